"""The measuring library behind every evaluation: every decoder on the same prompts, interleaved, against one
plain baseline (`run_comparison`), timed as the decode loop runs, checked lossless, and summarised into tau,
survival, acceptance, speedup and projected speedup with intervals over prompts (`summarize`). No files and no
text: infer/report.py writes and formats; infer/eval.py is the command."""

from __future__ import annotations

import dataclasses
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from infer.engine import Engine
from infer.intervals import decoder_intervals
from infer.metrics import conditional_acceptance, survival, tau_per_prompt, tau_pooled
from infer.plain import bucket_length
from infer.projection import Profile, load_profiles, project, prompt_costs
from infer.proposers import Stateless

TAU_NOTE = (
    "tau (the headline) = tau_pooled = committed tokens / rounds, every round weighing the same (vllm-project/"
    "speculators' convention), counted on what each round output: accepted drafts + 1, cut at a stop token and at "
    "the budget; tau_per_prompt = mean over prompts of each prompt's committed tokens per round (prompts with no "
    "round left out); tau_zlab = z-lab dflash.benchmark's per-prompt tau, which counts a last round's accepted "
    "drafts + 1 before those cuts (up to K - 1 tokens never output), for setting published numbers beside ours; "
    "[lo, hi] = 95% bootstrap interval over prompts"
)


LOSSLESS_SAMPLED = "in distribution (T>0, not token-checked)"


PROJECTION_NOTE = (
    "projected_speedup[profile] = committed tokens / the rounds' cost in plain decode steps as infer/profiles/"
    "<profile>.json predicts it: measured profiles price each round verify_cost(its width) + draft_cost where a "
    "drafter forward ran; roofline profiles (infer/roofline.py, a Qwen3-8B-sized target with a 5-layer drafter, "
    "batch 1) price verify(width) + the drafter's forward where one ran + the round's fixed overhead, calibrated "
    "on the published TPU v5p round cost; = tau_pooled / projected_round_cost. A projection, not a timing: "
    "`speedup` is the measured one. null where a round's width is outside the profile's curve (projection_refused "
    "says which)"
)


def acceptance_stats(accept_lengths: list[int], k: int) -> dict:
    """tau (pooled over rounds), its histogram and per-position acceptance from the committed lengths (bonus
    included) of rounds (infer.metrics).

    With a = accept_length - 1 accepted drafts in a round, position j (1..K-1) was accepted iff a >= j.
    survival[j] = unconditional[j] = #(a >= j) / rounds (vLLM's per-position rate); conditional[j] =
    #(a >= j) / #(a >= j-1), the rate given every earlier draft was accepted (EAGLE's n-alpha).
    """
    lengths = np.asarray(accept_lengths, np.int64)
    surv = survival(lengths, k)
    return {
        "rounds": int(lengths.size),
        "tau": tau_pooled(lengths),
        "tau_histogram": {str(t): int(np.sum(lengths == t)) for t in range(1, k + 1)},
        "acceptance_unconditional": surv,
        "acceptance_conditional": conditional_acceptance(lengths, k),
        "survival": list(surv),
    }


def has_drafter(draft) -> bool:
    """Whether the decoder's rounds can run a drafter forward (a lookup proposer's draft costs next to nothing)."""
    return not isinstance(draft.proposer, Stateless)


def tau_and_projection(records: list[dict], draft, profiles: dict[str, Profile]) -> dict:
    """Both taus (on committed tokens), z-lab's overrun-counted tau, the speedup each profile projects for these
    rounds (infer.projection), and 95% bootstrap intervals over prompts on all of them (infer.intervals)."""
    per_prompt = [r["accept_lengths"] for r in records]
    k, drafter = draft.block_size, has_drafter(draft)
    costs = {name: prompt_costs(p, records, k, drafter) for name, p in profiles.items()}
    uncut = [r["accept_lengths_uncut"] for r in records if "accept_lengths_uncut" in r]
    return {
        "tau_pooled": tau_pooled([a for lengths in per_prompt for a in lengths]),
        "tau_per_prompt": tau_per_prompt(per_prompt),
        "tau_headline": "tau_pooled",
        "tau_note": TAU_NOTE,
        # z-lab dflash.benchmark's number, for setting published taus beside ours: per prompt, a + 1 before the
        # cut at the budget and at a stop token (a last round can count up to K - 1 tokens never output)
        "tau_zlab": tau_per_prompt(uncut) if len(uncut) == len(records) else math.nan,
        **project(profiles, records, k, drafter),
        "projection_note": PROJECTION_NOTE,
        "projected_cost_per_prompt": costs,
        **decoder_intervals(records, k, costs),
    }


def timed_batch(engine: Engine, ids, lengths, key):
    """(seconds, generations of every row) of one decode of a batch, prefill excluded."""
    state = engine.prefill(ids, lengths, key)
    jax.block_until_ready(state)
    t = time.perf_counter()
    state = engine.decode(state)
    jax.block_until_ready(state)
    return time.perf_counter() - t, engine.results(state)


def warm(engine: Engine, ids, lengths, key):
    """Compile prefill and decode for this shape without decoding: a state already marked done exits the
    loop at once but has exactly the shapes (and so the executable) of a real one."""
    state = engine.prefill(ids, lengths, key)
    jax.block_until_ready(engine.decode(state.replace(done=jnp.ones_like(state.done))))


def _predicted_s(engine: Engine, gen) -> float:
    """Seconds the decode would take if a round cost exactly its parts timed alone (engine.costs): the verify at
    the round's width plus the drafter forward where it ran. Decode time / this = the loop's overhead."""
    verify = dict(zip(engine.costs["widths"], engine.costs["verify_ms"]))
    rounds = zip(gen.verify_widths, gen.drafted)
    return 1e-3 * sum(verify[w] + (engine.costs["draft_ms"] if d else 0.0) for w, d in rounds)


def _batch_inputs(chunk: list[list[int]], batch_size: int, width: int, seed: int):
    """Device inputs of one batch of `batch_size` rows: the chunk's prompts, then copies of its first prompt where
    the last chunk is short (one shape, one compile; their answers are dropped)."""
    rows = chunk + [chunk[0]] * (batch_size - len(chunk))
    ids_BP = np.zeros((batch_size, width), np.int32)
    for b, prompt in enumerate(rows):
        ids_BP[b, : len(prompt)] = prompt
    return jnp.asarray(ids_BP), jnp.asarray([len(p) for p in rows], jnp.int32), jax.random.key(seed)


def _decode_all(engines: list[Engine], inputs, repeats: int) -> tuple[dict, dict]:
    """Every engine decodes the batch `repeats` times, the order reversed on every other repeat:
    ({id(engine): [seconds per repeat]}, {id(engine): generations of the last repeat})."""
    times = {id(e): [] for e in engines}
    gens = {}
    for r in range(repeats):
        for engine in engines if r % 2 == 0 else engines[::-1]:
            t, gens[id(engine)] = timed_batch(engine, *inputs)
            times[id(engine)].append(t)
    return times, gens


def _batch_predicted_s(engine: Engine, gens, rows: int) -> float:
    """A batch's predicted decode seconds (`_predicted_s` of its longest row: every row runs every round), shared
    by its rows."""
    if not engine.costs:
        return math.nan
    return _predicted_s(engine, max(gens, key=lambda g: len(g.verify_widths))) / rows


def run_comparison(
    target_model,
    drafts,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    stop_ids=(),
    ids=None,
    progress: bool = True,
    repeats: int = 1,
    overhead: bool = False,
    profiles: list[str] | None = None,
    temperature: float = 0.0,
    batch_size: int = 1,
) -> dict[str, dict]:
    """Each prompt decoded plainly and by every draft back to back, `batch_size` prompts at once (batch 1: the
    speedup convention), `repeats` times, the order reversed on every other repeat so that a drift in the machine's
    speed falls on both sides; {draft name: report}. Every report compares against the same plain runs, so the
    drafts' speedups share one baseline. A batch's decode time is shared equally by its prompts, so the report's
    tokens/s is the whole batch's. temperature > 0: every engine samples (T); the answers then match in
    distribution, not token for token. overhead: also time every fixed-width engine's forwards alone
    (`Engine.calibrate`, a few compiles more) for the loop-overhead ratio; adaptive engines and those choosing
    their tree size are always calibrated (they choose from those costs). profiles: the accelerator profiles to
    project speedups on (default: every committed one)."""
    if not prompts:
        raise ValueError("no prompts to decode")
    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    projection_profiles = load_profiles(profiles)
    names = [d.name for d in drafts]
    if len(set(names)) != len(names):
        raise ValueError(f"draft names must be distinct to compare them: {names}")
    common = dict(max_new_tokens=max_new_tokens, stop_ids=stop_ids, temperature=temperature)
    plain = Engine(target_model, **common)
    specs = [Engine(target_model, d.proposer, d.params, **common, **d.engine_options()) for d in drafts]
    # Every prompt is padded to the longest one's bucket: one compile per engine instead of one per bucket
    # (compiles dominate a short eval on a CPU); padding after the prompt changes no output. The costs measured
    # at these shapes (calibrate) hold for every prompt.
    width = bucket_length(max(len(p) for p in prompts))
    records = {d.name: [] for d in drafts}
    starts = range(0, len(prompts), batch_size)
    for c, start in enumerate(tqdm(starts, desc="eval", disable=not progress, file=sys.stderr)):
        chunk = prompts[start : start + batch_size]
        inputs = _batch_inputs(chunk, batch_size, width, seed=c)
        if c == 0:
            for engine in (plain, *specs):
                if overhead or engine.needs_costs:
                    engine.calibrate(*inputs)
                warm(engine, *inputs)
        times, gens = _decode_all([plain, *specs], inputs, repeats)
        n = len(chunk)
        plain_s = [t / n for t in times[id(plain)]]
        plain_pred = _batch_predicted_s(plain, gens[id(plain)], n)
        for d, spec in zip(drafts, specs):
            spec_pred = _batch_predicted_s(spec, gens[id(spec)], n)
            for row, prompt in enumerate(chunk):
                g_plain, g_spec = gens[id(plain)][row], gens[id(spec)][row]
                records[d.name].append(
                    {
                        "id": ids[start + row] if ids else start + row,
                        "prompt_tokens": len(prompt),
                        "plain_tokens": g_plain.tokens,
                        "spec_tokens": g_spec.tokens,
                        "accept_lengths": g_spec.accept_lengths,
                        "accept_lengths_uncut": g_spec.accept_lengths_uncut,
                        "verify_widths": g_spec.verify_widths,
                        "drafted": g_spec.drafted,
                        "plain_decode_s": plain_s,
                        "spec_decode_s": [t / n for t in times[id(spec)]],
                        "plain_predicted_s": plain_pred,
                        "spec_predicted_s": spec_pred,
                    }
                )
    out = {}
    for d, spec in zip(drafts, specs):
        if spec.costs and "tree_choice" in spec.costs:  # a tree size chosen at start-up: report the one decoded
            d = dataclasses.replace(d, block_size=spec.block_size, tree_nodes=spec.costs["tree_choice"]["nodes"])
        out[d.name] = summarize(
            records[d.name], d, max_new_tokens, projection_profiles, temperature=temperature, batch_size=batch_size
        )
        out[d.name]["costs_ms"] = {name: e.costs for name, e in (("plain", plain), (d.name, spec)) if e.costs}
    return out


def _seconds(r: dict, key: str) -> list[float]:
    """A record's decode times (one per repeat; older records hold a single float)."""
    v = r[key]
    return list(v) if isinstance(v, (list, tuple)) else [v]


def _mismatches(records: list[dict]) -> list[dict]:
    """Where each prompt's speculative answer first parts from its plain one (none where they are equal)."""
    out = []
    for r in records:
        p, s = r["plain_tokens"], r["spec_tokens"]
        first = first_difference(p, s)
        if first is not None:
            out.append(
                {
                    "id": r["id"],
                    "first_diff": first,
                    "plain": p[first : first + 8],
                    "spec": s[first : first + 8],
                    "plain_len": len(p),
                    "spec_len": len(s),
                }
            )
    return out


def _lossless(records: list[dict], temperature: float) -> dict:
    """Greedy: the speculative answers checked against the plain ones token for token. T > 0: both sample, so
    equal answers are not expected; the engine's rule keeps the target's distribution, which is not checked here."""
    if temperature > 0:
        return {
            "lossless": LOSSLESS_SAMPLED,
            "lossless_mismatches": None,
            "mismatch_examples": [],
        }
    mismatches = _mismatches(records)
    return {
        "lossless": "token for token against plain greedy decoding",
        "lossless_mismatches": len(mismatches),
        "mismatch_examples": mismatches[:10],
    }


def summarize(
    records: list[dict],
    draft,
    max_new_tokens: int,
    profiles: dict[str, Profile] | None = None,
    *,
    temperature: float = 0.0,
    batch_size: int = 1,
) -> dict:
    """A decoder's report from its per-prompt records; profiles: those to project speedups on (default: all)."""
    k = draft.block_size
    stats = acceptance_stats([a for r in records for a in r["accept_lengths"]], k)
    widths = [w for r in records for w in r.get("verify_widths", [])]
    # Decode-only tokens: the first token of each answer comes from the prefill, the rest from the loop.
    plain_tok = sum(max(len(r["plain_tokens"]) - 1, 0) for r in records)
    spec_tok = sum(max(len(r["spec_tokens"]) - 1, 0) for r in records)
    # Per repeat: the whole set's plain and speculative decode time. The headline numbers are their medians; the
    # spread is their range.
    repeats = min(len(_seconds(r, k_)) for r in records for k_ in ("plain_decode_s", "spec_decode_s"))
    plain_rep = [sum(_seconds(r, "plain_decode_s")[i] for r in records) for i in range(repeats)]
    spec_rep = [sum(_seconds(r, "spec_decode_s")[i] for r in records) for i in range(repeats)]
    plain_s, spec_s = float(np.median(plain_rep)), float(np.median(spec_rep))
    speedups = [p / s for p, s in zip(plain_rep, spec_rep) if s > 0]
    tpot_plain = 1e3 * plain_s / plain_tok if plain_tok else math.nan
    tpot_spec = 1e3 * spec_s / spec_tok if spec_tok else math.nan
    overhead = {}
    for side in ("plain", "spec"):
        predicted = sum(r.get(f"{side}_predicted_s", math.nan) for r in records)
        overhead[side] = (plain_s if side == "plain" else spec_s) / predicted if predicted else math.nan
    return {
        "draft": draft.name,
        "block_size": k,
        "adaptive": bool(getattr(draft, "adaptive", False)),
        "tree_nodes": getattr(draft, "tree_nodes", None),
        "prompts": len(records),
        "max_new_tokens": max_new_tokens,
        **stats,
        **tau_and_projection(records, draft, load_profiles() if profiles is None else profiles),
        "mean_verify_width": float(np.mean(widths)) if widths else float(k),
        "acceptance_note": "position j = j-th draft of a round; survival = unconditional = #(accepted >= j) / rounds; "
        "conditional = #(accepted >= j) / #(accepted >= j-1) (adaptive: rounds that verified fewer than j "
        "drafts count as not accepting j)",
        "tpot_plain_ms": tpot_plain,
        "tpot_spec_ms": tpot_spec,
        "speedup": tpot_plain / tpot_spec if spec_tok and plain_tok and spec_s else math.nan,
        "repeats": repeats,
        # TPOT ratio per repeat: (plain s / plain tokens) / (spec s / spec tokens).
        "speedup_per_repeat": [x * spec_tok / plain_tok for x in speedups] if spec_tok and plain_tok else [],
        "loop_overhead": overhead["spec"],
        "loop_overhead_plain": overhead["plain"],
        "loop_overhead_note": "decode time / (sum over rounds of the verify at its width + the drafter forward "
        "where it ran, each timed alone at the decode's shapes)",
        "tokens_per_s_plain": plain_tok / plain_s if plain_s else math.nan,
        "tokens_per_s_spec": spec_tok / spec_s if spec_s else math.nan,
        "decode_tokens_plain": plain_tok,
        "decode_tokens_spec": spec_tok,
        "timing": f"decode only (prefill excluded), batch {batch_size}, "
        f"{'greedy' if temperature == 0 else f'temperature {temperature}'}, block_until_ready, compiled beforehand; "
        "plain and speculative interleaved batch by batch; medians over repeats"
        + (
            "; a batch's time is shared equally by its prompts: tokens/s is the whole batch's" if batch_size > 1 else ""
        ),
        "temperature": temperature,
        "batch_size": batch_size,
        **_lossless(records, temperature),
        "per_prompt": records,
    }


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where two answers differ (the shorter one's length where one stopped and the other
    went on); None where they are equal."""
    if a == b:
        return None
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def count_flips(reference: list[list[int]], tokens: list[list[int]]) -> dict:
    """Where greedy answers part from a reference decoding of the same prompts (bf16 against fp32): a flip is the
    first token where they differ (a near-tie in the logits that the lower precision resolves the other way);
    after it the two texts go their own ways, so later tokens are not compared."""
    first = [first_difference(ref, got) for ref, got in zip(reference, tokens, strict=True)]
    flipped = [j for j in first if j is not None]
    return {
        "prompts": len(first),
        "identical": len(first) - len(flipped),
        "first_flip": first,
        "median_first_flip": float(np.median(flipped)) if flipped else None,
        "note": "first_flip[i]: index of the first answer token that differs from the reference decoding (None: "
        "identical)",
    }
