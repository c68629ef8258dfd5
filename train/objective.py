"""The DFlash training objective: random-anchor blocks, same-position labels, decayed CE through the frozen lm_head.

Dimension letters: docs/glossary.md (one glossary for the repository).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from dflash_model.drafter import train_logits
from dflash_model.target import config_of, lm_head_weight

# Paper values (K=8, 10, 16). Other K: gamma grows like K**0.7 through gamma(16) = 7 (a power law fitted to
# the three published points: it gives 4.3, 5.0, 7.0 there): gamma(64) = 18.5 and gamma(128) = 30.0, so the last
# position of a K=64 block keeps weight exp(-62/18.5) = 0.035 and of K=128 exp(-126/30) = 0.015, the same
# order as K=16's exp(-14/7) = 0.14 decayed over a 4-8x wider block. Which gamma is best for wide blocks is
# an open question: it is a config value.
PAPER_GAMMA = {8: 4.0, 10: 5.0, 16: 7.0}


def default_gamma(block_size: int) -> float:
    return PAPER_GAMMA.get(block_size, round(7.0 * (block_size / 16) ** 0.7, 2))


def gamma_of(cfg) -> float:
    """The loss decay a config trains with: its `gamma`, or the default for its block size."""
    return cfg.gamma if cfg.gamma is not None else default_gamma(cfg.block_size)


def position_weights(block_size: int, gamma: float):
    """[K] loss weight per block slot: 0 for slot 0 (it holds the given token), exp(-(k-1)/gamma) for k >= 1."""
    k = jnp.arange(block_size, dtype=jnp.float32)
    return jnp.where(k >= 1, jnp.exp(-(k - 1) / gamma), 0.0)


def loss_slots(block_size: int, loss_positions: int | None) -> int:
    """The block slots the loss covers, as an end index: slots 1..loss_slots-1 (slot 0 is never a label)."""
    return block_size if loss_positions is None else min(int(loss_positions) + 1, block_size)


def block_labels(tokens_BT, loss_mask_BT, anchors_BN, block_size: int):
    """Same-position labels [B, N, K] = tokens[a + k] and their validity (anchor real, k >= 1, inside the
    sequence, and a loss-mask token); slot 0 is never a label. `tokens_BT` may be any per-position label row
    (e.g. the target's own greedy next token at each position, see `target_labels`)."""
    t = tokens_BT.shape[1]
    idx = anchors_BN[..., None] + jnp.arange(block_size, dtype=jnp.int32)
    inside = (anchors_BN[..., None] >= 0) & (idx < t) & (jnp.arange(block_size) >= 1)
    safe = jnp.clip(idx, 0, t - 1).reshape(idx.shape[0], -1)
    labels = jnp.take_along_axis(tokens_BT, safe, axis=1).reshape(idx.shape)
    in_mask = jnp.take_along_axis(loss_mask_BT.astype(bool), safe, axis=1).reshape(idx.shape)
    return labels, inside & in_mask


def target_labels(tokens_BT, logits_BTV):
    """[B, T] labels from the target itself: position t holds argmax(logits[t-1]), the target's greedy next token
    after the real prefix tokens[:t] (position 0 keeps its token: nothing predicts it). Training on these labels
    distills the target's greedy choices from text it did not write, without generating: one forward, which the
    online step runs anyway."""
    pred = jnp.argmax(logits_BTV[:, :-1], axis=-1).astype(tokens_BT.dtype)
    return jnp.concatenate([tokens_BT[:, :1], pred], axis=1)


def on_greedy_path(tokens_BT, labels_BT, anchors_BN, block_size: int):
    """[B, N, K] True where slot k's label continues the target's own greedy path from the anchor: every text
    token a+1 .. a+k-1 before it equals the target's greedy choice there. Then the block's earlier labels are the
    tokens the target would itself have written after token a, and slot k's label is its greedy next token after
    them: the label a speculative round verifies. Past the first disagreement the target label was predicted after
    a human token the target would not have chosen, a prefix no round sees; those slots leave the loss. Slot 1
    is always on the path."""
    t = tokens_BT.shape[1]
    idx = jnp.clip(anchors_BN[..., None] + jnp.arange(block_size, dtype=jnp.int32), 0, t - 1)
    agree = jnp.take_along_axis(tokens_BT == labels_BT, idx.reshape(idx.shape[0], -1), axis=1).reshape(idx.shape)
    # slot k needs agreement at slots 1..k-1: an exclusive cumulative product (slot 0 holds the given token)
    upto = jnp.cumprod(agree.at[..., 0].set(True), axis=-1).astype(bool)
    return jnp.concatenate([jnp.ones_like(upto[..., :1]), upto[..., :-1]], axis=-1)


def restrict_vocab(labels, valid, vocab_ids_U, vocab_size: int):
    """(labels as indices into `vocab_ids_U`, validity) for a loss over a draft vocabulary: a label outside it
    cannot be predicted and leaves the loss (FR-Spec's frequency-ranked drafting vocabulary, applied to training).
    """
    n = vocab_ids_U.shape[0]
    index = jnp.full((vocab_size,), -1, jnp.int32).at[vocab_ids_U].set(jnp.arange(n, dtype=jnp.int32))
    sub = index[labels]
    return jnp.maximum(sub, 0), valid & (sub >= 0)


@jax.named_scope("cross_entropy")
def chunked_cross_entropy(
    target_model, hidden_XD, labels_X, chunk: int, teacher_XD=None, soft_weight: float = 0.0, vocab_ids_U=None
):
    """Per-row cross-entropy and argmax-correctness through the target's (frozen) lm_head, `chunk` rows at a time.

    The label of a row is the one-hot of `labels_X`, or with `teacher_XD` (the target's own final-normed hidden
    state that predicted that token) the mixture (1 - soft_weight) * onehot + soft_weight * softmax(teacher
    logits): distillation on the target's whole next-token distribution, which says far more per example than
    its argmax does when a run sees few examples. `correct` always compares with the hard label.

    The [X, V] logits never exist at once, and each chunk's logits are computed once: the forward pass also
    forms d loss / d hidden = (softmax - label) @ W^T and keeps only that [X, D] residual, so a training step
    costs two W x D x V matmuls per chunk (three with a teacher) instead of three (forward, rematerialised
    forward, backward) and holds no logits for the backward pass. Hand-written because no JAX library we use
    ships a fused linear cross-entropy; `tests/test_objective.py` checks values and gradients against the
    plain formula.

    `vocab_ids_U` restricts the softmax to those lm_head rows (labels are then indices into it, see
    `restrict_vocab`): N/V of the cost. Logits and the softmax are fp32 whatever the hidden dtype.
    """
    w_DV = jax.lax.stop_gradient(lm_head_weight(target_model))
    if vocab_ids_U is not None:
        w_DV = jnp.take(w_DV, vocab_ids_U, axis=1)
    w_DV = w_DV.astype(hidden_XD.dtype)
    m, d = hidden_XD.shape
    # As many chunks as `chunk` rows need, of equal size: 2,400 rows go as 3 x 800, not as 3 x 1,024 with 672
    # rows of padding through both lm_head matmuls.
    n_chunks = math.ceil(m / min(chunk, m))
    chunk = math.ceil(m / n_chunks)
    pad = n_chunks * chunk - m

    def chunks(x):
        return jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1)).reshape(n_chunks, chunk, *x.shape[1:])

    if teacher_XD is None or soft_weight == 0.0:
        teacher, soft_weight = jnp.zeros((n_chunks, 0, d), hidden_XD.dtype), 0.0
    else:
        teacher = chunks(jax.lax.stop_gradient(teacher_XD).astype(hidden_XD.dtype))
    nll, correct = _fused_ce(chunks(hidden_XD), chunks(labels_X), teacher, w_DV, float(soft_weight))
    return nll.reshape(-1)[:m], correct.reshape(-1)[:m]


def _ce_chunk(h_WD, y_W, t_WD, w_DV, soft_weight: float, with_grad: bool):
    logits = jnp.einsum("WD,DV->WV", h_WD, w_DV, preferred_element_type=jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    label = jax.nn.one_hot(y_W, logits.shape[-1], dtype=jnp.float32)
    if soft_weight:
        teacher = jax.nn.softmax(jnp.einsum("WD,DV->WV", t_WD, w_DV, preferred_element_type=jnp.float32), axis=-1)
        label = (1.0 - soft_weight) * label + soft_weight * teacher
    nll = lse - jnp.sum(label * logits, axis=-1)
    correct = jnp.argmax(logits, axis=-1) == y_W
    if not with_grad:
        return nll, correct
    p = jnp.exp(logits - lse[:, None]) - label
    return (
        nll,
        correct,
        jnp.einsum("WV,DV->WD", p.astype(w_DV.dtype), w_DV, preferred_element_type=jnp.float32).astype(h_WD.dtype),
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _fused_ce(h_chunks, y_chunks, t_chunks, w_DV, soft_weight):
    return jax.lax.map(lambda a: _ce_chunk(*a, w_DV, soft_weight, with_grad=False), (h_chunks, y_chunks, t_chunks))


def _fused_ce_fwd(h_chunks, y_chunks, t_chunks, w_DV, soft_weight):
    nll, correct, dh = jax.lax.map(
        lambda a: _ce_chunk(*a, w_DV, soft_weight, with_grad=True), (h_chunks, y_chunks, t_chunks)
    )
    return (nll, correct), (dh,)


def _fused_ce_bwd(soft_weight, res, cotangents):
    (dh,) = res
    g_nll, _ = cotangents
    # The lm_head and the teacher are the frozen target's: their cotangents are zero by contract.
    return dh * g_nll[..., None].astype(dh.dtype), None, None, None


_fused_ce.defvjp(_fused_ce_fwd, _fused_ce_bwd)


@jax.named_scope("dflash_loss")
def dflash_loss(
    drafter,
    target_model,
    features_BTF,
    tokens_BT,
    loss_mask_BT,
    anchors_BN,
    *,
    block_size: int,
    gamma: float,
    ce_chunk: int = 1024,
    loss_positions: int | None = None,
    teacher_BTD=None,
    soft_weight: float = 0.0,
    labels_BT=None,
    vocab_ids_U=None,
    compute_dtype=None,
):
    """Weighted CE of all anchor blocks, normalised by the weight sum; returns (loss, metrics).

    `loss_positions` P < K-1 trains only block slots 1..P: the drafter still runs the whole K-wide block (every
    slot attends to all K, as at decode time), but the lm_head cross-entropy, the costliest part of a CPU step,
    covers P of the K-1 predictions (the same as weight 0 for slots > P).

    `teacher_BTD` (the target's final-normed hidden states) with `soft_weight` > 0 distills: the label of slot k
    mixes in the target's distribution at position a+k-1 (see chunked_cross_entropy).

    `labels_BT` replaces the text as the label row (block inputs stay the text's tokens), on the target's greedy
    path only: see `target_labels` and `on_greedy_path`.
    `vocab_ids_U` trains against a draft vocabulary (see `restrict_vocab`; `acc` then counts in-vocabulary labels
    only). `compute_dtype` (e.g. bfloat16) runs the drafter and the lm_head matmuls in that dtype; parameters,
    softmax and loss stay fp32.

    metrics: `loss`, `acc` [P] per-position top-1 accuracy (slots 1..P, over valid labels), `sim_tau` =
    1 + sum_k prod_{j<=k} acc_j (expected committed tokens per round if positions were independent and a
    round stopped at the first miss; the 1 is the bonus token), `valid_labels`.
    """
    hidden = train_logits(
        drafter,
        target_model,
        features_BTF,
        tokens_BT,
        anchors_BN,
        block_size,
        hidden_only=True,
        compute_dtype=compute_dtype,
    )
    labels, valid = block_labels(tokens_BT if labels_BT is None else labels_BT, loss_mask_BT, anchors_BN, block_size)
    if labels_BT is not None:
        valid = valid & on_greedy_path(tokens_BT, labels_BT, anchors_BN, block_size)
    slots = loss_slots(block_size, loss_positions)
    # Slot 0 holds the given token and is never a label: the cross-entropy, a step's costliest part, covers
    # slots 1..slots-1 only (1/K of its rows saved, the same loss and gradients).
    hidden, labels, valid = hidden[:, :, 1:slots], labels[:, :, 1:slots], valid[:, :, 1:slots]
    d = hidden.shape[-1]
    teacher = None
    if teacher_BTD is not None and soft_weight:
        # Slot k's label is token a+k, which the target predicted at position a+k-1.
        t = teacher_BTD.shape[1]
        idx = jnp.clip(anchors_BN[..., None] + jnp.arange(1, slots, dtype=jnp.int32) - 1, 0, t - 1)
        teacher = jnp.take_along_axis(teacher_BTD, idx.reshape(idx.shape[0], -1)[..., None], axis=1).reshape(-1, d)
    if vocab_ids_U is not None:
        labels, valid = restrict_vocab(labels, valid, vocab_ids_U, config_of(target_model).vocab_size)
    nll, correct = chunked_cross_entropy(
        target_model, hidden.reshape(-1, d), labels.reshape(-1), ce_chunk, teacher, soft_weight, vocab_ids_U
    )
    nll, correct = nll.reshape(labels.shape), correct.reshape(labels.shape)
    w = position_weights(block_size, gamma)[1:slots] * valid
    loss = jnp.sum(w * nll) / jnp.maximum(jnp.sum(w), 1e-9)
    n_valid = jnp.sum(valid, axis=(0, 1))
    acc = jnp.sum(correct * valid, axis=(0, 1)) / jnp.maximum(n_valid, 1)
    sim_tau = 1.0 + jnp.sum(jnp.cumprod(acc))
    return loss, {"loss": loss, "acc": acc, "sim_tau": sim_tau, "valid_labels": jnp.sum(valid)}
