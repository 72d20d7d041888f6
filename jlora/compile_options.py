"""XLA compile options of the model's jitted steps: which GPU steps run their CUDA graphs concurrently.

XLA records a GPU step's kernels into CUDA graphs (command buffers). By default a graph runs them one after
another; with `xla_gpu_command_buffer_scheduling_mode=CONCURRENT` it gets only the data dependencies, so
independent kernels overlap: the LoRA shrink, which reads the same x as the base projection's GEMM, runs
beside that GEMM instead of after it. Whether that pays depends on the step's size. Measured on an H200
(bench/scheduling.py: one process compiles the 8B-shaped decode step both ways and times them in 4
alternating rounds), decode ms per step with one r=16 adapter per request (up to 32 distinct):

| rows | 1 | 2 | 4 | 8 | 16 | 32 | 64 |
|---|---|---|---|---|---|---|---|
| default | 5.56 | 5.06 | 5.24 | 5.43 | 5.79 | 6.75 | 8.57 |
| concurrent | 5.08 | 4.69 | 5.54 | 5.76 | 5.34 | 6.46 | 8.07 |

(bench/results/scheduling.json). An earlier run read the same signs but for 16 rows (5.87 -> 6.00 ms).
The base model's step moved by -2.1 % to +0.3 %. At 4 and 8 rows the overlapped LoRA kernels slow the
GEMMs beside them more than they save (a profile at 8 rows: the gate|up GEMM 56 -> 70 µs, and 0.3 ms per step
of gaps at the graph's joins), so those steps keep XLA's default, as prefill does (no gain at 2048 tokens,
and 16 % more temporary memory). An XLA_FLAGS that sets the mode itself wins over all of this.
"""

from __future__ import annotations

import functools
import os

import jax

__all__ = ["concurrent_graphs", "step_compiler_options", "step_jit"]

_SCHEDULING = "xla_gpu_command_buffer_scheduling_mode"


def concurrent_graphs(num_rows: int, seq_len: int) -> bool:
    """Whether a model step of num_rows requests x seq_len tokens each runs CONCURRENT CUDA graphs under
    `step_compiler_options`: decode steps (seq_len 1) do, unless XLA_FLAGS sets the mode itself (then whether
    it sets CONCURRENT). The engine's steps then order each base projection before its LoRA kernels
    (`Transformer.__call__`'s `base_first`), which pays only under these graphs."""
    flags = os.environ.get("XLA_FLAGS", "")
    if _SCHEDULING in flags:
        return f"{_SCHEDULING}=CONCURRENT" in flags
    return seq_len == 1


def step_compiler_options(num_rows: int, seq_len: int) -> dict[str, str]:
    """`jax.jit(..., compiler_options=...)` for a model step of num_rows requests x seq_len tokens each: CONCURRENT
    graph scheduling for decode steps, else XLA's default (module doc); nothing when XLA_FLAGS sets the mode.
    Ignored off GPU."""
    if _SCHEDULING in os.environ.get("XLA_FLAGS", "") or not concurrent_graphs(num_rows, seq_len):
        return {}
    return {_SCHEDULING: "CONCURRENT"}


def step_jit(*, static_argnames: tuple[str, ...], donate_argnames: tuple[str, ...] = ()):
    """`jax.jit` for a model step `fn(model_def, params, tokens [B, S], ...)` that compiles each shape with
    `step_compiler_options(B, S)`. `with_options(options)` is the step's `jax.jit` under given options, and
    `_cache_size()` counts the compilations under all of them."""

    def wrap(fn):
        jits = {}

        def with_options(options: dict[str, str]):
            key = tuple(options.items())
            if key not in jits:
                jits[key] = jax.jit(fn, static_argnames=static_argnames, donate_argnames=donate_argnames,
                                    compiler_options=options or None)
            return jits[key]

        @functools.wraps(fn)
        def step(model_def, params, tokens, *args, **kwargs):
            return with_options(step_compiler_options(*tokens.shape))(model_def, params, tokens, *args, **kwargs)

        step.with_options = with_options
        step._cache_size = lambda: sum(j._cache_size() for j in jits.values())
        return step

    return wrap
