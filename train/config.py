"""The run config: a typed, frozen tree of dataclasses built from configs/base.yml, a preset and `a.b=value`
overrides (train.presets reads the YAML). The types are the annotations below; the defaults and their meaning are
base.yml's, the one place a key is documented. `RunConfig.validate()` holds every check of a value's range or
choice and every check across keys, so a bad config is refused, naming its key, before anything heavy runs."""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from train.presets import resolve, suggest

# target.attention: the training forward's causal attention (dflash_model.target.forward's `attention`)
ATTENTION_KINDS = ("einsum", "xla", "cudnn")


def _bounds(low=None, high=None, *, above=None, choices=None, key=None) -> Any:
    """A field's range (low <= v <= high, or v > above) or choices, checked by validate(); `key`: its name in the
    YAML when that is not a Python name (checkpoint.async)."""
    return field(metadata={"low": low, "high": high, "above": above, "choices": choices, "key": key})


# The sections, in base.yml's order. Lists become tuples (frozen all the way down) except inside the free-form
# mappings target.arch, train.lr_ratio and blocks, which stay dicts.


@dataclass(frozen=True)
class Target:
    path: str | None
    preset: str | None
    arch: dict
    dtype: str = _bounds(choices=("float32", "bfloat16"))
    maxtext: str | None
    attention: str = _bounds(choices=ATTENTION_KINDS)


@dataclass(frozen=True)
class Drafter:
    preset: str | None
    num_layers: int = _bounds(1)
    n_features: int = _bounds(1)
    target_layer_ids: tuple[int, ...] | None
    mask_token_id: int | None
    intermediate_size: int | None = _bounds(1)
    layer_types: tuple[str, ...] | None
    sliding_window: int | None = _bounds(1)
    init_logit_std: float | None = _bounds(0.0)
    init: str | None
    init_layers: tuple[int | None, ...] | None
    init_vocab: bool


@dataclass(frozen=True)
class Train:
    lr: float = _bounds(above=0.0)
    warmup_ratio: float = _bounds(0.0, 1.0)
    schedule: str = _bounds(choices=("cosine", "constant"))
    final_lr_ratio: float = _bounds(0.0, 1.0)
    weight_decay: float = _bounds(0.0)
    b1: float
    b2: float
    grad_clip: float = _bounds(0.0)
    lr_ratio: dict
    compute_dtype: str = _bounds(choices=("float32", "bfloat16"))
    batch_size: int = _bounds(1)
    max_len: int = _bounds(2)
    steps: int | None = _bounds(1)
    epochs: int = _bounds(1)


@dataclass(frozen=True)
class Mesh:
    data: int
    fsdp: int
    tensor: int


@dataclass(frozen=True)
class Checkpoint:
    dir: str | None
    every_steps: int = _bounds(1)
    max_to_keep: int | None = _bounds(2)  # >= 2: a damaged latest checkpoint has a predecessor
    asynchronous: bool = _bounds(key="async")


@dataclass(frozen=True)
class Log:
    every: int = _bounds(1)
    tensorboard: bool
    profile_steps: int = _bounds(0)
    profile_start: int = _bounds(1)


@dataclass(frozen=True)
class Features:
    mode: str = _bounds(choices=("online", "offline"))
    cache_dir: str | None
    zero: bool


@dataclass(frozen=True)
class Regenerate:
    prompts: str
    limit: int = _bounds(1)
    heldout: int = _bounds(0)
    max_new_tokens: int = _bounds(1)
    max_prompt_tokens: int = _bounds(1)
    batch_size: int = _bounds(1)
    output: str | None


DATA_SOURCES = ("synthetic", "regenerate", "mix", "sharegpt")


@dataclass(frozen=True)
class Data:
    source: str | None  # null in a recipe whose data is given on the command line; a run refuses it
    tokenizer: str | None
    labels: str = _bounds(choices=("text", "target"))
    num_records: int = _bounds(1)
    skip: int = _bounds(0)
    limit: int | None = _bounds(1)
    regenerate: Regenerate
    mix: tuple[str, ...]
    mix_seed: int


@dataclass(frozen=True)
class Export:
    enabled: bool
    dtype: str = _bounds(choices=("float32", "bfloat16"))
    format: str = _bounds(choices=("zlab", "speculators", "both"))
    verifier: str | None  # an HF model id or directory


# eval.prompts names; anything else is a JSONL path
EVAL_SETS = ("heldout", "sharegpt", "humaneval", "gsm8k", "mtbench")


@dataclass(frozen=True)
class Eval:
    enabled: bool
    prompts: str
    records: int | None = _bounds(1)
    num_prompts: int = _bounds(1)
    max_new_tokens: int = _bounds(1)
    max_prompt_tokens: int = _bounds(1)
    block: int | None = _bounds(2, 1024)  # inference bounds K (infer.spec.MAX_BLOCK)
    also_blocks: tuple[int, ...]
    ngram_block: int = _bounds(2, 1024)
    shipped: str | None
    fullvocab: bool


@dataclass(frozen=True)
class Debug:
    nan_at_step: int | None = _bounds(1)
    sleep_per_step: float = _bounds(0.0)


@dataclass(frozen=True)
class RunConfig:
    run_dir: str
    seed: int
    xla_flags: str
    target: Target
    drafter: Drafter
    block_size: int = _bounds(2)
    blocks: dict
    gamma: float | None = _bounds(above=0.0)
    num_anchors: int = _bounds(1)
    anchor_buckets: int = _bounds(1)
    ce_chunk: int = _bounds(1)
    loss_positions: int | None = _bounds(1)
    draft_vocab: int | None = _bounds(1)
    distill_weight: float = _bounds(0.0, 1.0)
    train: Train
    mesh: Mesh
    checkpoint: Checkpoint
    log: Log
    features: Features
    data: Data
    export: Export
    eval: Eval
    debug: Debug

    @classmethod
    def from_dict(cls, tree: dict) -> RunConfig:
        """Build from a resolved dict (train.presets), checking every value's type against the annotations."""
        return _build(cls, tree, "")

    def to_dict(self) -> dict:
        """The YAML/JSON view (lists and the YAML's own key names), e.g. a run directory's config.yml."""
        return _plain(self)

    def dump(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def with_data(self, **changes) -> RunConfig:
        """This config with data keys replaced (e.g. source= the JSONL a regeneration wrote), validated again."""
        return dataclasses.replace(self, data=dataclasses.replace(self.data, **changes)).validate()

    def validate(self) -> RunConfig:
        """Ranges and choices of every key, then every check across keys; each error names the key."""
        _check_bounds(self, "")
        if self.block_size > self.train.max_len:
            raise ValueError(
                f"block_size={self.block_size} exceeds train.max_len={self.train.max_len}: "
                "a block must fit in a training row"
            )
        if self.target.path is None and self.target.preset is None:
            raise ValueError("set target.path (real weights) or target.preset (random weights)")
        if self.target.attention == "cudnn" and self.target.dtype != "bfloat16":
            raise ValueError(
                "target.attention=cudnn needs target.dtype=bfloat16: cuDNN's flash attention takes 16-bit inputs"
            )
        if self.target.attention != "einsum" and self.target.maxtext is not None:
            raise ValueError(
                f"target.attention={self.target.attention} chooses the Tunix target's attention; a MaxText target "
                "(target.maxtext) runs MaxText's own: leave target.attention=einsum"
            )
        if self.distill_weight and self.features.mode != "online":
            raise ValueError(
                f"distill_weight={self.distill_weight} needs features.mode=online (the teacher is the "
                f"target's last layer, computed in the step), not {self.features.mode!r}"
            )
        _check_source(self.data.source)
        _check_drafter(self.drafter, self.draft_vocab)
        _check_eval(self.eval, self.block_size)
        _check_late_files(self)
        return self


def _yaml_key(f: dataclasses.Field) -> str:
    return f.metadata.get("key") or f.name


def _type_name(hint) -> str:
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in args)
    if typing.get_origin(hint) is tuple:
        return "list"
    return getattr(hint, "__name__", str(hint))


def _conforms(value, hint) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(value, a) for a in args)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:  # an int is a fine float; a bool is not a number
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin is tuple:  # tuple[X, ...]: a YAML list of X
        return isinstance(value, (list, tuple)) and all(_conforms(v, args[0]) for v in value)
    return isinstance(value, hint)


def _build(cls, tree, prefix: str):
    if not isinstance(tree, dict):
        raise ValueError(f"{prefix.rstrip('.')}={tree!r}: expected a mapping of keys")
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        key, hint = _yaml_key(f), hints[f.name]
        value = tree[key]  # train.presets merged base.yml in: every key is present
        if dataclasses.is_dataclass(hint):
            out[f.name] = _build(hint, value, f"{prefix}{key}.")
            continue
        if not _conforms(value, hint):
            raise ValueError(f"{prefix}{key}={value!r}: expected {_type_name(hint)} (configs/base.yml documents it)")
        if isinstance(value, float) and not math.isfinite(value):  # YAML reads .inf and .nan as numbers
            raise ValueError(f"{prefix}{key}={value!r}: must be a finite number")
        out[f.name] = tuple(value) if isinstance(value, list) else value
    return cls(**out)


def _as_floats(obj):
    """`obj` with every int in a float key made a float (`gamma: 7` in YAML), so no reader casts config values;
    after validate(), whose messages show each value as it was written."""
    hints = typing.get_type_hints(type(obj))
    changes = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            changes[f.name] = _as_floats(value)
        elif isinstance(value, int) and not isinstance(value, bool) and not _takes_int(hints[f.name]):
            changes[f.name] = float(value)
    return dataclasses.replace(obj, **changes)


def _takes_int(hint) -> bool:
    """Whether an int value is an int under `hint` (int, int | None, a free-form dict, ...) rather than a float."""
    if hint is float:
        return False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return all(_takes_int(a) for a in typing.get_args(hint) if a is not type(None))
    return True


def _plain(obj):
    if dataclasses.is_dataclass(obj):
        return {_yaml_key(f): _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    return obj


def _check_bounds(obj, prefix: str) -> None:
    for f in dataclasses.fields(obj):
        key, value = f"{prefix}{_yaml_key(f)}", getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            _check_bounds(value, key + ".")
            continue
        m = f.metadata
        if value is None or not m:
            continue
        if m["choices"] is not None and value not in m["choices"]:
            raise ValueError(f"{key}={value!r}: expected one of {m['choices']}")
        if m["above"] is not None and value <= m["above"]:
            raise ValueError(f"{key}={value!r}: must be > {m['above']}")
        if m["low"] is not None and value < m["low"]:
            raise ValueError(f"{key}={value!r}: must be >= {m['low']}")
        if m["high"] is not None and value > m["high"]:
            raise ValueError(f"{key}={value!r}: must be <= {m['high']}")


def _check_source(source: str | None) -> None:
    if source is None:
        raise ValueError(f"data.source=null: give the data, one of {DATA_SOURCES} or a file (data.source=FILE)")
    if (
        source not in DATA_SOURCES
        and not Path(source).expanduser().exists()
        and difflib.get_close_matches(source, DATA_SOURCES, cutoff=0.6)
    ):
        # A typo of a source name would otherwise be read as a file path. Other missing files are named by the
        # loader when the data is read (a preset may name a file that a first step of its recipe writes).
        raise ValueError(
            f"data.source={source!r}: no such file, and not one of {DATA_SOURCES}{suggest(source, DATA_SOURCES)}"
        )


NAMED_STARTS = ("copy",)  # drafter.init values that name a start (train.starts.STARTS) rather than a directory


def start_of(init) -> str:
    """The one reading of drafter.init: the key of train.starts.STARTS it selects (null a random start)."""
    if init is None:
        return "random"
    return init if init in NAMED_STARTS else "directory"


def _check_drafter(d: Drafter, draft_vocab) -> None:
    if d.preset is None and d.mask_token_id is None:
        raise ValueError("drafter.mask_token_id is required when drafter.preset is null")
    if d.sliding_window is not None and d.layer_types is None:
        raise ValueError(
            f"drafter.sliding_window={d.sliding_window} needs drafter.layer_types with a sliding_attention layer"
        )
    if d.target_layer_ids is not None and len(d.target_layer_ids) != d.n_features:
        raise ValueError(
            f"drafter.target_layer_ids={list(d.target_layer_ids)} has {len(d.target_layer_ids)} "
            f"layers but drafter.n_features={d.n_features}: set them to agree"
        )
    if d.target_layer_ids is not None and len(set(d.target_layer_ids)) < len(d.target_layer_ids):
        raise ValueError(
            f"drafter.target_layer_ids={list(d.target_layer_ids)}: a layer named twice (each feature is one layer)"
        )
    init_is_dir = start_of(d.init) == "directory"  # the other starts build a drafter, load none
    if d.init_layers is not None and not init_is_dir:
        raise ValueError(
            f"drafter.init_layers={list(d.init_layers)} grows a loaded drafter: it needs drafter.init "
            f"to name a drafter directory, not {d.init!r}"
        )
    if d.init_vocab and not init_is_dir:
        raise ValueError(f"drafter.init_vocab=true needs drafter.init to be a drafter directory, not {d.init!r}")
    if d.init_vocab and draft_vocab is None:
        raise ValueError("drafter.init_vocab=true needs draft_vocab (the size of the saved vocabulary)")


def _check_eval(e: Eval, block_size: int) -> None:
    if e.block is not None and e.block > block_size:
        raise ValueError(
            f"eval.block={e.block}: more than the trained block_size={block_size} (a drafter decodes at "
            "its trained K or below)"
        )
    eval_k = e.block if e.block is not None else block_size
    bad = [k for k in e.also_blocks if not 2 <= k <= eval_k]
    if bad:
        raise ValueError(f"eval.also_blocks={list(e.also_blocks)}: {bad[0]!r} is not a block size in 2..{eval_k}")
    if len(set(e.also_blocks)) < len(e.also_blocks):
        raise ValueError(f"eval.also_blocks={list(e.also_blocks)}: a block size named twice")


def _check_late_files(cfg: RunConfig) -> None:
    """Files a run reads only after training (the end-of-run eval's prompts and shipped drafter) or after loading
    the target (the prompts to regenerate replies to), checked when the config is read: a missing one is named by
    its key before anything runs, not found after hours of training and the export. Relative paths are read from
    the current directory, as the run reads them."""
    e = cfg.eval
    if e.enabled:
        if e.prompts not in EVAL_SETS and not Path(e.prompts).expanduser().is_file():
            raise ValueError(f"eval.prompts={e.prompts!r}: no such file, and not one of {EVAL_SETS}")
        if e.shipped is not None and not (Path(e.shipped).expanduser() / "config.json").is_file():
            raise ValueError(
                f"eval.shipped={e.shipped!r}: no drafter directory there (no config.json); give one, or null for none"
            )
    if cfg.data.source == "mix":
        _check_mix(cfg.data.mix)
    regen = cfg.data.regenerate.prompts
    if cfg.data.source == "regenerate" and regen != "sharegpt" and not Path(regen).expanduser().is_file():
        raise ValueError(f"data.regenerate.prompts={regen!r}: no such file, and not 'sharegpt'")


def _check_mix(parts) -> None:
    """data.mix for source=mix: a non-empty list of data/mix.py parts whose files exist (named by key if not)."""
    from data.mix import parse_part

    if not parts:
        raise ValueError(f"data.mix={list(parts)!r}: data.source=mix needs a list of parts (FILE[+FILE...][:take=N])")
    for spec in parts:
        for f in parse_part(str(spec)).files:
            if not Path(f).expanduser().is_file():
                raise ValueError(f"data.mix part {spec!r}: no such file {f!r}")


def load_config(name_or_path: str | Path = "smollm2-135m", overrides: list[str] | None = None) -> RunConfig:
    """Preset (a name in configs/ or a YAML path) + `a.b=value` overrides: typed and validated. Every `blocks:`
    entry is checked as if its K ran, so a typo in the K=128 entry is found by a K=16 run too."""
    tree, at_k = resolve(name_or_path, overrides or [])
    for k, entry in at_k.items():
        try:
            RunConfig.from_dict(entry).validate()
        except ValueError as e:
            raise ValueError(f"blocks.{k}: {e}") from None
    # `{block_size}` in run_dir: `--block 16` and `--block 128` of one preset get their own run directories
    # (a checkpoint refuses to resume under another block size).
    cfg = _as_floats(RunConfig.from_dict(tree).validate())
    return dataclasses.replace(cfg, run_dir=cfg.run_dir.replace("{block_size}", str(cfg.block_size)))
