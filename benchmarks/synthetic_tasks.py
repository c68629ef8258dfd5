"""Can a drafter learn what only its context tells it, and how many blocks does that take? Synthetic token tasks
on the tiny random target of configs/tiny.yml, trained with the real Trainer, with and without target features.

  .venv/bin/python benchmarks/synthetic_tasks.py TASK [--steps 200] [--seed 0] [--no-features] [key=value ...]
  .venv/bin/python benchmarks/synthetic_tasks.py --table

Tasks (period2, copy16) and the run: `train.tiny_runs.run_task`.

Reports top-1 accuracy of slots 1-3 and the loss over 20-step windows (learning_probe.py's windows) and
writes docs/results/probes/synthetic-<TASK>[-nofeat]-<STEPS>[-<override>...].json. `--no-features` trains with
features.zero=true: the ablation that removes the context. tests/test_learns_context.py runs period2 for 200 steps.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from train.tiny_runs import TASKS, run_task

OUT = Path(__file__).resolve().parent.parent / "docs" / "results" / "probes"


def table() -> str:
    lines = [
        "| task | features | overrides | steps (blocks) | acc pos 1 / 2 / 3, first 20 steps "
        "| acc pos 1 / 2 / 3, last 20 steps | loss, last 20 steps |",
        "|---|---|---|---:|---|---|---:|",
    ]
    reports = [json.loads(path.read_text()) for path in OUT.glob("synthetic-*.json")]
    for r in sorted(reports, key=lambda r: (r["task"], not r["features"], r["steps"], r.get("overrides", []))):
        first, last = r["windows"][0], r["windows"][-1]
        fmt = [" / ".join(f"{a:.3f}" for a in w["acc_1_2_3"]) for w in (first, last)]
        over = " ".join(r.get("overrides", [])) or "-"
        lines.append(
            f"| {r['task']} | {'on' if r['features'] else 'zeroed'} | {over} | {r['steps']} "
            f"({r['steps'] * r['blocks_per_step']:,}) | {fmt[0]} | {fmt[1]} | {last['loss']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("task", nargs="?", choices=TASKS)
    ap.add_argument("overrides", nargs="*", help="key=value trainer config overrides")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-features", action="store_true", help="features.zero=true: train without the context")
    ap.add_argument("--table", action="store_true")
    args = ap.parse_intermixed_args()
    if args.table:
        print(table())
        return
    if not args.task:
        ap.error("give a TASK or --table")
    r = run_task(args.task, args.steps, seed=args.seed, features=not args.no_features, overrides=tuple(args.overrides))
    for w in r["windows"]:
        print(
            f"steps {w['steps'][0]:>4}-{w['steps'][1]:<4} loss {w['loss']:.2f}  acc 1/2/3 "
            + " / ".join(f"{a:.3f}" for a in w["acc_1_2_3"])
        )
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{r['name']}.json").write_text(json.dumps(r, indent=1))
    print(f"wrote {OUT / (r['name'] + '.json')}")


if __name__ == "__main__":
    main()
