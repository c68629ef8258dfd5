"""Teacher-forced acceptance (the training pass) against real speculative decoding on the tiny target."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import tiny_target
from flax import nnx

from dflash_model.drafter import build_drafter
from dflash_model.drafter_config import drafter_config_for
from dflash_model.target import forward
from infer.agreement import (
    censored_survival,
    compare,
    format_agreement,
    leading_correct,
    round_anchors,
    teacher_forced,
)
from infer.engine import Engine
from infer.metrics import survival
from infer.plain import greedy_generate
from infer.proposers import DFlashProposer
from train.objective import dflash_loss

K = 8
NEW = 24  # tokens decoded; the replies given to the teacher-forced pass run K further, so no round is censored


def test_accept_length_counts_leading_correct_slots_capped_at_k_minus_1():
    labels = np.array([[5, 6, 7, 8]] * 5)
    drafts = np.array(
        [
            [5, 6, 7, 8],  # all right: K-1 = 4, the cap
            [5, 6, 0, 8],  # a miss at slot 3: later right slots do not count
            [0, 6, 7, 8],  # a miss at slot 1
            [5, 6, 7, 0],
            [5, 6, 7, 8],  # right so far, but slots 3 and 4 lie past the text: censored at 2
        ]
    )
    known = np.ones_like(labels, bool)
    known[4, 2:] = False
    a, final = leading_correct(drafts, labels, known)
    assert a.tolist() == [4, 2, 0, 3, 2]
    assert final.tolist() == [True, True, True, True, False]
    # A miss on a known label is final even where later labels are unknown.
    a, final = leading_correct(np.array([[5, 0, 7, 8]]), labels[:1], np.array([[True, True, False, False]]))
    assert (a.tolist(), final.tolist()) == ([1], [True])


def test_survival_of_censored_blocks_and_round_starts():
    # Without censoring: the survival of infer.metrics (accept lengths = accepted + 1).
    a = np.array([0, 1, 3, 3, 2])
    assert censored_survival(a, np.ones(5, bool), 4) == pytest.approx(survival(a + 1, 4))
    # A block censored at 1 (its draft-2 label unknown) counts at draft 1, not after: S_2 = 1/2 * 1/1 ... from the
    # blocks at risk: draft 1: 3 blocks, 2 pass; draft 2: 1 at risk (the other is censored), it passes.
    s = censored_survival(np.array([0, 1, 2]), np.array([True, False, True]), 3)
    assert s == pytest.approx([2 / 3, 2 / 3])
    assert all(math.isnan(x) for x in censored_survival(np.zeros(0), np.zeros(0, bool), 3))
    # The prefill commits the token at position prompt_len; round 0's block starts on it, each round moves the
    # start by the tokens it committed.
    assert round_anchors(10, [3, 1, 8]) == [10, 13, 14]
    assert round_anchors(10, []) == []


@pytest.fixture(scope="module")
def tiny():
    """The tiny target, a drafter config, 3 prompts and the target's greedy replies to them (NEW + K tokens)."""
    target = tiny_target("qwen3", num_hidden_layers=2)
    cfg = drafter_config_for(
        target.target_config, mask_token_id=511, num_layers=1, block_size=K, target_layer_ids=(0, 1)
    )
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 500, n).tolist() for n in (9, 14, 20)]
    return target, cfg, prompts, greedy_generate(target, prompts, NEW + K)


def _decode(target, cfg, drafter, prompts):
    return Engine(target, DFlashProposer(cfg), drafter, block_size=K, max_new_tokens=NEW).generate(prompts)


def _check_rounds(target, cfg, drafter, prompts, replies):
    """Real decoding's accept lengths and drafts, round for round, equal the training pass's at the rounds'
    starts; returns the real accept lengths."""
    gens = _decode(target, cfg, drafter, prompts)
    assert [g.tokens for g in gens] == [r[:NEW] for r in replies]  # lossless: the replies are the verify's labels
    real = [g.accept_lengths for g in gens]
    got = teacher_forced(target, drafter, K, prompts, replies, rounds=real)
    assert got["anchors"] == "rounds" and got["censored"] == 0
    # The replies run K tokens past the budget, so a last round's block is scored whole: its drafts accepted + 1
    # before the cut at the budget, which the round records beside what it committed.
    assert got["accept_lengths"] == [g.accept_lengths_uncut for g in gens]
    assert got["drafts"] == [g.proposals for g in gens]
    return real


def test_rounds_reproduce_real_decoding_with_a_random_drafter(tiny):
    target, cfg, prompts, replies = tiny
    _check_rounds(target, cfg, build_drafter(cfg, seed=0), prompts, replies)


def _trained(target, cfg, prompts, replies, steps: int = 30):
    """A drafter fitted a few Adam steps to the target's replies by the training loss (every reply position)."""
    t = 64
    ids, mask, anchors = np.zeros((3, t), np.int32), np.zeros((3, t), np.int32), np.full((3, 40), -1, np.int32)
    for i, (p, r) in enumerate(zip(prompts, replies)):
        ids[i, : len(p) + len(r)], mask[i, len(p) : len(p) + len(r)] = p + r, 1
        row = list(range(len(p), len(p) + len(r) - 1))[:40]
        anchors[i, : len(row)] = row
    ids, mask, anchors = jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(anchors)
    feats = forward(target, ids, layer_ids=(0, 1), compute_logits=False).features
    graph, params = nnx.split(build_drafter(cfg, seed=0))
    tx = optax.adam(3e-3)

    @jax.jit
    def step(params, opt):
        def loss(p):
            return dflash_loss(nnx.merge(graph, p), target, feats, ids, mask, anchors, block_size=K, gamma=4.0)[0]

        grads = jax.grad(loss)(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt

    opt = tx.init(params)
    for _ in range(steps):
        params, opt = step(params, opt)
    return nnx.merge(graph, params)


@pytest.fixture(scope="module")
def trained(tiny):
    target, cfg, prompts, replies = tiny
    return _trained(target, cfg, prompts, replies)


@pytest.mark.long
def test_rounds_reproduce_real_decoding_with_a_trained_drafter(tiny, trained):
    target, cfg, prompts, replies = tiny
    real = _check_rounds(target, cfg, trained, prompts, replies)
    assert len({a for row in real for a in row}) >= 3, real  # rounds of several lengths, some accepting drafts


@pytest.mark.long
def test_teacher_forcing_differs_off_the_greedy_text_and_between_anchor_sets(tiny, trained):
    target, cfg, prompts, replies = tiny
    replies = [r[:NEW] for r in replies]
    every = teacher_forced(target, trained, K, prompts, replies)
    assert every["anchors"] == "every" and every["blocks"] == 3 * (NEW - 1)
    assert every["tau"] > 1.5 and every["censored"] > 0  # blocks near a reply's end run past it
    # The same tokens in another order are not what the target writes: acceptance against them falls.
    rng = np.random.default_rng(1)
    shuffled = teacher_forced(target, trained, K, prompts, [rng.permutation(r).tolist() for r in replies])
    assert shuffled["blocks"] == every["blocks"] and shuffled["tau"] < every["tau"] - 0.5
    # The rounds' anchors are fewer than every reply position: each round skips the positions it accepted.
    real = [g.accept_lengths for g in _decode(target, cfg, trained, prompts)]
    rounds = teacher_forced(target, trained, K, prompts, replies, rounds=real)
    assert rounds["blocks"] == sum(map(len, real)) < every["blocks"]
    report = {
        "acceptance_unconditional": survival([a for row in real for a in row], K),
        "tau": float(np.mean([a for row in real for a in row])),
        "per_prompt": [{"accept_lengths": row} for row in real],
    }
    cmp = compare(every, report)
    assert cmp["real"]["rounds"] == rounds["blocks"]
    assert cmp["gap"]["tau"] == pytest.approx(report["tau"] - every["tau"])
    assert cmp["gap"]["S_1"] == pytest.approx(report["acceptance_unconditional"][0] - every["survival"][0])
    table = format_agreement(cmp)
    assert "teacher-forced" in table and "real decoding" in table and "gap" in table


def test_a_one_token_reply_has_no_block(tiny):
    target, cfg, prompts, replies = tiny
    got = teacher_forced(target, build_drafter(cfg, seed=0), K, prompts[:2], [replies[0][:1], replies[1][:NEW]])
    assert got["accept_lengths"][0] == [] and len(got["accept_lengths"][1]) == NEW - 1
    assert got["blocks"] == NEW - 1
