"""Training presets as YAML: configs/*.yml with `base:` inheritance, strict `a.b=value` overrides, per-K `blocks:`
entries and the command line's `--config` / `--block`. Everything here is a plain nested dict checked against the
keys of configs/base.yml; train.config turns the result into the typed, frozen run config."""

from __future__ import annotations

import copy
import difflib
from pathlib import Path
from typing import Any

import yaml

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
BASE = CONFIG_DIR / "base.yml"


class ConfigKeyError(KeyError):
    """An override or preset names a key base.yml does not define (a typo must not silently train the default)."""

    def __str__(self) -> str:
        return self.args[0]


def _find(name_or_path: str | Path) -> Path:
    p = Path(name_or_path)
    # CONFIG_DIR.parent: a recipe kept beside its drafter (drafters/NAME/recipe/STAGE.yml) from any directory
    for cand in (p, CONFIG_DIR / p, CONFIG_DIR / f"{p}.yml", CONFIG_DIR.parent / p):
        if cand.is_file():
            return cand
    known = sorted(q.stem for q in CONFIG_DIR.glob("*.yml"))
    raise FileNotFoundError(f"config {str(name_or_path)!r} not found (a path, or one of {known})")


def read_yaml(path: Path, seen: tuple = ()) -> dict:
    """A preset with its `base:` chain merged in (no schema check yet)."""
    if path.resolve() in seen:
        raise ValueError(f"config inheritance cycle through {path}")
    raw = yaml.safe_load(path.read_text()) or {}
    base = raw.pop("base", None)
    if base is None:
        return raw
    parent = read_yaml((path.parent / base) if not Path(base).is_absolute() else Path(base), seen + (path.resolve(),))
    return merge(parent, raw, schema=None, where=str(path))


def suggest(key: str, options, prefix: str = "") -> str:
    close = difflib.get_close_matches(key, list(options), n=3, cutoff=0.5)
    if close:
        return f"; did you mean {', '.join(prefix + c for c in close)}?"
    return f"; known: {', '.join(prefix + o for o in sorted(options))}"


def merge(into: dict, new: dict, schema: dict | None, where: str, prefix: str = "") -> dict:
    """Deep-merge `new` over `into`. With a schema, every key of `new` must exist in it; free-form dicts (an
    empty dict in the schema, like target.arch) take any keys."""
    out = copy.deepcopy(into)
    for k, v in new.items():
        full = f"{prefix}{k}"
        if schema is not None and schema != {} and k not in schema:
            raise ConfigKeyError(f"unknown config key {full!r} in {where}{suggest(k, schema, prefix)}")
        sub = None if schema is None or schema == {} else schema[k]
        if isinstance(v, dict) and isinstance(out.get(k), dict) and out.get(k) != {}:
            out[k] = merge(out[k], v, sub, where, full + ".")
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
        node: Any = parse_value(text)
        for part in reversed(dotted.split(".")):
            node = {part: node}
        cfg = merge(cfg, node, schema, where=f"override {item!r}")
    return cfg


# Keys a `blocks:` entry may not set: K picks the entry, and entries do not nest.
_NOT_PER_BLOCK = ("block_size", "blocks")


def resolve(name_or_path: str | Path, overrides: list[str]) -> tuple[dict, dict[int, dict]]:
    """(the run's settings as a dict, {K: that preset's settings had it run at K}) for a preset (a name in
    configs/ or a YAML path) and `a.b=value` overrides, every key checked against configs/base.yml. The per-K
    dicts let the caller check a `blocks:` entry whichever K runs: a typo in the K=128 entry is found at K=16."""
    schema = read_yaml(BASE)
    path = _find(name_or_path)
    preset = merge(schema, read_yaml(path), schema, where=str(path))  # a preset may only set keys base.yml defines
    cfg = apply_overrides(preset, overrides, schema)
    blocks = _block_entries(cfg, where=str(path))
    # Each entry as a run at its K reads it; merging with the schema checks the entry's keys.
    at_k = {
        k: merge(cfg, {**entry, "block_size": k}, schema, where=f"{path} blocks.{k}", prefix=f"blocks.{k}.")
        for k, entry in blocks.items()
    }
    if int(cfg["block_size"]) in blocks:
        # The preset's values for this K, then the command line's again: an explicit override still wins.
        preset = merge(preset, blocks[int(cfg["block_size"])], schema, where=f"{path} blocks")
        cfg = apply_overrides(preset, overrides, schema)
    cfg["blocks"] = blocks  # one entry a K, however its key was spelled
    return cfg, at_k


def _block_entries(cfg: dict, where: str) -> dict[int, dict]:
    """`blocks: {K: {key: value}}`, the settings a preset ships for block size K (`--block K`)."""
    out: dict[int, dict] = {}
    for k, entry in (cfg.get("blocks") or {}).items():
        if not str(k).isdigit():
            raise ValueError(f"blocks.{k}: a blocks key is a block size (an int), not {k!r}")
        if not isinstance(entry, dict):
            raise ValueError(f"blocks.{k}={entry!r}: expected a mapping of config keys (e.g. num_anchors: 64)")
        # YAML reads `128:` as an int, an override `blocks.128.x=...` as the string '128': one entry.
        out[int(k)] = merge(out.get(int(k), {}), entry, schema=None, where=where)
    for k, entry in out.items():
        for key in _NOT_PER_BLOCK:
            if key in entry:
                raise ConfigKeyError(f"config key 'blocks.{k}.{key}' in {where}: a blocks entry cannot set {key}")
    return out


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
