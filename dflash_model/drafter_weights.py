"""z-lab DFlash drafter checkpoints (config.json + model.safetensors): the config.json parser and writer, strict
load and export (what a server needs of them: dflash_model.zlab_schema); and the same tensors under vLLM's
speculators-format config.json (dflash_model.speculators_format), which load_drafter tells apart by its config and
reads into the same drafter.

The format is the one z-lab publishes and vLLM / SGLang / tpu-inference read: unprefixed tensor names, torch
Linear layout [out, in], no embedding, no lm_head, no biases, no rotary buffers; 3 + 11 * L tensors.
Everything is checked (config keys, pairing with the target, every tensor's name, shape and dtype) before the
first tensor is read, so a mismatch is an error naming it and never a half-loaded drafter.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from safetensors import safe_open
from safetensors.flax import save_file

from dflash_model import speculators_format
from dflash_model.config import (
    ConfigError,
    TargetConfig,
    architecture_json,
    declared_dtype,
    jnp_dtype,
    read_config_json,
    rope_scaling_of,
    rope_theta_of,
    stored_dtype,
)
from dflash_model.drafter import Drafter, abstract_drafter
from dflash_model.drafter_config import DrafterConfig, check_pairing, default_target_layer_ids
from dflash_model.files import atomic_write_json
from dflash_model.sharding import param_shardings
from dflash_model.weights import CheckpointError, SafetensorsSource, check_finite, raise_problems, torch_layouts
from dflash_model.weights import tensor_problems as shape_dtype_problems

SAFETENSORS_DTYPE = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


@dataclass(frozen=True)
class DraftTensor:
    shape: tuple[int, ...]  # torch layout, as stored
    path: tuple  # path of the nnx.Param in Drafter
    to_param: Callable  # stored layout -> module layout
    to_hf: Callable  # and back


def zlab_tensor_specs(cfg: DrafterConfig) -> dict[str, DraftTensor]:
    """Every tensor a z-lab checkpoint of `cfg` holds, keyed by name (the module path joined by dots + '.weight')."""
    d, m, f = cfg.hidden_size, cfg.intermediate_size, cfg.feature_size
    q, g, h = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    same, t, heads_in, heads_out_of = torch_layouts(d, h)
    heads_out = heads_out_of(q)

    def spec(path, shape, conv):
        return ".".join(map(str, path)) + ".weight", DraftTensor(shape, path, *conv)

    entries = [spec(("fc",), (d, f), t), spec(("hidden_norm",), (d,), same), spec(("norm",), (d,), same)]
    for i in range(cfg.num_hidden_layers):
        layer, attn, mlp = ("layers", i), ("layers", i, "self_attn"), ("layers", i, "mlp")
        entries += [
            spec((*layer, "input_layernorm"), (d,), same),
            spec((*layer, "post_attention_layernorm"), (d,), same),
            spec((*attn, "q_proj"), (q * h, d), heads_in(q)),
            spec((*attn, "k_proj"), (g * h, d), heads_in(g)),
            spec((*attn, "v_proj"), (g * h, d), heads_in(g)),
            spec((*attn, "o_proj"), (d, q * h), heads_out),
            spec((*attn, "q_norm"), (h,), same),
            spec((*attn, "k_norm"), (h,), same),
            spec((*mlp, "gate_proj"), (m, d), t),
            spec((*mlp, "up_proj"), (m, d), t),
            spec((*mlp, "down_proj"), (d, m), t),
        ]
    return dict(entries)


def read_config(model_dir: Path) -> dict:
    return read_config_json(model_dir, "a z-lab drafter directory", missing=CheckpointError)


# -- z-lab config.json: parse and write ------------------------------------------------------------------

# transformers' remote-code reference "<hub repo>--<module>.<class>": the DFlashDraftModel z-lab publishes beside its
# b16 drafters (dflash.py in each model repository; any of them carries the same class).
ZLAB_MODELING = "z-lab/Qwen3-8B-DFlash-b16--dflash.DFlashDraftModel"

# Keys of dflash_config this implementation honours; any other one changes the algorithm (DFlash2 selectors,
# logit soft-capping, sink biases, ...) and is refused rather than ignored.
_DFLASH_KEYS = {"mask_token_id", "target_layer_ids", "block_size", "causal"}


def _dflash_section(raw: dict[str, Any], source: str) -> dict:
    """The dflash_config object, after the checks of what this implementation supports at the top level."""
    arch = raw.get("architectures")
    if arch != ["DFlashDraftModel"]:
        raise ConfigError(f"{source}: architectures={arch!r}; only ['DFlashDraftModel'] is supported")
    if raw.get("model_type") != "qwen3":
        raise ConfigError(f"{source}: model_type={raw.get('model_type')!r}; DFlash drafters are 'qwen3'")
    dflash = raw.get("dflash_config")
    if not isinstance(dflash, dict):
        raise ConfigError(f"{source}: missing required key 'dflash_config' (with mask_token_id, target_layer_ids)")
    unknown = sorted(set(dflash) - _DFLASH_KEYS)
    if unknown:
        raise ConfigError(f"{source}: dflash_config keys {unknown} are not supported")
    if raw.get("attention_bias"):
        raise ConfigError(f"{source}: attention_bias=true is not supported (DFlash drafters have no biases)")
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{source}: hidden_act={raw['hidden_act']!r}; only 'silu' is supported")
    return dflash


def _block_size(raw: dict[str, Any], dflash: dict, source: str):
    """block_size at the top level or in dflash_config (equal where both are given)."""
    top_block, nested_block = raw.get("block_size"), dflash.get("block_size")
    if top_block is not None and nested_block is not None and int(top_block) != int(nested_block):
        raise ConfigError(f"{source}: block_size={top_block} but dflash_config.block_size={nested_block}")
    block = top_block if top_block is not None else nested_block
    if block is None:
        raise ConfigError(f"{source}: missing required key 'block_size' (top level or in dflash_config)")
    return block


def _sliding_layers(raw: dict[str, Any], dflash: dict, num_layers: int, source: str):
    """(sliding window or None, layer_types or None) as HF's Qwen3Config reads them (z-lab's reference and vLLM read
    through it): sliding_window counts only with use_sliding_window, and without layer_types the layers from
    max_window_layers on slide."""
    window = raw.get("sliding_window") if raw.get("use_sliding_window", False) else None
    layer_types = raw.get("layer_types")
    if layer_types is None and window is not None:
        first = int(raw.get("max_window_layers", 28))
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    sliding = [t == "sliding_attention" for t in (layer_types or ())]
    # z-lab: a layer is causal iff it slides, unless is_causal / dflash_config.causal overrides all layers.
    for key, value in (("is_causal", raw.get("is_causal")), ("dflash_config.causal", dflash.get("causal"))):
        if value is not None and (any(s != bool(value) for s in sliding) or (not sliding and value)):
            raise ConfigError(
                f"{source}: {key}={value} with layer_types={layer_types}: only the default (sliding layers causal, "
                "full layers bidirectional) is supported"
            )
    return window, layer_types


def parse_zlab_config(raw: dict[str, Any], source: str = "config.json") -> DrafterConfig:
    """A DrafterConfig from a z-lab DFlash config.json dict; anything this implementation would silently get wrong
    is an error naming the key (`source` names the file in messages)."""

    def need(key: str, where: dict = raw, prefix: str = ""):
        if key not in where or where[key] is None:
            raise ConfigError(f"{source}: missing required key {prefix + key!r}")
        return where[key]

    dflash = _dflash_section(raw, source)
    hidden = int(need("hidden_size"))
    if raw.get("target_hidden_size", hidden) != hidden:
        raise ConfigError(f"{source}: target_hidden_size={raw['target_hidden_size']} != hidden_size={hidden}")
    block = _block_size(raw, dflash, source)
    num_layers = int(need("num_hidden_layers"))
    num_target = int(need("num_target_layers"))
    ids = dflash.get("target_layer_ids")
    if ids is None:
        # The reference falls back to one feature per draft layer, spread by the default rule.
        try:
            ids = default_target_layer_ids(num_target, num_layers)
        except ValueError as e:
            raise ConfigError(f"{source}: no dflash_config.target_layer_ids and {e}") from e

    window, layer_types = _sliding_layers(raw, dflash, num_layers, source)
    try:
        return DrafterConfig(
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=num_layers,
            num_attention_heads=int(need("num_attention_heads")),
            num_key_value_heads=int(need("num_key_value_heads")),
            head_dim=int(raw.get("head_dim") or hidden // int(need("num_attention_heads"))),
            rms_norm_eps=float(need("rms_norm_eps")),
            rope_theta=rope_theta_of(raw, source),
            rope_scaling=rope_scaling_of(raw, source),
            max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
            vocab_size=int(need("vocab_size")),
            block_size=int(block),
            mask_token_id=int(need("mask_token_id", dflash, "dflash_config.")),
            target_layer_ids=tuple(int(i) for i in ids),
            num_target_layers=num_target,
            layer_types=tuple(layer_types) if layer_types is not None else None,
            sliding_window=int(window) if window is not None else None,
            dtype=declared_dtype(raw),
        )
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from e


def zlab_config(cfg: DrafterConfig) -> dict[str, Any]:
    """The config.json z-lab drafters ship and vLLM / SGLang read (dtype written as `torch_dtype`).

    `auto_map` makes `transformers.AutoModel.from_pretrained(dir, trust_remote_code=True)` (the route z-lab
    documents) build z-lab's own DFlashDraftModel: it names the modeling file published in z-lab's model
    repositories (ZLAB_MODELING) rather than copying it here. Without it that route silently builds a plain
    Qwen3 model with no `fc` and `hidden_norm`.
    """
    layer_types = list(cfg.layer_types or ("full_attention",) * cfg.num_hidden_layers)
    return {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": ZLAB_MODELING},
        "model_type": "qwen3",
        "block_size": cfg.block_size,
        "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids)},
        "num_target_layers": cfg.num_target_layers,
        **architecture_json(cfg),
        "layer_types": layer_types,
        "sliding_window": cfg.sliding_window,
        # HF's Qwen3Config drops sliding_window unless this is set, so a sliding draft needs it.
        "use_sliding_window": "sliding_attention" in layer_types,
    }


def tensor_problems(source, cfg: DrafterConfig, expected_dtype: str | None, extras=None) -> list[str]:
    """Every missing, unexpected, mis-shaped or mis-typed tensor of `source` against `cfg`; `extras` (name ->
    (shape, dtype kind)) are tensors that may be present beside the body and are checked when they are."""
    shapes = {name: spec.shape for name, spec in zlab_tensor_specs(cfg).items()}
    extras = extras or {}
    problems = shape_dtype_problems(source, shapes, expected_dtype, tolerated=frozenset(extras))
    for name in sorted(set(extras) & set(source.keys())):
        (want, kind), (shape, dtype) = extras[name], source.shape_dtype(name)
        if shape != want:
            problems.append(
                f"tensor {name!r} in {source.where(name)} has shape {list(shape)}, config expects {list(want)}"
            )
        if dtype not in _DTYPE_KINDS[kind]:
            problems.append(f"tensor {name!r} in {source.where(name)} has dtype {dtype}, expected {kind}")
    return problems


# safetensors dtype names of each kind of tensor a speculators checkpoint holds.
_DTYPE_KINDS = {"float": ("F32", "BF16", "F16"), "int": ("I64", "I32"), "bool": ("BOOL",)}


def _read_drafter_config(model_dir: Path, target_cfg: TargetConfig | None) -> tuple[dict, DrafterConfig, dict, set]:
    """(z-lab config dict, DrafterConfig, extra tensors, required extras) of a drafter directory in either format.

    A speculators config.json is translated to the z-lab one first; its checkpoint may hold the tensors
    speculators_format.extra_tensors names beside the body, and a reduced draft vocabulary requires its d2t."""
    raw = read_config(model_dir)
    source_name = str(model_dir / "config.json")
    if not speculators_format.is_speculators_config(raw):
        return raw, parse_zlab_config(raw, source=source_name), {}, set()
    depth = None if target_cfg is None else target_cfg.num_hidden_layers
    zraw = speculators_format.zlab_view(raw, source_name, num_target_layers=depth)
    cfg = parse_zlab_config(zraw, source=f"{source_name} (transformer_layer_config)")
    n = speculators_format.draft_vocab_size(raw, cfg.vocab_size, source_name)
    extras = speculators_format.extra_tensors(cfg.vocab_size, n, cfg.hidden_size)
    return zraw, cfg, extras, set() if n == cfg.vocab_size else {"d2t"}


def load_drafter(
    model_dir: str | Path, target_cfg: TargetConfig | None = None, *, dtype: str | None = None, mesh=None
) -> tuple[DrafterConfig, Drafter]:
    """(config, drafter) from a drafter directory in the z-lab or the speculators format (told apart by its
    config.json), checked against `target_cfg` when given.

    dtype: compute/parameter dtype after the strict check (default: the checkpoint's declared dtype).
    mesh: place each parameter by the sharding rules as it is read.
    """
    model_dir = Path(model_dir)
    raw, cfg, extras, required = _read_drafter_config(model_dir, target_cfg)
    source_name = str(model_dir / "config.json")
    if target_cfg is not None:
        check_pairing(cfg, target_cfg, source=source_name)
    declared = stored_dtype(raw)
    if declared not in SAFETENSORS_DTYPE:
        raise ConfigError(f"{source_name}: torch_dtype={declared!r}; expected one of {sorted(SAFETENSORS_DTYPE)}")
    source = SafetensorsSource(model_dir)
    problems = [
        f"missing tensor {name!r} (the mapping of a reduced draft vocabulary, draft_vocab_size < {cfg.vocab_size})"
        for name in sorted(required - set(source.keys()))
    ]
    problems += tensor_problems(source, cfg, declared, extras)
    raise_problems(f"{model_dir}: checkpoint does not match its config", problems)

    cfg = cfg if dtype is None else cfg.replace(dtype=dtype)
    drafter = abstract_drafter(cfg)
    params = {path: p for path, p in nnx.iter_graph(drafter) if isinstance(p, nnx.Param)}
    specs = zlab_tensor_specs(cfg)
    if set(params) != {s.path for s in specs.values()}:  # the module and the name map must never drift apart
        raise RuntimeError(
            f"Drafter parameter layout changed: {sorted(set(params) ^ {s.path for s in specs.values()})}"
        )
    shardings = None if mesh is None else param_shardings(drafter, mesh)
    jdtype = jnp_dtype(cfg.dtype)
    for name, spec in specs.items():
        value = spec.to_param(jnp.asarray(source.get(name))).astype(jdtype)
        check_finite(value, f"{source.where(name)}: {name}")
        if shardings is not None:
            value = jax.device_put(value, shardings[spec.path])
        params[spec.path].set_value(value)
    return cfg, drafter


# The draft vocabulary a drafter was trained on, beside its exported files. The z-lab format has no field for one
# and the speculators format's (d2t + a reduced lm_head) is not written, so servers ignore the file and use the full
# lm_head; this project's decoder reads it (infer.loading).
DRAFT_VOCAB_FILE = "draft_vocab.json"

EXPORT_FORMATS = ("zlab", "speculators")


def export_config(cfg: DrafterConfig, fmt: str = "zlab", verifier: dict | None = None) -> dict[str, Any]:
    """The config.json of an export of `cfg` in `fmt`: z-lab's, or vLLM's speculators format around the same
    architecture keys, `verifier` ({"name_or_path", "architectures"}) naming the target a server pairs it with."""
    if fmt == "zlab":
        return zlab_config(cfg)
    if fmt == "speculators":
        return speculators_format.speculators_config(zlab_config(cfg), **{"name_or_path": None, **(verifier or {})})
    raise ValueError(f"format={fmt!r}: expected one of {EXPORT_FORMATS}")


def export_drafter(
    drafter: Drafter,
    cfg: DrafterConfig,
    out_dir: str | Path,
    dtype: str = "bfloat16",
    draft_vocab=None,
    *,
    fmt: str = "zlab",
    verifier: dict | None = None,
) -> Path:
    """Write config.json + model.safetensors, tensors cast to `dtype`, in z-lab's format (fmt="zlab") or vLLM's
    speculators format (fmt="speculators": the same tensors, export_config's config.json); and draft_vocab.json
    when `draft_vocab` (the token ids of a reduced-vocabulary training loss, most frequent first) is given."""
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype={dtype!r}: export writes 'float32' or 'bfloat16'")
    if cfg.replace(dtype=drafter.config.dtype) != drafter.config:
        raise ValueError("cfg describes a different architecture than the drafter being exported")
    out_cfg = cfg.replace(dtype=dtype)
    config = export_config(out_cfg, fmt, verifier)  # a config the format refuses stops the export before any file
    out = Path(out_dir)
    vocab_file = out / DRAFT_VOCAB_FILE
    ids = None if draft_vocab is None else [int(i) for i in jax.device_get(draft_vocab)]
    if ids is not None:
        _check_draft_vocab(ids, cfg.vocab_size, str(vocab_file))
    out.mkdir(parents=True, exist_ok=True)
    params = {path: p for path, p in nnx.iter_graph(drafter) if isinstance(p, nnx.Param)}
    jdtype = jnp_dtype(dtype)
    tensors = {
        name: jnp.asarray(spec.to_hf(params[spec.path][...])).astype(jdtype)
        for name, spec in zlab_tensor_specs(out_cfg).items()
    }
    # format=pt: transformers' safetensors loader (z-lab's reference path) expects torch-format metadata.
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    atomic_write_json(out / "config.json", config)
    if ids is None:
        vocab_file.unlink(missing_ok=True)  # a stale one from an earlier export must not outlive its weights
    else:
        atomic_write_json(
            vocab_file, {"about": "token ids of the draft vocabulary the training loss used", "token_ids": ids}, None
        )
    return out


def load_draft_vocab(model_dir: str | Path, vocab_size: int) -> tuple[int, ...] | None:
    """The draft vocabulary saved beside a drafter (draft_vocab.json, in its order), else a speculators
    checkpoint's reduced vocabulary (its d2t mapping, ascending ids); None when it has neither. A draft_vocab.json
    and a d2t that disagree are refused."""
    path = Path(model_dir) / DRAFT_VOCAB_FILE
    mapped = _mapped_draft_vocab(Path(model_dir), vocab_size)
    if not path.is_file():
        return mapped
    try:
        ids = json.loads(path.read_text())["token_ids"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ConfigError(f"{path}: expected a JSON object with a 'token_ids' list ({e})") from None
    _check_draft_vocab(ids, vocab_size, str(path))
    if mapped is not None and sorted(ids) != list(mapped):
        raise ConfigError(f"{path}: its tokens are not the {len(mapped)} the checkpoint's d2t maps to")
    return tuple(int(i) for i in ids)


def _mapped_draft_vocab(model_dir: Path, vocab_size: int) -> tuple[int, ...] | None:
    """The reduced draft vocabulary of a speculators checkpoint (d2t, checked against t2d), or None."""
    if not (model_dir / "config.json").is_file():
        return None
    raw = read_config(model_dir)
    if not speculators_format.is_speculators_config(raw):
        return None
    source_name = str(model_dir / "config.json")
    if speculators_format.draft_vocab_size(raw, vocab_size, source_name) == vocab_size:
        return None
    source = SafetensorsSource(model_dir)
    if "d2t" not in source.keys():
        raise CheckpointError(f"{model_dir}: missing tensor 'd2t' (draft_vocab_size < {vocab_size} needs the mapping)")

    def read(name):  # integer and bool tensors, read as numpy (no float cast, no int64 truncation)
        with safe_open(source.where(name), framework="np") as f:
            return f.get_tensor(name)

    t2d = read("t2d") if "t2d" in source.keys() else None
    return speculators_format.draft_vocab_from_mappings(read("d2t"), t2d, vocab_size, source.where("d2t"))


def _check_draft_vocab(ids, vocab_size: int, source: str) -> None:
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ConfigError(f"{source}: token_ids must be a non-empty list of integers")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ConfigError(f"{source}: token id {bad[0]} is outside the vocabulary 0..{vocab_size - 1}")
    if len(set(ids)) != len(ids):
        raise ConfigError(f"{source}: token_ids repeats a token")


__all__ = [
    "CheckpointError",
    "DraftTensor",
    "EXPORT_FORMATS",
    "export_config",
    "export_drafter",
    "load_drafter",
    "parse_zlab_config",
    "tensor_problems",
    "zlab_config",
    "zlab_tensor_specs",
]
