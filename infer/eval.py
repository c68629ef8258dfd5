r"""Measure a proposer on a prompt set: tau, survival and per-position acceptance, TPOT and speedup vs plain decoding,
the speedup projected on accelerator profiles, lossless check.

  python -m infer.eval --target DIR|FILE.gguf|smollm2 --draft DIR|ngram|random|none | --compare DIR \
      --dataset gsm8k|math500|humaneval|mbpp|mtbench|aime25|alpaca|zlab|SET,SET|hf:ORG/NAME[:SPLIT]|FILE.jsonl \
      [--limit N] [--max-new-tokens N] [--block K] [--temperature T] [--batch-size B] \
      [--profiles tpu-v5p,tpu-v6e,h100,h200,this-machine] --out DIR

tau, the headline, is tau_pooled = committed tokens / rounds (every round weighs the same; vllm-project/speculators'
convention), counted on what was output: a round's accepted drafts + 1, cut at a stop token and at the budget;
tau_per_prompt, the mean over prompts of each prompt's tau, is reported beside it, and tau_zlab (z-lab
dflash.benchmark's per-prompt tau, which counts a last round's drafts past the budget) as a compatibility column.
Every tau, S_j and projected speedup carries a 95% bootstrap interval over prompts (infer/intervals.py), and
`--compare` sets each drafter against n-gram at the drafter's own K with a paired interval. Survival S_j = P(at
least j drafts accepted in a round).
The measured speedup is wall clock on this machine; a projected speedup is tau over the round cost a profile
(infer/profiles/NAME.json, in plain decode steps) predicts for the rounds' verify widths, not a timing.

Greedy, batch 1 by default (the speedup convention of the published DFlash numbers), max 2048 new tokens, thinking
off; the named sets are worded, subset and multi-turn as z-lab dflash's benchmark takes them. Prompts are
chat-templated. Both engines are the same code: the baseline is proposer none with K = 1. Timing is decode only:
prefill and the decode loop are separate jitted calls, each compiled before timing, and a decode is timed up to
block_until_ready on its output (jax.effects_barrier would not wait for a pure computation). Writes DIR/eval.json,
DIR/table.md, DIR/acceptance.csv (vllm-project/speculators' columns) and the acceptance plots, and prints the table.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import hashlib
import io
import json
import math
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from data.prompt_sets import SETS, STYLES, ZLAB, Unavailable, held_out, hf_prompts, jsonl_prompts, named_prompts
from dflash_model.cli import run_main
from dflash_model.files import atomic_write_text, claim_dir, local_dir, push, run_path, sha256_file
from dflash_model.tokenizer import chat_prompt_ids, stop_token_ids
from infer.engine import Engine
from infer.intervals import comparisons, decoder_intervals, format_comparisons
from infer.loading import (
    DRAFT_HELP,
    NGRAM_BLOCK,
    at_least,
    check_prompt_ids,
    fit_prompts,
    load_draft_spec,
    non_negative,
)
from infer.metrics import conditional_acceptance, strict_dumps, survival, tau_per_prompt, tau_pooled
from infer.plain import bucket_length
from infer.projection import HEADLINE_PROFILE, Profile, available_profiles, load_profiles, project, prompt_costs
from infer.proposers import Stateless
from infer.spec import MAX_BLOCK, check_positions
from infer.target_spec import load_target_spec

DATASETS = tuple(SETS)
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


def dataset_names(value: str) -> list[str]:
    """--dataset as the sets it runs: 'zlab' is z-lab's five, a comma list each of its parts, else the one value."""
    if value == "zlab":
        return list(ZLAB)
    return [v for v in value.split(",") if v] or [value]


def dataset_messages(name: str, limit: int | None = None, *, style: str = "raw", offline: bool = False) -> list[dict]:
    """Rows [{id, text} | {id, messages} | {id, prompt_ids}] of a named set (data.prompt_sets.SETS), an HF dataset
    (hf:ORG/NAME[:SPLIT], or a local dataset directory) or a JSONL file (data.prompt_sets.parse_row).

    style zlab: z-lab dflash's wording and subset; MT-Bench's second turns are rows with `earlier_turns`, asked
    after the target's own answers (`answer_earlier_turns`). raw (the default of this function, what the earlier
    numbers of this project used): the bare text, first turns only, the first `limit` items.
    """
    if name in SETS:
        return named_prompts(name, limit, style=style, offline=offline)
    if name.startswith("hf:"):
        return hf_prompts(name[3:], limit, offline=offline)
    path = Path(name)
    if not path.is_file():
        raise ValueError(f"--dataset {name!r}: expected one of {DATASETS}, zlab, hf:ORG/NAME[:SPLIT] or a .jsonl file")
    return jsonl_prompts(path, limit)


def dataset_source(name: str) -> str:
    """Where a --dataset's rows come from, for eval.json."""
    if name in SETS:
        return SETS[name].source or f"HF hub {SETS[name].hub_name}"
    return name


def answer_earlier_turns(model, tokenizer, rows: list[dict], *, max_new_tokens: int, stop_ids=(), thinking=False):
    """Rows with `earlier_turns` made chats: each earlier user turn followed by the target's own answer to it
    (plain greedy decoding, up to max_new_tokens, the text without special tokens), then the row's turn. This is
    z-lab's MT-Bench turn 2, there asked after the speculative decode's answer, the same text under greedy
    decoding."""
    if not any("earlier_turns" in r for r in rows):
        return rows
    if tokenizer is None:
        raise ValueError("a multi-turn set needs the target's tokenizer to write its answers back into the chat")
    engine = Engine(model, max_new_tokens=max_new_tokens, stop_ids=stop_ids)
    answers: dict[str, str] = {}
    out = []
    for r in rows:
        if "earlier_turns" not in r:
            out.append(r)
            continue
        messages = []
        for turn in r["earlier_turns"]:
            messages.append({"role": "user", "content": turn})
            key = json.dumps(messages)
            if key not in answers:
                gen = engine.generate([chat_prompt_ids(tokenizer, messages, thinking=thinking)])[0]
                answers[key] = tokenizer.decode(gen.tokens, skip_special_tokens=True)
            messages.append({"role": "assistant", "content": answers[key]})
        out.append({"id": r["id"], "messages": [*messages, {"role": "user", "content": r["text"]}]})
    return out


def encode(rows: list[dict], tokenizer, thinking: bool = False) -> list[list[int]]:
    out = []
    for r in rows:
        if "prompt_ids" in r:
            out.append(r["prompt_ids"])
            continue
        if tokenizer is None:
            raise ValueError("this target has no tokenizer: the dataset must give token ids (input_ids)")
        if "earlier_turns" in r:
            raise ValueError(f"prompt {r['id']}: a later turn, encoded before its earlier turns were answered")
        out.append(chat_prompt_ids(tokenizer, r.get("messages", r.get("text")), thinking=thinking))
    return out


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


def _timed_batch(engine: Engine, ids, lengths, key):
    """(seconds, generations of every row) of one decode of a batch, prefill excluded."""
    state = engine.prefill(ids, lengths, key)
    jax.block_until_ready(state)
    t = time.perf_counter()
    state = engine.decode(state)
    jax.block_until_ready(state)
    return time.perf_counter() - t, engine.results(state)


def _timed_decode(engine: Engine, ids, lengths, key):
    """(seconds, the first row's generation) of one decode, prefill excluded."""
    t, gens = _timed_batch(engine, ids, lengths, key)
    return t, gens[0]


def _warm(engine: Engine, ids, lengths, key):
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
            t, gens[id(engine)] = _timed_batch(engine, *inputs)
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
                _warm(engine, *inputs)
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


def _flips_against_fp32(args, target, prompts, reports: dict, stop_ids) -> dict | None:
    """Below fp32: decode every prompt plainly with the target in fp32 (untimed) and count where the plain answers
    of this run part from it (`count_flips`). None at fp32."""
    if target.config.dtype == "float32":
        return None
    fp32 = load_target_spec(args.target, "float32")
    engine = Engine(fp32.model, max_new_tokens=args.max_new_tokens, stop_ids=stop_ids)
    reference = [engine.generate([p])[0].tokens for p in prompts]
    return count_flips(reference, [r["plain_tokens"] for r in next(iter(reports.values()))["per_prompt"]])


def format_flips(flips: dict) -> str:
    return (
        f"plain decoding against fp32 plain decoding: {flips['identical']}/{flips['prompts']} answers identical; "
        f"first flips at tokens {[j for j in flips['first_flip'] if j is not None]}"
    )


def _num(x, digits: int = 3) -> str:
    """A number for a table; '-' where there is none (None or NaN: not measured, e.g. forwards not timed alone, or
    no round reached that position)."""
    return "-" if x is None or math.isnan(x) else f"{x:.{digits}f}"


def _profiles_of(rep: dict) -> list[str]:
    """The report's projection profiles, the headline one first."""
    names = list(rep.get("projected_speedup") or {})
    return sorted(names, key=lambda n: n != HEADLINE_PROFILE)


def _times(x, digits: int = 2) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:.{digits}f}x"


def _ci(pair, digits: int = 2) -> str:
    """' [lo, hi]' of a 95% interval, or '' where there is none (an older eval.json, or too few prompts)."""
    if not pair or any(v is None or math.isnan(v) for v in pair):
        return ""
    return f" [{pair[0]:.{digits}f}, {pair[1]:.{digits}f}]"


def _tau_cell(rep: dict) -> str:
    return _num(rep["tau"]) + _ci(rep.get("tau_ci"))


def _survival_cell(rep: dict, j: int) -> str:
    """S_j and its interval (j from 1)."""
    values = list(rep["acceptance_unconditional"])
    cis = list(rep.get("survival_ci") or [])
    if j > len(values):
        return "-"
    return _num(values[j - 1]) + _ci(cis[j - 1] if j <= len(cis) else None)


def _projected(rep: dict, profile: str) -> str:
    return _times((rep.get("projected_speedup") or {}).get(profile)) + _ci(
        (rep.get("projected_speedup_ci") or {}).get(profile)
    )


def _projected_others(rep: dict, names: list[str]) -> str:
    """'h100 1.91x, this-machine 0.70x': the non-headline profiles' projections in one cell."""
    return ", ".join(f"{n} {_projected(rep, n)}" for n in names) or "-"


def _tau_footer(rep: dict) -> str:
    return f"{rep.get('tau_note', TAU_NOTE)}."


def _projection_rows(rep: dict) -> list[str]:
    rows = []
    for name in _profiles_of(rep):
        cost = (rep.get("projected_round_cost") or {}).get(name)
        refused = (rep.get("projection_refused") or {}).get(name)
        detail = f"refused: {refused}" if refused else f"round = {_num(cost, 2)} plain steps"
        rows.append(f"| projected speedup, {name} profile (not a timing) | {_projected(rep, name)} ({detail}) |")
    return rows


def format_table(rep: dict) -> str:
    k = rep["block_size"]
    lines = [
        f"draft={rep['draft']}  K={k}  prompts={rep['prompts']}  max_new_tokens={rep['max_new_tokens']}  "
        f"{_decoding(rep)}",
        "| metric | value |",
        "|---|---|",
        f"| verify rounds | {rep['rounds']} |",
        f"| tau (committed tokens per round, bonus incl.; pooled over rounds, the headline) | {_tau_cell(rep)} |",
        f"| tau per prompt (mean over prompts of each prompt's tau) | {_num(rep.get('tau_per_prompt'))}"
        f"{_ci(rep.get('tau_per_prompt_ci'))} |",
        f"| tau, z-lab's count (per prompt; a last round's drafts past the budget counted) | "
        f"{_num(rep.get('tau_zlab'))} |",
        f"| TPOT plain (ms) | {_num(rep['tpot_plain_ms'], 2)} |",
        f"| TPOT speculative (ms) | {_num(rep['tpot_spec_ms'], 2)} |",
        f"| speedup, measured wall clock (decode only) | {_times(rep['speedup'], 3)}{_spread(rep)} |",
        *_projection_rows(rep),
        f"| loop overhead (round / its parts timed alone) | {_num(rep.get('loop_overhead'))} |",
        f"| tokens/s plain / speculative | {_num(rep['tokens_per_s_plain'], 2)} / "
        f"{_num(rep['tokens_per_s_spec'], 2)} |",
        f"| lossless mismatches (prompts) | {_lossless_cell(rep, 'mismatched')} |",
        "",
        "tau histogram: " + "  ".join(f"{t}:{c}" for t, c in rep["tau_histogram"].items()),
        "",
        "| draft position j | " + " | ".join(str(j) for j in range(1, k)) + " |",
        "|---|" + "---|" * (k - 1),
        "| survival S_j = P(>= j accepted) [95% interval] | "
        + " | ".join(_survival_cell(rep, j) for j in range(1, k))
        + " |",
        "| conditional P(j accepted given j-1) | " + " | ".join(_num(x) for x in rep["acceptance_conditional"]) + " |",
        "",
        _tau_footer(rep) + " Projected speedups are tau over the round cost an accelerator profile predicts "
        "(infer/profiles/NAME.json), not timings; the measured speedup is this run's wall clock.",
    ]
    for m in rep["mismatch_examples"]:
        lines.append(f"MISMATCH {m['id']}: first diff at {m['first_diff']}: plain {m['plain']} spec {m['spec']}")
    return "\n".join(lines)


def _nan_for_none(values) -> list[float]:
    """Rates read back from a strict eval.json hold None where the run had NaN; matplotlib wants NaN (a gap)."""
    return [math.nan if v is None else v for v in values]


def _plot_survival(reports: dict[str, dict], path: Path, title: str) -> None:
    """Two panels, one line per decoder up to its own K-1: survival S_j against position j, and the conditional
    acceptance at j beside it."""
    import matplotlib  # plots only: an eval that draws none never loads matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (surv_ax, cond_ax) = plt.subplots(1, 2, figsize=(11, 3.8), sharex=True)
    for name, r in reports.items():
        j = list(range(1, r["block_size"]))
        label = f"{name} (K={r['block_size']}, tau={_num(r['tau'], 2)})"
        ms = 3 if len(j) <= 16 else 0
        surv_ax.plot(j, _nan_for_none(r.get("survival", r["acceptance_unconditional"])), "o-", ms=ms, label=label)
        cond_ax.plot(j, _nan_for_none(r["acceptance_conditional"]), "s--", ms=ms, label=label)
    surv_ax.set_ylabel("survival $S_j$ = P(>= j drafts accepted)")
    cond_ax.set_ylabel("P(draft j accepted | drafts < j accepted)")
    for ax in (surv_ax, cond_ax):
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.set_xlabel("draft position j")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    surv_ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_acceptance(rep: dict, path: Path) -> None:
    """One decoder's survival and conditional acceptance against draft position."""
    title = f"{rep['draft']}, K={rep['block_size']}, tau={_num(rep['tau'], 2)}, {rep['prompts']} prompts"
    _plot_survival({rep["draft"]: rep}, path, title)


def _spread(rep: dict) -> str:
    """'(min-max over R repeats)' of the speedup, or '' for one repeat."""
    per = rep.get("speedup_per_repeat") or []
    return f" ({min(per):.2f}-{max(per):.2f} over {len(per)})" if len(per) > 1 else ""


def _lossless_cell(rep: dict, count: str) -> str:
    """'0 / 10' mismatched or '10/10 equal' prompts; T > 0: 'in distribution (...)', no token check."""
    if rep.get("lossless_mismatches") is None:
        return rep.get("lossless", LOSSLESS_SAMPLED)
    if count == "equal":
        return f"{rep['prompts'] - rep['lossless_mismatches']}/{rep['prompts']} equal"
    return f"{rep['lossless_mismatches']} / {rep['prompts']}"


def _comparison_row(name: str, r: dict, headline: str, others: list[str]) -> str:
    return (
        f"| {name} | {r['block_size']} | {r.get('mean_verify_width', r['block_size']):.1f} | {_tau_cell(r)} | "
        f"{_num(r.get('tau_per_prompt'))} | {_num(r.get('tau_zlab'))} | "
        + " | ".join(_survival_cell(r, j) for j in (1, 2, 3))
        + f" | {_num(r['tpot_spec_ms'], 1)} | {_times(r['speedup'])}{_spread(r)} | {_projected(r, headline)} | "
        f"{_projected_others(r, others)} | {_num(r.get('loop_overhead'), 2)} | {_num(r['tokens_per_s_spec'], 2)} | "
        f"{_lossless_cell(r, 'equal')} |"
    )


def _decoding(rep: dict) -> str:
    """'greedy, batch 1' or 'temperature 0.7, batch 4 (tokens/s: the whole batch's)'."""
    t, b = rep.get("temperature", 0.0), rep.get("batch_size", 1)
    return (
        ("greedy" if not t else f"temperature {t}")
        + f", batch {b}"
        + (" (tokens/s: the whole batch's)" if b > 1 else "")
    )


def format_comparison(reports: dict[str, dict], found: list[dict] | None = None) -> str:
    """One row per decoder, plain first, then the paired comparisons (`found`, default `infer.intervals.comparisons`
    under the headline profile): the table a run prints at its end."""
    first = next(iter(reports.values()))
    names = _profiles_of(first)
    headline, others = (names[0], names[1:]) if names else ("-", [])
    lines = [
        f"{first['prompts']} prompts, up to {first['max_new_tokens']} new tokens, {_decoding(first)}; decoders "
        f"interleaved prompt by prompt, {first.get('repeats', 1)} repeat(s): TPOT and measured speedup are medians, "
        "decode only, the range over repeats in brackets; width = mean tokens verified per round; overhead = decode "
        "time / its verify and drafter forwards timed alone",
        f"| decoder | K | width | tau [95%] | tau/prompt | tau, z-lab | S_1 | S_2 | S_3 | TPOT ms | speedup, measured "
        f"| projected, {headline} | projected, other profiles | overhead | tokens/s | lossless |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---|",
        f"| plain | 1 | 1.0 | 1.000 | 1.000 | 1.000 | - | - | - | {_num(first['tpot_plain_ms'], 1)} | 1.00x | 1.00x | "
        f"{', '.join(f'{n} 1.00x' for n in others) or '-'} | {_num(first.get('loop_overhead_plain'), 2)} | "
        f"{_num(first['tokens_per_s_plain'], 2)} | - |",
        *(_comparison_row(name, r, headline, others) for name, r in reports.items()),
        "",
        *(
            [format_comparisons(found if found is not None else comparisons(reports, headline)), ""]
            if len(reports) > 1
            else []
        ),
        _tau_footer(first) + " S_j = survival, P(at least j drafts accepted in a round). Projected = tau over "
        "the round cost a profile (infer/profiles/NAME.json) predicts for the rounds' verify widths, in plain decode "
        "steps: a projection, not a timing ('-': a width outside the profile's curve); the measured speedup is this "
        "run's wall clock.",
    ]
    return "\n".join(lines)


def plot_comparison(reports: dict[str, dict], path: Path, title: str = "") -> None:
    """Survival and conditional acceptance of several decoders against draft position (each up to its own K-1)."""
    _plot_survival(reports, path, title or "survival and conditional acceptance")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m infer.eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--target", required=True, help="the target: an HF model directory, a .gguf file, or 'smollm2' (required)"
    )
    ap.add_argument(
        "--draft",
        action="append",
        help=f"the proposer, {DRAFT_HELP}; optionally SPEC@K, "
        "optionally NAME=SPEC to name its row; "
        "repeat to compare several in one interleaved run (one plain baseline); no default: give --draft or --compare",
    )
    ap.add_argument(
        "--compare",
        metavar="DIR",
        help="compare every decoder of one drafter directory in one interleaved table: n-gram (K=8, and at the "
        "drafter's K, or --block, as ngram-K<K>), adaptive n-gram (K=16), DFlash, adaptive DFlash, hybrid, adaptive "
        "hybrid, DDTree (adds to --draft; default: none)",
    )
    ap.add_argument(
        "--repeats",
        type=at_least(1),
        default=1,
        help="decode every prompt this many times, the order reversed every other time (default 1; the timings "
        "are medians, their range in brackets)",
    )
    ap.add_argument(
        "--dataset",
        required=True,
        help=f"the prompts: a named set ({', '.join(DATASETS)}; their rows and wording as z-lab dflash's benchmark "
        "takes them, see --prompt-style), 'zlab' (its five published sets, "
        f"{', '.join(ZLAB)}, at its published counts, one combined table), a comma list of sets, "
        "hf:ORG/NAME[:SPLIT] or hf:ORG/NAME:CONFIG:SPLIT (through `datasets`; a local dataset directory for "
        "ORG/NAME too; split default test, or the only one), or a .jsonl file (each row prompt (text), messages (a "
        "chat list) or input_ids / token_ids (raw ids, no template)); every text prompt is chat-templated (required)",
    )
    ap.add_argument(
        "--skip",
        type=at_least(0),
        default=0,
        help="leave out the prompts that chose a checkpoint: a named set drops the first N items of both its file "
        "order and z-lab's shuffled order and takes --limit items in z-lab's order (the held-out rule of "
        "python -m infer.teacher_forced; 40 holds out every prompt the shipped drafter was chosen on); a file drops "
        "its first N rows (default 0)",
    )
    ap.add_argument(
        "--limit",
        type=at_least(1),
        default=None,
        help="N prompts (items: an MT-Bench item is both its turns) per set (default: all, and in a run of several "
        "sets z-lab's published count of each: " + ", ".join(f"{n} {SETS[n].count}" for n in SETS) + "); a named set "
        "takes z-lab's subset in the zlab style (Python's random.shuffle seeded 0, then the first N), else its first N",
    )
    ap.add_argument(
        "--prompt-style",
        choices=list(STYLES),
        default="zlab",
        help="named sets: zlab (default): z-lab dflash benchmark's wording (math: '...within \\boxed{}.' after the "
        "problem; HumanEval: asked to solve it inside a python fence), its subset, and every MT-Bench turn (turn 2 "
        "asked after the target's own greedy answer to turn 1); raw: the bare text, the first N, MT-Bench's first "
        "turn only (this project's numbers before the z-lab wording)",
    )
    ap.add_argument(
        "--offline",
        action="store_true",
        help="package-shipped sets only: a set only the HF hub has is skipped (named in the table and eval.json) "
        "without trying the network (default: try the hub, skip the set where that fails)",
    )
    ap.add_argument(
        "--temperature",
        type=non_negative,
        default=0.0,
        help="sampling temperature of the target, plain and speculative alike (default 0: greedy, the speedup "
        "convention, every answer checked token for token against plain decoding's; T > 0 keeps the target's "
        "distribution, not checked here: eval.json says so)",
    )
    ap.add_argument(
        "--batch-size",
        type=at_least(1),
        default=1,
        help="prompts decoded at once (default 1, the published speedups' convention); above 1 the speedup and "
        "tokens/s are the whole batch's (a batch decodes until its longest answer ends)",
    )
    ap.add_argument(
        "--max-new-tokens",
        type=at_least(1),
        default=2048,
        help="new tokens a prompt at most (default 2048, the published DFlash benchmarks' setting; tau moves with it)",
    )
    ap.add_argument(
        "--thinking",
        choices=["on", "off"],
        default="off",
        help="the chat template's thinking switch (enable_thinking; default off, as DFlash drafters are trained and "
        "benchmarked); refused for a template that has none",
    )
    ap.add_argument(
        "--block", type=at_least(2, MAX_BLOCK), default=None, help="block size K (default: each drafter's own)"
    )
    ap.add_argument(
        "--truncate-prompts",
        action="store_true",
        help="cut a prompt too long for the target's positions (with --max-new-tokens and K) to its last tokens "
        "that fit, said on stderr and in eval.json (default: refused)",
    )
    ap.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="the target's compute dtype (default: its config's); below float32 the plain answers are also "
        "compared with float32 plain decoding (flips_vs_fp32)",
    )
    ap.add_argument("--seed", type=int, default=0, help="init seed of --draft random (default 0)")
    ap.add_argument(
        "--out",
        required=True,
        help="the directory (or gs:// path) for eval.json, table.md, acceptance.csv, plots (required)",
    )
    ap.add_argument("--no-progress", action="store_true", help="no progress bar on stderr (default: one)")
    ap.add_argument(
        "--profiles",
        type=_profile_names,
        default=None,
        help="comma-separated accelerator profiles to project each decoder's speedup on (tau / the round cost the "
        f"profile predicts, in plain decode steps; a projection, not a timing): {', '.join(available_profiles())} "
        "(default: all; 'none' for no projection). The headline tau is tau_pooled (1 + accepted / rounds); "
        "tau_per_prompt is reported beside it",
    )
    args = ap.parse_args(argv)
    if args.compare and not (Path(args.compare) / "config.json").is_file():
        ap.error(f"argument --compare: {args.compare!r} is not a drafter directory (no config.json in it)")
    if args.compare:
        args.draft = (args.draft or []) + compare_specs(args.compare, args.block)
    if not args.draft:
        ap.error("give --draft (one or more) or --compare DIR")
    return args


def _profile_names(value: str) -> list[str]:
    """--profiles: names of committed profiles, checked here so that a typo fails before any model loads."""
    if value == "none":
        return []
    names = [n for n in value.split(",") if n]
    unknown = sorted(set(names) - set(available_profiles()))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown profile(s) {unknown}; the profiles are {available_profiles()}")
    return names


def _drafter_block(drafter_dir: str) -> int | None:
    """The block size K a drafter directory was trained with (its config.json), None where it names none."""
    try:
        k = json.loads((Path(drafter_dir) / "config.json").read_text()).get("block_size")
    except (OSError, ValueError, AttributeError):
        return None
    return int(k) if isinstance(k, int) else None


def compare_specs(drafter_dir: str, block: int | None = None) -> list[str]:
    """The --draft values of `--compare DIR`: every way this project decodes with one drafter, and n-gram, at
    K=8 and, named ngram-K<K>, at the drafter's own K (--block where given), the same-K baseline."""
    k = block or _drafter_block(drafter_dir)
    same_k = [f"ngram-K{k}=ngram@{k}"] if k and k != NGRAM_BLOCK else []
    return [
        f"ngram@{NGRAM_BLOCK}",
        *same_k,
        "adaptive:ngram@16",
        drafter_dir,
        f"adaptive:{drafter_dir}",
        f"hybrid:{drafter_dir}",
        f"adaptive:hybrid:{drafter_dir}",
        f"tree:{drafter_dir}",
    ]


def _drafts(specs: list[str], target_cfg, block: int | None, seed: int):
    """Draft objects for --draft values (NAME=SPEC or SPEC, each optionally @K), with distinct names: NAME names
    the row; else a second drafter directory is named by its directory, its prefixes kept (fullvocab:DIR is
    fullvocab-DIRNAME), and by its K too where that is what differs."""
    out = []
    for given in specs:
        label, eq, rest = given.partition("=")
        if not eq or not re.fullmatch(r"[\w.+@-]+", label):
            label, rest = "", given
        spec, at, k = rest.partition("@")
        if at and not k.isdigit():
            raise ValueError(f"--draft {given!r}: the block size after '@' must be a whole number, not {k!r}")
        d = load_draft_spec(spec, target_cfg, int(k) if k else block, seed=seed)
        if label:
            d = dataclasses.replace(d, name=label)
        elif any(o.name == d.name for o in out):
            dir_name = Path(spec.rsplit(":", 1)[-1]).name
            name = d.name.replace("dflash", dir_name) if "dflash" in d.name else f"{d.name}-{dir_name}"
            d = dataclasses.replace(d, name=name if all(o.name != name for o in out) else f"{name}@{d.block_size}")
        if any(o.name == d.name for o in out):
            raise ValueError(f"--draft {given!r}: a second row named {d.name!r}; name it with NAME=SPEC")
        out.append(d)
    return out


def _set_limit(args, name: str, many: bool) -> int | None:
    """--limit, else in a run of several sets (zlab, a comma list) z-lab's published count of a named set."""
    if args.limit is not None or not many or name not in SETS or args.prompt_style != "zlab":
        return args.limit
    return SETS[name].count


def _check_thinking(args, target) -> bool:
    thinking = args.thinking == "on"
    if thinking and "enable_thinking" not in str(getattr(target.tokenizer, "chat_template", None) or ""):
        raise ValueError(f"--thinking on: the chat template of --target {args.target} has no enable_thinking switch")
    return thinking


def prepared_set(args, target, drafts, name: str, rows: list[dict], stop_ids) -> tuple[list, list, dict]:
    """(rows, prompts, prompts cut) of one set, every prompt checked against the target's config (lengths, ids);
    a later turn is first asked after the target's own answers (its weights load for that)."""
    thinking = _check_thinking(args, target)
    if any("earlier_turns" in r for r in rows):
        model = target.load_weights().model
        rows = answer_earlier_turns(
            model, target.tokenizer, rows, max_new_tokens=args.max_new_tokens, stop_ids=stop_ids, thinking=thinking
        )
    prompts = encode(rows, target.tokenizer, thinking=thinking)
    names = [f"--dataset {name}: prompt {r['id']}" for r in rows]
    check_prompt_ids(prompts, target.config, names=names)
    prompts, cut = fit_prompts(
        prompts,
        target.config,
        max_new_tokens=args.max_new_tokens,
        width=max(d.width for d in drafts),
        names=names,
        truncate=args.truncate_prompts,
    )
    return rows, prompts, cut


def checked_inputs(args):
    """(target, drafts, {set: (rows, prompts, prompts cut)}, {set: why it was skipped}, stop ids) with every input
    checked against the target's config before its weights load (the lengths: max_new_tokens, K, each prompt
    against the target's positions; the token ids), but a multi-turn set's, which needs the target's answers. In
    a run of several sets, one that cannot be loaded here is skipped (said why); a single one is an error."""
    target = load_target_spec(args.target, args.dtype, weights=False)
    positions = target.config.max_position_embeddings
    check_positions(1, args.max_new_tokens, args.block or 1, positions, "--max-new-tokens")
    drafts = _drafts(args.draft, target.config, args.block, args.seed)
    _check_thinking(args, target)
    stop_ids = tuple(stop_token_ids(target.tokenizer)) if target.tokenizer is not None else ()
    names = dataset_names(args.dataset)
    sets, skipped = {}, {}
    for name in names:
        try:
            limit = _set_limit(args, name, len(names) > 1)
            if args.skip:
                every = dataset_messages(name, None, style=args.prompt_style, offline=args.offline)
                rows, _ = held_out(every, name in SETS, args.skip, limit)
            else:
                rows = dataset_messages(name, limit, style=args.prompt_style, offline=args.offline)
        except Unavailable as e:
            if len(names) == 1:
                raise
            print(f"skipped {e}", file=sys.stderr)
            skipped[name] = str(e)
            continue
        if not rows:
            raise ValueError(f"--dataset {name}: no prompts in it")
        sets[name] = prepared_set(args, target, drafts, name, rows, stop_ids)
    if not sets:
        raise ValueError(f"--dataset {args.dataset}: every set was skipped: {skipped}")
    return target.load_weights(), drafts, sets, skipped, stop_ids


def _params_sha256(params) -> str | None:
    """sha256 over a drafter's parameter arrays (dtype, shape, bytes, in tree order); None where it has none."""
    leaves = jax.tree.leaves(params)
    if not leaves:
        return None
    h = hashlib.sha256()
    for x in leaves:
        if jnp.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        a = np.asarray(x)
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def _target_sha256(path: Path) -> str:
    """sha256 of the target's weight file, or over its directory's weight files' (name, sha256) in name order."""
    path = Path(path)
    if path.is_file():
        return sha256_file(path)
    files = sorted(f for pattern in ("*.safetensors", "*.gguf", "*.bin") for f in path.glob(pattern))
    return hashlib.sha256("".join(f"{f.name} {sha256_file(f)}\n" for f in files).encode()).hexdigest()


def _about(args, argv, target, drafts) -> dict:
    """The run's settings and identities, for eval.json."""
    sampled = args.temperature > 0
    return {
        "command": " ".join(["python -m infer.eval", *(sys.argv[1:] if argv is None else argv)]),
        "target": str(target.path),
        "target_weights_sha256": _target_sha256(target.path),
        "draft_weights_sha256": {d.name: _params_sha256(d.params) for d in drafts},
        "block_sizes": {d.name: d.block_size for d in drafts},
        "dataset": args.dataset,
        "prompt_style": args.prompt_style,
        "max_new_tokens": args.max_new_tokens,
        "thinking": args.thinking,
        "temperature": args.temperature,
        "batch_size": args.batch_size,
        "lossless": LOSSLESS_SAMPLED if sampled else "token for token against plain greedy decoding",
        "method": "speculative decoding, each decoder's tokens "
        + ("sampled at the same temperature as plain decoding's" if sampled else "checked against plain greedy's"),
        "device": str(jax.devices()[0]),
        "dtype": target.config.dtype,
        "tau_headline": "tau_pooled",
        "projection_profiles": {n: p.summary() for n, p in load_profiles(args.profiles).items()},
    }


def _run_set(args, target, drafts, prepared, stop_ids) -> dict:
    """One set decoded by every decoder: {reports, prompts, flips_vs_fp32?, truncated_prompts?}."""
    rows, prompts, cut = prepared
    reports = run_comparison(
        target.model,
        drafts,
        prompts,
        max_new_tokens=args.max_new_tokens,
        stop_ids=stop_ids,
        ids=[r["id"] for r in rows],
        progress=not args.no_progress,
        repeats=args.repeats,
        overhead=True,
        profiles=args.profiles,
        temperature=args.temperature,
        batch_size=args.batch_size,
    )
    out = {"prompts": len(prompts), "reports": reports}
    flips = _flips_against_fp32(args, target, prompts, reports, stop_ids)
    out.update({"flips_vs_fp32": flips} if flips else {})
    out.update({"truncated_prompts": cut} if cut else {})
    return out


def acceptance_rows(results: dict[str, dict]) -> tuple[list[str], list[dict]]:
    """(columns, rows) of acceptance.csv: one row per set and decoder in vllm-project/speculators' columns (its
    evaluate script's acceptance.csv; `decoder` added): num_drafts = verify rounds, num_draft_tokens = drafts
    verified, num_accepted_tokens = drafts accepted, acceptance_length = 1 + accepted / rounds (tau_pooled),
    acceptance_at_pos_i = rounds that accepted draft i+1 / rounds (survival S_(i+1))."""
    rows, positions = [], 0
    for name, res in results.items():
        for decoder, r in res["reports"].items():
            lengths = [a for p in r["per_prompt"] for a in p["accept_lengths"]]
            widths = [w for p in r["per_prompt"] for w in p.get("verify_widths", [])]
            drafts = sum(w - 1 for w in widths) if len(widths) == len(lengths) else len(lengths) * (r["block_size"] - 1)
            row = {
                "subset": name,
                "decoder": decoder,
                "num_drafts": len(lengths),
                "num_draft_tokens": drafts,
                "num_accepted_tokens": sum(a - 1 for a in lengths),
                "acceptance_length": 1 + sum(a - 1 for a in lengths) / len(lengths) if lengths else 0,
            }
            survival = r["acceptance_unconditional"]
            row.update(
                {f"acceptance_at_pos_{i}": 0 if s is None or math.isnan(s) else s for i, s in enumerate(survival)}
            )
            positions = max(positions, len(survival))
            rows.append(row)
    columns = ["subset", "decoder", "num_drafts", "num_draft_tokens", "num_accepted_tokens", "acceptance_length"]
    return columns + [f"acceptance_at_pos_{i}" for i in range(positions)], rows


def write_acceptance_csv(results: dict[str, dict], path: Path) -> None:
    columns, rows = acceptance_rows(results)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(path, buf.getvalue())


def format_sets(results: dict[str, dict], skipped: dict[str, str]) -> str:
    """One row per set and decoder (the sets of one run, each against its own plain decoding), then the skipped
    sets."""
    first = next(iter(next(iter(results.values()))["reports"].values()))
    lines = [
        f"up to {first['max_new_tokens']} new tokens, {_decoding(first)}, {first.get('repeats', 1)} repeat(s); "
        "speedup: decode-only wall clock against plain decoding of the same set, interleaved",
        f"| set | prompts | decoder | K | tau [95%] | tau/prompt | tau, z-lab | S_1 | S_2 | S_3 | speedup, measured "
        f"| projected, {HEADLINE_PROFILE} | lossless |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, res in results.items():
        for decoder, r in res["reports"].items():
            lines.append(
                f"| {name} | {r['prompts']} | {decoder} | {r['block_size']} | {_tau_cell(r)} | "
                f"{_num(r.get('tau_per_prompt'))} | {_num(r.get('tau_zlab'))} | "
                + " | ".join(_survival_cell(r, j) for j in (1, 2, 3))
                + " | "
                f"{_times(r['speedup'])}{_spread(r)} | {_projected(r, HEADLINE_PROFILE)} | "
                f"{_lossless_cell(r, 'equal')} |"
            )
    lines += [f"| {name} | - | skipped: {why} | | | | | | | | | | |" for name, why in skipped.items()]
    lines += ["", _tau_footer(first) + " S_j = survival, P(at least j drafts accepted in a round)."]
    for name, res in results.items():
        if len(res["reports"]) > 1:
            lines += ["", f"{name}: " + format_comparisons(comparisons(res["reports"], HEADLINE_PROFILE))]
    return "\n".join(lines)


def _write_one(out: Path, about: dict, res: dict, drafts) -> tuple[dict, str]:
    """eval.json's content and the table of a run of one set (the earlier layout: one draft's report is the
    file; several share one table)."""
    reports = res["reports"]
    extra = {k: res[k] for k in ("flips_vs_fp32", "truncated_prompts") if k in res}
    about = {**about, "dataset_prompts": res["prompts"], "dataset_source": dataset_source(about["dataset"])}
    rep = {**about, "reports": reports, **extra} if len(drafts) > 1 else {**reports[drafts[0].name], **about, **extra}
    if len(drafts) > 1:
        plot_comparison(
            reports, out / "acceptance.png", title=f"{about['dataset']}: survival and conditional acceptance"
        )
        table = format_comparison(reports)
    else:
        plot_acceptance(rep, out / "acceptance.png")
        table = format_table(rep)
    return rep, table + (f"\n\n{format_flips(extra['flips_vs_fp32'])}" if "flips_vs_fp32" in extra else "")


def _write_many(out: Path, about: dict, results: dict, skipped: dict) -> tuple[dict, str]:
    """eval.json's content and the combined table of a run of several sets; acceptance-SET.png per set."""
    for name, res in results.items():
        res["source"] = dataset_source(name)
        plot_comparison(res["reports"], out / f"acceptance-{name}.png", title=f"{name}: survival and acceptance")
    rep = {**about, "datasets": results, "skipped": skipped}
    return rep, format_sets(results, skipped)


def main(argv=None) -> dict:
    args = parse_args(argv)
    # --out before any work: a file there, a second eval writing there, or a store that cannot be reached is refused
    # now, not after the decoding. A gs:// --out is written locally, then mirrored there (dflash_model.files.push).
    lock = claim_dir(args.out, key="--out", doing="written by an eval", name=".eval.lock")
    try:
        return _main(args, argv)
    finally:
        lock.release()


def _main(args, argv) -> dict:
    target, drafts, sets, skipped, stop_ids = checked_inputs(args)
    out = local_dir(args.out)
    results = {name: _run_set(args, target, drafts, prepared, stop_ids) for name, prepared in sets.items()}
    about = _about(args, argv, target, drafts)
    many = len(dataset_names(args.dataset)) > 1
    if many:
        rep, table = _write_many(out, about, results, skipped)
    else:
        rep, table = _write_one(out, about, next(iter(results.values())), drafts)
    # No path of this machine in a result meant to be committed: the home directory reads as ~.
    atomic_write_text(out / "eval.json", strict_dumps(rep, indent=1).replace(str(Path.home()), "~"))
    write_acceptance_csv(results, out / "acceptance.csv")
    atomic_write_text(out / "table.md", table + "\n")
    print(table)
    push(args.out)
    print(f"wrote {run_path(args.out, 'eval.json')}, table.md, acceptance.csv and the acceptance plots")
    return rep


if __name__ == "__main__":
    run_main(main)
