"""What bounds the decode down shrink (GPU only): T=64 tokens, 8 adapters of rank 16, K=14336.

Times, the way bench/kernels.py does (device kernel time, 32 calls), jlora's kernel and variants of a study
kernel with its structure (segment metadata -> token rows -> x and A in 28 K splits of 4 blocks of 128 columns,
3 pipeline stages, one warp), each leaving a stage out:
  study     the whole work, as jlora's kernel does it (the check that the study kernel is comparable)
  l2        every split reads the same K range: x and A come from L2, the DRAM traffic is gone
  no-meta   no metadata or token index loads: segment i takes rows 16·(i mod 4).. and slot i
  no-loads  no-meta, and x and A are constants: no memory read, only the partials written
  empty     every program exits at once: the launch of the grid alone
The study variants skip the split-K sum; jlora's row gives both its kernel and XLA's sum of the 28 partials.

Then what finishing the split-K sum inside one thread-block cluster would cost (Mosaic GPU, distributed shared
memory): 36 clusters of C blocks, each block holding a [256] f32 partial in shared memory; after a cluster
barrier block 0 reads its peers' partials, adds them and writes the sum (`exchange`), against the same grid where
every block writes its own partial (`alone`). (Mosaic GPU's interpret mode has no `cluster_ref`, so a kernel
built on this could not be tested on CPU.)

  python bench/studies/shrink_limits.py
"""

from __future__ import annotations

import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import triton as pltriton

import jlora
from jlora.pallas.common import segment_meta
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # the product benchmarks in bench/
from kernels import STACKS, device_time_per_call, make_info, make_inputs  # noqa: E402

SPLITS, BLOCK_K, STEPS = 28, 128, 4  # jlora's decode tiles for K = 14336 = 28 x 4 x 128
VARIANTS = {"study": (True, True, False), "l2": (True, True, True), "no-meta": (False, True, False),
            "no-loads": (False, False, False)}  # name: (metadata, x and A loads, one K range for all splits)


def _kernel(idx_ref, start_ref, len_ref, slot_ref, x_ref, a_ref, o_ref, *, meta, loads, same_k, work):
    if not work:
        return
    seg, split = pl.program_id(0), pl.program_id(1)
    if meta:
        seg_len, slot, rows = segment_meta(idx_ref, start_ref, len_ref, slot_ref, seg, 16)
    else:  # the first 8 segments are used, as in the batch
        seg_len, slot, rows = 8 - jnp.minimum(seg // 8, 1) * 8, seg % 8, seg % 4 * 16 + jnp.arange(16)

    @pl.when(seg_len > 0)
    def _():
        r = pl.ds(0, a_ref.shape[1])

        def step(j, acc):
            k = pl.ds(pl.multiple_of((0 if same_k else split * STEPS * BLOCK_K) + j * BLOCK_K, BLOCK_K), BLOCK_K)
            x = x_ref[rows, k] if loads else jnp.full((16, BLOCK_K), 0.5, x_ref.dtype)
            a = a_ref[slot, r, k] if loads else jnp.full((a_ref.shape[1], BLOCK_K), 0.25, a_ref.dtype)
            return acc + pltriton.dot(x, a, trans_b=True)

        o_ref[split, rows, r] = jax.lax.fori_loop(0, STEPS, step, jnp.zeros((16, a_ref.shape[1]), jnp.float32))


def _shrink(x, a, info, meta=True, loads=True, same_k=False, work=True):
    return pl.pallas_call(
        functools.partial(_kernel, meta=meta, loads=loads, same_k=same_k, work=work),
        out_shape=jax.ShapeDtypeStruct((SPLITS, x.shape[0], a.shape[1]), jnp.float32),
        grid=(info.num_segments, SPLITS),
        compiler_params=pltriton.CompilerParams(num_warps=1, num_stages=3),
        name="study_shrink",
    )(info.sorted_idx, info.seg_start, info.seg_len, info.seg_slot, x, a)


def main() -> None:
    print(f"# {jax.devices()[0].device_kind}: down shrink T=64, 8 adapters, r=16; device µs per call by kernel "
          "(32 calls)")
    _, _, slots, (xs, a_stacks), _ = make_inputs("down_shrink", 64, 8, 16, np.random.default_rng(0))
    info = make_info(slots, 16, 16)
    assert xs[0].shape[1] == SPLITS * STEPS * BLOCK_K
    jlora_fn = jax.jit(lambda info, xs, stacks: [jlora.lora_shrink(x, stacks[i % STACKS], info, backend="pallas")
                                                 for i, x in enumerate(xs)])
    runs = [("jlora", jlora_fn)] + [
        (name, jax.jit(lambda info, xs, stacks, kw=kw: [_shrink(x, stacks[i % STACKS], info, **kw)
                                                         for i, x in enumerate(xs)]))
        for name, kw in [*((n, dict(meta=m, loads=ld, same_k=s)) for n, (m, ld, s) in VARIANTS.items()),
                         ("empty", dict(work=False))]]
    for name, fn in runs:
        _, kernels = device_time_per_call(fn, info, xs, a_stacks)
        parts = ", ".join(f"{n} {sum(d) / len(xs):.2f}" for n, d in sorted(kernels.items()))
        print(f"{name:9s} {parts}", flush=True)
    cluster_finish()


def _cluster_sum(clusters: int, size: int, exchange: bool):
    """[clusters, size, W] partials -> [clusters, W] sums through DSMEM (exchange), or each block's partial
    written as it is ([clusters * size, W])."""
    width = 256

    def body(in_gmem, out_gmem, smem, barrier):
        s, c = jax.lax.axis_index("s"), jax.lax.axis_index("c")
        if not exchange:
            out_gmem[s * size + c, :] = in_gmem[s, c, :]
            return
        smem[...] = in_gmem[s, c, :]
        plgpu.barrier_arrive(barrier.at[0])
        plgpu.barrier_wait(barrier.at[0])

        @pl.when(c == 0)
        def _():
            acc = smem[...]
            for peer in range(1, size):
                acc = acc + plgpu.cluster_ref(smem, {"c": peer})[...]
            out_gmem[s, :] = acc

        plgpu.barrier_arrive(barrier.at[1])  # the peers keep their shared memory until block 0 has read it
        plgpu.barrier_wait(barrier.at[1])

    rows = clusters if exchange else clusters * size
    return plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((rows, width), jnp.float32), grid=(clusters,), grid_names=("s",),
        cluster=(size,), cluster_names=("c",),
        scratch_types=dict(smem=plgpu.SMEM((width,), jnp.float32),
                           barrier=plgpu.ClusterBarrier(collective_axes=("c",), num_barriers=2)))


def cluster_finish(clusters: int = 36) -> None:
    """Device µs per call (32 calls) of `_cluster_sum` with and without the exchange, per cluster size."""
    for size in (2, 4, 8, 16):
        xs = [jax.random.normal(jax.random.key(i), (clusters, size, 256), jnp.float32) for i in range(32)]
        times = {}
        for exchange in (True, False):
            kernel = _cluster_sum(clusters, size, exchange)
            if exchange:
                np.testing.assert_allclose(kernel(xs[0]), xs[0].sum(1), rtol=1e-5, atol=1e-5)
            fn = jax.jit(lambda xs, kernel=kernel: [kernel(x) for x in xs])
            times[exchange] = device_time_per_call(fn, xs)[0] * 1e6
        print(f"cluster of {size:2d}: exchange {times[True]:.2f} µs, alone {times[False]:.2f} µs per call",
              flush=True)


if __name__ == "__main__":
    main()
