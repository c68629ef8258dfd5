"""Pure functional pieces shared by the target and the drafter: RMSNorm, RoPE, grouped attention, SwiGLU.

Dimension letters: docs/glossary.md (one glossary for the repository).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dflash_model.config import RopeScaling

# A large finite negative instead of -inf: rows whose every key is masked (padding) stay NaN-free.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def rms_norm(x, w, eps: float):
    """RMSNorm as HF computes it: normalise in fp32, cast back, then scale by the weight."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return w.astype(x.dtype) * normed.astype(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> np.ndarray:
    """Inverse frequencies [H/2] in float32, with Llama-3.1 frequency scaling when given.

    Computed in NumPy at trace time: they are constants of the architecture.
    """
    # float32 throughout, as HF computes them: at position 600 a 1-ulp frequency difference is already 4e-5 rad.
    exponent = np.arange(0, head_dim, 2).astype(np.float32) / np.float32(head_dim)
    inv_freq = np.float32(1.0) / (np.float32(theta) ** exponent)
    if scaling is not None:
        # Llama 3.1: long wavelengths are slowed down by `factor`, short ones kept, a smooth ramp between.
        old = scaling.original_max_position_embeddings
        low_wavelen = old / scaling.low_freq_factor
        high_wavelen = old / scaling.high_freq_factor
        wavelen = np.float32(2 * np.pi) / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = np.where(medium, smoothed, scaled)
    return inv_freq.astype(np.float32)


def rope_angles(positions, inv_freq):
    """cos, sin [..., H/2] in fp32 for integer positions [...]."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x_BTQH, cos_BTh, sin_BTh):
    """Rotate-half RoPE (the HF layout: first half / second half of each head), computed in fp32."""
    x = x_BTQH.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    cos, sin = cos_BTh[:, :, None, :], sin_BTh[:, :, None, :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BTQH.dtype)


# The most fp32 attention scores one call forms at once (2^26 = 256 MiB); longer queries go through in chunks
# (`map_in_chunks`), so memory stays bounded at pod sequence lengths (Qwen3-8B at T=3072 would otherwise hold
# 1.2 GB of scores per sequence and layer) while this project's CPU shapes keep the single dense einsum.
MAX_SCORES = 1 << 26


def map_in_chunks(fn, args, axis: int, chunk: int):
    """fn over `args` cut into `chunk`-long pieces along `axis` (every arg has that axis, same length), results
    put back together: the same values as fn(*args) when fn treats the axis independently. Each piece is
    rematerialised in the backward pass, so the saved activations are one piece's too."""
    n = args[0].shape[axis]
    pieces = -(-n // chunk)
    pad = pieces * chunk - n

    def cut(x):
        x = jnp.moveaxis(x, axis, 0)
        x = jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1))
        return x.reshape(pieces, chunk, *x.shape[1:])

    def paste(y):
        y = y.reshape(pieces * chunk, *y.shape[2:])[:n]
        return jnp.moveaxis(y, 0, axis)

    out = jax.lax.map(jax.checkpoint(lambda a: fn(*(jnp.moveaxis(x, 0, axis) for x in a))), tuple(map(cut, args)))
    return jax.tree.map(lambda y: paste(jnp.moveaxis(y, axis + 1, 1)), out)


def attend(q_BTQH, k_BSGH, v_BSGH, mask_BTS, max_scores: int | None = None):
    """Softmax attention with grouped kv heads; mask True = may attend. Scores and softmax in fp32, at most
    `max_scores` (default MAX_SCORES, read at trace time) of them at once: queries in chunks beyond that."""
    max_scores = MAX_SCORES if max_scores is None else max_scores
    b, t, n, _ = q_BTQH.shape
    rows = max(1, max_scores // (b * n * k_BSGH.shape[1]))
    if t <= rows:
        return _attend(q_BTQH, k_BSGH, v_BSGH, mask_BTS)
    mask_BTS = jnp.broadcast_to(mask_BTS, (b, t, k_BSGH.shape[1]))
    return map_in_chunks(lambda q, m: _attend(q, k_BSGH, v_BSGH, m), (q_BTQH, mask_BTS), axis=1, chunk=rows)


def _attend(q_BTQH, k_BSGH, v_BSGH, mask_BTS):
    b, t, n, h = q_BTQH.shape
    kv_heads = k_BSGH.shape[2]
    q = q_BTQH.reshape(b, t, kv_heads, n // kv_heads, h)
    scores = jnp.einsum("BTGRH,BSGH->BGRTS", q, k_BSGH, preferred_element_type=jnp.float32) * (h**-0.5)
    scores = jnp.where(mask_BTS[:, None, None, :, :], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_BSGH.dtype)
    out = jnp.einsum("BGRTS,BSGH->BTGRH", probs, v_BSGH)
    return out.reshape(b, t, n, h)


def attend_context_and_blocks(q_BNKQH, kc_BSGH, vc_BSGH, kb_BNJGH, vb_BNJGH, ctx_mask, blk_mask):
    """Attention of N blocks of K queries over shared context keys [S] and each block's own keys [J], with one
    softmax over both parts: the same values as dense attention over the concatenated keys, without forming
    block-to-other-block scores or writing the block's keys into the context buffer. ctx_mask broadcasts to
    [B, N, K, S], blk_mask to [B, N, K, J]; True = may attend. Scores and softmax in fp32.

    The drafter's blocks use it (`drafter._attend_blocks`, in chunks of blocks), and so does a target verify that
    only reads its cache (`target.forward(write_cache=False)`, one block of the new positions): the adaptive
    decode's width switch, whose branches would otherwise write, and XLA:CPU copy, the whole cache
    (docs/results/decoding/cache-write/)."""
    b, n, k, nq, h = q_BNKQH.shape
    g = kc_BSGH.shape[2]
    q = q_BNKQH.reshape(b, n, k, g, nq // g, h)
    scale = h**-0.5
    s_ctx = jnp.einsum("BNKGRH,BSGH->BGRNKS", q, kc_BSGH, preferred_element_type=jnp.float32) * scale
    s_blk = jnp.einsum("BNKGRH,BNJGH->BGRNKJ", q, kb_BNJGH, preferred_element_type=jnp.float32) * scale
    s_ctx = jnp.where(ctx_mask[:, None, None], s_ctx, MASK_VALUE)
    s_blk = jnp.where(blk_mask[:, None, None], s_blk, MASK_VALUE)
    probs = jax.nn.softmax(jnp.concatenate([s_ctx, s_blk], axis=-1), axis=-1).astype(vc_BSGH.dtype)
    p_ctx, p_blk = probs[..., : s_ctx.shape[-1]], probs[..., s_ctx.shape[-1] :]
    out = jnp.einsum("BGRNKS,BSGH->BNKGRH", p_ctx, vc_BSGH) + jnp.einsum("BGRNKJ,BNJGH->BNKGRH", p_blk, vb_BNJGH)
    return out.reshape(b, n, k, nq, h)


def out_projection(o_XQH, w_QHD):
    """The attention output projection [..., Q, H] x [Q, H, D] -> [..., D], as one matmul over the Q*H features.

    Written as einsum("...QH,QHD->...D"), XLA:CPU put the two contracted dims of the weight in the attention
    output's order (H before Q) and so copied the whole [Q, H, D] weight, transposed, in every layer of every
    decode step (`tests/test_target.py` checks the compiled step). Flattened, the weight is used as stored.
    """
    q, h, d = w_QHD.shape
    o_XF = o_XQH.reshape(*o_XQH.shape[:-2], q * h)
    return jnp.einsum("...F,FD->...D", o_XF, w_QHD.reshape(q * h, d).astype(o_XQH.dtype))


def swiglu(x_BTD, gate_DM, up_DM, down_MD):
    return (jax.nn.silu(x_BTD @ gate_DM.astype(x_BTD.dtype)) * (x_BTD @ up_DM.astype(x_BTD.dtype))) @ down_MD.astype(
        x_BTD.dtype
    )
