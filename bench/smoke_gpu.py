"""Quick GPU lowering check of every op and backend on small random data (python bench/smoke_gpu.py)."""

import numpy as np
import jax
import jax.numpy as jnp

import jlora

rng = np.random.default_rng(0)
for dtype in (jnp.bfloat16, jnp.float32):
    T, L, K, R = 300, 8, 512, 16
    info = jlora.LoRABatchInfo.build(rng.integers(-1, L, T), rng.integers(1, R + 1, L), rng.random(L), block_m=16)
    x = jnp.asarray(rng.standard_normal((T, K)), dtype)
    a = jnp.asarray(rng.standard_normal((L, 3 * R, K)) / 8, dtype)
    b = jnp.asarray(rng.standard_normal((L, 384, R)), dtype)
    base = jnp.asarray(rng.standard_normal((T, 384)), dtype)
    ref = jlora.lora_linear(x.astype(jnp.float32), base.astype(jnp.float32), a.astype(jnp.float32),
                            b.astype(jnp.float32), info, slice_sizes=(256, 64, 64), backend="reference")
    for be in ("ragged", "pallas"):
        out = jlora.lora_linear(x, base, a, b, info, slice_sizes=(256, 64, 64), backend=be).astype(jnp.float32)
        err = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
        print(jax.devices()[0].device_kind, dtype.__name__, be, f"rel err {err:.2e}")
