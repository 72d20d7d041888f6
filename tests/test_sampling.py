"""sample_tokens: greedy rows, the nucleus cut, and sampling without it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jlora.sampling import request_keys, sample_tokens

# Row 0: tokens 3 and 1 hold ~0.6 and ~0.3 of the mass, the other six share the rest.
LOGITS = jnp.log(jnp.array([[0.02, 0.3, 0.02, 0.6, 0.01, 0.02, 0.02, 0.01]] * 4, jnp.float32))


def draw(temperature, top_p, nucleus, n=200):
    keys = jax.random.split(jax.random.key(0), (n, 4))
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


@pytest.mark.parametrize("nucleus", [False, True])
def test_a_row_samples_from_its_own_key_whatever_the_other_rows(nucleus):
    # Row 1's draw depends on its key alone: moved to another row, beside other rows, it samples the same.
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((5, 50)), jnp.float32)
    seeds, steps = np.array([3, 7, 7, 9, 11], np.uint32), np.array([0, 4, 5, 4, 0], np.int32)
    temp, top_p = jnp.ones(5), jnp.full(5, 0.9)
    out = sample_tokens(logits, request_keys(seeds, steps), temp, top_p, nucleus=nucleus)
    perm = np.array([3, 1, 4, 0, 2])
    moved = sample_tokens(logits[perm], request_keys(seeds[perm], steps[perm]), temp, top_p, nucleus=nucleus)
    assert (np.asarray(moved) == np.asarray(out)[perm]).all()
    alone = [int(sample_tokens(logits[i:i + 1], request_keys(seeds[i:i + 1], steps[i:i + 1]), temp[:1],
                               top_p[:1], nucleus=nucleus)[0]) for i in range(5)]
    assert alone == np.asarray(out).tolist()
    # Different seeds or token indices give different draws (over 50 near-uniform tokens).
    many = sample_tokens(jnp.zeros((64, 50)), request_keys(np.arange(64, dtype=np.uint32), np.zeros(64, np.int32)),
                         jnp.ones(64), jnp.ones(64), nucleus=nucleus)
    assert len(set(np.asarray(many).tolist())) > 20


def test_a_row_without_top_p_draws_the_same_beside_nucleus_rows():
    # The nucleus variant runs when any row has top_p < 1; rows with top_p = 1 must not notice.
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.standard_normal((6, 40)), jnp.float32)
    keys = request_keys(np.arange(6, dtype=np.uint32), np.full(6, 2, np.int32))
    top_p = jnp.array([1.0, 0.5, 1.0, 0.9, 1.0, 1.0])
    plain = np.asarray(sample_tokens(logits, keys, jnp.ones(6), top_p, nucleus=False))
    mixed = np.asarray(sample_tokens(logits, keys, jnp.ones(6), top_p, nucleus=True))
    full = np.asarray(top_p) >= 1
    assert (mixed[full] == plain[full]).all()
