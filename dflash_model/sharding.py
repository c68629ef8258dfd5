"""Meshes and parameter sharding: one table from Tunix's logical axis names to this project's mesh axes."""

from __future__ import annotations

import math

import jax
import numpy as np
from flax import nnx
from jax.experimental import mesh_utils, multihost_utils
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

# Tunix annotates parameters with 'fsdp' (model dim), 'tp' (heads / MLP width / vocab) and 'sp' (sequence).
LOGICAL_TO_MESH = {"fsdp": "fsdp", "tp": "tensor", "sp": None}

# Activations and caches: batch over data x fsdp, kv heads over tensor.
BATCH_AXES = ("data", "fsdp")


def device_grid(data: int, fsdp: int, tensor: int, devices) -> np.ndarray:
    """The [data, fsdp, tensor] array of `devices` a mesh is made of, laid out by the interconnect.

    One slice: `mesh_utils.create_device_mesh`, which on TPU follows the physical torus (ICI) so the inner axes
    (tensor, then fsdp) are the best-connected; elsewhere a plain reshape. Several slices (devices carry a
    `slice_index`, a multislice job): the data axis spans the slices over DCN (only gradients cross it) and fsdp x
    tensor stay inside each slice (`create_hybrid_device_mesh`).
    """
    if data * fsdp * tensor != len(devices):
        raise ValueError(f"mesh data={data} x fsdp={fsdp} x tensor={tensor} != {len(devices)} devices")
    slices = len({getattr(d, "slice_index", 0) for d in devices})
    if slices == 1:
        return mesh_utils.create_device_mesh((data, fsdp, tensor), devices, allow_split_physical_axes=True)
    if data % slices:
        raise ValueError(
            f"mesh.data={data} over {slices} slices: the data axis spans the slices (DCN), so it must be a "
            f"multiple of {slices}"
        )
    return mesh_utils.create_hybrid_device_mesh(
        (data // slices, fsdp, tensor), (slices, 1, 1), devices, allow_split_physical_axes=True
    )


def make_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1, devices=None) -> Mesh:
    """A (data, fsdp, tensor) mesh over `devices` (default: all), topology-aware (`device_grid`). Axes are Auto:
    jax 0.12's default Explicit axes break the embedding gather."""
    devices = jax.devices() if devices is None else devices
    grid = device_grid(data, fsdp, tensor, list(devices))
    return Mesh(grid, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3)


def abstract_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1) -> AbstractMesh:
    """A mesh of the given shape with no devices: enough to plan shardings of pod-sized models here."""
    return AbstractMesh((data, fsdp, tensor), MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3)


def _mesh_spec(logical: PartitionSpec, shape, mesh) -> PartitionSpec:
    """Translate logical names; replicate a dimension the mesh axis does not divide (e.g. SmolLM2's 9 heads
    on tensor=2), since uneven shards are not allowed for parameters."""
    out = []
    for dim, name in zip(shape, tuple(logical) + (None,) * (len(shape) - len(logical))):
        axis = LOGICAL_TO_MESH.get(name, name) if name is not None else None
        if axis is not None and (axis not in mesh.axis_names or dim % mesh.shape[axis]):
            axis = None
        out.append(axis)
    return PartitionSpec(*out)


def param_specs(model: nnx.Module, mesh) -> dict[tuple, PartitionSpec]:
    """Mesh PartitionSpec for every nnx.Param of `model` (concrete or abstract), keyed by path."""
    specs = {}
    for path, param in nnx.iter_graph(model):
        if isinstance(param, nnx.Param):
            logical = PartitionSpec(*(param.get_metadata().get("out_sharding") or ()))
            specs[path] = _mesh_spec(logical, param.get_value().shape, mesh)
    return specs


def param_shardings(model: nnx.Module, mesh: Mesh) -> dict[tuple, NamedSharding]:
    return {path: NamedSharding(mesh, spec) for path, spec in param_specs(model, mesh).items()}


def shard_model(model: nnx.Module, mesh: Mesh) -> nnx.Module:
    """Place every parameter of `model` on `mesh` in place."""
    shardings = param_shardings(model, mesh)
    for path, param in nnx.iter_graph(model):
        if isinstance(param, nnx.Param):
            param.set_value(jax.device_put(param.get_value(), shardings[path]))
    return model


def batch_spec(ndim: int, batch_axis: int = 0) -> PartitionSpec:
    """One axis over data x fsdp, the rest replicated."""
    spec = [None] * ndim
    spec[batch_axis] = BATCH_AXES
    return PartitionSpec(*spec)


def batch_sharding(mesh: Mesh, ndim: int, batch_axis: int = 0) -> NamedSharding:
    """Shard one axis of an activation over data x fsdp, replicate the rest."""
    return NamedSharding(mesh, batch_spec(ndim, batch_axis))


def constrain_batch(x, batch_axis: int = 0):
    """Pin an activation's batch axis to (data, fsdp) while tracing under `jax.set_mesh(mesh)`; a no-op
    elsewhere (decoding, single-device tests). Parameters are FSDP-sharded on the model dim, and left to itself
    GSPMD shards the activations of `x @ W` the same way, replicating the batch: on a pod every device then held
    the whole global batch's activations (train/plan.py showed 371 GiB a device for the Qwen3-8B recipe)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(BATCH_AXES) <= set(mesh.axis_names):
        return x
    if x.shape[batch_axis] % math.prod(mesh.shape[a] for a in BATCH_AXES):
        return x  # a batch the axes do not divide (e.g. a feature precompute chunk) stays as GSPMD lays it
    return jax.lax.with_sharding_constraint(x, batch_spec(x.ndim, batch_axis))


def memory_report(model: nnx.Module, mesh) -> dict:
    """Parameter count, total bytes and the largest per-device bytes of `model` sharded on `mesh`."""
    specs = param_specs(model, mesh)
    count = total = per_device = 0
    for path, param in nnx.iter_graph(model):
        if isinstance(param, nnx.Param):
            value = param.get_value()
            size = math.prod(value.shape)
            nbytes = size * np.dtype(value.dtype).itemsize
            split = math.prod(mesh.shape[a] for a in specs[path] if a is not None)
            count, total, per_device = count + size, total + nbytes, per_device + nbytes / split
    return {"params": count, "bytes": total, "bytes_per_device": per_device, "mesh": dict(mesh.shape)}


# ----------------------------------------------------------------------------------------------------------
# Several processes (jax.distributed): both are no-ops in one process.


def process0_decides(flag: bool) -> bool:
    """`flag` as process 0 sees it, on every process. Where a file on disk decides whether collectives follow,
    every process must take the same branch, or the ones that skip leave the others waiting."""
    if jax.process_count() == 1:
        return bool(flag)
    return bool(multihost_utils.broadcast_one_to_all(np.asarray(flag)))


def max_over_processes(value: int) -> int:
    """The largest of every process's `value`, on every process (e.g. a signal number only some processes
    received: all must stop at the same step, or the ones still stepping wait in a collective forever)."""
    if jax.process_count() == 1:
        return int(value)
    return int(np.max(multihost_utils.process_allgather(np.asarray(value, np.int32))))


def barrier(name: str) -> None:
    """Every process waits here until all have arrived (e.g. until process 0 has written a file)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)
