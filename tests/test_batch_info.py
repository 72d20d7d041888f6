import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jlora import LoRABatchInfo, num_segments, token_slots_from_requests
from tests.oracle import build_np


@st.composite
def slot_batches(draw):
    num_slots = draw(st.one_of(st.integers(1, 6), st.integers(100, 300)))  # few slots, or more than tokens
    num_tokens = draw(st.integers(1, 70))
    mode = draw(st.sampled_from(["random", "all_none", "one_slot", "sparse"]))
    if mode == "all_none":
        slots = [-1] * num_tokens
    elif mode == "one_slot":
        slots = [draw(st.integers(0, num_slots - 1))] * num_tokens
    else:
        hi = num_slots - 1 if mode == "random" else min(num_slots - 1, 1)
        slots = draw(st.lists(st.integers(-1, hi), min_size=num_tokens, max_size=num_tokens))
    block_m = draw(st.sampled_from([1, 4, 16]))
    return np.array(slots, np.int32), num_slots, block_m


@settings(max_examples=60, deadline=None)
@given(slot_batches())
def test_build_properties(batch):
    slots, num_slots, block_m = batch
    info = LoRABatchInfo.build(slots, np.arange(num_slots), np.ones(num_slots), block_m=block_m)
    sorted_idx = np.asarray(info.sorted_idx)
    seg_start, seg_len, seg_slot = map(np.asarray, (info.seg_start, info.seg_len, info.seg_slot))

    # Shapes depend on (T, L, block_m) only.
    assert sorted_idx.shape == (len(slots),)
    assert seg_start.shape == (num_segments(len(slots), num_slots, block_m),)
    # The order is a permutation grouping tokens by slot, stably, slot -1 last.
    assert sorted(sorted_idx.tolist()) == list(range(len(slots)))
    ref_idx, ref_counts, ref_segments = build_np(slots, num_slots, block_m)
    np.testing.assert_array_equal(sorted_idx, ref_idx)
    np.testing.assert_array_equal(np.asarray(info.slot_counts), ref_counts)
    # Segments cover exactly the tokens with slot >= 0, each <= block_m tokens of one slot.
    used = seg_len > 0
    assert list(zip(seg_start[used], seg_len[used], seg_slot[used])) == ref_segments
    covered = np.concatenate([sorted_idx[s : s + n] for s, n in zip(seg_start[used], seg_len[used])] or [[]])
    assert sorted(covered.tolist()) == [t for t in range(len(slots)) if slots[t] >= 0]
    for s, n, sl in zip(seg_start[used], seg_len[used], seg_slot[used]):
        assert 1 <= n <= block_m and (slots[sorted_idx[s : s + n]] == sl).all()
    # Padding segments are empty and come after the used ones.
    assert (seg_slot[~used] == -1).all() and (seg_start[~used] == 0).all()
    assert not used[np.argmin(used) :].any() if not used.all() else True


@pytest.mark.parametrize("num_tokens, num_slots, block_m", [(4, 8, 16), (32, 32, 16), (32, 128, 16), (3, 3, 1)])
def test_a_batch_of_one_token_per_slot_fills_every_segment(num_tokens, num_slots, block_m):
    # T <= L: the bound is min(T, ...) = T segments, one per token, whatever the slots: the kernels' grids
    # hold no program more than such a batch uses.
    info = LoRABatchInfo.build(np.arange(num_tokens), np.full(num_slots, 4), np.ones(num_slots), block_m=block_m)
    seg_len = np.asarray(info.seg_len)
    assert seg_len.shape == (num_segments(num_tokens, num_slots, block_m),) == (num_tokens,)
    assert (seg_len == 1).all()


def test_build_is_jittable_and_shape_stable():
    f = jax.jit(lambda s: LoRABatchInfo.build(s, jnp.array([4, 8]), jnp.array([1.0, 2.0]), block_m=16))
    a = f(jnp.array([0, 1, -1, 1, 0], jnp.int32))
    b = f(jnp.array([-1, -1, -1, -1, -1], jnp.int32))
    assert jax.tree.map(jnp.shape, a) == jax.tree.map(jnp.shape, b)
    assert f._cache_size() == 1
    assert int(b.seg_len.sum()) == 0


def test_out_of_range_slot_under_jit_counts_as_none():
    info = jax.jit(lambda s: LoRABatchInfo.build(s, jnp.array([4]), jnp.array([1.0])))(jnp.array([0, 5, -3]))
    np.testing.assert_array_equal(info.token_slot, [0, -1, -1])
    assert int(info.seg_len.sum()) == 1


def test_the_metadata_runs_no_while_loop():
    """Its searches compare every pair: an XLA while loop (jnp.searchsorted's default binary search) runs outside
    the step's CUDA graphs on the GPU, the host waiting on the device at each iteration."""
    def build(request_slot, request_len):
        return LoRABatchInfo.from_requests(request_slot, request_len, jnp.full(128, 16), jnp.ones(128),
                                           num_tokens=64)

    text = jax.jit(build).lower(jnp.zeros(8, jnp.int32), jnp.ones(8, jnp.int32)).as_text()
    assert "stablehlo.while" not in text
    search = jax.jit(lambda edges, values: jnp.searchsorted(edges, values))  # the binary search: a while loop
    assert "stablehlo.while" in search.lower(jnp.arange(128), jnp.arange(64)).as_text()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(-1, 3), st.integers(0, 5)), min_size=1, max_size=8), st.integers(1, 40))
def test_token_slots_from_requests_lay_requests_back_to_back(requests, num_tokens):
    """Request b owns the tokens after those of the requests before it (empty requests own none); tokens past
    them get -1, and a buffer too short keeps the first num_tokens."""
    slots, lengths = map(np.array, zip(*requests))
    want = np.concatenate([np.repeat(slots, lengths), np.full(num_tokens, -1)])[:num_tokens]
    got = token_slots_from_requests(jnp.asarray(slots), jnp.asarray(lengths), num_tokens=num_tokens)
    np.testing.assert_array_equal(got, want)


def test_from_requests():
    slots = token_slots_from_requests(jnp.array([2, -1, 0]), jnp.array([3, 1, 2]), num_tokens=8)
    np.testing.assert_array_equal(slots, [2, 2, 2, -1, 0, 0, -1, -1])
    with pytest.raises(ValueError, match=r"request_len must be >= 0; got \[-1\]"):  # its ends would decrease
        token_slots_from_requests(jnp.array([0, 1, 2]), jnp.array([2, -1, 3]), num_tokens=6)
    with pytest.raises(ValueError, match="request_len must be >= 0"):
        LoRABatchInfo.from_requests(np.array([0]), np.array([-2]), np.array([4]), np.array([1.0]), num_tokens=4)
    info = LoRABatchInfo.from_requests(
        jnp.array([1, 0]), jnp.array([2, 0]), jnp.array([4, 8]), jnp.array([1.0, 1.0]), num_tokens=4
    )
    np.testing.assert_array_equal(info.token_slot, [1, 1, -1, -1])


@pytest.mark.parametrize(
    "slots, ranks, scalings, block_m, match",
    [
        ([0, 2], [4, 4], [1.0, 1.0], 16, r"token_slot values must be in \[-1, 2\)"),
        ([0, -2], [4, 4], [1.0, 1.0], 16, r"token_slot values"),
        ([0], [4, 4], [1.0], 16, "expected token_slot"),
        ([0], [4], [1.0], 0, "block_m"),
        ([-1], [], [], 16, "at least one adapter slot"),
        (np.zeros(0, np.int32), [4], [1.0], 16, r"at least one token \(token_slot has shape \[0\]\)"),
    ],
)
def test_build_errors(slots, ranks, scalings, block_m, match):
    with pytest.raises(ValueError, match=match):
        LoRABatchInfo.build(np.array(slots), np.array(ranks), np.array(scalings), block_m=block_m)


def test_build_in_jit_over_a_concrete_array():
    """A jitted function may build from a device array it closes over: the values are still checked."""
    slots = jnp.array([0, 1, -1, 0], jnp.int32)
    build = lambda s: jax.jit(lambda: LoRABatchInfo.build(s, np.array([4, 4]), np.array([1.0, 1.0])))()
    np.testing.assert_array_equal(build(slots).token_slot, slots)
    with pytest.raises(ValueError, match=r"token_slot values must be in \[-1, 2\) for 2 slots; got \[2\]"):
        build(slots.at[1].set(2))


def test_is_a_pytree_with_static_block_m():
    info = LoRABatchInfo.build(np.array([0, -1]), np.array([4]), np.array([1.0]), block_m=16)
    leaves, treedef = jax.tree.flatten(info)
    assert len(leaves) == 8
    assert jax.tree.unflatten(treedef, leaves).block_m == 16
