"""Recount committed `infer.eval` results on what was output, with 95% intervals over prompts and paired comparisons.

  .venv/bin/python benchmarks/recount.py docs/results/shipped/humaneval/eval.json [...] \
      [--pair A,B ...] [--profile tpu-v5p] [--out docs/results/recount]

eval.json files written before a round recorded what it committed hold each round's accepted drafts + 1 before the
cut at the budget and at a stop token (z-lab's count). Only a prompt's last round can be cut (a cut ends the row),
so the committed count is exact from the record: the last round committed the output tokens the earlier rounds did
not (len(spec_tokens) - 1 - their sum; the first token is the prefill's). Files that already hold both counts are
read as they are. Per decoder: tau on output, z-lab's tau, S_1..S_3 and the projected speedup, each with its 95%
bootstrap interval (infer/intervals.py); then each drafter against n-gram at its own K and the given pairs, paired.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dflash_model.files import atomic_write_text, check_out_dir  # noqa: E402
from infer.intervals import comparisons, decoder_intervals, format_comparisons  # noqa: E402
from infer.metrics import strict_dumps, survival, tau_per_prompt, tau_pooled  # noqa: E402
from infer.projection import load_profiles, project, prompt_costs  # noqa: E402

LOOKUPS = ("ngram", "lookup", "reply")  # decoders whose rounds run no drafter forward


def committed(record: dict) -> tuple[list[int], list[int]]:
    """(committed tokens per round, accepted drafts + 1 per round before the cuts) of one prompt's record."""
    if "accept_lengths_uncut" in record:
        return list(record["accept_lengths"]), list(record["accept_lengths_uncut"])
    uncut = list(record["accept_lengths"])
    if not uncut:
        return [], []
    output = len(record["spec_tokens"]) - 1
    last = output - sum(uncut[:-1])
    if not 1 <= last <= uncut[-1]:
        raise ValueError(f"prompt {record.get('id')}: {output} output tokens do not fit rounds {uncut}")
    return uncut[:-1] + [last], uncut


def reports_of(path: Path) -> dict[str, dict[str, dict]]:
    """{set: {decoder: report}} of any eval.json layout (one decoder, `reports`, or `datasets`) or a kept set."""
    if not path.is_file():
        raise ValueError(f"{path}: no such file (an eval.json of python -m infer.eval, or its DIR/sets/SET.json)")
    try:
        raw = json.loads(path.read_text())
        if "about" in raw and "result" in raw:  # DIR/sets/SET.json: a set a several-set infer.eval kept as it finished
            return {path.stem: raw["result"]["reports"]}
        if "datasets" in raw:
            return {name: res["reports"] for name, res in raw["datasets"].items()}
        name = raw.get("dataset") or raw.get("prompts") or path.parent.name
        if "reports" in raw:
            return {str(name): raw["reports"]}
        return {str(name): {raw["draft"]: raw}}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: not an eval.json of python -m infer.eval ({type(e).__name__}: {e})") from None


def recount(report: dict, name: str, profiles) -> dict:
    records = []
    for r in report["per_prompt"]:
        if not isinstance(r, dict) or "accept_lengths" not in r or "spec_tokens" not in r:
            raise ValueError(f"decoder {name}: a per_prompt record without accept_lengths and spec_tokens")
        out, uncut = committed(r)
        records.append({**r, "accept_lengths": out, "accept_lengths_uncut": uncut})
    k = int(report["block_size"])
    drafter = not name.startswith(LOOKUPS)
    flat = [a for r in records for a in r["accept_lengths"]]
    costs = {p: prompt_costs(prof, records, k, drafter) for p, prof in profiles.items()}
    return {
        "draft": name,
        "block_size": k,
        "prompts": len(records),
        "max_new_tokens": report.get("max_new_tokens"),
        "rounds": len(flat),
        "tau": tau_pooled(flat),
        "tau_as_committed_before": report.get("tau"),
        "tau_zlab": tau_per_prompt([r["accept_lengths_uncut"] for r in records]),
        "survival": survival(flat, k),
        **project(profiles, records, k, drafter),
        "projected_cost_per_prompt": costs,
        **decoder_intervals(records, k, costs),
        "per_prompt": records,
    }


def _cell(value, ci, digits: int = 3) -> str:
    if value is None:
        return "-"
    if not ci or any(c is None for c in ci):
        return f"{value:.{digits}f}"
    return f"{value:.{digits}f} [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]"


def table(results: dict, profile: str) -> str:
    lines = [
        f"| file | set | decoder | K | prompts | tau on output [95%] | tau as first reported | tau, z-lab | S_1 [95%] "
        f"| projected, {profile} [95%] |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    notes = []
    for (file, set_name), reports in results.items():
        for name, r in reports.items():
            s1 = r["survival"][0] if r["survival"] else None
            s1_ci = r["survival_ci"][0] if r["survival_ci"] else None
            lines.append(
                f"| {file} | {set_name} | {name} | {r['block_size']} | {r['prompts']} | "
                f"{_cell(r['tau'], r['tau_ci'])} | {_cell(r['tau_as_committed_before'], None)} | "
                f"{_cell(r['tau_zlab'], None)} | {_cell(s1, s1_ci)} | "
                f"{_cell(r['projected_speedup'].get(profile), r['projected_speedup_ci'].get(profile), 2)} |"
            )
    return "\n".join(lines + notes)


def _pair(text: str) -> tuple[str, str]:
    a, _, b = text.partition(",")
    if not a or not b or "," in b:
        raise ValueError(f"--pair {text!r}: give two decoder names as A,B (e.g. --pair ft32@32,ft16@16)")
    return a, b


def _check_pairs(pairs, results: dict) -> None:
    """Each --pair names two decoders of one set in at least one file: a misspelt name would otherwise compare
    nothing and say nothing."""
    for a, b in pairs:
        if not any(a in reps and b in reps for reps in results.values()):
            names = sorted({n for reps in results.values() for n in reps})
            raise ValueError(f"--pair {a},{b}: no file has both decoders in one set; the decoders are {names}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", type=Path, help="eval.json files")
    ap.add_argument("--pair", action="append", default=[], help="A,B: also compare decoder A with B (paired)")
    ap.add_argument("--profile", default="tpu-v5p", help="the profile whose projected speedup is compared")
    ap.add_argument("--out", type=Path, default=None, help="write table.md and recount.json here")
    args = ap.parse_args(argv)
    if args.out:
        check_out_dir(args.out, "--out")
    pairs = [_pair(p) for p in args.pair]
    profiles = load_profiles()
    if args.profile not in profiles:
        raise ValueError(f"--profile {args.profile!r}: no such profile; the profiles are {sorted(profiles)}")
    results, compared = {}, {}
    for path in args.files:
        where = path.parent.resolve()
        file = str(where.relative_to(ROOT) if path.is_absolute() and where.is_relative_to(ROOT) else path.parent)
        for set_name, reports in reports_of(path).items():
            key = (file, set_name)
            try:
                results[key] = {n: recount(r, n, profiles) for n, r in reports.items() if r.get("per_prompt")}
            except ValueError as e:
                raise ValueError(f"{path}, set {set_name}: {e}") from None
            compared[key] = comparisons(results[key], args.profile, pairs)
    _check_pairs(pairs, results)
    text = table(results, args.profile)
    for (file, set_name), found in compared.items():
        if found:
            text += f"\n\n{file}, {set_name}: " + format_comparisons(found)
    print(text)
    if args.out:
        cmd = "python benchmarks/recount.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
        args.out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.out / "table.md", f"Made by `{cmd}`.\n\n{text}\n")
        slim = {
            f"{f} | {s}": {
                "decoders": {n: {k: v for k, v in r.items() if k != "per_prompt"} for n, r in reps.items()},
                "comparisons": compared[(f, s)],
            }
            for (f, s), reps in results.items()
        }
        atomic_write_text(args.out / "recount.json", strict_dumps({"command": cmd, "results": slim}, indent=1))
        print(f"wrote {args.out}/table.md and recount.json")


if __name__ == "__main__":
    from dflash_model.cli import run_main

    run_main(main)
