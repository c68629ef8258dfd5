"""Offline target features: one target forward per training record, stored once, read back by record index.

Layout of `cache_dir`: features.npy, a [N, T, F] memory-mapped array (F = len(layer_ids) * D; bf16 targets are
stored as their raw uint16 bits, numpy has no bf16), and meta.json, written last: a cache without meta.json
(a killed precompute) or with a meta.json describing another target / layer set / length is rebuilt, and so is a
damaged one (meta.json unreadable, an array cut short), with a warning naming it.
Rows are the *unshuffled* record order; the grain pipeline's batches carry each row's `index`, so shuffling,
epochs and exact resume are untouched and only the feature lookup differs from the online path.

Several processes (jax.distributed) share one file system: process 0 decides whether to build and tells the
others, every process runs the (sharded) target forward in lockstep, process 0 writes, and nobody reads before
a barrier after meta.json is written.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from dflash_model import sharding as shd
from dflash_model.files import RunLock, atomic_write_text, is_uri
from dflash_model.target import forward
from train.objective import target_labels

log = logging.getLogger("dflash.train")


def records_digest(records) -> str:
    """sha256 of every record's token ids, in order: the features depend on exactly these, not on a file's name."""
    h = hashlib.sha256()
    arrays = getattr(records, "arrays", None)  # data.pipeline.TokenizedRecords: flat ids and offsets
    if arrays is not None:
        h.update(np.ascontiguousarray(arrays[0], np.int32).tobytes())
        h.update(np.ascontiguousarray(arrays[2], np.int64).tobytes())
        return h.hexdigest()
    for i in range(len(records)):
        ids = np.ascontiguousarray(np.asarray(records[i]["input_ids"], np.int32))
        h.update(np.int64(ids.size).tobytes())
        h.update(ids.tobytes())
    return h.hexdigest()


def _meta(trainer, records) -> dict:
    cfg = trainer.cfg
    num_records = len(records)
    return {
        "tokens_sha256": records_digest(records),
        "target": str(cfg.target.path or cfg.target.preset),
        "target_arch": dict(cfg.target.arch),
        "dtype": trainer.target_cfg.dtype,
        "layer_ids": list(trainer.drafter_cfg.target_layer_ids),
        "max_len": cfg.train.max_len,
        "num_records": num_records,
        "seed": cfg.seed,
        "hidden_size": trainer.target_cfg.hidden_size,
        "labels": cfg.data.labels,
        # another attention kernel gives features that differ in the last bits: its own cache (einsum's caches,
        # made before the key existed, keep their meta)
        **({"attention": cfg.target.attention} if cfg.target.attention != "einsum" else {}),
    }


def open_or_build(trainer, records, chunk: int = 8):
    """(the [N, T, F] float32 view of the cache for `records` (a sequence of dicts with input_ids), the [N, T]
    int32 target labels or None), building the cache first when missing or stale. With data.labels=target the
    same forward also computes the lm_head and stores the target's greedy next token at every position
    (train.objective.target_labels). Every process must call this (the build is a collective); process 0 writes."""
    cfg = trainer.cfg
    if is_uri(cfg.features.cache_dir or ""):
        raise ValueError(
            f"features.cache_dir={cfg.features.cache_dir}: the feature cache is a memory-mapped array on local disk; "
            "give it a local directory (null = <run_dir>/features, the staging directory of a URI run_dir)"
        )
    root = Path(cfg.features.cache_dir) if cfg.features.cache_dir else trainer.run_dir / "features"
    want = _meta(trainer, records)
    data_path = root / "features.npy"
    # One builder at a time (process 0 of each run): two runs sharing a cache_dir would otherwise both find it
    # missing and write it over each other. The lock sits beside the cache, which a rebuild deletes whole; the
    # second run waits for the first build and then finds the cache ready.
    lock = None
    if jax.process_index() == 0:
        lock = RunLock(root.parent, key="features.cache_dir", name=f".{root.name}.lock", doing="built", wait=True)
    try:
        # Process 0's view decides: a peer that looked after process 0 finished would otherwise skip the build.
        stale = shd.process0_decides(cache_problem(root, want) is not None)
        if stale:
            _build(trainer, records, root, want, chunk, write=jax.process_index() == 0)
        shd.barrier("dflash offline features written")
    finally:
        if lock is not None:
            lock.release()
    labels = np.load(root / "labels.npy", mmap_mode="r") if want["labels"] == "target" else None
    return _Reader(np.load(data_path, mmap_mode="r"), want["dtype"]), labels


def cache_problem(root: Path, want: dict) -> str | None:
    """Why the feature cache at `root` cannot serve `want` (its meta.json), or None where it can: missing (a first
    run, or a killed precompute: meta.json is written last), made for other settings, or damaged (meta.json or an
    array unreadable or cut short). A damaged cache is said, naming the file, before it is rebuilt."""
    meta_path = root / "meta.json"
    if not meta_path.is_file():
        return "missing"
    try:
        if json.loads(meta_path.read_text()) != want:
            return "made for other settings"
        n, t = want["num_records"], want["max_len"]
        shapes = {"features.npy": (n, t, len(want["layer_ids"]) * want["hidden_size"])}
        if want["labels"] == "target":
            shapes["labels.npy"] = (n, t)
        for name, shape in shapes.items():
            got = np.load(root / name, mmap_mode="r").shape
            if got != shape:
                raise ValueError(f"{root / name}: shape {got}, expected {shape}")
    except (OSError, ValueError, EOFError) as e:  # json.JSONDecodeError and a cut .npy's mmap error are ValueErrors
        log.warning("the offline feature cache %s is damaged (%s); rebuilding it", root, e)
        return f"damaged: {e}"
    return None


def _build(trainer, records, root: Path, meta: dict, chunk: int, *, write: bool) -> None:
    t, n = meta["max_len"], meta["num_records"]
    f = len(meta["layer_ids"]) * meta["hidden_size"]
    bf16 = meta["dtype"] == "bfloat16"
    out = labels_out = None
    with_labels = meta["labels"] == "target"
    if write:
        if root.exists():
            shutil.rmtree(root)
        root.mkdir(parents=True)
        out = np.lib.format.open_memmap(
            root / "features.npy", mode="w+", dtype=np.uint16 if bf16 else np.float32, shape=(n, t, f)
        )
        if with_labels:
            labels_out = np.lib.format.open_memmap(root / "labels.npy", mode="w+", dtype=np.int32, shape=(n, t))
        log.info("precomputing target features for %d records into %s (%.1f GB)", n, root, out.nbytes / 1e9)
    t_graph, layer_ids = trainer.t_graph, tuple(meta["layer_ids"])
    attention = meta.get("attention", "einsum")
    # Token ids in and features out replicated over the trainer's mesh: the target may be sharded across
    # processes, and every process then holds the whole chunk of features (process 0 writes it).
    replicated = NamedSharding(trainer.mesh, PartitionSpec())

    def features_and_labels(s, ids):
        out = forward(nnx.merge(t_graph, s), ids, layer_ids=layer_ids, compute_logits=with_labels, attention=attention)
        return out.features, (target_labels(ids, out.logits) if with_labels else ids)

    fn = jax.jit(features_and_labels, out_shardings=(replicated, replicated))
    t0, last_log = time.perf_counter(), time.perf_counter()
    for lo in range(0, n, chunk):
        if write and time.perf_counter() - last_log > 60:
            done, secs = lo, time.perf_counter() - t0
            log.info(
                "features: %d/%d records, %.1f records/s, eta %.1f min",
                done,
                n,
                done / secs,
                (n - done) / max(done / secs, 1e-9) / 60,
            )
            last_log = time.perf_counter()
        rows = [records[i] for i in range(lo, min(lo + chunk, n))]
        ids = np.zeros((chunk, t), np.int32)  # a fixed chunk shape: one compilation
        for j, r in enumerate(rows):
            x = np.asarray(r["input_ids"])[:t]
            ids[j, : x.size] = x
        feats, labels = fn(trainer.t_state, jax.make_array_from_process_local_data(replicated, ids))
        if out is not None:
            feats = np.asarray(feats.addressable_data(0))[: len(rows)]
            out[lo : lo + len(rows)] = feats.view(np.uint16) if bf16 else feats
            if labels_out is not None:
                labels_out[lo : lo + len(rows)] = np.asarray(labels.addressable_data(0))[: len(rows)]
    if out is not None:
        out.flush()
        del out
        if labels_out is not None:
            labels_out.flush()
            del labels_out
        atomic_write_text(root / "meta.json", json.dumps(meta, indent=1))


class _Reader:
    """Row lookup by record index, decoding bf16 bits back to float32 on the host."""

    def __init__(self, arr: np.ndarray, dtype: str):
        self.arr, self.bf16 = arr, dtype == "bfloat16"

    def __getitem__(self, index) -> np.ndarray:
        rows = np.asarray(self.arr[np.asarray(index)])
        if self.bf16:
            return (rows.astype(np.uint32) << 16).view(np.float32)
        return rows
