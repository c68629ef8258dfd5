"""The DFlash trainer: handed a run's world (`train.assembly.build_run`: target, drafter start, data, draft
vocabulary, features), it sets up the optimizer state, runs the loop (`train`: one `train.step.train_step` per
batch, checkpoints, signals, and the reporting hooks of `train.reporting`), and resumes bit for bit from Orbax
checkpoints (`train.checkpointing`: drafter params + optimizer state + step + grain iterator state).
`open_trainer` is the whole assembly for a config: lock the run directory, stage it, build the run, hand it over.
"""

from __future__ import annotations

import logging
import math
import signal
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from dflash_model import sharding as shd
from dflash_model.drafter_weights import zlab_config
from dflash_model.files import open_run_dir, push, run_path
from train.assembly import Run, build_run, stage_run_dir
from train.batches import kept_anchors
from train.checkpointing import Checkpoints, trim_metrics
from train.objective import gamma_of
from train.reporting import Hook, default_hooks
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


class Trainer:
    """The training loop over a run's world: set up the optimizer state, restore the newest readable checkpoint,
    then `train()`.

    run: what to train with (train.assembly.build_run). lock: the run directory's lock (process 0), held by the
    caller; with own_lock the Trainer owns it (`open_trainer`'s): released when `train` ends and taken again by a
    later `train`. hooks: what each step reports (train.reporting); default: what cfg.log asks for, made anew for
    each `train` call.
    """

    def __init__(self, run: Run, *, restore=True, lock=None, own_lock=False, hooks=None):
        self.run, self.cfg = run, run.cfg
        self.run_uri = str(run.cfg.run_dir)  # a URI run_dir: checkpoints go there, the other files through run_dir
        self.run_dir = run.run_dir
        self.lock, self._own_lock = lock, own_lock
        self._hooks = hooks
        cfg = self.cfg
        self.block_size = cfg.block_size
        self.gamma = gamma_of(cfg)
        self.d_graph, params = nnx.split(run.drafter)
        self.target_labels = cfg.data.labels == "target"
        epoch_steps = run.batches_per_epoch * cfg.train.epochs
        self.total_steps = cfg.train.steps if cfg.train.steps is not None else epoch_steps
        if self.total_steps > epoch_steps:
            raise ValueError(
                f"train.steps={self.total_steps} exceeds the {epoch_steps} batches of "
                f"train.epochs={cfg.train.epochs}; raise epochs or data.num_records"
            )
        self.tx, self.schedule = make_optimizer(cfg.train, self.total_steps)
        # tx.init may hand back one buffer for several equal leaves (the step counts); donation needs them distinct.
        init = jax.jit(self.tx.init, out_shardings=optimizer_shardings(self.tx, params, run.mesh))
        opt = jax.tree.map(lambda x: jnp.array(x, copy=True), init(params))
        self.state = self._place({"params": params, "opt": opt, "step": jnp.zeros((), jnp.int32)})
        self.iterator = iter(run.dataset)
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

    def release_lock(self) -> None:
        """Release the run directory's lock if this Trainer owns it (a no-op otherwise, or when released)."""
        if self._own_lock and self.lock is not None:
            self.lock.release()

    def _hold_lock(self) -> None:
        """Take the run directory's lock again for a `train` after an earlier one released it."""
        if self._own_lock and self.lock is not None and not self.lock.held:
            self.lock = open_run_dir(self.cfg.run_dir, checkpoint_dir=self.cfg.checkpoint.dir)

    # -- state ---------------------------------------------------------------------------------------------

    def _place(self, tree):
        """Commit every leaf to the mesh (parameters keep their sharding, the rest is replicated)."""
        rep = NamedSharding(self.run.mesh, PartitionSpec())

        def put(x):
            sh = x.sharding
            keep = isinstance(sh, NamedSharding) and sh.mesh == self.run.mesh
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
        arch = zlab_config(self.run.drafter_cfg)
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
            t_graph=self.run.t_graph,
            layer_ids=self.run.drafter_cfg.target_layer_ids,
            total_steps=self.total_steps,
            mesh=self.run.mesh,
            state=self.state,
            target_labels=self.target_labels and self.run.features is None,
        )

    def put_batch(self, batch: dict) -> dict:
        """Host numpy batch (this process's rows) -> global arrays sharded over (data, fsdp)."""
        out = {}
        for k, v in batch.items():
            if k not in BATCH_KEYS:  # e.g. the pipeline's record index: not an input of the step
                continue
            v = np.asarray(v)
            out[k] = jax.make_array_from_process_local_data(shd.batch_sharding(self.run.mesh, v.ndim), v)
        return out

    def next_batch(self) -> dict:
        """The next training batch on the mesh: the grain iterator's rows, plus their offline features (and target
        labels) read by record index when the features are precomputed."""
        host = next(self.iterator)
        host = {**host, "anchors": self._trim_anchors(host["anchors"])}
        if self.run.features is not None:
            host = {**host, "features": self.run.features[host["index"]]}
            if self.run.labels is not None:
                host["labels"] = self.run.labels[host["index"]]
        return self.put_batch(host)

    def _trim_anchors(self, anchors_BN):
        """The batch's anchor columns that hold a real anchor in some row (train.batches.kept_anchors), the same
        count on every process (one global array shape)."""
        keep = kept_anchors(anchors_BN, self.cfg.anchor_buckets)
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

    def _make_hooks(self) -> list[Hook]:
        if self._hooks is None:
            return default_hooks(self.cfg.log, self.run_dir, self.total_steps)
        return list(self._hooks)

    def _train(self, max_steps: int | None) -> dict:
        cfg = self.cfg
        end = self.total_steps if max_steps is None else min(self.total_steps, self.step + max_steps)
        prog = self.program()
        nan_at = jnp.asarray(-1 if cfg.debug.nan_at_step is None else cfg.debug.nan_at_step, jnp.int32)
        old_handlers = self._install_signals()
        hooks = self._make_hooks()
        every = cfg.checkpoint.every_steps
        timer = _Throughput()
        stopped = None
        try:
            while self.step < end:
                batch = self.next_batch()
                for h in hooks:
                    h.before_step(self.step + 1)
                rec = timer.record(*self._step(batch, prog, nan_at))
                for h in hooks:
                    h.after_step(rec)
                step = rec["step"]
                if step % every == 0 or step == end:
                    self.save()
                if cfg.debug.sleep_per_step:
                    _pause(cfg.debug.sleep_per_step)
                stopped = self._agreed_stop(step)
                if stopped:
                    break
        finally:
            for h in hooks:
                h.close()
            self.checkpoints.wait_until_finished()
            for s, h in old_handlers.items():
                signal.signal(s, h)
            self.push()
        return {"step": self.step, "stopped_by": stopped, **timer.summary()}

    def _step(self, batch: dict, prog: Program, nan_at) -> tuple[dict, float, int]:
        """One training step: (its metrics on the host, its seconds, its anchor columns). A non-finite loss stops
        the run before anything of that step is saved."""
        t0 = time.perf_counter()
        with jax.set_mesh(self.run.mesh):  # traced under the mesh: activations keep their batch sharding
            self.state, metrics = train_step(self.state, self.run.t_state, batch, nan_at, self.run.vocab_ids, prog=prog)
        metrics = jax.device_get(metrics)  # one host sync per step: the NaN stop and the log need it
        dt = time.perf_counter() - t0
        loss = float(metrics["loss"])
        if not math.isfinite(loss):
            step = int(self.state["step"])
            self.checkpoints.wait_until_finished()
            last = self.checkpoints.latest_step()
            raise TrainingDiverged(
                f"loss is {loss} at step {step + 1}; stopped without saving that step. Last good "
                f"checkpoint: step {last} in {self.checkpoints.dir}"
                if last is not None
                else f"loss is {loss} at step {step + 1}; stopped; no checkpoint had been written yet"
            )
        return {**metrics, "step": int(self.state["step"])}, dt, int(batch["anchors"].shape[1])

    def _agreed_stop(self, step: int) -> str | None:
        """The signal that stops the run after this step, once checkpointed, or None. A preemption notice can reach
        the processes of a pod at different steps: they agree on it at every step (one tiny all-gather with several
        processes), so all of them save this step and stop."""
        agreed = shd.max_over_processes(self._stop_signal or 0)
        if not agreed:
            return None
        stopped = signal.Signals(agreed).name
        whose = "" if self._stop_signal else " by another process"
        log.warning("%s received%s: checkpointing step %d and stopping", stopped, whose, step)
        self.save(force=True)
        return stopped


class _Throughput:
    """Each step's log record, and the run's rates over the steps that did not compile (the first, and the first
    of each new anchor-column count: train.batches.kept_anchors)."""

    def __init__(self):
        self.timed, self.tokens, self.anchors, self.seconds, self.first = 0, 0, 0, 0.0, None
        self.shapes = set()

    def record(self, metrics: dict, dt: float, columns: int) -> dict:
        tokens, anchors = int(metrics["tokens"]), int(metrics["anchors"])
        compiled = columns not in self.shapes
        self.shapes.add(columns)
        if not compiled:
            self.timed, self.tokens, self.anchors = self.timed + 1, self.tokens + tokens, self.anchors + anchors
            self.seconds += dt
        elif self.first is None:
            self.first = dt  # the first step, compilation included
        return {
            "step": metrics["step"],
            "loss": float(metrics["loss"]),
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

    def summary(self) -> dict:
        t = self.seconds
        return {
            "compile_step_s": self.first,
            "tokens_per_s": self.tokens / t if t else None,
            "anchors_per_s": self.anchors / t if t else None,
            "step_s": t / self.timed if self.timed else None,
        }


def open_trainer(cfg, *, devices=None, target=None, records=None, restore=True, lock=None, hooks=None) -> Trainer:
    """A Trainer over the run `cfg` describes: the run directory locked (process 0; unless the caller holds `lock`,
    which stays the caller's), staged (a URI run's files pulled first), its world built (`build_run`: target, or the
    `target` module given; data, or the TokenizedRecords `records` given) and handed over. A lock taken here is the
    Trainer's: released when `train` ends, and taken again by a later `train`."""
    own = lock is None
    if own and jax.process_index() == 0:
        lock = open_run_dir(cfg.run_dir, checkpoint_dir=cfg.checkpoint.dir)
    try:
        run = build_run(cfg, stage_run_dir(cfg), devices=devices, target=target, records=records)
        return Trainer(run, restore=restore, lock=lock, own_lock=own, hooks=hooks)
    except BaseException:
        if own and lock is not None:
            lock.release()
        raise
