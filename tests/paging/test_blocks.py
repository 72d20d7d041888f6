"""`BlockPool` against a model of what the device holds: every block a request reuses holds exactly its
prefix under its adapter, and no block is ever both free and held."""

import numpy as np
import pytest

from jlora.paging import BlockPool, block_keys

IDENTITIES = ["", "a@1", "b@2", "a@3"]  # the base model; adapter a, b; a reloaded (a new generation)


def check_invariants(pool: BlockPool, rows: dict) -> None:
    held = {}
    for blocks in rows.values():
        for b in blocks:
            held[b] = held.get(b, 0) + 1
    assert pool.refs == [held.get(b, 0) for b in range(pool.num_blocks)]
    free, cached = set(pool._free), set(pool._cached)
    assert len(free) == len(pool._free) and not free & cached and not free & set(held) and not cached & set(held)
    assert free | cached | set(held) == set(range(pool.num_blocks))
    assert set(pool._cached) <= set(pool._key_of) and {pool._by_key[k] for k in pool._key_of.values()} == set(
        pool._key_of) and len(pool._by_key) == len(pool._key_of)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_random_admissions_reuse_only_their_own_prefixes(seed, block_size):
    """Requests over shared, partly shared and distinct prompts under several adapters arrive and end at
    random in a pool too small for them all: every reused block holds the request's own prefix (a model of
    the device's writes says what each block holds), the pool's books balance after every operation, and
    both reuse and eviction happen."""
    rng = np.random.default_rng(seed)
    pool = BlockPool(int(rng.integers(12, 30)), block_size)
    shared = [rng.integers(0, 50, int(rng.integers(block_size, 5 * block_size))).tolist() for _ in range(3)]
    holds: dict[int, tuple] = {}  # block -> (identity, the tokens of the prefix it holds), as written
    rows: dict[int, list[int]] = {}
    for step in range(300):
        if rows and rng.random() < 0.4:
            pool.release(rows.pop(int(rng.choice(list(rows)))))
        else:
            identity = IDENTITIES[int(rng.integers(len(IDENTITIES)))]
            prompt = shared[int(rng.integers(len(shared)))][: int(rng.integers(1, 5 * block_size))]
            prompt = prompt + rng.integers(0, 50, int(rng.integers(0, 2 * block_size))).tolist()
            if not prompt:
                continue
            keys = block_keys(identity, prompt, block_size)
            refs = list(pool.refs)
            matched = pool.match(keys, (len(prompt) - 1) // block_size)
            for i, b in enumerate(matched):
                assert holds[b] == (identity, tuple(prompt[: (i + 1) * block_size])), "reused a wrong block"
            new = pool.allocate(pool.blocks_for(len(prompt) + int(rng.integers(1, 8))) - len(matched))
            if new is None:
                pool.release(matched)  # waits: gives back what it took
                assert pool.refs == refs
            else:
                blocks = matched + new
                for i, b in enumerate(new, len(matched)):  # the step writes the prompt's keys and values
                    end = (i + 1) * block_size
                    holds[b] = (identity, tuple(prompt[:end])) if end <= len(prompt) else None
                full = len(prompt) // block_size
                pool.commit(blocks[:full], keys[:full])
                rows[step] = blocks
        check_invariants(pool, rows)
    assert pool.stats.hit_tokens > 0 and pool.stats.evicted_blocks > 0
    assert 0 < pool.stats.hit_rate < 1


def test_a_prefix_is_reused_under_its_own_adapter_generation_only():
    pool = BlockPool(16, 4)
    prompt = list(range(13))
    keys = block_keys("a@1", prompt, 4)
    blocks = pool.allocate(4)
    pool.commit(blocks[:3], keys[:3])
    pool.release(blocks)
    assert pool.num_cached == 3 and pool.num_available == 16
    assert pool.match(block_keys("a@2", prompt, 4), 3) == []  # reloaded under the same name
    assert pool.match(block_keys("b@1", prompt, 4), 3) == []
    assert pool.match(block_keys("", prompt, 4), 3) == []
    assert pool.match(keys, 3) == blocks[:3]
    assert pool.match(block_keys("a@1", prompt[:8] + [99] * 5, 4), 3) == blocks[:2]  # partly shared
    assert pool.refs[blocks[0]] == 2 and pool.refs[blocks[2]] == 1


def test_eviction_takes_the_least_recently_released_and_a_row_tail_first():
    pool = BlockPool(4, 2)
    first = pool.allocate(2)
    pool.commit(first, block_keys("", [1, 2, 3, 4], 2))
    second = pool.allocate(2)
    pool.commit(second, block_keys("", [5, 6, 7, 8], 2))
    pool.release(first)
    pool.release(second)
    assert pool.allocate(3) == [first[1], first[0], second[1]]
    assert pool.match(block_keys("", [5, 6, 7, 8], 2), 2) == [second[0]]
    assert pool.allocate(1) is None and pool.num_available == 0


def test_a_block_keyed_and_a_key_held_stay_as_they_are():
    pool = BlockPool(4, 2)
    one, two = pool.allocate(1), pool.allocate(1)
    k1, k2 = block_keys("", [1, 2, 3, 4], 2)
    pool.commit(one, [k1])
    pool.commit(one, [k2])  # already keyed: it keeps k1
    pool.commit(two, [k1])  # the same prefix computed twice: the first block keeps the key
    pool.release(one + two)
    assert pool.num_cached == 1 and pool.match([k1], 1) == one and pool.match([k2], 1) == []


def test_without_prefix_caching_nothing_is_kept():
    pool = BlockPool(4, 2, prefix_caching=False)
    blocks = pool.allocate(2)
    pool.commit(blocks, block_keys("", [1, 2, 3, 4], 2))
    pool.release(blocks)
    assert pool.num_cached == 0 and pool.match(block_keys("", [1, 2, 3, 4], 2), 2) == []


def test_misuse_is_refused():
    with pytest.raises(ValueError, match="must be >= 1"):
        BlockPool(0, 16)
    pool = BlockPool(2, 2)
    (b,) = pool.allocate(1)
    pool.release([b])
    with pytest.raises(ValueError, match="released more often than taken"):
        pool.release([b])
