"""Does training wider pay? From one start and one data set, train drafters at K_train = 16, 32, 64 and 128 for
equal wall-clock, then decode each at every K_infer <= K_train on long generations.

  .venv/bin/python benchmarks/wide_blocks.py [--out docs/results/wide-blocks] [--runs runs/wide-blocks]
      [--train-minutes 5] [--sets gsm8k,humaneval,mtbench] [--limit 10] [--max-new-tokens 512]
      [--k-infer 8,16,32,64,128] [--arms ft16,ft32,ft64,ft128,scratch16,scratch64]

Arms: `ftK` widens (or keeps) the shipped K=16 drafter (drafters/smollm2-135m-dflash) at K_train = K; `scratchK`
trains the same architecture from a random start (the pair that says whether the answer depends on the start).
Every arm reads the same rows in the same order (RUNS/train.jsonl, mixed once from committed reply files: code
completions, math word problems, ShareGPT) and drafts the same number of positions a step (num_anchors = 2048 / K,
so a step's drafter and cross-entropy work is about equal across K); each arm's step count is its wall-clock budget
over its own step time, measured in a short calibration run first. Each arm uses its K's default loss decay
(train.objective.default_gamma: the paper's 7 at K=16, grown with K). Decoding is infer.eval's engine (greedy,
lossless-checked), one call per set with every arm at every K_infer, the shipped drafter and n-gram beside them.

Resumable: the mix, each calibration, each training run (the trainer resumes from its checkpoints) and each set's
eval are skipped when their output is already on disk. Writes OUT/study.json (the tau matrices, survival, projected
speedup, training budgets), OUT/table.md and OUT/survival.png.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dflash_model.files import atomic_write_text, claim_dir  # noqa: E402
from infer.report import plot_survival_grid  # noqa: E402
from train.objective import default_gamma  # noqa: E402

SHIPPED = "drafters/smollm2-135m-dflash"
POSITIONS_PER_STEP = 2048  # drafted positions a step, whatever K: num_anchors = POSITIONS_PER_STEP / K
CALIBRATION_STEPS = 5
FT_LR = 5e-5  # every fine-tuned arm: the continued-training rate of the shipped drafter's stages
SCRATCH_LR = 6e-4  # the from-scratch arms: the paper's rate
REPLIES = {  # committed target replies (greedy, SmolLM2-135M-Instruct): file, lines taken
    "code": ("docs/results/gpu-burst-4/regen_gpu.jsonl.gz", 1200),
    "math": ("docs/results/gpu-burst-3/regen_gpu.jsonl.gz", 500),
    "chat": ("docs/results/gpu-burst/regen_gpu.jsonl.gz", 300),
}


ARM = re.compile(r"(ft|scratch)([1-9][0-9]*)(s[0-9]+)?")


def arm_k(arm: str) -> int:
    """K_train of an arm name: ftK, scratchK, or either with a seed suffix sN (ft16s1: K=16, seed 1)."""
    return int(arm.removeprefix("ft").removeprefix("scratch").partition("s")[0])


def check_arms(value: str) -> list[str]:
    """--arms as a list: every name ftK / scratchK[sN] with K >= 2, none twice."""
    arms = [a for a in value.split(",") if a]
    for arm in arms:
        if not ARM.fullmatch(arm) or arm_k(arm) < 2:
            raise ValueError(f"--arms: {arm!r} is not ftK or scratchK with K >= 2, optionally sN (e.g. ft16s1)")
    repeated = sorted({a for a in arms if arms.count(a) > 1})
    if repeated or not arms:
        raise ValueError(f"--arms {value!r}: " + (f"{', '.join(repeated)} named twice" if repeated else "no arm"))
    return arms


def read_result(path: Path) -> dict | None:
    """A result JSON written by an earlier run of the study, or None where there is none. A damaged one (a run killed
    mid-write by an older writer, a disk that filled) is named, moved aside to PATH.damaged and recomputed."""
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ValueError(f"a JSON {type(data).__name__}, not an object")
        return data
    except (ValueError, UnicodeDecodeError) as e:
        print(f"{path}: damaged ({type(e).__name__}: {e}); moved to {path.name}.damaged and recomputed", flush=True)
        path.replace(path.with_name(path.name + ".damaged"))
        return None


def arm_seed(arm: str) -> int:
    """The training seed of an arm (its sN suffix, else 0): a second seed of an arm sets its interval against
    training noise."""
    _, s, seed = arm.removeprefix("scratch").partition("s")
    return int(seed) if s else 0


def run(cmd: list[str], log: Path) -> None:
    """Run a step of the study, its output teed to a log; a failure stops the study naming the log."""
    print("+", " ".join(cmd), flush=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as f:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode:
        raise SystemExit(f"{cmd[1]} failed (exit {proc.returncode}); see {log}")


def mix(runs: Path) -> Path:
    out = runs / "train.jsonl"
    if not out.exists():
        parts = [f"{f}:seed=7:take={n}" for f, n in REPLIES.values()]
        run([sys.executable, "-m", "data.mix", str(out), *parts, "--seed", "0"], runs / "mix.log")
    return out


def train_overrides(arm: str, data: Path, lr: float = FT_LR) -> list[str]:
    k = arm_k(arm)
    start = [f"drafter.init={SHIPPED}", "drafter.init_vocab=true", f"train.lr={lr}"] if arm.startswith("ft") else [
        "drafter.init=null", "drafter.init_vocab=false", f"train.lr={SCRATCH_LR}",
    ]  # fmt: skip
    return [
        "--config", "smollm2-135m", "--block", str(k), f"data.source={data}", f"num_anchors={POSITIONS_PER_STEP // k}",
        "gamma=null", "train.max_len=512", "eval.enabled=false", "log.every=10", "checkpoint.every_steps=50",
        f"seed={arm_seed(arm)}", *start,
    ]  # fmt: skip


def _metrics(run_dir: Path) -> list[dict]:
    """A run's metrics.jsonl rows; a torn last line (a run killed mid-write) is dropped, as the trainer drops it."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines()
    rows = []
    for n, line in enumerate(lines, 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if n < len(lines):
                raise SystemExit(f"{path}: line {n} is not JSON") from None
    return [r for r in rows if "step" in r]


def step_seconds(run_dir: Path) -> float:
    """Median seconds of a step past the first (which compiles), from a run's metrics.jsonl."""
    times = [r["step_s"] for r in _metrics(run_dir) if "step_s" in r and r["step"] > 1]
    if not times:
        raise SystemExit(f"{run_dir}/metrics.jsonl: no timed step past the first")
    return statistics.median(times)


def steps_for_positions(arm: str, data: Path, runs: Path, lr: float, positions: int) -> int:
    """The steps after which the arm has trained on at least `positions` labelled positions: its batches' labelled
    positions counted from the trainer's own pipeline (train.assembly.labelled_positions; no model step), not
    extrapolated from a few calibration steps, whose rows need not be typical."""
    from train.assembly import build_run, labelled_positions
    from train.config import load_config
    from train.presets import cli_overrides

    name, overrides = cli_overrides(train_overrides(arm, data, lr))
    scratch = runs / f"count-{arm}"
    cfg = load_config(name, [*overrides, f"run_dir={scratch}"])
    run = build_run(cfg, scratch)
    most = run.batches_per_epoch * int(cfg.train.epochs)
    counts = labelled_positions(run, most, until=positions)
    if sum(counts) < positions:
        raise SystemExit(
            f"error: {arm}: its {most} batches hold {sum(counts)} labelled positions, fewer than "
            f"--positions {positions}: lower it or mix more rows"
        )
    print(f"{arm}: {len(counts)} steps hold {sum(counts)} labelled positions (>= {positions})", flush=True)
    return len(counts)


def calibrate(arm: str, data: Path, runs: Path, lr: float) -> Path:
    cal = runs / f"cal-{arm}"
    if not (cal / "metrics.jsonl").exists():
        cmd = [sys.executable, "train/run.py", *train_overrides(arm, data, lr), f"train.steps={CALIBRATION_STEPS}",
               f"run_dir={cal}", "export.enabled=false"]  # fmt: skip
        run(cmd, runs / f"cal-{arm}.log")
    return cal


def train_arm(arm: str, data: Path, runs: Path, budget: dict, out: Path, lr: float = FT_LR) -> dict:
    """Train one arm to its budget: {"steps": N}, {"seconds": S} (steps from a calibrated step time) or
    {"positions": P} (the steps whose batches hold at least P labelled positions, counted from the pipeline, so
    that every arm sees P labelled positions whatever its K); its export directory and what it saw, also written
    to out/arms/ARM.json as soon as it is trained, so a study stopped later keeps every finished arm."""
    record = out / "arms" / f"{arm}.json"
    s_step = None
    steps = budget.get("steps")
    if "positions" in budget:
        steps = steps_for_positions(arm, data, runs, lr, budget["positions"])
    elif steps is None:
        cal = calibrate(arm, data, runs, lr)
        s_step = step_seconds(cal)
        steps = max(1, int(budget["seconds"] / s_step))
    dest = runs / arm
    export = dest / "export"
    if not (export / "config.json").exists():
        cmd = [sys.executable, "train/run.py", *train_overrides(arm, data, lr), f"train.steps={steps}",
               f"run_dir={dest}"]  # fmt: skip
        run(cmd, runs / f"{arm}.log")
    rows = _metrics(dest)
    k = arm_k(arm)
    result = {
        "arm": arm,
        "k_train": k,
        "start": "shipped K=16 drafter" if arm.startswith("ft") else "random",
        "seed": arm_seed(arm),
        "lr": lr if arm.startswith("ft") else SCRATCH_LR,
        "gamma": default_gamma(k),
        "num_anchors": POSITIONS_PER_STEP // k,
        "budget": budget,
        "calibrated_step_s": s_step,
        "steps": len(rows),
        "train_s": sum(r["step_s"] for r in rows),
        "blocks": round(sum(r["anchors_per_s"] * r["step_s"] for r in rows)),
        "labelled_positions": sum(r["valid_labels"] for r in rows),
        "final_loss": rows[-1]["loss"],
        "export": _shown(export),
    }
    record.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(record, json.dumps(result, indent=1, allow_nan=False) + "\n")
    return result


def _shown(path: Path) -> str:
    """A path as a committed record shows it: relative to the repository where it is inside it (no path of the
    machine that ran the study)."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path).replace(str(Path.home()), "~")


def widths(k_infer: list[str], k_train: int) -> list[int]:
    """The K_infer a drafter trained at k_train is decoded at: the listed ones up to k_train, `own` = k_train."""
    ks = {k_train if k == "own" else int(k) for k in k_infer}
    return sorted(k for k in ks if k <= k_train)


def eval_set(spec: str, arms: list[dict], k_infer: list[str], args, out: Path) -> dict:
    """One infer.eval call for a set (NAME or NAME:MAX_NEW_TOKENS): every arm at every K_infer <= its K_train, the
    shipped drafter, n-gram."""
    name, _, tokens = spec.partition(":")
    dest = out / f"eval-{name}"
    done = read_result(dest / "eval.json")
    if done is None:
        drafts = [f"shipped@{k}={SHIPPED}@{k}" for k in widths(k_infer, 16)]
        drafts += [f"{a['arm']}@{k}={a['export']}@{k}" for a in arms for k in widths(k_infer, a["k_train"])]
        # --prompt-style raw: the sets' first items as written, the prompts of the study's committed results
        cmd = [sys.executable, "-m", "infer.eval", "--target", "smollm2", "--dataset", name, "--prompt-style", "raw",
               "--limit", str(args.limit), "--max-new-tokens", tokens or str(args.max_new_tokens), "--out", str(dest),
               "--no-progress", "--draft", "ngram@16", *(x for d in drafts for x in ("--draft", d))]  # fmt: skip
        run(cmd, out / f"eval-{name}.log")
        done = read_result(dest / "eval.json")
        if done is None:
            raise SystemExit(
                f"error: infer.eval wrote no readable {dest / 'eval.json'}; see {out / f'eval-{name}.log'}"
            )
    return done


def _cell(rep: dict) -> dict:
    return {
        "tau": rep.get("tau"),
        "tau_per_prompt": rep.get("tau_per_prompt"),
        "survival": rep.get("survival", rep.get("acceptance_unconditional")),
        "acceptance_conditional": rep.get("acceptance_conditional"),
        "projected_speedup": rep.get("projected_speedup", {}),
        "speedup_measured_cpu": rep.get("speedup"),
        "lossless": rep.get("prompts", 0) - rep.get("lossless_mismatches", 0),
        "prompts": rep.get("prompts"),
    }


def matrices(evals: dict[str, dict]) -> dict:
    """{set: {row: {K_infer: cell}}} from each set's reports, whose rows are named ROW@K (n-gram as ngram)."""
    out = {}
    for name, ev in evals.items():
        rows: dict[str, dict] = {}
        for label, rep in ev["reports"].items():
            row, _, k = label.partition("@")
            rows.setdefault(row, {})[int(k or rep["block_size"])] = _cell(rep)
        out[name] = rows
    return out


def _fmt(x, digits=2) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def format_tables(mats: dict, arms: list[dict]) -> str:
    lines = []
    k_infer = sorted({k for rows in mats.values() for cells in rows.values() for k in cells})
    for name, rows in mats.items():
        lines += [f"### {name}: tau (projected v5p speedup), by K_train (rows) and K_infer (columns)", "",
                  "| drafter | " + " | ".join(f"K_infer={k}" for k in k_infer) + " |",
                  "|---|" + "---:|" * len(k_infer)]  # fmt: skip
        for row, cells in rows.items():
            vals = []
            for k in k_infer:
                c = cells.get(k)
                proj = (c or {}).get("projected_speedup", {}).get("tpu-v5p") if c else None
                vals.append("" if c is None else f"{_fmt(c['tau'], 3)} ({_fmt(proj)}x)")
            lines.append(f"| {row} | " + " | ".join(vals) + " |")
        lines.append("")
    lines += ["### training budgets", "", "| arm | K_train | start | gamma | anchors/row | steps | train s | blocks | "
              "labelled positions | final loss |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for a in arms:
        lines.append(
            f"| {a['arm']} | {a['k_train']} | {a['start']} | {a['gamma']} | {a['num_anchors']} | {a['steps']} | "
            f"{a['train_s']:.0f} | {a['blocks']} | {a['labelled_positions']} | {a['final_loss']:.3f} |"
        )
    return "\n".join(lines)


def plot_survival(mats: dict, path: Path) -> None:
    """Per set, survival against position: every row at K_infer = 16 (left) and at its own widest K (right)."""
    grid = []
    for name, rows in mats.items():
        left, right = [], []
        for row, cells in rows.items():
            for curves, k in ((left, 16), (right, max(cells))):
                c = cells.get(k)
                if c and c["survival"]:
                    curves.append((f"{row} (K={k}, tau {_fmt(c['tau'])})", c["survival"]))
        grid.append([(f"{name}: survival at K_infer = 16", left), (f"{name}: survival at each drafter's own K", right)])
    plot_survival_grid(grid, path)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="docs/results/wide-blocks", help="study.json, table.md, survival.png")
    ap.add_argument("--runs", default="runs/wide-blocks", help="training runs and the data mix")
    ap.add_argument("--train-minutes", type=float, default=5.0, help="wall-clock of steps per arm (default 5)")
    ap.add_argument(
        "--steps",
        type=int,
        default=None,
        help="equal steps per arm instead of equal wall-clock (every step drafts the same positions; for a machine "
        "whose load varies, where a calibrated step time would not hold)",
    )
    ap.add_argument("--sets", default="gsm8k,humaneval,mtbench", help="NAME or NAME:MAX_NEW_TOKENS, comma-separated")
    ap.add_argument("--limit", type=int, default=10, help="prompts per set (default 10)")
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--k-infer", default="8,16,32,64,128", help="K_infer list; `own` = each drafter's K_train")
    ap.add_argument("--arms", default="ft16,ft32,ft64,ft128,scratch16,scratch64", help="ftK, scratchK; sN adds a seed")
    ap.add_argument(
        "--positions",
        type=int,
        default=None,
        help="equal labelled positions per arm (each arm trains the steps whose batches hold that many, counted from "
        "the training pipeline); takes the place of --train-minutes and --steps",
    )
    ap.add_argument("--lr", type=float, default=FT_LR, help=f"every fine-tuned arm's learning rate ({FT_LR})")
    ap.add_argument(
        "--train-only",
        action="store_true",
        help="train the arms (each recorded in OUT/arms/ARM.json) and stop: for judging them by teacher-forced "
        "survival (infer.teacher_forced) instead of decoding",
    )
    args = ap.parse_args(argv)
    check_args(ap, args)
    out, runs = ROOT / args.out, ROOT / args.runs
    # Both places locked before any work: a second study there would train into the same run directories.
    with claim_dir(out, key="--out", doing="written by a study", name=".study.lock"):
        with claim_dir(runs, key="--runs", doing="used by a study", name=".study.lock"):
            return _study(args, out, runs)


def check_args(ap, args) -> None:
    """Values that cannot work, refused before any work (argparse checked the types)."""
    for flag, value in (("--limit", args.limit), ("--max-new-tokens", args.max_new_tokens), ("--steps", args.steps),
                        ("--positions", args.positions)):  # fmt: skip
        if value is not None and value < 1:
            ap.error(f"{flag} must be at least 1, got {value}")
    for flag, value in (("--train-minutes", args.train_minutes), ("--lr", args.lr)):
        if not (math.isfinite(value) and value > 0):
            ap.error(f"{flag} must be a positive number, got {value}")
    try:
        check_arms(args.arms)
        ks = [k for k in args.k_infer.split(",") if k]
        if not ks or any(k != "own" and not (k.isdigit() and int(k) >= 1) for k in ks) or len(set(ks)) < len(ks):
            raise ValueError(f"--k-infer {args.k_infer!r}: distinct K >= 1 or `own`, comma-separated")
    except ValueError as e:
        ap.error(str(e))


def _study(args, out: Path, runs: Path) -> dict:
    k_infer = args.k_infer.split(",")
    data = mix(runs)
    if args.positions is not None:
        budget = {"positions": args.positions}
    elif args.steps is not None:
        budget = {"steps": args.steps}
    else:
        budget = {"seconds": args.train_minutes * 60}
    arms = [train_arm(a, data, runs, budget, out, args.lr) for a in check_arms(args.arms)]
    if args.train_only:
        return {"arms": arms}
    evals = {s.partition(":")[0]: eval_set(s, arms, k_infer, args, out) for s in args.sets.split(",")}
    mats = matrices(evals)
    study = {"settings": vars(args), "positions_per_step": POSITIONS_PER_STEP, "arms": arms, "matrices": mats}
    atomic_write_text(out / "study.json", json.dumps(study, indent=1, allow_nan=False))
    table = format_tables(mats, arms)
    atomic_write_text(out / "table.md", table + "\n")
    plot_survival(mats, out / "survival.png")
    print(table)
    return study


if __name__ == "__main__":
    from dflash_model.cli import run_main

    run_main(main)
