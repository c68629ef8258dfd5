"""The DFlash training objective: random-anchor blocks, same-position labels, decayed CE through the frozen lm_head.

Dimension letters: B sequences, T tokens, N anchors (blocks) per sequence, K block size, D width, V vocab,
M = B*N*K flattened block positions, C rows per cross-entropy chunk.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from dflash_model.drafter import train_logits
from dflash_model.target import lm_head_weight

# Paper values (K=8, 10, 16). Other K: gamma grows like K**0.7 through gamma(16) = 7 (a power law fitted to
# the three published points: it gives 4.3, 5.0, 7.0 there): gamma(64) = 18.5 and gamma(128) = 30.0, so the last
# position of a K=64 block keeps weight exp(-62/18.5) = 0.035 and of K=128 exp(-126/30) = 0.015, the same
# order as K=16's exp(-14/7) = 0.14 decayed over a 4-8x wider block. Which gamma is best for wide blocks is
# an open question: it is a config value.
PAPER_GAMMA = {8: 4.0, 10: 5.0, 16: 7.0}


def default_gamma(block_size: int) -> float:
    return PAPER_GAMMA.get(block_size, round(7.0 * (block_size / 16) ** 0.7, 2))


def position_weights(block_size: int, gamma: float):
    """[K] loss weight per block slot: 0 for slot 0 (it holds the given token), exp(-(k-1)/gamma) for k >= 1."""
    k = jnp.arange(block_size, dtype=jnp.float32)
    return jnp.where(k >= 1, jnp.exp(-(k - 1) / gamma), 0.0)


def block_labels(tokens_BT, loss_mask_BT, anchors_BN, block_size: int):
    """Same-position labels [B, N, K] = tokens[a + k] and their validity (anchor real, k >= 1, inside the
    sequence, and a loss-mask token); slot 0 is never a label."""
    t = tokens_BT.shape[1]
    idx = anchors_BN[..., None] + jnp.arange(block_size, dtype=jnp.int32)
    inside = (anchors_BN[..., None] >= 0) & (idx < t) & (jnp.arange(block_size) >= 1)
    safe = jnp.clip(idx, 0, t - 1).reshape(idx.shape[0], -1)
    labels = jnp.take_along_axis(tokens_BT, safe, axis=1).reshape(idx.shape)
    in_mask = jnp.take_along_axis(loss_mask_BT.astype(bool), safe, axis=1).reshape(idx.shape)
    return labels, inside & in_mask


def chunked_cross_entropy(target_model, hidden_MD, labels_M, chunk: int):
    """Per-row NLL and argmax-correctness through the target's (frozen) lm_head, `chunk` rows at a time.

    The [M, V] logits never exist at once, and each chunk's logits are computed once: the forward pass also
    forms d nll / d hidden = (softmax - onehot) @ W^T and keeps only that [M, D] residual, so a training step
    costs two C x D x V matmuls per chunk instead of three (forward, rematerialised forward, backward) and
    holds no logits for the backward pass. Hand-written because no JAX library we use ships a fused
    linear cross-entropy; `tests/test_objective.py` checks values and gradients against the plain formula.
    """
    w_DV = jax.lax.stop_gradient(lm_head_weight(target_model)).astype(hidden_MD.dtype)
    m, d = hidden_MD.shape
    chunk = min(chunk, m)  # never pad a short batch up to a whole chunk (K=16 x 16 anchors is 256 rows, not 1024)
    n_chunks = math.ceil(m / chunk)
    pad = n_chunks * chunk - m
    h = jnp.pad(hidden_MD, ((0, pad), (0, 0))).reshape(n_chunks, chunk, d)
    y = jnp.pad(labels_M, (0, pad)).reshape(n_chunks, chunk)
    nll, correct = _fused_ce(h, y, w_DV)
    return nll.reshape(-1)[:m], correct.reshape(-1)[:m]


def _ce_chunk(h_CD, y_C, w_DV, with_grad: bool):
    logits = jnp.einsum("CD,DV->CV", h_CD, w_DV).astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    nll = lse - jnp.take_along_axis(logits, y_C[:, None], axis=-1)[:, 0]
    correct = jnp.argmax(logits, axis=-1) == y_C
    if not with_grad:
        return nll, correct
    p = jnp.exp(logits - lse[:, None])
    p = p - jax.nn.one_hot(y_C, p.shape[-1], dtype=p.dtype)
    return nll, correct, jnp.einsum("CV,DV->CD", p.astype(w_DV.dtype), w_DV).astype(h_CD.dtype)


@jax.custom_vjp
def _fused_ce(h_chunks, y_chunks, w_DV):
    return jax.lax.map(lambda a: _ce_chunk(*a, w_DV, with_grad=False), (h_chunks, y_chunks))


def _fused_ce_fwd(h_chunks, y_chunks, w_DV):
    nll, correct, dh = jax.lax.map(lambda a: _ce_chunk(*a, w_DV, with_grad=True), (h_chunks, y_chunks))
    return (nll, correct), (dh,)


def _fused_ce_bwd(res, cotangents):
    (dh,) = res
    g_nll, _ = cotangents
    # The lm_head is the frozen target's: its cotangent is zero by contract (the trainer never updates it).
    return dh * g_nll[..., None].astype(dh.dtype), None, None


_fused_ce.defvjp(_fused_ce_fwd, _fused_ce_bwd)


def dflash_loss(drafter, target_model, features_BTF, tokens_BT, loss_mask_BT, anchors_BN, *, block_size: int,
                gamma: float, ce_chunk: int = 1024):
    """Weighted CE of all anchor blocks, normalised by the weight sum; returns (loss, metrics).

    metrics: `loss`, `acc` [K-1] per-position top-1 accuracy (slots 1..K-1, over valid labels), `sim_tau` =
    1 + sum_k prod_{j<=k} acc_j (expected committed tokens per round if positions were independent and a
    round stopped at the first miss; the 1 is the bonus token), `valid_labels`.
    """
    hidden = train_logits(drafter, target_model, features_BTF, tokens_BT, anchors_BN, block_size, hidden_only=True)
    labels, valid = block_labels(tokens_BT, loss_mask_BT, anchors_BN, block_size)
    d = hidden.shape[-1]
    nll, correct = chunked_cross_entropy(target_model, hidden.reshape(-1, d), labels.reshape(-1), ce_chunk)
    nll, correct = nll.reshape(labels.shape), correct.reshape(labels.shape)
    w = position_weights(block_size, gamma) * valid
    loss = jnp.sum(w * nll) / jnp.maximum(jnp.sum(w), 1e-9)
    n_valid = jnp.sum(valid, axis=(0, 1))[1:]
    acc = jnp.sum(correct * valid, axis=(0, 1))[1:] / jnp.maximum(n_valid, 1)
    sim_tau = 1.0 + jnp.sum(jnp.cumprod(acc))
    return loss, {"loss": loss, "acc": acc, "sim_tau": sim_tau, "valid_labels": jnp.sum(valid)}
