"""What one model call of the engine carries: `Step` (the batcher's step: decode rows, prompt pieces, slots,
sampling), `Call` (a plain model call) and `StepOptions` (their static options).

`Step` and `Call` are pytrees of arrays, so the jitted runner functions take each as one argument and
recompile only when their shapes (or a step's static `filtered` / `logprobs`) change.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from jlora.models.llama import Batch, Group
from jlora.parallel import TensorParallel
from jlora.sampling import Penalties, Sampling

__all__ = ["Call", "Step", "StepOptions"]


@functools.partial(jax.tree_util.register_dataclass, data_fields=["batch", "token_slot", "ranks"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Call:
    """A model call: its batch, each of its T tokens' adapter slot [T] (-1: none) and each slot's rank [L]."""

    batch: Batch
    token_slot: jax.Array
    ranks: jax.Array

    @property
    def seq_len(self) -> int:
        """Tokens per request of the widest group: what the compile options and `base_first` go by."""
        return max(g.tokens.shape[1] for g in self.batch.groups)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["decode", "prefill", "token_slot", "ranks", "sampling", "prefill_last",
                                "prefill_next", "penalties"],
                   meta_fields=["filtered", "logprobs"])
@dataclasses.dataclass(frozen=True)
class Step:
    """One step of the engine over its R cache rows (`jlora.runner.generate_step`).

    Attributes:
      decode: every row's decode token [R, 1] (rows that do not decode are not valid; rows None: row r).
      prefill: prompt pieces [Bp, Sp] written into other rows, or None.
      token_slot: [R + Bp·Sp] the decode tokens' adapter slots, then the pieces'.
      ranks: [L] each slot's rank.
      sampling: each row's `jlora.sampling.Sampling`.
      prefill_last: [Bp] the index in its piece of the token whose logits give that row its first token (-1:
        none: the prompt goes on in a later step, or a padding request).
      prefill_next: with `logprobs`, [Bp, Sp] the prompt token each piece token predicts (-1: none).
      penalties: the rows' penalties (`jlora.sampling.Penalties`) when some row asks for one, else None (a step
        without them compiles without them, and takes no token history).
      filtered: whether some row samples with a top-k, top-p or min-p filter (`Sampling.filtered`: the sort they
        need runs only then).
      logprobs: the top-k width of the step's log-probabilities (`jlora.logprobs.top_width`); 0: none.
    """

    decode: Group
    prefill: Group | None
    token_slot: np.ndarray
    ranks: np.ndarray
    sampling: Sampling
    prefill_last: np.ndarray | None = None
    prefill_next: np.ndarray | None = None
    penalties: Penalties | None = None
    filtered: bool = False
    logprobs: int = 0

    @property
    def seq_len(self) -> int:
        return max(1, 0 if self.prefill is None else self.prefill.tokens.shape[1])


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """A call's static options: the LoRA ops' row tile (`LoRABatchInfo.block_m`) and backend, the tensor-parallel
    mesh (None: one device), `base_first` (None: the engine's rule, `jlora.compile_options.concurrent_graphs`)
    and `attention_chunk` (see `jlora.models.llama.CallOptions` for both)."""

    block_m: int
    backend: str
    tp: TensorParallel | None = None
    base_first: bool | None = None
    attention_chunk: int | None = None
