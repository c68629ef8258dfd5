"""The training step of this tree against an earlier commit, over the shapes users run, in one run on one machine.

  .venv/bin/python benchmarks/step_grid.py --before REV [--after HEAD] [--steps 9] [--repeats 2]
      [--cells 16x64 16x256 64x64 64x256 16x64:bf16] [--out docs/results/throughput/grid.json]

Both trees are git worktrees made in a scratch directory (removed afterwards), so edits to the checkout while the
grid runs change nothing. Each cell (K x anchors per row, fp32 unless `:bf16`) trains `--steps` steps of
`train/run.py --config smollm2-135m` in a fresh process per tree, with every key that sets the step's shape
pinned by override (below), so the two commits run the same objective on the same model whatever their config
files say: a random drafter of 4 layers (the main job's), all K-1 slots trained, the 8,192-token draft vocabulary,
every anchor column run (`anchor_buckets=1` where the tree has it), batch 1, rows of at most 384 tokens. The rows
are the main job's 160 mixed replies (written once by this tree's `data.mix`), read in the same order by both.

A cell's time is the sum of the step times both trees logged for the steps after the first (which compiles), step
for step over the same rows. The trees alternate, the order swapped on every repeat; a cell's spread is the largest
relative difference between two repeats of one tree, and a cell counts as slower only when the ratio falls below
1 by more than that spread.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dflash_model.files import atomic_write_text, check_out_file

REPO = Path(__file__).resolve().parent.parent
MIX = [  # the main job's mix (configs/smollm2-135m.yml data.mix)
    "docs/results/gpu-burst/regen_gpu.jsonl.gz:seed=0:take=96",
    "docs/results/gpu-burst-4/regen_gpu.jsonl.gz:seed=0:take=32",
    "docs/results/gpu-burst-3/regen_gpu.jsonl.gz:seed=0:take=32",
]
# Every key that sets the step's shape or work, pinned: the default config's drafter and objective changed between
# commits worth comparing (a copy-circuit start, loss on slot 1 alone, a 2-layer drafter), and a grid must time the
# same step in both.
PINNED = [
    "target.path=asset:smollm2",
    "drafter.init=null",
    "drafter.init_vocab=false",
    "drafter.num_layers=4",
    "drafter.n_features=5",
    "drafter.mask_token_id=4",
    "drafter.layer_types=[sliding_attention,full_attention,full_attention,full_attention]",
    "drafter.sliding_window=2",
    "draft_vocab=8192",
    "gamma=7.0",
    "loss_positions=null",
    "ce_chunk=1024",
    "distill_weight=0.0",
    "train.lr=5.0e-5",
    "train.batch_size=1",
    "train.max_len=384",
    "train.epochs=1",
    "features.mode=online",
    "export.enabled=false",
    "eval.enabled=false",
    "log.tensorboard=false",
    "log.every=1",
    "mesh.data=1",
    "mesh.fsdp=-1",
    "mesh.tensor=1",
]
BF16 = ["train.compute_dtype=bfloat16", "target.dtype=bfloat16"]
CELLS = ["16x64", "16x256", "64x64", "64x256", "16x64:bf16"]


def parse_cell(spec: str) -> tuple[int, int, str]:
    """'KxA' or 'KxA:bf16' -> (K, anchors, dtype)."""
    shape, _, dtype = spec.partition(":")
    dtype = dtype or "fp32"
    try:
        k, a = (int(x) for x in shape.split("x"))
    except ValueError:
        raise ValueError(f"cell {spec!r}: write KxANCHORS, e.g. 16x64 or 64x256:bf16") from None
    if k < 2 or a < 1 or dtype not in ("fp32", "bf16"):
        raise ValueError(f"cell {spec!r}: K >= 2, anchors >= 1, dtype fp32 or bf16")
    return k, a, dtype


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True).stdout.strip()


def tree_overrides(rev: str) -> list[str]:
    """What a tree needs beyond PINNED: all anchor columns run where its config has the key that trims them."""
    return ["anchor_buckets=1"] if "\nanchor_buckets:" in git("show", f"{rev}:configs/base.yml") else []


def overrides(tree_keys: list[str], data: Path, run_dir: Path, k: int, anchors: int, dtype: str, steps: int):
    over = [*PINNED, f"data.source={data}", f"run_dir={run_dir}", f"block_size={k}", f"num_anchors={anchors}"]
    return over + [f"train.steps={steps}", f"checkpoint.every_steps={steps + 1}", *(BF16 if dtype == "bf16" else []),
                   *tree_keys]  # fmt: skip


def run_cell(tree: Path, over: list[str], run_dir: Path) -> list[dict]:
    """One training run in a fresh process of `tree`; its per-step log (step, seconds, loss)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "train/run.py", "--config", "smollm2-135m", *over]
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"error: training in {tree} failed ({shlex.join(cmd[1:])}):\n{proc.stderr[-3000:]}")
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{"step": r["step"], "step_s": r["step_s"], "loss": r["loss"]} for r in recs if "step_s" in r]


def summarize(cell: dict) -> dict:
    """Per tree: the timed seconds of each repeat (steps 2.. summed), their spread; the cell's ratio before/now."""
    out = {}
    for name, runs in cell["runs"].items():
        secs = [sum(s["step_s"] for s in run if s["step"] > 1) for run in runs]
        mid = statistics.median(secs)
        out[name] = {"timed_s": secs, "median_s": mid, "spread": (max(secs) - min(secs)) / mid}
    ratio = out["before"]["median_s"] / out["now"]["median_s"]  # > 1: this tree is faster
    spread = max(out["before"]["spread"], out["now"]["spread"])
    # the same objective in both trees: the first repeats' losses step for step
    lb, ln = ([s["loss"] for s in cell["runs"][t][0]] for t in ("before", "now"))
    loss_gap = max(abs(a - b) / max(abs(a), 1e-9) for a, b in zip(lb, ln, strict=True))
    return {**out, "speedup": ratio, "spread": spread, "slower": ratio < 1 - spread, "loss_gap": loss_gap}


def table(cells: dict, steps: int) -> str:
    lines = [
        f"| K | anchors | dtype | before s ({steps - 1} steps, each repeat) | now s | before/now | spread | verdict "
        "| losses differ by |",
        "|---:|---:|---|---|---|---:|---:|---|---:|",
    ]
    for spec, c in cells.items():
        k, a, dtype = parse_cell(spec)
        s = c["summary"]
        b, n = (", ".join(f"{x:.1f}" for x in s[t]["timed_s"]) for t in ("before", "now"))
        verdict = "slower" if s["slower"] else ("faster" if s["speedup"] > 1 + s["spread"] else "within spread")
        if len(s["now"]["timed_s"]) < 2:
            verdict = "one repeat: no spread"
        lines.append(
            f"| {k} | {a} | {dtype} | {b} | {n} | {s['speedup']:.2f}x | {100 * s['spread']:.0f}% | {verdict} "
            f"| {s['loss_gap']:.1e} |"
        )
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="the earlier commit")
    ap.add_argument("--after", default="HEAD", help="the commit to measure against it (default HEAD)")
    ap.add_argument("--cells", nargs="+", default=CELLS, help=f"KxANCHORS[:bf16] (default {' '.join(CELLS)})")
    ap.add_argument("--steps", type=int, default=9, help="steps per run; the first compiles (default 9)")
    ap.add_argument("--repeats", type=int, default=2, help="runs per tree and cell, alternating (default 2)")
    ap.add_argument("--out", help="write the grid here as JSON")
    args = ap.parse_args(argv)
    if args.out:
        check_out_file(args.out, "--out")
    if args.steps < 2:
        ap.error(f"--steps must be at least 2 (the first compiles), got {args.steps}")
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    try:
        specs = {s: parse_cell(s) for s in args.cells}
    except ValueError as e:
        ap.error(str(e))
    revs = {}
    for name, rev in (("before", args.before), ("now", args.after)):
        try:
            revs[name] = git("rev-parse", "--short", f"{rev}^{{commit}}")
        except subprocess.CalledProcessError:
            ap.error(f"--{'before' if name == 'before' else 'after'} {rev}: not a commit of this repository")

    from data.mix import mix, parse_part

    cells = {s: {"runs": {"before": [], "now": []}} for s in specs}
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="step-grid-") as scratch:
        scratch = Path(scratch)
        data = scratch / "mix.jsonl"
        data.write_text("".join(mix([parse_part(str(REPO / p)) for p in MIX], seed=0)))
        trees = {name: scratch / name for name in revs}
        tree_keys = {name: tree_overrides(rev) for name, rev in revs.items()}
        for name, path in trees.items():
            git("worktree", "add", "--detach", str(path), revs[name])
        try:
            for spec, (k, a, dtype) in specs.items():
                for i in range(args.repeats):
                    order = ("before", "now") if i % 2 == 0 else ("now", "before")
                    for name in order:
                        run_dir = scratch / f"run-{name}-{k}x{a}-{dtype}-{i}"
                        over = overrides(tree_keys[name], data, run_dir, k, a, dtype, args.steps)
                        steps = run_cell(trees[name], over, run_dir)
                        cells[spec]["runs"][name].append(steps)
                        timed = sum(s["step_s"] for s in steps if s["step"] > 1)
                        print(
                            f"[grid] {spec} {name} ({revs[name]}) repeat {i + 1}: {timed:.1f} s for "
                            f"{len(steps) - 1} steps, loss {steps[0]['loss']:.3f} -> {steps[-1]['loss']:.3f} "
                            f"({(time.perf_counter() - t_start) / 60:.0f} min)",
                            flush=True,
                        )
                cells[spec]["summary"] = summarize(cells[spec])
        finally:
            for path in trees.values():
                git("worktree", "remove", "--force", str(path))
    text = table(cells, args.steps)
    machine = f"{platform.machine()}, {len(os.sched_getaffinity(0))} CPUs"
    print(f"\nbefore {revs['before']}, now {revs['now']}, on {machine}\n{text}")
    result = {
        "command": shlex.join(["benchmarks/step_grid.py", *(sys.argv[1:] if argv is None else argv)]),
        "before": revs["before"],
        "now": revs["now"],
        "machine": machine,
        "processor": platform.processor(),
        "pinned": PINNED,
        "mix": MIX,
        "cells": cells,
        "table": text,
    }
    if args.out:
        atomic_write_text(args.out, json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    from dflash_model.cli import run_main

    run_main(main)
