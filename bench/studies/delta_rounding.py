"""Where each form of the LoRA expand rounds its delta, in bf16 bits, for #39 and docs/kernels.md.

PEFT rounds its LoRA output to bf16 before adding it to the base layer's. jlora's gather backend and the
Pallas expand writing its delta alone (`defer_add` at T <= 256) round so; the reference and ragged forms and
the Pallas expand in place add the f32 delta and round once. This prints, for seeded cases (decode and prefill
sizes, with and without the column affine), the fraction of each form's bf16 outputs of `jlora.lora_linear`
that differ from the in-place Pallas form's. Run it under `XLA_FLAGS=--xla_allow_excess_precision=false` too:
on the GPU XLA may otherwise keep a fusion's bf16 roundings in f32.

  python bench/studies/delta_rounding.py  # CPU or GPU
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jlora
from jlora import LoRABatchInfo

BACKENDS = ("reference", "ragged", "gather", "pallas")
SLOTS, K, R = 4, 64, 16


def case(seed: int, tokens: int, slice_sizes: tuple[int, ...], affine: bool) -> dict[str, float]:
    """{"backend/defer_add": fraction of outputs unlike the in-place Pallas form's} of one seeded case."""
    rng = np.random.default_rng(seed)
    n = sum(slice_sizes)
    slots = rng.integers(-1, SLOTS, tokens)
    info = LoRABatchInfo.build(slots, np.array([16, 5, 1, 12]), rng.uniform(0.5, 2.0, SLOTS), block_m=16)
    bf16 = lambda shape, scale=1.0: jnp.asarray(scale * rng.standard_normal(shape), jnp.bfloat16)
    x, a, b, base = bf16((tokens, K)), bf16((SLOTS, len(slice_sizes) * R, K), K ** -0.5), \
        bf16((SLOTS, n, R), R ** -0.5), bf16((tokens, n), 0.5)
    kw = dict(scale=jnp.asarray(rng.uniform(0.5, 1.5, (SLOTS, n)), jnp.bfloat16), shift=bf16((SLOTS, n))) if affine else {}
    outs = {f"{backend}/{int(defer)}": np.asarray(jlora.lora_linear(
        x, base, a, b, info, slice_sizes=slice_sizes, backend=backend, defer_add=defer, **kw).astype(jnp.float32))
        for backend in BACKENDS for defer in (False, True)}
    return {form: round(float((out != outs["pallas/0"]).mean()), 4) for form, out in outs.items()}


def main() -> None:
    print(f"# {jax.devices()[0].device_kind}: fraction of bf16 outputs unlike the in-place Pallas form's "
          f"(backend/defer_add)", flush=True)
    for seed, (tokens, slice_sizes, affine) in enumerate([(29, (48, 16), False), (300, (17, 33, 16), True),
                                                          (257, (32,), False), (1, (5, 40), True)]):
        print(f"T={tokens} slices={slice_sizes} affine={affine}: {case(seed, tokens, slice_sizes, affine)}", flush=True)


if __name__ == "__main__":
    main()
