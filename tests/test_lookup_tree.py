"""The lookup tree (proposers.LookupTreeProposer): a reply n-gram's followers and a context suffix's followers
against dict-of-counts references, and `tree.grow_tree` against brute-force enumeration of every path."""

import collections
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infer.proposers import LookupTreeProposer, context_followers
from infer.replies import FOLLOWERS, build_index, followers
from infer.tree import grow_tree


def test_reply_followers_are_the_most_frequent_with_their_shares():
    """Over random records of a 6-token vocabulary (many followers per n-gram): each row's followers of its longest
    indexed n-gram are the FOLLOWERS most frequent (ties to the smaller id), with count / the n-gram's count."""
    rng = np.random.default_rng(0)
    records = [rng.integers(0, 6, int(rng.integers(4, 40))).tolist() for _ in range(60)]
    table = collections.defaultdict(collections.Counter)
    for ids in records:
        for i in range(2, len(ids)):  # the first 2 tokens are a header, not reply
            for n in (2, 3, 4):
                if i - n >= 0:
                    table[tuple(ids[i - n : i])][ids[i]] += 1
    ids = np.concatenate(records).astype(np.int32)
    mask = np.concatenate([[i >= 2 for i in range(len(r))] for r in records])
    index = build_index(ids, mask, np.cumsum([0] + [len(r) for r in records]), min_n=2, max_n=4)
    tails = rng.integers(0, 6, (50, 4)).astype(np.int32)
    avail = rng.integers(1, 5, 50).astype(np.int32)
    tok, share, order = followers(index, jnp.asarray(tails), jnp.asarray(avail))
    for b in range(50):
        want_n = next((n for n in (4, 3, 2) if avail[b] >= n and tuple(tails[b, -n:]) in table), 0)
        assert int(order[b]) == want_n
        if want_n == 0:
            assert float(jnp.sum(share[b])) == 0.0
            continue
        counts = table[tuple(tails[b, -want_n:])]
        ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:FOLLOWERS]
        got = [(int(t), float(s)) for t, s in zip(tok[b], share[b]) if s > 0]
        assert [t for t, _ in got] == [t for t, _ in ranked]
        np.testing.assert_allclose([s for _, s in got], [c / sum(counts.values()) for _, c in ranked], rtol=1e-6)


def _context_reference(seq, max_n, fanout):
    """(followers, most frequent first, ties to the latest occurrence; their shares; the suffix length)."""
    for n in range(max_n, 0, -1):
        if len(seq) < n + 1:
            continue
        ends = [i for i in range(n - 1, len(seq) - 1) if seq[i - n + 1 : i + 1] == seq[-n:]]
        if ends:
            follow = [seq[i + 1] for i in ends]
            counts = collections.Counter(follow)
            last = {t: max(i for i, x in enumerate(follow) if x == t) for t in counts}
            ranked = sorted(counts, key=lambda t: (-counts[t], -last[t]))[:fanout]
            return ranked, [counts[t] / len(ends) for t in ranked], n
    return [], [], 0


@pytest.mark.parametrize("vocab", [4, 9])
def test_context_followers_equal_a_count_of_earlier_occurrences(vocab):
    """Random rows of a small vocabulary, scored at every length (stale tokens past it never read)."""
    rng = np.random.default_rng(vocab)
    fn = jax.jit(lambda s, n: context_followers(s, n, 3, 4, vocab))
    for _ in range(6):
        seq = rng.integers(0, vocab, 24).astype(np.int32)
        for length in range(1, 25):
            tok, share, order = fn(jnp.asarray(seq), jnp.int32(length))
            want_tok, want_share, want_n = _context_reference(seq[:length].tolist(), 3, 4)
            assert int(order) == want_n
            k = len(want_tok)
            assert np.asarray(tok[:k]).tolist() == want_tok, (seq[:length], tok, want_tok)
            np.testing.assert_allclose(np.asarray(share[:k]), want_share, rtol=1e-6)
            assert float(jnp.sum(share[k:])) == 0.0


def test_grow_tree_keeps_the_likeliest_paths_best_first():
    """A made-up conditional proposal (3 children per node, probabilities a function of the path): the grown tree's
    nodes are the `nodes` likeliest paths of a brute-force enumeration, popped in order of probability, each
    node's parent its path minus the last token and each node seeing exactly its ancestors and itself."""
    fanout, nodes, max_depth = 3, 9, 4

    def probs(path):  # a deterministic, path-dependent distribution over 3 of 50 tokens, summing to < 1
        r = np.random.default_rng(hash(tuple(path)) % 2**32)
        tok = r.choice(50, fanout, replace=False)
        p = r.dirichlet(np.ones(fanout)) * 0.9
        return tok, p

    table = {}
    # Enumerate every path up to max_depth through the proposal (3**4 leaves).
    scored, frontier = [], [((), 1.0)]
    while frontier:
        path, s = frontier.pop()
        tok, p = probs(path)
        table[path] = (tok, p)
        for t, q in zip(tok, p):
            child = (*path, int(t))
            scored.append((s * q, child))
            if len(child) < max_depth:
                frontier.append((child, s * q))
    best = sorted(scored, key=lambda x: -x[0])[:nodes]

    def children(path_D, depth):
        def host(path, d):  # a node at max_depth is asked too (its children go unused): none
            tok, p = table.get(tuple(int(x) for x in path[: int(d)]), (np.zeros(fanout), np.zeros(fanout)))
            return tok.astype(np.int32), p.astype(np.float32)

        shapes = (jax.ShapeDtypeStruct((fanout,), jnp.int32), jax.ShapeDtypeStruct((fanout,), jnp.float32))
        return jax.pure_callback(host, shapes, path_D, depth)

    score, tree = grow_tree(children, nodes, fanout, max_depth)
    paths = {0: ()}
    for i in range(1, nodes + 1):
        assert bool(tree.valid[i])
        parent = int(tree.parent[i])
        assert parent < i
        paths[i] = (*paths[parent], int(tree.token[i]))
        assert int(tree.depth[i]) == len(paths[i])
        ancestors = {j for j in paths if paths[j] == paths[i][: len(paths[j])]}
        assert set(np.flatnonzero(np.asarray(tree.visible[i])).tolist()) == ancestors
    assert [paths[i] for i in range(1, nodes + 1)] == [p for _, p in best]
    np.testing.assert_allclose(np.asarray(score[1:]), [s for s, _ in best], rtol=1e-5)


def _reference_children(seq, table, proposer: LookupTreeProposer, index_max_n: int):
    """{token: probability} of every candidate after seq, as LookupTreeProposer.children scores them (before its
    top-`fanout` cut): context followers (top FOLLOWERS) and reply followers (top FOLLOWERS), weighted, merged."""
    ctx_tok, ctx_share, ctx_n = _context_reference(seq, proposer.max_n, FOLLOWERS)
    p = {t: proposer.context_weight[ctx_n] * s for t, s in zip(ctx_tok, ctx_share)}
    order = next((n for n in range(index_max_n, 0, -1) if len(seq) >= n and tuple(seq[-n:]) in table), 0)
    if order:
        counts = table[tuple(seq[-order:])]
        for t, c in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:FOLLOWERS]:
            q = proposer.reply_weight[order] * c / sum(counts.values())
            p[t] = 1 - (1 - p.get(t, 0.0)) * (1 - q)
    total = max(sum(p.values()), 1.0)
    return {t: q / total for t, q in p.items()}


def test_lookup_tree_nodes_are_scored_from_their_own_paths():
    """Two rows of different lengths, stale tokens past each: every node of the grown tree is a candidate of its
    parent's text (the committed tokens plus the parent's path) with the reference's probability, its path
    probability is its parent's times that, and its siblings are the likeliest candidates of that text."""
    vocab = 7
    rng = np.random.default_rng(3)
    records = [rng.integers(0, vocab, int(rng.integers(4, 30))).tolist() for _ in range(40)]
    table = collections.defaultdict(collections.Counter)
    for ids in records:
        for i in range(2, len(ids)):
            for n in (1, 2, 3, 4):
                if i - n >= 0:
                    table[tuple(ids[i - n : i])][ids[i]] += 1
    mask = np.concatenate([[i >= 2 for i in range(len(r))] for r in records])
    offsets = np.cumsum([0] + [len(r) for r in records])
    index = build_index(np.concatenate(records).astype(np.int32), mask, offsets, min_n=1, max_n=4)
    proposer = LookupTreeProposer()
    lengths = [3, 17]
    history = rng.integers(0, vocab, (2, 40)).astype(np.int32)  # past each length: stale tokens, never read
    target = SimpleNamespace(target_config=SimpleNamespace(vocab_size=vocab))
    nodes, k = 9, 10
    score, tree = jax.jit(lambda h, n: proposer.propose_tree(index, target, None, h, n, k, nodes))(
        jnp.asarray(history), jnp.asarray(lengths, jnp.int32)
    )
    for b, n in enumerate(lengths):
        paths = {0: ()}
        for i in range(1, nodes + 1):
            if not bool(tree.valid[b, i]):
                continue
            parent = int(tree.parent[b, i])
            text = history[b, :n].tolist() + list(paths[parent])
            cands = _reference_children(text, table, proposer, 4)
            tok = int(tree.token[b, i])
            assert tok in cands, (b, i, text, tok, cands)
            np.testing.assert_allclose(float(score[b, i]), float(score[b, parent]) * cands[tok], rtol=1e-5)
            kept = {
                int(tree.token[b, j]) for j in range(1, nodes + 1) if tree.valid[b, j] and tree.parent[b, j] == parent
            }
            assert cands[tok] >= max([q for t, q in cands.items() if t not in kept], default=0.0) - 1e-6
            paths[i] = (*paths[parent], tok)
        assert len(paths) > 3  # the tree grew past the root's children
