"""A dry run: will this config fit a pod, and what does a step cost? (`train/run.py --dry-run --pod v5p-128`)

Builds the configured target, drafter, optimizer state and the real jitted training step (`train.step.train_step`)
over abstract arrays (shapes, dtypes and shardings only: nothing is allocated or loaded; a target given as a
file is read for its architecture only, and an `asset:` one is fetched into the cache first if it is not there),
lays them on a mesh of the pod's size made of fake CPU devices, and compiles the step with XLA's SPMD partitioner.
It reports per device: the target's and the drafter's parameters, the optimizer state, the compiled step's
temporaries (activations, gradients, scratch), their sum against the chip's HBM, and the step's FLOPs.

What it is and is not: parameter and optimizer bytes follow from the shardings exactly; the temporaries and FLOPs
are what XLA's CPU compiler plans for the partitioned program, which fuses and schedules differently from the TPU
compiler. Read them as the size of the problem, not as a TPU measurement.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from data.assets import target_file
from dflash_model.config import preset
from dflash_model.drafter import Drafter
from dflash_model.sharding import batch_sharding, param_specs
from dflash_model.target import build_target
from dflash_model.weights import load_target_config
from train.assembly import drafter_config, resolve_mesh
from train.objective import loss_slots
from train.step import Program, make_optimizer, optimizer_shardings, train_step

GIB = 1 << 30

# HBM per JAX device (a chip: v4 and v5p TensorCore pairs form one megacore device) and TensorCores per chip,
# for turning a slice name (v5p-128 counts TensorCores; v5e / v6e count chips) into devices.
CHIPS = {
    "v4": (32 * GIB, 2),
    "v5p": (95 * GIB, 2),
    "v5e": (16 * GIB, 1),
    "v5litepod": (16 * GIB, 1),
    "v6e": (32 * GIB, 1),
}


@dataclasses.dataclass(frozen=True)
class Pod:
    name: str
    devices: int
    hbm_bytes: int | None  # per device; None for an explicit mesh of unknown chips


def parse_pod(spec: str) -> Pod:
    """'v5p-128' (a Cloud TPU slice name) or a device count with an HBM size, e.g. '64' or '64:95' (GiB)."""
    m = re.fullmatch(r"(v4|v5p|v5e|v5litepod|v6e)-(\d+)", spec)
    if m:
        hbm, cores_per_chip = CHIPS[m.group(1)]
        cores = int(m.group(2))
        if cores % cores_per_chip:
            raise ValueError(f"--pod {spec}: {m.group(1)} slices count {cores_per_chip} TensorCores a chip")
        return Pod(spec, cores // cores_per_chip, hbm)
    m = re.fullmatch(r"(\d+)(?::(\d+(?:\.\d+)?))?", spec)
    if m:
        hbm = int(float(m.group(2)) * GIB) if m.group(2) else None
        return Pod(f"{m.group(1)} devices", int(m.group(1)), hbm)
    raise ValueError(f"--pod {spec!r}: expected a slice name ({', '.join(CHIPS)} + '-<size>') or DEVICES[:HBM_GIB]")


def use_fake_devices(pod: Pod) -> None:
    """Make the CPU backend hold `pod.devices` devices. Must run before JAX initialises a backend (importing the
    modules above does not)."""
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", pod.devices)


def _abstract(module, mesh):
    """(graph, state of ShapeDtypeStructs carrying each parameter's NamedSharding on `mesh`)."""
    specs = param_specs(module, mesh)
    graph, state = nnx.split(module)
    flat = dict(nnx.to_flat_state(state))
    for path, var in flat.items():
        value = var.get_value()
        var.set_value(jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=NamedSharding(mesh, specs[path])))
    return graph, nnx.from_flat_state(flat)


def model_flops(
    tcfg,
    dcfg,
    *,
    batch: int,
    length: int,
    anchors: int,
    block: int,
    online: bool,
    labels: bool,
    vocab: int,
    labelled_slots: int | None = None,
) -> dict[str, float]:
    """Matmul FLOPs of one training step (the MFU convention: 2 per multiply-add, elementwise work left out),
    by part. As the code computes them: the target runs up to its deepest feature layer over the whole sequence
    (every layer and the lm_head when it labels the data); each block position scores every context position,
    masked or not; the cross-entropy runs the `labelled_slots` slots of a block (default K - 1: slot 0 is never a
    label) through `vocab` lm_head rows twice (logits, and the hidden state's gradient in its forward); the
    drafter's backward costs twice its forward."""
    tokens, positions = batch * length, batch * anchors * block

    def layer(cfg, rows, keys):
        d, q, g, h = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        proj = d * h * (2 * q + 2 * g) + 3 * d * cfg.intermediate_size
        return 2 * rows * proj + 4 * rows * keys * q * h

    target = 0.0
    if online:  # the forward stops at the deepest feature layer unless it must reach the logits
        depth = tcfg.num_hidden_layers if labels else max(dcfg.target_layer_ids) + 1
        target = depth * layer(tcfg, tokens, length)
        target += 2 * tokens * tcfg.hidden_size * tcfg.vocab_size if labels else 0.0
    d, g, h = dcfg.hidden_size, dcfg.num_key_value_heads, dcfg.head_dim
    context = 2 * tokens * dcfg.feature_size * d + dcfg.num_hidden_layers * 2 * tokens * d * 2 * g * h
    drafter_forward = context + dcfg.num_hidden_layers * layer(dcfg, positions, length + block)
    return {
        "target_forward": float(target),
        "drafter_forward_backward": 3.0 * drafter_forward,
        "cross_entropy": 4.0 * batch * anchors * (block - 1 if labelled_slots is None else labelled_slots) * d * vocab,
    }


def plan(cfg, pod: Pod) -> dict:
    """The dry run of `cfg` on `pod` (JAX must already hold pod.devices devices: `use_fake_devices`)."""
    if len(jax.devices()) < pod.devices:
        raise RuntimeError(f"{pod.name} needs {pod.devices} devices; JAX holds {len(jax.devices())}")
    mesh = resolve_mesh(cfg.mesh, jax.devices()[: pod.devices])
    t = cfg.target
    if t.path is not None:
        tcfg = load_target_config(target_file(t.path), dtype=t.dtype)
    else:
        tcfg = preset(t.preset).replace(**dict(t.arch), dtype=t.dtype)
    dcfg = drafter_config(cfg, tcfg)
    t_graph, t_state = _abstract(nnx.eval_shape(lambda: build_target(tcfg)), mesh)
    d_graph, params = _abstract(nnx.eval_shape(lambda: Drafter(dcfg)), mesh)

    total_steps = int(cfg.train.steps or 1000)
    tx, _ = make_optimizer(cfg.train, total_steps)
    rep = NamedSharding(mesh, PartitionSpec())
    opt = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        jax.eval_shape(tx.init, params),
        optimizer_shardings(tx, params, mesh),
    )
    state = {"params": params, "opt": opt, "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)}

    b, length = cfg.train.batch_size, cfg.train.max_len
    n_batch = mesh.shape["data"] * mesh.shape["fsdp"]
    if b % n_batch:
        raise ValueError(
            f"train.batch_size={b} does not split over data x fsdp = {n_batch} devices of {pod.name}: set "
            "train.batch_size to a multiple, or mesh.tensor to take the rest"
        )
    k = cfg.block_size
    n_anchors = cfg.num_anchors
    batch = {
        "input_ids": jax.ShapeDtypeStruct((b, length), jnp.int32, sharding=batch_sharding(mesh, 2)),
        "loss_mask": jax.ShapeDtypeStruct((b, length), jnp.bool_, sharding=batch_sharding(mesh, 2)),
        "lengths": jax.ShapeDtypeStruct((b,), jnp.int32, sharding=batch_sharding(mesh, 1)),
        "anchors": jax.ShapeDtypeStruct((b, n_anchors), jnp.int32, sharding=batch_sharding(mesh, 2)),
    }
    vocab_ids = None
    if cfg.draft_vocab is not None:
        vocab_ids = jax.ShapeDtypeStruct((cfg.draft_vocab,), jnp.int32, sharding=rep)
    offline = cfg.features.mode == "offline"
    if offline:
        batch["features"] = jax.ShapeDtypeStruct(
            (b, length, dcfg.feature_size), jnp.dtype(tcfg.dtype), sharding=batch_sharding(mesh, 3)
        )
    prog = Program.for_config(
        cfg,
        d_graph=d_graph,
        t_graph=t_graph,
        layer_ids=dcfg.target_layer_ids,
        total_steps=total_steps,
        mesh=mesh,
        state=state,
        target_labels=cfg.data.labels == "target" and not offline,
    )
    t0 = time.time()
    nan_at = jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)
    with jax.set_mesh(mesh):  # as Trainer.train traces it: activations keep their batch sharding
        lowered = train_step.lower(state, t_state, batch, nan_at, vocab_ids, prog=prog)
    compiled = lowered.compile()
    compile_s = time.time() - t0
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost

    def per_device(tree):
        return sum(
            math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)
        )

    out = {
        "pod": pod.name,
        "devices": pod.devices,
        "mesh": dict(mesh.shape),
        "mesh_devices": int(mesh.devices.size),  # what the step is split over (a config's mesh may use fewer)
        "hbm_bytes_per_device": pod.hbm_bytes,
        "target": f"{tcfg.family} {tcfg.num_hidden_layers} layers x {tcfg.hidden_size} ({tcfg.dtype})",
        "drafter": f"{dcfg.num_hidden_layers} layers, K={k}, {n_anchors} anchors/seq (fp32 master weights)",
        "batch": f"{b} sequences x {length} tokens, {b // n_batch} a device",
        "features": cfg.features.mode,
        "bytes_per_device": {
            "target_params": per_device(t_state),
            "drafter_params": per_device(params),
            "optimizer": per_device(opt),
            "batch": per_device(batch),
            "step_temporaries": int(mem.temp_size_in_bytes),
        },
        "flops_per_step": model_flops(
            tcfg,
            dcfg,
            batch=b,
            length=length,
            anchors=n_anchors,
            block=k,
            online=not offline,
            labels=prog.target_labels,
            vocab=cfg.draft_vocab if cfg.draft_vocab is not None else tcfg.vocab_size,
            labelled_slots=loss_slots(k, prog.loss_positions) - 1,
        ),
        "xla_flops_per_device": float(cost.get("flops", float("nan"))),
        "compile_s": round(compile_s, 1),
    }
    out["flops_per_step"]["total"] = sum(out["flops_per_step"].values())
    out["bytes_per_device"]["total"] = sum(out["bytes_per_device"].values())
    if pod.hbm_bytes:
        out["fits"] = out["bytes_per_device"]["total"] <= 0.9 * pod.hbm_bytes  # XLA reserves a share of HBM
    return out


def report(p: dict) -> str:
    """The dry run as a table a person reads."""
    rows = [
        f"dry run: {p['target']} -> drafter {p['drafter']}",
        f"pod {p['pod']}: {p['devices']} devices, mesh {p['mesh']}; batch {p['batch']}; features {p['features']}",
        "",
        "| per device | GiB |",
        "|---|---:|",
    ]
    for key, value in p["bytes_per_device"].items():
        rows.append(f"| {key.replace('_', ' ')} | {value / GIB:.3f} |")
    if p["hbm_bytes_per_device"]:
        rows.append(f"| HBM | {p['hbm_bytes_per_device'] / GIB:.0f} |")
    flops = p["flops_per_step"]
    rows += ["", "| step FLOPs (matmuls) | TFLOP | per device |", "|---|---:|---:|"]
    for key, value in flops.items():
        rows.append(f"| {key.replace('_', ' ')} | {value / 1e12:.1f} | {value / 1e12 / p['mesh_devices']:.2f} |")
    rows.append(
        f"XLA's own count: {p['xla_flops_per_device'] / 1e12:.2f} TFLOP a device (it counts a loop's body once: the "
        f"chunked cross-entropy and attention); compiled in {p['compile_s']} s on fake CPU devices"
    )
    if "fits" in p:
        used = p["bytes_per_device"]["total"] / p["hbm_bytes_per_device"]
        verdict = "fits" if p["fits"] else "does NOT fit"
        rows.append(f"verdict: {verdict} ({used:.0%} of HBM; keep under 90%)")
    rows.append(
        "step temporaries are XLA's CPU plan of the partitioned step: the size of the problem, not a TPU measurement"
    )
    return "\n".join(rows)
