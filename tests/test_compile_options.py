"""Which model steps compile with CONCURRENT CUDA-graph scheduling and which without graphs, that every step
compiles without XLA's excess precision, and the jit wrapper that applies it."""

import jax.numpy as jnp
import numpy as np
import pytest

from jlora.compile_options import concurrent_graphs, step_compiler_options, step_jit
from jlora.models.llama import Batch
from jlora.step import Call

EXACT = {"xla_allow_excess_precision": False}
CONCURRENT = {**EXACT, "xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}
NO_GRAPHS = {**EXACT, "xla_gpu_enable_command_buffer": ""}


@pytest.mark.parametrize(("seq", "concurrent"), [(1, True), (16, False), (128, False)])
def test_decode_steps_run_concurrent_graphs_and_prompt_steps_none(monkeypatch, seq, concurrent):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    assert step_compiler_options(seq) == (CONCURRENT if concurrent else NO_GRAPHS)
    assert concurrent_graphs(seq) == concurrent


@pytest.mark.parametrize(("mode", "concurrent"), [("LHS", False), ("CONCURRENT", True)])
def test_xla_flags_that_set_the_mode_win(monkeypatch, mode, concurrent):
    monkeypatch.setenv("XLA_FLAGS", f"--xla_gpu_command_buffer_scheduling_mode={mode}")
    assert step_compiler_options(1) == EXACT
    assert step_compiler_options(16) == NO_GRAPHS
    assert concurrent_graphs(1) == concurrent
    assert concurrent_graphs(16) == concurrent


@pytest.mark.parametrize("graphs", ["", "FUSION,CUBLAS"])
def test_xla_flags_that_set_the_graphs_win(monkeypatch, graphs):
    monkeypatch.setenv("XLA_FLAGS", f"--xla_dump_to=/tmp/x --xla_gpu_enable_command_buffer={graphs} --xla_foo=1")
    assert step_compiler_options(16) == EXACT
    assert step_compiler_options(1) == CONCURRENT


@pytest.mark.parametrize("flag", ["--xla_allow_excess_precision=true", "--xla_allow_excess_precision=false",
                                  "--xla_allow_excess_precision"])
def test_xla_flags_that_set_excess_precision_win(monkeypatch, flag):
    monkeypatch.setenv("XLA_FLAGS", f"--xla_dump_to=/tmp/x {flag}")
    assert step_compiler_options(1) == {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}
    assert step_compiler_options(16) == {"xla_gpu_enable_command_buffer": ""}


def test_step_jit_compiles_each_shape_under_its_options(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)

    @step_jit(static_argnames=("model_def",))
    def step(model_def, params, call):
        return call.batch.groups[0].tokens * params + model_def

    params = jnp.float32(3.0)
    for seq in (1, 16, 1):  # decode: CONCURRENT; 16 tokens: no graphs; the second decode reuses the first compile
        tokens = jnp.asarray(np.random.default_rng(seq).normal(size=(8, seq)), jnp.float32)
        call = Call(Batch.of(tokens, tokens), jnp.zeros(8 * seq, jnp.int32), jnp.zeros(2, jnp.int32))
        np.testing.assert_allclose(step(2, params, call), tokens * 3 + 2, rtol=1e-6)
    assert step.with_options(CONCURRENT)._cache_size() == 1
    assert step.with_options(NO_GRAPHS)._cache_size() == 1
    assert step._cache_size() == 2
