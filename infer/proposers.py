"""Draft proposers for the speculative engine: none (plain decoding), n-gram prompt lookup, prompt lookup backed by
the target's past replies, a draft tree grown from both lookups, DFlash, and the hybrids of DFlash with either lookup.

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
  propose_scored(...same...) -> Proposal     (optional: what an adaptive verify width is chosen from; `scored`
      gives proposers without it the defaults)
  propose_top(...same..., top) -> ([B, K-1, top] tokens, [B, K-1, top] log-probs)   (optional: a draft tree's)
  propose_tree(...same..., nodes) -> ([B, E] path probabilities, DraftTree)   (optional: a tree grown by the
      proposer itself, e.g. the lookup tree; the engine verifies it instead of building one from propose_top)

Dimension letters: docs/glossary.md (one glossary for the repository).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax
import jax
import jax.numpy as jnp

from dflash_model.drafter import DraftCache, extend_context, propose_scored, propose_top
from dflash_model.target import config_of
from infer.replies import FOLLOWERS, continue_rows, followers, row_tails
from infer.tree import grow_tree

# Where a row's drafts came from: an adaptive engine keeps a measured acceptance rate per source and position.
# Lookups are split by how far back the context agrees with the match (its match length, in buckets): inside a
# repetition loop the match is long and nearly every copied token is accepted, after a short chance match few
# are, and one rate for both would verify too little in loops and too much elsewhere.
MATCH_BUCKETS = (1, 2, 3, 4, 8, 16)  # lower bounds of the lookup buckets (a match has >= 1 token)
# "lookup 4-7": a lookup whose match is 4 to 7 tokens long (one name per bucket of MATCH_BUCKETS).
SOURCES = ("drafter", "repeat", "lookup 1", "lookup 2", "lookup 3", "lookup 4-7", "lookup 8-15", "lookup 16+")
DRAFTER, REPEAT, LOOKUP = 0, 1, 2  # LOOKUP: the first lookup bucket
LOOKUP_TREE_ORDERS = (1, 4)  # the reply n-gram orders (min_n, max_n) a lookup tree's index is built with
# Reply lookup (infer.replies) is split by how often its first draft followed its n-gram in the replies, so that an
# adaptive engine measures the acceptance of a near-certain continuation apart from a guess among many.
REPLY_BUCKETS = (0.0, 0.4, 0.6, 0.8)  # lower bounds of the reply-lookup buckets
SOURCES += ("replies <0.4", "replies 0.4-0.6", "replies 0.6-0.8", "replies 0.8+")
SOURCES += ("lookup tree",)  # a tree round's (its tries count verified nodes as depths: bookkeeping only)
LOOKUP_TREE = SOURCES.index("lookup tree")
REPLIES = SOURCES.index("replies <0.4")  # the first reply bucket


def _bucket(value_B, lower_bounds):
    """[B] index of the bucket each value falls in, buckets given by their ascending lower bounds."""
    return jnp.sum(value_B[:, None] >= jnp.asarray(lower_bounds[1:])[None, :], axis=1).astype(jnp.int32)


def lookup_source(match_len_B):
    """SOURCES index of a lookup whose match is match_len_B tokens long."""
    return LOOKUP + _bucket(match_len_B, MATCH_BUCKETS)


def reply_source(prob_B):
    """SOURCES index of a reply lookup whose first draft followed its n-gram this often (prob_B) in the replies."""
    return REPLIES + _bucket(prob_B, REPLY_BUCKETS)


@flax.struct.dataclass
class Proposal:
    tokens: jax.Array  # [B, K-1] int32 drafts
    prob: jax.Array  # [B, K-1] fp32 the proposer's probability that each draft is the target's token; NaN = none
    source: jax.Array  # [B] int32 index into SOURCES
    drafted: jax.Array  # [] bool: a drafter forward ran this round (its cost was paid)

    @classmethod
    def unscored(cls, tokens, source, drafted: bool) -> Proposal:
        """Drafts without a probability (NaN: the engine uses the acceptance rate it measured for `source`)."""
        source = jnp.broadcast_to(jnp.asarray(source, jnp.int32), tokens.shape[:1])
        return cls(tokens, jnp.full(tokens.shape, jnp.nan), source, jnp.bool_(drafted))


def scored(proposer, params, target, state, history_BC, n_B, k) -> Proposal:
    """`proposer.propose_scored` where it exists; otherwise its drafts with no confidence (NaN: the engine uses the
    rate it measured), counted as the drafter's, whose forward ran."""
    if hasattr(proposer, "propose_scored"):
        return proposer.propose_scored(params, target, state, history_BC, n_B, k)
    return Proposal.unscored(proposer.propose(params, target, state, history_BC, n_B, k), DRAFTER, True)


def last_tokens(history_BC, n_B):
    return jnp.take_along_axis(history_BC, (n_B - 1)[:, None], axis=1)[:, 0]


class Stateless:
    """The engine hooks of a proposer that reads no target features and keeps no state between rounds."""

    layer_ids: tuple[int, ...] = ()

    def init(self, params, batch, capacity):
        return ()

    def observe(self, params, state, feats_BTF, num_new_B):
        return state

    def propose(self, params, target, state, history_BC, n_B, k):
        return self.propose_scored(params, target, state, history_BC, n_B, k).tokens


@dataclasses.dataclass(frozen=True)
class NoProposer(Stateless):
    """No drafts: with K = 1 the engine is plain autoregressive decoding (the speedup denominator)."""

    name: str = "none"

    def propose(self, params, target, state, history_BC, n_B, k):
        return jnp.zeros((history_BC.shape[0], k - 1), jnp.int32)


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


def context_followers(seq_C, length, max_n: int, fanout: int, vocab: int):
    """The tokens that followed the earlier occurrences of the longest (<= max_n) suffix of seq_C[:length] that
    occurs earlier (one row): ([fanout] tokens, most frequent first, ties to the latest occurrence as prompt lookup
    prefers, [fanout] their share of those occurrences, 0 for none; [] the suffix's length n, 0 when not even the
    last token occurs earlier). A count per token over the vocabulary (one scatter) ranks them."""
    c = seq_C.shape[0]
    pos_C = jnp.arange(c, dtype=jnp.int32)
    match_C, order = jnp.zeros((c,), bool), jnp.int32(0)
    for n in range(max_n, 0, -1):
        m = suffix_matches(seq_C[None], jnp.asarray(length)[None], n)[0]
        take = (order == 0) & jnp.any(m)
        match_C, order = jnp.where(take, m, match_C), jnp.where(take, n, order)
    follow_C = seq_C[jnp.minimum(pos_C + 1, c - 1)]
    count_V = jnp.zeros((vocab,), jnp.float32).at[jnp.where(match_C, follow_C, vocab)].add(1.0, mode="drop")
    score_C = jnp.where(match_C, count_V[follow_C], 0.0)
    total = jnp.maximum(jnp.sum(match_C), 1)
    tokens, probs = [], []
    for _ in range(fanout):  # the most frequent follower, then the next among the others, ...
        best = jnp.max(score_C)
        j = jnp.argmax(jnp.where((score_C == best) & (best > 0), pos_C, -1))  # its latest occurrence
        tokens.append(jnp.where(best > 0, follow_C[j], 0))
        probs.append(best / total)
        score_C = jnp.where(follow_C == follow_C[j], 0.0, score_C)
    return jnp.stack(tokens).astype(jnp.int32), jnp.stack(probs), order


@dataclasses.dataclass(frozen=True)
class LookupTreeProposer(Stateless):
    """A draft tree from the two lookups (SuffixDecoding's idea, arXiv 2411.04975, on this project's lookups): each
    node's children are the tokens that followed its text's suffix earlier in the row's own context and in the
    target's past replies (`infer.replies`), each with an estimated probability of being the target's token, and
    the `nodes` likeliest paths are verified in one tree forward (`infer.tree.grow_tree`). A chain bets every
    verified position on one continuation; on text where the lookups' first guess is often wrong, a second guess
    at the first positions is worth more than an eighth draft.

    `params` is the `ReplyIndex`, best built with min_n=1 (`LOOKUP_TREE_ORDERS`): a reply's follower of the last
    token alone still beats no candidate. A candidate's probability is its share of its lookup's occurrences times how
    often such a share was right: the weights below, per lookup and n-gram order, are the least-squares slopes of
    acceptance against share on dev prompts (GSM8K 200-263, HumanEval 100-163, MT-Bench 40-79; the first 10 of each
    are the held-out eval prompts). A token both lookups propose gets 1 - (1 - p_context)(1 - p_replies), and a
    node's probabilities are scaled to sum to at most 1."""

    max_n: int = 8  # longest context suffix looked up
    fanout: int = 4  # children per node
    # By context suffix length 0..max_n; the slope of the longest is capped at 0.97 (1.04 measured).
    context_weight: tuple[float, ...] = (0.0, 0.45, 0.7, 0.77, 0.85, 0.88, 0.89, 0.92, 0.97)
    reply_weight: tuple[float, ...] = (0.0, 0.3, 0.42, 0.5, 0.6)  # by reply n-gram order 0..index.max_n
    name: str = "lookup-tree"

    def propose(self, params, target, state, history_BC, n_B, k):
        raise ValueError("a lookup tree drafts a tree, not a chain: decode it with tree_nodes")

    def __post_init__(self):
        if len(self.context_weight) != self.max_n + 1:
            raise ValueError(f"context_weight needs one weight per suffix length 0..{self.max_n}")

    def children(self, index, seq_C, length, vocab: int):
        """([fanout] tokens, [fanout] probabilities) of the token after seq_C[:length] (one row)."""
        ctx_tok, ctx_share, ctx_order = context_followers(seq_C, length, self.max_n, FOLLOWERS, vocab)
        length = jnp.asarray(length)
        tail = row_tails(seq_C[None], length[None], index.max_n)  # a row shorter than max_n: avail says so
        rep_tok, rep_share, rep_order = followers(index, tail, jnp.minimum(length, index.max_n)[None])
        rep_tok, rep_share, rep_order = rep_tok[0], rep_share[0], rep_order[0]
        p_ctx = jnp.asarray(self.context_weight, jnp.float32)[ctx_order] * ctx_share
        p_rep = jnp.asarray(self.reply_weight, jnp.float32)[rep_order] * rep_share
        same = (ctx_tok[:, None] == rep_tok[None, :]) & (p_ctx[:, None] > 0) & (p_rep[None, :] > 0)
        p_ctx = 1.0 - (1.0 - p_ctx) * (1.0 - jnp.sum(jnp.where(same, p_rep[None, :], 0.0), axis=1))
        p_rep = jnp.where(jnp.any(same, axis=0), 0.0, p_rep)  # counted with the context's candidate
        tok, p = jnp.concatenate([ctx_tok, rep_tok]), jnp.concatenate([p_ctx, p_rep])
        p = p / jnp.maximum(jnp.sum(p), 1.0)
        p, at = jax.lax.top_k(p, self.fanout)
        return tok[at], p

    def propose_tree(self, params, target, state, history_BC, n_B, k, nodes: int):
        """([B, E] each node's path probability, DraftTree of E = nodes + 1, node 0 the last committed token), its
        paths at most k - 1 deep."""
        if params.max_n >= len(self.reply_weight):
            raise ValueError(
                f"reply_weight has weights for orders up to {len(self.reply_weight) - 1}, the index {params.max_n}"
            )
        vocab = config_of(target).vocab_size
        c = history_BC.shape[1]
        depth_max = k - 1

        def row(hist_C, n):
            def children(path_J, depth):
                at = jnp.arange(c) - n  # the path's tokens go at n .. n + depth - 1
                seq = jnp.where((at >= 0) & (at < depth), path_J[jnp.clip(at, 0, depth_max - 1)], hist_C)
                return self.children(params, seq, n + depth, vocab)

            return grow_tree(children, nodes, self.fanout, depth_max)

        return jax.vmap(row)(history_BC, n_B)


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


__all__ = [
    "SOURCES",
    "DFlashProposer",
    "HybridProposer",
    "LookupTreeProposer",
    "NGramProposer",
    "NoProposer",
    "Proposal",
    "ReplyHybridProposer",
    "ReplyLookupProposer",
    "last_tokens",
    "scored",
]
