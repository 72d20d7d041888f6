"""XLA compile options of the model's jitted steps: which GPU steps run as CUDA graphs, which concurrently, and
bf16 rounded where the program rounds it.

XLA records a GPU step's kernels into CUDA graphs (command buffers). By default a graph runs them one after
another; with `xla_gpu_command_buffer_scheduling_mode=CONCURRENT` it gets only the data dependencies, so
independent kernels overlap: the LoRA shrink, which reads the same x as the base projection's GEMM, runs
beside that GEMM instead of after it. With the model's `base_first` (the base GEMMs scheduled before their
LoRA kernels where those run in XLA, so each GEMM keeps the graph's stream) decode gains at every batch size
but one, where it is level, so decode steps compile CONCURRENT and prefill keeps XLA's default (no gain there
and more temporary memory). The per-size table: docs/performance.md (bench/results/scheduling.json).

Steps that carry prompt tokens run without graphs (`xla_gpu_enable_command_buffer` empty): XLA records a graph
once and records it again, every command, whenever a buffer it uses has moved since its last launch. A decode
step, launched every step with the same buffers, keeps its graph; the prompt steps' many shapes (prompt and
block-table buckets) launch between one another and find their buffers moved, so a launch re-records a graph of
about 1,200 kernels. Launched one by one instead, its kernels' launch hides the device work: faster for a
prefix hit, slower for a short prompt alone whose graph had been kept (docs/performance.md, § The paged KV
cache).

Every step compiles with `xla_allow_excess_precision` off. On by default, it lets XLA on the GPU keep a fused
bf16 intermediate in f32 instead of rounding it where the program rounds, so the expand's forms gave different
bits on the GPU than on the CPU, and the model rounded less often than PEFT's bf16 ops do. Off, each form gives
the CPU's bits (bench/results/delta_rounding.txt), and the 8B decode step's time was level
(bench/results/xla_options.json). An XLA_FLAGS that sets any of these options wins over all of this.
"""

from __future__ import annotations

import functools
import os
import re

import jax

__all__ = ["concurrent_graphs", "step_compiler_options", "step_jit"]

_SCHEDULING = "xla_gpu_command_buffer_scheduling_mode"
_GRAPHS = "xla_gpu_enable_command_buffer"
_PRECISION = "xla_allow_excess_precision"


def _flag(name: str) -> str | None:
    """The value XLA_FLAGS gives option `name` ("true" for a bare `--name`), or None where it sets none."""
    match = re.search(rf"--{name}(?:=([\w,]*))?(?!\w)", os.environ.get("XLA_FLAGS", ""))
    return match and (match.group(1) if match.group(1) is not None else "true")


def concurrent_graphs(seq_len: int) -> bool:
    """Whether a model step of seq_len tokens per request runs CONCURRENT CUDA graphs: decode steps (seq_len 1)
    do, at every batch size (module doc), unless XLA_FLAGS sets the mode itself (then whether it sets CONCURRENT).
    The engine's steps then order the base GEMMs before their XLA LoRA kernels (`CallOptions.base_first`),
    which pays only under these graphs."""
    mode = _flag(_SCHEDULING)
    return seq_len == 1 if mode is None else mode == "CONCURRENT"


def step_compiler_options(seq_len: int) -> dict[str, str | bool]:
    """`jax.jit(..., compiler_options=...)` for a model step of seq_len tokens per request: bf16 rounded where
    the program rounds it, CONCURRENT graph scheduling for decode steps, no graphs for steps with prompt tokens
    (module doc); an option XLA_FLAGS sets applies as it is. The graph options are ignored off GPU."""
    options: dict[str, str | bool] = {} if _flag(_PRECISION) is not None else {_PRECISION: False}
    if _flag(_SCHEDULING) is None and concurrent_graphs(seq_len):
        options[_SCHEDULING] = "CONCURRENT"
    if _flag(_GRAPHS) is None and seq_len > 1:
        options[_GRAPHS] = ""
    return options


def step_jit(*, static_argnames: tuple[str, ...], donate_argnames: tuple[str, ...] = ()):
    """`jax.jit` for a model step `fn(model_def, params, inputs, ...)` (inputs: a `jlora.step.Call` or `Step`)
    that compiles each shape with `step_compiler_options(inputs.seq_len)`. `with_options(options)` is the
    step's `jax.jit` under given options, and `_cache_size()` counts the compilations under all of them."""

    def wrap(fn):
        jits = {}

        def with_options(options: dict[str, str]):
            key = tuple(options.items())
            if key not in jits:
                jits[key] = jax.jit(fn, static_argnames=static_argnames, donate_argnames=donate_argnames,
                                    compiler_options=options or None)
            return jits[key]

        @functools.wraps(fn)
        def step(model_def, params, inputs, *args, **kwargs):
            return with_options(step_compiler_options(inputs.seq_len))(model_def, params, inputs, *args, **kwargs)

        step.with_options = with_options
        step._cache_size = lambda: sum(j._cache_size() for j in jits.values())
        return step

    return wrap
