"""The DFlash drafter's configuration: its shape, the target layers it reads, the published presets, and the check
that a drafter fits a target. The module itself is dflash_model/drafter.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dflash_model.config import PRESETS, ConfigError, RopeScaling, TargetConfig, check_heads_and_dtype

ATTENTION_TYPES = ("full_attention", "sliding_attention")


def default_target_layer_ids(num_target_layers: int, n: int) -> list[int]:
    """The reference rule for which target layers feed the drafter: n ids spread from 1 to L-3.

    `round` is Python's (ties to even), as in the reference helper: it only matters for depths where
    (L-4)/(n-1) has a half, e.g. SmolLM2's 30 layers give [1, 8, 14, 20, 27], not [1, 8, 14, 21, 27].
    One feature takes the middle layer, as the reference does.
    """
    if n < 1:
        raise ValueError(f"n={n}: need at least one target feature")
    if n == 1:
        return [num_target_layers // 2]
    ids = [int(round(1 + i * (num_target_layers - 4) / (n - 1))) for i in range(n)]
    if len(set(ids)) != n or not all(0 <= i < num_target_layers for i in ids):
        raise ValueError(
            f"the default rule gives {ids} for {num_target_layers} target layers and {n} features; "
            "pass target_layer_ids explicitly"
        )
    return ids


@dataclasses.dataclass(frozen=True, kw_only=True)
class DrafterConfig:
    """A DFlash drafter's architecture, named as in z-lab's config.json (`drafter_weights.parse_zlab_config`)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 32768
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    layer_types: tuple[str, ...] | None = None  # None = every layer full_attention
    sliding_window: int | None = None  # None on a sliding layer = causal block, unbounded window (HF semantics)
    dtype: str = "float32"  # parameter and compute dtype

    def __post_init__(self):
        # Normalise list inputs (JSON) so the config stays hashable: it is static data of jitted functions.
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        if self.layer_types is not None:
            # All-full is the same drafter as no layer_types; one spelling keeps configs comparable.
            types = tuple(self.layer_types)
            object.__setattr__(self, "layer_types", None if set(types) == {"full_attention"} else types)
        if self.layer_types is None:
            object.__setattr__(self, "sliding_window", None)  # no layer reads it
        check_heads_and_dtype(self)
        if self.block_size < 2:
            raise ConfigError(f"block_size={self.block_size}: a block needs the last token plus at least one mask")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(f"mask_token_id={self.mask_token_id} outside the vocabulary 0..{self.vocab_size - 1}")
        if not self.target_layer_ids:
            raise ConfigError("target_layer_ids is empty")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise ConfigError(
                f"target_layer_ids {bad} outside the target's 0..{self.num_target_layers - 1} "
                f"(num_target_layers={self.num_target_layers})"
            )
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ConfigError(
                    f"layer_types has {len(self.layer_types)} entries for num_hidden_layers={self.num_hidden_layers}"
                )
            unknown = sorted(set(self.layer_types) - set(ATTENTION_TYPES))
            if unknown:
                raise ConfigError(f"layer_types {unknown} not supported (expected {ATTENTION_TYPES})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim}: rotate-half RoPE needs an even head_dim")

    @property
    def n_features(self) -> int:
        return len(self.target_layer_ids)

    @property
    def feature_size(self) -> int:
        """Width of the concatenated target features fed to `fc`."""
        return self.n_features * self.hidden_size

    def layer_type(self, i: int) -> str:
        return "full_attention" if self.layer_types is None else self.layer_types[i]

    def replace(self, **changes: Any) -> DrafterConfig:
        return dataclasses.replace(self, **changes)

    def num_params(self) -> int:
        d, m, h = self.hidden_size, self.intermediate_size, self.head_dim
        attn = d * h * (2 * self.num_attention_heads + 2 * self.num_key_value_heads) + 2 * h
        per_layer = attn + 3 * d * m + 2 * d
        return self.feature_size * d + 2 * d + self.num_hidden_layers * per_layer


def drafter_config_for(
    target_cfg: TargetConfig,
    *,
    mask_token_id: int,
    num_layers: int = 5,
    n_features: int = 5,
    block_size: int = 16,
    intermediate_size: int | None = None,
    target_layer_ids: tuple[int, ...] | None = None,
) -> DrafterConfig:
    """A drafter shaped like `target_cfg`'s layers (the recipe of the published b16 drafts: same width, heads,
    MLP width, RoPE and norm eps as the target), with features from the default target layers."""
    ids = target_layer_ids or default_target_layer_ids(target_cfg.num_hidden_layers, n_features)
    return DrafterConfig(
        hidden_size=target_cfg.hidden_size,
        intermediate_size=intermediate_size or target_cfg.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=target_cfg.num_attention_heads,
        num_key_value_heads=target_cfg.num_key_value_heads,
        head_dim=target_cfg.head_dim,
        rms_norm_eps=target_cfg.rms_norm_eps,
        rope_theta=target_cfg.rope_theta,
        rope_scaling=target_cfg.rope_scaling,
        max_position_embeddings=target_cfg.max_position_embeddings,
        vocab_size=target_cfg.vocab_size,
        block_size=block_size,
        mask_token_id=mask_token_id,
        target_layer_ids=tuple(ids),
        num_target_layers=target_cfg.num_hidden_layers,
        dtype=target_cfg.dtype,
    )


# Published drafters (values from their config.json) plus the one for the embedded default target.
# llama3.1-8b-dflash-ultrachat: block 10 and 5 layers are published; intermediate 14336 (the target's, as for
# the Qwen3 drafts), the Llama-3.1 RoPE scaling and mask id 128002 (<|reserved_special_token_0|>) are
# assumptions: no public copy of its config.json was found.
# smollm2-135m-dflash: 5 layers and 5 features as in the paper's recipe, so results on the embedded target carry
# over to the published setups (5/30 of the target's depth, vs 5/36 for Qwen3 and 5/32 for Llama-3.1).
# Mask id 4 is '<reponame>': a special token the chat template never emits, found 0 times in 6.5M tokens of
# CPython stdlib sources, HumanEval/GSM8K/MT-Bench/ShareGPT chats; unlike <filename> (id 6, which does occur)
# and ids 5, 7-16 (embedding rows the Q4_1 file makes bit-identical to other tokens' rows), its row is distinct.
DRAFTER_PRESETS: dict[str, tuple[DrafterConfig, str]] = {
    "qwen3-4b-dflash-b16": (drafter_config_for(PRESETS["qwen3-4b"], mask_token_id=151669), "qwen3-4b"),
    "qwen3-8b-dflash-b16": (drafter_config_for(PRESETS["qwen3-8b"], mask_token_id=151669), "qwen3-8b"),
    "llama3.1-8b-dflash-ultrachat": (
        drafter_config_for(PRESETS["llama-3.1-8b"], mask_token_id=128002, block_size=10),
        "llama-3.1-8b",
    ),
    "smollm2-135m-dflash": (drafter_config_for(PRESETS["smollm2-135m"], mask_token_id=4), "smollm2-135m"),
}


def drafter_preset(name: str) -> DrafterConfig:
    if name not in DRAFTER_PRESETS:
        raise ConfigError(f"unknown drafter preset {name!r}; known: {sorted(DRAFTER_PRESETS)}")
    return DRAFTER_PRESETS[name][0]


def check_pairing(cfg: DrafterConfig, target_cfg: TargetConfig, source: str = "drafter") -> None:
    """Raise ConfigError listing every way `cfg` cannot run on `target_cfg`."""
    problems = []
    if cfg.hidden_size != target_cfg.hidden_size:
        problems.append(f"hidden_size={cfg.hidden_size} != target hidden_size={target_cfg.hidden_size}")
    if cfg.vocab_size != target_cfg.vocab_size:
        problems.append(f"vocab_size={cfg.vocab_size} != target vocab_size={target_cfg.vocab_size}")
    if not 0 <= cfg.mask_token_id < target_cfg.vocab_size:
        problems.append(
            f"mask_token_id={cfg.mask_token_id} is not a row of the target's {target_cfg.vocab_size}-row embedding"
        )
    if cfg.num_target_layers != target_cfg.num_hidden_layers:
        problems.append(
            f"num_target_layers={cfg.num_target_layers} != target num_hidden_layers={target_cfg.num_hidden_layers}"
        )
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < target_cfg.num_hidden_layers]
    if bad:
        problems.append(f"target_layer_ids {bad} outside the target's 0..{target_cfg.num_hidden_layers - 1}")
    if problems:
        raise ConfigError(f"{source} does not fit the target:\n  " + "\n  ".join(problems))
