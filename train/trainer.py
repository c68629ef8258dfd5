"""The DFlash trainer: builds the drafter, data, optimizer state and `Program` from a Config, runs the loop
(`train`: one `train.step.train_step` per batch, metrics, signals, export), and resumes bit for bit from Orbax
checkpoints (`train.checkpointing`: drafter params + optimizer state + step + grain iterator state).
"""

from __future__ import annotations

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

from data import assets
from dflash_model import sharding as shd
from dflash_model.config import preset
from dflash_model.drafter import (
    check_pairing,
    drafter_config_for,
    drafter_preset,
)
from dflash_model.drafter_weights import (
    export_config,
    export_drafter,
    zlab_config,
)
from dflash_model.files import local_dir, open_run_dir, pull, push, run_path
from dflash_model.speculators_format import VERIFIER_ARCHITECTURES
from dflash_model.target import build_target, config_of, forward, is_maxtext, randomize
from dflash_model.tokenizer import load_tokenizer
from dflash_model.weights import load_target
from train.batches import build_train_dataset
from train.checkpointing import Checkpoints, trim_metrics
from train.features import open_or_build
from train.objective import gamma_of
from train.starts import init_draft_vocab, start_drafter
from train.step import BATCH_KEYS, Program, make_optimizer, optimizer_shardings, step_loss, train_step

log = logging.getLogger("dflash.train")


class TrainingDiverged(RuntimeError):
    """The loss became NaN/inf; the run stopped without saving the bad state."""


# ----------------------------------------------------------------------------------------------------------
# Building blocks (each callable alone from tests).


def target_path(path):
    """cfg.target.path as a local file or directory: an `asset:NAME` resolved to the cached asset (fetched the first
    time), anything else as given."""
    if isinstance(path, str) and path.startswith("asset:"):
        return assets.path(path.split(":", 1)[1])
    return path


def load_target_model(cfg, mesh=None):
    """(target module, tokenizer path or None) for cfg.target: real weights from a path, or a random preset."""
    t = cfg.target
    if t.maxtext is not None:
        if t.path is None:
            raise ValueError(
                "target.maxtext needs target.path: the HF directory whose config.json and tokenizer it has"
            )
        from dflash_model.maxtext_target import load_maxtext_target  # the optional maxtext extra

        model = load_maxtext_target(t.path, t.maxtext, dtype=t.dtype, mesh=mesh, max_length=int(cfg.train.max_len))
        return model, Path(t.path)
    if t.path is not None:
        path = target_path(t.path)
        _, model = load_target(path, dtype=t.dtype, mesh=mesh)  # sharded as it loads: no single-device copy
        return model, Path(path)
    tcfg = preset(t.preset).replace(**dict(t.arch), dtype=t.dtype)
    # Random targets are for shapes, throughput and tests. Built abstract (Tunix's initialisers would compile a
    # few dozen jitted functions only to be overwritten), then filled by randomize(), which also avoids the
    # all-zero MLPs Tunix starts from.
    model = nnx.eval_shape(lambda: build_target(tcfg, seed=int(cfg.seed)))
    return randomize(model, seed=int(cfg.seed)), None


def drafter_config(cfg, target_cfg):
    """The drafter architecture for cfg (preset or shaped like the target), at cfg.block_size, fp32 master weights."""
    d = cfg.drafter
    if d.preset is not None:
        dcfg = drafter_preset(d.preset)
    else:
        if d.mask_token_id is None:
            raise ValueError("drafter.mask_token_id is required when drafter.preset is null")
        ids = tuple(d.target_layer_ids) if d.target_layer_ids is not None else None
        dcfg = drafter_config_for(
            target_cfg,
            mask_token_id=int(d.mask_token_id),
            num_layers=int(d.num_layers),
            n_features=int(d.n_features),
            intermediate_size=d.intermediate_size,
            target_layer_ids=ids,
        )
    if d.layer_types is not None:
        # DrafterConfig checks the names and that there is one per layer, naming the key.
        window = int(d.sliding_window) if d.sliding_window is not None else None
        dcfg = dcfg.replace(layer_types=tuple(d.layer_types), sliding_window=window)
    elif d.sliding_window is not None:
        raise ValueError(
            f"drafter.sliding_window={d.sliding_window} needs drafter.layer_types with a sliding_attention layer"
        )
    # AdamW on bf16 weights loses small updates; the drafter trains in fp32 and is cast at export.
    dcfg = dcfg.replace(block_size=int(cfg.block_size), dtype="float32")
    check_pairing(dcfg, target_cfg, source=f"drafter ({d.preset or 'from config'})")
    if cfg.export.enabled:  # a format that cannot carry this drafter stops the run now, not after training
        for fmt, _ in EXPORT_LAYOUT[cfg.export.format]:
            export_config(dcfg, fmt, export_verifier(cfg, target_cfg))
    return dcfg


# export.format: (format, directory under run_dir) of each export; the first is the one the summary and eval read.
EXPORT_LAYOUT = {
    "zlab": (("zlab", "export"),),
    "speculators": (("speculators", "export"),),
    "both": (("zlab", "export"), ("speculators", "export-speculators")),
}


def export_verifier(cfg, target_cfg) -> dict:
    """speculators_config.verifier of a speculators export: export.verifier, else target.path as written (null for
    a random preset target), and the HF class of the target's family."""
    name = cfg.export.verifier if cfg.export.verifier is not None else cfg.target.path
    arch = VERIFIER_ARCHITECTURES.get(target_cfg.family)
    return {"name_or_path": None if name is None else str(name), "architectures": [arch] if arch else []}


def check_token_ids(records, vocab_size: int, cfg) -> None:
    """Refuse data whose token ids the target cannot embed (a tokenizer larger than the target's vocabulary):
    an out-of-range id embeds as NaN, and the run would die at step 1 with a loss of nan, naming nothing."""
    arrays = getattr(records, "arrays", None)
    if arrays is None or not len(arrays[0]):
        return  # synthetic records draw their ids below vocab_size
    top = int(np.max(arrays[0]))
    if top >= vocab_size or int(np.min(arrays[0])) < 0:
        raise ValueError(
            f"data.source={cfg.data.source}: token id {top} from tokenizer "
            f"{cfg.data.tokenizer or cfg.target.path} is outside the target's vocabulary "
            f"0..{vocab_size - 1}; the tokenizer does not belong to this target"
        )


def draft_vocabulary(records, vocab_size: int, size: int) -> np.ndarray:
    """The `size` most frequent loss-mask tokens of the training records, most frequent first (ties by id):
    the draft vocabulary of a reduced-vocabulary training loss (FR-Spec). Unseen tokens fill the tail in id order
    when the data has fewer distinct ones."""
    if not 1 <= size <= vocab_size:
        raise ValueError(f"draft_vocab={size}: must be in 1..{vocab_size} (the target's vocabulary), or null")
    counts = np.zeros(vocab_size, np.int64)
    for i in range(len(records)):
        r = records[i]
        ids = np.asarray(r["input_ids"])
        ids = ids[np.asarray(r["loss_mask"], bool)[: ids.size]]
        counts += np.bincount(ids[(ids >= 0) & (ids < vocab_size)], minlength=vocab_size)
    return np.argsort(-counts, kind="stable")[:size].astype(np.int32)


def check_eval_lengths(cfg, positions: int) -> None:
    """The end-of-run eval's longest prompt, its new tokens and its widest verify must fit the target's positions:
    found when the target is known, not after training."""
    e = cfg.eval
    if not bool(e.enabled):
        return
    width = max(int(e.block if e.block is not None else cfg.block_size), int(e.ngram_block))
    need = int(e.max_prompt_tokens) + int(e.max_new_tokens) + width
    if need > positions:
        raise ValueError(
            f"eval.max_prompt_tokens={e.max_prompt_tokens} + eval.max_new_tokens={e.max_new_tokens} + a verify of "
            f"{width} = {need} positions, more than the target's max_position_embeddings={positions}"
        )


def resolve_mesh(cfg, devices=None):
    devices = list(jax.devices() if devices is None else devices)
    m = {k: int(cfg.mesh[k]) for k in ("data", "fsdp", "tensor")}
    free = [k for k, v in m.items() if v == -1]
    if len(free) > 1:
        raise ValueError(f"mesh {m}: at most one axis may be -1")
    fixed = math.prod(v for v in m.values() if v != -1)
    if free:
        m[free[0]] = len(devices) // fixed
    n = math.prod(m.values())
    if n > len(devices):
        raise ValueError(f"mesh {m} needs {n} devices; {len(devices)} available")
    return shd.make_mesh(m["data"], m["fsdp"], m["tensor"], devices=devices[:n])


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

    target: a target module to train against instead of the one cfg.target names; records: TokenizedRecords to
    train on instead of cfg.data's source (the batches, anchors and resumable iterator are the conversation path's).
    """

    def __init__(self, cfg, *, devices=None, target=None, records=None, restore: bool = True, lock=None):
        self.cfg = cfg
        # A URI run_dir (gs://bucket/run): checkpoints go there through Orbax, the other files through a local
        # staging directory that `push` mirrors to it (dflash_model.files).
        self.run_uri = str(cfg.run_dir)
        self.run_dir = local_dir(cfg.run_dir)
        # The run directory's lock (process 0) before anything in it is read or written: a second training there
        # is refused with every file as it was. A lock given by the caller (train/run.py, which takes it before
        # regenerating data) stays the caller's to release; one taken here is released when `train` ends.
        self._own_lock = lock is None
        self.lock = lock if lock is not None or jax.process_index() != 0 else open_run_dir(cfg.run_dir)
        try:
            self._setup(devices, target, records, restore)
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
            self.lock = open_run_dir(self.cfg.run_dir)

    def _setup(self, devices, target, records, restore: bool) -> None:
        cfg = self.cfg
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if jax.process_index() == 0:
            pull(self.run_uri)  # a fresh host resuming a URI run: its metrics.jsonl and config.yml come back first
        self.mesh = resolve_mesh(cfg, devices)
        n_batch = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
        if int(cfg.train.batch_size) % n_batch:
            raise ValueError(f"train.batch_size={cfg.train.batch_size} is not divisible by data x fsdp = {n_batch}")

        self.target, self.tokenizer_path = (target, None) if target is not None else load_target_model(cfg, self.mesh)
        self.target_cfg = config_of(self.target)
        self.drafter_cfg = drafter_config(cfg, self.target_cfg)
        positions = self.target_cfg.max_position_embeddings
        for key, value in (("block_size", int(cfg.block_size)), ("train.max_len", int(cfg.train.max_len))):
            if value > positions:
                raise ValueError(f"{key}={value} exceeds the target's max_position_embeddings={positions}")
        check_eval_lengths(cfg, positions)
        self.block_size = int(cfg.block_size)
        self.gamma = gamma_of(cfg)
        self.loss_positions, self.distill_weight = objective_options(cfg)

        if not is_maxtext(self.target):  # MaxText placed its parameters on the mesh as it loaded them
            shd.shard_model(self.target, self.mesh)

        tokenizer = None
        if records is None and cfg.data.source in ("regenerate", "mix"):
            raise ValueError(
                f"data.source={cfg.data.source} is resolved by train/run.py (train.workflow.prepare_regenerated "
                "or prepare_mix writes the JSONL); give the Trainer that JSONL's path as data.source"
            )
        if records is None and cfg.data.source != "synthetic":
            tokenizer = load_tokenizer(cfg.data.tokenizer or self.tokenizer_path)
        self.dataset, self.batches_per_epoch, records = build_train_dataset(
            cfg,
            vocab_size=self.target_cfg.vocab_size,
            mask_token_id=self.drafter_cfg.mask_token_id,
            tokenizer=tokenizer,
            records=records,
        )
        check_token_ids(records, self.target_cfg.vocab_size, cfg)
        drafter = shd.shard_model(start_drafter(cfg, self.drafter_cfg, self.target, records), self.mesh)
        self.d_graph, params = nnx.split(drafter)
        self.t_graph, self.t_state = nnx.split(self.target)
        self.target_labels = cfg.data.labels == "target"
        self.features = self.labels = None
        if cfg.features.mode == "offline":
            self.features, self.labels = open_or_build(
                self, records, chunk=int(cfg.train.batch_size) // jax.process_count()
            )
        self.vocab_ids = None
        if cfg.draft_vocab is not None:
            if cfg.drafter.init_vocab:
                ids = init_draft_vocab(cfg, self.target_cfg.vocab_size)
            else:
                ids = draft_vocabulary(records, self.target_cfg.vocab_size, int(cfg.draft_vocab))
            self.vocab_ids = jax.device_put(jnp.asarray(ids), NamedSharding(self.mesh, PartitionSpec()))
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
            asynchronous=bool(ck["async"]),
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

    def loss_fn(self, params, t_state, batch, nan_at=-1):
        return step_loss(self.program(), params, t_state, batch, jnp.zeros((), jnp.int32), nan_at, self.vocab_ids)

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
        if self.features is not None:
            host = {**host, "features": self.features[host["index"]]}
            if self.labels is not None:
                host["labels"] = self.labels[host["index"]]
        return self.put_batch(host)

    def grads(self, batch: dict):
        """(loss, grads) at the current params on a host batch: for sharding-equivalence checks."""
        prog = self.program()
        fn = jax.jit(
            jax.value_and_grad(
                lambda p, t, b: step_loss(prog, p, t, b, jnp.zeros((), jnp.int32), -1, self.vocab_ids)[0]
            )
        )
        with jax.set_mesh(self.mesh):
            return fn(self.state["params"], self.t_state, self.put_batch(batch))

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
                if first_time is None:
                    first_time = dt  # includes compilation
                else:
                    timed, t_tokens, t_anchors, t_time = timed + 1, t_tokens + tokens, t_anchors + anchors, t_time + dt
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

    def time_target_forward(self, host_batch: dict, repeats: int = 3) -> float:
        """Seconds of the target forward alone on one batch (for the share of step time it takes)."""
        fn = jax.jit(
            lambda t, ids: (
                forward(
                    nnx.merge(self.t_graph, t), ids, layer_ids=self.drafter_cfg.target_layer_ids, compute_logits=False
                ).features
            )
        )
        ids = self.put_batch({"input_ids": host_batch["input_ids"]})["input_ids"]
        fn(self.t_state, ids).block_until_ready()
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn(self.t_state, ids).block_until_ready()
        return (time.perf_counter() - t0) / repeats
