"""The gate|up LoRA expand in SiLU·mul's kernel instead of beside the gate|up GEMM, for #39.

In the shipped decode step on the Pallas LoRA kernels (batch 32 and above) gate|up's expand writes its delta beside
the gate|up GEMM, and XLA adds it in the SiLU·mul fusion. The expand's programs take SMs from the GEMM, which slows:
at batch 32 with one r=16 adapter 57.9 -> 62.2 µs beside a 17.1 µs expand, 5.3 µs a layer over the base step
(bench/results/model_profile_b32_r16.txt), the largest of the four projections' shares. Here one Pallas kernel
takes SiLU·mul's place: a program per column block of the intermediate width reads the GEMM's gate and up tiles of
every token, adds each token's delta (its slot's s @ Bᵀ, one `dot` per slot in use, rounded to bf16 as PEFT rounds
it) and writes silu(gate) · up. The expand then runs after the GEMM, on its critical path, but no longer beside it.
The shrink's split-K partials are summed by XLA beside the GEMM; a first form summed them in every program
(commit 2fdc90c; `silu_expand.json`, `silu_expand_more.json`, `silu_expand_profile.txt`).

What it keeps: each token's delta is the product of its own s row and its slot's B (a row of a `dot` depends on no
other row), selected by its slot, so a token's bits do not depend on the batch beside it, and a slot's non-finite B
reaches only its own tokens; the add, the rounding and SiLU·mul are the model's (`llama.MLP`).

Model: the 8B-shaped decode step (`bench/model.py`'s random model, each batch as `bench/model.py` runs it, 1024
positions a request, query at 512; the adapters' slots shuffled over the rows), shipped and fused at each column
block, timed in alternating rounds. JSON: silu_expand_summed.json (`--json` names another).

  python bench/studies/silu_expand.py --check               # CPU: the fused MLP against the shipped one
  python bench/studies/silu_expand.py [--cases 32x16x1,...] [--block-n 32,64] [--out DIR]  # GPU
  python bench/studies/silu_expand.py --profile --cases 32x16x1 --block-n 32  # GPU: layer 16's kernels
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import os
import sys
from unittest import mock

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # the product benchmarks in bench/
from common import row_recorder, trace_events  # noqa: E402

from jlora.batch_info import LoRABatchInfo  # noqa: E402
from jlora.models import llama  # noqa: E402
from jlora.ops import resolve_backend  # noqa: E402
from jlora.pallas.common import dot_precision  # noqa: E402
from jlora.pallas.config import delta_expand  # noqa: E402
from jlora.pallas.shrink import shrink_partials  # noqa: E402

SHIPPED = llama.MLP.__call__


def slots_in_use(info: LoRABatchInfo) -> tuple[jax.Array, jax.Array, jax.Array]:
    """([S] the distinct slots the batch's segments use, ascending, then padding; [S] their ranks; [1] their
    count). A slot's segments are consecutive, so its first segment is the one whose slot differs from the one
    before."""
    before = jnp.concatenate([jnp.full((1,), -2, jnp.int32), info.seg_slot[:-1]])
    first = (info.seg_len > 0) & (info.seg_slot != before)
    slots = jnp.minimum(jnp.sort(jnp.where(first, info.seg_slot, info.num_slots)), info.num_slots - 1)
    return slots, info.ranks[slots], jnp.sum(first, dtype=jnp.int32)[None]


def finished_shrink(partials: jax.Array, info: LoRABatchInfo, dtype) -> jax.Array:
    """[T, 2R] in `dtype`: the shrink's split-K partials [P, T, 2R] summed in the expand kernel's order, each
    half's columns past the token's rank zeroed (all of a slot -1 token's row, which no program wrote)."""
    s = partials[0]
    for p in range(1, partials.shape[0]):
        s = s + partials[p]
    rank = partials.shape[2] // 2
    own = jnp.where(info.token_slot >= 0, info.ranks[jnp.maximum(info.token_slot, 0)], 0)
    return jnp.where(jnp.arange(2 * rank)[None, :] % rank < own[:, None], s, 0).astype(dtype)


def _kernel(slots_ref, slot_ranks_ref, count_ref, token_slot_ref, s_ref, b_ref, base_ref, o_ref, *, inter: int,
            rank: int, block_n: int, precision):
    """Program j: columns j·block_n ... of silu(gate + δgate) · (up + δup) for every token, where δ of a token is
    its slot's s @ Bᵀ (zero, as -0.0, for slot -1 tokens)."""
    j = pl.program_id(0)
    cols = pl.ds(pl.multiple_of(j * block_n, block_n), block_n)
    up_cols = pl.ds(pl.multiple_of(inter + j * block_n, block_n), block_n)
    bases = base_ref[:, cols], base_ref[:, up_cols]  # [T, BN] each
    halves = s_ref[:, pl.ds(0, rank)], s_ref[:, pl.ds(rank, rank)]  # [T, R] each, zero past each token's rank
    token_slot = token_slot_ref[...]  # [T]
    col = jnp.arange(rank)[None, :]  # [1, R]

    def one_slot(i, deltas):
        slot = slots_ref[i]
        in_rank = col // 16 * 16 < slot_ranks_ref[i]  # B's 16-column chunks up to the rank, as the expand reads them
        mine = (token_slot == slot)[:, None]
        return tuple(
            jnp.where(mine, pltriton.dot(s, pltriton.load(b_ref.at[slot, c, :], mask=in_rank, other=0),
                                         trans_b=True, precision=precision), d)
            for d, s, c in zip(deltas, halves, (cols, up_cols)))

    none = jnp.full((token_slot.shape[0], block_n), -0.0, jnp.float32)  # slot -1 rows keep the base's bits
    deltas = jax.lax.fori_loop(0, count_ref[0], one_slot, (none, none))
    dtype = base_ref.dtype
    gate, up = ((base.astype(jnp.float32) + d.astype(dtype).astype(jnp.float32)).astype(dtype).astype(jnp.float32)
                for base, d in zip(bases, deltas))
    o_ref[:, cols] = (jax.nn.silu(gate) * up).astype(o_ref.dtype)


def silu_expand(partials: jax.Array, b: jax.Array, info: LoRABatchInfo, base: jax.Array, *, block_n: int,
                num_warps: int = 4, num_stages: int = 3) -> jax.Array:
    """[T, I] silu(gate) · up, each of gate and up its base [T, I] half of `base` [T, 2I] plus the expand of
    the shrink's partials [P, T, 2R] against B [L, 2I, R]; in base.dtype. The partials are summed by XLA (beside
    the GEMM, as the shrink runs), the slots in use listed once a step (XLA merges the layers' copies)."""
    inter, rank = base.shape[1] // 2, b.shape[2]
    if inter % block_n:
        raise ValueError(f"block_n={block_n} must divide the intermediate width {inter}")
    kernel = functools.partial(_kernel, inter=inter, rank=rank, block_n=block_n, precision=dot_precision(b.dtype))
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((base.shape[0], inter), base.dtype),
        grid=(inter // block_n,),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=jax.default_backend() != "gpu",
        name=f"jlora_silu_expand_{rank}x{inter}",
    )(*slots_in_use(info), info.token_slot, finished_shrink(partials, info, b.dtype), b, base)


def fused_mlp(self, x, ctx, group, *, block_n: int):
    """`llama.MLP.__call__` with gate|up's expand in SiLU·mul's kernel where the shipped step writes its delta
    apart on the Pallas kernels (and no DoRA scale or LoRA bias, no tensor parallelism); as shipped elsewhere."""
    lora, options = ctx.lora, ctx.options
    if (lora is None or "gate_up" not in group.a or options.reduce_axis is not None or group.scale is not None
            or group.shift is not None
            or resolve_backend(options.backend, x.shape[0], group.b["gate_up"].shape[2]) != "pallas"
            or not delta_expand(x.shape[0], True)):
        return SHIPPED(self, x, ctx, group)
    partials = shrink_partials(x, group.a["gate_up"], lora.info, num_slices=2)
    h = silu_expand(partials, group.b["gate_up"], lora.info, self.gate_up(x), block_n=block_n)
    return llama._with_lora(self.down, h, ctx, group, "down", (self.config.hidden_size,), row_parallel=True)


def patched(block_n: int):
    @contextlib.contextmanager
    def patch():
        with mock.patch.object(llama.MLP, "__call__", functools.partialmethod(fused_mlp, block_n=block_n)):
            yield
    return patch


def check() -> None:
    """On the CPU (interpret mode): the fused MLP's output against the shipped one, bit for bit, over batches of
    mixed slots (slot -1 rows, several segments of one slot, ranks below the kernel rank)."""
    from jlora.ops import lora_linear
    tokens, hidden, inter, slots, rank = 64, 64, 256, 5, 16
    ranks = jnp.array([16, 8, 16, 4, 12], jnp.int32)
    k = jax.random.split(jax.random.PRNGKey(0), 5)
    x = jax.random.normal(k[0], (tokens, hidden), jnp.bfloat16)
    a = (jax.random.normal(k[1], (slots, 2 * rank, hidden)) * 0.1).astype(jnp.bfloat16)
    b = (jax.random.normal(k[2], (slots, 2 * inter, rank)) * 0.1).astype(jnp.bfloat16)
    w = (jax.random.normal(k[3], (hidden, 2 * inter)) * 0.1).astype(jnp.bfloat16)
    for trial in range(4):
        token_slot = jax.random.randint(jax.random.fold_in(k[4], trial), (tokens,), -1, slots)
        if trial == 1:
            token_slot = token_slot.at[:40].set(2)  # one slot over several segments
        info = LoRABatchInfo.build(token_slot, ranks, jnp.ones(slots), block_m=16)
        base = x @ w
        gate_up = lora_linear(x, base, a, b, info, slice_sizes=(inter, inter), backend="pallas", defer_add=True)
        want = (jax.nn.silu(gate_up[:, :inter].astype(jnp.float32)) * gate_up[:, inter:].astype(jnp.float32)
                ).astype(x.dtype)
        got = silu_expand(shrink_partials(x, a, info, num_slices=2), b, info, base, block_n=64)
        equal = float(jnp.mean(got == want))
        print(f"trial {trial}: {int(jnp.sum(token_slot >= 0))} LoRA tokens, equal fraction {equal:.4f}, "
              f"max |diff| {float(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32)).max()):.3g}")
        assert equal == 1.0, "the fused kernel's output differs from the shipped MLP's"


def profile_case(case, config, block_n: int) -> None:
    """Layer 16's kernels of one traced step, shipped and fused (`bench/model.py`'s layer timeline)."""
    from model import layer_timeline  # noqa: E402

    from jlora.runner import forward
    cache = case.cache
    for name, (model_def, patch) in {"shipped": (case.model_def, None),
                                     f"fused, block_n {block_n}": (copy.copy(case.model_def), patched(block_n))}.items():
        with (patch or contextlib.nullcontext)():  # the variant's step traces here
            _, cache = forward(model_def, case.params, case.call, cache, case.lora, case.options)
        out = {}

        def run():
            out["logits"], out["cache"] = forward(model_def, case.params, case.call, cache, case.lora, case.options)
            return out["logits"]

        events = trace_events(run)
        cache = out["cache"]
        print(f"PROFILE decode B={case.batch}, {case.adapters} r={case.rank}, {name}", flush=True)
        layer_timeline(events, config.num_layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="CPU: the fused kernel against the shipped MLP")
    parser.add_argument("--cases", default="32x16x1,32x16x8,32x16x32,64x16x32,32x64x1,32x64x32,64x64x32",
                        help="decode batch x rank x adapters")
    parser.add_argument("--block-n", default="32,64", help="the fused kernel's column blocks, comma-separated")
    parser.add_argument("--profile", action="store_true", help="print each case's layer timeline, shipped and fused "
                        "at the first --block-n, instead of timing it")
    parser.add_argument("--json", default="silu_expand_summed.json")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    if args.check:
        check()
        return
    from model import llama3_8b, random_model  # noqa: E402
    from split_attention import lora_decodes, time_lora_decodes  # noqa: E402
    blocks = [int(n) for n in args.block_n.split(",")]
    if args.profile:
        config = llama3_8b(32)
        model_def, params = random_model(config)
        for case in lora_decodes(config, model_def, params, args.cases):
            profile_case(case, config, blocks[0])
            del case
        return
    _, record = row_recorder(args.out, args.json)
    time_lora_decodes(args.cases, {"shipped": None, **{f"fused, block_n {n}": patched(n) for n in blocks}},
                      record=record)


if __name__ == "__main__":
    main()
