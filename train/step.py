"""The training step: the DFlash loss of one batch (the target's features computed in the step or given), its
gradient and one AdamW update, jitted over explicit state. `Trainer` (train/trainer.py) builds a `Program` and
calls `train_step` once per batch; nothing here touches files, data loaders or the host loop.

State flow: state = {params (drafter nnx.State), opt (optax), step} is donated to `train_step` and returned
updated; the target's state is a separate, never-donated argument wrapped in stop_gradient, so it is neither a
compile-time constant (jit would bake billions of weights into the executable) nor differentiated.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from dflash_model.target import config_of, final_norm, forward
from train.objective import dflash_loss, gamma_of, target_labels


def make_optimizer(t, total_steps: int):
    """(AdamW + warmup-cosine + global-norm clipping, the schedule) from cfg.train's keys. Norm scales and other
    1-D params do not decay. `t`: cfg.train, or a mapping of its OPT_KEYS (a Program's frozen copy)."""
    t = SimpleNamespace(**{k: t[k] if isinstance(t, Mapping) else getattr(t, k) for k in OPT_KEYS})
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
    ratios = dict(t.lr_ratio or {})
    if ratios:  # only then: a run without it keeps the optimizer state layout of earlier checkpoints
        tx = optax.chain(tx, _scale_by_name(ratios))
    return tx, sched


def param_name(path) -> str:
    """A drafter parameter's dotted name from its pytree path: `layers.1.self_attn.o_proj`."""
    parts = []
    for key in path:
        part = getattr(key, "key", getattr(key, "idx", getattr(key, "name", key)))
        if part not in ("value", "raw_value"):
            parts.append(str(part))
    return ".".join(parts)


def lr_ratio_of(name: str, ratios: dict) -> float:
    """The lr multiplier of parameter `name`: the ratio of the first key of `ratios` that occurs in it, else 1."""
    return next((float(r) for pattern, r in ratios.items() if pattern in name), 1.0)


def _scale_by_name(ratios: dict) -> optax.GradientTransformation:
    """Multiply each parameter's update (AdamW's, so its lr and its weight decay) by lr_ratio_of its name:
    per-parameter learning rates without a second optimizer state."""

    def update(updates, state, params=None):
        del params
        scale = lambda path, u: u * lr_ratio_of(param_name(path), ratios)
        return jax.tree_util.tree_map_with_path(scale, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def optimizer_shardings(tx, params, mesh):
    """Shardings of tx's state over `params` (arrays or ShapeDtypeStructs carrying shardings): every copy of the
    parameter tree in it (Adam's mu and nu) sharded like the parameters, the rest (step counts) replicated.
    Without this, jit lays out tx.init's zeros as it likes, and on a pod it replicated Adam's state: twice the
    drafter's whole fp32 size on every device."""
    rep = NamedSharding(mesh, PartitionSpec())
    return optax.tree_map_params(
        tx,
        lambda _, sharding: sharding,
        jax.eval_shape(tx.init, params),
        jax.tree.map(lambda p: p.sharding, params),
        transform_non_params=lambda _: rep,
    )


def _tree_where(ok, new, old):
    return jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)


BATCH_KEYS = ("input_ids", "loss_mask", "lengths", "anchors", "features", "labels")

# Optimizer keys of cfg.train that the compiled step depends on.
OPT_KEYS = ("lr", "warmup_ratio", "schedule", "final_lr_ratio", "weight_decay", "b1", "b2", "grad_clip", "lr_ratio")


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
    attention: str  # target.attention: the target forward's causal attention (einsum, xla, cudnn)
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

    @classmethod
    def for_config(cls, cfg, *, d_graph, t_graph, layer_ids, total_steps, mesh, state, target_labels) -> Program:
        """The step `cfg` asks for (block, loss and optimizer keys) over these graphs, on `mesh`, for a state
        laid out like `state` (arrays or ShapeDtypeStructs). target_labels: the step labels the data with the
        target's own forward (data.labels=target with online features)."""
        block = cfg.block_size
        return cls(
            d_graph=d_graph,
            t_graph=t_graph,
            block_size=block,
            gamma=gamma_of(cfg),
            ce_chunk=cfg.ce_chunk,
            loss_positions=cfg.loss_positions,
            distill_weight=cfg.distill_weight,
            layer_ids=tuple(layer_ids),
            zero_features=cfg.features.zero,
            target_labels=bool(target_labels),
            compute_dtype=cfg.train.compute_dtype,
            attention=cfg.target.attention,
            # lr_ratio is a dict: frozen to pairs so the Program stays hashable (make_optimizer reads either)
            opt=tuple(
                (k, tuple(v.items()) if isinstance(v, dict) else v)
                for k, v in ((k, getattr(cfg.train, k)) for k in OPT_KEYS)
            ),
            total_steps=int(total_steps),
            mesh_key=(tuple(mesh.shape.items()), tuple(d.id for d in mesh.devices.flat)),
            state_shardings=jax.tree.map(lambda x: x.sharding, state),
        )


def step_loss(prog: Program, params, t_state, batch, step, nan_at, vocab_ids=None):
    target = nnx.merge(prog.t_graph, jax.lax.stop_gradient(t_state))
    drafter = nnx.merge(prog.d_graph, params)
    teacher, labels = None, batch.get("labels")
    if "features" in batch:
        features = batch["features"]
    else:
        # With distillation the forward also keeps the last layer: final-normed, it is the hidden state the
        # target's own next-token distribution comes from (the teacher), at no cost beyond this forward.
        last = (config_of(target).num_hidden_layers - 1,) if prog.distill_weight else ()
        out = forward(
            target,
            batch["input_ids"],
            layer_ids=(*prog.layer_ids, *last),
            compute_logits=prog.target_labels,
            attention=prog.attention,
        )
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
    grad_fn = jax.value_and_grad(step_loss, argnums=1, has_aux=True)
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
