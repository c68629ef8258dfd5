"""Where a run's drafter starts: a registry of starts (name -> function); `train.config.start_of` is the one
place that reads which one drafter.init asks for: null a random start, `copy` the in-context copy circuit, anything
else a z-lab drafter directory (grown by drafter.init_layers, its draft vocabulary kept by drafter.init_vocab).

A start takes (cfg, drafter, target, records), `drafter` freshly built from the run's seed, and returns the drafter
the first step trains.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_model.drafter import build_drafter, scale_output_norm
from dflash_model.drafter_weights import DRAFT_VOCAB_FILE, load_draft_vocab, load_drafter
from dflash_model.target import config_of
from train.config import start_of
from train.copy_init import FIT_ROWS, fit_copy_circuit
from train.objective import gamma_of


def random_start(cfg, drafter, target, records):
    """The seed's drafter; drafter.init_logit_std scales its output norm."""
    if cfg.drafter.init_logit_std is not None:
        drafter = scale_output_norm(drafter, target, cfg.drafter.init_logit_std)
    return drafter


def copy_start(cfg, drafter, target, records):
    """The in-context copy circuit, fitted on the first FIT_ROWS training rows (train/copy_init.py)."""
    fit_rows = [records[i]["input_ids"] for i in range(min(FIT_ROWS, len(records)))]
    return fit_copy_circuit(drafter, target, fit_rows, gamma=gamma_of(cfg), loss_positions=cfg.loss_positions)


def directory_start(cfg, drafter, target, records):
    """A z-lab drafter directory's weights, grown by drafter.init_layers."""
    layers = cfg.drafter.init_layers
    init_weights(drafter, drafter.config, cfg.drafter.init, config_of(target), None if layers is None else list(layers))
    return drafter


STARTS: dict[str, Callable] = {"random": random_start, "copy": copy_start, "directory": directory_start}


def start_drafter(cfg, drafter_cfg, target, records):
    """The drafter a run starts from: the start drafter.init selects, applied to the seed's drafter."""
    name = start_of(cfg.drafter.init)
    if name != "random" and cfg.drafter.init_logit_std is not None:
        raise ValueError(
            f"drafter.init={cfg.drafter.init} and drafter.init_logit_std both set: an initialised drafter keeps its "
            "own output norm"
        )
    return STARTS[name](cfg, build_drafter(drafter_cfg, seed=cfg.seed), target, records)


def init_weights(drafter, dcfg, init_dir, target_cfg, layers=None) -> None:
    """Overwrite `drafter`'s parameters (in place) with a z-lab drafter directory's, cast to fp32.

    The directory's architecture must equal `dcfg` but for block_size (the weights do not depend on K) and dtype;
    a difference is an error naming drafter.init and the fields.

    `layers` (drafter.init_layers) grows a loaded drafter: one entry per layer of `dcfg`, the directory's layer it
    starts from, or None for a new layer that starts as the identity (its o_proj and down_proj zeroed, the rest as
    `drafter` holds them), so the grown drafter starts out drafting exactly what the loaded one drafts.
    """
    icfg, loaded = load_drafter(init_dir, target_cfg, dtype="float32")
    icfg = icfg.replace(block_size=dcfg.block_size)
    if layers is not None:
        icfg = _grown_config(icfg, dcfg, list(layers), init_dir)
    if icfg != dcfg:
        diff = {
            f.name: (getattr(icfg, f.name), getattr(dcfg, f.name))
            for f in dataclasses.fields(dcfg)
            if getattr(icfg, f.name) != getattr(dcfg, f.name)
        }
        raise ValueError(
            f"drafter.init={init_dir}: its architecture differs from the config's (field: (checkpoint, config)): {diff}"
        )
    if layers is None:
        nnx.update(drafter, nnx.state(loaded, nnx.Param))
        return
    for name in ("fc", "hidden_norm", "norm"):
        getattr(drafter, name).set_value(getattr(loaded, name).get_value())
    for i, src in enumerate(layers):
        if src is None:
            attn, mlp = drafter.layers[i].self_attn, drafter.layers[i].mlp
            attn.o_proj.set_value(jnp.zeros_like(attn.o_proj.get_value()))
            mlp.down_proj.set_value(jnp.zeros_like(mlp.down_proj.get_value()))
        else:
            nnx.update(drafter.layers[i], nnx.state(loaded.layers[src], nnx.Param))


def _grown_config(icfg, dcfg, layers: list, init_dir):
    """The loaded drafter's config as drafter.init_layers grows it (to compare with the run's): a clear error for a
    mapping that does not fit the two drafters."""
    n_in = icfg.num_hidden_layers
    if len(layers) != dcfg.num_hidden_layers:
        raise ValueError(
            f"drafter.init_layers={layers}: {len(layers)} entries for drafter.num_layers={dcfg.num_hidden_layers}"
        )
    for i, src in enumerate(layers):
        if src is None:
            continue
        if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < n_in:
            raise ValueError(
                f"drafter.init_layers={layers}: entry {i} is {src!r}, not null or a layer of drafter.init={init_dir} "
                f"(0..{n_in - 1})"
            )
        if icfg.layer_type(src) != dcfg.layer_type(i):
            raise ValueError(
                f"drafter.init_layers={layers}: layer {i} is {dcfg.layer_type(i)} but drafter.init={init_dir}'s "
                f"layer {src} is {icfg.layer_type(src)}"
            )
    # The layer types now match the run's where mapped, and new layers take the run's. A sliding window is the
    # loaded drafter's own when it has sliding layers (a copied sliding layer keeps its mask: a run that sets
    # another window differs below); else the run's, which only new layers use.
    return icfg.replace(
        num_hidden_layers=dcfg.num_hidden_layers,
        layer_types=dcfg.layer_types,
        sliding_window=icfg.sliding_window if icfg.layer_types is not None else dcfg.sliding_window,
    )


def init_draft_vocab(cfg, vocab_size: int) -> np.ndarray:
    """drafter.init_vocab: the draft vocabulary saved beside the drafter.init directory, of draft_vocab's size."""
    init = cfg.drafter.init  # a drafter directory, and draft_vocab set: train.config checks both
    ids = load_draft_vocab(init, vocab_size)
    if ids is None:
        raise ValueError(f"drafter.init_vocab=true: {Path(init) / DRAFT_VOCAB_FILE} does not exist")
    if len(ids) != cfg.draft_vocab:
        raise ValueError(
            f"drafter.init_vocab=true: {Path(init) / DRAFT_VOCAB_FILE} holds {len(ids)} tokens, draft_vocab="
            f"{cfg.draft_vocab}"
        )
    return np.asarray(ids, np.int32)
