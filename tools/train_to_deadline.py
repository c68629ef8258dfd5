"""Train a config to a wall-clock deadline, then export: `python tools/train_to_deadline.py --deadline UNIX_TIME
--config NAME [key=value ...]`.

An accelerator machine is reached for minutes, and a step's time on it is unknown until it runs. So: train
`--probe` steps (the first compiles), take the median step time, and set the cosine schedule's length to the steps
that fit before the deadline less one more compile (the schedule is a compile-time constant of the step: the new
length compiles once). A timer sends SIGTERM shortly before the deadline in case the fit was optimistic: the trainer
then stops at the next step, and the drafter is exported where it stands.

It always starts from step 0 (the fitted schedule is this run's own), so a run_dir that holds a run already is
refused unless `--restart` says to replace it; a deadline too close to leave a step and the export is refused.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from train.config import load_config  # noqa: E402
from train.presets import cli_overrides  # noqa: E402

EXPORT_S = 20.0  # the export and the files after it
MIN_LEAD_S = 60.0  # a deadline nearer than this leaves no time for a build, a compile, a step and the export


def holds_run(run_dir: Path) -> list[str]:
    """What in run_dir shows a run was trained there (metrics, checkpoints, an export)."""
    found = [name for name in ("metrics.jsonl", "export") if (run_dir / name).exists()]
    checkpoints = run_dir / "checkpoints"
    if checkpoints.is_dir() and any(checkpoints.iterdir()):
        found.append("checkpoints/")
    return found


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--deadline", type=float, required=True, help="unix time by which the export must be written")
    ap.add_argument("--probe", type=int, default=12, help="steps timed before the schedule is fitted")
    ap.add_argument("--restart", action="store_true", help="replace a run the run_dir holds already (else refused)")
    args, rest = ap.parse_known_args(argv)
    if args.probe < 2:
        ap.error(f"--probe must be at least 2 (the first step compiles), got {args.probe}")
    lead = args.deadline - time.time()
    if not lead >= MIN_LEAD_S:  # also refuses a NaN deadline
        raise ValueError(
            f"--deadline {args.deadline:.0f} is {lead:.0f} s from now: at least {MIN_LEAD_S:.0f} s are needed for a "
            "build, a compiled step and the export"
        )
    name, overrides = cli_overrides(rest)
    cfg = load_config(name, overrides)
    from dflash_model.files import open_run_dir

    # the run directory's lock before anything there is read or written
    with open_run_dir(cfg.run_dir, checkpoint_dir=cfg.checkpoint.dir) as lock:
        return _train(args, name, overrides, cfg, lock)


def _train(args, name: str, overrides: list[str], cfg, lock) -> dict:
    from dflash_model.files import local_dir

    found = holds_run(local_dir(cfg.run_dir))
    if found and not args.restart:
        raise ValueError(
            f"run_dir={cfg.run_dir} holds a run already ({', '.join(found)}): this tool starts from step 0 and would "
            "replace it. Give another run_dir=, resume it with train/run.py, or pass --restart to replace it"
        )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("absl").setLevel(logging.WARNING)
    log = logging.getLogger("train_to_deadline")

    from train.trainer import open_trainer
    from train.workflow import export_run

    t0 = time.time()
    trainer = open_trainer(cfg, restore=False, lock=lock)
    (trainer.run_dir / "config.yml").write_text(cfg.dump())
    log.info("trainer built in %.0f s: %d batches an epoch", time.time() - t0, trainer.run.batches_per_epoch)
    stop_at = args.deadline - EXPORT_S
    # Between the trainer's own SIGTERM handlers (installed only inside train()) this one keeps the signal a request.
    signal.signal(signal.SIGTERM, lambda signum, _frame: setattr(trainer, "_stop_signal", signum))
    timer = threading.Timer(max(1.0, stop_at - time.time()), os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    summary = trainer.train(max_steps=args.probe)
    total = trainer.total_steps
    if summary["stopped_by"] is None:
        recs = [json.loads(line) for line in trainer.metrics_path.open()]
        compile_s, step_s = recs[0]["step_s"], statistics.median(r["step_s"] for r in recs[1:] or recs)
        fit = trainer.step + int((stop_at - time.time() - compile_s) / step_s)
        total = max(trainer.step + 1, min(fit, trainer.run.batches_per_epoch * int(cfg.train.epochs)))
        log.info("step %.3f s (first %.0f s): %d steps fit before the deadline", step_s, compile_s, total)
        trainer.total_steps = total  # read by trainer.program(): the next train() compiles the fitted schedule
        (trainer.run_dir / "config.yml").write_text(load_config(name, [*overrides, f"train.steps={total}"]).dump())
        summary = trainer.train()
    timer.cancel()  # the export is not a step: a SIGTERM now would only set a flag nobody reads
    if "export" not in summary:
        summary["export"] = str(export_run(trainer))
    summary.update(total_steps=total, wall_s=time.time() - t0)
    (trainer.run_dir / "budget_summary.json").write_text(json.dumps(summary, indent=1))
    log.info("done: %s", summary)
    return summary


if __name__ == "__main__":
    from dflash_model.cli import run_main

    run_main(main)
