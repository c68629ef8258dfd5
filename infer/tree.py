"""Draft trees (DDTree): many candidate continuations from one drafter forward, verified in one target forward.

The drafter gives a distribution per block position (`dflash_model.drafter.propose_top`: its `top` likeliest
tokens at each). A draft tree holds the likeliest prefixes of those: a path that picks the rank-r_j token at
depth j scores sum_j logp[j, r_j], and the tree keeps the N best-scoring prefixes. Every prefix of a kept path
scores at least as high (log-probabilities are <= 0), so the set is a tree.

Best first without enumerating: each prefix has one successor of each kind, its first child (append the rank-0
token of the next depth) and its next sibling (raise its last rank by one), neither scoring higher than it; every
prefix is reached exactly once that way. Popping the best of a frontier N times, pushing both successors of each
pop, visits the N best prefixes in order with a frontier of at most 2N + 1 (fixed shapes: one compile per N).

`grow_tree` builds the other kind: a tree whose children depend on their parent's path (the lookup tree,
`proposers.LookupTreeProposer`), best first by path probability, each popped node's children computed from its
own path.

Node 0 is the root: the last committed token, at depth 0. Node i >= 1 was popped i-th, so its parent has a lower
index. The tree is hand-written: no JAX library builds or walks draft trees.

Dimension letters: docs/glossary.md (here E = nodes of a tree, root included; J = depths 1..K-1; O = ranks).
"""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class DraftTree:
    token: jax.Array  # [B, E] int32 the node's token (node 0: filled in by the caller with the last token)
    parent: jax.Array  # [B, E] int32 (node 0: 0)
    depth: jax.Array  # [B, E] int32 (node 0: 0)
    visible: jax.Array  # [B, E, E] bool: visible[i, m] iff m is i or one of its ancestors
    valid: jax.Array  # [B, E] bool: False for nodes past the available prefixes (never matched)

    @classmethod
    def root_only(cls, e: int) -> DraftTree:
        """One row's tree of E node slots holding only the root (node 0); the builders fill the others in order."""
        return cls(
            token=jnp.zeros((e,), jnp.int32),
            parent=jnp.zeros((e,), jnp.int32),
            depth=jnp.zeros((e,), jnp.int32),
            visible=jnp.eye(e, dtype=bool),
            valid=jnp.zeros((e,), bool).at[0].set(True),
        )

    def place(self, i, ok, token, parent, depth) -> DraftTree:
        """One row's tree with node i set to `token` under `parent` at `depth`, seeing its parent's ancestors and
        itself; where not ok (no candidate was left), node i stays invalid."""
        return self.replace(
            token=self.token.at[i].set(jnp.where(ok, token, 0)),
            parent=self.parent.at[i].set(jnp.where(ok, parent, 0)),
            depth=self.depth.at[i].set(jnp.where(ok, depth, 1)),
            visible=self.visible.at[i].set(self.visible[i] | (ok & self.visible[parent])),
            valid=self.valid.at[i].set(ok),
        )


@jax.named_scope("tree_build")
def build_tree(tokens_BJO, logp_BJO, nodes: int) -> DraftTree:
    """The `nodes` best-scoring prefixes of per-depth candidates (tokens_BJO[b, j, r]: rank-r token at depth j+1,
    best first; logp_BJO its log-probability), plus the root: a tree of E = nodes + 1."""
    return jax.vmap(lambda t, lp: _build_row(t, lp, nodes))(tokens_BJO, logp_BJO)


def _build_row(tok_JO, logp_JO, nodes: int) -> DraftTree:
    depths, ranks = tok_JO.shape
    e, f = nodes + 1, 2 * nodes + 1
    neg = jnp.float32(-jnp.inf)
    logp_JO = logp_JO.astype(jnp.float32)
    # Frontier: candidate prefixes, each its last (depth, rank), its parent node and its score; -inf = empty.
    frontier = dict(
        score=jnp.full((f,), neg).at[0].set(logp_JO[0, 0]),
        depth=jnp.ones((f,), jnp.int32),
        rank=jnp.zeros((f,), jnp.int32),
        parent=jnp.zeros((f,), jnp.int32),
    )
    tree = DraftTree.root_only(e)

    def pop(i, carry):
        fr, tr = carry
        best = jnp.argmax(fr["score"])
        ok = fr["score"][best] > neg
        d, r, par, score = fr["depth"][best], fr["rank"][best], fr["parent"][best], fr["score"][best]
        tr = tr.place(i, ok, tok_JO[d - 1, r], par, d)
        # Its first child goes to slot 2i - 1, its next sibling to slot 2i (each pop frees one slot, fills two).
        child_ok = ok & (d < depths)
        child = jnp.where(child_ok, score + logp_JO[jnp.minimum(d, depths - 1), 0], neg)
        sib_ok = ok & (r + 1 < ranks)
        sib = jnp.where(sib_ok, score - logp_JO[d - 1, r] + logp_JO[d - 1, jnp.minimum(r + 1, ranks - 1)], neg)
        fr = dict(
            score=fr["score"].at[best].set(neg).at[2 * i - 1].set(child).at[2 * i].set(sib),
            depth=fr["depth"].at[2 * i - 1].set(d + 1).at[2 * i].set(d),
            rank=fr["rank"].at[2 * i - 1].set(0).at[2 * i].set(r + 1),
            parent=fr["parent"].at[2 * i - 1].set(i).at[2 * i].set(par),
        )
        return fr, tr

    return jax.lax.fori_loop(1, e, pop, (frontier, tree))[1]


@jax.named_scope("tree_walk")
def walk_tree(target_tok_BE, tree: DraftTree, depths: int):
    """Follow the target down the tree: from the root, move to the child whose token is the target's token at the
    current node, while one exists. ([B, depths + 1] the path's nodes, root first, 0 past its end; [B] accepted
    drafts a). The committed tokens are target_tok at path[0..a]: the a accepted drafts, then the bonus token.

    Greedy, the target's token is its argmax; at T > 0 it is a sample per node from the target's distribution
    given that node's path, and the walk commits exactly those samples, so the output is distributed as the target
    alone would sample it, whatever the tree (which the drafter built without seeing the samples)."""
    b, e = target_tok_BE.shape
    node_E = jnp.arange(e)

    def step(j, carry):
        cur_B, path_BD, a_B, alive_B = carry
        want_B = jnp.take_along_axis(target_tok_BE, cur_B[:, None], axis=1)[:, 0]
        match_BE = (tree.parent == cur_B[:, None]) & (tree.token == want_B[:, None]) & tree.valid & (node_E > 0)
        found_B = alive_B & jnp.any(match_BE, axis=1)
        child_B = jnp.argmax(match_BE, axis=1).astype(jnp.int32)
        cur_B = jnp.where(found_B, child_B, cur_B)
        path_BD = path_BD.at[:, j].set(jnp.where(found_B, child_B, 0))
        return cur_B, path_BD, a_B + found_B, found_B

    init = (
        jnp.zeros((b,), jnp.int32),
        jnp.zeros((b, depths + 1), jnp.int32),
        jnp.zeros((b,), jnp.int32),
        jnp.ones((b,), bool),
    )
    _, path, a, _ = jax.lax.fori_loop(1, depths + 1, step, init)
    return path, a


def grow_tree(children, nodes: int, fanout: int, max_depth: int):
    """The `nodes` likeliest paths of a conditional proposal, best first, as a tree of E = nodes + 1 (one row;
    vmap it over rows). ([E] path probability of each node (root 1, 0 past the valid ones), DraftTree).

    children(path_J, depth) -> ([fanout] tokens, [fanout] probabilities) of the token after the draft path
    path_J[:depth] (depth 0: after the committed tokens), each a distinct token, probability 0 for none. A path's
    probability is the product of its tokens' probabilities, so every prefix of a kept path scores at least as high
    and the kept set is a tree. Unlike `build_tree`, whose per-depth candidates do not depend on the path, each
    popped node's children come from its own path (a lookup continues the text the path drafts). Each pop pushes
    its node's `fanout` children into a frontier of fanout * E slots; the last pop's are computed and unused."""
    e = nodes + 1
    tok0, p0 = children(jnp.zeros((max_depth,), jnp.int32), jnp.int32(0))
    slots = fanout * e
    frontier = dict(
        score=jnp.zeros((slots,), jnp.float32).at[:fanout].set(p0.astype(jnp.float32)),
        token=jnp.zeros((slots,), jnp.int32).at[:fanout].set(tok0),
        parent=jnp.zeros((slots,), jnp.int32),
        depth=jnp.zeros((slots,), jnp.int32).at[:fanout].set(1),
    )
    tree = DraftTree.root_only(e)
    paths_EJ = jnp.zeros((e, max_depth), jnp.int32)
    score_E = jnp.zeros((e,), jnp.float32).at[0].set(1.0)

    def pop(i, carry):
        fr, tr, paths_EJ, score_E = carry
        best = jnp.argmax(fr["score"])
        score, d, par, token = fr["score"][best], fr["depth"][best], fr["parent"][best], fr["token"][best]
        ok = score > 0
        path_J = paths_EJ[par].at[jnp.clip(d - 1, 0, max_depth - 1)].set(token)
        tr = tr.place(i, ok, token, par, d)
        tok_O, p_O = children(path_J, d)
        child_score = jnp.where(ok & (d < max_depth), score * p_O.astype(jnp.float32), 0.0)
        at = fanout * i + jnp.arange(fanout)
        fr = dict(
            score=fr["score"].at[best].set(0.0).at[at].set(child_score),
            token=fr["token"].at[at].set(tok_O),
            parent=fr["parent"].at[at].set(i),
            depth=fr["depth"].at[at].set(d + 1),
        )
        return fr, tr, paths_EJ.at[i].set(path_J), score_E.at[i].set(jnp.where(ok, score, 0.0))

    _, tree, _, score_E = jax.lax.fori_loop(1, e, pop, (frontier, tree, paths_EJ, score_E))
    return score_E, tree


__all__ = ["DraftTree", "build_tree", "grow_tree", "walk_tree"]
