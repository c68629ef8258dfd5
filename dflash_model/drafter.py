"""DFlash drafter: config, NNX module, cached inference and the one-pass multi-block training forward.

Dimension letters: docs/glossary.md (one glossary for the repository).

The drafter has no embedding and no lm_head: the target's are passed in at every call (`target.embed`,
`target.lm_head`) and never copied. Every draft layer attends from the block's queries to keys/values
`[context ; block]`; the context path is `ctx = hidden_norm(fc(features))`, shared by all layers, projected by
each layer's k_proj / v_proj with NO input_layernorm, then k_norm and RoPE at the context's own positions.

Attention pattern (the same function serves inference and training, so the two agree by construction):
  * full_attention layers: a block position sees context positions < block start and its whole block;
  * sliding_attention layers (newer z-lab drafts): causal inside the block, and only keys with
    `query_pos - key_pos < sliding_window` (context and block alike), as z-lab's reference mask does;
  * never another block (training lays N blocks of one sequence side by side in one pass).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_model import layers
from dflash_model.config import (
    PRESETS,
    ConfigError,
    RopeScaling,
    TargetConfig,
    check_heads_and_dtype,
    jnp_dtype,
)
from dflash_model.layers import (
    apply_rope,
    map_in_chunks,
    out_projection,
    rms_norm,
    rope_angles,
    rope_inv_freq,
    swiglu,
)
from dflash_model.sharding import constrain_batch
from dflash_model.target import KVCache, config_of, embed, lm_head, lm_head_weight, write_rows

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


# ----------------------------------------------------------------------------------------------------------
# The module. Parameter layouts are einsum layouts; `out_sharding` uses the same logical names as Tunix
# ('fsdp' on the model dim, 'tp' on heads / MLP width) so sharding.param_specs and memory_report apply as is.
# Attribute paths equal z-lab tensor names minus ".weight" (drafter_weights relies on it).


def _param(value, sharding) -> nnx.Param:
    return nnx.Param(value, out_sharding=sharding, eager_sharding=False)


class DraftAttention(nnx.Module):
    def __init__(self, cfg: DrafterConfig):
        d, q, g, h = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        zeros, ones = _init(cfg)
        self.q_proj = _param(zeros((d, q, h)), ("fsdp", "tp", None))
        self.k_proj = _param(zeros((d, g, h)), ("fsdp", "tp", None))
        self.v_proj = _param(zeros((d, g, h)), ("fsdp", "tp", None))
        self.o_proj = _param(zeros((q, h, d)), ("tp", None, "fsdp"))
        self.q_norm = _param(ones((h,)), (None,))
        self.k_norm = _param(ones((h,)), (None,))


class DraftMLP(nnx.Module):
    def __init__(self, cfg: DrafterConfig):
        d, m = cfg.hidden_size, cfg.intermediate_size
        zeros, _ = _init(cfg)
        self.gate_proj = _param(zeros((d, m)), ("fsdp", "tp"))
        self.up_proj = _param(zeros((d, m)), ("fsdp", "tp"))
        self.down_proj = _param(zeros((m, d)), ("tp", "fsdp"))


class DraftLayer(nnx.Module):
    def __init__(self, cfg: DrafterConfig):
        _, ones = _init(cfg)
        self.input_layernorm = _param(ones((cfg.hidden_size,)), (None,))
        self.self_attn = DraftAttention(cfg)
        self.post_attention_layernorm = _param(ones((cfg.hidden_size,)), (None,))
        self.mlp = DraftMLP(cfg)


class Drafter(nnx.Module):
    """fc, hidden_norm, `num_hidden_layers` Qwen3-style layers with KV injection, final norm.

    Constructed with zero matrices and unit norms, cheap under `nnx.eval_shape` (see `abstract_drafter`);
    `build_drafter` gives an initialised one.
    """

    def __init__(self, cfg: DrafterConfig):
        zeros, ones = _init(cfg)
        self.fc = _param(zeros((cfg.feature_size, cfg.hidden_size)), ("tp", "fsdp"))
        self.hidden_norm = _param(ones((cfg.hidden_size,)), (None,))
        self.layers = nnx.List([DraftLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = _param(ones((cfg.hidden_size,)), (None,))
        self.config = cfg  # plain attribute: static graph data, not a parameter


def _init(cfg: DrafterConfig):
    dtype = jnp_dtype(cfg.dtype)
    return (lambda shape: jnp.zeros(shape, dtype)), (lambda shape: jnp.ones(shape, dtype))


def abstract_drafter(cfg: DrafterConfig) -> Drafter:
    """Shapes, dtypes and sharding metadata only: for planning pod-sized drafters without allocating them."""
    return nnx.eval_shape(lambda: Drafter(cfg))


def build_drafter(cfg: DrafterConfig, *, seed: int = 0, std: float = 0.02) -> Drafter:
    """A freshly initialised drafter: matrices N(0, std) (HF's initializer_range for Qwen3, what z-lab's
    drafters start from), norms one.

    The values come from NumPy's seeded generator: jax.random compiles a threefry program per parameter shape
    (14 s for a toy drafter on CPU), and host values are identical on every backend.
    """
    drafter = Drafter(cfg)
    rng = np.random.default_rng(seed)
    dtype = jnp_dtype(cfg.dtype)
    for _, param in nnx.iter_graph(drafter):
        if isinstance(param, nnx.Param) and param.get_value().ndim >= 2:
            shape = param.get_value().shape
            param.set_value(jnp.asarray(std * rng.standard_normal(shape, dtype=np.float32), dtype))
    return drafter


def scale_output_norm(drafter: Drafter, target_model: nnx.Module, logit_std: float = 0.3) -> Drafter:
    """Set the final norm's scale so an untrained drafter's logits through the frozen lm_head have std ~logit_std.

    The normed output has unit RMS and a random direction, so logit v has std scale * |W_v| (W_v = lm_head row
    v). With scale 1 that is |W_v| itself (3.2 for SmolLM2): the untrained loss is ~40 against ln V = 10.8, and
    Adam, which moves a weight by ~lr per step, needs thousands of steps to shrink the scale. A trainer-side
    initialisation choice (the checkpoint format is unchanged); a short run starts near ln V instead.
    """
    w = lm_head_weight(target_model).T
    row_norm = float(jnp.mean(jnp.linalg.norm(w.astype(jnp.float32), axis=-1)))
    drafter.norm.set_value(jnp.full_like(drafter.norm[...], logit_std / max(row_norm, 1e-6)))
    return drafter


# ----------------------------------------------------------------------------------------------------------
# Shared maths.


def _dtype(drafter: Drafter):
    return jnp_dtype(drafter.config.dtype)


def _check_target(drafter: Drafter, target_model: nnx.Module) -> None:
    check_pairing(drafter.config, config_of(target_model))


def _context(drafter: Drafter, features_BTF, compute_dtype=None):
    """ctx = hidden_norm(fc(features)): one context stream shared by every draft layer."""
    cfg = drafter.config
    if features_BTF.shape[-1] != cfg.feature_size:
        raise ValueError(
            f"features have width {features_BTF.shape[-1]}; the drafter expects {cfg.n_features} target layers "
            f"x {cfg.hidden_size} = {cfg.feature_size}"
        )
    x = features_BTF.astype(compute_dtype or _dtype(drafter))
    ctx = constrain_batch(jnp.einsum("BTF,FD->BTD", x, drafter.fc[...].astype(x.dtype)))
    return rms_norm(ctx, drafter.hidden_norm[...], cfg.rms_norm_eps)


def _keys_values(attn: DraftAttention, x_BXD, cos, sin, eps: float):
    """K (k_norm, then RoPE) and V of any stream: the context enters here without input_layernorm."""
    k = jnp.einsum("BXD,DGH->BXGH", x_BXD, attn.k_proj[...].astype(x_BXD.dtype))
    v = jnp.einsum("BXD,DGH->BXGH", x_BXD, attn.v_proj[...].astype(x_BXD.dtype))
    k = apply_rope(rms_norm(k, attn.k_norm[...], eps), cos, sin)
    return k, v


def _attend_blocks(q_BNKQH, kc_BSGH, vc_BSGH, kb_BNJGH, vb_BNJGH, ctx_mask, blk_mask, max_scores: int | None = None):
    """Softmax over [context ; own block] without ever forming block-to-other-block scores.

    ctx_mask broadcasts to [B, N, K, S], blk_mask to [B, N, K, J]; True = may attend. One softmax spans both
    parts, so this equals dense attention over the concatenated keys with a block-diagonal mask, at
    O(N*K*(S+K)) instead of O(N*K*(S+N*K)) scores. Scores and softmax in fp32, at most `max_scores` (default
    layers.MAX_SCORES) at once: beyond that the blocks go through in chunks (blocks never interact, so the result
    is the same).
    """
    max_scores = layers.MAX_SCORES if max_scores is None else max_scores
    b, n, k, nq, _ = q_BNKQH.shape
    s, j = kc_BSGH.shape[1], kb_BNJGH.shape[2]
    per_chunk = max(1, max_scores // (b * nq * k * (s + j)))
    if n <= per_chunk:
        return layers.attend_context_and_blocks(q_BNKQH, kc_BSGH, vc_BSGH, kb_BNJGH, vb_BNJGH, ctx_mask, blk_mask)
    ctx_mask = jnp.broadcast_to(ctx_mask, (b, n, *ctx_mask.shape[2:]))
    blk_mask = jnp.broadcast_to(blk_mask, (b, n, *blk_mask.shape[2:]))
    return map_in_chunks(
        lambda q, kb, vb, cm, bm: layers.attend_context_and_blocks(q, kc_BSGH, vc_BSGH, kb, vb, cm, bm),
        (q_BNKQH, kb_BNJGH, vb_BNJGH, ctx_mask, blk_mask),
        axis=1,
        chunk=per_chunk,
    )


def _masks(cfg: DrafterConfig, q_pos_BNK, kv_pos_S, ctx_visible):
    """(ctx_mask, blk_mask) per attention type. `ctx_visible` [B, N, K|1, S] says which context keys exist for
    each block (positions < block start, or < cache length); sliding layers add the window and causality."""
    k = q_pos_BNK.shape[-1]
    j = jnp.arange(k)
    masks = {"full_attention": (ctx_visible, jnp.ones((1, 1, k, k), bool))}
    if cfg.layer_types is not None and "sliding_attention" in cfg.layer_types:
        causal = j[None, :] <= j[:, None]
        if cfg.sliding_window is None:
            masks["sliding_attention"] = (ctx_visible, causal[None, None])
        else:
            w = cfg.sliding_window
            in_window = (q_pos_BNK[..., None] - kv_pos_S) < w
            blk = causal & ((j[:, None] - j[None, :]) < w)
            masks["sliding_attention"] = (ctx_visible & in_window, blk[None, None])
    return masks


def _run_blocks(drafter: Drafter, x_BNKD, mask_pos_BNK, rope_pos_BNK, ctx_kv, kv_pos_S, ctx_visible):
    """The draft layers over N blocks per row, then the final norm.

    `ctx_kv` holds each layer's context K/V [B, S, G, H] (RoPE already applied). `mask_pos_BNK` / `kv_pos_S` are
    the sequence indices the sliding-window masks compare; `rope_pos_BNK` are the blocks' RoPE positions (the
    same numbers, unless a caller shifts every position by a constant).
    """
    cfg = drafter.config
    eps = cfg.rms_norm_eps
    b, n, k, d = x_BNKD.shape
    inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    cos, sin = rope_angles(rope_pos_BNK.reshape(b, n * k), inv_freq)
    masks = _masks(cfg, mask_pos_BNK, kv_pos_S, ctx_visible)
    x = x_BNKD
    for i, layer in enumerate(drafter.layers):
        attn = layer.self_attn
        h = rms_norm(x, layer.input_layernorm[...], eps).reshape(b, n * k, d)
        q = jnp.einsum("BXD,DQH->BXQH", h, attn.q_proj[...].astype(h.dtype))
        q = apply_rope(rms_norm(q, attn.q_norm[...], eps), cos, sin)
        kb, vb = _keys_values(attn, h, cos, sin, eps)
        kc, vc = ctx_kv[i]
        ctx_mask, blk_mask = masks[cfg.layer_type(i)]
        o = _attend_blocks(
            q.reshape(b, n, k, *q.shape[2:]),
            kc.astype(x.dtype),
            vc.astype(x.dtype),
            kb.reshape(b, n, k, *kb.shape[2:]),
            vb.reshape(b, n, k, *vb.shape[2:]),
            ctx_mask,
            blk_mask,
        )
        x = x + out_projection(o, attn.o_proj[...])
        h = rms_norm(x, layer.post_attention_layernorm[...], eps)
        mlp = layer.mlp
        x = constrain_batch(x + swiglu(h, mlp.gate_proj[...], mlp.up_proj[...], mlp.down_proj[...]))
    return rms_norm(x, drafter.norm[...], eps)


# ----------------------------------------------------------------------------------------------------------
# Inference: the cache holds context K/V only, never block K/V, so drafting needs no roll-back.


# The drafter's cache is the target's cache type, holding CONTEXT K/V only (never block K/V): entries below
# lengths[b] are the context K/V of positions 0..lengths[b]-1; anything above is stale or padding and is
# never read (draft_logits masks keys at positions >= lengths). DrafterConfig has the fields KVCache.init reads.
DraftCache = KVCache


@jax.named_scope("drafter_context")
def extend_context(drafter: Drafter, cache: DraftCache, features_BTF, num_new_B) -> DraftCache:
    """Append target features at positions `cache.lengths[b] + 0..T-1`; only the first `num_new_B[b]` of each row
    are real (the rest is padding: written beyond the new length, never read). Returns lengths += num_new.
    The caller keeps `lengths + num_new <= capacity`."""
    cfg = drafter.config
    ctx = _context(drafter, features_BTF)
    pos_BT = cache.lengths[:, None] + jnp.arange(features_BTF.shape[1], dtype=jnp.int32)[None, :]
    cos, sin = rope_angles(pos_BT, rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
    k_all, v_all = cache.k, cache.v
    for i, layer in enumerate(drafter.layers):
        k, v = _keys_values(layer.self_attn, ctx, cos, sin, cfg.rms_norm_eps)
        k_all, v_all = write_rows(k_all, i, k, pos_BT), write_rows(v_all, i, v, pos_BT)
    return DraftCache(k_all, v_all, cache.lengths + jnp.asarray(num_new_B, jnp.int32))


@jax.named_scope("drafter_block")
def _draft_hidden(drafter: Drafter, target_model: nnx.Module, cache: DraftCache, block_tokens_BK):
    _check_target(drafter, target_model)
    k = block_tokens_BK.shape[1]
    pos_BNK = (cache.lengths[:, None] + jnp.arange(k, dtype=jnp.int32)[None, :])[:, None, :]
    kv_pos = jnp.arange(cache.capacity, dtype=jnp.int32)
    visible = (kv_pos[None, :] < cache.lengths[:, None])[:, None, None, :]  # [B, 1, 1, C]
    x = embed(target_model, block_tokens_BK).astype(_dtype(drafter))[:, None]
    ctx_kv = [(cache.k[i], cache.v[i]) for i in range(drafter.config.num_hidden_layers)]
    # Cache slot c holds context position c, so sequence indices and RoPE positions coincide here.
    return _run_blocks(drafter, x, pos_BNK, pos_BNK, ctx_kv, kv_pos, visible)[:, 0]


def draft_logits(drafter: Drafter, target_model: nnx.Module, cache: DraftCache, block_tokens_BK):
    """[B, K, V] fp32 logits for a block at positions `cache.lengths + 0..K-1`, seeing context positions
    < lengths and the whole block. Output k predicts the token at position start + k (same-position labels)."""
    return lm_head(target_model, _draft_hidden(drafter, target_model, cache, block_tokens_BK))


def propose(
    drafter: Drafter, target_model: nnx.Module, cache: DraftCache, last_token_B, block_size: int, vocab_ids_U=None
):
    """[B, K-1] int32 greedy proposals: argmax at positions 1..K-1 of the block [last, MASK x (K-1)].
    `block_size` (static) may differ from the size the drafter was trained at."""
    return propose_scored(drafter, target_model, cache, last_token_B, block_size, vocab_ids_U)[0]


def block_logits(
    drafter: Drafter, target_model: nnx.Module, cache: DraftCache, last_token_B, block_size: int, vocab_ids_U=None
):
    """[B, K-1, V] fp32 logits of the drafter at positions 1..K-1 of the block [last, MASK x (K-1)].

    vocab_ids_U: the draft vocabulary the drafter was trained on (FR-Spec; `train.assembly.draft_vocabulary`):
    logits over those U tokens only, [B, K-1, U], index u standing for token vocab_ids_U[u]. It is what the
    training loss saw, and the lm_head then reads U rows instead of V (SmolLM2: 8,192 of 49,152)."""
    if block_size < 2:
        raise ValueError(f"block_size={block_size}: need at least 2 (the last token and one proposal)")
    b = last_token_B.shape[0]
    mask = jnp.full((b, block_size - 1), drafter.config.mask_token_id, jnp.int32)
    block = jnp.concatenate([jnp.asarray(last_token_B, jnp.int32)[:, None], mask], axis=1)
    hidden = _draft_hidden(drafter, target_model, cache, block)
    # Slot 0 only carries the last token; its logits are never used, so the lm_head skips it.
    return lm_head(target_model, hidden[:, 1:], vocab_ids_U)


def _token_ids(index, vocab_ids_U):
    """Token ids of logit indices: themselves over the full vocabulary, vocab_ids_U[index] over a draft one."""
    index = index.astype(jnp.int32)
    return index if vocab_ids_U is None else jnp.take(jnp.asarray(vocab_ids_U, jnp.int32), index)


def propose_scored(
    drafter: Drafter, target_model: nnx.Module, cache: DraftCache, last_token_B, block_size: int, vocab_ids_U=None
):
    """([B, K-1] int32 greedy proposals, [B, K-1] fp32 the drafter's probability of each): `propose` plus the
    confidence an adaptive verify width is chosen from (the drafter's marginal at each position)."""
    logits = block_logits(drafter, target_model, cache, last_token_B, block_size, vocab_ids_U)
    tokens = _token_ids(jnp.argmax(logits, axis=-1), vocab_ids_U)
    prob = jnp.exp(jnp.max(logits, axis=-1) - jax.nn.logsumexp(logits, axis=-1))
    return tokens, prob


def propose_top(
    drafter: Drafter,
    target_model: nnx.Module,
    cache: DraftCache,
    last_token_B,
    block_size: int,
    top: int,
    vocab_ids_U=None,
):
    """([B, K-1, top] int32 the `top` likeliest tokens at each block position, best first, [B, K-1, top] fp32
    their log-probabilities): what a draft tree is built from."""
    logits = block_logits(drafter, target_model, cache, last_token_B, block_size, vocab_ids_U)
    best, index = jax.lax.top_k(logits, top)
    return _token_ids(index, vocab_ids_U), best - jax.nn.logsumexp(logits, axis=-1, keepdims=True)


# ----------------------------------------------------------------------------------------------------------
# Training: N blocks per sequence in one pass.


def block_tokens(cfg: DrafterConfig, tokens_BT, anchors_BN, block_size: int):
    """[B, N, K] block inputs [tokens[a], MASK x (K-1)]; padding anchors (a < 0) read token 0."""
    t = tokens_BT.shape[1]
    first = jnp.take_along_axis(tokens_BT, jnp.clip(anchors_BN, 0, t - 1), axis=1)
    mask = jnp.full((*anchors_BN.shape, block_size - 1), cfg.mask_token_id, tokens_BT.dtype)
    return jnp.concatenate([first[..., None], mask], axis=-1)


@jax.named_scope("drafter_train_blocks")
def train_hidden_from_embeds(
    drafter: Drafter, features_BTF, block_embeds_BNKD, anchors_BN, start_positions_B=None, compute_dtype=None
):
    """Final-normed hidden [B, N, K, D] of N blocks per row whose inputs are given as embeddings.

    Block n sits at positions a_n .. a_n+K-1 and sees context features at positions STRICTLY before a_n
    (kv < a: when drafting, the target has not yet run on the block's first token, so its feature does not
    exist; training with `<=` hands the drafter the target's own prediction for slot 1 and collapses acceptance),
    its own block, and never another block.
    Anchors < 0 are padding: such a block sees no context, its output is finite and meaningless, and it
    influences nothing else. `start_positions_B` (default 0) is the absolute position of features[:, 0], for
    windows cut out of longer sequences: it shifts every RoPE position, not the masks.
    """
    b, t, _ = features_BTF.shape
    k = block_embeds_BNKD.shape[2]
    cfg = drafter.config
    start = jnp.zeros((b,), jnp.int32) if start_positions_B is None else jnp.asarray(start_positions_B, jnp.int32)
    anchors = jnp.asarray(anchors_BN, jnp.int32)
    a0 = jnp.maximum(anchors, 0)  # padding blocks sit at 0, where no context is visible
    kv_idx = jnp.arange(t, dtype=jnp.int32)
    visible = kv_idx[None, None, None, :] < a0[:, :, None, None]  # [B, N, 1, T]
    ctx = _context(drafter, features_BTF, compute_dtype)
    ctx_pos_BT = start[:, None] + kv_idx[None, :]
    cos, sin = rope_angles(ctx_pos_BT, rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
    ctx_kv = [_keys_values(layer.self_attn, ctx, cos, sin, cfg.rms_norm_eps) for layer in drafter.layers]
    block_idx_BNK = a0[..., None] + jnp.arange(k, dtype=jnp.int32)
    x = block_embeds_BNKD.astype(compute_dtype or _dtype(drafter))
    # Masks compare sequence indices; RoPE sees indices + start, which shifts both sides of every q.k alike.
    rope_pos_BNK = start[:, None, None] + block_idx_BNK
    return _run_blocks(drafter, x, block_idx_BNK, rope_pos_BNK, ctx_kv, kv_idx, visible)


def train_logits(
    drafter: Drafter,
    target_model: nnx.Module,
    features_BTF,
    tokens_BT,
    anchors_BN,
    block_size: int,
    hidden_only: bool = False,
    start_positions_B=None,
    compute_dtype=None,
):
    """All N blocks [tokens[a_n], MASK x (K-1)] of each row in one pass: [B, N, K, V] fp32 logits, or the
    final-normed hidden [B, N, K, D] when `hidden_only` (for a chunked cross-entropy through the lm_head).

    Output k of block n predicts tokens[a_n + k] (slot 0 carries no prediction). Anchors < 0 are padding (see
    train_hidden_from_embeds); valid anchors lie in 0..T-1. Context scores cost B*Q*N*K*T: chunk the anchors
    for long sequences (blocks never interact, so chunks give the same result).

    `compute_dtype` (default: the drafter's own dtype) is the dtype of the activations and so of every matmul:
    bfloat16 over fp32 parameters is mixed-precision training (each weight is cast where it is used, so its
    gradient arrives in fp32); norms and softmax compute in fp32 either way.
    """
    _check_target(drafter, target_model)
    blocks = block_tokens(drafter.config, jnp.asarray(tokens_BT, jnp.int32), jnp.asarray(anchors_BN), block_size)
    hidden = train_hidden_from_embeds(
        drafter, features_BTF, embed(target_model, blocks), anchors_BN, start_positions_B, compute_dtype
    )
    return hidden if hidden_only else lm_head(target_model, hidden)
