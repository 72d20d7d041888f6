"""sample_tokens: greedy rows, the top-k, top-p and min-p filters against a float64 reference of HF's order, and
sampling without them; apply_penalties against a float64 reference of HF's repetition penalty and OpenAI's
frequency and presence penalties (and HF's own processor where transformers is installed)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jlora.sampling import Penalties, Sampling, apply_penalties, request_keys, sample_tokens

# Row 0: tokens 3 and 1 hold ~0.6 and ~0.3 of the mass, the other six share the rest.
LOGITS = jnp.log(jnp.array([[0.02, 0.3, 0.02, 0.6, 0.01, 0.02, 0.02, 0.01]] * 4, jnp.float32))


def settings(temperature, top_p=1.0, top_k=0, min_p=0.0, rows=None):
    """A `Sampling` of `rows` rows (seeds and token indices unused here: the keys come separately)."""
    rows = rows or max(len(np.atleast_1d(v)) for v in (temperature, top_p, top_k, min_p))
    full = lambda v, dtype: jnp.broadcast_to(jnp.asarray(v, dtype), (rows,))
    return Sampling(jnp.zeros(rows, jnp.uint32), jnp.zeros(rows, jnp.int32), full(temperature, jnp.float32),
                    full(top_p, jnp.float32), full(top_k, jnp.int32), full(min_p, jnp.float32))


def draw(sampling, filtered, n=200, logits=LOGITS):
    keys = jax.random.split(jax.random.key(0), (n, logits.shape[0]))
    fn = jax.jit(jax.vmap(lambda k: sample_tokens(logits, k, sampling, filtered=filtered)))
    return np.asarray(fn(keys))  # [n, rows]


@pytest.mark.parametrize("filtered", [False, True])
def test_greedy_rows_take_the_argmax(filtered):
    out = draw(settings([0.0, 1.0, 0.0, 1.0], [1.0, 1.0, 0.5, 0.5]), filtered)
    assert (out[:, 0] == 3).all() and (out[:, 2] == 3).all()
    assert len(set(out[:, 1].tolist())) > 2  # a sampled row is not stuck on the argmax


def test_nucleus_keeps_the_smallest_set_reaching_top_p():
    out = draw(settings(1.0, [0.5, 0.85, 0.95, 1.0]), True)
    assert set(out[:, 0].tolist()) == {3}  # 0.6 >= 0.5: the top token alone
    assert set(out[:, 1].tolist()) == {1, 3}  # 0.6 + 0.3 >= 0.85
    assert {1, 3} < set(out[:, 2].tolist())  # 0.95 needs more than the top two
    assert len(set(out[:, 3].tolist())) > 4


def test_top_k_min_p_and_their_order():
    out = draw(settings(1.0, top_k=[1, 2, 0, 0], min_p=[0.0, 0.0, 0.4, 0.03]), True)
    assert set(out[:, 0].tolist()) == {3} and set(out[:, 1].tolist()) == {1, 3}
    assert set(out[:, 2].tolist()) == {1, 3}  # p >= 0.4 * 0.6
    assert set(out[:, 3].tolist()) == {0, 1, 2, 3, 5, 6}  # p >= 0.018: not the two of 0.01
    # top-p counts the mass renormalized over the top k, as HF: with k = 2, token 1 has 2/3 ranked above it
    out = draw(settings(1.0, top_p=0.65, top_k=[2, 0, 2, 0]), True)
    assert set(out[:, 0].tolist()) == {3} and set(out[:, 1].tolist()) == {1, 3}


def test_the_filters_at_their_bounds_keep_the_top_token_and_its_ties():
    """min_p = 1 keeps the tokens as likely as the top one (p >= 1 · p_top), top_k = 1 the tokens tied with the
    first (as HF keeps ties with the k-th), and a top_p below every token's mass one of them: never no token."""
    tied = jnp.log(jnp.array([[0.05, 0.4, 0.05, 0.4, 0.1]] * 3, jnp.float32))  # tokens 1 and 3 tied at the top
    out = draw(settings(1.0, top_p=[1.0, 1.0, 1e-6], top_k=[0, 1, 0], min_p=[1.0, 0.0, 0.0]), True, logits=tied)
    assert set(out[:, 0].tolist()) == {1, 3} and set(out[:, 1].tolist()) == {1, 3}
    assert len(set(out[:, 2].tolist())) == 1 and set(out[:, 2].tolist()) <= {1, 3}


def _reference(logits: np.ndarray, temperature: float, top_p: float, top_k: int, min_p: float) -> np.ndarray:
    """HF's warpers in float64 (temperature, top-k, top-p on the renormalized rest, min-p): the kept tokens'
    probabilities [V] (0 elsewhere)."""
    scores = logits.astype(np.float64) / temperature
    if top_k:
        scores = np.where(scores < np.sort(scores)[::-1][min(top_k, len(scores)) - 1], -np.inf, scores)
    probs = np.exp(scores - scores.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    above = np.cumsum(probs[order]) - probs[order]
    removed = order[above >= top_p]
    probs[removed] = 0
    probs[probs < min_p * probs.max()] = 0
    return probs / probs.sum()


def test_random_settings_sample_what_the_float64_reference_keeps():
    """Over random logits and settings, every draw is a token the reference keeps, and the frequencies follow
    the reference's probabilities."""
    rng = np.random.default_rng(0)
    rows, vocab, n = 8, 24, 4000
    logits = rng.standard_normal((rows, vocab)).astype(np.float32) * 2
    temperature = rng.uniform(0.5, 1.5, rows)
    top_p, top_k = rng.uniform(0.3, 1.0, rows), rng.integers(0, 8, rows)
    min_p = np.where(rng.random(rows) < 0.5, rng.uniform(0, 0.3, rows), 0)
    sampling = settings(temperature, top_p, top_k, min_p)
    out = draw(sampling, True, n=n, logits=jnp.asarray(logits))
    for r in range(rows):
        want = _reference(logits[r], temperature[r], top_p[r], top_k[r], min_p[r])
        seen = np.bincount(out[:, r], minlength=vocab) / n
        assert set(np.flatnonzero(seen)) <= set(np.flatnonzero(want)), r
        assert np.abs(seen - want).max() < 0.04, (r, seen, want)


def test_without_filters_rows_sample_from_every_token():
    out = draw(settings(1.0, 0.5, 2, 0.5), False)  # the filters are not applied
    assert len(set(out.ravel().tolist())) > 4
    assert abs((out == 3).mean() - 0.6) < 0.1


@pytest.mark.parametrize("filtered", [False, True])
def test_a_row_samples_from_its_own_key_whatever_the_other_rows(filtered):
    # Row 1's draw depends on its key alone: moved to another row, beside other rows, it samples the same.
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((5, 50)), jnp.float32)
    seeds, steps = np.array([3, 7, 7, 9, 11], np.uint32), np.array([0, 4, 5, 4, 0], np.int32)
    sampling = settings(1.0, 0.9, [0, 5, 0, 3, 0], [0, 0, 0.1, 0, 0])
    out = sample_tokens(logits, request_keys(seeds, steps), sampling, filtered=filtered)
    perm = np.array([3, 1, 4, 0, 2])
    moved = sample_tokens(logits[perm], request_keys(seeds[perm], steps[perm]),
                          jax.tree.map(lambda x: x[perm], sampling), filtered=filtered)
    assert (np.asarray(moved) == np.asarray(out)[perm]).all()
    alone = [int(sample_tokens(logits[i:i + 1], request_keys(seeds[i:i + 1], steps[i:i + 1]),
                               jax.tree.map(lambda x: x[i:i + 1], sampling), filtered=filtered)[0]) for i in range(5)]
    assert alone == np.asarray(out).tolist()
    # Different seeds or token indices give different draws (over 50 near-uniform tokens).
    many = sample_tokens(jnp.zeros((64, 50)), request_keys(np.arange(64, dtype=np.uint32), np.zeros(64, np.int32)),
                         settings(1.0, rows=64), filtered=filtered)
    assert len(set(np.asarray(many).tolist())) > 20


def test_a_row_without_filters_draws_the_same_beside_filtered_rows():
    # The filtered variant runs when any row has a filter; rows without one must not notice.
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.standard_normal((6, 40)), jnp.float32)
    keys = request_keys(np.arange(6, dtype=np.uint32), np.full(6, 2, np.int32))
    sampling = settings(1.0, [1.0, 0.5, 1.0, 0.9, 1.0, 1.0], [0, 0, 4, 0, 0, 0], [0, 0, 0, 0, 0.2, 0])
    plain = np.asarray(sample_tokens(logits, keys, sampling, filtered=False))
    mixed = np.asarray(sample_tokens(logits, keys, sampling, filtered=True))
    assert sampling.filtered() is True and settings(1.0, rows=6).filtered() is False
    assert settings([0.0, 0.0], 0.5, 3, 0.1).filtered() is False  # greedy rows filter nothing
    assert (mixed[[0, 5]] == plain[[0, 5]]).all() and (mixed[[1, 2, 3, 4]] != plain[[1, 2, 3, 4]]).any()


def penalty_case(seed: int, rows: int = 6, vocab: int = 50, h: int = 24):
    """Random logits [rows, vocab] (some -inf, some 0), histories with repeats, prompts, decode tokens, settings;
    row 0's penalties are off."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 3, (rows, vocab)).astype(np.float32)
    logits[rng.random((rows, vocab)) < 0.05] = -np.inf
    logits[rng.random((rows, vocab)) < 0.05] = 0.0
    history = np.full((rows, h), -1, np.int32)
    lengths = rng.integers(1, h, rows)
    prompt_len = np.minimum(rng.integers(1, h, rows), lengths).astype(np.int32)
    for r, n in enumerate(lengths):
        history[r, :n] = rng.integers(0, 8, n) if r % 2 else rng.integers(0, vocab, n)  # odd rows: many repeats
    decoding = rng.random(rows) < 0.7
    positions = np.where(decoding, np.minimum(lengths, h - 1), 0).astype(np.int32)  # the token after the known
    tokens = rng.integers(0, vocab, rows).astype(np.int32)
    rep = rng.uniform(0.5, 2.0, rows).astype(np.float32)
    freq, pres = rng.uniform(-2, 2, rows).astype(np.float32), rng.uniform(-2, 2, rows).astype(np.float32)
    rep[0], freq[0], pres[0] = 1, 0, 0
    return logits, Penalties(prompt_len, rep, freq, pres), history, tokens, positions, decoding


def penalized_reference(logits, p: Penalties, history, tokens, positions, decoding):
    """float64: HF's RepetitionPenaltyLogitsProcessor over the row's tokens (prompt and generated), then OpenAI's
    frequency and presence penalties over the generated ones, row by row."""
    out = logits.astype(np.float64).copy()
    for r in range(len(out)):
        seq = [int(t) for t in history[r] if t >= 0]
        if decoding[r]:
            seq = seq[: positions[r]] + [int(tokens[r])] + seq[positions[r] + 1:]
        ids = np.array(sorted(set(seq)), np.int64)
        score = out[r, ids]
        out[r, ids] = np.where(score < 0, score * p.repetition[r], score / p.repetition[r])
        generated = np.bincount(seq[p.prompt_len[r]:], minlength=out.shape[1])
        out[r] -= p.frequency[r] * generated + p.presence[r] * (generated > 0)
    return out


@pytest.mark.parametrize("seed", range(8))
def test_penalties_as_hf_and_openai_define_them(seed):
    logits, p, history, tokens, positions, decoding = penalty_case(seed)
    got, written = jax.jit(apply_penalties)(logits, p, history, tokens, positions, decoding)
    got, want = np.asarray(got), penalized_reference(logits, p, history, tokens, positions, decoding)
    history[decoding, positions[decoding]] = tokens[decoding]  # the decode tokens join the history
    assert np.array_equal(np.asarray(written), history)
    finite = np.isfinite(want)
    assert (np.isfinite(got) == finite).all() and (got[~finite] == want[~finite]).all()
    np.testing.assert_allclose(got[finite], want[finite], rtol=2e-6, atol=2e-6)
    assert np.array_equal(got[0], logits[0])  # penalties off: the logits bit for bit


def test_repetition_penalty_is_hfs_processor():
    torch = pytest.importorskip("torch")
    processors = pytest.importorskip("transformers.generation.logits_process")
    logits, p, history, tokens, positions, _ = penalty_case(11)
    p = Penalties(np.zeros_like(p.prompt_len), p.repetition, 0 * p.frequency, 0 * p.presence)
    got, _ = jax.jit(apply_penalties)(logits, p, history, tokens, positions, np.zeros(len(tokens), bool))
    got = np.asarray(got)
    for r in range(len(logits)):
        ids = torch.tensor(history[r][history[r] >= 0][None].astype(np.int64))
        hf = processors.RepetitionPenaltyLogitsProcessor(float(p.repetition[r]))(ids, torch.tensor(logits[r:r + 1]))
        # the same operations in float32; on the GPU XLA's division by the row's penalty may round 1 ulp apart
        np.testing.assert_allclose(got[r], hf[0].numpy(), rtol=1.2e-7, atol=0)
