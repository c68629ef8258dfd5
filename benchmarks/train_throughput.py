"""Training throughput of a config: tokens/s, anchors/s, seconds per step, and the share of a step spent in the
target forward (the part the offline feature path removes).

  .venv/bin/python benchmarks/train_throughput.py [--config tiny] [--steps 20] [--out runs/train_throughput.json]
      [key=value overrides ...]

Trains `--steps` steps in a scratch run directory (no resume, no export, no eval) and reports medians over the
steps after the first (which compiles). The target forward is timed alone on one batch of the same shape,
jitted the same way (features of the drafter's layers, no logits).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default="runs/train_throughput.json")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)

    import jax

    from train.config import load_config
    from train.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        over = [*args.overrides, f"run_dir={tmp}", f"train.steps={args.steps}", "export.enabled=false",
                "eval.enabled=false", "log.tensorboard=false", f"checkpoint.every_steps={args.steps + 1}"]
        cfg = load_config(args.config, over)
        if cfg.data.source == "regenerate":
            raise SystemExit("give a regenerated JSONL as data.source=PATH (the cache of a default run works)")
        trainer = Trainer(cfg, restore=False)
        trainer.train()
        recs = [json.loads(ln) for ln in Path(tmp, "metrics.jsonl").read_text().splitlines()][1:]
        batch = next(iter(trainer.dataset))
        target_s = trainer.time_target_forward(batch) if cfg.features.mode == "online" else 0.0
    step_s = statistics.median(r["step_s"] for r in recs)
    rep = {
        "config": args.config, "overrides": args.overrides, "steps_timed": len(recs), "device": str(jax.devices()[0]),
        "machine": platform.processor() or platform.machine(), "block_size": int(cfg.block_size),
        "batch_size": int(cfg.train.batch_size), "max_len": int(cfg.train.max_len), "num_anchors": int(cfg.num_anchors),
        "step_s_median": step_s,
        "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in recs),
        "anchors_per_s_median": statistics.median(r["anchors_per_s"] for r in recs),
        "block_positions_per_s": statistics.median(r["anchors_per_s"] for r in recs) * int(cfg.block_size),
        "target_forward_s": target_s, "target_forward_share": target_s / step_s if step_s else None,
    }
    print("| config | K | batch x len | anchors/seq | s/step | tokens/s | anchors/s | target fwd share |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    name = f"{args.config} {' '.join(args.overrides)}"
    print(f"| {name} | {rep['block_size']} | {rep['batch_size']} x {rep['max_len']} | "
          f"{rep['num_anchors']} | {step_s:.3f} | {rep['tokens_per_s_median']:.0f} | "
          f"{rep['anchors_per_s_median']:.1f} | {100 * rep['target_forward_share']:.0f}% |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rep, indent=1))
    return rep


if __name__ == "__main__":
    main()
