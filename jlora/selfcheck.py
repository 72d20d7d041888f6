"""A self-check of the multi-LoRA ops on random data: every backend against a float64 NumPy oracle."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from jlora.batch_info import LoRABatchInfo
from jlora.ops import lora_linear

__all__ = ["run_selfcheck"]


def _oracle(x, base, a, b, token_slot, ranks, scalings, slice_sizes):
    """float64 per-slot loop: base + scaling · (x @ A[:r]ᵀ) @ B[:, :r]ᵀ per slice."""
    out = base.astype(np.float64)
    rank = b.shape[2]
    for s in np.unique(token_slot[token_slot >= 0]):
        t, r, col = token_slot == s, ranks[s], 0
        for i, n in enumerate(slice_sizes):
            y = scalings[s] * x[t] @ a[s, i * rank : i * rank + r].T.astype(np.float64)
            out[t, col : col + n] += y @ b[s, col : col + n, :r].T
            col += n
    return out


def run_selfcheck(seed: int = 0) -> bool:
    """Runs `lora_linear` (q|k|v-shaped, mixed adapters and base-only tokens) on every backend; prints a
    table of relative error and time. Returns True when every backend is within tolerance."""
    rng = np.random.default_rng(seed)
    num_tokens, k, rank, num_slots, slice_sizes = 96, 256, 16, 4, (256, 64, 64)
    token_slot = rng.integers(-1, num_slots, num_tokens)
    ranks = rng.integers(1, rank + 1, num_slots)
    scalings = rng.uniform(0.5, 2.0, num_slots).astype(np.float32)
    x = rng.standard_normal((num_tokens, k)).astype(np.float32)
    a = (rng.standard_normal((num_slots, 3 * rank, k)) / np.sqrt(k)).astype(np.float32)
    b = rng.standard_normal((num_slots, sum(slice_sizes), rank)).astype(np.float32)
    base = rng.standard_normal((num_tokens, sum(slice_sizes))).astype(np.float32)
    info = LoRABatchInfo.build(token_slot, ranks, scalings, block_m=16)
    ref = _oracle(x, base, a, b, token_slot, ranks, scalings, slice_sizes)

    print(f"jlora self-check on {jax.devices()[0].device_kind} ({jax.default_backend()}): lora_linear q|k|v "
          f"{slice_sizes}, T={num_tokens}, {num_slots} adapters (ranks {ranks.tolist()}), "
          f"{int((token_slot < 0).sum())} base-only tokens")
    print(f"{'backend':10s} {'dtype':9s} {'rel err':>9s} {'tol':>6s} {'ms':>8s}  check")
    ok = True
    for backend in ("reference", "ragged", "gather", "pallas"):
        for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)):
            args = [jnp.asarray(v, dtype) for v in (x, base, a, b)]
            jax.block_until_ready(lora_linear(*args, info, slice_sizes=slice_sizes, backend=backend))  # compile
            t0 = time.perf_counter()
            out = jax.block_until_ready(lora_linear(*args, info, slice_sizes=slice_sizes, backend=backend))
            ms = (time.perf_counter() - t0) * 1e3
            out = np.asarray(out.astype(jnp.float32), np.float64)
            err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
            untouched = (out[token_slot < 0] == np.asarray(args[1].astype(jnp.float32))[token_slot < 0]).all()
            passed = bool(err < tol and untouched)
            ok &= passed
            print(f"{backend:10s} {jnp.dtype(dtype).name:9s} {err:9.2e} {tol:6.0e} {ms:8.2f}  "
                  f"{'ok' if passed else 'FAIL'}")
    return ok
