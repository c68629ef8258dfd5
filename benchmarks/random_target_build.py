"""How long a random target takes to build, and the host memory it takes: this tree against an earlier commit.

  .venv/bin/python benchmarks/random_target_build.py [--config qwen3-4b] [--before REV] [--repeats 2]
      [--out docs/results/random-target/build.json]

Each measurement is a fresh process (so peak memory is the build's own) that imports the project, then times
`train.assembly.load_target_model(cfg)` for the config's random target (`target.path=null`, the config's dtype),
up to every parameter being ready, on one device. It reports the seconds and the process's peak resident memory
(`ru_maxrss`) before and after the build. With --before REV the same is done for a git worktree of REV made in a
scratch directory (removed afterwards), the two alternating, in one run on one machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from dflash_model.files import atomic_write_text, check_out_file

REPO = Path(__file__).resolve().parent.parent

# Run in the child: only names that exist at every commit worth comparing (load_config, load_target_model).
CHILD = """
import json, resource, sys, time
import jax
from flax import nnx
from train.assembly import load_target_model
from train.config import load_config
cfg = load_config(sys.argv[1], ["target.path=null"])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
model, _ = load_target_model(cfg)
jax.block_until_ready(jax.tree.leaves(nnx.state(model, nnx.Param)))
seconds = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
nbytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
print(json.dumps({"build_s": seconds, "rss_before_gib": before / 2**20, "rss_peak_gib": peak / 2**20,
                  "params": int(params), "param_gib": nbytes / 2**30, "dtype": cfg.target.dtype}))
"""


def measure(tree: Path, config: str) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(tree)}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, config], cwd=tree, env=env, capture_output=True, text=True, check=False
    )
    if proc.returncode:
        raise SystemExit(f"error: the build in {tree} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True).stdout.strip()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="qwen3-4b", help="a config whose target is a preset (default qwen3-4b)")
    ap.add_argument("--before", help="an earlier commit to measure in the same run")
    ap.add_argument("--repeats", type=int, default=2, help="builds per tree, alternating (default 2)")
    ap.add_argument("--out", help="write the results here as JSON")
    args = ap.parse_args(argv)
    if args.out:
        check_out_file(args.out, "--out")
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    dirty = "+changes" if git("status", "--porcelain", "--untracked-files=no") else ""
    trees = {"now": (REPO, git("rev-parse", "--short", "HEAD") + dirty)}
    with tempfile.TemporaryDirectory(prefix="random-build-") as scratch:
        if args.before:
            try:
                rev = git("rev-parse", "--short", args.before)
            except subprocess.CalledProcessError:
                ap.error(f"--before {args.before}: not a commit of this repository")
            path = Path(scratch) / "before"
            git("worktree", "add", "--detach", str(path), rev)
            trees = {"before": (path, rev), **trees}
        try:
            runs = {name: [] for name in trees}
            for i in range(args.repeats):
                for name, (tree, rev) in trees.items():
                    runs[name].append(measure(tree, args.config))
                    r = runs[name][-1]
                    print(f"{name} ({rev}) build {i + 1}: {r['build_s']:.1f} s, peak RSS {r['rss_peak_gib']:.2f} GiB")
        finally:
            if args.before:
                git("worktree", "remove", "--force", str(Path(scratch) / "before"))
    rows = {name: {"commit": trees[name][1], "builds": runs[name]} for name in trees}
    first = runs["now"][0]
    print(
        f"\nrandom {args.config} target ({first['params'] / 1e9:.2f} B parameters, {first['dtype']}, "
        f"{first['param_gib']:.2f} GiB) on {_cpus()} CPUs ({platform.machine()})"
    )
    print("| tree | commit | build s (each) | peak RSS GiB (max) |")
    print("|---|---|---|---:|")
    for name, row in rows.items():
        secs = ", ".join(f"{b['build_s']:.1f}" for b in row["builds"])
        print(f"| {name} | {row['commit']} | {secs} | {max(b['rss_peak_gib'] for b in row['builds']):.2f} |")
    if args.before:
        best = {name: min(b["build_s"] for b in runs[name]) for name in runs}
        print(f"speed-up (best of each): {best['before'] / best['now']:.1f}x")
    result = {"config": args.config, "machine": platform.platform(), "cpus": _cpus(), "trees": rows}
    if args.out:
        atomic_write_text(args.out, json.dumps(result, indent=1) + "\n")
    return result


def _cpus() -> int:
    return len(os.sched_getaffinity(0))


if __name__ == "__main__":
    from dflash_model.cli import run_main

    run_main(main)
