"""Prompt lookup backed by the target's past replies (infer/replies.py): the context's own match where it has one,
else the n-grams of a reply file."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from infer.proposers.base import REPEAT, Proposal, Stateless, lookup_source, reply_source
from infer.proposers.ngram import NGramProposer
from infer.replies import continue_rows


@dataclasses.dataclass(frozen=True)
class ReplyLookupProposer(Stateless):
    """Prompt lookup where the row's context has a match of at least `min_match` tokens; elsewhere the tokens the
    target's own replies to other prompts most often continued the row's last tokens with (infer.replies), or a
    shorter context match where the replies have none.

    `params` is the `ReplyIndex`. A 1-token context match is a chance hit as often as not, while a reply n-gram has
    2-4 tokens of context behind it, so the replies come first there."""

    ngram: NGramProposer = NGramProposer()
    min_match: int = 2
    name: str = "replies"

    def propose_scored(self, params, target, state, history_BC, n_B, k):
        tokens, source_B, _ = self.choose(params, history_BC, n_B, k)
        return Proposal.unscored(tokens, source_B, False)

    def choose(self, index, history_BC, n_B, k, min_prob: float = 1.0):
        """([B, k-1] drafts, [B] their SOURCES index, [B] confident: a context match of `min_match`+ tokens or a
        reply n-gram whose first draft followed it at least `min_prob` of the time)."""
        looked_up, match_len_B = self.ngram.lookup(history_BC, n_B, k)
        replied, prob_B, found_B = continue_rows(index, history_BC, n_B, k - 1)
        # A short context match still beats repeating the last token where the replies have nothing.
        long_match_B = match_len_B >= self.min_match
        from_context_B = long_match_B | (~found_B & (match_len_B > 0))
        source_B = jnp.where(found_B, reply_source(prob_B), REPEAT)  # not found: `replied` repeats the last token
        source_B = jnp.where(from_context_B, lookup_source(match_len_B), source_B)
        tokens = jnp.where(from_context_B[:, None], looked_up, replied).astype(jnp.int32)
        return tokens, source_B, long_match_B | (found_B & (prob_B >= min_prob))
