"""The benchmark recipe: real draft-quality numbers for SmolLM2-135M drafters on this machine.

  .venv/bin/python benchmarks/recipe.py [--scale full|short|quick] [--out DIR] [--only train|eval]

What it runs (each step resumes: regenerated data, checkpoints and finished evals are reused):
  1. the default config's data at a larger size: ShareGPT first turns answered by the target (greedy);
  2. four drafters with the SAME data, steps, batch and anchors per sequence (so the same training tokens and
     the same number of blocks; a K=64 block costs ~4x a K=16 block in compute):
       k16            K=16, gamma 7 (the paper's)
       k64            K=64, gamma 18.47 (train.objective.default_gamma)
       k64-gamma7     K=64, gamma 7: is a K=16 decay better for a wide block?
       k64-nofeat     K=64 with the target features zeroed (training and eval): what the features are worth
  3. HumanEval, GSM8K and MT-Bench turn 1 (chat template, greedy, batch 1, `max_new_tokens` new tokens): plain
     decoding once per prompt, then every drafter and n-gram (K=8) on the same prompt, through infer/eval.py's
     `run_comparison` (lossless check included). Writes <out>/eval-<dataset>.json, <out>/table.md and
     <out>/acceptance-<dataset>.png, plus <out>/train.json with each run's wall time and final metrics.

Scales: `full` is the long results run (many hours on a 2-core CPU; resumable across runs); `short` is the
one that takes about 1.5 h and gives docs/results/recipe-short/; `quick` checks the recipe end to end in
minutes (numbers meaningless).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

from dflash_model.files import atomic_write_text

REPO = Path(__file__).resolve().parent.parent

SCALES = {
    # limit: conversations read (the default run reads 216); steps x batch x anchors: the training budget.
    # heldout: conversations kept out of training (the recipe evaluates on other datasets, so 0 is fine).
    "full": {"limit": 1216, "heldout": 0, "steps": 600, "batch": 2, "anchors": 16, "prompts": 10, "new_tokens": 256},
    # About 1.6 h on 2 cores: 308 replies, 300 steps of one sequence, 3 prompts per dataset.
    "short": {"limit": 400, "heldout": 0, "steps": 300, "batch": 1, "anchors": 16, "prompts": 3, "new_tokens": 256},
    "quick": {"limit": 216, "heldout": 16, "steps": 4, "batch": 2, "anchors": 4, "prompts": 1, "new_tokens": 16},
}
RUNS = {
    "k16": ["block_size=16"],
    "k64": ["block_size=64"],
    "k64-gamma7": ["block_size=64", "gamma=7.0"],
    "k64-nofeat": ["block_size=64", "features.zero=true"],
}
DATASETS = ("humaneval", "gsm8k", "mtbench")


def train_all(scale: dict, out: Path, runs_dir: Path) -> dict:
    """Each drafter through train/run.py in its own process (its log next to the results); returns walls."""
    info = json.loads((out / "train.json").read_text()) if (out / "train.json").exists() else {}
    for name, extra in RUNS.items():
        run_dir = runs_dir / name
        args = [
            sys.executable,
            str(REPO / "train" / "run.py"),
            "--config",
            "smollm2-135m",
            *extra,
            f"run_dir={run_dir}",
            f"data.regenerate.limit={scale['limit']}",
            f"data.regenerate.heldout={scale['heldout']}",
            f"train.steps={scale['steps']}",
            f"train.batch_size={scale['batch']}",
            f"num_anchors={scale['anchors']}",
            "loss_positions=null",  # every slot: the recipe compares block widths and decays
            "train.epochs=100",
            f"checkpoint.every_steps={max(scale['steps'] // 6, 1)}",
            "eval.enabled=false",
        ]
        print(f"[recipe] training {name}: {' '.join(args[2:])}", flush=True)
        t0 = time.perf_counter()
        with (out / f"train-{name}.log").open("a") as log:
            subprocess.run(args, check=True, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        wall = time.perf_counter() - t0
        metrics = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
        last = metrics[-10:]
        prior = info.get(name, {})
        info[name] = {
            "overrides": extra,
            # Relative to the repository where it lies inside it: committed results name no path of this machine.
            "run_dir": str(run_dir.resolve().relative_to(REPO))
            if run_dir.resolve().is_relative_to(REPO)
            else str(run_dir),
            "steps": metrics[-1]["step"],
            # A resumed run's wall only covers what was left; keep the first (full) measurement.
            "wall_s": prior.get("wall_s", wall) if prior.get("steps") == metrics[-1]["step"] else wall,
            "final_loss_mean10": sum(m["loss"] for m in last) / len(last),
            "final_sim_tau_mean10": sum(m["sim_tau"] for m in last) / len(last),
            "tokens_per_s_median": sorted(m["tokens_per_s"] for m in metrics)[len(metrics) // 2],
            "anchors_per_s_median": sorted(m["anchors_per_s"] for m in metrics)[len(metrics) // 2],
        }
        atomic_write_text(out / "train.json", json.dumps(info, indent=1))
    return info


def eval_all(scale: dict, out: Path, runs_dir: Path) -> None:
    import dataclasses

    import jax

    from dflash_model.tokenizer import stop_token_ids
    from infer.eval import dataset_messages, encode, format_comparison, plot_comparison, run_comparison
    from infer.loading import load_draft_spec
    from infer.target_spec import load_target_spec

    target = load_target_spec("smollm2")
    drafts = [
        dataclasses.replace(
            load_draft_spec(
                str(runs_dir / name / "export"),
                target.config,
                dtype=target.config.dtype,
                zero_features="features.zero=true" in extra,
            ),
            name=name,
        )
        for name, extra in RUNS.items()
    ]
    drafts.append(load_draft_spec("ngram", target.config, 8))
    tables = []
    for ds in DATASETS:
        path = out / f"eval-{ds}.json"
        if path.exists():
            reports = json.loads(path.read_text())["reports"]
        else:
            rows = dataset_messages(ds, scale["prompts"])
            t0 = time.perf_counter()
            stops = tuple(stop_token_ids(target.tokenizer))
            reports = run_comparison(
                target.model,
                drafts,
                encode(rows, target.tokenizer),
                max_new_tokens=scale["new_tokens"],
                stop_ids=stops,
                ids=[r["id"] for r in rows],
            )
            atomic_write_text(
                path,
                json.dumps(
                    {
                        "dataset": ds,
                        "prompts": len(rows),
                        "max_new_tokens": scale["new_tokens"],
                        "wall_s": time.perf_counter() - t0,
                        "device": str(jax.devices()[0]),
                        "machine": platform.processor() or platform.machine(),
                        "reports": reports,
                    },
                    indent=1,
                ),
            )
        plot_comparison(reports, out / f"acceptance-{ds}.png", title=f"SmolLM2-135M drafters on {ds}")
        tables.append(f"### {ds}\n\n{format_comparison(reports)}\n")
    atomic_write_text(out / "table.md", "\n".join(tables))
    print("\n".join(tables))
    summary = summarize(out)
    atomic_write_text(out / "summary.md", summary)
    print(summary)


def summarize(out: Path) -> str:
    """One row per decoder over every dataset: how it was trained, tau and speedup per dataset, lossless."""
    train = json.loads((out / "train.json").read_text()) if (out / "train.json").exists() else {}
    evals = {
        ds: json.loads((out / f"eval-{ds}.json").read_text()) for ds in DATASETS if (out / f"eval-{ds}.json").exists()
    }
    if not evals:
        return ""
    first = next(iter(evals.values()))
    head = (
        f"{first['prompts']} prompts per dataset, up to {first['max_new_tokens']} new tokens, greedy, batch 1; "
        "tau = committed tokens per verify round (bonus included); speedup = plain TPOT / speculative TPOT"
    )
    cols = " | ".join(f"{ds} tau | {ds} speedup" for ds in evals)
    lines = [
        head,
        "",
        f"| decoder | K | train wall | final loss | {cols} | lossless |",
        "|---|---:|---:|---:|" + "---:|---:|" * len(evals) + "---|",
    ]
    plain = " | ".join(
        f"1.000 | 1.00x ({e['reports'][next(iter(e['reports']))]['tpot_plain_ms']:.0f} ms)" for e in evals.values()
    )
    lines.append(f"| plain | 1 | - | - | {plain} | - |")
    for name in next(iter(evals.values()))["reports"]:
        rs = [e["reports"][name] for e in evals.values()]
        t = train.get(name, {})
        wall = f"{t['wall_s'] / 60:.1f} min" if t else "-"
        loss = f"{t['final_loss_mean10']:.2f}" if t else "-"
        cells = " | ".join(f"{r['tau']:.3f} | {r['speedup']:.2f}x" for r in rs)
        n = sum(r["prompts"] for r in rs)
        bad = sum(r["lossless_mismatches"] for r in rs)
        lines.append(f"| {name} | {rs[0]['block_size']} | {wall} | {loss} | {cells} | {n - bad}/{n} equal |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", choices=sorted(SCALES), default="full")
    ap.add_argument("--out", default=None, help="default docs/results/recipe-<scale> (runs/recipe-quick for quick)")
    ap.add_argument("--runs", default=None, help="training run directories; default runs/recipe-<scale>")
    ap.add_argument("--only", choices=["train", "eval"], default=None)
    args = ap.parse_args(argv)
    scale = SCALES[args.scale]
    # The quick check's numbers mean nothing: it writes under runs/, not docs/.
    default_out = REPO / ("runs" if args.scale == "quick" else "docs/results") / f"recipe-{args.scale}"
    out = Path(args.out or default_out)
    runs_dir = Path(args.runs or REPO / "runs" / f"recipe-{args.scale}")
    out.mkdir(parents=True, exist_ok=True)
    if args.only != "eval":
        train_all(scale, out, runs_dir)
    if args.only != "train":
        eval_all(scale, out, runs_dir)


if __name__ == "__main__":
    main()
