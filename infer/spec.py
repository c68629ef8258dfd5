"""Speculative decoding engine: prefill, then draft / verify / accept / commit rounds in one jitted while_loop.

One engine serves every proposer (DFlash, n-gram prompt lookup, none), so the plain baseline (proposer none,
K = 1) and a speculative run differ only in the proposer and K. Prefill and the decode loop are separate
jitted calls so that decode can be timed alone; the loop runs entirely on device and the host sees the
results once the whole batch has finished.

Positions, row b: the committed sequence is history[b, :n[b]]. Its last token, at `start = n - 1`, was
produced but has not been through the target yet, so the target cache and the drafter's context both hold
exactly the positions < start. A round runs the block [last, d_1 .. d_{K-1}] at positions start .. start+K-1.

Dimension letters: docs/glossary.md (one glossary for the repository). Here C = P + max_new_tokens + K.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import time
import weakref
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np

from dflash_model.target import KVCache, config_of, forward
from infer.plain import pad_prompts, truncate_at_stop
from infer.proposers import DRAFTER, LOOKUP_TREE, SOURCES, NoProposer, Proposal, scored
from infer.tree import build_tree, walk_tree

# Trace counts of the jitted steps (incremented only while tracing): tests check one compile per shape bucket.
TRACES: collections.Counter = collections.Counter()

# The widest block K and the largest draft tree an engine accepts. A round's arrays grow with K (and a tree's
# attention with its nodes squared): K = 100000 compiled for minutes while memory grew. Both are bounded by the
# target's positions too (`check_positions`).
MAX_BLOCK = 1024
MAX_TREE_NODES = 1024


def check_positions(prompt_tokens: int, max_new_tokens: int, width: int, positions: int, name: str = "a prompt"):
    """Refuse a decode that would run past the target's positions: a prompt of P tokens, max_new_tokens more and a
    last verify of `width` tokens (K, or a tree's nodes + 1) need P + max_new_tokens + width of them (the decode's
    cache, C = P + max_new_tokens + K). Past them RoPE runs on positions the model never saw: quietly wrong."""
    need = prompt_tokens + max_new_tokens + width
    if need > positions:
        raise ValueError(
            f"{name}: a prompt of {prompt_tokens} + {max_new_tokens} new tokens + a verify of {width} = {need} "
            f"positions, more than the target's {positions} (max_position_embeddings): shorten the prompt or lower "
            "--max-new-tokens"
        )


@flax.struct.dataclass
class DecodeState:
    history: jax.Array  # [B, C] committed tokens (prompt, then generated); beyond n[b] scratch
    prompt_len: jax.Array  # [B]
    n: jax.Array  # [B] committed tokens (prompt + generated)
    done: jax.Array  # [B] bool: stop token committed or max_new_tokens reached
    stop_ids: jax.Array  # [Y] ids that end a row, padded with -1 (data, not static: one compile for any set)
    cache: KVCache  # target K/V of positions < n - 1
    draft: Any  # proposer state (DFlash: its context cache, also of positions < n - 1)
    key: jax.Array  # sampling key (unused at temperature 0)
    rounds: jax.Array  # [] verify rounds run so far
    accept: jax.Array  # [B, I] tokens committed by each verify round, bonus included (0 = row was done)
    proposals: jax.Array  # [B, I, K-1] the drafts of each round
    widths: jax.Array  # [I] tokens verified by each round (the last token and widths - 1 drafts)
    drafted: jax.Array  # [I] bool: the round ran a drafter forward (the hybrid skips it when every row matched)
    tries: jax.Array  # [sources, K-1] rounds where draft j was verified after drafts 1..j-1 were accepted
    hits: jax.Array  # [sources, K-1] ... and draft j was accepted too (adaptive engines choose widths from these)
    verify_ms_Z: jax.Array  # [Z] adaptive: measured cost of verifying each candidate width (data: no recompile)
    draft_ms: jax.Array  # [] adaptive: measured cost of the drafter's forward
    nonfinite: jax.Array  # [] bool: some target logit was NaN or inf (its argmax, token 0, would be reported)


def accept_length(drafts_BK1, target_BK):
    """Accepted drafts a in [0, K-1]: the longest prefix where d_j == target token j-1.

    target_BK[:, j] is the target's token for position start+j+1 given the block prefix up to j, so draft
    d_{j+1} (drafts[:, j]) is right iff it equals target[:, j]; a = sum_j prod_{i<=j} [d_{i+1} == target_i].
    """
    return jnp.sum(jnp.cumprod(drafts_BK1 == target_BK[:, :-1], axis=1), axis=1).astype(jnp.int32)


def _pick(logits_BxV, temperature: float, key):
    """The target's token: argmax, or a sample from softmax(logits / T)."""
    if temperature == 0:
        return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, logits_BxV / temperature, axis=-1).astype(jnp.int32)


def _is_stop(tokens, stop_Y):
    return jnp.any(tokens[..., None] == stop_Y, axis=-1)


@jax.named_scope("choose_width")
def choose_width(conf_BJ, live_B, widths: tuple[int, ...], cost_Z):
    """Index into `widths` of the verify width with the most expected committed tokens per unit of cost.

    conf_BJ[b, j-1]: probability that draft j of row b is right given drafts 1..j-1 were (a row's K-1 drafts);
    verifying w tokens commits 1 + sum_{j < w} prod_{i <= j} conf[b, i-1] in expectation (the bonus plus the
    accepted drafts). cost_Z: the round's cost at each width (same unit). Rows that are done count for nothing.
    """
    reach_BJ = jnp.cumprod(conf_BJ, axis=1)  # P(drafts 1..j all accepted)
    return _best_rate(reach_BJ, live_B, widths, cost_Z)


def _best_rate(reach_BJ, live_B, widths, cost_Z):
    """argmax over widths of (expected committed tokens, summed over live rows) / cost, where verifying w tokens
    commits 1 + sum_{j < w} reach[b, j-1] in expectation: reach[b, j-1] is the probability that the j-th verified
    draft (a chain's draft j, a tree's node j in pop order) is on the accepted path."""
    expected_BK = 1.0 + jnp.concatenate([jnp.zeros_like(reach_BJ[:, :1]), jnp.cumsum(reach_BJ, axis=1)], axis=1)
    expected_BZ = expected_BK[:, jnp.asarray(widths) - 1]
    rate_Z = jnp.sum(jnp.where(live_B[:, None], expected_BZ, 0.0), axis=0) / cost_Z
    return jnp.argmax(rate_Z).astype(jnp.int32)


def measured_rates(tries, hits, prior_weight: float = 4.0):
    """[sources, K-1] acceptance rate of draft j given drafts 1..j-1 were accepted, per source: what an adaptive
    engine uses where the proposer gives no probability.

    Each position's count is shrunk towards its source's rate pooled over positions ((hits + 1) / (tries + 2)),
    worth `prior_weight` rounds. Without the pooling a position never verified keeps an even prior, so a
    proposer whose first drafts are nearly always right is still never verified wide enough to show it.
    """
    pooled = (jnp.sum(hits, axis=1) + 1.0) / (jnp.sum(tries, axis=1) + 2.0)
    return (hits + prior_weight * pooled[:, None]) / (tries + prior_weight)


@jax.named_scope("verify")
def _verify(target, proposer, st: DecodeState, last_B, drafts_BJ, key, *, width, k, temperature, branch=False):
    """Target forward over [last, d_1 .. d_{width-1}] from the cache at `start`; the target's tokens and the layer
    features padded to K (so every width returns one shape), the accepted count, the grown cache.

    branch (a width of the adaptive round's `lax.switch`): the cache is only read, and the new positions' K/V,
    padded to K, come back instead of it, for `KVCache.append` after the switch. A cache written inside a branch
    is copied whole, several times, by XLA:CPU; outside a switch the forward's own write is the one in place
    (appending after an unswitched forward made XLA copy the cache too: docs/results/decoding/cache-write/)."""
    out = forward(
        target,
        jnp.concatenate([last_B[:, None], drafts_BJ[:, : width - 1]], axis=1),
        st.cache,
        layer_ids=proposer.layer_ids,
        write_cache=not branch,
    )
    # target_tok[:, j] ~ p(x_{start+j+1} | committed, d_1..d_j). Greedy: argmax. T > 0: an independent sample
    # per position; drafts stay greedy, so accepting d_{j+1} iff it equals the sample is rejection sampling
    # with a one-hot proposal (accept w.p. p(d), else a sample from p restricted to x != d): lossless.
    TRACES[f"verify@{width}"] += 1
    target_tok = _pick(out.logits, temperature, key)
    a = accept_length(drafts_BJ[:, : width - 1], target_tok)
    target_tok, feats, new_kv = _pad_positions(k, target_tok, out.features, out.new_kv if branch else None)
    nonfinite = ~jnp.all(jnp.isfinite(out.logits))
    return target_tok, a, feats, (new_kv if branch else out.cache), nonfinite


def _pad_positions(size, tok_BT, feats_BTF, new_kv):
    """A verify's per-position outputs (tokens [B, T], features [B, T, F] or None, new K/V [L, B, T, G, H] or None)
    padded to `size` positions, so every branch of a width switch returns one shape."""
    pad = size - tok_BT.shape[1]
    tok = jnp.pad(tok_BT, ((0, 0), (0, pad)))
    feats = None if feats_BTF is None else jnp.pad(feats_BTF, ((0, 0), (0, pad), (0, 0)))
    kv = None if new_kv is None else tuple(jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0), (0, 0))) for x in new_kv)
    return tok, feats, kv


@jax.named_scope("tree_round")
def _verify_tree(target, proposer, params, st: DecodeState, last_B, key, *, k, tree, temperature, widths, cost_Z):
    """A tree round's verify: the tree (DDTree: the best `nodes` prefixes of the drafter's top tokens per position;
    or the proposer's own grown tree), one target forward over its nodes (tree attention; with `widths`, over the
    first w nodes, w chosen per round), the walk. The target's tokens along the path, the accepted count, the
    path's features, a cache whose path entries sit where a sequential verify puts them, the verified width."""
    nodes, top = tree
    if hasattr(proposer, "propose_tree"):  # a tree grown node by node (proposers.LookupTreeProposer)
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
        target_tok_BE = _pick(out.logits, temperature, key)  # at T > 0 an independent sample per node
        width = jnp.int32(nodes + 1)
        feats_BE, cache, nonfinite = out.features, out.cache, ~jnp.all(jnp.isfinite(out.logits))
    else:
        # Verify the first w nodes in pop order (a tree: every node's parent was popped before it), w chosen from
        # their path probabilities (score_BE: the chance each is on the accepted path) and the measured costs.
        choice = _best_rate(score_BE[:, 1:], ~st.done, widths, cost_Z)
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
    return prop, committed, a, feats, cache, nonfinite, width


def _verify_tree_nodes(target, proposer, st, node_tok_BE, tr, key, *, width, temperature):
    """A branch of the adaptive tree round: the target forward over the first `width` nodes, reading the cache
    only (as `_verify(branch=True)`); the target's tokens, features and the nodes' K/V padded to all E nodes."""
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
    target_tok, feats, kv = _pad_positions(e, _pick(out.logits, temperature, key), out.features, out.new_kv)
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


def _round(target, proposer, params, st: DecodeState, *, k, temperature, max_new, widths, tree) -> DecodeState:
    """One draft -> verify -> accept -> commit round for every row (finished rows run along, change nothing).

    widths None: every round verifies the whole block of K. Otherwise the round verifies the first w of it, w
    from `widths` (each a branch of one lax.switch, so each compiles once) chosen by `choose_width` from the
    proposer's confidence (or, where it has none, the acceptance measured so far for the row's source) and the
    measured cost of a round at each width. tree (nodes, top): a tree round (`_verify_tree`: DDTree, or the proposer's
    own tree), with widths the first w of its nodes, w chosen by `_best_rate` from the nodes' path probabilities."""
    b = st.n.shape[0]
    start = st.n - 1
    last = jnp.take_along_axis(st.history, start[:, None], axis=1)[:, 0]
    key = jax.random.fold_in(st.key, st.rounds)
    live = ~st.done
    if tree is not None:
        cost_Z = None if widths is None else st.verify_ms_Z + st.draft_ms
        prop, target_tok, a, feats, cache, nonfinite, width = _verify_tree(
            target,
            proposer,
            params,
            st,
            last,
            key,
            k=k,
            tree=tree,
            temperature=temperature,
            widths=widths,
            cost_Z=cost_Z,
        )
    elif widths is None:
        prop = scored(proposer, params, target, st.draft, st.history, st.n, k)
        target_tok, a, feats, cache, nonfinite = _verify(
            target, proposer, st, last, prop.tokens, key, width=k, k=k, temperature=temperature
        )
        width = jnp.int32(k)
    else:
        prop = scored(proposer, params, target, st.draft, st.history, st.n, k)
        measured_BJ = measured_rates(st.tries, st.hits)[prop.source]
        conf = jnp.where(jnp.isnan(prop.prob), measured_BJ, prop.prob)
        cost_Z = st.verify_ms_Z + jnp.where(prop.drafted, st.draft_ms, 0.0)
        choice = choose_width(conf, live, widths, cost_Z)
        branches = [
            functools.partial(_verify, target, proposer, width=w, k=k, temperature=temperature, branch=True)
            for w in widths
        ]
        target_tok, a, feats, kv, nonfinite = jax.lax.switch(choice, branches, st, last, prop.tokens, key)
        cache = st.cache.append(*kv)  # positions past the chosen width hold padding, above what crop keeps
        width = jnp.asarray(widths, jnp.int32)[choice]
    drafts = prop.tokens  # [B, K-1]; a tree round records its likeliest chain (DDTree: the drafter's greedy block)
    # Draft j was tried when it was verified and drafts 1..j-1 were accepted; hit when it was accepted too.
    j = jnp.arange(1, k)[None, :]
    tried_BJ = (live[:, None] & (j < width) & (a[:, None] >= j - 1)).astype(jnp.float32)
    hit_BJ = tried_BJ * (a[:, None] >= j)
    by_source = jax.nn.one_hot(prop.source, len(SOURCES), dtype=jnp.float32)  # [B, sources]

    # Commit target_tok[:, :a+1]: the first a equal the accepted drafts, target_tok[:, a] is the bonus (the
    # target's own token at the first mismatch, or after all verified drafts). Cut after a committed stop token.
    j = jnp.arange(k)
    stop_hit = _is_stop(target_tok, st.stop_ids) & (j[None, :] <= a[:, None])
    first_stop = jnp.min(jnp.where(stop_hit, j[None, :], k), axis=1)
    # Also cut at max_new: it keeps n <= P + max_new, so the K-wide writes below stay inside the capacity.
    room = max_new - (st.n - st.prompt_len)
    num_new = jnp.where(st.done, 0, jnp.minimum(jnp.minimum(a + 1, first_stop + 1), room))
    history = jax.vmap(lambda h, t, s: jax.lax.dynamic_update_slice(h, t, (s,)))(st.history, target_tok, st.n)
    n = st.n + num_new

    # Roll both caches back to the committed length n - 1: the target drops the K/V of rejected drafts; the
    # drafter gets the features of exactly the num_new committed positions start .. start+num_new-1.
    cache = cache.crop(n - 1)
    draft = proposer.observe(params, st.draft, feats, num_new)

    done = st.done | jnp.any(stop_hit, axis=1) | (n - st.prompt_len >= max_new)
    return st.replace(
        history=history,
        n=n,
        done=done,
        cache=cache,
        draft=draft,
        rounds=st.rounds + 1,
        accept=st.accept.at[:, st.rounds].set(jnp.where(st.done, 0, a + 1)),
        proposals=st.proposals.at[jnp.arange(b), st.rounds].set(drafts),
        widths=st.widths.at[st.rounds].set(width),
        drafted=st.drafted.at[st.rounds].set(prop.drafted),
        tries=st.tries + by_source.T @ tried_BJ,
        hits=st.hits + by_source.T @ hit_BJ,
        nonfinite=st.nonfinite | nonfinite,
    )


def _prefill_impl(
    target,
    proposer,
    params,
    ids_BP,
    lengths_B,
    key,
    stop_Y,
    verify_ms_Z,
    draft_ms,
    *,
    k,
    temperature,
    max_new,
    widths,
    tree,
):
    TRACES["prefill"] += 1
    b, p = ids_BP.shape
    capacity = p + max_new + max(k, tree[0] + 1 if tree else 0)  # a verify writes K (or a tree's nodes) slots
    out = forward(
        target,
        ids_BP,
        KVCache.init(config_of(target), b, capacity),
        layer_ids=proposer.layer_ids,
        logits_at=lengths_B - 1,
    )
    key, sub = jax.random.split(key)
    first = _pick(out.logits, temperature, sub)
    rows = jnp.arange(b)
    history = jnp.zeros((b, capacity), jnp.int32).at[:, :p].set(ids_BP).at[rows, lengths_B].set(first)
    draft = proposer.observe(params, proposer.init(params, b, capacity), out.features, lengths_B)
    rounds = max(max_new - 1, 1)  # each round commits >= 1 token and the prefill gave the first
    return DecodeState(
        history=history,
        prompt_len=lengths_B,
        n=lengths_B + 1,
        done=_is_stop(first, stop_Y) | (max_new <= 1),
        stop_ids=stop_Y,
        cache=out.cache.crop(lengths_B),
        draft=draft,
        key=key,
        rounds=jnp.int32(0),
        accept=jnp.zeros((b, rounds), jnp.int32),
        proposals=jnp.zeros((b, rounds, k - 1), jnp.int32),
        widths=jnp.zeros((rounds,), jnp.int32),
        drafted=jnp.zeros((rounds,), bool),
        tries=jnp.zeros((len(SOURCES), k - 1), jnp.float32),
        hits=jnp.zeros((len(SOURCES), k - 1), jnp.float32),
        verify_ms_Z=jnp.asarray(verify_ms_Z, jnp.float32),
        draft_ms=jnp.asarray(draft_ms, jnp.float32),
        nonfinite=~jnp.all(jnp.isfinite(out.logits)),
    )


def _decode_impl(target, proposer, params, st, *, k, temperature, max_new, widths, tree):
    TRACES["decode"] += 1
    step = functools.partial(
        _round, target, proposer, params, k=k, temperature=temperature, max_new=max_new, widths=widths, tree=tree
    )
    max_rounds = st.accept.shape[1]
    return jax.lax.while_loop(lambda s: (s.rounds < max_rounds) & ~jnp.all(s.done), step, st)


# Modules (target, DFlash drafter) are jit arguments as pytrees: their GraphDefs cannot be static arguments
# because Tunix's ModelConfig, held in them, is unhashable.
_STATIC = ("proposer", "k", "temperature", "max_new", "widths", "tree")
_prefill = jax.jit(_prefill_impl, static_argnames=_STATIC)
_decode = jax.jit(_decode_impl, static_argnames=_STATIC, donate_argnames=("st",))


def default_widths(k: int) -> tuple[int, ...]:
    """Candidate verify widths for an adaptive engine of block size K: 1 (a plain step), powers of two, K."""
    return tuple(sorted({1, k, *(w for w in (2, 4, 8, 16, 32, 64) if w < k)}))


# Cost probes: a verify at a given width, and the drafter's forward, each alone at the decode's shapes (the state
# after prefill). Each runs `reps` times inside one jitted fori_loop, its cache carried and written in place as in
# the decode loop (a standalone call would copy the cache and pay the Python dispatch of every module leaf, both
# absent from a round); `_loop_ms` takes the difference of two repetition counts, which cancels the per-call cost.
@functools.partial(jax.jit, static_argnames=("proposer", "width", "k"))
def _probe_verify(target, proposer, st, reps, *, width, k):
    last = jnp.take_along_axis(st.history, (st.n - 1)[:, None], axis=1)[:, 0]
    drafts = jnp.zeros((st.n.shape[0], k - 1), jnp.int32)

    def body(_, carry):
        cache, acc = carry
        tok, a, _, grown, _ = _verify(
            target, proposer, st.replace(cache=cache), last, drafts, st.key, width=width, k=k, temperature=0.0
        )
        return grown.crop(st.cache.lengths), acc + jnp.sum(tok) + jnp.sum(a)

    return jax.lax.fori_loop(0, reps, body, (st.cache, jnp.int32(0)))[1]


@functools.partial(jax.jit, static_argnames=("proposer", "k", "nodes"))
def _probe_draft(target, proposer, params, st, reps, *, k, nodes=None):
    """A draft (a grown tree's, with `nodes`) repeated `reps` times in one loop."""

    def body(i, acc):
        # The last token varies with i so that the loop body cannot be hoisted out as loop-invariant.
        history = st.history.at[jnp.arange(st.n.shape[0]), st.n - 1].add(i)
        if nodes is not None and hasattr(proposer, "propose_tree"):
            return acc + jnp.sum(proposer.propose_tree(params, target, st.draft, history, st.n, k, nodes)[1].token)
        return acc + jnp.sum(proposer.propose(params, target, st.draft, history, st.n, k))

    return jax.lax.fori_loop(0, reps, body, jnp.int32(0))


# id(target) -> (weakref to it, {(batch, capacity rounded up to 64, dtype, width): verify ms}): `Engine.calibrate`.
_VERIFY_MS: dict[int, tuple] = {}


def _loop_ms(fn, reps: int) -> float:
    """ms per repetition of fn(r) (r repetitions in one call): (time(1 + reps) - time(1)) / reps, each the fastest
    of three calls after a compile run; while that difference is not positive, up to twice more with 4x the reps
    (0 only when all three tries drown in noise). The fastest, not the median: other work on the CPU only ever
    adds time, and a burst of it during calibration would steer every round of the decode that follows (a
    calibration taken while a test ran beside it timed a width-2 verify at 36 ms, 19 ms on the quiet machine)."""

    def once(r):
        t = time.perf_counter()
        jax.block_until_ready(fn(r))
        return time.perf_counter() - t

    jax.block_until_ready(fn(1))  # compile (the count is data: one executable for every r)
    for _ in range(3):
        one = min(once(1) for _ in range(3))
        many = min(once(1 + reps) for _ in range(3))
        if many > one:
            break
        reps *= 4  # the machine's noise swallowed `reps` repetitions (a tiny model on a loaded CPU): time more
    return 1e3 * max(many - one, 0.0) / reps


@dataclasses.dataclass
class Generation:
    tokens: list[int]  # generated ids after the prompt, cut after the first stop id and at max_new_tokens
    accept_lengths: list[int]  # committed tokens per verify round, bonus included (before that cut)
    proposals: list[list[int]]  # the K-1 drafted ids of each round
    verify_widths: list[int] = dataclasses.field(default_factory=list)  # tokens verified by each round
    drafted: list[bool] = dataclasses.field(default_factory=list)  # whether each round ran a drafter forward


def checked_tree_prior(prior) -> dict[int, float]:
    """{tree size: expected committed tokens per round} as ints and floats, or ValueError where a size is below 1
    or a value is not finite and positive (NaN and Infinity parse from JSON)."""
    prior = {int(n): float(t) for n, t in prior.items()}
    if not prior or min(prior) < 1 or not all(0 < t < math.inf for t in prior.values()):
        raise ValueError(f"tree_prior needs sizes >= 1 with expected tokens per round > 0 and finite, got {prior}")
    return prior


class Engine:
    """A target + proposer + block size: `generate(prompts)`, or `prefill` and `decode` separately (timing).

    adaptive: verify only the first w tokens of each round's block, w in `widths` (default `default_widths(K)`)
    chosen per round by `choose_width` from the costs `calibrate` measures at the decode's own shapes (`generate`
    calibrates on its first call; call it yourself before `prefill` to time decode alone). tree_prior {nodes:
    expected committed tokens per round}: a grown tree's size is chosen by `calibrate` among these, from the same
    measured costs.
    """

    def __init__(
        self,
        target,
        proposer=None,
        params=None,
        *,
        block_size: int = 1,
        max_new_tokens: int,
        temperature: float = 0.0,
        stop_ids=(),
        adaptive: bool = False,
        widths: tuple[int, ...] | None = None,
        tree_nodes: int | None = None,
        tree_top: int = 4,
        tree_prior: dict[int, float] | None = None,
    ):
        proposer = proposer or NoProposer()
        if tree_prior is not None:
            # The tree size is chosen by `calibrate` among the prior's; until then the engine is the largest's.
            tree_prior = checked_tree_prior(tree_prior)
            if not hasattr(proposer, "propose_tree"):
                raise ValueError(
                    "a tree size chosen at start-up (tree_prior) needs a proposer that grows its own tree (a lookup "
                    f"tree), not {proposer.name}"
                )
            if tree_nodes is not None or adaptive:
                raise ValueError("tree_prior chooses the tree size: give it without tree_nodes and adaptive")
            tree_nodes = max(tree_prior)
            block_size = tree_nodes + 1  # a grown tree's paths are at most block_size - 1 deep
        self.tree_prior = tree_prior
        if block_size < 1:
            raise ValueError(f"block size must be >= 1, got {block_size}")
        if isinstance(proposer, NoProposer) and block_size != 1:
            raise ValueError("without a proposer the block size is 1 (plain decoding)")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        self.target = target
        self.proposer, self.params = proposer, params
        k = int(block_size)
        if widths is not None and not adaptive:
            raise ValueError("widths are the candidates of an adaptive engine: pass adaptive=True with them")
        if adaptive:
            widths = tuple(sorted({int(w) for w in (widths or default_widths(k))}))
            if not 1 <= widths[0] <= widths[-1] <= k or len(widths) < 2:
                raise ValueError(
                    f"adaptive widths must be at least two values in 1..{k} (the block size), got {widths}"
                )
        tree = None
        if tree_nodes is None and hasattr(proposer, "propose_tree") and not hasattr(proposer, "propose_scored"):
            raise ValueError(f"the {proposer.name} proposer drafts trees only: give tree_nodes")
        if tree_nodes is not None:
            if adaptive and not hasattr(proposer, "propose_tree"):
                raise ValueError(
                    "a DDTree sets its own width (its nodes): tree_nodes and adaptive exclude each other; an "
                    "adaptive tree needs a proposer that scores its nodes (propose_tree)"
                )
            if adaptive and widths[-1] > tree_nodes + 1:
                raise ValueError(f"adaptive tree widths must be at most its nodes + 1 = {tree_nodes + 1}, got {widths}")
            if not (hasattr(proposer, "propose_top") or hasattr(proposer, "propose_tree")):
                raise ValueError(
                    f"a draft tree needs per-position distributions or a tree; the {proposer.name} proposer has neither"
                )
            if not (tree_nodes >= 1 and tree_top >= 1 and k >= 2):
                raise ValueError(
                    f"a draft tree needs tree_nodes >= 1, tree_top >= 1, K >= 2; got {tree_nodes}, {tree_top}, {k}"
                )
            tree = (int(tree_nodes), int(tree_top))
        self.static = dict(k=k, temperature=float(temperature), max_new=int(max_new_tokens), widths=widths, tree=tree)
        self._check_sizes()
        # Costs (ms) of a verify at each candidate width and of the drafter's forward; `calibrate` measures them.
        self.costs: dict | None = None
        self.stop_ids = tuple(sorted({int(s) for s in stop_ids}))
        slots = 8 * max(1, -(-len(self.stop_ids) // 8))  # a few fixed sizes: the set is data, not a shape
        self.stop_Y = jnp.asarray(list(self.stop_ids) + [-1] * (slots - len(self.stop_ids)), jnp.int32)

    @property
    def block_size(self) -> int:
        return self.static["k"]

    @property
    def width(self) -> int:
        """The widest verify a round runs: K, or a tree's nodes + 1 (what the cache holds beyond the tokens)."""
        tree = self.static["tree"]
        return max(self.block_size, tree[0] + 1 if tree else 0)

    def _check_sizes(self) -> None:
        """K, a tree's nodes and a one-token prompt's decode against MAX_BLOCK, MAX_TREE_NODES and the target's
        positions, before anything compiles (`prefill` checks each prompt's own length)."""
        tree = self.static["tree"]
        if self.block_size > MAX_BLOCK:
            raise ValueError(f"block size K={self.block_size} is more than {MAX_BLOCK}")
        if tree and tree[0] > MAX_TREE_NODES:
            raise ValueError(f"a draft tree of {tree[0]} nodes is more than {MAX_TREE_NODES}")
        positions = config_of(self.target).max_position_embeddings
        check_positions(1, self.static["max_new"], self.width, positions, "max_new_tokens")

    @property
    def widths(self) -> tuple[int, ...]:
        """The verify widths this engine may use: its candidates, the block size alone, or a tree's nodes."""
        if self.static["widths"]:
            return self.static["widths"]
        if self.static["tree"]:
            return (self.static["tree"][0] + 1,)
        return (self.block_size,)

    @property
    def adaptive(self) -> bool:
        return self.static["widths"] is not None

    @property
    def needs_costs(self) -> bool:
        """Whether this engine decodes by measured costs (an adaptive width, a tree size chosen at start-up)."""
        return self.adaptive or self.tree_prior is not None

    def prefill(self, ids_BP, lengths_B, key) -> DecodeState:
        if self.needs_costs and self.costs is None:
            raise RuntimeError(
                "an adaptive engine (or one choosing its tree size) decodes by measured costs: call calibrate() first"
            )
        return self._prefill(ids_BP, lengths_B, key, self.costs)

    def _prefill(self, ids_BP, lengths_B, key, costs) -> DecodeState:
        positions = config_of(self.target).max_position_embeddings
        check_positions(int(np.max(lengths_B)), self.static["max_new"], self.width, positions, "the longest prompt")
        costs = costs or {"verify_ms": [0.0] * len(self.widths), "draft_ms": 0.0}  # unused by a fixed width
        return _prefill(
            self.target,
            self.proposer,
            self.params,
            ids_BP,
            lengths_B,
            key,
            self.stop_Y,
            jnp.asarray(costs["verify_ms"], jnp.float32),
            jnp.float32(costs["draft_ms"]),
            **self.static,
        )

    def calibrate(self, ids_BP, lengths_B, key, reps: int = 10) -> dict:
        """Time, at these inputs' decode shapes, a verify forward at each width and the drafter's forward, each
        alone (`reps` repetitions in one call, see `_loop_ms`): {"widths", "verify_ms": [per width], "draft_ms"}.
        Attention runs over the whole cache capacity, so the shapes, not the prompt's length, set the cost.

        With a tree_prior, first choose the tree size: the one whose expected committed tokens per round (the prior)
        over its measured round cost (verify over its nodes + growing the tree) is the highest on this machine; the
        costs then carry the choice and every size's numbers ("tree_choice"). A state prefilled before a call is
        stale after it (its shapes are the old size's)."""
        if self.tree_prior is None:
            self.costs = self._measure(ids_BP, lengths_B, key, reps)
            return self.costs
        before, top = dict(self.static), self.static["tree"][1]
        measured, table, dearest = {}, {}, 0.0
        try:
            for n, tau in sorted(self.tree_prior.items()):
                self.static.update(k=n + 1, tree=(n, top))
                measured[n] = c = self._measure(ids_BP, lengths_B, key, reps)
                # The rest of a round (the walk, commit, cache crop) is left out: 2-7% of a round in the measured
                # loop overheads, the same at every size, so leaving it out favours smaller trees by at most that.
                # A bigger tree never costs less: a measured dip is noise (each size is timed apart).
                dearest = max(dearest, c["verify_ms"][0] + c["draft_ms"], 1e-3)  # 1e-3: drowned in noise
                tps = round(1e3 * tau / dearest, 2)
                table[n] = {"tau": tau, "round_ms": round(dearest, 3), "tokens_per_s": tps}
        except BaseException:
            self.static = before  # as it was: a failed choice leaves the engine's size and its costs unchanged
            raise
        best = max(table, key=lambda n: table[n]["tokens_per_s"])
        self.static.update(k=best + 1, tree=(best, top))
        self.costs = {**measured[best], "tree_choice": {"nodes": best, "by_size": table}}
        return self.costs

    def _measure(self, ids_BP, lengths_B, key, reps: int) -> dict:
        st = self._prefill(ids_BP, lengths_B, key, None)  # the probes read shapes and caches, not costs
        k = self.block_size
        verify_ms = []
        for w in self.widths:
            # Measured once per target, width and cache shape in a process: every engine then chooses from the
            # same numbers (calibrations minutes apart differed by up to 1.5x on a busy machine).
            shape = (st.cache.k.shape[1], -(-st.cache.capacity // 64) * 64, str(st.cache.k.dtype), w)
            known = _VERIFY_MS.get(id(self.target))
            if known is None or known[0]() is not self.target:
                known = _VERIFY_MS[id(self.target)] = (weakref.ref(self.target), {})
            if shape not in known[1]:
                # A tree's verify is timed as a sequential one over as many tokens (the same matmuls, another mask).
                probe = lambda r, w=w: _probe_verify(self.target, self.proposer, st, r, width=w, k=max(k, w))
                known[1][shape] = _loop_ms(probe, reps)
            verify_ms.append(known[1][shape])
        # The cost of the model forward a round may pay: a hybrid's is its drafter's; a lookup is nearly free.
        model, params = (
            self.proposer.drafter(self.params) if hasattr(self.proposer, "drafter") else (self.proposer, self.params)
        )
        draft_ms = 0.0
        if k > 1:
            nodes = self.static["tree"][0] if self.static["tree"] else None
            draft_ms = _loop_ms(lambda r: _probe_draft(self.target, model, params, st, r, k=k, nodes=nodes), reps)
        # A wider verify never costs less; a measured dip is noise, and would make the choice chase it.
        return {
            "widths": list(self.widths),
            "verify_ms": np.maximum.accumulate(verify_ms).tolist(),
            "verify_ms_measured": verify_ms,
            "draft_ms": draft_ms,
        }

    def decode(self, state: DecodeState) -> DecodeState:
        """The whole decode loop on device (the state's buffers are donated: do not reuse `state`)."""
        return _decode(self.target, self.proposer, self.params, state, **self.static)

    def inputs(self, prompts: list[list[int]], seed: int = 0):
        """Device arrays (ids [B, bucket], lengths [B], key) for `prefill`."""
        ids, lengths = pad_prompts(prompts)
        return jnp.asarray(ids), jnp.asarray(lengths), jax.random.key(seed)

    def results(self, state: DecodeState) -> list[Generation]:
        history, plen, n, accept, proposals, widths, drafted, nonfinite = jax.device_get(
            (
                state.history,
                state.prompt_len,
                state.n,
                state.accept,
                state.proposals,
                state.widths,
                state.drafted,
                state.nonfinite,
            )
        )
        if nonfinite:
            # Target and drafter would both "agree" on argmax(NaN) = 0: a perfect tau for garbage.
            raise FloatingPointError(
                "the target produced NaN/inf logits while decoding (overflow in its dtype, or "
                "damaged weights): the tokens would be argmax(NaN) = 0; nothing is reported"
            )
        out = []
        for b in range(history.shape[0]):
            tokens = history[b, plen[b] : n[b]].tolist()
            rounds = int(np.count_nonzero(accept[b]))
            out.append(
                Generation(
                    truncate_at_stop(tokens, self.stop_ids),
                    accept[b, :rounds].tolist(),
                    proposals[b, :rounds].tolist(),
                    widths[:rounds].tolist(),
                    drafted[:rounds].tolist(),
                )
            )
        return out

    def generate(self, prompts: list[list[int]], seed: int = 0) -> list[Generation]:
        inputs = self.inputs(prompts, seed)
        if self.needs_costs and self.costs is None:
            self.calibrate(*inputs)
        return self.results(self.decode(self.prefill(*inputs)))
