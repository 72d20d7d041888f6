import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jlora
from jlora import LoRABatchInfo
from tests.oracle import expand_np, rel_err, shrink_np

BACKENDS = ["reference", "ragged", "gather", "pallas"]
DTYPES = [jnp.float32, jnp.bfloat16]
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}
NUM_SLOTS, K, R = 4, 64, 16
RANKS = np.array([16, 5, 1, 12])  # heterogeneous, one below 16, weights stored non-zero past each rank


def scenario_slots(name: str, rng) -> np.ndarray:
    """Per-token slots for the coverage the ops must handle."""
    if name == "all_none":
        return np.full(20, -1)
    if name == "one_slot_owns_all":
        return np.full(33, 2)
    if name == "all_slots":  # every slot used, some -1, T not a multiple of block_m
        s = rng.integers(-1, NUM_SLOTS, 37)
        s[:NUM_SLOTS] = np.arange(NUM_SLOTS)
        return rng.permutation(s)
    if name == "scattered":  # one slot's tokens spread among base-only tokens, T a multiple of block_m
        s = np.full(32, -1)
        s[[1, 7, 8, 19, 30]] = 1
        return s
    if name == "single_token":
        return np.array([3])
    raise ValueError(name)


SCENARIOS = ["all_none", "one_slot_owns_all", "all_slots", "scattered", "single_token"]


def make_case(rng, slots, dtype, slice_sizes, rank=R, ranks=RANKS):
    num_slices = len(slice_sizes)
    n_total = sum(slice_sizes)
    scalings = rng.uniform(0.5, 2.0, NUM_SLOTS).astype(np.float32)
    info = LoRABatchInfo.build(slots, ranks, scalings, block_m=16)
    x = rng.standard_normal((len(slots), K)).astype(np.float32)
    a = (rng.standard_normal((NUM_SLOTS, num_slices * rank, K)) / np.sqrt(K)).astype(np.float32)
    b = (rng.standard_normal((NUM_SLOTS, n_total, rank)) / np.sqrt(rank)).astype(np.float32)
    base = (0.5 * rng.standard_normal((len(slots), n_total))).astype(np.float32)
    # Round through the dtype first so the float64 oracle sees exactly the kernel's inputs.
    cast = lambda v: jnp.asarray(v, dtype)
    x, a, b, base = map(cast, (x, a, b, base))
    np_ = lambda v: np.asarray(v.astype(jnp.float32))
    return info, (x, a, b, base), tuple(map(np_, (x, a, b, base))), scalings


def check(out, ref, dtype, info, base_np=None):
    assert out.dtype == dtype
    out = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(out).all()
    none = np.asarray(info.token_slot) < 0
    if base_np is None:  # shrink: rows of slot -1 exactly 0
        assert (out[none] == 0).all()
    else:  # expand: rows of slot -1 exactly base, untouched
        np.testing.assert_array_equal(out[none], base_np[none])
    if not none.all():
        assert rel_err(out, ref) < TOL[dtype], rel_err(out, ref)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_lora_linear_qkv(scenario, dtype, backend):
    rng = np.random.default_rng(abs(hash((scenario, backend))) % 2**32)
    slots = scenario_slots(scenario, rng)
    slice_sizes = (48, 32, 16)
    info, (x, a, b, base), (xn, an, bn, basen), scal = make_case(rng, slots, dtype, slice_sizes)
    out = jlora.lora_linear(x, base, a, b, info, slice_sizes=slice_sizes, backend=backend)
    y = shrink_np(xn, an, slots, RANKS, scal, 3)
    check(out, expand_np(y, bn, slots, RANKS, basen, slice_sizes), dtype, info, basen)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slice_sizes", [(32,), (48, 16), (48, 32, 16)])
def test_shrink_and_expand(slice_sizes, dtype, backend):
    rng = np.random.default_rng(len(slice_sizes) * 7 + len(backend))
    slots = scenario_slots("all_slots", rng)
    info, (x, a, b, base), (xn, an, bn, basen), scal = make_case(rng, slots, dtype, slice_sizes)
    num_slices = len(slice_sizes)
    y = jlora.lora_shrink(x, a, info, num_slices=num_slices, backend=backend)
    y_ref = shrink_np(xn, an, slots, RANKS, scal, num_slices)
    check(y, y_ref, dtype, info)
    # Expand a random s (non-zero past each rank too: those columns must contribute nothing).
    s = jnp.asarray(rng.standard_normal(y.shape), dtype)
    out = jlora.lora_expand(s, b, info, base, slice_sizes=slice_sizes, backend=backend)
    sn = np.asarray(s.astype(jnp.float32))
    check(out, expand_np(sn, bn, slots, RANKS, basen, slice_sizes), dtype, info, basen)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rank", [8, 24])
def test_max_rank_not_a_kernel_size(rank, backend):
    """R below 16 or not a power of two: the pallas backend pads; every backend agrees with the oracle."""
    rng = np.random.default_rng(rank)
    slots = scenario_slots("all_slots", rng)
    ranks = np.minimum(RANKS, rank)
    info, (x, a, b, base), (xn, an, bn, basen), scal = make_case(
        rng, slots, jnp.float32, (32, 16), rank=rank, ranks=ranks
    )
    out = jlora.lora_linear(x, base, a, b, info, slice_sizes=(32, 16), backend=backend)
    y = shrink_np(xn, an, slots, ranks, scal, 2)
    check(out, expand_np(y, bn, slots, ranks, basen, (32, 16)), jnp.float32, info, basen)
    y_op = jlora.lora_shrink(x, a, info, num_slices=2, backend=backend)
    check(y_op, y, jnp.float32, info)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_lora_embedding(dtype, backend):
    rng = np.random.default_rng(3)
    vocab, hidden = 50, 32
    slots = scenario_slots("all_slots", rng)
    info = LoRABatchInfo.build(slots, RANKS, rng.uniform(0.5, 2, NUM_SLOTS), block_m=16)
    tokens = jnp.asarray(rng.integers(0, vocab, len(slots)), jnp.int32)
    a_emb = jnp.asarray(rng.standard_normal((NUM_SLOTS, R, vocab)), dtype)
    b_emb = jnp.asarray(rng.standard_normal((NUM_SLOTS, hidden, R)) / 4, dtype)
    base = jnp.asarray(rng.standard_normal((len(slots), hidden)), dtype)
    out = jlora.lora_embedding(tokens, a_emb, b_emb, info, base, backend=backend)
    f = lambda v: np.asarray(v.astype(jnp.float32), np.float64)
    an, bn, basen, scal = f(a_emb), f(b_emb), f(base), np.asarray(info.scalings)
    ref = basen.copy()
    for t, s in enumerate(slots):
        if s >= 0:
            r = RANKS[s]
            ref[t] += scal[s] * bn[s, :, :r] @ an[s, :r, int(tokens[t])]
    check(out, ref, dtype, info, basen)


def test_auto_backend_runs_and_agrees():
    rng = np.random.default_rng(5)
    slots = scenario_slots("all_slots", rng)
    info, (x, a, b, base), _, _ = make_case(rng, slots, jnp.float32, (32,))
    auto = jlora.lora_linear(x, base, a, b, info, slice_sizes=(32,), backend="auto")
    ref = jlora.lora_linear(x, base, a, b, info, slice_sizes=(32,), backend="reference")
    np.testing.assert_allclose(auto, ref, rtol=1e-5, atol=1e-5)


def test_auto_backend_by_device_and_tokens(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert jlora.ops.resolve_backend("auto", 8, 16) == "reference"
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    limit, min_tokens = jlora.ops.GATHER_MAX_TOKEN_RANK, jlora.ops.PALLAS_MIN_TOKENS
    calls = {(1, 16): "gather", (min_tokens - 1, 16): "gather", (min_tokens, 16): "pallas",
             (min_tokens, 8): "pallas", (limit // 64, 64): "gather", (limit // 64 + 1, 64): "pallas",
             (limit // 32, 32): "gather", (8, None): "pallas"}
    assert {call: jlora.ops.resolve_backend("auto", *call) for call in calls} == calls
    assert jlora.ops.resolve_backend("ragged", 1) == "ragged"
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        jlora.ops.resolve_backend("cuda", 1)


def poison(w: np.ndarray, in_use: int, ranks, rank_axis: int, num_slices: int, rng, chunk: int = 1) -> np.ndarray:
    """w [L, ...] with NaN / inf in every slot but `in_use`, and in `in_use`'s entries past its rank along
    `rank_axis` (per slice of R columns), from the end of the rank's last `chunk`-column chunk on."""
    w = np.array(w, np.float32)
    for slot in range(w.shape[0]):
        if slot != in_use:
            w[slot] = rng.choice([np.nan, np.inf, -np.inf], w[slot].shape)
    rank = w.shape[rank_axis] // num_slices
    past = np.tile(np.arange(rank) >= -(-ranks[in_use] // chunk) * chunk, num_slices)
    view = np.moveaxis(w[in_use], rank_axis - 1, 0)  # [S·R, ...] of slot in_use
    view[past] = np.where(rng.random(view[past].shape) < 0.5, np.nan, np.inf)
    return w


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("in_use, rank, ranks", [(0, R, RANKS), (2, R, RANKS), (0, 32, [16, 5, 20, 12]),
                                                 (2, 32, [16, 5, 20, 12]), (1, 32, [16, 32, 20, 12])])
def test_a_slot_reaches_only_its_own_tokens_whatever_the_others_hold(backend, in_use, rank, ranks):
    """One slot in use beside base tokens; every other slot (used by no token, slot 0 among them, which slot
    -1 tokens index when unmasked) and the in-use slot's columns past its rank hold NaN and inf. Outputs must
    equal the clean oracle: every backend selects instead of multiplying by zero. The Pallas expand reads B in
    16-column chunks up to the rank, so B's columns past the rank in its last chunk must be finite there: they
    stay clean for it. Ranks at R, below R on a chunk's end and inside a chunk."""
    rng = np.random.default_rng(17 + in_use + rank)
    ranks = np.asarray(ranks)
    slots = np.where(rng.random(21) < 0.6, in_use, -1)
    slice_sizes = (32, 16)
    info, (x, a, b, base), (xn, an, bn, basen), scal = make_case(rng, slots, jnp.float32, slice_sizes, rank, ranks)
    a_bad = jnp.asarray(poison(an, in_use, ranks, 1, 2, rng))
    chunk = 16 if backend == "pallas" else 1
    b_bad = jnp.asarray(poison(bn, in_use, ranks, 2, 1, rng, chunk))
    y = shrink_np(xn, an, slots, ranks, scal, 2)
    for defer_add in (False, True):  # the pallas expand into base's buffer, and its delta added by XLA
        out = jlora.lora_linear(x, base, a_bad, b_bad, info, slice_sizes=slice_sizes, backend=backend,
                                defer_add=defer_add)
        check(out, expand_np(y, bn, slots, ranks, basen, slice_sizes), jnp.float32, info, basen)
    check(jlora.lora_shrink(x, a_bad, info, num_slices=2, backend=backend), y, jnp.float32, info)
    s = rng.standard_normal(y.shape).astype(np.float32)  # non-zero past the rank too
    out = jlora.lora_expand(jnp.asarray(s), b_bad, info, base, slice_sizes=slice_sizes, backend=backend)
    check(out, expand_np(s, bn, slots, ranks, basen, slice_sizes), jnp.float32, info, basen)
    # The embedding: A_emb [L, R, V] and B_emb [L, H, R] poisoned the same way.
    vocab, hidden = 40, 32
    tokens = rng.integers(0, vocab, len(slots))
    a_emb = rng.standard_normal((NUM_SLOTS, rank, vocab)).astype(np.float32)
    b_emb = (rng.standard_normal((NUM_SLOTS, hidden, rank)) / 4).astype(np.float32)
    base_h = rng.standard_normal((len(slots), hidden)).astype(np.float32)
    out = jlora.lora_embedding(jnp.asarray(tokens, jnp.int32), jnp.asarray(poison(a_emb, in_use, ranks, 1, 1, rng)),
                               jnp.asarray(poison(b_emb, in_use, ranks, 2, 1, rng, chunk)), info, jnp.asarray(base_h),
                               backend=backend)
    s_emb = shrink_np(np.eye(vocab)[tokens], a_emb, slots, ranks, scal, 1)  # the A side as a one-hot product
    check(out, expand_np(s_emb, b_emb, slots, ranks, base_h, (hidden,)), jnp.float32, info, base_h)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", range(3))
def test_column_affine(case, dtype, backend):
    """`scale` and `shift` (DoRA's column factor, a LoRA bias) per slot, each alone and together, on seeded
    random cases: decode and prefill sizes (the Pallas expand's two tilings), odd and narrow slices, some
    slots unused and holding NaN in their rows; slot -1 rows stay exactly base."""
    rng = np.random.default_rng(100 + case)
    slice_sizes = [(48, 16), (17, 33, 16), (5,)][case]
    t = [29, 300, 13][case]
    used = rng.permutation(NUM_SLOTS)[: rng.integers(1, NUM_SLOTS)]  # the others hold NaN
    slots = np.where(rng.random(t) < 0.25, -1, rng.choice(used, t))
    info, (x, a, b, base), (xn, an, bn, basen), scal = make_case(rng, slots, dtype, slice_sizes)
    n = sum(slice_sizes)
    scale = rng.uniform(0.5, 1.5, (NUM_SLOTS, n)).astype(np.float32)
    shift = rng.standard_normal((NUM_SLOTS, n)).astype(np.float32)
    poisoned = lambda w: jnp.asarray(np.where(np.isin(np.arange(NUM_SLOTS), used)[:, None], w, np.nan))
    y = shrink_np(xn, an, slots, RANKS, scal, len(slice_sizes))
    plain = expand_np(y, bn, slots, RANKS, basen, slice_sizes)
    own, sl = slots >= 0, np.maximum(slots, 0)
    for with_scale, with_shift in [(True, False), (False, True), (True, True)]:
        ref = plain * (scale[sl] if with_scale else 1) + (shift[sl] if with_shift else 0)
        ref = np.where(own[:, None], ref, basen)
        kw = dict(scale=poisoned(scale) if with_scale else None, shift=poisoned(shift) if with_shift else None)
        for defer_add in (False, True):
            out = jlora.lora_linear(x, base, a, b, info, slice_sizes=slice_sizes, backend=backend,
                                    defer_add=defer_add, **kw)
            check(out, ref, dtype, info, basen)
        out = jlora.lora_expand(jnp.asarray(y, dtype), b, info, base, slice_sizes=slice_sizes, backend=backend, **kw)
        check(out, np.where(own[:, None], expand_np(np.asarray(jnp.asarray(y, dtype).astype(jnp.float32)), bn, slots,
                                                    RANKS, basen, slice_sizes)
                            * (scale[sl] if with_scale else 1) + (shift[sl] if with_shift else 0), basen),
              dtype, info, basen)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_slot_minus_one_rows_keep_base_bit_for_bit(dtype, backend):
    """Rows of slot -1 tokens return base's own bits, -0.0 and inf among them, in every form: in place,
    deferred, at decode and prefill sizes, with and without the column affine. (A +0.0 added to them would
    turn -0.0 into +0.0.) Subnormal values are left out: XLA's fused adds may flush them to zero."""
    rng = np.random.default_rng(7)
    uint = np.uint32 if dtype == jnp.float32 else np.uint16
    for t, slice_sizes in [(29, (48, 16)), (300, (17, 33, 16))]:
        slots = rng.integers(-1, NUM_SLOTS, t)
        info, (x, a, b, _), _, _ = make_case(rng, slots, dtype, slice_sizes)
        n = sum(slice_sizes)
        special = np.array([-0.0, 0.0, np.inf, -np.inf, -1.5, 3e-38], np.float32)
        base = jnp.asarray(rng.choice(special, (t, n)), dtype)
        want = np.asarray(base).view(uint)[slots < 0]
        for affine in ({}, dict(scale=jnp.asarray(rng.uniform(0.5, 1.5, (NUM_SLOTS, n)), dtype))):
            for defer_add in (False, True):
                out = jlora.lora_linear(x, base, a, b, info, slice_sizes=slice_sizes, backend=backend,
                                        defer_add=defer_add, **affine)
                np.testing.assert_array_equal(np.asarray(out).view(uint)[slots < 0], want,
                                              err_msg=f"T={t} defer_add={defer_add} {affine.keys()}")


@pytest.mark.parametrize("case", range(4))
def test_where_each_form_rounds_the_delta(case):
    """bf16, on seeded cases at decode and prefill sizes, with and without the column affine: the forms that
    round each token's delta to bf16 before the add, as PEFT rounds its LoRA output (gather, and the Pallas
    expand writing its delta alone: `defer_add` at T <= 256), give the same bits; so do the forms that add the
    f32 delta and round once (reference, ragged, the Pallas expand in place). The two groups differ in about a
    fifth of the outputs; rounding in the in-place kernel too cost 3-10 % of its time (docs/kernels.md). Each
    form is jitted under the model steps' compiler options, which keep XLA on the GPU from skipping a fused
    rounding (`xla_allow_excess_precision`), so this holds on the GPU too."""
    rng = np.random.default_rng(200 + case)
    slice_sizes = [(48, 16), (17, 33, 16), (32,), (5, 40)][case]
    t = [29, 300, 257, 1][case]
    slots = rng.integers(-1, NUM_SLOTS, t)
    info, (x, a, b, base), (_, _, _, basen), _ = make_case(rng, slots, jnp.bfloat16, slice_sizes)
    n = sum(slice_sizes)
    affine = dict(scale=jnp.asarray(rng.uniform(0.5, 1.5, (NUM_SLOTS, n)), jnp.bfloat16),
                  shift=jnp.asarray(rng.standard_normal((NUM_SLOTS, n)), jnp.bfloat16)) if case % 2 else {}

    def run_form(backend, defer_add):
        fn = functools.partial(jlora.lora_linear, slice_sizes=slice_sizes, backend=backend, defer_add=defer_add)
        out = jax.jit(fn, compiler_options=jlora.step_compiler_options(1))(x, base, a, b, info, **affine)
        return np.asarray(out.astype(jnp.float32))

    outs = {(backend, defer_add): run_form(backend, defer_add) for backend in BACKENDS for defer_add in (False, True)}
    rounds_first = {("gather", False), ("gather", True)} | ({("pallas", True)} if t <= 256 else set())
    for form, out in outs.items():
        same = ("gather", False) if form in rounds_first else ("reference", False)
        np.testing.assert_array_equal(out, outs[same], err_msg=f"{form} against {same}")
    assert (outs["gather", False] != outs["reference", False]).mean() > 0.1
    np.testing.assert_array_equal(outs["pallas", False][slots < 0], basen[slots < 0])


def test_column_affine_errors():
    x, base, a, b, info = _args()
    with pytest.raises(ValueError, match=r"scale \(2, 31\) must be \[L, N\]"):
        jlora.lora_linear(x, base, a, b, info, slice_sizes=(32,), scale=jnp.ones((2, 31)))
    with pytest.raises(ValueError, match="shift must be a floating array"):
        jlora.lora_linear(x, base, a, b, info, slice_sizes=(32,), shift=jnp.ones((2, 32), jnp.int32))


# Widths that are no multiple of the kernels' tiles: K (the shrink's input) and output slices, down to 1.
WIDTHS = [((1,), 17), ((15,), 300), ((17,), 15), ((300,), 64), ((17, 33, 16), 1), ((100, 20), 48), ((32001,), 24)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("slice_sizes,k", WIDTHS)
def test_any_width(slice_sizes, k, backend):
    """Every backend takes any K and any slice widths (the Pallas kernels end on an overlapping block)."""
    rng = np.random.default_rng(sum(slice_sizes) + k)
    slots = rng.integers(-1, NUM_SLOTS, 23 if sum(slice_sizes) < 10000 else 7)
    num_slices = len(slice_sizes)
    info = LoRABatchInfo.build(slots, RANKS, rng.uniform(0.5, 2.0, NUM_SLOTS), block_m=16)
    x = rng.standard_normal((len(slots), k)).astype(np.float32)
    a = (rng.standard_normal((NUM_SLOTS, num_slices * R, k)) / np.sqrt(k)).astype(np.float32)
    b = rng.standard_normal((NUM_SLOTS, sum(slice_sizes), R)).astype(np.float32)
    base = rng.standard_normal((len(slots), sum(slice_sizes))).astype(np.float32)
    y = shrink_np(x, a, slots, RANKS, np.asarray(info.scalings), num_slices)
    ref = expand_np(y, b, slots, RANKS, base, slice_sizes)
    args = [jnp.asarray(v) for v in (x, base, a, b)]
    for defer_add in (False, True):
        out = jlora.lora_linear(*args, info, slice_sizes=slice_sizes, backend=backend, defer_add=defer_add)
        check(out, ref, jnp.float32, info, base)
    check(jlora.lora_shrink(args[0], args[2], info, num_slices=num_slices, backend=backend), y, jnp.float32, info)


def test_jitted_lora_linear_compiles_once_over_adapter_mixes():
    rng = np.random.default_rng(11)
    traces = []

    @jax.jit
    def step(x, base, a, b, slots, ranks, scalings):
        traces.append(1)
        info = LoRABatchInfo.build(slots, ranks, scalings, block_m=16)
        return jlora.lora_linear(x, base, a, b, info, slice_sizes=(48, 16), backend="pallas")

    slots0 = scenario_slots("all_slots", rng)
    _, (x, a, b, base), _, _ = make_case(rng, slots0, jnp.float32, (48, 16))
    for _ in range(50):
        mode = rng.integers(3)
        slots = rng.integers(-1, NUM_SLOTS, len(slots0)) if mode == 0 else np.full(len(slots0), mode - 2)
        ranks = rng.integers(0, R + 1, NUM_SLOTS)
        out = step(x, base, a, b, jnp.asarray(slots, jnp.int32), jnp.asarray(ranks), jnp.asarray(rng.random(NUM_SLOTS)))
        assert out.shape == base.shape
    assert len(traces) == 1 and step._cache_size() == 1


def _args(dtype=jnp.float32, t=8, k=32, n=32, rank=16, slots=2):
    info = LoRABatchInfo.build(np.zeros(t, np.int32), np.full(slots, 4), np.ones(slots))
    return (
        jnp.ones((t, k), dtype),
        jnp.ones((t, n), dtype),
        jnp.ones((slots, rank, k), dtype),
        jnp.ones((slots, n, rank), dtype),
        info,
    )


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda x, base, a, b, i: (x.astype(jnp.bfloat16), base, a, b, i), "dtype mismatch: x=bfloat16, A=float32"),
        (lambda x, base, a, b, i: (x[:, :16], base, a, b, i), "input dim K=32 but x"),
        (lambda x, base, a, b, i: (x, base[:, :16], a, b, i), r"base \(8, 16\) must be \[T, N\]"),
        (lambda x, base, a, b, i: (x[:4], base[:4], a, b, i), "info is built for T=8"),
        (lambda x, base, a, b, i: (x, base, a[:1], b[:1], i), "info has L=2 slots"),
        (lambda x, base, a, b, i: (x, base, a, b[:, :, :8], i), "disagree on the max rank|columns"),
        (lambda x, base, a, b, i: (x, base, a, b, i.__class__.build(np.zeros(8, np.int32), np.full(2, 17), np.ones(2))),
         "adapter rank 17 exceeds the weight stack's max rank R=16"),
        (lambda x, base, a, b, i: (x.astype(jnp.int32), base, a, b, i), "x must be a floating array"),
    ],
)
def test_lora_linear_errors(mutate, match):
    x, base, a, b, info = mutate(*_args())
    with pytest.raises(ValueError, match=match):
        jlora.lora_linear(x, base, a, b, info, slice_sizes=(32,), backend="reference")


def test_errors_name_the_problem():
    x, base, a, b, info = _args()
    with pytest.raises(ValueError, match="unknown backend 'triton'"):
        jlora.lora_shrink(x, a, info, backend="triton")
    with pytest.raises(ValueError, match=r"slice_sizes \(16, 8\) sum to 24 but B"):
        jlora.lora_expand(jnp.ones((8, 32)), b, info, base, slice_sizes=(16, 8))
    with pytest.raises(ValueError, match="not num_slices"):
        jlora.lora_shrink(x, a, info, num_slices=3)
    with pytest.raises(ValueError, match="must have 2 slices x R=16"):
        jlora.lora_expand(jnp.ones((8, 16)), b, info, base, slice_sizes=(16, 16))
    with pytest.raises(TypeError, match="LoRABatchInfo"):
        jlora.lora_shrink(x, a, {"token_slot": None})
    with pytest.raises(NotImplementedError, match="block_m=8 must be a power of two >= 16 for the pallas backend"):
        jlora.lora_expand(jnp.ones((8, 32)), b, dataclasses.replace(info, block_m=8), base, slice_sizes=(16, 16),
                          backend="pallas")
    with pytest.raises(ValueError, match="slot id 2 >= number of slots"):
        jlora.lora_shrink(x, a, dataclasses.replace(info, token_slot=info.token_slot.at[1].set(2)))
    with pytest.raises(ValueError, match="token_ids must be a 1-D int array"):
        jlora.lora_embedding(jnp.ones(8), jnp.ones((2, 16, 10)), b, info, base)


def test_info_closed_over_by_jit():
    """A jitted function may close over a concrete `info`: its values are still checked, on the host."""
    x, base, a, b, info = _args()
    got = jax.jit(lambda x, a: jlora.lora_shrink(x, a, info, backend="reference"))(x, a)
    np.testing.assert_allclose(got, jlora.lora_shrink(x, a, info, backend="reference"))
    bad = dataclasses.replace(info, token_slot=info.token_slot.at[1].set(2))
    with pytest.raises(ValueError, match="slot id 2 >= number of slots"):
        jax.jit(lambda x, a: jlora.lora_shrink(x, a, bad, backend="reference"))(x, a)
