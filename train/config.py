"""Training config: YAML presets in configs/ with `base:` inheritance and strict, typed `a.b=value` overrides."""

from __future__ import annotations

import copy
import difflib
from pathlib import Path
from typing import Any

import yaml

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


class ConfigKeyError(KeyError):
    """An override or preset names a key base.yml does not define (a typo must not silently train the default)."""

    def __str__(self) -> str:
        return self.args[0]


class Config(dict):
    """A nested dict with attribute access (`cfg.train.lr`); still a plain dict for YAML/JSON dumps."""

    def __getattr__(self, name: str) -> Any:
        try:
            value = self[name]
        except KeyError:
            raise AttributeError(name) from None
        return Config(value) if isinstance(value, dict) and not isinstance(value, Config) else value

    def to_dict(self) -> dict:
        return copy.deepcopy(dict(self))

    def dump(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def _find(name_or_path: str | Path) -> Path:
    p = Path(name_or_path)
    # CONFIG_DIR.parent: a recipe kept beside its drafter (drafters/NAME/recipe/STAGE.yml) from any directory
    for cand in (p, CONFIG_DIR / p, CONFIG_DIR / f"{p}.yml", CONFIG_DIR.parent / p):
        if cand.is_file():
            return cand
    known = sorted(q.stem for q in CONFIG_DIR.glob("*.yml"))
    raise FileNotFoundError(f"config {str(name_or_path)!r} not found (a path, or one of {known})")


def _read(path: Path, seen: tuple = ()) -> dict:
    if path.resolve() in seen:
        raise ValueError(f"config inheritance cycle through {path}")
    raw = yaml.safe_load(path.read_text()) or {}
    base = raw.pop("base", None)
    if base is None:
        return raw
    parent = _read((path.parent / base) if not Path(base).is_absolute() else Path(base), seen + (path.resolve(),))
    return _merge(parent, raw, schema=None, where=str(path))


def _suggest(key: str, options, prefix: str = "") -> str:
    close = difflib.get_close_matches(key, list(options), n=3, cutoff=0.5)
    if close:
        return f"; did you mean {', '.join(prefix + c for c in close)}?"
    return f"; known: {', '.join(prefix + o for o in sorted(options))}"


def _merge(into: dict, new: dict, schema: dict | None, where: str, prefix: str = "") -> dict:
    """Deep-merge `new` over `into`. With a schema, every key of `new` must exist in it; free-form dicts (an
    empty dict in the schema, like target.arch) take any keys."""
    out = copy.deepcopy(into)
    for k, v in new.items():
        full = f"{prefix}{k}"
        if schema is not None and schema != {} and k not in schema:
            raise ConfigKeyError(f"unknown config key {full!r} in {where}{_suggest(k, schema, prefix)}")
        sub = None if schema is None or schema == {} else schema[k]
        if isinstance(v, dict) and isinstance(out.get(k), dict) and out.get(k) != {}:
            out[k] = _merge(out[k], v, sub, where, full + ".")
        else:
            out[k] = copy.deepcopy(v)
    return out


def parse_value(text: str) -> Any:
    """Typed value of an override: YAML scalars (1 -> int, 6e-4 -> float, true, null, [0, 2], {a: 1})."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    # YAML 1.1 reads "6e-4" as a string (it wants a dot and a sign); people type floats that way.
    return float(text) if isinstance(value, str) and _is_float(text) else value


def _is_float(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def apply_overrides(cfg: dict, overrides: list[str], schema: dict) -> dict:
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r}: expected key=value (e.g. train.lr=3e-4)")
        dotted, text = item.split("=", 1)
        value = parse_value(text)
        node: Any = value
        for part in reversed(dotted.split(".")):
            node = {part: node}
        cfg = _merge(cfg, node, schema, where=f"override {item!r}")
    return cfg


def load_config(name_or_path: str | Path = "smollm2-135m", overrides: list[str] | None = None) -> Config:
    """Preset (name in configs/ or a YAML path) + `a.b=value` overrides, checked against configs/base.yml."""
    schema = _read(CONFIG_DIR / "base.yml")
    path = _find(name_or_path)
    raw = _read(path)
    preset = _merge(schema, raw, schema, where=str(path))  # a preset may only set keys base.yml defines
    cfg = apply_overrides(preset, overrides or [], schema)
    blocks = _block_presets(cfg, schema, where=str(path))
    if int(cfg["block_size"]) in blocks:
        # The preset's values for this K, then the command line's again: an explicit override still wins.
        preset = _merge(preset, blocks[int(cfg["block_size"])], schema, where=f"{path} blocks")
        cfg = apply_overrides(preset, overrides or [], schema)
    cfg["blocks"] = blocks  # one entry a K, however its key was spelled
    _validate(cfg, schema)
    # `{block_size}` in run_dir: `--block 16` and `--block 128` of one preset get their own run directories
    # (a checkpoint refuses to resume under another block size).
    cfg["run_dir"] = str(cfg["run_dir"]).replace("{block_size}", str(cfg["block_size"]))
    return Config(cfg)


# Keys a `blocks:` entry may not set: K picks the entry, and entries do not nest.
_NOT_PER_BLOCK = ("block_size", "blocks")


def _block_presets(cfg: dict, schema: dict, where: str) -> dict[int, dict]:
    """`blocks: {K: {key: value}}`, the settings a preset ships for block size K (`--block K`), checked whichever
    K runs: every entry's keys must be keys of base.yml, and its values must pass the checks a run at its K does,
    so a typo in the K=128 entry is found by a K=16 run too."""
    out: dict[int, dict] = {}
    for k, entry in (cfg.get("blocks") or {}).items():
        if not str(k).isdigit():
            raise ValueError(f"blocks.{k}: a blocks key is a block size (an int), not {k!r}")
        if not isinstance(entry, dict):
            raise ValueError(f"blocks.{k}={entry!r}: expected a mapping of config keys (e.g. num_anchors: 64)")
        # YAML reads `128:` as an int, an override `blocks.128.x=...` as the string '128': one entry.
        out[int(k)] = _merge(out.get(int(k), {}), entry, schema=None, where=where)
    for k, entry in out.items():
        for key in _NOT_PER_BLOCK:
            if key in entry:
                raise ConfigKeyError(f"config key 'blocks.{k}.{key}' in {where}: a blocks entry cannot set {key}")
        merged = _merge(cfg, {**entry, "block_size": k}, schema, where=f"{where} blocks.{k}", prefix=f"blocks.{k}.")
        try:
            _validate(merged, schema)
        except ValueError as e:
            raise ValueError(f"blocks.{k}: {e}") from None
    return out


# Keys whose default in base.yml is null, so the schema cannot give their type: (type, lower bound), None allowed.
_NULLABLE = {
    "gamma": (float, 0.0),
    "loss_positions": (int, 1),
    "draft_vocab": (int, 1),
    "train.steps": (int, 1),
    "data.limit": (int, 1),
    "eval.block": (int, 2),
    "eval.records": (int, 1),
    "drafter.intermediate_size": (int, 1),
    "drafter.sliding_window": (int, 1),
    "drafter.init_logit_std": (float, 0.0),
    "checkpoint.max_to_keep": (int, 2),
    "debug.nan_at_step": (int, 1),
}
# Lower bounds of keys with a non-null default (their type is the default's): a count of zero or a negative
# rate is a typo, and found here it costs nothing; found at step 1 (or never) it costs a run.
_AT_LEAST = {
    "block_size": 2,
    "num_anchors": 1,
    "anchor_buckets": 1,
    "ce_chunk": 1,
    "train.lr": 0.0,
    "train.batch_size": 1,
    "train.max_len": 2,
    "train.epochs": 1,
    "train.warmup_ratio": 0.0,
    "train.final_lr_ratio": 0.0,
    "train.weight_decay": 0.0,
    "train.grad_clip": 0.0,
    "checkpoint.every_steps": 1,
    "log.every": 1,
    "log.profile_steps": 0,
    "log.profile_start": 1,
    "data.num_records": 1,
    "data.skip": 0,
    "drafter.num_layers": 1,
    "drafter.n_features": 1,
    "eval.num_prompts": 1,
    "eval.max_new_tokens": 1,
    "eval.max_prompt_tokens": 1,
    "eval.ngram_block": 2,
    "data.regenerate.limit": 1,
    "data.regenerate.heldout": 0,
    "data.regenerate.max_new_tokens": 1,
    "data.regenerate.max_prompt_tokens": 1,
    "data.regenerate.batch_size": 1,
    "debug.sleep_per_step": 0.0,
    "distill_weight": 0.0,
}
_STRICTLY_POSITIVE = {"train.lr", "gamma"}
# eval's block sizes as inference bounds them (infer.spec.MAX_BLOCK); block_size is bounded by train.max_len
_AT_MOST = {
    "train.warmup_ratio": 1.0,
    "train.final_lr_ratio": 1.0,
    "distill_weight": 1.0,
    "eval.block": 1024,
    "eval.ngram_block": 1024,
}
DATA_SOURCES = ("synthetic", "regenerate", "mix", "sharegpt")


def _leaves(tree: dict, prefix: str = ""):
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            yield from _leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def _get(tree: dict, dotted: str):
    for part in dotted.split("."):
        tree = tree[part]
    return tree


def _check_type(key: str, value, default) -> None:
    """value must have the type of base.yml's default (an int is a fine float; bools are not numbers)."""
    if value is None or default is None:
        return
    want = type(default)
    ok = (
        isinstance(value, bool)
        if want is bool
        else isinstance(value, int) and not isinstance(value, bool)
        if want is int
        else isinstance(value, (int, float)) and not isinstance(value, bool)
        if want is float
        else isinstance(value, want)
    )
    if not ok:
        raise ValueError(f"{key}={value!r}: expected {want.__name__} (as {key}={default!r} in configs/base.yml)")


def _check_range(key: str, value, kind=None, low=None) -> None:
    if value is None:
        return
    if kind is not None and not (
        isinstance(value, (int, float)) and not isinstance(value, bool) and (kind is float or isinstance(value, int))
    ):
        raise ValueError(f"{key}={value!r}: expected {kind.__name__} or null")
    if low is not None and (value <= low if key in _STRICTLY_POSITIVE else value < low):
        raise ValueError(f"{key}={value!r}: must be {'>' if key in _STRICTLY_POSITIVE else '>='} {low}")
    high = _AT_MOST.get(key)
    if high is not None and value > high:
        raise ValueError(f"{key}={value!r}: must be <= {high}")


def _validate(cfg: dict, schema: dict | None = None) -> None:
    """Types, ranges and choices of every key, then the checks across keys, before anything heavy runs; each error
    names the key."""
    if schema is not None:
        for key, default in _leaves(schema):
            if key.startswith("target.arch"):
                continue
            _check_type(key, _get(cfg, key), default)
    for key, (kind, low) in _NULLABLE.items():
        _check_range(key, _get(cfg, key), kind, low)
    for key, low in _AT_LEAST.items():
        _check_range(key, _get(cfg, key), None, low)
    for (a, b), allowed in _CHOICES.items():
        if cfg[a][b] not in allowed:
            raise ValueError(f"{a}.{b}={cfg[a][b]!r}: expected one of {allowed}")
    verifier = cfg["export"]["verifier"]
    if verifier is not None and not isinstance(verifier, str):
        raise ValueError(f"export.verifier={verifier!r}: expected an HF model id or directory (a string) or null")
    if cfg["block_size"] > cfg["train"]["max_len"]:
        raise ValueError(
            f"block_size={cfg['block_size']} exceeds train.max_len={cfg['train']['max_len']}: "
            "a block must fit in a training row"
        )
    if cfg["target"]["path"] is None and cfg["target"]["preset"] is None:
        raise ValueError("set target.path (real weights) or target.preset (random weights)")
    _check_source(str(cfg["data"]["source"]))
    _check_drafter(cfg["drafter"], cfg["draft_vocab"])
    _check_eval(cfg["eval"], cfg["block_size"])
    _check_late_files(cfg)


_CHOICES = {
    ("features", "mode"): ("online", "offline"),
    ("train", "schedule"): ("cosine", "constant"),
    ("target", "dtype"): ("float32", "bfloat16"),
    ("export", "dtype"): ("float32", "bfloat16"),
    ("export", "format"): ("zlab", "speculators", "both"),
    ("train", "compute_dtype"): ("float32", "bfloat16"),
    ("data", "labels"): ("text", "target"),
}


def _check_source(source: str) -> None:
    if (
        source not in DATA_SOURCES
        and not Path(source).expanduser().exists()
        and difflib.get_close_matches(source, DATA_SOURCES, cutoff=0.6)
    ):
        # A typo of a source name would otherwise be read as a file path. Other missing files are named by the
        # loader when the data is read (a preset may name a file that a first step of its recipe writes).
        raise ValueError(
            f"data.source={source!r}: no such file, and not one of {DATA_SOURCES}{_suggest(source, DATA_SOURCES)}"
        )


NAMED_STARTS = ("copy",)  # drafter.init values that name a start (train.starts.STARTS) rather than a directory


def start_of(init) -> str:
    """The one reading of drafter.init: the key of train.starts.STARTS it selects (null a random start)."""
    if init is None:
        return "random"
    return init if init in NAMED_STARTS else "directory"


def _check_drafter(d: dict, draft_vocab) -> None:
    if d["target_layer_ids"] is not None and len(d["target_layer_ids"]) != d["n_features"]:
        raise ValueError(
            f"drafter.target_layer_ids={list(d['target_layer_ids'])} has {len(d['target_layer_ids'])} "
            f"layers but drafter.n_features={d['n_features']}: set them to agree"
        )
    init_is_dir = start_of(d["init"]) == "directory"  # the other starts build a drafter, load none
    if d["init_layers"] is not None and not init_is_dir:
        raise ValueError(
            f"drafter.init_layers={list(d['init_layers'])} grows a loaded drafter: it needs drafter.init "
            f"to name a drafter directory, not {d['init']!r}"
        )
    if d["init_vocab"] and not init_is_dir:
        raise ValueError(f"drafter.init_vocab=true needs drafter.init to be a drafter directory, not {d['init']!r}")
    if d["init_vocab"] and draft_vocab is None:
        raise ValueError("drafter.init_vocab=true needs draft_vocab (the size of the saved vocabulary)")


def _check_eval(e: dict, block_size: int) -> None:
    if e["block"] is not None and e["block"] > block_size:
        raise ValueError(
            f"eval.block={e['block']}: more than the trained block_size={block_size} (a drafter decodes at "
            "its trained K or below)"
        )
    eval_k = e["block"] if e["block"] is not None else block_size
    bad = [k for k in e["also_blocks"] if isinstance(k, bool) or not isinstance(k, int) or not 2 <= k <= eval_k]
    if bad:
        raise ValueError(f"eval.also_blocks={list(e['also_blocks'])}: {bad[0]!r} is not a block size in 2..{eval_k}")


# eval.prompts names; anything else is a JSONL path
EVAL_SETS = ("heldout", "sharegpt", "humaneval", "gsm8k", "mtbench")


def _check_late_files(cfg: dict) -> None:
    """Files a run reads only after training (the end-of-run eval's prompts and shipped drafter) or after loading
    the target (the prompts to regenerate replies to), checked when the config is read: a missing one is named by
    its key before anything runs, not found after hours of training and the export. Relative paths are read from
    the current directory, as the run reads them."""
    e = cfg["eval"]
    if e["enabled"]:
        prompts = str(e["prompts"])
        if prompts not in EVAL_SETS and not Path(prompts).expanduser().is_file():
            raise ValueError(f"eval.prompts={prompts!r}: no such file, and not one of {EVAL_SETS}")
        shipped = e["shipped"]
        if shipped is not None and not (Path(str(shipped)).expanduser() / "config.json").is_file():
            raise ValueError(
                f"eval.shipped={shipped!r}: no drafter directory there (no config.json); give one, or null for none"
            )
    if cfg["data"]["source"] == "mix":
        _check_mix(cfg["data"]["mix"])
    regen = cfg["data"]["regenerate"]["prompts"]
    if cfg["data"]["source"] == "regenerate" and regen != "sharegpt" and not Path(str(regen)).expanduser().is_file():
        raise ValueError(f"data.regenerate.prompts={regen!r}: no such file, and not 'sharegpt'")


def _check_mix(parts) -> None:
    """data.mix for source=mix: a non-empty list of data/mix.py parts whose files exist (named by key if not)."""
    from data.mix import parse_part

    if not isinstance(parts, list) or not parts:
        raise ValueError(f"data.mix={parts!r}: data.source=mix needs a list of parts (FILE[+FILE...][:take=N])")
    for spec in parts:
        for f in parse_part(str(spec)).files:
            if not Path(f).expanduser().is_file():
                raise ValueError(f"data.mix part {spec!r}: no such file {f!r}")


def cli_overrides(argv: list[str]) -> tuple[str, list[str]]:
    """(`--config NAME`, overrides) from argv; `--block K` is shorthand for block_size=K."""
    name, out, i = "smollm2-135m", [], 0
    while i < len(argv):
        a = argv[i]
        if a in ("--config", "-c", "--block"):
            if i + 1 >= len(argv) or argv[i + 1].startswith("-"):
                raise ValueError(f"{a} needs a value (e.g. {a} {'64' if a == '--block' else 'smollm2-135m'})")
            if a == "--block":
                out.append(f"block_size={argv[i + 1]}")
            else:
                name = argv[i + 1]
            i += 2
            continue
        if a.startswith("--config="):
            name = a.split("=", 1)[1]
        elif a.startswith("--block="):
            out.append(f"block_size={a.split('=', 1)[1]}")
        elif a.startswith("--"):
            raise ValueError(f"unknown flag {a!r}: use --config NAME, --block K, or key=value overrides")
        else:
            out.append(a)
        i += 1
    return name, out
