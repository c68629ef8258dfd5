"""The DFlash trainer: a pure jitted step over explicit state, a frozen target passed as a jit argument, and Orbax
checkpoints (drafter params + optimizer state + step + grain iterator state) that resume bit for bit.

State flow per step: state = {params (drafter nnx.State), opt (optax), step} is donated to `step_fn` and returned
updated; the target's state is a separate, never-donated argument wrapped in stop_gradient, so it is neither a
compile-time constant (jit would bake billions of weights into the executable) nor differentiated.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import signal
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from dflash_model import sharding as shd
from dflash_model.drafter import build_drafter, check_pairing, drafter_config_for, drafter_preset, scale_output_norm
from dflash_model.files import RunLock, atomic_write_text
from dflash_model.target import config_of, final_norm, forward
from train.config import Config
from train.data import build_train_dataset
from train.objective import default_gamma, dflash_loss, target_labels

log = logging.getLogger("dflash.train")


class TrainingDiverged(RuntimeError):
    """The loss became NaN/inf; the run stopped without saving the bad state."""


# ----------------------------------------------------------------------------------------------------------
# Building blocks (each callable alone from tests).


def load_target_model(cfg, mesh=None):
    """(target module, tokenizer path or None) for cfg.target: real weights from a path, or a random preset."""
    from dflash_model.config import preset
    from dflash_model.target import build_target, randomize

    t = cfg.target
    if t.path is not None:
        from dflash_model.weights import load_target

        path = t.path
        if isinstance(path, str) and path.startswith("asset:"):
            from data import assets

            path = assets.path(path.split(":", 1)[1])
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
    return dcfg


def init_weights(drafter, dcfg, init_dir, target_cfg) -> None:
    """Overwrite `drafter`'s parameters (in place) with a z-lab drafter directory's, cast to fp32.

    The directory's architecture must equal `dcfg` but for block_size (the weights do not depend on K) and dtype;
    a difference is an error naming drafter.init and the fields.
    """
    from dflash_model.drafter_weights import load_drafter

    icfg, loaded = load_drafter(init_dir, target_cfg, dtype="float32")
    icfg = icfg.replace(block_size=dcfg.block_size)
    if icfg != dcfg:
        diff = {
            f.name: (getattr(icfg, f.name), getattr(dcfg, f.name))
            for f in dataclasses.fields(dcfg)
            if getattr(icfg, f.name) != getattr(dcfg, f.name)
        }
        raise ValueError(
            f"drafter.init={init_dir}: its architecture differs from the config's (field: (checkpoint, config)): {diff}"
        )
    nnx.update(drafter, nnx.state(loaded, nnx.Param))


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


def make_optimizer(t, total_steps: int):
    """(AdamW + warmup-cosine + global-norm clipping, the schedule) from cfg.train's keys. Norm scales and other
    1-D params do not decay."""
    t = Config(t)
    warmup = int(round(float(t.warmup_ratio) * total_steps))
    if t.schedule == "cosine":
        sched = optax.warmup_cosine_decay_schedule(
            0.0,
            float(t.lr),
            max(warmup, 1) if warmup else 0,
            max(total_steps, warmup + 1),
            float(t.lr) * float(t.final_lr_ratio),
        )
    else:
        sched = optax.join_schedules(
            [optax.linear_schedule(0.0, float(t.lr), max(warmup, 1)), optax.constant_schedule(float(t.lr))], [warmup]
        )
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
    tx = optax.chain(
        optax.clip_by_global_norm(float(t.grad_clip)),
        optax.adamw(sched, b1=float(t.b1), b2=float(t.b2), weight_decay=float(t.weight_decay), mask=decay_mask),
    )
    return tx, sched


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


def _tree_where(ok, new, old):
    return jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)


BATCH_KEYS = ("input_ids", "loss_mask", "lengths", "anchors", "features", "labels")

# Optimizer keys of cfg.train that the compiled step depends on.
OPT_KEYS = ("lr", "warmup_ratio", "schedule", "final_lr_ratio", "weight_decay", "b1", "b2", "grad_clip")


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
    """Everything static about a training step, hashable: Trainers built from the same config share one
    compiled step (a restart inside a process, tests) instead of compiling their own closure."""

    d_graph: Any
    t_graph: Any
    block_size: int
    gamma: float
    ce_chunk: int
    loss_positions: int | None
    distill_weight: float
    layer_ids: tuple
    zero_features: bool  # ablation (features.zero): how much of the drafter's skill comes from the target
    target_labels: bool  # data.labels=target: labels are the target's greedy next tokens, not the text's
    compute_dtype: str  # train.compute_dtype: the drafter's activations and matmuls (parameters stay fp32)
    opt: tuple
    total_steps: int
    mesh_key: tuple  # the sharding constraint below is only valid on the mesh it was made for
    state_shardings: Any = dataclasses.field(compare=False, hash=False)

    def _key(self):
        # Tunix's graph holds its unhashable ModelConfig; the graphs' reprs identify the structure instead.
        if "_k" not in self.__dict__:
            graphs = (repr(self.d_graph), repr(self.t_graph))
            rest = tuple(
                getattr(self, f.name)
                for f in dataclasses.fields(self)
                if f.name not in ("d_graph", "t_graph", "state_shardings")
            )
            object.__setattr__(self, "_k", (graphs, rest))
        return self.__dict__["_k"]

    def __hash__(self):
        return hash(self._key())

    def __eq__(self, other):
        return isinstance(other, Program) and self._key() == other._key()

    def optimizer(self):
        return make_optimizer(dict(self.opt), self.total_steps)


def _loss(prog: Program, params, t_state, batch, step, nan_at, vocab_ids=None):
    target = nnx.merge(prog.t_graph, jax.lax.stop_gradient(t_state))
    drafter = nnx.merge(prog.d_graph, params)
    teacher, labels = None, batch.get("labels")
    if "features" in batch:
        features = batch["features"]
    else:
        # With distillation the forward also keeps the last layer: final-normed, it is the hidden state the
        # target's own next-token distribution comes from (the teacher), at no cost beyond this forward.
        last = (config_of(target).num_hidden_layers - 1,) if prog.distill_weight else ()
        out = forward(target, batch["input_ids"], layer_ids=(*prog.layer_ids, *last), compute_logits=prog.target_labels)
        features = out.features
        if prog.target_labels:
            labels = target_labels(batch["input_ids"], out.logits)
        if last:
            d = features.shape[-1] // (len(prog.layer_ids) + 1)
            features, teacher = features[..., :-d], final_norm(target, features[..., -d:])
    if prog.zero_features:
        features = jnp.zeros_like(features)
    loss, metrics = dflash_loss(
        drafter,
        target,
        jax.lax.stop_gradient(features),
        batch["input_ids"],
        batch["loss_mask"],
        batch["anchors"],
        block_size=prog.block_size,
        gamma=prog.gamma,
        ce_chunk=prog.ce_chunk,
        loss_positions=prog.loss_positions,
        teacher_BTD=teacher,
        soft_weight=prog.distill_weight,
        labels_BT=jax.lax.stop_gradient(labels) if labels is not None else None,
        vocab_ids_U=vocab_ids,
        compute_dtype=jnp.dtype(prog.compute_dtype),
    )
    # debug.nan_at_step as a runtime value (-1 = off), so the knob does not change the compiled program.
    loss = jnp.where(step + 1 == nan_at, jnp.nan, loss)
    return loss, {**metrics, "loss": loss}


@functools.partial(jax.jit, static_argnames=("prog",), donate_argnums=(0,))
def train_step(state, t_state, batch, nan_at, vocab_ids=None, *, prog: Program):
    tx, schedule = prog.optimizer()
    grad_fn = jax.value_and_grad(_loss, argnums=1, has_aux=True)
    (loss, metrics), grads = grad_fn(prog, state["params"], t_state, batch, state["step"], nan_at, vocab_ids)
    updates, opt = tx.update(grads, state["opt"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    # A non-finite step changes nothing: the host stops the run and both the in-memory state and the
    # checkpoints stay the last good ones.
    ok = jnp.isfinite(loss)
    new = {
        "params": _tree_where(ok, params, state["params"]),
        "opt": _tree_where(ok, opt, state["opt"]),
        "step": state["step"] + ok.astype(jnp.int32),
    }
    # Outputs pinned to the input layout: the next call sees identical avals and does not recompile.
    new = jax.lax.with_sharding_constraint(new, prog.state_shardings)
    # Counted here, on the global batch: a process's host batch is only its share under jax.distributed.
    metrics = {
        **metrics,
        "grad_norm": optax.global_norm(grads),
        "lr": schedule(state["step"]),
        "tokens": jnp.sum(batch["lengths"]),
        "anchors": jnp.sum(batch["anchors"] >= 0),
    }
    return new, metrics


# ----------------------------------------------------------------------------------------------------------
# The trainer.


class Trainer:
    """Build everything from a Config, restore the newest readable checkpoint, then `train()`."""

    def __init__(self, cfg, *, devices=None, target=None, restore: bool = True):
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
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
        self.block_size = int(cfg.block_size)
        self.gamma = float(cfg.gamma) if cfg.gamma is not None else default_gamma(self.block_size)
        self.loss_positions = None if cfg.loss_positions is None else int(cfg.loss_positions)
        if self.loss_positions is not None and self.loss_positions < 1:
            raise ValueError(f"loss_positions={self.loss_positions}: must be >= 1 (or null for all K-1 slots)")
        self.distill_weight = float(cfg.distill_weight)
        if not 0.0 <= self.distill_weight <= 1.0:
            raise ValueError(f"distill_weight={self.distill_weight}: must be in [0, 1]")
        if self.distill_weight and cfg.features.mode != "online":
            raise ValueError(
                f"distill_weight={self.distill_weight} needs features.mode=online (the teacher is the "
                f"target's last layer, computed in the step), not {cfg.features.mode!r}"
            )

        shd.shard_model(self.target, self.mesh)
        drafter = build_drafter(self.drafter_cfg, seed=int(cfg.seed))
        if cfg.drafter.init is not None:
            if cfg.drafter.init_logit_std is not None:
                raise ValueError(
                    "drafter.init and drafter.init_logit_std both set: a loaded drafter keeps its own output norm"
                )
            init_weights(drafter, self.drafter_cfg, cfg.drafter.init, self.target_cfg)
        elif cfg.drafter.init_logit_std is not None:
            drafter = scale_output_norm(drafter, self.target, float(cfg.drafter.init_logit_std))
        drafter = shd.shard_model(drafter, self.mesh)
        self.d_graph, params = nnx.split(drafter)
        self.t_graph, self.t_state = nnx.split(self.target)

        tokenizer = None
        if cfg.data.source == "regenerate":
            raise ValueError(
                "data.source=regenerate is resolved by train/run.py (train.workflow.prepare_regenerated "
                "writes the JSONL); give the Trainer that JSONL's path as data.source"
            )
        if cfg.data.source != "synthetic":
            from dflash_model.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(cfg.data.tokenizer or self.tokenizer_path)
        self.dataset, self.batches_per_epoch, records = build_train_dataset(
            cfg,
            vocab_size=self.target_cfg.vocab_size,
            mask_token_id=self.drafter_cfg.mask_token_id,
            tokenizer=tokenizer,
        )
        check_token_ids(records, self.target_cfg.vocab_size, cfg)
        self.target_labels = cfg.data.labels == "target"
        self.features = self.labels = None
        if cfg.features.mode == "offline":
            from train.features import open_or_build

            self.features, self.labels = open_or_build(
                self, records, chunk=int(cfg.train.batch_size) // jax.process_count()
            )
        self.vocab_ids = None
        if cfg.draft_vocab is not None:
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
        opt = jax.tree.map(lambda x: jnp.array(x, copy=True), jax.jit(self.tx.init)(params))
        self.state = self._place({"params": params, "opt": opt, "step": jnp.zeros((), jnp.int32)})
        self.iterator = iter(self.dataset)
        self._stop_signal = None

        ck = cfg.checkpoint
        self.ckpt_dir = Path(ck.dir) if ck.dir is not None else self.run_dir / "checkpoints"
        self.ckpt = ocp.CheckpointManager(
            self.ckpt_dir.resolve(),
            item_names=("state", "data", "meta"),
            options=ocp.CheckpointManagerOptions(
                max_to_keep=ck.max_to_keep, enable_async_checkpointing=bool(ck["async"]), create=True
            ),
        )
        self.restored_step = self.restore() if restore else None
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self._trim_metrics(self.step)

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
        """Load the newest checkpoint that reads back whole; warn and fall back past damaged ones.

        A checkpoint written under another drafter architecture or objective is refused by name before anything is
        read (it is not damaged: the config changed, and falling back past it would start over on top of the run).
        A damaged checkpoint is moved to <checkpoints>/damaged/ so that its step can be saved again.
        """
        self._check_newest_meta()
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, self.state)
        damaged = []
        try:
            for step in sorted(self.ckpt.all_steps(), reverse=True):
                try:
                    got = self.ckpt.restore(
                        step,
                        args=ocp.args.Composite(
                            state=ocp.args.StandardRestore(abstract),
                            data=ocp.args.JsonRestore(),
                            meta=ocp.args.JsonRestore(),
                        ),
                    )
                    if int(got.state["step"]) != step:
                        raise ValueError(f"holds step {int(got.state['step'])}")
                except Exception as e:  # noqa: BLE001 - any unreadable checkpoint means: try the previous one
                    msg = (
                        f"checkpoint step {step} in {self.ckpt_dir} is unreadable ({type(e).__name__}: {e}); "
                        "falling back to the previous checkpoint"
                    )
                    warnings.warn(msg, stacklevel=2)
                    log.warning(msg)
                    damaged.append(step)
                    continue
                self._check_meta(got.meta, step)
                self.state = self._place(got.state)
                self.iterator.set_state(got.data)
                log.info("resumed from step %d (%s)", step, self.ckpt_dir)
                return step
            return None
        finally:
            self._set_aside(damaged)

    def _set_aside(self, steps) -> None:
        """Move damaged checkpoints out of the manager's directory (kept for a post-mortem, never deleted)."""
        if not steps or jax.process_index() != 0:
            return
        aside = self.ckpt_dir / "damaged"
        aside.mkdir(exist_ok=True)
        for step in steps:
            src = self.ckpt_dir / str(step)
            if src.exists():
                dst = aside / f"{step}-{time.strftime('%Y%m%d-%H%M%S')}"
                src.rename(dst)
                log.warning("moved the unreadable checkpoint step %d to %s", step, dst)
        self.ckpt.reload()

    def _meta(self) -> dict:
        """What a checkpoint must agree on to be resumed: the objective and the drafter architecture."""
        arch = self.drafter_cfg.to_zlab_config()
        return {
            "block_size": self.block_size,
            "gamma": self.gamma,
            "total_steps": self.total_steps,
            "drafter": {k: v for k, v in arch.items() if k not in ("block_size", "torch_dtype", "dtype")},
        }

    def _check_newest_meta(self) -> None:
        for step in sorted(self.ckpt.all_steps(), reverse=True):
            try:
                meta = self.ckpt.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
            except Exception:  # noqa: BLE001 - a damaged checkpoint is the restore loop's business
                continue
            self._check_meta(meta, step)
            return

    def _check_meta(self, meta: dict, step: int) -> None:
        """A checkpoint resumes only the objective and drafter it was trained with: the drafter shapes would load
        at another K (the block size is not a parameter shape), so a changed block_size or gamma is refused by
        name, and so is a changed drafter (its parameter shapes would not load). A changed train.steps resumes,
        saying what it does to the learning-rate schedule."""
        mine = self._meta()
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
                f"checkpoint step {step} in {self.ckpt_dir}: {said}. Use a new run_dir (or "
                f"checkpoint.dir) for a different objective or drafter, or set them back to resume"
            )
        old_total = meta.get("total_steps")
        if old_total is not None and int(old_total) != self.total_steps:
            old_lr = float(make_optimizer(self.cfg.train, int(old_total))[1](step))
            new_lr = float(self.schedule(step))
            log.warning(
                "train.steps is %d now, %d when step %d was saved: the learning-rate schedule is "
                "recomputed over %d steps, so the rate at step %d moves from %.3g to %.3g",
                self.total_steps,
                int(old_total),
                step,
                self.total_steps,
                step,
                old_lr,
                new_lr,
            )

    def save(self, force: bool = False) -> None:
        step = self.step
        if step in self.ckpt.all_steps():
            return
        meta = {"step": step, **self._meta(), "time": time.time()}
        self.ckpt.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(self.state),
                data=ocp.args.JsonSave(self.iterator.get_state()),
                meta=ocp.args.JsonSave(meta),
            ),
            force=force,
        )

    def _trim_metrics(self, step: int) -> None:
        """Drop log lines of steps past the restored state (a killed run logged them; they will be redone) and a
        torn last line (a kill mid-write). The file is replaced whole (temporary file + rename), never cut in place."""
        if not self.metrics_path.exists() or jax.process_index() != 0:
            return
        lines = self.metrics_path.read_text().splitlines()
        keep = []
        for i, ln in enumerate(lines):
            try:
                rec = json.loads(ln)
            except json.JSONDecodeError:
                if i == len(lines) - 1:
                    log.warning("%s: dropped a torn last line (%d characters)", self.metrics_path, len(ln))
                    continue
                raise ValueError(
                    f"{self.metrics_path}:{i + 1}: not a JSON record (only a torn last line is expected after a crash)"
                ) from None
            if rec["step"] <= step:
                keep.append(ln)
        if len(keep) != len(lines):
            atomic_write_text(self.metrics_path, "".join(ln + "\n" for ln in keep))

    # -- the step ------------------------------------------------------------------------------------------

    def program(self) -> Program:
        t = self.cfg.train
        return Program(
            d_graph=self.d_graph,
            t_graph=self.t_graph,
            block_size=self.block_size,
            gamma=self.gamma,
            ce_chunk=int(self.cfg.ce_chunk),
            loss_positions=self.loss_positions,
            distill_weight=self.distill_weight,
            layer_ids=tuple(self.drafter_cfg.target_layer_ids),
            zero_features=bool(self.cfg.features.zero),
            target_labels=self.target_labels and self.features is None,
            compute_dtype=str(self.cfg.train.compute_dtype),
            opt=tuple((k, t[k]) for k in OPT_KEYS),
            total_steps=self.total_steps,
            mesh_key=(tuple(self.mesh.shape.items()), tuple(d.id for d in self.mesh.devices.flat)),
            state_shardings=jax.tree.map(lambda x: x.sharding, self.state),
        )

    def loss_fn(self, params, t_state, batch, nan_at=-1):
        return _loss(self.program(), params, t_state, batch, jnp.zeros((), jnp.int32), nan_at, self.vocab_ids)

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
            jax.value_and_grad(lambda p, t, b: _loss(prog, p, t, b, jnp.zeros((), jnp.int32), -1, self.vocab_ids)[0])
        )
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
        SIGINT and at the end. Returns a summary with throughput."""
        cfg = self.cfg
        end = self.total_steps if max_steps is None else min(self.total_steps, self.step + max_steps)
        prog = self.program()
        nan_at = jnp.asarray(-1 if cfg.debug.nan_at_step is None else int(cfg.debug.nan_at_step), jnp.int32)
        lock = RunLock(self.run_dir) if jax.process_index() == 0 else None
        old_handlers = self._install_signals()
        tb = self._tensorboard()
        every = int(cfg.checkpoint.every_steps)
        timed, t_tokens, t_anchors, t_time, first_time = 0, 0, 0, 0.0, None
        stopped = None
        try:
            while self.step < end:
                batch = self.next_batch()
                t0 = time.perf_counter()
                self.state, metrics = train_step(self.state, self.t_state, batch, nan_at, self.vocab_ids, prog=prog)
                metrics = jax.device_get(metrics)  # one host sync per step: the NaN stop and the log need it
                dt = time.perf_counter() - t0
                step = int(self.state["step"])
                loss = float(metrics["loss"])
                if not math.isfinite(loss):
                    self.ckpt.wait_until_finished()
                    last = self.ckpt.latest_step()
                    raise TrainingDiverged(
                        f"loss is {loss} at step {step + 1}; stopped without saving that step. Last good "
                        f"checkpoint: step {last} in {self.ckpt_dir}"
                        if last is not None
                        else f"loss is {loss} at step {step + 1}; stopped; no checkpoint had been written yet"
                    )
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
            self.ckpt.wait_until_finished()
            if lock is not None:
                lock.release()
            for s, h in old_handlers.items():
                signal.signal(s, h)
            if tb is not None:
                tb.close()
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
        """The z-lab format drafter at <run_dir>/export/. With several processes every one must call this (the
        parameters are gathered across them); process 0 writes and gets the path, the others None."""
        from dflash_model.drafter_weights import export_drafter

        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            params = multihost_utils.process_allgather(self.state["params"], tiled=True)  # host numpy, whole
            if jax.process_index() != 0:
                return None
            drafter = nnx.merge(self.d_graph, params)
        else:
            drafter = self.drafter()
        return export_drafter(drafter, drafter.config, self.run_dir / "export", dtype=self.cfg.export.dtype)

    def _tensorboard(self):
        if not bool(self.cfg.log.tensorboard) or jax.process_index() != 0:
            return None
        from tensorboardX import (
            SummaryWriter,
        )  # a dependency; imported here so a run with log.tensorboard=false skips it

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
