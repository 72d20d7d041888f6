"""Which model steps compile with CONCURRENT CUDA-graph scheduling, and the jit wrapper that applies it."""

import jax.numpy as jnp
import numpy as np
import pytest

from jlora.compile_options import step_compiler_options, step_jit

CONCURRENT = {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}


@pytest.mark.parametrize(("rows", "seq", "concurrent"), [
    (1, 1, True), (2, 1, True), (4, 1, False), (8, 1, False), (16, 1, True), (32, 1, True), (64, 1, True),
    (1, 128, False), (32, 16, False),
])
def test_decode_steps_of_measured_sizes_run_concurrent_graphs(monkeypatch, rows, seq, concurrent):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    assert step_compiler_options(rows, seq) == (CONCURRENT if concurrent else {})


def test_xla_flags_that_set_the_mode_win(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_command_buffer_scheduling_mode=LHS")
    assert step_compiler_options(32, 1) == {}


def test_step_jit_compiles_each_shape_under_its_options(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)

    @step_jit(static_argnames=("model_def",))
    def step(model_def, params, tokens):
        return tokens * params + model_def

    params = jnp.float32(3.0)
    for rows in (32, 8, 32):  # 32 rows: CONCURRENT; 8: the default; the second 32 reuses the first compile
        tokens = jnp.asarray(np.random.default_rng(rows).normal(size=(rows, 1)), jnp.float32)
        np.testing.assert_allclose(step(2, params, tokens), tokens * 3 + 2, rtol=1e-6)
    assert step.with_options(CONCURRENT)._cache_size() == 1
    assert step.with_options({})._cache_size() == 1
    assert step._cache_size() == 2
