"""Draft trees, a round strategy of infer/spec.py: verify a tree of drafts in one target forward (tree attention)
and commit the longest path the target agrees with.

DDTree (`infer.tree.build_tree`): the best `nodes` prefixes of the drafter's top tokens at each position. A
proposer may instead grow its own tree (`propose_tree`: the lookup tree). With adaptive widths, the round verifies
the first w nodes in pop order, w chosen from the nodes' path probabilities and the measured costs
(`infer.width_choice.best_rate`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dflash_model.target import forward
from infer.proposers import DRAFTER, LOOKUP_TREE, GrowsTree, Proposal
from infer.spec import TRACES, DecodePlan, DecodeState, Verified, pad_positions, pick
from infer.tree import build_tree, walk_tree
from infer.width_choice import best_rate


@jax.named_scope("tree_round")
def verify_tree(target, proposer, params, st: DecodeState, last_B, key, plan: DecodePlan) -> Verified:
    """A tree round's verify: the tree (DDTree: the best `nodes` prefixes of the drafter's top tokens per position;
    or the proposer's own grown tree), one target forward over its nodes (tree attention; with `widths`, over the
    first w nodes, w chosen per round), the walk. The target's tokens along the path, the accepted count, the
    path's features, a cache whose path entries sit where a sequential verify puts them, the verified width."""
    (nodes, top), k, widths, temperature = plan.tree, plan.k, plan.widths, plan.temperature
    cost_Z = None if widths is None else st.strategy.verify_ms_Z + st.strategy.draft_ms
    if isinstance(proposer, GrowsTree):  # a tree grown node by node (proposers.LookupTreeProposer)
        score_BE, tr = proposer.propose_tree(params, target, st.draft, st.history, st.n, k, nodes)
        chain_BJ = _tree_chain(tr, k)
        # drafted: the tree's build is this proposer's draft cost, paid every round.
        prop = Proposal(
            chain_BJ, jnp.full(chain_BJ.shape, jnp.nan), jnp.full_like(last_B, LOOKUP_TREE), jnp.bool_(True)
        )
    else:
        tokens_BJO, logp_BJO = proposer.propose_top(params, target, st.draft, st.history, st.n, k, top)
        tr = build_tree(tokens_BJO, logp_BJO, nodes)
        prop = Proposal(tokens_BJO[..., 0], jnp.exp(logp_BJO[..., 0]), jnp.full_like(last_B, DRAFTER), jnp.bool_(True))
    node_tok = jnp.where(tr.valid, tr.token, 0).at[:, 0].set(last_B)
    if widths is None:
        out = forward(target, node_tok, st.cache, layer_ids=proposer.layer_ids, tree=(tr.depth, tr.visible))
        TRACES[f"tree@{nodes}"] += 1
        target_tok_BE = pick(out.logits, temperature, key)  # at T > 0 an independent sample per node
        width = jnp.int32(nodes + 1)
        feats_BE, cache, nonfinite = out.features, out.cache, ~jnp.all(jnp.isfinite(out.logits))
    else:
        # Verify the first w nodes in pop order (a tree: every node's parent was popped before it), w chosen from
        # their path probabilities (score_BE: the chance each is on the accepted path) and the measured costs.
        choice = best_rate(score_BE[:, 1:], ~st.done, widths, cost_Z)
        branches = [
            functools.partial(_verify_tree_nodes, target, proposer, width=w, temperature=temperature) for w in widths
        ]
        target_tok_BE, feats_BE, kv, nonfinite = jax.lax.switch(choice, branches, st, node_tok, tr, key)
        width = jnp.asarray(widths, jnp.int32)[choice]
        tr = tr.replace(valid=tr.valid & (jnp.arange(nodes + 1)[None, :] < width))
        cache = st.cache.append(*kv)  # the nodes past the chosen width hold padding, dropped by keep_path and crop
    path_BK, a = walk_tree(target_tok_BE, tr, k - 1)
    committed = jnp.take_along_axis(target_tok_BE, path_BK, axis=1)
    feats = None if feats_BE is None else jnp.take_along_axis(feats_BE, path_BK[..., None], axis=1)
    cache = cache.keep_path(st.cache.lengths, path_BK)
    return Verified(prop, committed, a, feats, cache, nonfinite, width, st.strategy)


def _verify_tree_nodes(target, proposer, st, node_tok_BE, tr, key, *, width, temperature):
    """A branch of the adaptive tree round: the target forward over the first `width` nodes, reading the cache
    only (as `infer.spec.verify_forward(branch=True)`); the target's tokens, features and the nodes' K/V padded to
    all E nodes."""
    e = node_tok_BE.shape[1]
    out = forward(
        target,
        node_tok_BE[:, :width],
        st.cache,
        layer_ids=proposer.layer_ids,
        tree=(tr.depth[:, :width], tr.visible[:, :width, :width]),
        write_cache=False,
    )
    TRACES[f"tree-verify@{width}"] += 1
    target_tok, feats, kv = pad_positions(e, pick(out.logits, temperature, key), out.features, out.new_kv)
    return target_tok, feats, kv, ~jnp.all(jnp.isfinite(out.logits))


def _tree_chain(tr, k):
    """[B, K-1] a grown tree's likeliest path (from each node its first child, the likeliest), what a tree round
    records as its drafts; 0 past its end."""
    e = tr.token.shape[1]
    node_E = jnp.arange(e)

    def step(cur_B, _):
        child_BE = (tr.parent == cur_B[:, None]) & tr.valid & (node_E > 0)
        has_B = jnp.any(child_BE, axis=1)
        nxt_B = jnp.where(has_B, jnp.argmax(child_BE, axis=1), 0).astype(jnp.int32)  # children pop likeliest first
        tok_B = jnp.where(has_B, jnp.take_along_axis(tr.token, nxt_B[:, None], axis=1)[:, 0], 0)
        return jnp.where(has_B, nxt_B, e), tok_B  # e: past the end, no node's parent

    _, chain = jax.lax.scan(step, jnp.zeros((tr.token.shape[0],), jnp.int32), None, length=k - 1)
    return chain.T.astype(jnp.int32)
