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
    for cand in (p, CONFIG_DIR / p, CONFIG_DIR / f"{p}.yml"):
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
    cfg = _merge(schema, raw, schema, where=str(path))  # a preset may only set keys base.yml defines
    cfg = apply_overrides(cfg, overrides or [], schema)
    _validate(cfg)
    # `{block_size}` in run_dir: `--block 16` and `--block 128` of one preset get their own run directories
    # (a checkpoint refuses to resume under another block size).
    cfg["run_dir"] = str(cfg["run_dir"]).replace("{block_size}", str(cfg["block_size"]))
    return Config(cfg)


def _validate(cfg: dict) -> None:
    choices = {("features", "mode"): ("online", "offline"), ("train", "schedule"): ("cosine", "constant"),
               ("target", "dtype"): ("float32", "bfloat16"), ("export", "dtype"): ("float32", "bfloat16"),
               ("train", "compute_dtype"): ("float32", "bfloat16"), ("data", "labels"): ("text", "target")}
    for (a, b), allowed in choices.items():
        if cfg[a][b] not in allowed:
            raise ValueError(f"{a}.{b}={cfg[a][b]!r}: expected one of {allowed}")
    if int(cfg["block_size"]) < 2:
        raise ValueError(f"block_size={cfg['block_size']}: need at least 2 (slot 0 holds the given token)")
    if cfg["target"]["path"] is None and cfg["target"]["preset"] is None:
        raise ValueError("set target.path (real weights) or target.preset (random weights)")
    if cfg["checkpoint"]["max_to_keep"] is not None and cfg["checkpoint"]["max_to_keep"] < 2:
        raise ValueError("checkpoint.max_to_keep must be >= 2: a damaged latest checkpoint needs a predecessor")


def cli_overrides(argv: list[str]) -> tuple[str, list[str]]:
    """(`--config NAME`, overrides) from argv; `--block K` is shorthand for block_size=K."""
    name, out, i = "smollm2-135m", [], 0
    while i < len(argv):
        a = argv[i]
        if a in ("--config", "-c", "--block") and i + 1 < len(argv):
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
