"""Teacher-forced acceptance over rows of prompt + the target's reply, and its gap to real decoding: the library
of the `infer.teacher_forced` command (see its docstring for what the measure estimates).

`forced` scores every reply position as a block's anchor (`infer.agreement.teacher_forced`) with one compile per
length bucket; `estimate` and `set_result` summarise a set with intervals over prompts; `real_decode` and `real_gap`
decode the same prompts speculatively and set the two measures side by side, with the pass at real decoding's own
round starts as the check that they agree round for round.
"""

from __future__ import annotations

import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from infer.agreement import censored_survival, compare, gap_intervals, survival_intervals, teacher_forced
from infer.engine import Engine
from infer.metrics import survival, tau_pooled
from infer.plain import bucket_length

LENGTH_BUCKET = 128  # rows of prompt + reply padded to a multiple of this: one compile per bucket, little padding


def forced(target, draft, k: int, prompts, replies, *, max_new_tokens: int, rounds=None, bar=None) -> dict:
    """`teacher_forced` over rows of any lengths: rows grouped by LENGTH_BUCKET of prompt + reply, each group padded
    to its bucket and to the budget's anchors, so that one compile serves every group of a bucket (every set, and
    the rounds' check). {accept_lengths, final}, one list per row in the given order."""
    groups: dict[int, list[int]] = {}
    for i, (p, r) in enumerate(zip(prompts, replies)):
        groups.setdefault(-(-(len(p) + len(r)) // LENGTH_BUCKET) * LENGTH_BUCKET, []).append(i)
    lengths: list = [None] * len(prompts)
    finals: list = [None] * len(prompts)
    for length, idx in sorted(groups.items()):
        got = teacher_forced(
            target,
            draft.params,
            k,
            [prompts[i] for i in idx],
            [replies[i] for i in idx],
            rounds=None if rounds is None else [rounds[i] for i in idx],
            zero_features=draft.proposer.zero_features,
            vocab=draft.proposer.vocab,
            min_length=length,
            min_anchors=max_new_tokens - 1,
            on_row=None if bar is None else lambda: bar.update(1),
        )
        for j, i in enumerate(idx):
            lengths[i], finals[i] = got["accept_lengths"][j], got["final"][j]
    return {"accept_lengths": lengths, "final": finals}


def estimate(lengths, finals, k: int, anchors: str = "every") -> dict:
    """`teacher_forced`'s summary of these rows: blocks, censored, survival [S_1..S_{K-1}], tau."""
    a = np.asarray([x - 1 for row in lengths for x in row], np.int64)
    final = np.asarray([f for row in finals for f in row], bool)
    s = censored_survival(a, final, k)
    return {
        "anchors": anchors,
        "block_size": k,
        "blocks": int(a.size),
        "censored": int(np.sum(~final)),
        "survival": s,
        "tau": 1.0 + float(np.sum(s)) if a.size else math.nan,
    }


def set_result(ids, prompts, replies, got, k: int, max_new_tokens: int) -> dict:
    """One set's numbers, their intervals and its per-prompt rows."""
    est = estimate(got["accept_lengths"], got["final"], k)
    return {
        **est,
        **survival_intervals(got["accept_lengths"], got["final"], k),
        "reply_tokens": sum(map(len, replies)),
        "replies_at_budget": sum(len(r) == max_new_tokens for r in replies),
        "per_prompt": [
            {"id": i, "prompt_tokens": len(p), "reply": r, "accept_lengths": a, "final": f}
            for i, p, r, a, f in zip(ids, prompts, replies, got["accept_lengths"], got["final"])
        ],
    }


def real_decode(model, draft, k: int, prompt_sets: dict[str, list], *, max_new_tokens: int, stop_ids, progress):
    """{set: its prompts' speculative generations}: each set one batch of as many rows as the largest, every batch
    padded to one width (one compile), a short one filled with copies of its first prompt (their answers dropped)."""
    engine = Engine(model, draft.proposer, draft.params, block_size=k, max_new_tokens=max_new_tokens, stop_ids=stop_ids)
    rows = max(len(p) for p in prompt_sets.values())
    width = bucket_length(max(len(p) for prompts in prompt_sets.values() for p in prompts))
    out = {}
    for name, prompts in tqdm(prompt_sets.items(), desc="real decoding", disable=not progress, file=sys.stderr):
        batch = prompts + [prompts[0]] * (rows - len(prompts))
        ids = np.zeros((rows, width), np.int32)
        for b, p in enumerate(batch):
            ids[b, : len(p)] = p
        lengths = jnp.asarray([len(p) for p in batch], jnp.int32)
        out[name] = engine.results(engine.decode(engine.prefill(jnp.asarray(ids), lengths, jax.random.key(0))))
        out[name] = out[name][: len(prompts)]
    return out


def rounds_equal(at_rounds: dict, real: list[list[int]]) -> int:
    """Rounds whose teacher-forced accept length at the round's start equals real decoding's. A censored block
    ran past the reply with every draft right: real decoding committed the reply's remaining tokens, cut there
    (a stop token or the budget), which is the block's accepted drafts, one less than its accept length."""
    n = 0
    for tf_row, final_row, real_row in zip(at_rounds["accept_lengths"], at_rounds["final"], real):
        n += sum((tf if final else tf - 1) == r for tf, final, r in zip(tf_row, final_row, real_row))
    return int(n)


def real_gap(model, draft, k: int, gens, prompts, replies, got, *, max_new_tokens: int, progress) -> dict:
    """Real decoding's rounds on these prompts against the teacher-forced pass on the same prompts
    (`infer.agreement.compare`), with a paired interval on the gap; and the pass at the rounds' own starts, which
    reproduces real decoding's accept lengths round for round (up to float rounding)."""
    real = [g.accept_lengths for g in gens]
    flat = [a for row in real for a in row]
    report = {
        "acceptance_unconditional": survival(flat, k),
        "tau": tau_pooled(flat),
        "per_prompt": [{"accept_lengths": row} for row in real],
    }
    out = compare(estimate(got["accept_lengths"], got["final"], k), report)
    out["gap_ci"] = gap_intervals(real, got["accept_lengths"], got["final"], k)
    with tqdm(total=len(prompts), desc="rounds check", disable=not progress, file=sys.stderr) as bar:
        at_rounds = forced(model, draft, k, prompts, replies, max_new_tokens=max_new_tokens, rounds=real, bar=bar)
    out["rounds_check"] = {
        "rounds": len(flat),
        "rounds_equal": rounds_equal(at_rounds, real),
        "replies_equal": sum(g.tokens == r for g, r in zip(gens, replies)),
        "prompts": len(prompts),
        "note": "the teacher-forced pass at real decoding's round starts (round_anchors): rounds whose committed "
        "tokens equal real decoding's (a censored block, the last round of a reply, counted as its accepted drafts: "
        "real decoding cuts that round at the reply's end, where the block's + 1 would fall past it); replies_equal: "
        "speculative answers equal to the plain greedy replies (lossless)",
    }
    out["real_accept_lengths"] = real
    out["teacher_forced_at_rounds"] = at_rounds["accept_lengths"]
    return out
