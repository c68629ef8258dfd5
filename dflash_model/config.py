"""Target-model configuration: one frozen dataclass for the Qwen3 and Llama families, presets, HF config.json."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax.numpy as jnp

# Parameter / compute dtypes of targets and drafters, by the names config.json and the YAML configs use.
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def jnp_dtype(name: str):
    if name not in DTYPES:
        raise ConfigError(f"dtype={name!r}: expected one of {tuple(DTYPES)}")
    return DTYPES[name]


FAMILIES = ("qwen3", "llama")


class ConfigError(ValueError):
    """A model config that cannot be used (names the file and key)."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1 style frequency scaling ("rope_type": "llama3"); the only scaling the supported targets use."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


def check_heads_and_dtype(cfg) -> None:
    """The checks a target's and a drafter's config share: query heads in whole groups per kv head, a known dtype."""
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ConfigError(
            f"num_attention_heads={cfg.num_attention_heads} is not a multiple of "
            f"num_key_value_heads={cfg.num_key_value_heads}"
        )
    if cfg.dtype not in DTYPES:
        raise ConfigError(f"dtype={cfg.dtype!r}: expected one of {tuple(DTYPES)}")


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    """Architecture of a decoder-only target LLM (HF naming, so config.json maps one to one)."""

    family: str  # "qwen3" (q_norm/k_norm in attention) or "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int = 32768
    rope_scaling: RopeScaling | None = None
    dtype: str = "float32"  # parameter and compute dtype: "float32" or "bfloat16"

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ConfigError(f"family={self.family!r}: expected one of {FAMILIES}")
        check_heads_and_dtype(self)

    @property
    def qk_norm(self) -> bool:
        return self.family == "qwen3"

    def replace(self, **changes: Any) -> TargetConfig:
        return dataclasses.replace(self, **changes)

    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        d, f, h = self.hidden_size, self.intermediate_size, self.head_dim
        attn = d * h * (2 * self.num_attention_heads + 2 * self.num_key_value_heads)
        per_layer = attn + 3 * d * f + 2 * d + (2 * h if self.qk_norm else 0)
        embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return embed + self.num_hidden_layers * per_layer + d


_HF_MODEL_TYPES = {"qwen3": "qwen3", "llama": "llama"}


def from_hf_config(cfg: dict[str, Any], source: str = "config.json", dtype: str | None = None) -> TargetConfig:
    """TargetConfig from an HF config dict; `source` names the file in errors."""
    model_type = cfg.get("model_type")
    if model_type not in _HF_MODEL_TYPES:
        raise ConfigError(f"{source}: model_type={model_type!r} is not supported (supported: qwen3, llama)")

    def need(key: str):
        if key not in cfg:
            raise ConfigError(f"{source}: missing required key {key!r}")
        return cfg[key]

    heads = int(need("num_attention_heads"))
    hidden = int(need("hidden_size"))
    rope_theta, rope_scaling = rope_theta_of(cfg, source), rope_scaling_of(cfg, source)
    dtype = dtype or declared_dtype(cfg)
    return TargetConfig(
        family=_HF_MODEL_TYPES[model_type],
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        num_hidden_layers=int(need("num_hidden_layers")),
        num_attention_heads=heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads", heads)),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rope_theta=rope_theta,
        rms_norm_eps=float(need("rms_norm_eps")),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
        rope_scaling=rope_scaling,
        dtype=dtype,
    )


def rope_theta_of(raw: dict, source: str) -> float:
    """rope_theta of an HF / z-lab config.json (top level, or under rope_parameters as transformers >= 5 writes)."""
    theta = raw.get("rope_theta")
    if theta is None and isinstance(raw.get("rope_parameters"), dict):
        theta = raw["rope_parameters"].get("rope_theta")
    if theta is None:
        raise ConfigError(f"{source}: missing required key 'rope_theta' (or rope_parameters.rope_theta)")
    return float(theta)


def rope_scaling_of(raw: dict, source: str) -> RopeScaling | None:
    """Llama-3 RoPE scaling of a config.json (rope_scaling, or rope_parameters); None for plain RoPE; any other
    scaling type is an error naming it."""
    scaling = raw.get("rope_scaling") or None
    if scaling is None and isinstance(raw.get("rope_parameters"), dict):
        scaling = raw["rope_parameters"]
    if scaling is None:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ConfigError(f"{source}: rope_scaling type {kind!r} is not supported (only 'llama3')")
    return RopeScaling(
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
    )


def architecture_json(cfg) -> dict:
    """The config.json keys a target (TargetConfig) and a drafter (DrafterConfig) write alike: the Qwen3 / Llama
    layer shape, RoPE (rope_scaling null for plain RoPE), norm eps and the stored dtype; the inverse of the
    parsers above."""
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None
        if cfg.rope_scaling is None
        else {"rope_type": "llama3", **dataclasses.asdict(cfg.rope_scaling)},
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "torch_dtype": cfg.dtype,
    }


def stored_dtype(raw: dict) -> str:
    """The dtype a config.json says its tensors are stored in (torch_dtype, or dtype as transformers >= 5 writes)."""
    return raw.get("torch_dtype", raw.get("dtype", "float32"))


def declared_dtype(raw: dict) -> str:
    """The compute dtype a config.json declares (its stored dtype): bf16 or fp32."""
    return "bfloat16" if stored_dtype(raw) == "bfloat16" else "float32"


def read_config_json(model_dir: str | Path, what: str = "an HF model directory", missing=None) -> dict:
    """The JSON object of <model_dir>/config.json; a missing file raises `missing` (default ConfigError), bad JSON
    or a non-object ConfigError, each naming the file."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise (missing or ConfigError)(f"{path}: not found (expected {what} with config.json)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return raw


def load_hf_config(model_dir: str | Path, dtype: str | None = None) -> TargetConfig:
    raw = read_config_json(model_dir)
    return from_hf_config(raw, source=str(Path(model_dir) / "config.json"), dtype=dtype)


# Presets: the real targets DFlash drafters exist for, plus the embedded default. Values from their config.json.
PRESETS: dict[str, TargetConfig] = {
    "qwen3-4b": TargetConfig(
        family="qwen3",
        vocab_size=151936,
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        max_position_embeddings=40960,
        dtype="bfloat16",
    ),
    "qwen3-8b": TargetConfig(
        family="qwen3",
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        max_position_embeddings=40960,
        dtype="bfloat16",
    ),
    "llama-3.1-8b": TargetConfig(
        family="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rope_theta=5e5,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        max_position_embeddings=131072,
        dtype="bfloat16",
        rope_scaling=RopeScaling(
            factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
        ),
    ),
    "smollm2-135m": TargetConfig(
        family="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        rope_theta=1e5,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
    ),
}

# The test suite's tiny shapes (those of the committed HF fixtures tests/fixtures/tiny_qwen3 and tiny_llama): big
# enough to exercise GQA, qk-norm, tied embeddings and Llama-3.1 rope scaling, small enough to compile in seconds.
TINY_PRESETS: dict[str, TargetConfig] = {
    "qwen3": TargetConfig(
        family="qwen3",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        max_position_embeddings=2048,
    ),
    "llama": TargetConfig(
        family="llama",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=5e5,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        max_position_embeddings=2048,
        rope_scaling=RopeScaling(8.0, 1.0, 4.0, 128),
    ),
}


def preset(name: str) -> TargetConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown target preset {name!r}; known: {sorted(PRESETS)}")
    return PRESETS[name]
