"""A training run's world, built from its config: the mesh, the target, the data, the drafter's start, the draft
vocabulary and the offline features (`build_run`). The Trainer receives it and only loops."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from data import assets
from dflash_model import sharding as shd
from dflash_model.config import preset
from dflash_model.drafter_config import check_pairing, drafter_config_for, drafter_preset
from dflash_model.drafter_weights import export_config
from dflash_model.files import local_dir, pull
from dflash_model.speculators_format import VERIFIER_ARCHITECTURES
from dflash_model.target import config_of, is_maxtext, random_target
from dflash_model.tokenizer import load_tokenizer
from dflash_model.weights import load_target
from train.batches import build_train_dataset
from train.features import open_or_build
from train.objective import block_labels, loss_slots, restrict_vocab
from train.starts import init_draft_vocab, start_drafter


@dataclasses.dataclass
class Run:
    """What a run trains with. `features` and `labels` are the offline features' memmaps (features.mode=offline),
    `vocab_ids` the draft vocabulary on the mesh (draft_vocab set); each None otherwise."""

    cfg: Any
    run_dir: Path
    mesh: Mesh
    target: nnx.Module
    tokenizer_path: Path | None
    target_cfg: Any
    drafter_cfg: Any
    drafter: nnx.Module
    dataset: Any
    batches_per_epoch: int
    t_graph: Any
    t_state: Any
    features: Any = None
    labels: Any = None
    vocab_ids: jax.Array | None = None


def stage_run_dir(cfg) -> Path:
    """The local directory of cfg.run_dir, made: the run directory itself, or for a URI (gs://bucket/run) the staging
    directory whose files `dflash_model.files.push` mirrors there; a fresh host resuming a URI run gets its
    metrics.jsonl and config.yml back first (process 0)."""
    run_dir = local_dir(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if jax.process_index() == 0:
        pull(str(cfg.run_dir))
    return run_dir


def build_run(cfg, run_dir: Path, *, devices=None, target=None, records=None) -> Run:
    """The run's world from cfg. target: a target module to train against instead of the one cfg.target names;
    records: TokenizedRecords to train on instead of cfg.data's source. The offline features are built (or opened)
    under run_dir unless features.cache_dir names a place."""
    mesh = resolve_mesh(cfg.mesh, devices)
    n_batch = mesh.shape["data"] * mesh.shape["fsdp"]
    if cfg.train.batch_size % n_batch:
        raise ValueError(f"train.batch_size={cfg.train.batch_size} is not divisible by data x fsdp = {n_batch}")

    target, tokenizer_path = (target, None) if target is not None else load_target_model(cfg, mesh)
    target_cfg = config_of(target)
    drafter_cfg = drafter_config(cfg, target_cfg)
    positions = target_cfg.max_position_embeddings
    for key, value in (("block_size", cfg.block_size), ("train.max_len", cfg.train.max_len)):
        if value > positions:
            raise ValueError(f"{key}={value} exceeds the target's max_position_embeddings={positions}")
    check_eval_lengths(cfg.eval, cfg.block_size, positions)
    if not is_maxtext(target):  # MaxText placed its parameters on the mesh as it loaded them
        shd.shard_model(target, mesh)

    tokenizer = None
    if records is None and cfg.data.source in ("regenerate", "mix"):
        raise ValueError(
            f"data.source={cfg.data.source} is resolved by train/run.py (train.workflow.prepare_regenerated "
            "or prepare_mix writes the JSONL); give the Trainer that JSONL's path as data.source"
        )
    if records is None and cfg.data.source != "synthetic":
        tokenizer = load_tokenizer(cfg.data.tokenizer or tokenizer_path)
    dataset, batches_per_epoch, records = build_train_dataset(
        cfg, vocab_size=target_cfg.vocab_size, mask_token_id=drafter_cfg.mask_token_id, tokenizer=tokenizer,
        records=records,
    )  # fmt: skip
    check_token_ids(records, target_cfg.vocab_size, cfg)
    drafter = shd.shard_model(start_drafter(cfg, drafter_cfg, target, records), mesh)
    t_graph, t_state = nnx.split(target)
    run = Run(
        cfg, run_dir, mesh, target, tokenizer_path, target_cfg, drafter_cfg, drafter, dataset, batches_per_epoch,
        t_graph, t_state,
    )  # fmt: skip
    if cfg.features.mode == "offline":
        run.features, run.labels = open_or_build(run, records, chunk=cfg.train.batch_size // jax.process_count())
    if cfg.draft_vocab is not None:
        if cfg.drafter.init_vocab:
            ids = init_draft_vocab(cfg, target_cfg.vocab_size)
        else:
            ids = draft_vocabulary(records, target_cfg.vocab_size, cfg.draft_vocab)
        run.vocab_ids = jax.device_put(jnp.asarray(ids), NamedSharding(mesh, PartitionSpec()))
    return run


# ----------------------------------------------------------------------------------------------------------
# Building blocks (each callable alone from tests).

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


def load_target_model(cfg, mesh=None):
    """(target module, tokenizer path or None) for cfg.target: real weights from a path, or a random preset."""
    t = cfg.target
    if t.maxtext is not None:
        if t.path is None:
            raise ValueError(
                "target.maxtext needs target.path: the HF directory whose config.json and tokenizer it has"
            )
        from dflash_model.maxtext_target import load_maxtext_target  # the optional maxtext extra

        model = load_maxtext_target(t.path, t.maxtext, dtype=t.dtype, mesh=mesh, max_length=cfg.train.max_len)
        return model, Path(t.path)
    if t.path is not None:
        path = assets.target_file(t.path)
        _, model = load_target(path, dtype=t.dtype, mesh=mesh)  # sharded as it loads: no single-device copy
        return model, Path(path)
    tcfg = preset(t.preset).replace(**dict(t.arch), dtype=t.dtype)
    # Random targets are for shapes, throughput and tests: drawn on the mesh, each device its own shard.
    return random_target(tcfg, seed=cfg.seed, mesh=mesh), None


def drafter_config(cfg, target_cfg):
    """The drafter architecture for cfg (preset or shaped like the target), at cfg.block_size, fp32 master weights."""
    d = cfg.drafter
    if d.preset is not None:
        dcfg = drafter_preset(d.preset)
    else:  # RunConfig.validate() saw to mask_token_id
        dcfg = drafter_config_for(
            target_cfg,
            mask_token_id=d.mask_token_id,
            num_layers=d.num_layers,
            n_features=d.n_features,
            intermediate_size=d.intermediate_size,
            target_layer_ids=d.target_layer_ids,
        )
    if d.layer_types is not None:
        # DrafterConfig checks the names and that there is one per layer, naming the key.
        dcfg = dcfg.replace(layer_types=d.layer_types, sliding_window=d.sliding_window)
    # AdamW on bf16 weights loses small updates; the drafter trains in fp32 and is cast at export.
    dcfg = dcfg.replace(block_size=cfg.block_size, dtype="float32")
    check_pairing(dcfg, target_cfg, source=f"drafter ({d.preset or 'from config'})")
    if cfg.export.enabled:  # a format that cannot carry this drafter stops the run now, not after training
        for fmt, _ in EXPORT_LAYOUT[cfg.export.format]:
            export_config(dcfg, fmt, export_verifier(cfg, target_cfg))
    return dcfg


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


def check_eval_lengths(e, block_size: int, positions: int) -> None:
    """The end-of-run eval's (the config's `eval` section) longest prompt, its new tokens and its widest verify must
    fit the target's positions: found when the target is known, not after training."""
    if not e.enabled:
        return
    width = max(e.block if e.block is not None else block_size, e.ngram_block)
    need = e.max_prompt_tokens + e.max_new_tokens + width
    if need > positions:
        raise ValueError(
            f"eval.max_prompt_tokens={e.max_prompt_tokens} + eval.max_new_tokens={e.max_new_tokens} + a verify of "
            f"{width} = {need} positions, more than the target's max_position_embeddings={positions}"
        )


def resolve_mesh(mesh, devices=None):
    """The device mesh of the config's `mesh` section over these devices (default: all), one axis of -1 taking
    the devices the others leave."""
    devices = list(jax.devices() if devices is None else devices)
    m = {k: getattr(mesh, k) for k in ("data", "fsdp", "tensor")}
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


def labelled_positions(run: Run, steps: int, until: int | None = None) -> list[int]:
    """The labelled positions of each of a run's first `steps` batches (fewer where their sum reaches `until`),
    counted from its own pipeline (the rows, the anchors and the draft vocabulary the trainer's steps see, in the
    same order) with no model step: what the step logs as `valid_labels`. A budget of labelled positions is met by
    counting them, not by extrapolating a few calibration steps (rows differ in length: the first 5 rows of one mix
    held 1,821 a step, its first 138 1,355)."""
    cfg = run.cfg
    if cfg.data.labels == "target":
        raise ValueError("labelled_positions counts text labels; data.labels=target needs the target's forward")
    k = cfg.block_size
    slots = loss_slots(k, cfg.loss_positions)
    counts, batches = [], iter(run.dataset)
    for _ in range(steps):
        b = next(batches)
        labels, valid = block_labels(
            jnp.asarray(b["input_ids"]), jnp.asarray(b["loss_mask"]), jnp.asarray(b["anchors"]), k
        )
        labels, valid = labels[:, :, 1:slots], valid[:, :, 1:slots]
        if run.vocab_ids is not None:
            labels, valid = restrict_vocab(labels, valid, run.vocab_ids, run.target_cfg.vocab_size)
        counts.append(int(jnp.sum(valid)))
        if until is not None and sum(counts) >= until:
            break
    return counts
