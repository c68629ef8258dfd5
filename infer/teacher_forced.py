r"""Teacher-forced acceptance of a DFlash drafter on prompt sets: blocks at every position of the target's own greedy
reply, scored by the drafter's training pass, with 95% bootstrap intervals over prompts.

  python -m infer.teacher_forced --target smollm2|DIR|FILE.gguf --draft DIR \
      --dataset humaneval|gsm8k|mtbench|SET,SET|hf:ORG/NAME[:SPLIT]|FILE.jsonl [--limit N] [--skip N] \
      [--block K] [--max-new-tokens N] [--real N] [--replies FILE] --out DIR

Why: real speculative decoding on a CPU scores a drafter on a few hundred rounds of a few prompts, too few to tell
two drafters apart. Here every position of a reply is a block, all scored in one pass of the trained drafter
(`infer.agreement.teacher_forced`), and the replies are the target's alone: decoded once, they serve any number of
drafters (`--replies`), each paying only its own pass, so a comparison can afford many prompts. The intervals are
over prompts, the unit whose spread they measure (a reply's blocks share its text): their width comes down with
prompts, not with blocks.

What it estimates: the acceptance a round would get if its block started at a uniformly chosen position of the
target's own greedy reply, that reply being the text: S_j = P(at least j drafts accepted) and tau = 1 + sum S_j,
the committed tokens of such a round. Real decoding's rounds start where the previous round ended, not uniformly;
at those starts the same pass reproduces real decoding's accepted drafts round for round, and `--real N` measures
both on the first N prompts of each set and reports the gap.

The replies: plain greedy decoding of the target (`infer.plain`), batched, cut after a stop token and at
--max-new-tokens. A block whose slots run past the reply and matched every known token is censored; survival is the
product-limit over the blocks at risk (`infer.agreement.censored_survival`). Intervals: prompts resampled with
`infer.intervals.resamples` (the project's draws), the censored survival recomputed over each resample's blocks.

The prompts are held out from the ones that chose the shipped drafter's checkpoints: those were evaluated on each
set's first 10 or 40 prompts in file order (`--prompt-style raw`) and on the first 10 or 40 of z-lab's shuffled
order (the default style, `data.prompt_sets.subset`). `--skip N` (default 40) leaves out the first N of both orders
and takes the next --limit items in z-lab's order, so the sample is a random one (not the file's neighbours) and
disjoint from every `infer.eval --limit N` run with N <= --skip. A fresh seeded shuffle would not be: it would draw
some of the prompts that were used. A JSONL or hf: set skips its first N rows. Writes DIR/teacher_forced.json and
DIR/table.md (results of the shipped drafter: docs/results/teacher-forced/). This module is the command and its
report; the pass and its summaries are `infer.forced_acceptance`, the target's replies `infer.target_replies`.
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from pathlib import Path

import jax
from tqdm import tqdm

from data.prompt_sets import SETS, STYLES, Unavailable, held_out
from dflash_model.cli import run_main
from dflash_model.files import atomic_write_text, claim_dir, is_uri, local_dir, push, run_path, sha256_file
from dflash_model.tokenizer import stop_token_ids
from infer.eval_sets import dataset_messages, dataset_names, dataset_source
from infer.forced_acceptance import forced, real_decode, real_gap, set_result
from infer.intervals import LEVEL, REPLICATES, SEED
from infer.loading import at_least, load_draft_spec
from infer.metrics import strict_dumps
from infer.options import decode_options
from infer.proposers import DFlashProposer
from infer.spec import check_positions
from infer.target_replies import Replier, earlier_replies
from infer.target_spec import load_target_spec

DEFAULT_SKIP = 40  # the most prompts of a set any checkpoint of the shipped drafter was chosen on (--limit 40)
ESTIMATES = (
    "the acceptance a speculative round would get if its block started at a uniformly chosen position of the "
    "target's own greedy reply, that reply being the text (the drafter's training pass over prompt + reply, a block "
    "[token a, MASK x (K-1)] at every reply position a with a next token, its leading drafts equal to the reply's "
    "tokens accepted); not at the rounds' starts, which real decoding picks (each round starts where the last one "
    "ended). S_j = P(at least j drafts accepted), product-limit over the blocks at risk (a block running past the "
    "reply with every known draft right is censored); tau = 1 + sum S_j, the committed tokens of such a round"
)
INTERVAL_NOTE = (
    f"95% percentile bootstrap over prompts ({REPLICATES} replicates, seed {SEED}, infer.intervals.resamples): "
    "prompts resampled, the censored survival recomputed over the resampled prompts' blocks"
)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m infer.teacher_forced",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[decode_options(sampling=False)],
    )
    ap.add_argument("--draft", required=True, help="a DFlash drafter directory (z-lab or speculators format; required)")
    ap.add_argument(
        "--dataset",
        required=True,
        help="a named set (" + ", ".join(SETS) + "), a comma list of them, 'zlab', hf:ORG/NAME[:SPLIT] or a .jsonl "
        "file, as python -m infer.eval takes them; in a run of several, a set that cannot be loaded is skipped and "
        "named (required)",
    )
    ap.add_argument(
        "--limit",
        type=at_least(1),
        default=40,
        help="items per set (an MT-Bench item in the zlab style is both its turns; default 40)",
    )
    ap.add_argument(
        "--skip",
        type=at_least(0),
        default=DEFAULT_SKIP,
        help=f"leave out each set's first N items in file order and in z-lab's shuffled order, the prompts earlier "
        f"evals (and checkpoint choices) used; then take --limit in z-lab's order (default {DEFAULT_SKIP}; a "
        "JSONL or hf: set: its first N rows)",
    )
    ap.add_argument(
        "--prompt-style",
        choices=list(STYLES),
        default="zlab",
        help="the wording of named sets, as infer.eval's (default zlab: z-lab's wording, MT-Bench's second turns "
        "asked after the target's own greedy answers)",
    )
    ap.add_argument("--offline", action="store_true", help="package-shipped sets only; one only the hub has is skipped")
    ap.add_argument(
        "--thinking", choices=["on", "off"], default="off", help="the chat template's thinking switch (default off)"
    )
    ap.add_argument("--max-new-tokens", type=at_least(2), default=256, help="reply budget of the target (default 256)")
    ap.add_argument(
        "--batch-size",
        type=at_least(1),
        default=8,
        help="replies decoded at once (default 8; one compile per prompt-length bucket)",
    )
    ap.add_argument(
        "--real",
        type=at_least(0),
        default=0,
        metavar="N",
        help="also decode the first N prompts of each set speculatively (infer.engine.Engine, greedy, the same K) "
        "and report real minus teacher-forced on them (default 0: none)",
    )
    ap.add_argument(
        "--replies",
        metavar="FILE",
        help="reuse the target's replies of an earlier run (its teacher_forced.json or directory; the same target, "
        "dtype, --max-new-tokens, --prompt-style and --thinking) for the prompts it has, decoding only the others: "
        "a second drafter on the same prompts then pays only its teacher-forced pass (default: decode them all)",
    )
    ap.add_argument("--out", required=True, help="the directory for teacher_forced.json and table.md (required)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    args = ap.parse_args(argv)
    if not (Path(args.draft) / "config.json").is_file():
        raise ValueError(f"--draft {args.draft!r}: not a DFlash drafter directory (no config.json in it)")
    if not is_uri(args.out) and Path(args.out).exists() and not Path(args.out).is_dir():
        raise ValueError(f"--out {args.out!r}: an existing file, not a directory")
    return args


# --- the prompts --------------------------------------------------------------------------------------------------


def set_rows(name: str, args) -> tuple[list[dict], dict]:
    """The held-out rows of one set, and how they were chosen (`data.prompt_sets.held_out`)."""
    every = dataset_messages(name, None, style=args.prompt_style, offline=args.offline)
    rows, info = held_out(every, name in SETS, args.skip, args.limit)
    if not rows:
        raise ValueError(f"--dataset {name}: no prompt left after --skip {args.skip} ({info['items_in_set']} items)")
    return rows, info


def load_sets(args) -> tuple[dict, dict]:
    """({set: (rows, selection)}, {set: why skipped}); in a run of several sets one that cannot be loaded here is
    skipped, a single one is an error."""
    names = dataset_names(args.dataset)
    sets, skipped = {}, {}
    for name in names:
        try:
            sets[name] = set_rows(name, args)
        except Unavailable as e:
            if len(names) == 1:
                raise
            print(f"skipped {e}", file=sys.stderr)
            skipped[name] = str(e)
    if not sets:
        raise ValueError(f"--dataset {args.dataset}: every set was skipped: {skipped}")
    return sets, skipped


# --- the report ---------------------------------------------------------------------------------------------------


def _num(x, digits: int = 3) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _cell(value, ci, digits: int = 3) -> str:
    if not ci or any(v is None or math.isnan(v) for v in ci):
        return _num(value, digits)
    return f"{_num(value, digits)} [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]"


def _slots(values, n: int = 3) -> list:
    return (list(values) + [math.nan] * n)[:n]


def format_report(rep: dict) -> str:
    k = rep["block_size"]
    lines = [
        f"teacher-forced acceptance of {rep['draft']} at K={k} on {rep['target']}: blocks at every position of the "
        f"target's greedy reply (up to {rep['max_new_tokens']} new tokens), held-out prompts; [95% bootstrap "
        "interval over prompts]",
        "| set | prompts | blocks | censored | S_1 | S_2 | S_3 | tau |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in rep["sets"].items():
        cis = _slots(r["survival_ci"])
        cells = [_cell(s, ci) for s, ci in zip(_slots(r["survival"]), cis)]
        lines.append(
            f"| {name} | {r['prompts']} | {r['blocks']} | {r['censored']} | " + " | ".join(cells) + f" | "
            f"{_cell(r['tau'], r['tau_ci'], 2)} |"
        )
    lines += [f"| {name} | - | skipped: {why} | | | | | |" for name, why in rep["skipped"].items()]
    lines += ["", f"Estimates {rep['estimates']}.", ""]
    real = {name: r["real"] for name, r in rep["sets"].items() if "real" in r}
    if real:
        lines += _real_lines(real)
    return "\n".join(lines)


def _real_lines(real: dict) -> list[str]:
    first = next(iter(real.values()))
    lines = [
        f"real speculative decoding (infer.engine, greedy, the same K) on the first {first['rounds_check']['prompts']} "
        "prompts of each set, against the teacher-forced pass on the same prompts; gap = real - teacher-forced "
        "[95% paired bootstrap interval over those prompts]",
        "| set | measure | S_1 | S_2 | S_3 | tau |",
        "|---|---|---:|---:|---:|---:|",
    ]
    keys = ["S_1", "S_2", "S_3", "tau"]
    for name, cmp in real.items():
        tf, rl, check = cmp["teacher_forced"], cmp["real"], cmp["rounds_check"]
        lines += [
            f"| {name} | teacher-forced, every reply position ({tf['blocks']} blocks) | "
            + " | ".join(_num(tf.get(key, math.nan)) for key in keys)
            + " |",
            f"| {name} | real decoding ({rl['rounds']} rounds) | "
            + " | ".join(_num(rl.get(key, math.nan)) for key in keys)
            + " |",
            f"| {name} | gap | "
            + " | ".join(_cell(cmp["gap"].get(key, math.nan), cmp["gap_ci"].get(key)) for key in keys)
            + " |",
            f"| {name} | teacher-forced at the rounds' starts | {check['rounds_equal']}/{check['rounds']} rounds equal "
            f"to real decoding's; {check['replies_equal']}/{check['prompts']} replies lossless | | | |",
        ]
    return lines


def _cpu() -> str:
    try:
        names = [ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")]
    except OSError:
        names = []
    return f"{names[0] if names else platform.processor() or platform.machine()}, {len(names) or '?'} cores"


def _about(args, argv, target, draft, k: int) -> dict:
    files = Path(args.draft)
    weights = files / "model.safetensors"
    return {
        "command": " ".join(["python -m infer.teacher_forced", *(sys.argv[1:] if argv is None else argv)]),
        "target": args.target,
        "target_path": str(target.path).replace(str(Path.home()), "~"),
        "draft": files.name,
        "draft_weights_sha256": sha256_file(weights) if weights.is_file() else None,
        "block_size": k,
        "max_new_tokens": args.max_new_tokens,
        "dataset": args.dataset,
        "prompt_style": args.prompt_style,
        "skip": args.skip,
        "limit": args.limit,
        "thinking": args.thinking,
        "dtype": target.config.dtype,
        "device": str(jax.devices()[0]),
        "machine": _cpu(),
        "estimates": ESTIMATES,
        "interval_note": INTERVAL_NOTE,
        "interval_level": LEVEL,
    }


def checked_inputs(args):
    """(target config + tokenizer, the drafter as a Draft, K, stop ids), every size checked before the target's
    weights load."""
    target = load_target_spec(args.target, args.dtype, weights=False)
    draft = load_draft_spec(args.draft, target.config, args.block)
    if not isinstance(draft.proposer, DFlashProposer):
        raise ValueError(f"--draft {args.draft!r}: not a DFlash drafter directory")
    k = draft.block_size
    check_positions(1, args.max_new_tokens, k, target.config.max_position_embeddings, "--max-new-tokens")
    stop_ids = tuple(stop_token_ids(target.tokenizer)) if target.tokenizer is not None else ()
    return target, draft, k, stop_ids


def summarize(args, decoded, sets, got, k: int) -> dict:
    """{set: its numbers}, `got` (every set's rows in order) split back into sets."""
    results, row = {}, 0
    for name, (prompts, replies, cut) in decoded.items():
        mine = {key: got[key][row : row + len(prompts)] for key in got}
        row += len(prompts)
        results[name] = {
            "source": dataset_source(name),
            "prompts": len(prompts),
            "selection": sets[name][1],
            **set_result([r["id"] for r in sets[name][0]], prompts, replies, mine, k, args.max_new_tokens),
            **({"truncated_prompts": cut} if cut else {}),
        }
    return results


def add_real(args, model, draft, k: int, stop_ids, decoded, results, progress: bool) -> None:
    """--real: each set's first N prompts decoded speculatively, the gap written into its result."""
    n = {name: min(args.real, len(prompts)) for name, (prompts, _, _) in decoded.items()}
    gens = real_decode(
        model,
        draft,
        k,
        {name: prompts[: n[name]] for name, (prompts, _, _) in decoded.items()},
        max_new_tokens=args.max_new_tokens,
        stop_ids=stop_ids,
        progress=progress,
    )
    for name, (prompts, replies, _) in decoded.items():
        per = results[name]["per_prompt"][: n[name]]
        got = {"accept_lengths": [p["accept_lengths"] for p in per], "final": [p["final"] for p in per]}
        results[name]["real"] = real_gap(
            model,
            draft,
            k,
            gens[name],
            prompts[: n[name]],
            replies[: n[name]],
            got,
            max_new_tokens=args.max_new_tokens,
            progress=progress,
        )


def main(argv=None) -> dict:
    args = parse_args(argv)
    # --out before any work (a file there, a second writer, an unreachable store), as infer.eval does.
    with claim_dir(args.out, key="--out", doing="written by a teacher-forced pass", name=".eval.lock"):
        return _main(args, argv)


def _main(args, argv) -> dict:
    started = time.perf_counter()
    target, draft, k, stop_ids = checked_inputs(args)
    about = _about(args, argv, target, draft, k)
    known = earlier_replies(args.replies, about) if args.replies else {}
    sets, skipped = load_sets(args)
    out = local_dir(args.out)
    target.load_weights()
    progress = not args.no_progress
    timing = {}
    t = time.perf_counter()
    replier = Replier(args, target, k, stop_ids, progress, known)
    decoded = replier.replies({name: rows for name, (rows, _) in sets.items()})
    timing["replies_s"] = time.perf_counter() - t
    t = time.perf_counter()
    prompts = [p for ps, _, _ in decoded.values() for p in ps]
    replies = [r for _, rs, _ in decoded.values() for r in rs]
    with tqdm(total=len(prompts), desc="teacher-forced", disable=not progress, file=sys.stderr) as bar:
        got = forced(target.model, draft, k, prompts, replies, max_new_tokens=args.max_new_tokens, bar=bar)
    timing["teacher_forced_s"] = time.perf_counter() - t
    results = summarize(args, decoded, sets, got, k)
    if args.real:
        t = time.perf_counter()
        add_real(args, target.model, draft, k, stop_ids, decoded, results, progress)
        timing["real_s"] = time.perf_counter() - t
    timing["total_s"] = time.perf_counter() - started
    reused = {"replies_from": args.replies, "replies_reused": len(set(known) & replier.used)} if args.replies else {}
    rep = {**about, **reused, "timing_s": timing, "sets": results, "skipped": skipped}
    table = format_report(rep)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "teacher_forced.json", strict_dumps(rep, indent=1) + "\n")
    atomic_write_text(out / "table.md", table + "\n")
    print(table)
    push(args.out)
    print(f"wrote {run_path(args.out, 'teacher_forced.json')} and table.md")
    return rep


if __name__ == "__main__":
    run_main(main)
