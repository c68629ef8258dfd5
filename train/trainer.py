"""The DFlash trainer: receives a run's world (`train.assembly.build_run`: target, drafter start, data, draft
vocabulary, features), sets up the optimizer state, runs the loop (`train`: one `train.step.train_step` per batch,
metrics, signals, export), and resumes bit for bit from Orbax checkpoints (`train.checkpointing`: drafter params +
optimizer state + step + grain iterator state).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import signal
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from dflash_model import sharding as shd
from dflash_model.drafter_weights import (
    export_drafter,
    zlab_config,
)
from dflash_model.files import local_dir, open_run_dir, pull, push, run_path
from train.assembly import EXPORT_LAYOUT, Run, build_run, export_verifier
from train.batches import kept_anchors
from train.checkpointing import Checkpoints, trim_metrics
from train.objective import gamma_of
from train.step import BATCH_KEYS, Program, make_optimizer, optimizer_shardings, train_step

log = logging.getLogger("dflash.train")


class TrainingDiverged(RuntimeError):
    """The loss became NaN/inf; the run stopped without saving the bad state."""


# ----------------------------------------------------------------------------------------------------------
# Building blocks (each callable alone from tests).


def _pause(seconds: float) -> None:
    time.sleep(seconds)  # a module function so a test can stand in for it (e.g. send SIGTERM mid-run)


# ----------------------------------------------------------------------------------------------------------
# The trainer.


class Profile:
    """A jax.profiler trace of steps start .. start+steps-1 (steps 0: off), written under `directory` on process 0.
    The step's metrics are fetched before `after`, so the trace holds the whole step's device work."""

    def __init__(self, directory: Path, start: int, steps: int):
        self.directory, self.start, self.steps = directory, start, steps
        self.on = False

    def before(self, step: int) -> None:
        if self.steps and step == self.start and jax.process_index() == 0:
            jax.profiler.start_trace(str(self.directory))
            self.on = True
            log.info("profiling steps %d-%d into %s", step, step + self.steps - 1, self.directory)

    def after(self, step: int) -> None:
        if self.on and step >= self.start + self.steps - 1:
            self.stop()

    def stop(self) -> None:
        if self.on:
            jax.profiler.stop_trace()
            self.on = False


def objective_options(cfg) -> tuple[int | None, float]:
    """(loss_positions, distill_weight), checked against each other and features.mode."""
    loss_positions = None if cfg.loss_positions is None else int(cfg.loss_positions)
    if loss_positions is not None and loss_positions < 1:
        raise ValueError(f"loss_positions={loss_positions}: must be >= 1 (or null for all K-1 slots)")
    distill_weight = float(cfg.distill_weight)
    if not 0.0 <= distill_weight <= 1.0:
        raise ValueError(f"distill_weight={distill_weight}: must be in [0, 1]")
    if distill_weight and cfg.features.mode != "online":
        raise ValueError(
            f"distill_weight={distill_weight} needs features.mode=online (the teacher is the "
            f"target's last layer, computed in the step), not {cfg.features.mode!r}"
        )
    return loss_positions, distill_weight


class Trainer:
    """Build everything from a Config, restore the newest readable checkpoint, then `train()`.

    run: the world to train in (train.assembly.build_run); without it the Trainer builds it from cfg, with target (a
    target module to train against instead of the one cfg.target names) and records (TokenizedRecords to train on
    instead of cfg.data's source: the batches, anchors and resumable iterator are the conversation path's).
    """

    def __init__(
        self, cfg, *, run: Run | None = None, devices=None, target=None, records=None, restore=True, lock=None
    ):
        self.cfg = cfg
        # A URI run_dir (gs://bucket/run): checkpoints go there through Orbax, the other files through a local
        # staging directory that `push` mirrors to it (dflash_model.files).
        self.run_uri = str(cfg.run_dir)
        self.run_dir = local_dir(cfg.run_dir)
        # The run directory's lock (process 0) before anything in it is read or written: a second training there
        # is refused with every file as it was. A lock given by the caller (train/run.py, which takes it before
        # regenerating data) stays the caller's to release; one taken here is released when `train` ends.
        self._own_lock = lock is None
        if lock is None and jax.process_index() == 0:
            lock = open_run_dir(cfg.run_dir, checkpoint_dir=cfg.checkpoint.dir)
        self.lock = lock
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if jax.process_index() == 0:
                pull(self.run_uri)  # a fresh host resuming a URI run: its metrics.jsonl and config.yml come back first
            if run is None:
                run = build_run(cfg, self.run_dir, devices=devices, target=target, records=records)
            self._receive(run, restore)
        except BaseException:
            self.release_lock()
            raise

    def release_lock(self) -> None:
        """Release the run directory's lock if this Trainer took it (a no-op otherwise, or when released)."""
        if self._own_lock and self.lock is not None:
            self.lock.release()

    def _hold_lock(self) -> None:
        """Take the run directory's lock again for a `train` after an earlier one released it."""
        if self._own_lock and self.lock is not None and not self.lock.held:
            self.lock = open_run_dir(self.cfg.run_dir, checkpoint_dir=self.cfg.checkpoint.dir)

    def _receive(self, run: Run, restore: bool) -> None:
        """Take the run's world (build_run's, or the caller's), then set up the optimizer state and checkpoints."""
        cfg = self.cfg
        for field in dataclasses.fields(run):  # cfg and run_dir are the Trainer's already; the drafter is split
            if field.name not in ("cfg", "run_dir", "drafter"):
                setattr(self, field.name, getattr(run, field.name))
        self.block_size = int(cfg.block_size)
        self.gamma = gamma_of(cfg)
        self.loss_positions, self.distill_weight = objective_options(cfg)
        self.d_graph, params = nnx.split(run.drafter)
        self.target_labels = cfg.data.labels == "target"
        epoch_steps = self.batches_per_epoch * int(cfg.train.epochs)
        self.total_steps = int(cfg.train.steps) if cfg.train.steps is not None else epoch_steps
        if self.total_steps > epoch_steps:
            raise ValueError(
                f"train.steps={self.total_steps} exceeds the {epoch_steps} batches of "
                f"train.epochs={cfg.train.epochs}; raise epochs or data.num_records"
            )
        self.tx, self.schedule = make_optimizer(cfg.train, self.total_steps)
        # tx.init may hand back one buffer for several equal leaves (the step counts); donation needs them distinct.
        init = jax.jit(self.tx.init, out_shardings=optimizer_shardings(self.tx, params, self.mesh))
        opt = jax.tree.map(lambda x: jnp.array(x, copy=True), init(params))
        self.state = self._place({"params": params, "opt": opt, "step": jnp.zeros((), jnp.int32)})
        self.iterator = iter(self.dataset)
        self._stop_signal = None

        ck = cfg.checkpoint
        self.checkpoints = Checkpoints(
            ck.dir if ck.dir is not None else run_path(self.run_uri, "checkpoints"),
            meta=self._meta(),
            max_to_keep=ck.max_to_keep,
            asynchronous=ck.asynchronous,
            lr_at=lambda total, step: float(make_optimizer(cfg.train, total)[1](step)),
        )
        self.restored_step = self.restore() if restore else None
        self.metrics_path = self.run_dir / "metrics.jsonl"
        trim_metrics(self.metrics_path, self.step)

    # -- state ---------------------------------------------------------------------------------------------

    def _place(self, tree):
        """Commit every leaf to the mesh (parameters keep their sharding, the rest is replicated)."""
        rep = NamedSharding(self.mesh, PartitionSpec())

        def put(x):
            sh = x.sharding
            keep = isinstance(sh, NamedSharding) and sh.mesh == self.mesh
            return jax.device_put(x, sh if keep else rep)

        return jax.tree.map(put, tree)

    @property
    def step(self) -> int:
        return int(self.state["step"])

    def drafter(self):
        """The current drafter, on its own buffers: the train step donates (and so deletes) the state's."""
        return nnx.merge(self.d_graph, jax.tree.map(jnp.copy, self.state["params"]))

    def restore(self) -> int | None:
        """Resume from the newest checkpoint that reads back whole (`Checkpoints.restore`); its step, or None."""
        got = self.checkpoints.restore(jax.tree.map(ocp.utils.to_shape_dtype_struct, self.state))
        if got is None:
            return None
        step, state, data = got
        self.state = self._place(state)
        self.iterator.set_state(data)
        return step

    def _meta(self) -> dict:
        """What a checkpoint must agree on to be resumed: the objective and the drafter architecture."""
        arch = zlab_config(self.drafter_cfg)
        return {
            "block_size": self.block_size,
            "gamma": self.gamma,
            "total_steps": self.total_steps,
            "drafter": {k: v for k, v in arch.items() if k not in ("block_size", "torch_dtype", "dtype")},
        }

    def save(self, force: bool = False) -> None:
        self.checkpoints.save(self.step, self.state, self.iterator.get_state(), force=force)
        self.push()

    def push(self) -> None:
        """Mirror the staged run files to a URI run_dir (process 0; a no-op for a local run_dir)."""
        if jax.process_index() == 0:
            push(self.run_uri)

    # -- the step ------------------------------------------------------------------------------------------

    def program(self) -> Program:
        return Program.for_config(
            self.cfg,
            d_graph=self.d_graph,
            t_graph=self.t_graph,
            layer_ids=self.drafter_cfg.target_layer_ids,
            total_steps=self.total_steps,
            mesh=self.mesh,
            state=self.state,
            target_labels=self.target_labels and self.features is None,
        )

    def put_batch(self, batch: dict) -> dict:
        """Host numpy batch (this process's rows) -> global arrays sharded over (data, fsdp)."""
        out = {}
        for k, v in batch.items():
            if k not in BATCH_KEYS:  # e.g. the pipeline's record index: not an input of the step
                continue
            v = np.asarray(v)
            out[k] = jax.make_array_from_process_local_data(shd.batch_sharding(self.mesh, v.ndim), v)
        return out

    def next_batch(self) -> dict:
        """The next training batch on the mesh: the grain iterator's rows, plus their offline features (and target
        labels) read by record index when the features are precomputed."""
        host = next(self.iterator)
        host = {**host, "anchors": self._trim_anchors(host["anchors"])}
        if self.features is not None:
            host = {**host, "features": self.features[host["index"]]}
            if self.labels is not None:
                host["labels"] = self.labels[host["index"]]
        return self.put_batch(host)

    def _trim_anchors(self, anchors_BN):
        """The batch's anchor columns that hold a real anchor in some row (train.batches.kept_anchors), the same
        count on every process (one global array shape)."""
        keep = kept_anchors(anchors_BN, int(self.cfg.anchor_buckets))
        if jax.process_count() > 1:
            keep = int(np.max(multihost_utils.process_allgather(np.int32(keep))))
        return anchors_BN[:, :keep]

    # -- the loop ------------------------------------------------------------------------------------------

    def _install_signals(self):
        if threading.current_thread() is not threading.main_thread():
            return {}

        def handler(signum, _frame):
            self._stop_signal = signum

        return {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}

    def train(self, max_steps: int | None = None) -> dict:
        """Run to train.steps (or `max_steps` more steps); checkpoint every checkpoint.every_steps, on SIGTERM/
        SIGINT and at the end; export a finished run. Returns a summary with throughput. Holds the run directory's
        lock throughout (a lock this Trainer took is released at the end, a caller's is left to the caller)."""
        self._hold_lock()
        try:
            return self._train(max_steps)
        finally:
            self.release_lock()

    def _train(self, max_steps: int | None) -> dict:
        cfg = self.cfg
        end = self.total_steps if max_steps is None else min(self.total_steps, self.step + max_steps)
        prog = self.program()
        nan_at = jnp.asarray(-1 if cfg.debug.nan_at_step is None else int(cfg.debug.nan_at_step), jnp.int32)
        old_handlers = self._install_signals()
        tb = self._tensorboard()
        every = int(cfg.checkpoint.every_steps)
        timed, t_tokens, t_anchors, t_time, first_time = 0, 0, 0, 0.0, None
        shapes = set()  # anchor columns run so far: a step of a new count compiles (train.batches.kept_anchors)
        stopped = None
        profile = Profile(self.run_dir / "profile", int(cfg.log.profile_start), int(cfg.log.profile_steps))
        try:
            while self.step < end:
                batch = self.next_batch()
                profile.before(self.step + 1)
                t0 = time.perf_counter()
                with jax.set_mesh(self.mesh):  # traced under the mesh: activations keep their batch sharding
                    self.state, metrics = train_step(self.state, self.t_state, batch, nan_at, self.vocab_ids, prog=prog)
                metrics = jax.device_get(metrics)  # one host sync per step: the NaN stop and the log need it
                dt = time.perf_counter() - t0
                step = int(self.state["step"])
                loss = float(metrics["loss"])
                if not math.isfinite(loss):
                    self.checkpoints.wait_until_finished()
                    last = self.checkpoints.latest_step()
                    raise TrainingDiverged(
                        f"loss is {loss} at step {step + 1}; stopped without saving that step. Last good "
                        f"checkpoint: step {last} in {self.checkpoints.dir}"
                        if last is not None
                        else f"loss is {loss} at step {step + 1}; stopped; no checkpoint had been written yet"
                    )
                profile.after(step)
                tokens, anchors = int(metrics["tokens"]), int(metrics["anchors"])
                columns = int(batch["anchors"].shape[1])
                compiled = columns not in shapes
                shapes.add(columns)
                if not compiled:
                    timed, t_tokens, t_anchors, t_time = timed + 1, t_tokens + tokens, t_anchors + anchors, t_time + dt
                elif first_time is None:
                    first_time = dt  # the first step, compilation included
                rec = {
                    "step": step,
                    "loss": loss,
                    "sim_tau": float(metrics["sim_tau"]),
                    "grad_norm": float(metrics["grad_norm"]),
                    "lr": float(metrics["lr"]),
                    "valid_labels": int(metrics["valid_labels"]),
                    "tokens_per_s": tokens / dt,
                    "anchors_per_s": anchors / dt,
                    "step_s": dt,
                    "anchor_columns": columns,
                    "compiled": compiled,
                    "acc": [float(a) for a in metrics["acc"]],
                }
                self._log(rec, tb)
                if step % every == 0 or step == end:
                    self.save()
                if float(cfg.debug.sleep_per_step):
                    _pause(float(cfg.debug.sleep_per_step))
                # A preemption notice can reach the processes of a pod at different steps: they agree on it at
                # every step (one tiny all-gather with several processes), so all of them save this step and stop.
                agreed = shd.max_over_processes(self._stop_signal or 0)
                if agreed:
                    stopped = signal.Signals(agreed).name
                    whose = "" if self._stop_signal else " by another process"
                    log.warning("%s received%s: checkpointing step %d and stopping", stopped, whose, step)
                    self.save(force=True)
                    break
        finally:
            profile.stop()
            self.checkpoints.wait_until_finished()
            for s, h in old_handlers.items():
                signal.signal(s, h)
            if tb is not None:
                tb.close()
            self.push()
        summary = {
            "step": self.step,
            "stopped_by": stopped,
            "compile_step_s": first_time,
            "tokens_per_s": t_tokens / t_time if t_time else None,
            "anchors_per_s": t_anchors / t_time if t_time else None,
            "step_s": t_time / timed if timed else None,
        }
        if self.step >= self.total_steps and stopped is None and bool(cfg.export.enabled):
            path = self.export()  # every process: FSDP shards are gathered from all of them; process 0 writes
            if path is not None:
                summary["export"] = str(path)
        return summary

    def export(self) -> Path | None:
        """The drafter in export.format's format(s) (EXPORT_LAYOUT: <run_dir>/export/, and export-speculators/ for
        `both`). With several processes every one must call this (the parameters are gathered across them);
        process 0 writes and gets the path of export/, the others None."""
        if jax.process_count() > 1:
            params = multihost_utils.process_allgather(self.state["params"], tiled=True)  # host numpy, whole
            if jax.process_index() != 0:
                return None
            drafter = nnx.merge(self.d_graph, params)
        else:
            drafter = self.drafter()
        verifier = export_verifier(self.cfg, self.target_cfg)
        paths = [
            export_drafter(
                drafter,
                drafter.config,
                self.run_dir / sub,
                dtype=self.cfg.export.dtype,
                draft_vocab=self.vocab_ids,
                fmt=fmt,
                verifier=verifier,
            )
            for fmt, sub in EXPORT_LAYOUT[self.cfg.export.format]
        ]
        self.push()
        return paths[0]

    def _tensorboard(self):
        if not bool(self.cfg.log.tensorboard) or jax.process_index() != 0:
            return None
        # A dependency, imported here so that a run with log.tensorboard=false never loads it.
        from tensorboardX import SummaryWriter

        return SummaryWriter(str(self.run_dir / "tb"))

    def _log(self, rec: dict, tb) -> None:
        if jax.process_index() != 0:
            return
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        if tb is not None:
            for k in ("loss", "sim_tau", "grad_norm", "lr", "tokens_per_s", "anchors_per_s"):
                tb.add_scalar(f"train/{k}", rec[k], rec["step"])
        s = rec["step"]
        if s % int(self.cfg.log.every) == 0 or s == 1 or s == self.total_steps:
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
