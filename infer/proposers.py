"""Draft proposers for the speculative engine: none (plain decoding), n-gram prompt lookup, DFlash, and the
hybrid of the last two.

A proposer is a small frozen (hashable) object, static under jit, whose methods are pure functions of
explicit arguments; its parameters (if any) travel separately as a pytree `params`. The engine calls:

  layer_ids                              target layers whose outputs `observe` receives (() = none needed)
  init(params, batch, capacity)          -> state (a pytree; () when stateless)
  observe(params, state, feats_BTF, num_new_B) -> state
      feats_BTF: target layer outputs at positions state_len[b] + 0..T-1; only the first num_new_B[b] are
      committed tokens (the rest are rejected drafts: write them past the length or drop them, never count them)
  propose(params, target, state, history_BC, n_B, k) -> [B, k-1] int32
      history_BC[b, :n_B[b]] is the committed sequence; the block to fill is
      [history[b, n_B[b]-1], d_1 .. d_{k-1}] at positions n_B[b]-1 .. n_B[b]+k-2.

Dimension letters: docs/glossary.md (one glossary for the repository).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp


def last_tokens(history_BC, n_B):
    return jnp.take_along_axis(history_BC, (n_B - 1)[:, None], axis=1)[:, 0]


@dataclasses.dataclass(frozen=True)
class NoProposer:
    """No drafts: with K = 1 the engine is plain autoregressive decoding (the speedup denominator)."""

    layer_ids: tuple[int, ...] = ()
    name: str = "none"

    def init(self, params, batch, capacity):
        return ()

    def observe(self, params, state, feats_BTF, num_new_B):
        return state

    def propose(self, params, target, state, history_BC, n_B, k):
        return jnp.zeros((history_BC.shape[0], k - 1), jnp.int32)


@dataclasses.dataclass(frozen=True)
class NGramProposer:
    """Prompt lookup: find the most recent earlier occurrence of the row's last n tokens (longest n first,
    max_n down to min_n) and propose the tokens that followed it. Needs no model and no state."""

    max_n: int = 3
    min_n: int = 1
    layer_ids: tuple[int, ...] = ()
    name: str = "ngram"

    def __post_init__(self):
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got {self.min_n}..{self.max_n}")

    def init(self, params, batch, capacity):
        return ()

    def observe(self, params, state, feats_BTF, num_new_B):
        return state

    def propose(self, params, target, state, history_BC, n_B, k):
        drafts, found_B = self.lookup(history_BC, n_B, k)
        # No match: repeat the last token (free to verify, and right inside runs of one token).
        return jnp.where(found_B[:, None], drafts, last_tokens(history_BC, n_B)[:, None]).astype(jnp.int32)

    def lookup(self, history_BC, n_B, k):
        """([B, k-1] the continuation of each row's latest earlier n-gram match, [B] bool whether one exists)."""
        b, c = history_BC.shape
        pos_C = jnp.arange(c, dtype=jnp.int32)
        hist_len = n_B[:, None]
        best_B = jnp.full((b,), -1, jnp.int32)  # last index of the chosen earlier match; -1 = none yet
        for n in range(self.max_n, self.min_n - 1, -1):
            suffix_Bn = jnp.take_along_axis(history_BC, jnp.maximum(n_B[:, None] - n + jnp.arange(n), 0), axis=1)
            # A match ends at i when history[i-n+1 .. i] == suffix. It must end before the suffix itself
            # (i < len-1), so at least one continuation token history[i+1] is already committed.
            match_BC = (pos_C >= n - 1) & (pos_C < hist_len - 1) & (hist_len >= n + 1)
            for j in range(n):
                shift = n - 1 - j  # compares history[i - shift] with suffix[j]
                shifted = jnp.pad(history_BC, ((0, 0), (shift, 0)), constant_values=-1)[:, :c]
                match_BC &= shifted == suffix_Bn[:, j : j + 1]
            found_B = jnp.max(jnp.where(match_BC, pos_C, -1), axis=1)
            best_B = jnp.where(best_B < 0, found_B, best_B)
        # Continue from the match. Past the committed end the text repeats with period p = len-1-i (the
        # match and the suffix are the same n tokens), so index i+1 + (j mod p) extends a repetition loop.
        period_B = jnp.maximum(n_B - 1 - best_B, 1)
        idx_BK = best_B[:, None] + 1 + jnp.arange(k - 1)[None, :] % period_B[:, None]
        drafts = jnp.take_along_axis(history_BC, jnp.clip(idx_BK, 0, c - 1), axis=1)
        return drafts.astype(jnp.int32), best_B >= 0


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

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return tuple(int(i) for i in self.config.target_layer_ids)

    def init(self, params, batch, capacity):
        from dflash_model.drafter import DraftCache

        return DraftCache.init(self.config, batch, capacity)

    def observe(self, params, state, feats_BTF, num_new_B):
        from dflash_model.drafter import extend_context

        feats = jnp.zeros_like(feats_BTF) if self.zero_features else feats_BTF
        return extend_context(params, state, feats, num_new_B)

    def propose(self, params, target, state, history_BC, n_B, k):
        from dflash_model.drafter import propose

        if k > self.config.block_size:
            raise ValueError(f"block size {k} is larger than the drafter's trained K={self.config.block_size}")
        return propose(params, target, state, last_tokens(history_BC, n_B), k).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class HybridProposer:
    """Prompt lookup where the context has a match, the DFlash block elsewhere, chosen per row and round.

    A match costs nothing to find and, on repetitive text, its continuation is accepted far more often than a
    weak drafter's block; without one the drafter's block beats repeating the last token. The drafter's context
    cache is extended every round either way (its state is DFlash's), and when every row has a match the drafter
    forward is skipped (`lax.cond`: at batch 1 a round then costs what an n-gram round costs).
    """

    dflash: DFlashProposer
    ngram: NGramProposer = NGramProposer()
    name: str = "hybrid"

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return self.dflash.layer_ids

    def init(self, params, batch, capacity):
        return self.dflash.init(params, batch, capacity)

    def observe(self, params, state, feats_BTF, num_new_B):
        return self.dflash.observe(params, state, feats_BTF, num_new_B)

    def propose(self, params, target, state, history_BC, n_B, k):
        looked_up, found_B = self.ngram.lookup(history_BC, n_B, k)
        drafted = jax.lax.cond(
            jnp.all(found_B),
            lambda: looked_up,
            lambda: self.dflash.propose(params, target, state, history_BC, n_B, k),
        )
        return jnp.where(found_B[:, None], looked_up, drafted).astype(jnp.int32)


__all__ = ["DFlashProposer", "HybridProposer", "NGramProposer", "NoProposer", "last_tokens"]
