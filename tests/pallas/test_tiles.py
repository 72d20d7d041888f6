"""The Pallas kernels under non-default tiles (interpret mode on CPU), against the float64 oracle."""

import jax.numpy as jnp
import numpy as np
import pytest

import jlora
from jlora import LoRABatchInfo
from jlora.pallas import ExpandConfig, ShrinkConfig, expand_config, shrink_config
from jlora.pallas.config import SMEM_BUDGET
from tests.oracle import expand_np, rel_err, shrink_np, worst_row_err


def _case(seed, t=45, k=256, slice_sizes=(64, 32, 32), rank=16, num_slots=3):
    rng = np.random.default_rng(seed)
    slots = rng.integers(-1, num_slots, t)
    ranks = rng.integers(1, rank + 1, num_slots)
    scal = rng.uniform(0.5, 2, num_slots).astype(np.float32)
    x = rng.standard_normal((t, k)).astype(np.float32)
    a = rng.standard_normal((num_slots, len(slice_sizes) * rank, k)).astype(np.float32) / 16
    b = rng.standard_normal((num_slots, sum(slice_sizes), rank)).astype(np.float32)
    base = rng.standard_normal((t, sum(slice_sizes))).astype(np.float32)
    return slots, ranks, scal, x, a, b, base


@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("config", [ExpandConfig(block_n=16, group=2, full_rank_branch=False),
                                    ExpandConfig(block_n=32, group=8, full_rank_branch=False),
                                    ExpandConfig(block_n=32, group=2),
                                    ExpandConfig(block_n=16, group=4, block_rows=16),
                                    ExpandConfig(block_n=16, group=2, block_rows=16, segments_first=True),
                                    ExpandConfig(block_n=16, group=2, full_rank_branch=False, delta=True),
                                    ExpandConfig(block_n=32, group=2, delta=True),
                                    ExpandConfig(block_n=16, group=2, block_rows=16, segments_first=True, delta=True)])
def test_expand_column_groups(config, block_m):
    slots, _, scal, x, a, b, base = _case(1, t=100)  # 21-30 tokens per slot: segments past 16 rows
    ranks = np.array([16, 5, 12])  # the full rank and below: both sides of full_rank_branch
    info = LoRABatchInfo.build(slots, ranks, scal, block_m=block_m)
    s = np.random.default_rng(2).standard_normal((len(slots), 48)).astype(np.float32)
    out = jlora.pallas.expand(jnp.asarray(s), jnp.asarray(b), info, jnp.asarray(base), slice_sizes=(64, 32, 32),
                              config=config)
    assert rel_err(out, expand_np(s, b, slots, ranks, base, (64, 32, 32))) < 1e-5
    np.testing.assert_array_equal(np.asarray(out)[slots < 0], base[slots < 0])


@pytest.mark.parametrize("config", [ShrinkConfig(block_k=32, k_splits=4), ShrinkConfig(block_k=64, k_splits=1),
                                    ShrinkConfig(block_k=32, k_splits=2, split_slices=True)])
def test_shrink_split_k(config):
    slots, ranks, scal, x, a, b, base = _case(3)
    info = LoRABatchInfo.build(slots, ranks, scal, block_m=16)
    y = jlora.pallas.shrink(jnp.asarray(x), jnp.asarray(a), info, num_slices=3, config=config)
    y_ref = shrink_np(x, a, slots, ranks, scal, 3)
    assert rel_err(y, y_ref) < 1e-5
    assert (np.asarray(y)[slots < 0] == 0).all()
    # The kernel into a NaN-poisoned buffer: each used row's split-K sums written, slot -1 rows left alone.
    poisoned = jnp.full((config.k_splits, *y.shape), jnp.nan, jnp.float32)
    partials = np.asarray(jlora.pallas.shrink_partials(jnp.asarray(x), jnp.asarray(a), info, num_slices=3,
                                                       config=config, out=poisoned))
    assert np.isnan(partials[:, slots < 0]).all()
    assert worst_row_err(partials[:, slots >= 0].sum(0), y_ref[slots >= 0]) < 1e-5


def test_linear_with_both_configs():
    """lora_linear's two kernels under explicit tiles: the expand adds the shrink's 4 split-K partials."""
    slots, ranks, scal, x, a, b, base = _case(4)
    info = LoRABatchInfo.build(slots, ranks, scal, block_m=16)
    out = jlora.pallas.linear(jnp.asarray(x), jnp.asarray(base), jnp.asarray(a), jnp.asarray(b), info,
                              slice_sizes=(64, 32, 32), shrink_config=ShrinkConfig(block_k=32, k_splits=4),
                              expand_config=ExpandConfig(block_n=32, group=2))
    ref = expand_np(shrink_np(x, a, slots, ranks, scal, 3), b, slots, ranks, base, (64, 32, 32))
    assert rel_err(out, ref) < 1e-5
    np.testing.assert_array_equal(np.asarray(out)[slots < 0], base[slots < 0])


def test_shrink_config_fits_shared_memory_and_tiles_k():
    for tokens, k, width, block_m in [(64, 4096, 16, 16), (64, 14336, 48, 16), (8192, 4096, 192, 64)]:
        cfg = shrink_config(tokens, k, width, block_m)
        assert k % (cfg.k_splits * cfg.block_k) == 0
        assert cfg.num_stages * (block_m + width) * cfg.block_k * 2 <= SMEM_BUDGET
    # Decode spreads K over programs that each walk 4 blocks through 3 stages, with at most 32 splits.
    for k, splits in [(4096, 8), (14336, 28), (65536, 32)]:
        cfg = shrink_config(64, k, 16, 16)
        assert (cfg.k_splits, cfg.block_k, cfg.num_stages, cfg.num_warps) == (splits, 128, 3, 1)
    assert shrink_config(64, 8304, 16, 16).k_splits == 3  # K = 16 x 3 x 173: the splits must tile K
    # A decode program's warps follow its slice's rank: R / 16, at most 4.
    for width, slices, warps in [(32, 1, 2), (64, 1, 4), (128, 1, 4), (192, 3, 4), (96, 3, 2), (48, 3, 1)]:
        assert shrink_config(64, 4096, width, 16, num_slices=slices).num_warps == warps


def test_expand_config_groups_blocks_only_with_programs_to_spare():
    decode = expand_config(64, (4096,), 16)
    assert (decode.group, decode.block_rows, decode.num_warps, decode.full_rank_branch, decode.segments_first) == (
        1, None, 2, True, False)
    assert [expand_config(64, (4096,), 16, rank=r).num_warps for r in (16, 32, 64)] == [2, 4, 4]
    prefill = expand_config(8192, (4096,), 64)  # 256 row parts x 32 blocks: 8 blocks each leave 1024 programs
    assert (prefill.block_n, prefill.group, prefill.block_rows, prefill.num_warps, prefill.segments_first) == (
        128, 8, 32, 4, True)
    assert expand_config(2048, (4096,), 64).group == 2  # 64 x 32 blocks: 4 each would leave < 1024 programs
    assert expand_config(8192, (2 * 14336,), 64).group == 8  # capped at 8
    assert expand_config(300, (1024,), 16).block_rows == 16  # never more rows than the segment's tile
    # The delta alone where the caller defers the add, at decode sizes only.
    assert [expand_config(t, (4096,), 16, defer_add=d).delta for t, d in [(64, True), (256, True), (257, True),
                                                                          (64, False)]] == [True, True, False, False]


def test_the_grid_rules_count_the_devices_sms(monkeypatch):
    """`num_sms` is the GPU's `core_count` (132 where a device does not say, as on the CPU), and the decode
    shrink's split-K target follows it: four programs an SM."""
    from jlora.pallas import config

    class Device:
        def __init__(self, platform, core_count=None):
            self.platform, self.core_count = platform, core_count

    def sms(device):
        monkeypatch.setattr(config.jax, "devices", lambda: [device])
        config.num_sms.cache_clear()
        return config.num_sms(), shrink_config(16, 16384, 16, 16).k_splits  # 1 segment, up to 32 splits

    try:
        assert sms(Device("cpu")) == (132, 32) and sms(Device("gpu")) == (132, 32)
        assert sms(Device("gpu", core_count=0)) == (132, 32)  # a device that reports no SMs
        assert sms(Device("gpu", core_count=4)) == (4, 16)  # 16 programs reach 4 x 4
    finally:
        monkeypatch.undo()
        config.num_sms.cache_clear()
