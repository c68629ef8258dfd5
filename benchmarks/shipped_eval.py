"""The shipped drafter against n-gram prompt lookup on HumanEval, GSM8K and MT-Bench (turn 1), SmolLM2-135M target.

  .venv/bin/python benchmarks/shipped_eval.py [--drafter drafters/smollm2-135m-dflash] [--limit 10]
      [--max-new-tokens 256] [--out docs/results/shipped]

One `infer.eval` run per prompt set (chat template, thinking off, greedy, batch 1): plain decoding, the drafter at its
trained K and n-gram at K=8 on the same prompts back to back, each checked token for token against plain greedy.
Writes <out>/<set>/{eval.json, table.md, acceptance.png} and <out>/summary.{json,md}: one row per set.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dflash_model.files import atomic_write_text
from infer import eval as infer_eval

SETS = ("humaneval", "gsm8k", "mtbench")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", default="drafters/smollm2-135m-dflash")
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--sets", nargs="+", default=list(SETS), choices=SETS)
    ap.add_argument("--out", default="docs/results/shipped")
    args = ap.parse_args(argv)
    out = Path(args.out)
    rows = {}
    for name in args.sets:
        rep = infer_eval.main(
            [
                "--target",
                "smollm2",
                "--draft",
                args.drafter,
                "--draft",
                "ngram@8",
                "--dataset",
                name,
                "--limit",
                str(args.limit),
                "--max-new-tokens",
                str(args.max_new_tokens),
                "--out",
                str(out / name),
                "--no-progress",
            ]
        )
        rows[name] = {
            d: {
                k: r[k]
                for k in (
                    "block_size",
                    "tau",
                    "acceptance_unconditional",
                    "speedup",
                    "tpot_spec_ms",
                    "tpot_plain_ms",
                    "prompts",
                    "lossless_mismatches",
                )
            }
            for d, r in rep["reports"].items()
        }
    lines = [
        f"{args.limit} prompts per set, up to {args.max_new_tokens} new tokens, greedy, batch 1, fp32, 2-core CPU",
        "",
        "| set | DFlash K | DFlash tau | acc. pos 1 / 2 / 3 | n-gram tau (K=8) | DFlash speedup | n-gram speedup "
        "| lossless (DFlash, n-gram) |",
        "|---|---:|---:|---|---:|---:|---:|---|",
    ]
    for name, r in rows.items():
        d, n = r["dflash"], r["ngram"]
        acc = " / ".join(f"{a:.3f}" for a in d["acceptance_unconditional"][:3])
        lines.append(
            f"| {name} | {d['block_size']} | {d['tau']:.3f} | {acc} | {n['tau']:.3f} | {d['speedup']:.2f}x | "
            f"{n['speedup']:.2f}x | {d['prompts'] - d['lossless_mismatches']}/{d['prompts']}, "
            f"{n['prompts'] - n['lossless_mismatches']}/{n['prompts']} |"
        )
    table = "\n".join(lines)
    print(table)
    summary = {
        "command": " ".join(["benchmarks/shipped_eval.py", *(sys.argv[1:] if argv is None else argv)]),
        "drafter": args.drafter,
        "rows": rows,
        "table": table,
    }
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=1))
    atomic_write_text(out / "summary.md", table + "\n")
    return summary


if __name__ == "__main__":
    main()
