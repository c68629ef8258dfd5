"""DFlash drafter: the NNX module, cached inference and the one-pass multi-block training forward.

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

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_model import layers
from dflash_model.config import jnp_dtype
from dflash_model.drafter_config import DrafterConfig, check_pairing
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
