"""N-gram prompt lookup: the tokens that followed the latest earlier occurrence of the context's last n-gram."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from infer.proposers.base import MATCH_BUCKETS, REPEAT, Proposal, Stateless, last_tokens, lookup_source
from infer.replies import row_tails


def suffix_matches(history_BC, n_B, n: int):
    """[B, C] True at each i where an earlier occurrence of the row's last n committed tokens ends:
    history[i-n+1 .. i] == history[len-n .. len-1], with i < len-1, so at least one token after it (history[i+1]) is
    committed. Tokens past a row's length are never read."""
    c = history_BC.shape[1]
    pos_C = jnp.arange(c, dtype=jnp.int32)
    suffix_Bn = row_tails(history_BC, n_B, n)
    hist_len = n_B[:, None]
    match_BC = (pos_C >= n - 1) & (pos_C < hist_len - 1) & (hist_len >= n + 1)
    for j in range(n):
        shift = n - 1 - j  # compares history[i - shift] with suffix[j]
        shifted = jnp.pad(history_BC, ((0, 0), (shift, 0)), constant_values=-1)[:, :c]
        match_BC &= shifted == suffix_Bn[:, j : j + 1]
    return match_BC


@dataclasses.dataclass(frozen=True)
class NGramProposer(Stateless):
    """Prompt lookup: find the most recent earlier occurrence of the row's last n tokens (longest n first,
    max_n down to min_n) and propose the tokens that followed it. Needs no model and no state."""

    max_n: int = 3
    min_n: int = 1
    name: str = "ngram"

    def __post_init__(self):
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got {self.min_n}..{self.max_n}")

    def propose_scored(self, params, target, state, history_BC, n_B, k):
        drafts, match_len_B = self.lookup(history_BC, n_B, k)
        found_B = match_len_B > 0
        # No match: repeat the last token (free to verify, and right inside runs of one token).
        tokens = jnp.where(found_B[:, None], drafts, last_tokens(history_BC, n_B)[:, None]).astype(jnp.int32)
        return Proposal.unscored(tokens, jnp.where(found_B, lookup_source(match_len_B), REPEAT), False)

    @jax.named_scope("ngram_lookup")
    def lookup(self, history_BC, n_B, k):
        """([B, k-1] the continuation of each row's latest earlier n-gram match, [B] its match length: how many
        tokens, up to MATCH_BUCKETS[-1], agree backwards from the match and from the row's end; 0 = no match)."""
        b, c = history_BC.shape
        pos_C = jnp.arange(c, dtype=jnp.int32)
        best_B = jnp.full((b,), -1, jnp.int32)  # last index of the chosen earlier match; -1 = none yet
        for n in range(self.max_n, self.min_n - 1, -1):
            found_B = jnp.max(jnp.where(suffix_matches(history_BC, n_B, n), pos_C, -1), axis=1)
            best_B = jnp.where(best_B < 0, found_B, best_B)
        # Continue from the match. Past the committed end the text repeats with period p = len-1-i (the
        # match and the suffix are the same n tokens), so index i+1 + (j mod p) extends a repetition loop.
        period_B = jnp.maximum(n_B - 1 - best_B, 1)
        idx_BK = best_B[:, None] + 1 + jnp.arange(k - 1)[None, :] % period_B[:, None]
        drafts = jnp.take_along_axis(history_BC, jnp.clip(idx_BK, 0, c - 1), axis=1)
        back = jnp.arange(MATCH_BUCKETS[-1])[None, :]
        at_match = jnp.take_along_axis(history_BC, jnp.clip(best_B[:, None] - back, 0, c - 1), axis=1)
        at_end = jnp.take_along_axis(history_BC, jnp.clip(n_B[:, None] - 1 - back, 0, c - 1), axis=1)
        agree = (at_match == at_end) & (best_B[:, None] - back >= 0)
        match_len_B = jnp.where(best_B >= 0, jnp.sum(jnp.cumprod(agree, axis=1), axis=1), 0)
        return drafts.astype(jnp.int32), match_len_B.astype(jnp.int32)
