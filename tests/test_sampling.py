"""sample_tokens: greedy rows, the nucleus cut, and sampling without it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jlora.sampling import sample_tokens

# Row 0: tokens 3 and 1 hold ~0.6 and ~0.3 of the mass, the other six share the rest.
LOGITS = jnp.log(jnp.array([[0.02, 0.3, 0.02, 0.6, 0.01, 0.02, 0.02, 0.01]] * 4, jnp.float32))


def draw(temperature, top_p, nucleus, n=200):
    keys = jax.random.split(jax.random.key(0), n)
    fn = jax.jit(jax.vmap(lambda k: sample_tokens(LOGITS, k, temperature, top_p, nucleus=nucleus)))
    return np.asarray(fn(keys))  # [n, 4]


@pytest.mark.parametrize("nucleus", [False, True])
def test_greedy_rows_take_the_argmax(nucleus):
    out = draw(jnp.array([0.0, 1.0, 0.0, 1.0]), jnp.array([1.0, 1.0, 0.5, 0.5]), nucleus)
    assert (out[:, 0] == 3).all() and (out[:, 2] == 3).all()
    assert len(set(out[:, 1].tolist())) > 2  # a sampled row is not stuck on the argmax


def test_nucleus_keeps_the_smallest_set_reaching_top_p():
    out = draw(jnp.ones(4), jnp.array([0.5, 0.85, 0.95, 1.0]), True)
    assert set(out[:, 0].tolist()) == {3}  # 0.6 >= 0.5: the top token alone
    assert set(out[:, 1].tolist()) == {1, 3}  # 0.6 + 0.3 >= 0.85
    assert {1, 3} < set(out[:, 2].tolist())  # 0.95 needs more than the top two
    assert len(set(out[:, 3].tolist())) > 4


def test_without_nucleus_rows_sample_from_every_token():
    out = draw(jnp.ones(4), jnp.full(4, 0.5), False)  # top_p is not applied
    assert len(set(out.ravel().tolist())) > 4
    assert abs((out == 3).mean() - 0.6) < 0.1
