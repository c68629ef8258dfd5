"""One table over several `infer.eval` runs (one per dataset): each decoder's speedup over plain decoding, its range
over the repeats, tau and lossless count, and the best decoder's speedup over n-gram's, per set.

  .venv/bin/python benchmarks/eval_summary.py docs/results/decoding/twice/{humaneval,gsm8k,mtbench} \
      [--baseline ngram] [--out docs/results/decoding/twice]

Each argument is an eval's --out directory (its eval.json). With --out it writes summary.md and summary.json there.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from dflash_model.files import atomic_write_text, check_out_dir


def load_reports(directory: Path) -> dict:
    path = directory / "eval.json"
    if not path.exists():
        raise SystemExit(f"{path}: no eval.json (run infer.eval with --out {directory} first)")
    return json.loads(path.read_text())["reports"]


def speedup_cell(report: dict) -> str:
    per_repeat = report.get("speedup_per_repeat") or [report["speedup"]]
    spread = f" ({min(per_repeat):.2f}-{max(per_repeat):.2f})" if len(per_repeat) > 1 else ""
    return f"{report['speedup']:.2f}x{spread}, tau {report['tau']:.2f}"


def summarize(directories: list[Path], baseline: str) -> tuple[str, dict]:
    sets = {d.name: load_reports(d) for d in directories}
    decoders = list(dict.fromkeys(name for reports in sets.values() for name in reports))
    lines = ["| decoder | " + " | ".join(sets) + " |", "|---|" + "---:|" * len(sets)]
    first = {s: next(iter(r.values())) for s, r in sets.items()}
    lines.append("| plain TPOT | " + " | ".join(f"{first[s]['tpot_plain_ms']:.1f} ms" for s in sets) + " |")
    for name in decoders:
        cells = [speedup_cell(sets[s][name]) if name in sets[s] else "-" for s in sets]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    out = {"sets": {}, "baseline": baseline}
    ratio_cells, lossless_cells = [], []
    for s, reports in sets.items():
        best = max(reports, key=lambda n: reports[n]["speedup"])
        ratio = reports[best]["speedup"] / reports[baseline]["speedup"] if baseline in reports else float("nan")
        ratio_cells.append(f"{ratio:.2f} ({best})")
        prompts = {n: r["prompts"] for n, r in reports.items()}
        exact = {n: r["prompts"] - r["lossless_mismatches"] for n, r in reports.items()}
        lossless_cells.append(f"{sum(exact.values())}/{sum(prompts.values())}")
        out["sets"][s] = {
            "tpot_plain_ms": first[s]["tpot_plain_ms"],
            "best": best,
            "best_over_baseline": ratio,
            "decoders": {
                n: {
                    k: r.get(k)
                    for k in ("speedup", "speedup_per_repeat", "tau", "mean_verify_width", "loop_overhead", "prompts")
                }
                | {"lossless_prompts": exact[n]}
                for n, r in reports.items()
            },
        }
    lines.append(f"| best / {baseline} | " + " | ".join(ratio_cells) + " |")
    lines.append("| lossless (prompts x decoders) | " + " | ".join(lossless_cells) + " |")
    return "\n".join(lines) + "\n", out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="+", type=Path, help="infer.eval --out directories")
    ap.add_argument("--baseline", default="ngram", help="the decoder the best one is compared with")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.out:
        check_out_dir(args.out, "--out")
    table, data = summarize(args.dirs, args.baseline)
    print(table, end="")
    if args.out:
        cmd = "python " + " ".join(shlex.quote(a) for a in sys.argv)
        args.out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.out / "summary.md", f"Made by `{cmd}`.\n\n{table}")
        atomic_write_text(args.out / "summary.json", json.dumps({"command": cmd} | data, indent=1) + "\n")
        print(f"wrote {args.out}/summary.md and summary.json")


if __name__ == "__main__":
    from dflash_model.cli import run_main

    run_main(main)
