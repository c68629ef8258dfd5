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
import sys
from pathlib import Path

import jax
from tqdm import tqdm

from data.prompt_sets import SETS, STYLES, ZLAB, Unavailable, held_out
from dflash_model.cli import run_main
from dflash_model.files import atomic_write_text, claim_dir, local_dir, push, run_path
from dflash_model.tokenizer import stop_token_ids
from infer.engine import Engine
from infer.eval_sets import DATASETS, answer_earlier_turns, dataset_messages, dataset_names, dataset_source, encode
from infer.loading import (
    DRAFT_HELP,
    at_least,
    check_prompt_ids,
    compare_specs,
    fit_prompts,
    load_drafts,
)
from infer.measure import LOSSLESS_SAMPLED, count_flips, run_comparison
from infer.metrics import strict_dumps
from infer.options import decode_options
from infer.projection import available_profiles, load_profiles
from infer.report import (
    drop_kept_sets,
    finished_set,
    format_comparison,
    format_flips,
    format_sets,
    format_table,
    keep_set,
    params_sha256,
    plot_acceptance,
    plot_comparison,
    set_file_name,
    target_sha256,
    write_acceptance_csv,
)
from infer.spec import check_positions
from infer.target_spec import load_target_spec


def _flips_against_fp32(args, target, prompts, reports: dict, stop_ids) -> dict | None:
    """Below fp32: decode every prompt plainly with the target in fp32 (untimed) and count where the plain answers
    of this run part from it (`count_flips`). None at fp32."""
    if target.config.dtype == "float32":
        return None
    fp32 = load_target_spec(args.target, "float32")
    engine = Engine(fp32.model, max_new_tokens=args.max_new_tokens, stop_ids=stop_ids)
    reference = [engine.generate([p])[0].tokens for p in prompts]
    return count_flips(reference, [r["plain_tokens"] for r in next(iter(reports.values()))["per_prompt"]])


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m infer.eval",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[decode_options()],
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
        bar = tqdm(desc=f"{name}: earlier turns", unit="answer", disable=args.no_progress, file=sys.stderr)
        turns = dict(max_new_tokens=args.max_new_tokens, stop_ids=stop_ids, batch_size=args.batch_size, bar=bar)
        rows = answer_earlier_turns(model, target.tokenizer, rows, thinking=thinking, **turns)
        bar.close()
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
    drafts = load_drafts(args.draft, target.config, args.block, args.seed)
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


def _about(args, argv, target, drafts) -> dict:
    """The run's settings and identities, for eval.json."""
    sampled = args.temperature > 0
    return {
        "command": " ".join(["python -m infer.eval", *(sys.argv[1:] if argv is None else argv)]),
        "target": str(target.path),
        "target_weights_sha256": target_sha256(target.path),
        "draft_weights_sha256": {d.name: params_sha256(d.params) for d in drafts},
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
        plot_comparison(
            res["reports"], out / f"acceptance-{set_file_name(name)}.png", title=f"{name}: survival and acceptance"
        )
    rep = {**about, "datasets": results, "skipped": skipped}
    return rep, format_sets(results, skipped)


def main(argv=None) -> dict:
    args = parse_args(argv)
    # --out before any work: a file there, a second eval writing there, or a store that cannot be reached is refused
    # now, not after the decoding. A gs:// --out is written locally, then mirrored there (dflash_model.files.push).
    with claim_dir(args.out, key="--out", doing="written by an eval", name=".eval.lock"):
        return _main(args, argv)


def _main(args, argv) -> dict:
    target, drafts, sets, skipped, stop_ids = checked_inputs(args)
    out = local_dir(args.out)
    about = _about(args, argv, target, drafts)
    many = len(dataset_names(args.dataset)) > 1
    results = {}
    for name, prepared in sets.items():  # with several sets, each kept as it finishes (report.keep_set)
        kept = finished_set(out, name, about) if many else None
        results[name] = kept or _run_set(args, target, drafts, prepared, stop_ids)
        if many and kept is None:
            keep_set(out, name, about, results[name])
    if many:
        rep, table = _write_many(out, about, results, skipped)
    else:
        rep, table = _write_one(out, about, next(iter(results.values())), drafts)
    # No path of this machine in a result meant to be committed: the home directory reads as ~.
    atomic_write_text(out / "eval.json", strict_dumps(rep, indent=1).replace(str(Path.home()), "~"))
    write_acceptance_csv(results, out / "acceptance.csv")
    atomic_write_text(out / "table.md", table + "\n")
    drop_kept_sets(out)
    print(table)
    push(args.out)
    print(f"wrote {run_path(args.out, 'eval.json')}, table.md, acceptance.csv and the acceptance plots")
    return rep


if __name__ == "__main__":
    run_main(main)
