"""A draft tree grown from both lookups (the context's and a reply file's n-gram followers), verified by a tree
round (infer/tree_round.py)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dflash_model.target import config_of
from infer.proposers.base import Stateless
from infer.proposers.ngram import suffix_matches
from infer.replies import FOLLOWERS, followers, row_tails
from infer.tree import grow_tree


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
