"""Teacher-forced acceptance: the drafter's training pass over the target's own greedy text, beside real decoding.

The training loss runs blocks [token a, MASK x (K-1)] at anchors a of a text, the target's features of positions
< a as context, and scores slot k against token a+k. Over a prompt followed by the target's own greedy
continuation, that pass drafts what a speculative round whose block starts at a drafts (the same context, the
same block input), and the continuation holds the tokens its verify checks: the target's greedy choices after
the prompt and the accepted drafts. So at the anchors real greedy decoding used (`round_anchors`) the leading
correct slots of each block are that round's accepted drafts, round for round, up to float rounding between one
full forward and a decode's incremental ones. At every position of the continuation (`every_anchors`) they are
what the loss's per-slot accuracy estimates; beside real decoding's numbers (`compare`), a gap says the trained
pass and the served one disagree (features, positions, masks, the export) or that the rounds' anchors are not a
typical sample of the text's positions.

A block whose slots run past the known text and matched every known label is censored: its count is a lower
bound. Survival then comes from the blocks still at risk at each slot (`censored_survival`), which is the plain
survival of `infer.metrics` when no block is censored. Counts here follow the decode reports: an accept length is
accepted drafts + 1.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from dflash_model.drafter import train_logits
from dflash_model.target import config_of, forward, lm_head
from infer.intervals import LEVEL, REPLICATES, SEED, percentile_interval, resamples

# Anchors per drafter call: the lm_head's [anchors, K-1, V] logits of one call stay near 2**26 floats.
_LOGITS_BUDGET = 1 << 26
_LENGTH_STEP = 64  # sequences are padded to a multiple of this: one compile serves every row of an eval


def leading_correct(drafts_NJ, labels_NJ, known_NJ) -> tuple[np.ndarray, np.ndarray]:
    """Per block: accepted drafts a (leading slots whose draft equals its label, 0..J with J = K-1) and whether
    a is final. A block is final when it missed on a known label or matched all J; one whose next label lies
    past the known text is censored at a."""
    drafts, labels, known = (np.asarray(x) for x in (drafts_NJ, labels_NJ, known_NJ))
    n, j = drafts.shape
    a = np.sum(np.cumprod((drafts == labels) & known, axis=1), axis=1).astype(np.int64)
    final = (a == j) | known[np.arange(n), np.minimum(a, j - 1)]
    return a, final


def round_anchors(prompt_len: int, accept_lengths) -> list[int]:
    """The position of each round's first block token. The prefill commits the first new token, at position
    prompt_len; round 0's block starts on it (`infer.spec`: start = n - 1, n counting that token), and each round
    moves the start by the tokens it committed (its accept length: accepted drafts + 1)."""
    lengths = np.asarray(accept_lengths, np.int64)
    return (prompt_len + np.concatenate([[0], np.cumsum(lengths)[:-1]])).astype(int).tolist() if lengths.size else []


def every_anchors(prompt_len: int, new_tokens: int) -> list[int]:
    """Every continuation position that has a next token to score: prompt_len .. prompt_len + new_tokens - 2."""
    return list(range(prompt_len, prompt_len + new_tokens - 1))


def censored_survival(accepted, final, k: int) -> list[float]:
    """[S_1 .. S_{K-1}]: S_j = prod over i <= j of (blocks accepting draft i) / (blocks at risk at draft i), at risk
    meaning drafts 1..i-1 accepted and draft i's label known. Without censored blocks, #(a >= j) / blocks.
    NaN from the first slot no block is at risk at while some block got that far."""
    a, final = np.asarray(accepted, np.int64), np.asarray(final, bool)
    out, s = [], 1.0 if a.size else math.nan
    for i in range(1, k):
        passed = int(np.sum(a >= i))
        at_risk = passed + int(np.sum(final & (a == i - 1)))
        if at_risk:
            s *= passed / at_risk
        elif np.any(a >= i - 1):
            s = math.nan
        else:
            s = 0.0 if a.size else math.nan
        out.append(s)
    return out


# --- survival over prompts resampled: the bootstrap of `censored_survival` ------------------------------------------


def prompt_block_counts(accept_lengths, finals, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per prompt (one list of accept lengths, accepted drafts + 1, and one of final flags each), what
    `censored_survival` sums over blocks: counts [P, 3, K-1], at slot i = 1..K-1 the blocks passing it (a >= i),
    at risk at it (passing, or final with a = i - 1) and reaching it (a >= i - 1); and blocks [P]. Survival over
    any multiset of prompts is then a function of their summed counts (`survival_from_counts`)."""
    out = np.zeros((len(accept_lengths), 3, max(k - 1, 0)), np.int64)
    blocks = np.zeros(len(accept_lengths), np.int64)
    slots = np.arange(1, k)
    for p, (lengths, final) in enumerate(zip(accept_lengths, finals, strict=True)):
        a, f = np.asarray(lengths, np.int64) - 1, np.asarray(final, bool)
        passed = (a[:, None] >= slots).sum(axis=0)
        out[p, 0] = passed
        out[p, 1] = passed + (f[:, None] & (a[:, None] == slots - 1)).sum(axis=0)
        out[p, 2] = (a[:, None] >= slots - 1).sum(axis=0)
        blocks[p] = a.size
    return out, blocks


def survival_from_counts(counts: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    """[..., K-1] survival from summed `prompt_block_counts` ([..., 3, K-1] and [...]): `censored_survival`'s
    product-limit, its NaN and 0 where no block is at risk included, for any number of leading axes (replicates)."""
    passed, at_risk, reached = (counts[..., c, :].astype(np.float64) for c in range(3))
    s = np.where(blocks > 0, 1.0, np.nan)
    out = np.empty(passed.shape)
    for i in range(passed.shape[-1]):
        risk = at_risk[..., i]
        with np.errstate(divide="ignore", invalid="ignore"):
            step = s * (passed[..., i] / np.where(risk > 0, risk, 1.0))  # censored_survival's order of rounding
        # none at risk: undefined where some block got this far (all censored before it), else none survives
        s = np.where(risk > 0, step, np.where(reached[..., i] > 0, np.nan, np.where(blocks > 0, 0.0, np.nan)))
        out[..., i] = s
    return out


def resampled_survival(accept_lengths, finals, k: int, draws: np.ndarray) -> np.ndarray:
    """[R, K-1] `censored_survival` recomputed over the blocks of each row of `draws` ([R, P] prompt indices drawn
    with replacement, `infer.intervals.resamples`): a prompt drawn twice counts its blocks twice."""
    counts, blocks = prompt_block_counts(accept_lengths, finals, k)
    times = np.zeros((draws.shape[0], len(blocks)), np.int64)
    np.add.at(times, (np.arange(draws.shape[0])[:, None], draws), 1)
    return survival_from_counts(np.einsum("rp,pcj->rcj", times, counts), times @ blocks)


def _tau(survival: np.ndarray) -> np.ndarray:
    """Expected committed tokens per block, 1 + sum of S_j (NaN where any S_j is)."""
    return 1.0 + np.sum(survival, axis=-1)


def survival_intervals(
    accept_lengths, finals, k: int, *, replicates: int = REPLICATES, seed: int = SEED, level: float = LEVEL
) -> dict:
    """95% percentile bootstrap intervals over prompts of the censored survival S_1..S_{K-1} and of tau = 1 +
    sum S_j: each replicate resamples the prompts (`infer.intervals.resamples`, the draws every interval of the
    project uses) and recomputes the survival over the resampled prompts' blocks. Prompts, not blocks, are the
    unit: the blocks of one reply share its text and are far from independent."""
    n = len(accept_lengths)
    if not n:
        return {"survival_ci": [[math.nan, math.nan]] * (k - 1), "tau_ci": [math.nan, math.nan], "prompts": 0}
    reps = resampled_survival(accept_lengths, finals, k, resamples(n, replicates, seed))
    return {
        "survival_ci": [list(percentile_interval(reps[:, j], level)) for j in range(k - 1)],
        "tau_ci": list(percentile_interval(_tau(reps), level)),
        "prompts": n,
    }


def gap_intervals(
    real_lengths,
    tf_lengths,
    tf_finals,
    k: int,
    slots: int = 3,
    *,
    replicates: int = REPLICATES,
    seed: int = SEED,
    level: float = LEVEL,
) -> dict:
    """Paired 95% bootstrap intervals of real - teacher-forced on S_1..S_slots and tau over the same prompts (one
    list of rounds' accept lengths per prompt for real decoding, as `teacher_forced` returns them for the other):
    one draw of prompts serves both sides, so what a prompt does to both cancels in the difference."""
    n = len(real_lengths)
    if n != len(tf_lengths):
        raise ValueError("a paired gap needs real decoding and the teacher-forced pass on the same prompts")
    keys = [f"S_{j + 1}" for j in range(min(slots, k - 1))] + ["tau"]
    if not n:
        return {key: [math.nan, math.nan] for key in keys}
    draws = resamples(n, replicates, seed)
    real = resampled_survival(real_lengths, [[True] * len(r) for r in real_lengths], k, draws)
    tf = resampled_survival(tf_lengths, tf_finals, k, draws)
    diff = {f"S_{j + 1}": real[:, j] - tf[:, j] for j in range(min(slots, k - 1))}
    diff["tau"] = _tau(real) - _tau(tf)
    return {key: list(percentile_interval(diff[key], level)) for key in keys}


def _row_blocks(seq: np.ndarray, anchors: list[int], k: int):
    """Labels [N, K-1] (token a+j) of blocks at `anchors` of `seq`, and which lie inside it."""
    idx = np.asarray(anchors, np.int64)[:, None] + np.arange(1, k)[None, :]
    known = idx < len(seq)
    return seq[np.minimum(idx, len(seq) - 1)], known


@functools.partial(jax.jit, static_argnames=("k", "layer_ids", "zero_features", "vocab", "per_call"))
def _drafts(drafter, target, ids_1T, anchors_1N, *, k, layer_ids, zero_features, vocab, per_call):
    """[N, K-1] the drafter's greedy tokens at slots 1..K-1 of the blocks at `anchors_1N` (-1: padding), from the
    training pass over one row; the target's features come from one forward over the row."""
    feats = forward(target, ids_1T, layer_ids=layer_ids, compute_logits=False).features
    if zero_features:
        feats = jnp.zeros_like(feats)
    vocab_ids = None if vocab is None else jnp.asarray(vocab, jnp.int32)

    def greedy(anchors_1C):
        hidden = train_logits(drafter, target, feats, ids_1T, anchors_1C, k, hidden_only=True)
        index = jnp.argmax(lm_head(target, hidden[:, :, 1:], vocab_ids), axis=-1).astype(jnp.int32)
        return index if vocab_ids is None else jnp.take(vocab_ids, index)

    chunks = anchors_1N.reshape(-1, 1, per_call)
    return jax.lax.map(greedy, chunks).reshape(-1, k - 1)


def teacher_forced(
    target,
    drafter,
    k: int,
    prompts: list[list[int]],
    continuations: list[list[int]],
    *,
    rounds: list[list[int]] | None = None,
    zero_features: bool = False,
    vocab: tuple[int, ...] | None = None,
    min_length: int = 0,
    min_anchors: int = 0,
    on_row: Callable[[], object] | None = None,
) -> dict:
    """Teacher-forced acceptance of `drafter` at block size `k` on prompt + continuation rows (the continuation:
    the target's greedy reply, `plain_tokens` of a decode report). Anchors: every continuation position, or with
    `rounds` (each row's real accept lengths) the rounds' block starts. `zero_features` and `vocab` as the
    drafter was trained and served (`infer.proposers.DFlashProposer`). `min_length` and `min_anchors` pad every
    row to at least that many tokens and anchors, so that calls over different rows share one compile (padding
    after a row changes none of its drafts); `on_row` is called after each row (a progress bar).

    Returns accept_lengths (per row, per block: accepted drafts + 1, as a decode report counts), final (per row,
    per block: False where censored), drafts (per row, per block: the K-1 greedy drafts), blocks, censored,
    survival [S_1 .. S_{K-1}] and tau = 1 + sum S_j."""
    if len(prompts) != len(continuations) or (rounds is not None and len(rounds) != len(prompts)):
        raise ValueError("prompts, continuations (and rounds) need one entry per row")
    seqs = [np.asarray(list(p) + list(c), np.int32) for p, c in zip(prompts, continuations)]
    if rounds is None:
        anchors = [every_anchors(len(p), len(c)) for p, c in zip(prompts, continuations)]
    else:
        anchors = [round_anchors(len(p), r) for p, r in zip(prompts, rounds)]
    most = max(max(map(len, anchors), default=1), min_anchors)
    per_call = max(1, min(most, _LOGITS_BUDGET // ((k - 1) * lm_vocab(target, vocab))))
    n = max(1, -(-most // per_call)) * per_call
    t = max(_LENGTH_STEP, -(-max(max(len(s) for s in seqs), min_length) // _LENGTH_STEP) * _LENGTH_STEP)
    static = dict(
        k=k,
        layer_ids=tuple(int(i) for i in drafter.config.target_layer_ids),
        zero_features=zero_features,
        vocab=vocab,
        per_call=per_call,
    )
    lengths, finals, drafted = [], [], []
    for seq, row in zip(seqs, anchors):
        if not row:  # a reply of one token: no block to score
            for out in (lengths, finals, drafted):
                out.append([])
            if on_row is not None:
                on_row()
            continue
        ids = np.zeros((1, t), np.int32)
        ids[0, : len(seq)] = seq
        padded = np.full((1, n), -1, np.int32)
        padded[0, : len(row)] = row
        drafts = np.asarray(_drafts(drafter, target, jnp.asarray(ids), jnp.asarray(padded), **static))[: len(row)]
        labels, known = _row_blocks(seq, row, k)
        a, final = leading_correct(drafts, labels, known)
        lengths.append((a + 1).tolist())
        finals.append(final.tolist())
        drafted.append(drafts.tolist())
        if on_row is not None:
            on_row()
    flat_a = np.asarray([x - 1 for row in lengths for x in row], np.int64)
    flat_final = np.asarray([f for row in finals for f in row], bool)
    survival = censored_survival(flat_a, flat_final, k)
    return {
        "anchors": "every" if rounds is None else "rounds",
        "block_size": k,
        "blocks": int(flat_a.size),
        "censored": int(np.sum(~flat_final)),
        "survival": survival,
        "tau": 1.0 + float(np.sum(survival)) if flat_a.size else math.nan,
        "accept_lengths": lengths,
        "final": finals,
        "drafts": drafted,
    }


def lm_vocab(target, vocab) -> int:
    """The number of logits per slot: the draft vocabulary's size, else the target's."""
    return len(vocab) if vocab is not None else int(config_of(target).vocab_size)


def compare(estimate: dict, report: dict, slots: int = 3) -> dict:
    """S_1..S_slots and tau teacher-forced (`teacher_forced`) and in real decoding (a decode report's
    `acceptance_unconditional` and `tau`), and real minus teacher-forced."""
    real_s = [math.nan if s is None else s for s in report["acceptance_unconditional"]]
    real_s = (real_s + [math.nan] * slots)[:slots]
    est_s = (list(estimate["survival"]) + [math.nan] * slots)[:slots]
    est = {**{f"S_{j + 1}": s for j, s in enumerate(est_s)}, "tau": estimate["tau"]}
    real = {**{f"S_{j + 1}": s for j, s in enumerate(real_s)}, "tau": report["tau"]}
    rounds = sum(len(p["accept_lengths"]) for p in report.get("per_prompt", []))
    return {
        "teacher_forced": {**est, "blocks": estimate["blocks"], "censored": estimate["censored"]},
        "real": {**real, "rounds": rounds},
        "gap": {key: real[key] - est[key] for key in est},
        "anchors": estimate["anchors"],
        "note": "teacher-forced: the drafter's training pass over prompt + the target's greedy reply, blocks at "
        "every reply position, leading slots equal to the reply's tokens; real: the same prompts decoded; gap = "
        "real - teacher-forced",
    }


def format_agreement(cmp: dict) -> str:
    """A small markdown table of `compare`'s numbers."""

    def cells(d, sign=""):
        return " | ".join("-" if math.isnan(d[key]) else f"{d[key]:{sign}.3f}" for key in keys)

    keys = [key for key in cmp["gap"] if key.startswith("S_")] + ["tau"]
    tf, real = cmp["teacher_forced"], cmp["real"]
    return "\n".join(
        [
            "train/serve agreement (same prompts, the target's greedy replies)",
            "| acceptance | " + " | ".join(keys) + " |",
            "|---|" + "---:|" * len(keys),
            f"| teacher-forced, every reply position ({tf['blocks']} blocks, {tf['censored']} censored) | "
            f"{cells(tf)} |",
            f"| real decoding ({real['rounds']} rounds) | {cells(real)} |",
            f"| gap, real - teacher-forced | {cells(cmp['gap'], '+')} |",
        ]
    )
