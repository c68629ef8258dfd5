"""Speculative engine: the accept rule, n-gram lookup, lossless greedy output (n-gram, DFlash) on tiny Qwen3 and
Llama targets, drafter-state sync, stop tokens, compile-once and no host transfer inside the decode loop."""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_target

from dflash_model.drafter import DraftCache, build_drafter, extend_context
from dflash_model.drafter_config import drafter_config_for
from dflash_model.target import forward
from infer import spec
from infer.engine import Engine
from infer.plain import greedy_generate, truncate_at_stop
from infer.proposers import SOURCES, DFlashProposer, NGramProposer
from infer.spec import TRACES, accept_length

MAX_NEW = 24


def _prompts(seed=0):
    """Two rows of different lengths: one random, one a repeated 5-token motif (prompt lookup finds it)."""
    rng = np.random.default_rng(seed)
    motif = rng.integers(0, 512, 5).tolist()
    return [rng.integers(0, 512, 13).tolist(), motif * 4]


_TARGETS = {}


def _target(family):
    # Two layers: enough for the cache and feature plumbing, and each compile of the decode loop (the
    # dominant cost of these tests on a 2-core CPU) stays a few seconds.
    if family not in _TARGETS:
        _TARGETS[family] = tiny_target(family, num_hidden_layers=2)
    return _TARGETS[family]


_REFS = {}


def _plain(family, prompts, stop_ids=()):
    key = (family, str(prompts), tuple(stop_ids))
    if key not in _REFS:
        _REFS[key] = greedy_generate(_target(family), prompts, MAX_NEW, stop_ids=stop_ids)
    return _REFS[key]


def _check_records(gen, k):
    assert len(gen.accept_lengths) == len(gen.proposals)
    assert all(1 <= a <= k for a in gen.accept_lengths)
    assert all(len(p) == k - 1 for p in gen.proposals)
    # Every generated token after the prefill's first came from a verify round, and a round records what it output.
    assert sum(gen.accept_lengths) == len(gen.tokens) - 1
    assert len(gen.accept_lengths_uncut) == len(gen.accept_lengths)
    assert all(c <= u <= k for c, u in zip(gen.accept_lengths, gen.accept_lengths_uncut))


def test_accept_length_is_the_matching_prefix():
    drafts = jnp.asarray([[5, 6, 7], [5, 9, 7], [1, 6, 7], [5, 6, 8]])
    target = jnp.asarray([[5, 6, 7, 8]] * 4)  # target[:, j] is the target's token after block prefix j
    assert accept_length(drafts, target).tolist() == [3, 1, 0, 2]


def test_ngram_lookup_proposals():
    """Longest n-gram first, most recent match, repetition extended with the match's period, ignores
    anything past the committed length; no match repeats the last token."""
    pad = 99
    rows = [
        ([7, 1, 2, 3, 4, 5, 1, 2], [3, 4, 5, 1]),  # 3-gram [5,1,2] unseen; 2-gram [1,2] at 1..2 -> 3,4,5,1
        ([4, 4, 4], [4, 4, 4, 4]),  # run of one token: period 1
        ([1, 2, 3, 1, 2, 3, 1], [2, 3, 1, 2]),  # cycle of 3, continued past the committed end
        ([10, 11], [11, 11, 11, 11]),  # no earlier match
        ([5, 6, 5, 8, 5, 6], [5, 8, 5, 6]),  # 2-gram [5,6] at 0..1 -> 5,8,5,6 (period 4)
    ]
    width = 16
    hist = np.full((len(rows), width), pad, np.int32)
    for b, (h, _) in enumerate(rows):
        hist[b, : len(h)] = h
        hist[b, len(h) : len(h) + 2] = h[:2]  # stale tokens past n that would create false matches
    n = jnp.asarray([len(h) for h, _ in rows], jnp.int32)
    ngram = NGramProposer(max_n=3, min_n=1)
    got = jax.jit(ngram.propose, static_argnums=5)(None, None, (), jnp.asarray(hist), n, 5)
    assert got.tolist() == [want for _, want in rows]
    # Match lengths: how far back the context agrees from the match and from the end, and their sources.
    _, match_len = ngram.lookup(jnp.asarray(hist), n, 5)
    assert match_len.tolist() == [2, 2, 4, 0, 2]
    scored = ngram.propose_scored(None, None, (), jnp.asarray(hist), n, 5)
    assert [SOURCES[s] for s in scored.source.tolist()] == ["lookup 2", "lookup 2", "lookup 4-7", "repeat", "lookup 2"]


def test_measured_rates_pool_positions_until_each_has_counts():
    """A source accepted 9 times in 10 tries at draft 1 and never tried further: the pooled rate (9+1)/(10+2)
    fills in for draft 2 (untried) instead of an even 0.5, while draft 1 keeps nearly its own 0.9."""
    from infer.width_choice import measured_rates

    tries = jnp.asarray([[10.0, 0.0], [0.0, 0.0]])
    hits = jnp.asarray([[9.0, 0.0], [0.0, 0.0]])
    rates = np.asarray(measured_rates(tries, hits, prior_weight=4.0))
    pooled = 10 / 12
    np.testing.assert_allclose(rates[0], [(9 + 4 * pooled) / 14, pooled], rtol=1e-6)
    np.testing.assert_allclose(rates[1], [0.5, 0.5], rtol=1e-6)  # a source never seen: even odds


# K = 2, 4, 8, 16 are spread over the n-gram, DFlash and drafter-sync tests (each K is a compile).
@pytest.mark.parametrize("family,k", [("qwen3", 2), ("llama", 8)])
def test_greedy_ngram_equals_plain_greedy(family, k):
    """Batch of 2 rows at different prompt lengths; every token equals target-only greedy decoding (fp32).
    With a stop id (one of row 1's answer tokens) each row ends right after its first occurrence, even
    mid-block, exactly where plain greedy decoding would have stopped."""
    prompts = _prompts()
    ref = _plain(family, prompts)
    out = Engine(_target(family), NGramProposer(), block_size=k, max_new_tokens=MAX_NEW).generate(prompts)
    assert [g.tokens for g in out] == ref
    for g in out:
        _check_records(g, k)
    # The motif row must exercise partial and multi-token acceptance, not only the bonus path.
    assert max(out[1].accept_lengths) > 1

    stop = ref[1][9]
    stopped = Engine(_target(family), NGramProposer(), block_size=k, max_new_tokens=MAX_NEW, stop_ids=(stop,)).generate(
        prompts
    )
    assert [g.tokens for g in stopped] == [truncate_at_stop(r, (stop,)) for r in ref]
    assert len(stopped[1].tokens) <= 10


def test_the_decode_plan_is_one_frozen_value():
    """An engine's shape and strategy are one frozen DecodePlan (the jit's static argument), not a dict that can be
    changed under it: a change is a new plan (`dataclasses.replace`), as `calibrate` makes one."""
    import dataclasses

    engine = Engine(_target("qwen3"), NGramProposer(), block_size=4, max_new_tokens=8, adaptive=True)
    assert not hasattr(engine, "static")
    assert (engine.plan.k, engine.plan.max_new, engine.plan.widths, engine.block_size) == (4, 8, (1, 2, 4), 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        engine.plan.k = 16
    assert hash(engine.plan) == hash(dataclasses.replace(engine.plan))  # hashable: a static argument


def test_each_round_strategy_carries_only_its_own_state():
    """A fixed-block decode carries nothing for its strategy; an adaptive one its acceptance counts and measured
    costs (infer.width_choice.WidthState), counted by its own rounds: draft 1 is tried once per live row a round."""
    from infer.width_choice import WidthState

    prompts = _prompts()
    fixed = Engine(_target("qwen3"), NGramProposer(), block_size=4, max_new_tokens=MAX_NEW)
    st = fixed.decode(fixed.prefill(*fixed.inputs(prompts)))
    assert st.strategy is None
    adaptive = Engine(_target("qwen3"), NGramProposer(), block_size=4, max_new_tokens=MAX_NEW, adaptive=True)
    inputs = adaptive.inputs(prompts)
    adaptive.calibrate(*inputs, reps=2)
    st = adaptive.decode(adaptive.prefill(*inputs))
    assert isinstance(st.strategy, WidthState)
    assert st.strategy.tries.shape == (len(SOURCES), 3)
    widths = np.asarray(st.widths)[: int(st.rounds)]
    live_rounds = np.count_nonzero(np.asarray(st.accept)[:, : int(st.rounds)][:, widths > 1])
    assert float(np.sum(st.strategy.tries[:, 0])) == live_rounds


def test_batch_one_and_plain_engine():
    """Rows alone (batch 1) give the batch's tokens; proposer none with K=1 is plain decoding on this engine."""
    prompts = _prompts()
    ref = _plain("qwen3", prompts)
    target = _target("qwen3")
    for b, prompt in enumerate(prompts):
        alone = Engine(target, NGramProposer(), block_size=2, max_new_tokens=MAX_NEW).generate([prompt])[0]
        assert alone.tokens == ref[b]
    plain = Engine(target, max_new_tokens=MAX_NEW).generate(prompts)
    assert [g.tokens for g in plain] == ref
    assert all(g.accept_lengths == [1] * (MAX_NEW - 1) and g.proposals == [[]] * (MAX_NEW - 1) for g in plain)


def _reply_case():
    """(prompts, their plain greedy continuations, a reply index over other prompts' greedy replies and a corrupted
    copy of these prompts' own, so that reply drafts are both accepted and rejected)."""
    prompts = _prompts(seed=4)
    ref = _plain("qwen3", prompts)
    other = _prompts(seed=5)
    rows = [(p, r) for p, r in zip(other, _plain("qwen3", other))] + list(zip(prompts, _corrupted(ref)))
    return prompts, ref, _reply_index(rows)


def _corrupted(replies):
    """The replies with every 5th token changed (drafts from them are right, then wrong)."""
    return [[t if i % 5 else (t + 1) % 512 for i, t in enumerate(r)] for r in replies]


def _reply_index(rows, **kw):
    """A reply index (infer.replies.build_index) over (prompt, reply) rows, the replies' tokens indexed."""
    from infer.replies import build_index

    ids = np.concatenate([p + r for p, r in rows]).astype(np.int32)
    mask = np.concatenate([[False] * len(p) + [True] * len(r) for p, r in rows])
    return build_index(ids, mask, np.cumsum([0] + [len(p) + len(r) for p, r in rows]), **kw)


@pytest.mark.long
@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_reply_lookup_equals_plain_greedy(adaptive):
    """Reply lookup over an index of other prompts' greedy replies (and a corrupted copy of these prompts', so
    drafts are both accepted and rejected) equals plain greedy at batch 2 and 1, fixed and adaptive width; some
    drafts are accepted, and (counted by the adaptive round, which keeps per-source counts) some rounds draft from
    the replies and some of those drafts are accepted."""
    from infer.proposers import REPLIES, ReplyLookupProposer

    prompts, ref, index = _reply_case()
    engine = Engine(
        _target("qwen3"), ReplyLookupProposer(), index, block_size=8, max_new_tokens=MAX_NEW, adaptive=adaptive
    )
    if adaptive:
        engine.costs = {"widths": [1, 2, 4, 8], "verify_ms": [1.0, 1.1, 1.3, 1.8], "draft_ms": 0.0}
    state = engine.decode(engine.prefill(*engine.inputs(prompts)))
    assert [g.tokens for g in engine.results(state)] == ref
    assert [engine.generate([p])[0].tokens for p in prompts] == ref
    assert (np.asarray(state.accept) > 1).any()
    if adaptive:
        tries, hits = np.asarray(state.strategy.tries), np.asarray(state.strategy.hits)
        assert tries[REPLIES:].sum() > 0 and hits[REPLIES:, 0].sum() > 0, (tries, hits)


# --- DFlash ------------------------------------------------------------------------------------------------


def _tiny_drafter(family, seed=0):
    target = _target(family)
    cfg = drafter_config_for(
        target.target_config, mask_token_id=511, num_layers=1, block_size=16, target_layer_ids=(0, 1)
    )
    return cfg, build_drafter(cfg, seed=seed)


@dataclasses.dataclass(frozen=True)
class OracleMix:
    """Test proposer: runs the DFlash drafter (its proposals and its state), then overwrites the drafts with
    the known greedy continuation except where that true token is a multiple of 3 (pseudo-random positions),
    so that acceptance lengths vary from round to round and the drafter's state sync sees many counts."""

    inner: Any

    @property
    def layer_ids(self):
        return self.inner.layer_ids

    def init(self, params, batch, capacity):
        return self.inner.init(params["drafter"], batch, capacity)

    def observe(self, params, state, feats, num_new):
        return self.inner.observe(params["drafter"], state, feats, num_new)

    def propose(self, params, target, state, history, n, k):
        drafts = self.inner.propose(params["drafter"], target, state, history, n, k)
        j = jnp.arange(k - 1)[None, :]
        truth = jnp.take_along_axis(params["ref"], (n - params["plen"])[:, None] + j, axis=1)
        return jnp.where(truth % 3 == 0, drafts, truth)

    def propose_scored(self, params, target, state, history, n, k):
        """The same drafts, with confidence 0.95 where the true token was put in and 0.05 where the drafter's
        stands (an adaptive engine then verifies up to about the first drafter's draft)."""

        prop = self.inner.propose_scored(params["drafter"], target, state, history, n, k)
        j = jnp.arange(k - 1)[None, :]
        truth = jnp.take_along_axis(params["ref"], (n - params["plen"])[:, None] + j, axis=1)
        ours = truth % 3 == 0
        return prop.replace(tokens=jnp.where(ours, prop.tokens, truth), prob=jnp.where(ours, 0.05, 0.95))


def _oracle_params(drafter, prompts, ref, k):
    """OracleMix's params: the drafter, each row's greedy continuation padded past the last round, prompt lengths."""
    ref_arr = jnp.asarray([r + [0] * (MAX_NEW + k - len(r)) for r in ref], jnp.int32)
    return {"drafter": drafter, "ref": ref_arr, "plen": jnp.asarray([len(p) for p in prompts], jnp.int32)}


@dataclasses.dataclass(frozen=True)
class Oracle(OracleMix):
    """Test proposer: every draft is the target's own greedy continuation, so every round accepts all K-1."""

    def propose(self, params, target, state, history, n, k):
        j = jnp.arange(k - 1)[None, :]
        return jnp.take_along_axis(params["ref"], (n - params["plen"])[:, None] + j, axis=1)

    def propose_scored(self, params, target, state, history, n, k):
        prop = self.inner.propose_scored(params["drafter"], target, state, history, n, k)
        return prop.replace(tokens=self.propose(params, target, state, history, n, k))


def test_a_round_cut_at_the_budget_or_a_stop_counts_what_it_output():
    """A K=16 drafter that is always right, 24 new tokens: the prefill gives 1, round 1 commits 16, round 2 has room
    for 7 of its 16. tau counts 23 tokens over 2 rounds (11.5); z-lab's count, 16 + 16 over 2 rounds (16.0), is
    kept beside it. With a stop token at reply position p <= 16, the one round commits p tokens, not 16."""
    from infer import measure
    from infer.loading import Draft

    prompts = _prompts(seed=1)
    ref = _plain("qwen3", prompts)
    assert [len(r) for r in ref] == [MAX_NEW, MAX_NEW]
    # The oracle knows the reply past the budget too, so the last round's drafts are all right and overrun it.
    longer = greedy_generate(_target("qwen3"), prompts, MAX_NEW + 16)
    assert [r[:MAX_NEW] for r in longer] == ref
    cfg, drafter = _tiny_drafter("qwen3")
    params = _oracle_params(drafter, prompts, longer, 16)
    engine = Engine(_target("qwen3"), Oracle(DFlashProposer(cfg)), params, block_size=16, max_new_tokens=MAX_NEW)
    out = engine.generate(prompts)
    assert [g.tokens for g in out] == ref
    assert [g.accept_lengths for g in out] == [[16, 7], [16, 7]]
    assert [g.accept_lengths_uncut for g in out] == [[16, 16], [16, 16]]
    records = [
        {
            "id": i,
            "plain_tokens": g.tokens,
            "spec_tokens": g.tokens,
            "accept_lengths": g.accept_lengths,
            "accept_lengths_uncut": g.accept_lengths_uncut,
            "plain_decode_s": [1.0],
            "spec_decode_s": [0.5],
        }
        for i, g in enumerate(out)
    ]
    rep = measure.summarize(records, Draft("oracle", engine.proposer, params, 16), MAX_NEW)
    assert rep["tau"] == pytest.approx(11.5) and rep["tau_per_prompt"] == pytest.approx(11.5)
    assert rep["tau"] == pytest.approx(rep["decode_tokens_spec"] / rep["rounds"])
    assert rep["tau_zlab"] == pytest.approx(16.0)
    # Survival on what was output: every round reached 6 accepted drafts, only the first ones 15.
    assert rep["survival"][5] == 1.0 and rep["survival"][14] == pytest.approx(0.5)

    # A stop token first met at reply position p of row 0: the round commits p tokens and the row ends there.
    p = next(i for i in range(3, 16) if ref[0][i] not in ref[0][:i])
    stop = Engine(
        _target("qwen3"),
        Oracle(DFlashProposer(cfg)),
        _oracle_params(drafter, prompts[:1], longer[:1], 16),
        block_size=16,
        max_new_tokens=MAX_NEW,
        stop_ids=(ref[0][p],),
    ).generate(prompts[:1])[0]
    assert stop.tokens == ref[0][: p + 1]
    assert stop.accept_lengths == [p] and stop.accept_lengths_uncut == [16]


@pytest.mark.parametrize("family,k,batch_one", [("qwen3", 16, True), ("llama", 4, False)])
def test_greedy_dflash_equals_plain_greedy(family, k, batch_one):
    """Untrained DFlash drafter (random init) at batch 2 (and batch 1): output equals plain greedy."""
    prompts = _prompts(seed=1)
    ref = _plain(family, prompts)
    cfg, drafter = _tiny_drafter(family)
    engine = Engine(_target(family), DFlashProposer(cfg), drafter, block_size=k, max_new_tokens=MAX_NEW)
    out = engine.generate(prompts)
    assert [g.tokens for g in out] == ref
    for g in out:
        _check_records(g, k)
    if batch_one:
        assert engine.generate(prompts[1:])[0].tokens == ref[1]


@pytest.mark.long
def test_draft_vocabulary_proposals_are_the_full_logits_restricted_to_it():
    """A drafter served with a draft vocabulary proposes, at every position, the argmax (and the top-3 in order)
    of its full-vocabulary logits over those tokens only, with the softmax over them as its confidence; a tree
    and a chain decode with it are lossless (batch 2)."""
    from dflash_model.drafter import block_logits

    family, k = "qwen3", 8
    target = _target(family)
    cfg, drafter = _tiny_drafter(family)
    prompts = _prompts(seed=2)
    # The drafter's context after a prefill of row 0's prompt.
    tokens = jnp.asarray([prompts[0]], jnp.int32)
    feats = forward(target, tokens, layer_ids=cfg.target_layer_ids).features
    state = extend_context(drafter, DraftCache.init(cfg, 1, 64), feats, jnp.asarray([tokens.shape[1]], jnp.int32))
    history = jnp.zeros((1, 64), jnp.int32).at[0, : tokens.shape[1]].set(tokens[0])
    n = jnp.asarray([tokens.shape[1]], jnp.int32)
    full = np.asarray(block_logits(drafter, target, state, tokens[:, -1], k))[0]  # [K-1, V]
    # 40 random tokens, without the full argmax at the first position, so that the restriction changes something.
    shuffled = np.random.default_rng(0).permutation(cfg.vocab_size)
    vocab = tuple(int(i) for i in shuffled if i != full[0].argmax())[:40]
    sub = full[:, list(vocab)]
    proposer = DFlashProposer(cfg, vocab=vocab)
    prop = proposer.propose_scored(drafter, target, state, history, n, k)
    np.testing.assert_array_equal(np.asarray(prop.tokens)[0], np.asarray(vocab)[sub.argmax(-1)])
    assert not np.array_equal(np.asarray(prop.tokens)[0], full.argmax(-1))  # the restriction changed something
    softmax = np.exp(sub - sub.max(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(prop.prob)[0], 1 / softmax.sum(-1), rtol=1e-5)
    top, logp = proposer.propose_top(drafter, target, state, history, n, k, 3)
    np.testing.assert_array_equal(np.asarray(top)[0], np.asarray(vocab)[np.argsort(-sub, axis=-1)[:, :3]])
    assert np.all(np.diff(np.asarray(logp)[0], axis=-1) <= 0)

    ref = _plain(family, prompts)
    for tree in (None, 6):
        engine = Engine(target, proposer, drafter, block_size=k, max_new_tokens=MAX_NEW, tree_nodes=tree)
        assert [g.tokens for g in engine.generate(prompts)] == ref


def test_drafter_context_tracks_the_committed_tokens_only():
    """After decoding with varied acceptance, the drafter's context cache has exactly the target cache's
    length (the true committed count, not the verified block) and holds the same K/V as a drafter context
    built from scratch from the committed sequence's target features."""
    family, k = "qwen3", 8
    target = _target(family)
    prompts = _prompts(seed=2)
    ref = _plain(family, prompts)
    cfg, drafter = _tiny_drafter(family)
    params = _oracle_params(drafter, prompts, ref, k)
    engine = Engine(target, OracleMix(DFlashProposer(cfg)), params, block_size=k, max_new_tokens=MAX_NEW)
    state = engine.decode(engine.prefill(*engine.inputs(prompts)))
    out = engine.results(state)
    assert [g.tokens for g in out] == ref
    lengths = sorted({a for g in out for a in g.accept_lengths})
    assert len(lengths) >= 3, lengths  # several different committed counts were synced

    n = np.asarray(state.n)
    np.testing.assert_array_equal(np.asarray(state.draft.lengths), n - 1)
    np.testing.assert_array_equal(np.asarray(state.cache.lengths), n - 1)
    history = np.asarray(state.history)
    for b in range(len(prompts)):
        seq = jnp.asarray(history[b : b + 1, : n[b] - 1])
        feats = forward(target, seq, layer_ids=cfg.target_layer_ids, compute_logits=False).features
        fresh = extend_context(drafter, DraftCache.init(cfg, 1, n[b] - 1), feats, jnp.asarray([n[b] - 1]))
        np.testing.assert_allclose(state.draft.k[:, b, : n[b] - 1], fresh.k[:, 0], atol=2e-5, rtol=0)
        np.testing.assert_allclose(state.draft.v[:, b, : n[b] - 1], fresh.v[:, 0], atol=2e-5, rtol=0)


# --- compile once, no host transfer --------------------------------------------------------------------------


def test_decode_compiles_once_per_bucket_and_never_touches_the_host():
    """Other prompts of the same batch size and bucket reuse the compiled prefill and decode (traces are
    counted); the decode loop runs under transfer_guard('disallow'); the next bucket compiles once more."""
    engine = Engine(_target("llama"), NGramProposer(), block_size=8, max_new_tokens=MAX_NEW)
    rng = np.random.default_rng(3)
    engine.generate([rng.integers(0, 512, 10).tolist(), rng.integers(0, 512, 30).tolist()])
    before = TRACES["decode"], TRACES["prefill"]
    state = engine.prefill(*engine.inputs([rng.integers(0, 512, 64).tolist(), [7]], seed=1))
    jax.block_until_ready(state)
    with jax.transfer_guard("disallow"):  # any host<->device copy inside the call raises
        state = engine.decode(state)
        jax.block_until_ready(state)
    assert (TRACES["decode"] - before[0], TRACES["prefill"] - before[1]) == (0, 0)
    assert [len(g.tokens) for g in engine.results(state)] == [MAX_NEW, MAX_NEW]
    engine.generate([rng.integers(0, 512, 65).tolist(), [1]])  # bucket 128: one more compile of each step
    assert (TRACES["decode"] - before[0], TRACES["prefill"] - before[1]) == (1, 1)


def test_non_finite_logits_are_an_error_not_token_zero():
    """NaN logits make argmax 0 for target and drafter alike ('lossless', perfect tau): the engine refuses to
    report them; the same target without the NaN decodes."""
    from flax import nnx

    target = tiny_target("qwen3", num_hidden_layers=2)
    prompts = _prompts()
    Engine(target, NGramProposer(), block_size=4, max_new_tokens=4).generate(prompts)
    param = next(p for path, p in nnx.iter_graph(target) if isinstance(p, nnx.Param) and "embed" in str(path))
    param.set_value(param.get_value().at[prompts[0][3]].set(jnp.nan))
    with pytest.raises(FloatingPointError, match="NaN/inf logits"):
        Engine(target, NGramProposer(), block_size=4, max_new_tokens=4).generate(prompts)


@pytest.mark.long
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_greedy_hybrid_equals_plain_greedy_and_looks_up_where_it_can(family):
    """The hybrid proposer (n-gram where the context matches, DFlash elsewhere) is lossless at batch 2 and 1; a
    row whose context matches gets the n-gram continuation (the round where every row matches skips the drafter)."""
    from infer.proposers import HybridProposer

    k = 8
    prompts = _prompts(seed=1)
    ref = _plain(family, prompts)
    cfg, drafter = _tiny_drafter(family)
    hybrid = Engine(_target(family), HybridProposer(DFlashProposer(cfg)), drafter, block_size=k, max_new_tokens=MAX_NEW)
    out = hybrid.generate(prompts)
    assert [g.tokens for g in out] == ref
    for g in out:
        _check_records(g, k)
    single = [hybrid.generate([p])[0] for p in prompts]
    assert [g.tokens for g in single] == ref
    # Per row: the n-gram continuation where the history has a match, the drafter's block where it has none.
    motif, rng = [5, 9, 13, 7], np.random.default_rng(5)
    rows = [motif * 4, [int(t) for t in rng.permutation(500)[:16]]]  # a repeated motif; 16 distinct tokens
    history, n = jnp.asarray(rows, jnp.int32), jnp.asarray([16, 16], jnp.int32)
    hp = HybridProposer(DFlashProposer(cfg))
    state = hp.init(drafter, 2, 16)
    got = np.asarray(hp.propose(drafter, _target(family), state, history, n, k))
    looked_up, match_len = hp.ngram.lookup(history, n, k)
    assert np.asarray(match_len).tolist() == [12, 0]  # the motif agrees 12 tokens back from its latest repeat
    assert got[0].tolist() == np.asarray(looked_up)[0].tolist() == (motif * 2)[: k - 1]
    drafted = np.asarray(hp.dflash.propose(drafter, _target(family), state, history, n, k))
    assert got[1].tolist() == drafted[1].tolist()


@pytest.mark.long
@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_reply_hybrid_equals_plain_greedy_and_drafts_where_replies_are_unsure(adaptive):
    """Reply lookup where it is confident, the DFlash block elsewhere: lossless at batch 2 and 1, fixed and adaptive
    width, with rounds from both sources (adaptive: counted by source); per row, the drafter's block exactly where
    the replies are unsure."""
    from infer.proposers import DRAFTER, REPLIES, ReplyHybridProposer

    k = 8
    prompts, ref, index = _reply_case()
    cfg, drafter = _tiny_drafter("qwen3")
    proposer = ReplyHybridProposer(DFlashProposer(cfg), min_prob=0.99)
    engine = Engine(
        _target("qwen3"), proposer, (drafter, index), block_size=k, max_new_tokens=MAX_NEW, adaptive=adaptive
    )
    if adaptive:
        # Calibration times the drafter's forward from the (drafter, index) params: a real cost, not the lookup's 0.
        assert engine.calibrate(*engine.inputs(prompts), reps=2)["draft_ms"] > 0
        engine.costs = {"widths": [1, 2, 4, 8], "verify_ms": [1.0, 1.1, 1.3, 1.8], "draft_ms": 0.5}
    state = engine.decode(engine.prefill(*engine.inputs(prompts)))
    assert [g.tokens for g in engine.results(state)] == ref
    assert [engine.generate([p])[0].tokens for p in prompts] == ref
    if adaptive:  # the adaptive round counts its rounds by source (a fixed block keeps no counts)
        tries = np.asarray(state.strategy.tries)
        assert tries[REPLIES:].sum() > 0 and tries[DRAFTER].sum() > 0, tries
    # Per row: the replies' drafts where they are confident, the drafter's block elsewhere. A reply indexed twice
    # makes [40, 41] -> 42 certain (row 0); 16 distinct tokens the replies never saw leave row 1 unsure.
    from infer.replies import build_index

    reply = [1, 40, 41, 42, 43, 44]
    mask = [False] + [True] * 5
    small = build_index(np.asarray(reply * 2, np.int32), np.asarray(mask * 2), np.asarray([0, 6, 12]))
    rows = [list(range(200, 214)) + [40, 41], [int(t) for t in np.random.default_rng(5).permutation(100)[:16] + 300]]
    history, n = jnp.asarray(rows, jnp.int32), jnp.asarray([16, 16], jnp.int32)
    dstate = proposer.init((drafter, small), 2, 32)
    got = proposer.propose_scored((drafter, small), _target("qwen3"), dstate, history, n, k)
    mine, source, sure = proposer.replies.choose(small, history, n, k, proposer.min_prob)
    assert np.asarray(sure).tolist() == [True, False]
    assert np.asarray(got.tokens)[0, :3].tolist() == [42, 43, 44]
    drafted = proposer.dflash.propose(drafter, _target("qwen3"), dstate, history, n, k)
    assert np.asarray(got.tokens)[1].tolist() == np.asarray(drafted)[1].tolist()
    assert np.asarray(got.source).tolist() == [int(source[0]), DRAFTER] and int(source[0]) >= REPLIES


# --- adaptive verify width -----------------------------------------------------------------------------------


def test_choose_width_maximises_expected_tokens_per_cost():
    """Hand-computed: confidences 0.9/0.8/0.5 make verifying 1, 2, 4 tokens commit 1, 1.9, 1.9+0.72+0.36 = 2.98
    in expectation; with costs 1, 1.2, 1.5 the rates are 1, 1.58, 1.99 (width 4 wins); when width 4 costs 3.0
    its rate falls to 0.99 and width 2 wins; a done row counts for nothing."""
    from infer.adaptive import choose_width

    conf = jnp.asarray([[0.9, 0.8, 0.5]])
    live = jnp.asarray([True])
    assert int(choose_width(conf, live, (1, 2, 4), jnp.asarray([1.0, 1.2, 1.5]))) == 2
    assert int(choose_width(conf, live, (1, 2, 4), jnp.asarray([1.0, 1.2, 3.0]))) == 1
    # A second row that is sure of nothing pulls toward width 1 only through its share of the cost.
    two = jnp.asarray([[0.9, 0.8, 0.5], [0.0, 0.0, 0.0]])
    assert int(choose_width(two, jnp.asarray([True, True]), (1, 2, 4), jnp.asarray([1.0, 1.2, 1.5]))) == 2
    assert int(choose_width(two, jnp.asarray([False, True]), (1, 2, 4), jnp.asarray([1.0, 1.2, 1.5]))) == 0


@pytest.mark.long
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_adaptive_width_is_lossless_and_varies(family):
    """Adaptive engines (a drafter whose confidence says how far its drafts are right, so the chosen width moves
    round by round; n-gram with measured rates) equal plain greedy at batch 2 and 1; the drafter context stays at
    the target cache's length; several widths are used; the decode compiles once, each width once."""
    k = 8
    target = _target(family)
    prompts = _prompts(seed=2)
    ref = _plain(family, prompts)
    cfg, drafter = _tiny_drafter(family)
    params = _oracle_params(drafter, prompts, ref, k)
    engine = Engine(target, OracleMix(DFlashProposer(cfg)), params, block_size=k, max_new_tokens=MAX_NEW, adaptive=True)
    assert engine.widths == (1, 2, 4, 8)
    inputs = engine.inputs(prompts)
    # Fixed costs, not timings (tiny-model timings are noise): a wider verify costs a little more.
    engine.costs = {"widths": [1, 2, 4, 8], "verify_ms": [1.0, 1.1, 1.3, 1.8], "draft_ms": 0.5}
    before = dict(TRACES)
    state = engine.decode(engine.prefill(*inputs))
    out = engine.results(state)
    assert [g.tokens for g in out] == ref
    used = {w for g in out for w in g.verify_widths}
    assert len(used) >= 2, used
    for g in out:
        assert all(1 <= a <= w for a, w in zip(g.accept_lengths, g.verify_widths))
    n = np.asarray(state.n)
    np.testing.assert_array_equal(np.asarray(state.draft.lengths), n - 1)
    np.testing.assert_array_equal(np.asarray(state.cache.lengths), n - 1)
    traced = {key: TRACES[key] - before.get(key, 0) for key in TRACES}
    assert traced["decode"] == 1 and all(traced[f"verify@{w}"] == 1 for w in engine.widths), traced
    assert [g.tokens for g in engine.generate(prompts, seed=1)] == ref  # same shapes: no new compile
    assert TRACES["decode"] - before.get("decode", 0) == 1
    # Batch 1, and the n-gram proposer (measured rates per source: lookup, repeat).
    ngram = Engine(target, NGramProposer(), block_size=k, max_new_tokens=MAX_NEW, adaptive=True)
    assert [ngram.generate([p])[0].tokens for p in prompts] == ref


def test_adaptive_decode_loop_copies_no_cache():
    """The compiled decode loop, fixed width and adaptive, holds no copy of a cache-shaped array. A cache written
    inside the adaptive round's lax.switch branches was copied whole four times per branch by XLA:CPU (about 1 ms
    of a SmolLM2 round, docs/results/decoding/cache-write/); the branches now return the new K/V instead."""
    import re

    target = _target("qwen3")
    for adaptive in (False, True):
        engine = Engine(target, NGramProposer(), block_size=8, max_new_tokens=MAX_NEW, adaptive=adaptive)
        if adaptive:
            engine.costs = {"widths": [1, 2, 4, 8], "verify_ms": [1.0, 1.1, 1.3, 1.8], "draft_ms": 0.5}
        state = engine.prefill(*engine.inputs(_prompts()))
        hlo = (
            spec._decode.lower(engine.target, engine.proposer, engine.params, state, plan=engine.plan)
            .compile()
            .as_text()
        )
        shape = ",".join(map(str, state.cache.k.shape))
        copies = re.findall(rf"= f32\[{shape}\]\S* copy\(", hlo)
        assert re.search(rf"f32\[{shape}\]", hlo) and not copies, (adaptive, len(copies))


# --- draft trees (DDTree) ------------------------------------------------------------------------------------


def test_build_tree_takes_the_best_prefixes_and_walk_follows_the_target():
    """Hand-computed: depth-1 candidates 10/11 (log-probs -0.1/-1.0), depth 2 20/21 (-0.2/-0.5), depth 3 30/31
    (-0.35/-2.0). The five best prefixes are 10 (-0.1), 10-20 (-0.3), 10-21 (-0.6), 10-20-30 (-0.65),
    10-21-30 (-0.95); a target that says 10, 21, 30, then 99 is followed down 0 -> 1 -> 3 -> 5 and commits
    10 21 30 99. With one candidate per depth and two depths only two nodes exist; the rest are invalid."""
    from infer.tree import build_tree, walk_tree

    tokens = jnp.asarray([[[10, 11], [20, 21], [30, 31]]], jnp.int32)
    logp = jnp.asarray([[[-0.1, -1.0], [-0.2, -0.5], [-0.35, -2.0]]], jnp.float32)
    tree = build_tree(tokens, logp, 5)
    assert tree.token[0, 1:].tolist() == [10, 20, 21, 30, 30]
    assert tree.parent[0].tolist() == [0, 0, 1, 1, 2, 3]
    assert tree.depth[0].tolist() == [0, 1, 2, 2, 3, 3]
    assert np.flatnonzero(np.asarray(tree.visible[0, 5])).tolist() == [0, 1, 3, 5]
    assert tree.valid[0].tolist() == [True] * 6
    target_tok = jnp.asarray([[10, 21, 99, 30, 99, 99]], jnp.int32)  # the target's token at each node
    path, a = walk_tree(target_tok, tree, 3)
    assert path[0].tolist() == [0, 1, 3, 5] and a.tolist() == [3]
    assert jnp.take_along_axis(target_tok, path, axis=1)[0].tolist() == [10, 21, 30, 99]
    # The target disagrees at the root: nothing accepted, the bonus is its root token.
    path, a = walk_tree(jnp.asarray([[12, 21, 99, 30, 99, 99]], jnp.int32), tree, 3)
    assert a.tolist() == [0] and path[0].tolist() == [0, 0, 0, 0]
    small = build_tree(tokens[:, :2, :1], logp[:, :2, :1], 4)
    assert small.valid[0].tolist() == [True, True, True, False, False]
    assert small.parent[0, :3].tolist() == [0, 0, 1]


@dataclasses.dataclass(frozen=True)
class OracleTree(OracleMix):
    """OracleMix for trees: at each depth the drafter's top tokens, with the true greedy token put in at rank
    (true token mod top) except where it is a multiple of 3, so that the target's path often leaves rank 0."""

    def propose_top(self, params, target, state, history, n, k, top):
        tokens, _ = self.inner.propose_top(params["drafter"], target, state, history, n, k, top)
        j = jnp.arange(k - 1)[None, :]
        truth = jnp.take_along_axis(params["ref"], (n - params["plen"])[:, None] + j, axis=1)
        rank = jnp.arange(top)[None, None, :]
        put = (truth % 3 != 0)[..., None] & (rank == (truth % top)[..., None])
        logp = jnp.broadcast_to(-0.3 * (rank + 1.0), tokens.shape)  # best first, every depth alike
        return jnp.where(put, truth[..., None], tokens), logp


@pytest.mark.long
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_tree_decoding_equals_plain_greedy(family):
    """DDTree rounds (12 nodes, top 3) equal plain greedy at batch 2 and 1, with drafts accepted off the greedy
    chain (the tree pays); both caches stay at the committed length; the decode and the tree verify compile
    once. The untrained DFlash drafter's own tree is lossless too."""
    k, nodes = 8, 12
    target = _target(family)
    prompts = _prompts(seed=3)
    ref = _plain(family, prompts)
    cfg, drafter = _tiny_drafter(family)
    oracle_tree = lambda params: Engine(
        target,
        OracleTree(DFlashProposer(cfg)),
        params,
        block_size=k,
        max_new_tokens=MAX_NEW,
        tree_nodes=nodes,
        tree_top=3,
    )
    engine = oracle_tree(_oracle_params(drafter, prompts, ref, k))
    assert engine.widths == (nodes + 1,)
    before = dict(TRACES)
    state = engine.decode(engine.prefill(*engine.inputs(prompts)))
    out = engine.results(state)
    assert [g.tokens for g in out] == ref
    off_chain = 0
    for g in out:
        assert all(w == nodes + 1 for w in g.verify_widths)
        at = 0
        for a, chain in zip(g.accept_lengths, g.proposals):
            off_chain += a >= 2 and g.tokens[at + 1] != chain[0]  # an accepted first draft that is not rank 0
            at += a
    assert off_chain >= 2, off_chain
    assert np.mean([a for g in out for a in g.accept_lengths]) > 1.25  # measured 1.68 (qwen3), 1.38 (llama)
    n = np.asarray(state.n)
    np.testing.assert_array_equal(np.asarray(state.draft.lengths), n - 1)
    np.testing.assert_array_equal(np.asarray(state.cache.lengths), n - 1)
    traced = {key: TRACES[key] - before.get(key, 0) for key in TRACES}
    assert traced["decode"] == 1 and traced[f"tree@{nodes}"] == 1, traced
    # Batch 1 with the oracle's own rows, and the untrained drafter's tree at batch 2.
    for i, p in enumerate(prompts):
        assert oracle_tree(_oracle_params(drafter, [p], [ref[i]], k)).generate([p])[0].tokens == ref[i]
    plain_tree = Engine(target, DFlashProposer(cfg), drafter, block_size=k, max_new_tokens=MAX_NEW, tree_nodes=6)
    assert [g.tokens for g in plain_tree.generate(prompts)] == ref


def test_tree_engine_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="per-position distributions or a tree"):
        Engine(_target("qwen3"), NGramProposer(), block_size=4, max_new_tokens=4, tree_nodes=4)
    cfg, drafter = _tiny_drafter("qwen3")
    with pytest.raises(ValueError, match="exclude each other"):
        Engine(
            _target("qwen3"), DFlashProposer(cfg), drafter, block_size=4, max_new_tokens=4, tree_nodes=4, adaptive=True
        )
    from infer.proposers import LookupTreeProposer

    with pytest.raises(ValueError, match="drafts trees only"):
        Engine(_target("qwen3"), LookupTreeProposer(), None, block_size=4, max_new_tokens=4)


@pytest.mark.long
@pytest.mark.parametrize("family,adaptive", [("qwen3", False), ("llama", False), ("qwen3", True)])
def test_lookup_tree_decoding_equals_plain_greedy(family, adaptive):
    """The lookup tree equals plain greedy at batch 2 and 1; some rounds accept drafts off the tree's likeliest path
    (a second guess paid), and the tree verify compiles once. Its index holds these prompts' greedy replies once
    and a copy with every 5th token changed twice, so there the likeliest follower is wrong and the second right.
    Adaptive: the round verifies the first w nodes, w chosen per round; with costs that make a wide verify dear,
    it verifies several widths, each branch compiled once."""
    from infer.proposers import LookupTreeProposer

    prompts = _prompts(seed=4)
    ref = _plain(family, prompts)
    index = _reply_index(list(zip(prompts, ref)) + list(zip(prompts, _corrupted(ref))) * 2)
    nodes = 7
    engine = Engine(
        _target(family),
        LookupTreeProposer(),
        index,
        block_size=nodes + 1,
        max_new_tokens=MAX_NEW,
        tree_nodes=nodes,
        adaptive=adaptive,
    )
    if adaptive:
        engine.costs = {"widths": [1, 2, 4, 8], "verify_ms": [1.0, 1.2, 1.6, 2.6], "draft_ms": 0.0}
    traces = [f"tree-verify@{w}" for w in (1, 2, 4, 8)] if adaptive else [f"tree@{nodes}"]
    before = [TRACES[t] for t in traces]
    gens = engine.generate(prompts)
    assert [g.tokens for g in gens] == ref
    assert engine.generate(prompts[::-1])[1].tokens == ref[0]  # same shapes: no new compile
    assert [TRACES[t] - b for t, b in zip(traces, before)] == [1] * len(traces), TRACES
    if adaptive:
        assert len({w for g in gens for w in g.verify_widths}) >= 2
    assert [engine.generate([p])[0].tokens for p in prompts] == ref
    off_chain = 0
    for g in gens:
        _check_records(g, nodes + 1)
        for a, chain, start in zip(g.accept_lengths, g.proposals, np.cumsum([1] + g.accept_lengths[:-1])):
            accepted = g.tokens[start : start + a - 1]
            off_chain += len(accepted) > 0 and accepted != chain[: len(accepted)]
    assert sum(a > 1 for g in gens for a in g.accept_lengths) >= 4
    if family == "qwen3" and not adaptive:  # the tiny Llama repeats one or two tokens: its context lookup is right
        assert off_chain >= 1


@pytest.mark.long
def test_lookup_tree_size_is_chosen_from_the_prior_over_measured_costs():
    """With a tree_prior the engine times each size's round (its verify + growing its tree) in `calibrate` and
    keeps the size with the most expected tokens per ms: a prior a thousand times higher at one size wins at any
    cost this machine can measure, either way round. The chosen engine decodes exactly plain greedy, compiling its
    size's tree verify once; before `calibrate` it refuses to decode, and a prior is refused where it cannot apply."""
    from infer.proposers import LookupTreeProposer

    prompts = _prompts(seed=4)
    ref = _plain("qwen3", prompts)
    index = _reply_index(list(zip(prompts, ref)))
    target = _target("qwen3")
    for prior, want in (({3: 1000.0, 6: 1.0}, 3), ({3: 1.0, 6: 1000.0}, 6)):
        engine = Engine(target, LookupTreeProposer(), index, max_new_tokens=MAX_NEW, tree_prior=prior)
        with pytest.raises(RuntimeError, match="call calibrate"):
            engine.prefill(*engine.inputs(prompts))
        costs = engine.calibrate(*engine.inputs(prompts))
        choice = costs["tree_choice"]
        assert choice["nodes"] == want and sorted(choice["by_size"]) == [3, 6]
        assert all(v["round_ms"] > 0 and v["tau"] == prior[n] for n, v in choice["by_size"].items())
        assert (engine.block_size, engine.widths, costs["widths"]) == (want + 1, (want + 1,), [want + 1])
        before = TRACES[f"tree@{want}"]
        gens = engine.generate(prompts)
        assert [g.tokens for g in gens] == ref
        assert TRACES[f"tree@{want}"] - before == 1
        assert all(w == want + 1 for g in gens for w in g.verify_widths)
    # In an eval: the report names the size decoded with, its acceptance table as deep as that tree.
    from infer.loading import Draft
    from infer.measure import run_comparison

    draft = Draft("lookuptree-auto", LookupTreeProposer(), index, 7, tree_prior={3: 1000.0, 6: 1.0})
    rep = run_comparison(target, [draft], prompts, max_new_tokens=MAX_NEW, progress=False)["lookuptree-auto"]
    assert (rep["tree_nodes"], rep["block_size"], rep["lossless_mismatches"]) == (3, 4, 0)
    assert len(rep["acceptance_unconditional"]) == 3 and rep["costs_ms"]["lookuptree-auto"]["tree_choice"]["nodes"] == 3
    with pytest.raises(ValueError, match="grows its own tree"):
        Engine(target, NGramProposer(), block_size=4, max_new_tokens=4, tree_prior={3: 2.0})
    with pytest.raises(ValueError, match="without tree_nodes and adaptive"):
        Engine(target, LookupTreeProposer(), index, max_new_tokens=4, tree_nodes=3, tree_prior={3: 2.0})
    with pytest.raises(ValueError, match="expected tokens per round > 0"):
        Engine(target, LookupTreeProposer(), index, max_new_tokens=4, tree_prior={3: 0.0})
