"""DFlash: the block drafter conditioned on the target's hidden states, its context kept in a cache of features."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from dflash_model.drafter import DraftCache, extend_context, propose_scored, propose_top
from infer.proposers.base import DRAFTER, Proposal, last_tokens


@dataclasses.dataclass(frozen=True)
class DFlashProposer:
    """The DFlash block-diffusion drafter: one drafter forward over [last, MASK x (K-1)] per round.

    `params` is the drafter module itself (an NNX module is a pytree, so it is traced, not baked in). Its state
    is the drafter's context cache (K/V of committed target features only), kept at exactly the target
    cache's length: `observe` is given the TRUE committed count of each round, never the K verified positions
    (the "sequence length inflation" bug of an earlier port fed it lengths that already counted the tokens
    under verification).
    """

    config: Any  # DrafterConfig (frozen, hashable)
    name: str = "dflash"
    zero_features: bool = False  # ablation: the drafter sees zeros where the target features go (as trained)
    # The draft vocabulary it was trained on (its directory's draft_vocab.json): proposals come from those tokens
    # only, and the lm_head reads only their rows. None: the whole vocabulary. A tuple, so the proposer stays a
    # hashable static argument of the decode jit; it enters the program as a constant.
    vocab: tuple[int, ...] | None = None

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return tuple(int(i) for i in self.config.target_layer_ids)

    def init(self, params, batch, capacity):
        return DraftCache.init(self.config, batch, capacity)

    def observe(self, params, state, feats_BTF, num_new_B):
        feats = jnp.zeros_like(feats_BTF) if self.zero_features else feats_BTF
        return extend_context(params, state, feats, num_new_B)

    def propose(self, params, target, state, history_BC, n_B, k):
        return self.propose_scored(params, target, state, history_BC, n_B, k).tokens

    def propose_scored(self, params, target, state, history_BC, n_B, k):
        if k > self.config.block_size:
            raise ValueError(f"block size {k} is larger than the drafter's trained K={self.config.block_size}")
        tokens, prob = propose_scored(params, target, state, last_tokens(history_BC, n_B), k, self._vocab_ids())
        b = tokens.shape[0]
        return Proposal(tokens.astype(jnp.int32), prob, jnp.full((b,), DRAFTER, jnp.int32), jnp.bool_(True))

    def propose_top(self, params, target, state, history_BC, n_B, k, top):
        """([B, K-1, top] the drafter's `top` likeliest tokens per position, [B, K-1, top] their log-probs)."""
        if k > self.config.block_size:
            raise ValueError(f"block size {k} is larger than the drafter's trained K={self.config.block_size}")
        return propose_top(params, target, state, last_tokens(history_BC, n_B), k, top, self._vocab_ids())

    def _vocab_ids(self):
        return None if self.vocab is None else jnp.asarray(self.vocab, jnp.int32)
