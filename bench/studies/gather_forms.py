"""Forms of the gather backend's expand, timed side by side (the study behind `reference.expand_gather`).

"gather" is the library's form (B[slot, slice] as one gather, each slice's delta rows masked); "gather_before"
the one it replaced (B sliced before the slot gather, the mask on the products); "gather_add" the mask on the
summed delta's rows at the add instead; "gather_unmasked" no row mask at all (slot -1 rows would read slot 0's
B, NaN there included), to show what the mask costs; "gather_one" one reduction over all of a fused group's
columns (each column reading its slice's columns of s) instead of one per slice: fewer kernels per layer;
"gather_inline" each delta as R products added one after another, no reduction op, so that XLA may fuse the
expand into the elementwise kernel after it (the residual add, SiLU·mul, RoPE) instead of a kernel of its own.
Device µs per call of bench/kernels.py's 32-call functions on the decode rows where they differ, then the 8B
decode step of each of `--cases` ('BxRxA', each batch as bench/model.py runs it) with each form as the gather
backend's expand (the rest of the step as shipped) in alternating rounds.

  python bench/studies/gather_forms.py [--model-only] [--forms gather,gather_one] [--cases 1x16x1,8x64x8]
  # bash bench/run_gpu.sh gather
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # the product benchmarks in bench/
import kernels as kb  # noqa: E402
from split_attention import time_lora_decodes  # noqa: E402

import jlora.models.llama as llama  # noqa: E402
from jlora import ops, reference  # noqa: E402
from jlora.runner import row_tile  # noqa: E402

_F32 = jnp.float32
SHIPPED = llama._with_lora


def expand_form(one_gather: bool, mask: str | None):
    """An expand_gather of another form: B[slot, slice] as one gather or sliced first; s masked by rank and slot,
    and besides that the mask on the products ("products"), on the rows of the concatenated delta at the add
    ("add") or nowhere (None)."""
    def expand(s, b, info, base, *, slice_sizes, scale=None, shift=None):
        assert scale is None and shift is None, "this form takes no column affine"
        rank = b.shape[2]
        keep = reference.column_scale(info, rank, len(slice_sizes), scaled=False) != 0
        used = (info.token_slot >= 0)[:, None]
        s = jnp.where(keep, s.astype(_F32), 0.0)
        slot = jnp.maximum(info.token_slot, 0)
        deltas, start = [], 0
        for i, n in enumerate(slice_sizes):
            cols = slice(i * rank, (i + 1) * rank)
            rows = b[slot, start:start + n, :] if one_gather else b[:, start:start + n, :][slot]
            prod = s[:, None, cols] * rows.astype(_F32)
            d = jnp.sum(jnp.where(keep[:, None, cols], prod, 0.0) if mask == "products" else prod, axis=-1)
            deltas.append(d.astype(base.dtype))
            start += n
        delta = jnp.concatenate(deltas, axis=1)
        return (base.astype(_F32) + (jnp.where(used, delta, 0) if mask == "add" else delta)).astype(base.dtype)
    return expand


def expand_one(s, b, info, base, *, slice_sizes, scale=None, shift=None):
    """expand_gather as one reduction over the group's N columns: column n of slice i reads s's columns
    i·R .. (i+1)·R, broadcast per slice and concatenated inside the fusion."""
    rank, tokens = b.shape[2], s.shape[0]
    keep = reference.column_scale(info, rank, len(slice_sizes), scaled=False) != 0
    s = jnp.where(keep, s.astype(_F32), 0.0)
    slot = jnp.maximum(info.token_slot, 0)
    s_cols = jnp.concatenate([jnp.broadcast_to(s[:, None, i * rank:(i + 1) * rank], (tokens, n, rank))
                              for i, n in enumerate(slice_sizes)], axis=1)  # [T, N, R]
    b_rows = jnp.where(keep[:, None, :rank], b[slot].astype(_F32), 0.0)
    delta = reference.own_rows(jnp.sum(s_cols * b_rows, axis=-1), info).astype(base.dtype)
    return reference.add_deltas(base, [delta], info, scale, shift)


def expand_inline(s, b, info, base, *, slice_sizes, scale=None, shift=None):
    """expand_gather with each slice's delta an unrolled sum of R elementwise products, s[:, j] · B[slot, n, j]:
    a loop fusion, which XLA may merge into the delta's consumer, where a reduction is a kernel of its own."""
    rank = b.shape[2]
    keep = reference.column_scale(info, rank, len(slice_sizes), scaled=False) != 0
    s = jnp.where(keep, s.astype(_F32), 0.0)
    slot, used = jnp.maximum(info.token_slot, 0), (info.token_slot >= 0)[:, None]
    deltas, start = [], 0
    for i, n in enumerate(slice_sizes):
        rows = b[slot, start:start + n, :]  # [T, n, R]
        delta = 0.0
        for j in range(rank):  # B's columns past a slot's rank selected out (NaN there stays out)
            delta = delta + s[:, i * rank + j, None] * jnp.where(keep[:, j, None], rows[:, :, j].astype(_F32), 0.0)
        deltas.append(jnp.where(used, delta, 0.0).astype(base.dtype))
        start += n
    return reference.add_deltas(base, deltas, info, scale, shift)


FORMS = {"gather": reference.expand_gather, "gather_before": expand_form(False, "products"),
         "gather_add": expand_form(True, "add"),
         "gather_unmasked": expand_form(True, None), "gather_one": expand_one,
         "gather_inline": expand_inline}
# Each form runs as a backend of its own name (a static argument of the jitted ops and model, so no trace of
# one form is reused for another), with the gather shrink and, in the model, the gather backend's attention.
for _name, _impl in list(FORMS.items())[1:]:
    ops._JNP_EXPAND[_name] = _impl
    ops._JNP_SHRINK[_name] = reference.shrink_gather
    ops.BACKENDS = (*ops.BACKENDS, _name)
_pallas_kernels = llama._pallas_kernels
llama._pallas_kernels = lambda backend: _pallas_kernels("gather" if backend.startswith("gather") else backend)


# (op, T, adapters, rank): the decode rows where the forms differ, and the model's decode projections.
ROWS = [("qkv_expand", 16, 8, 16), ("qkv_expand", 64, 8, 16), ("qkv_expand", 16, 8, 64), ("gate_up_expand", 16, 8, 16),
        ("gate_up_expand", 64, 8, 16), ("gate_up_expand", 16, 8, 64), ("expand", 64, 8, 16), ("qkv_linear", 64, 8, 16),
        ("qkv_linear", 16, 8, 64), ("gate_up_linear", 64, 8, 16),
        *((op, 32, 32, 16) for op in ("qkv_linear", "o_linear", "gate_up_linear", "down_linear"))]


def kernels() -> None:
    """Device µs per call of each row under each form and under pallas."""
    rng = np.random.default_rng(0)
    for op, tokens, adapters, rank in ROWS:
        kind, slices, slots, inputs, _ = kb.make_inputs(op, tokens, adapters, rank, rng)
        info = kb.make_info(slots, rank, row_tile(tokens))
        line = []
        for name in (*FORMS, "pallas"):  # the public ops under each backend
            sec, _ = kb.device_time_per_call(kb.make_fn(kind, slices, name), info, *inputs)
            line.append(f"{name} {sec * 1e6:.2f} µs")
        print(f"{op} T={tokens} n={adapters} r={rank}: " + ", ".join(line), flush=True)
        del inputs


def with_form(expand_fn):
    """`llama._with_lora` with `expand_fn` as the gather backend's expand (the shrink, the barrier and the
    other backends as shipped): a patch under which a model step traces (`common.time_variants`)."""
    def with_lora(proj, x, ctx, group, name, slice_sizes, row_parallel=False):
        lora, options = ctx.lora, ctx.options
        if (lora is None or name not in group.a or options.reduce_axis is not None
                or ops.resolve_backend(options.backend, x.shape[0], group.b[name].shape[2]) != "gather"):
            return SHIPPED(proj, x, ctx, group, name, slice_sizes, row_parallel)
        out = proj(x)
        if options.base_first and llama.base_first_projection(name, proj.out_in and x.shape[0] == 1):
            out, x = jax.lax.optimization_barrier((out, x))
        s = ops.lora_shrink(x, group.a[name], lora.info, num_slices=len(slice_sizes), backend="gather")
        scale = None if group.scale is None else group.scale[name]
        shift = None if group.shift is None else group.shift[name]
        return expand_fn(s, group.b[name], lora.info, out, slice_sizes=slice_sizes, scale=scale, shift=shift)

    @contextlib.contextmanager
    def patch():
        with mock.patch.object(llama, "_with_lora", with_lora):
            yield
    return patch


def model(forms, cases: str) -> None:
    """The 8B decode step of each of `cases` ('BxRxA', each batch as `bench/model.py` runs it) with each of `forms`
    as the gather backend's expand, in alternating rounds; the first form is the reference for the logits."""
    time_lora_decodes(cases, {form: with_form(FORMS[form]) for form in forms})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-only", action="store_true", help="the decode steps only, not the kernel rows")
    parser.add_argument("--forms", default=",".join(FORMS), help=f"the forms the decode steps compare, of {list(FORMS)}")
    parser.add_argument("--cases", default="32x16x32,32x16x1,1x16x1", help="the decode steps: batch x rank x adapters")
    args = parser.parse_args()
    if not args.model_only:
        kernels()
    model(args.forms.split(","), args.cases)
