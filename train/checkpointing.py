"""Checkpoints of a training run: Orbax saves of the train state, the data iterator's state and what the run was
(objective, drafter architecture), a restore that falls back past damaged checkpoints and refuses those of
another objective or drafter by name, and the metrics log trimmed back to the restored step.
"""

from __future__ import annotations

import json
import logging
import math
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from etils import epath

from dflash_model.files import atomic_write_text, is_uri

log = logging.getLogger("dflash.train")


class Checkpoints:
    """One run's checkpoint directory.

    meta: what a checkpoint must agree on to be resumed ({block_size, gamma, total_steps, drafter: z-lab config
    fields}); lr_at(total_steps, step): the learning rate at `step` of a schedule over `total_steps` (to say what
    resuming under another train.steps does to it).
    """

    def __init__(
        self,
        directory: Path,
        *,
        meta: dict,
        max_to_keep: int | None,
        asynchronous: bool,
        lr_at: Callable[[int, int], float],
    ):
        # epath: a gs:// directory stays a URI (Orbax and tensorstore write there themselves); local ones resolve.
        self.dir = epath.Path(str(directory)) if is_uri(directory) else Path(directory).resolve()
        self.meta = meta
        self.lr_at = lr_at
        self.manager = ocp.CheckpointManager(
            self.dir,
            item_names=("state", "data", "meta"),
            options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep, enable_async_checkpointing=asynchronous, create=True
            ),
        )

    def restore(self, abstract_state):
        """(step, state, data iterator state) of the newest checkpoint that reads back whole, or None; warns and
        falls back past damaged ones.

        A checkpoint written under another drafter architecture or objective is refused by name before anything is
        read (it is not damaged: the config changed, and falling back past it would start over on top of the run).
        A damaged checkpoint is moved to <checkpoints>/damaged/ so that its step can be saved again.
        """
        self._check_newest_meta()
        damaged = []
        try:
            for step in sorted(self.manager.all_steps(), reverse=True):
                try:
                    got = self.manager.restore(
                        step,
                        args=ocp.args.Composite(
                            state=ocp.args.StandardRestore(abstract_state),
                            data=ocp.args.JsonRestore(),
                            meta=ocp.args.JsonRestore(),
                        ),
                    )
                    if int(got.state["step"]) != step:
                        raise ValueError(f"holds step {int(got.state['step'])}")
                except Exception as e:  # noqa: BLE001 - any unreadable checkpoint means: try the previous one
                    msg = (
                        f"checkpoint step {step} in {self.dir} is unreadable ({type(e).__name__}: {e}); "
                        "falling back to the previous checkpoint"
                    )
                    warnings.warn(msg, stacklevel=2)
                    log.warning(msg)
                    damaged.append(step)
                    continue
                self._check_meta(got.meta, step)
                log.info("resumed from step %d (%s)", step, self.dir)
                return step, got.state, got.data
            return None
        finally:
            self._set_aside(damaged)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def wait_until_finished(self) -> None:
        """Block until an asynchronous save is on disk."""
        self.manager.wait_until_finished()

    def save(self, step: int, state, data_state, force: bool = False) -> None:
        if step in self.manager.all_steps():
            return
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                data=ocp.args.JsonSave(data_state),
                meta=ocp.args.JsonSave({"step": step, **self.meta, "time": time.time()}),
            ),
            force=force,
        )

    def _set_aside(self, steps) -> None:
        """Move damaged checkpoints out of the manager's directory (kept for a post-mortem, never deleted)."""
        if not steps or jax.process_index() != 0:
            return
        aside = self.dir / "damaged"
        aside.mkdir(exist_ok=True)
        for step in steps:
            src = self.dir / str(step)
            if src.exists():
                dst = aside / f"{step}-{time.strftime('%Y%m%d-%H%M%S')}"
                src.rename(dst)
                log.warning("moved the unreadable checkpoint step %d to %s", step, dst)
        self.manager.reload()

    def _check_newest_meta(self) -> None:
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
            except Exception:  # noqa: BLE001 - a damaged checkpoint is the restore loop's business
                continue
            self._check_meta(meta, step)
            return

    def _check_meta(self, meta: dict, step: int) -> None:
        """A checkpoint resumes only the objective and drafter it was trained with: the drafter shapes would load
        at another K (the block size is not a parameter shape), so a changed block_size or gamma is refused by
        name, and so is a changed drafter (its parameter shapes would not load). A changed train.steps resumes,
        saying what it does to the learning-rate schedule."""
        mine = self.meta
        diff = {
            k: (meta.get(k), mine[k])
            for k in ("block_size", "gamma")
            if k in meta and not math.isclose(float(meta[k]), mine[k])
        }
        old_arch = meta.get("drafter")
        if old_arch is not None:
            old_arch = json.loads(json.dumps(old_arch))
            new_arch = json.loads(json.dumps(mine["drafter"]))
            diff.update(
                {
                    f"drafter {k}": (old_arch.get(k), new_arch.get(k))
                    for k in sorted(set(old_arch) | set(new_arch))
                    if old_arch.get(k) != new_arch.get(k)
                }
            )
        if diff:
            said = "; ".join(f"{k}={old} in the checkpoint but {new} now" for k, (old, new) in diff.items())
            raise ValueError(
                f"checkpoint step {step} in {self.dir}: {said}. Use a new run_dir (or "
                f"checkpoint.dir) for a different objective or drafter, or set them back to resume"
            )
        old_total, total = meta.get("total_steps"), int(mine["total_steps"])
        if old_total is not None and int(old_total) != total:
            log.warning(
                "train.steps is %d now, %d when step %d was saved: the learning-rate schedule is "
                "recomputed over %d steps, so the rate at step %d moves from %.3g to %.3g",
                total,
                int(old_total),
                step,
                total,
                step,
                self.lr_at(int(old_total), step),
                self.lr_at(total, step),
            )


def trim_metrics(path: Path, step: int) -> None:
    """Drop log lines of steps past the restored state (a killed run logged them; they will be redone) and a torn
    last line (a kill mid-write). The file is replaced whole (temporary file + rename), never cut in place."""
    if not path.exists() or jax.process_index() != 0:
        return
    lines = path.read_text().splitlines()
    keep = []
    for i, ln in enumerate(lines):
        try:
            rec = json.loads(ln)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                log.warning("%s: dropped a torn last line (%d characters)", path, len(ln))
                continue
            raise ValueError(
                f"{path}:{i + 1}: not a JSON record (only a torn last line is expected after a crash)"
            ) from None
        if rec["step"] <= step:
            keep.append(ln)
    if len(keep) != len(lines):
        atomic_write_text(path, "".join(ln + "\n" for ln in keep))
