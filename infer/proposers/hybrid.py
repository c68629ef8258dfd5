"""Hybrids: a lookup where it is sure, the DFlash drafter's block elsewhere (one verify for both)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from infer.proposers.base import DRAFTER, Proposal, lookup_source
from infer.proposers.dflash import DFlashProposer
from infer.proposers.ngram import NGramProposer
from infer.proposers.reply_lookup import ReplyLookupProposer


class _WithDrafter:
    """The engine hooks of a hybrid: its state, features and timed forward are its DFlash drafter's (`self.dflash`),
    whose params `drafter(params)` picks out of the hybrid's."""

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return self.dflash.layer_ids

    def drafter(self, params):
        """(the proposer whose forward a round may pay for, its params): what the engine times as a round's draft."""
        return self.dflash, params

    def init(self, params, batch, capacity):
        return self.dflash.init(self.drafter(params)[1], batch, capacity)

    def observe(self, params, state, feats_BTF, num_new_B):
        return self.dflash.observe(self.drafter(params)[1], state, feats_BTF, num_new_B)

    def propose(self, params, target, state, history_BC, n_B, k):
        return self.propose_scored(params, target, state, history_BC, n_B, k).tokens


@dataclasses.dataclass(frozen=True)
class HybridProposer(_WithDrafter):
    """Prompt lookup where the context has a match, the DFlash block elsewhere, chosen per row and round.

    A match costs nothing to find and, on repetitive text, its continuation is accepted far more often than a
    weak drafter's block; without one the drafter's block beats repeating the last token. The drafter's context
    cache is extended every round either way (its state is DFlash's), and when every row has a match the drafter
    forward is skipped (`lax.cond`: at batch 1 a round then costs what an n-gram round costs).
    """

    dflash: DFlashProposer
    ngram: NGramProposer = NGramProposer()
    name: str = "hybrid"

    def propose_scored(self, params, target, state, history_BC, n_B, k):
        looked_up, match_len_B = self.ngram.lookup(history_BC, n_B, k)
        draft = lambda: self.dflash.propose_scored(params, target, state, history_BC, n_B, k)
        return _drafter_where_unsure(match_len_B > 0, looked_up, lookup_source(match_len_B), draft)


@dataclasses.dataclass(frozen=True)
class ReplyHybridProposer(_WithDrafter):
    """Reply lookup where it is confident (`ReplyLookupProposer.choose` with `min_prob`), the DFlash block elsewhere,
    chosen per row and round. `params` is (drafter, ReplyIndex); the drafter's state is DFlash's, and its forward is
    skipped when every row is confident. With a drafter whose first draft is accepted about as often as the
    replies' on average, the replies' own confidence says where each is the better guess: a reply n-gram followed
    by one token most of the time is accepted far more often than one followed by many."""

    dflash: DFlashProposer
    replies: ReplyLookupProposer = ReplyLookupProposer()
    min_prob: float = 0.6
    name: str = "replies-hybrid"

    def drafter(self, params):
        return self.dflash, params[0]

    def propose_scored(self, params, target, state, history_BC, n_B, k):
        drafter, index = params
        tokens, source_B, confident_B = self.replies.choose(index, history_BC, n_B, k, self.min_prob)
        draft = lambda: self.dflash.propose_scored(drafter, target, state, history_BC, n_B, k)
        return _drafter_where_unsure(confident_B, tokens, source_B, draft)


def _drafter_where_unsure(sure_B, tokens, source_B, draft) -> Proposal:
    """The given drafts where sure_B, the drafter's (`draft()`, a Proposal) elsewhere; the drafter forward runs only
    when some row is unsure (`lax.cond`: at batch 1 a sure round costs what a lookup round costs)."""
    every_row_sure = jnp.all(sure_B)
    model = jax.lax.cond(
        every_row_sure,
        lambda: Proposal.unscored(tokens, DRAFTER, False),  # placeholder: every row takes the given drafts
        draft,
    )
    return Proposal(
        jnp.where(sure_B[:, None], tokens, model.tokens).astype(jnp.int32),
        jnp.where(sure_B[:, None], jnp.nan, model.prob),
        jnp.where(sure_B, source_B, DRAFTER).astype(jnp.int32),
        ~every_row_sure,
    )
