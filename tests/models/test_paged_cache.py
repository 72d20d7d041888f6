"""The model over a paged KV cache: requests whose positions live in shuffled, shared blocks get the logits of
a full forward of their sequences (prefilled in pieces, then decoded token by token)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jlora import testing
from jlora.adapters.peft import LINEAR_MODULES
from jlora.batch_info import LoRABatchInfo
from jlora.engine import Engine
from jlora.models.llama import Batch, CallOptions, Group, KVCache, LoRAInput

CFG = testing.tiny_config("mistral", head_dim=32, sliding_window=24)  # a window shorter than the sequences
SIZE, BLOCKS = 16, 14


@pytest.fixture(scope="module", params=["auto", "pallas"])  # pallas: decode through the paged kernel (interpret)
def engine(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("paged")
    testing.write_model(str(root / "m"), CFG, seed=3)
    testing.write_adapter(str(root / "a"), CFG, r=8, alpha=16, seed=4, target_modules=LINEAR_MODULES)
    eng = Engine.from_pretrained(str(root / "m"), max_loras=2, max_lora_rank=8, dtype="float32", progress=False,
                                 max_seq_len=64, backend=request.param)
    eng.load_adapter("a", str(root / "a"))
    return eng


def test_shuffled_and_shared_blocks_give_the_full_forward(engine):
    """Three requests over 14 blocks of 16 positions in shuffled order; requests 0 and 1 have the same first 16
    tokens under the same adapter and share that block (request 1 prefills from position 16, reading it);
    request 2 is on the base model. Prompts go in two pieces, then 6 tokens each decode one by one."""
    rng = np.random.default_rng(0)
    a = engine.pool.slot("a")
    prefix = rng.integers(0, CFG["vocab_size"], SIZE).tolist()
    seqs = [prefix + rng.integers(0, CFG["vocab_size"], 20).tolist(),
            prefix + rng.integers(0, CFG["vocab_size"], 26).tolist(),
            rng.integers(0, CFG["vocab_size"], 30).tolist()]
    slots = [a, a, -1]
    full = engine.prefill_logits(seqs, ["a", "a", None])
    order = rng.permutation(BLOCKS)
    tables = np.array([order[0:4], [order[0], *order[4:7]], order[7:11]], np.int32)  # 4 blocks: 64 positions
    model = engine.runner.model_def.merge(engine.runner.params)
    ranks, ones = engine.pool.ranks, np.ones(engine.pool.ranks.shape, np.float32)

    @jax.jit
    def run(cache, batch, token_slot):
        info = LoRABatchInfo.build(token_slot, ranks, ones)
        return model(batch, cache, LoRAInput(engine.pool.step_weights, info), CallOptions(engine.runner.backend))

    cache = KVCache.zeros(engine.model_config, BLOCKS, SIZE, jnp.float32)
    cache = KVCache(tuple(k.at[order[11:]].set(jnp.nan) for k in cache.k),  # blocks no table names: never read
                    tuple(v.at[order[11:]].set(jnp.nan) for v in cache.v))
    starts, split, ends = [0, SIZE, 0], [24, 28, 20], [len(s) - 6 for s in seqs]
    for lo, hi in ((starts, split), (split, ends)):  # two prompt pieces per request, padded to one width
        width = max(h - l for l, h in zip(lo, hi))
        tokens = np.zeros((3, width), np.int32)
        positions = np.zeros((3, width), np.int32)
        valid = np.zeros((3, width), bool)
        for i, (l, h) in enumerate(zip(lo, hi)):
            tokens[i, : h - l] = seqs[i][l:h]
            positions[i] = l + np.arange(width)
            valid[i, : h - l] = True
        token_slot = np.where(valid, np.array(slots)[:, None], -1).reshape(-1)
        logits, cache = run(cache, Batch((Group(tokens, positions, valid, tables=tables),)), token_slot)
        for i, (l, h) in enumerate(zip(lo, hi)):
            np.testing.assert_allclose(np.asarray(logits[i, : h - l]), full[i][l:h], rtol=2e-4, atol=2e-4)
    for step in range(6):  # every request's next token at its own position
        positions = np.array([[e + step] for e in ends], np.int32)
        tokens = np.array([[s[e + step]] for s, e in zip(seqs, ends)], np.int32)
        logits, cache = run(cache, Batch((Group(tokens, positions, tables=tables),)), np.array(slots, np.int32))
        for i, e in enumerate(ends):
            np.testing.assert_allclose(np.asarray(logits[i, 0]), full[i][e + step], rtol=2e-4, atol=2e-4)
