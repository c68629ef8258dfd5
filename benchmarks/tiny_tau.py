"""Does training raise tau? A tiny random target, a drafter trained on the target's own greedy text, and tau
before and after: simulated (the training metric) and real (the speculative engine, infer/eval.py's loop).

  .venv/bin/python benchmarks/tiny_tau.py [--steps 600] [--block 8] [--target-std 0.08] [--eval-prompts 16]
      [--lr 3e-3] [--schedule cosine|constant] [--no-ngram] [--data target|synthetic] [--out runs/tiny_tau.json]
      [key=value trainer overrides ...]

On the target of configs/tiny.yml (a 4-layer, 512-token random Qwen3; `--target-std` changes the init scale,
0.08 being what the Trainer builds for a random preset); `train.tiny_runs.run_tiny_tau` is the run:
  random prompts, the target's greedy continuations as training data, `Trainer.train()`, then simulated tau
  (the training metric) and real tau (the speculative engine, on held-out prompts, against n-gram lookup).

Prints a table and writes the report JSON (default runs/tiny_tau.json; the run directory, with metrics.jsonl and
the exported drafters, is the JSON's name without .json). tests/test_tau_rises.py runs a shorter version.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from train.tiny_runs import Settings, format_tiny_tau, run_tiny_tau


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = Settings()
    ap.add_argument("--steps", type=int, default=d.steps)
    ap.add_argument("--block", type=int, default=d.block_size)
    ap.add_argument("--target-std", type=float, default=d.target_std)
    ap.add_argument("--train-prompts", type=int, default=d.train_prompts)
    ap.add_argument("--eval-prompts", type=int, default=d.eval_prompts)
    ap.add_argument("--new-tokens", type=int, default=d.new_tokens)
    ap.add_argument("--batch-size", type=int, default=d.batch_size)
    ap.add_argument("--anchors", type=int, default=d.num_anchors)
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--schedule", choices=["cosine", "constant"], default=d.schedule)
    ap.add_argument("--no-ngram", action="store_true", help="skip the n-gram reference")
    ap.add_argument(
        "--data",
        choices=["target", "synthetic"],
        default=d.data,
        help="synthetic: a control run on the Trainer's synthetic data (not the target's text)",
    )
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--out", default="runs/tiny_tau.json")
    ap.add_argument("overrides", nargs="*", help="trainer config overrides, key=value")
    a = ap.parse_args(argv)
    s = Settings(
        steps=a.steps,
        block_size=a.block,
        target_std=a.target_std,
        train_prompts=a.train_prompts,
        eval_prompts=a.eval_prompts,
        new_tokens=a.new_tokens,
        batch_size=a.batch_size,
        num_anchors=a.anchors,
        lr=a.lr,
        schedule=a.schedule,
        seed=a.seed,
        ngram=not a.no_ngram,
        data=a.data,
        overrides=tuple(a.overrides),
    )
    out = Path(a.out)
    rep = run_tiny_tau(s, out.with_suffix(""), progress=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rep, indent=1))
    print(format_tiny_tau(rep))
    print(f"wrote {out}")
    return rep


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("absl").setLevel(logging.WARNING)
    main()
