"""Can a drafter learn what only its context tells it, and how many blocks does that take? Synthetic token tasks
on the tiny random target of configs/tiny.yml, trained with the real Trainer, with and without target features.

  .venv/bin/python benchmarks/synthetic_tasks.py TASK [--steps 200] [--seed 0] [--no-features] [key=value ...]
  .venv/bin/python benchmarks/synthetic_tasks.py --table

Tasks (64-token sequences, K=8 blocks, 8 sequences x 16 anchors per step, lr 3e-3 constant, 2048 sequences):
  period2  each sequence alternates two random tokens, ABAB... Slot 1 of a block holds the token before the
           block's first one: only the context features can tell it. Slot 2 repeats slot 0: the block alone can.
  copy16   16 random distinct tokens, repeated to 64; the loss covers positions 16 on, where every token is
           the one 16 back. Every label is in the context at a fixed offset: the simplest form of the
           repetition that n-gram drafting feeds on in SmolLM2's looping replies.

Reports top-1 accuracy of slots 1-3 and the loss over 20-step windows (learning_probe.py's windows) and
writes docs/results/probes/synthetic-<TASK>[-nofeat]-<STEPS>[-<override>...].json. `--no-features` trains with
features.zero=true: the ablation that removes the context. tests/test_learns_context.py runs period2 for 200 steps.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import shlex
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
for p in (REPO, REPO / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import numpy as np  # noqa: E402

OUT = REPO / "docs" / "results" / "probes"
TASKS = ("period2", "copy16")
LENGTH = 64
PERIOD = 16


def task_records(task: str, n: int, vocab_size: int, mask_token_id: int, seed: int):
    """n TokenizedRecords of `task`, never containing the mask token; the loss mask starts where the context can
    already tell the next token (position 2 for period2, 16 for copy16)."""
    from data.pipeline import TokenizedRecords

    rng = np.random.default_rng(seed)
    allowed = np.asarray([t for t in range(vocab_size) if t != mask_token_id])
    examples = []
    for _ in range(n):
        if task == "period2":
            ids, start = np.resize(rng.choice(allowed, 2, replace=False), LENGTH), 2
        elif task == "copy16":
            ids, start = np.resize(rng.choice(allowed, PERIOD, replace=False), LENGTH), PERIOD
        else:
            raise ValueError(f"task {task!r}: expected one of {', '.join(TASKS)}")
        examples.append({"input_ids": ids.tolist(), "loss_mask": [False] * start + [True] * (LENGTH - start)})
    return TokenizedRecords.from_examples(examples, ids=[str(i) for i in range(n)])


def run(
    task: str,
    steps: int,
    *,
    seed: int = 0,
    features: bool = True,
    overrides: tuple[str, ...] = (),
    run_dir: Path | None = None,
) -> dict:
    """Train the tiny drafter on `task` for `steps` steps; returns the report (windows of 20 steps)."""
    import tiny_tau
    from learning_probe import accuracy_windows

    from train.trainer import Trainer

    name = f"synthetic-{task}{'' if features else '-nofeat'}-{steps}" + "".join(
        "-" + re.sub(r"[^A-Za-z0-9.=]+", "_", o) for o in overrides
    )
    run_dir = Path(run_dir or REPO / "runs" / "probes" / name)
    over = (*overrides, *(() if features else ("features.zero=true",)))
    # tiny_tau sizes train.max_len as its longest prompt plus new_tokens: make that LENGTH.
    s = tiny_tau.Settings(
        steps=steps,
        block_size=8,
        new_tokens=LENGTH - tiny_tau.Settings.prompt_len[1],
        lr=3e-3,
        schedule="constant",
        seed=seed,
        overrides=over,
    )
    cfg = tiny_tau.trainer_config(s, run_dir)
    assert int(cfg.train.max_len) == LENGTH, cfg.train.max_len
    target = tiny_tau.build_target(cfg, s.target_std)
    records = task_records(task, 2048, int(cfg.target.arch["vocab_size"]), int(cfg.drafter.mask_token_id), seed)
    t0 = time.time()
    trainer = Trainer(cfg, target=target, restore=False)
    tiny_tau.attach_records(trainer, records)
    trainer.train()
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return {
        "name": name,
        "task": task,
        "features": features,
        "overrides": list(overrides),
        "steps": steps,
        "seed": seed,
        "blocks_per_step": int(cfg.train.batch_size) * int(cfg.num_anchors),
        "wall_s": time.time() - t0,
        "windows": accuracy_windows(recs),
        "machine": platform.processor() or platform.machine(),
        "command": shlex.join(
            [
                "benchmarks/synthetic_tasks.py",
                task,
                "--steps",
                str(steps),
                "--seed",
                str(seed),
                *(() if features else ("--no-features",)),
                *overrides,
            ]
        ),
    }


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
    r = run(args.task, args.steps, seed=args.seed, features=not args.no_features, overrides=tuple(args.overrides))
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
