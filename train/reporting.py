"""What the training loop reports, as hooks it calls around each step: the metrics file, the console line,
TensorBoard and the profiler. The loop (train.trainer) knows only the three calls of `Hook`; `default_hooks` picks
the ones a config asks for, on process 0 (the others of a multi-process run report nothing).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Protocol

import jax

log = logging.getLogger("dflash.train")


class Hook(Protocol):
    def before_step(self, step: int) -> None:
        """Step `step` (1-based) is about to run."""

    def after_step(self, rec: dict) -> None:
        """Step rec["step"] ran: its metrics (host values), fetched already."""

    def close(self) -> None:
        """The loop ended (finished, stopped or raised)."""


class MetricsFile:
    """One JSON line a step in <run_dir>/metrics.jsonl (the file resume trims back to the restored step)."""

    def __init__(self, path: Path):
        self.path = path

    def before_step(self, step: int) -> None:
        pass

    def after_step(self, rec: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(rec) + "\n")

    def close(self) -> None:
        pass


class Console:
    """A log line every `every` steps (and at the first and last) with the loss, accuracies, rates and time left."""

    def __init__(self, every: int, total_steps: int):
        self.every, self.total_steps = every, total_steps

    def before_step(self, step: int) -> None:
        pass

    def after_step(self, rec: dict) -> None:
        s = rec["step"]
        if s % self.every and s != 1 and s != self.total_steps:
            return
        acc = rec["acc"]
        log.info(
            "step %d/%d  loss %.4f  sim_tau %.3f  acc[1] %.3f acc[K-1] %.3f  |g| %.3f  lr %.2e  "
            "%.0f tok/s  %.0f anchors/s  %.3fs/step  eta %.1f min",
            s,
            self.total_steps,
            rec["loss"],
            rec["sim_tau"],
            acc[0],
            acc[-1],
            rec["grad_norm"],
            rec["lr"],
            rec["tokens_per_s"],
            rec["anchors_per_s"],
            rec["step_s"],
            rec["step_s"] * (self.total_steps - s) / 60,
        )

    def close(self) -> None:
        pass


class TensorBoard:
    """Scalars under train/ in <run_dir>/tb (tensorboardX, a dependency loaded only when this hook is made)."""

    KEYS = ("loss", "sim_tau", "grad_norm", "lr", "tokens_per_s", "anchors_per_s")

    def __init__(self, directory: Path):
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(str(directory))

    def before_step(self, step: int) -> None:
        pass

    def after_step(self, rec: dict) -> None:
        for k in self.KEYS:
            self.writer.add_scalar(f"train/{k}", rec[k], rec["step"])

    def close(self) -> None:
        self.writer.close()


class Profiler:
    """A jax.profiler trace of steps start .. start+steps-1 (steps 0: off), written under `directory`. The step's
    metrics are fetched before `after_step`, so the trace holds the whole step's device work."""

    def __init__(self, directory: Path, start: int, steps: int):
        self.directory, self.start, self.steps = directory, start, steps
        self.on = False

    def before_step(self, step: int) -> None:
        if self.steps and step == self.start:
            jax.profiler.start_trace(str(self.directory))
            self.on = True
            log.info("profiling steps %d-%d into %s", step, step + self.steps - 1, self.directory)

    def after_step(self, rec: dict) -> None:
        if self.on and rec["step"] >= self.start + self.steps - 1:
            self.close()

    def close(self) -> None:
        if self.on:
            jax.profiler.stop_trace()
            self.on = False


def default_hooks(log, run_dir: Path, total_steps: int) -> list[Hook]:
    """The reporting the config's `log` section asks for, on process 0: metrics file, console, TensorBoard
    (log.tensorboard) and a profile (log.profile_steps > 0)."""
    if jax.process_index() != 0:
        return []
    hooks: list[Hook] = [MetricsFile(run_dir / "metrics.jsonl"), Console(log.every, total_steps)]
    if log.tensorboard:
        hooks.append(TensorBoard(run_dir / "tb"))
    if log.profile_steps:
        hooks.append(Profiler(run_dir / "profile", log.profile_start, log.profile_steps))
    return hooks
