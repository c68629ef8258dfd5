"""A K_train x K_infer matrix of teacher-forced acceptance: several drafters, each measured at one or more K on the
same prompts and replies, set side by side per set with intervals, survival curves and projected speedups.

  .venv/bin/python benchmarks/teacher_forced_matrix.py [LABEL=]DIR [[LABEL=]DIR ...] [--against [LABEL=]DIR]
      [--profiles tpu-v5p,h200] [--shapes qwen3-8b,smollm2-135m] [--out DIR]

Each DIR is an `infer.teacher_forced --out` directory (one drafter at one K, its teacher_forced.json); every one
must hold the same prompts with the same replies (run them with `--replies` of one reference run). A cell's row is
its LABEL (default: the directory name's ARM in `tf-ARM-atK`, else the drafter's name) and its column the K it was
measured at. Per set and cell: tau (1 + the sum of the censored survival; a slot with no estimate counted 0, as in
teacher_forced_compare.py) with a 95% bootstrap interval over prompts; the projected speedup tau / round cost(K) on
each profile for each target shape (infer/projection.py; roofline profiles price that target at batch 1 with a
DFlash drafter beside it - a projection, not a timing), with its interval; and, paired over the same resampled
prompts, the cell minus the `--against` cell (default: the first DIR), on tau and on each projection. One set of
resampled prompts serves every cell, so every difference is paired.

Writes OUT/matrix.md, OUT/matrix.json and OUT/survival.png (each set's S_j curves).
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from teacher_forced_compare import load, resampled_tau, round_cost, tau  # noqa: E402

from dflash_model.files import atomic_write_text, check_out_dir  # noqa: E402
from infer.intervals import LEVEL, MIN_PROMPTS, percentile_interval, resamples  # noqa: E402
from infer.metrics import strict_dumps  # noqa: E402
from infer.projection import load_profiles  # noqa: E402
from infer.report import plot_survival_grid  # noqa: E402

RUN_NAME = re.compile(r"tf-(?P<arm>.+)-at(?P<k>[0-9]+)")
DRAFTER_LAYERS = {"smollm2-135m": 4}  # the shipped SmolLM2 drafter's depth; other shapes: z-lab's 5-layer drafters


def parse_entry(text: str) -> tuple[str | None, Path]:
    """`LABEL=DIR` or `DIR`."""
    label, eq, path = text.partition("=")
    return (label, Path(path)) if eq and label else (None, Path(text))


def label_of(label: str | None, directory: Path, run: dict) -> str:
    if label:
        return label
    m = RUN_NAME.fullmatch(directory.name)
    return m["arm"] if m else str(run["draft"])


def _interval(values: np.ndarray) -> list[float]:
    return list(percentile_interval(values, LEVEL))


def set_matrix(cells: list[dict], name: str, against: int, projections: dict) -> dict:
    """One set's cells: tau and each projection with intervals, each minus cell `against` paired over one set of
    resampled prompts, and the cell's survival curve."""
    runs = [c["run"]["sets"][name] for c in cells]
    keys = [(p["id"], p["reply"]) for p in runs[0]["per_prompt"]]
    for c, r in zip(cells, runs):
        if [(p["id"], p["reply"]) for p in r["per_prompt"]] != keys:
            raise SystemExit(f"error: set {name}: {c['dir']} holds other prompts or replies than {cells[0]['dir']}")
    draws = resamples(len(keys))
    reps, points = [], []
    for c, r in zip(cells, runs):
        rep, point = {"tau": resampled_tau(r, c["k"], draws)[1]}, {"tau": tau(r)}
        for key, profile in projections.items():
            cost = round_cost(profile, c["k"])
            rep[key], point[key] = rep["tau"] / cost, point["tau"] / cost
        reps.append(rep)
        points.append(point)
    out = {"prompts": len(keys), "against": cells[against]["label"], "cells": []}
    for i, (c, r, rep, point) in enumerate(zip(cells, runs, reps, points)):
        cell = {"label": c["label"], "k": c["k"], "dir": c["dir"], "blocks": r["blocks"]}
        for key in rep:
            lo, hi = _interval(rep[key] - reps[against][key])
            cell[key] = {
                "value": float(point[key]),
                "interval": _interval(rep[key]),
                "minus_against": float(point[key] - points[against][key]),
                "minus_against_interval": [lo, hi],
                "resolved": bool(i != against and len(keys) >= MIN_PROMPTS and (lo > 0 or hi < 0)),
            }
        cell["survival"] = r["survival"]
        out["cells"].append(cell)
    return out


def _grid(result: dict, fmt) -> list[str]:
    """A markdown matrix: a row per label, a column per K, `fmt(cell)` in each measured cell, '-' elsewhere."""
    labels = list(dict.fromkeys(c["label"] for c in result["cells"]))
    ks = sorted({c["k"] for c in result["cells"]})
    at = {(c["label"], c["k"]): c for c in result["cells"]}
    lines = ["| drafter | " + " | ".join(f"K={k}" for k in ks) + " |", "|---|" + "---:|" * len(ks)]
    for label in labels:
        lines.append(f"| {label} | " + " | ".join(fmt(at[label, k]) if (label, k) in at else "-" for k in ks) + " |")
    return lines


def tables(matrix: dict, projection_notes: dict) -> str:
    out = []
    for name, result in matrix["sets"].items():
        against = result["against"]
        ref = next(c for c in result["cells"] if c["label"] == against and c["k"] == matrix["against_k"])
        out += [f"## {name} ({result['prompts']} prompts)", "", "tau, teacher-forced [95% interval over prompts]", ""]
        out += _grid(result, lambda c: f"{c['tau']['value']:.3f} [{c['tau']['interval'][0]:.3f}, "
                                       f"{c['tau']['interval'][1]:.3f}]")  # fmt: skip
        out += ["", f"tau minus {against} at K={ref['k']} [95% paired interval; '*' resolved]", ""]
        out += _grid(result, lambda c, ref=ref: "(reference)" if c is ref else _diff(c["tau"], "+.3f"))
        for key, note in projection_notes.items():
            out += ["", f"projected speedup, {note}: value [interval]; minus {against} at K={ref['k']}", ""]
            out += _grid(
                result,
                lambda c, key=key, ref=ref: _value(c[key]) + ("" if c is ref else f"; {_diff(c[key], '+.3f')}"),
            )
        out.append("")
    return "\n".join(out)


def _value(d: dict) -> str:
    return f"{d['value']:.2f}x [{d['interval'][0]:.2f}, {d['interval'][1]:.2f}]"


def _diff(d: dict, spec: str) -> str:
    lo, hi = d["minus_against_interval"]
    return f"{d['minus_against']:{spec}} [{lo:{spec}}, {hi:{spec}}]{'*' if d['resolved'] else ''}"


def plot(matrix: dict, path: Path) -> None:
    """One panel per set: every cell's survival curve."""
    row = [(name, [(f"{c['label']} at K={c['k']}", c["survival"]) for c in result["cells"]])
           for name, result in matrix["sets"].items()]  # fmt: skip
    plot_survival_grid([row], path)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="[LABEL=]DIR: infer.teacher_forced --out directories")
    ap.add_argument("--against", default=None, help="[LABEL=]DIR the differences are taken from (default: the first)")
    ap.add_argument("--profiles", default="tpu-v5p,h200", help="comma-separated profiles to project on ('' for none)")
    ap.add_argument("--shapes", default="qwen3-8b", help="comma-separated target presets the rooflines price")
    ap.add_argument("--out", type=Path, default=None, help="write matrix.md, matrix.json and survival.png here")
    args = ap.parse_args(argv)
    if args.out:
        check_out_dir(args.out, "--out")
    entries = [parse_entry(t) for t in args.runs]
    dirs = [d for _, d in entries]
    if len(set(dirs)) < len(dirs):
        raise SystemExit("error: a directory is named twice")
    against = parse_entry(args.against) if args.against else entries[0]
    if against[1] not in dirs:  # matched by directory: `--against DIR` names a run listed as LABEL=DIR too
        entries.insert(0, against)
        dirs.insert(0, against[1])
    cells = []
    for label, d in entries:
        run = load(d)
        cells.append({"label": label_of(label, d, run), "dir": str(d), "k": int(run["block_size"]), "run": run})
    if len({(c["label"], c["k"]) for c in cells}) < len(cells):
        raise SystemExit("error: two directories give the same drafter at the same K; label them LABEL=DIR")
    profiles, notes = {}, {}
    names = [p for p in args.profiles.split(",") if p]
    for shape in [s for s in args.shapes.split(",") if s] if names else []:
        for pname, profile in load_profiles(names, shape=shape, drafter_layers=DRAFTER_LAYERS.get(shape, 5)).items():
            key = f"projected@{pname}@{shape}"
            profiles[key] = profile
            ridge = getattr(profile, "ridge_k", None)
            free = f" (verify free up to K={ridge})" if ridge else ""
            notes[key] = f"{pname}, {shape}-sized target, batch 1{free}"
    sets = [s for s in cells[0]["run"]["sets"] if all(s in c["run"]["sets"] for c in cells)]
    if not sets:
        raise SystemExit("error: the runs share no set")
    i = dirs.index(against[1])
    matrix = {
        "against": cells[i]["label"],
        "against_k": cells[i]["k"],
        "sets": {s: set_matrix(cells, s, i, profiles) for s in sets},
    }
    differences = (len(cells) - 1) * len(sets)
    matrix["comparisons"] = differences
    text = tables(matrix, notes) + (
        f"\n{differences} tau differences from the reference; at 95% each, about {differences * 0.05:.1f} would read"
        " as resolved by chance where nothing differs.\n"
    )
    print(text)
    if args.out:
        cmd = "python benchmarks/teacher_forced_matrix.py " + " ".join(shlex.quote(x) for x in (argv or sys.argv[1:]))
        atomic_write_text(args.out / "matrix.md", f"Made by `{cmd}`.\n\n{text}")
        atomic_write_text(args.out / "matrix.json", strict_dumps({"command": cmd, "projections": notes, **matrix}))
        plot(matrix, args.out / "survival.png")
    return matrix


if __name__ == "__main__":
    from dflash_model.cli import run_main

    run_main(main)
