"""Two drafters' teacher-forced acceptance on the same prompts and replies, compared pairwise with intervals.

  .venv/bin/python benchmarks/teacher_forced_compare.py A_DIR B_DIR [--out DIR]

Each argument is an `infer.teacher_forced --out` directory (its teacher_forced.json); both must hold the same
prompts with the same replies (run the second with `--replies A_DIR`). Per set: each drafter's tau (1 + sum of its
censored survival: the tokens a round starting at a uniformly chosen reply position commits) and S_1..S_3, and
A - B with a 95% paired bootstrap over prompts: one set of resampled prompts serves both drafters, so what the
prompts share cancels. A slot past which every block ran off its reply has no survival estimate; tau counts it as
0 (a lower bound, reached only by wide blocks near a reply's end). Drafters of different K are compared on tau,
the committed tokens a round of each buys, and with --profiles on what a round of each costs too: the projected
speedup tau / (verify(K) + the drafter's forward(K)) in plain decode steps on each named profile
(infer/projection.py; the roofline profiles price a Qwen3-8B-sized target, batch 1), paired the same way. A
projection, not a timing.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dflash_model.files import atomic_write_text, check_out_dir  # noqa: E402
from infer.agreement import resampled_survival  # noqa: E402
from infer.intervals import LEVEL, MIN_PROMPTS, percentile_interval, resamples  # noqa: E402
from infer.metrics import round_costs, strict_dumps  # noqa: E402
from infer.projection import load_profiles  # noqa: E402

SLOTS = 3


# What a run must hold to be compared: its drafter, K and each set's per-prompt records and survival.
RUN_KEYS = ("draft", "block_size", "sets")
SET_KEYS = ("per_prompt", "survival", "blocks")


def load(directory: Path) -> dict:
    path = directory / "teacher_forced.json"
    if not path.is_file():
        raise SystemExit(f"error: {path}: no teacher_forced.json (python -m infer.teacher_forced --out {directory})")
    try:
        run = json.loads(path.read_text())
    except ValueError as e:
        raise SystemExit(f"error: {path}: not JSON ({e})") from None
    missing = [key for key in RUN_KEYS if not isinstance(run, dict) or key not in run]
    if not missing:
        missing = [f"sets.{name}.{key}" for name, s in run["sets"].items() for key in SET_KEYS if key not in s]
    if missing:
        raise SystemExit(f"error: {path}: not a teacher_forced.json of infer.teacher_forced (no {', '.join(missing)})")
    return run


def tau(result: dict) -> float:
    """1 + the sum of a set's survival, a slot with no estimate (None in the JSON) counted as 0."""
    return 1.0 + sum(x for x in result["survival"] if x is not None)


def resampled_tau(result: dict, k: int, draws: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A set's survival [R, K-1] and tau [R] over each row of prompt draws, counted as `tau` counts them."""
    per_prompt = result["per_prompt"]
    s = resampled_survival([p["accept_lengths"] for p in per_prompt], [p["final"] for p in per_prompt], k, draws)
    return s, 1 + np.nansum(s, axis=1)


def round_cost(profile, k: int) -> float:
    """Plain decode steps a round of width K with a drafter forward costs on `profile`."""
    return round_costs([k], [True], verify_cost=profile.verify_cost, draft_cost=profile.draft_cost,
                       name=profile.name)[0]  # fmt: skip


def compare_set(a: dict, b: dict, ka: int, kb: int, name: str, profiles: dict | None = None) -> dict:
    """A - B on tau and S_1..S_3 for one set, paired over its prompts; with profiles, on each one's projected
    speedup (tau over the round cost at each drafter's K) too."""
    pa, pb = a["per_prompt"], b["per_prompt"]
    if [(p["id"], p["reply"]) for p in pa] != [(p["id"], p["reply"]) for p in pb]:
        raise SystemExit(f"error: set {name}: the two runs hold different prompts or replies (use --replies)")
    draws = resamples(len(pa))
    sa, ta = resampled_tau(a, ka, draws)
    sb, tb = resampled_tau(b, kb, draws)
    out = {"prompts": len(pa), "blocks": [a["blocks"], b["blocks"]]}
    # A deep slot where every block that got there ran past the reply (censored) has no survival estimate; tau
    # counts it as 0 there, a lower bound (the slots it drops are the rarest: K=64 blocks near a reply's end).
    measures = {"tau": (ta, tb, tau(a), tau(b))}
    for j in range(SLOTS):
        measures[f"S_{j + 1}"] = (sa[:, j], sb[:, j], a["survival"][j], b["survival"][j])
    for pname, profile in (profiles or {}).items():
        ca, cb = round_cost(profile, ka), round_cost(profile, kb)
        ta, tb, point_a, point_b = measures["tau"]
        measures[f"projected@{pname}"] = (ta / ca, tb / cb, point_a / ca, point_b / cb)
    for key, (ra, rb, point_a, point_b) in measures.items():
        lo, hi = percentile_interval(ra - rb, LEVEL)
        resolved = len(pa) >= MIN_PROMPTS and (lo > 0 or hi < 0)
        out[key] = {"a": point_a, "b": point_b, "difference": point_a - point_b, "low": lo, "high": hi,
                    "resolved": bool(resolved)}  # fmt: skip
    return out


def table(result: dict, name_a: str, name_b: str) -> str:
    projected = [k for k in next(iter(result.values())) if k.startswith("projected@")]
    lines = [
        f"A = {name_a}, B = {name_b}; teacher-forced, blocks at every reply position; A - B with its 95% paired "
        "bootstrap interval over prompts ('*': resolved, the interval excludes 0)",
        "",
        "| set | prompts | blocks A / B | tau A | tau B | tau A - B | S_1 A - B | S_2 A - B | S_3 A - B |"
        + "".join(f" {k.split('@')[1]}: projected A / B, A - B |" for k in projected),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(projected),
    ]
    for name, r in result.items():

        def cell(key, r=r):
            d = r[key]
            return f"{d['difference']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]{'*' if d['resolved'] else ''}"

        lines.append(
            f"| {name} | {r['prompts']} | {r['blocks'][0]} / {r['blocks'][1]} | {r['tau']['a']:.3f} | "
            f"{r['tau']['b']:.3f} | {cell('tau')} | {cell('S_1')} | {cell('S_2')} | {cell('S_3')} |"
            + "".join(f" {r[k]['a']:.2f}x / {r[k]['b']:.2f}x, {cell(k)} |" for k in projected)
        )
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--out", type=Path, default=None, help="write comparison.md and comparison.json here")
    ap.add_argument(
        "--profiles",
        default="",
        help="comma-separated profiles to compare projected speedup on too (e.g. tpu-v5p,h200; default none)",
    )
    args = ap.parse_args(argv)
    profiles = load_profiles([p for p in args.profiles.split(",") if p]) if args.profiles else {}
    if args.out:
        check_out_dir(args.out, "--out")
    a, b = load(args.a), load(args.b)
    sets = [s for s in a["sets"] if s in b["sets"]]
    if not sets:
        raise SystemExit("error: the two runs share no set")
    result = {s: compare_set(a["sets"][s], b["sets"][s], a["block_size"], b["block_size"], s, profiles) for s in sets}
    name_a, name_b = (f"{d['draft']} at K={d['block_size']}" for d in (a, b))
    text = table(result, name_a, name_b)
    print(text)
    if args.out:
        cmd = "python benchmarks/teacher_forced_compare.py " + " ".join(shlex.quote(x) for x in (argv or sys.argv[1:]))
        atomic_write_text(args.out / "comparison.md", f"Made by `{cmd}`.\n\n{text}\n")
        atomic_write_text(
            args.out / "comparison.json", strict_dumps({"command": cmd, "a": name_a, "b": name_b, "sets": result})
        )
    return result


if __name__ == "__main__":
    from dflash_model.cli import run_main

    run_main(main)
