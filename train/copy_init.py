"""Start a drafter as an in-context copy circuit, fitted by least squares on the target's own features
(`drafter.init: copy`). No public DFlash trainer initialises its drafter this way; written by hand because no
library builds attention circuits from data.

What n-gram drafting exploits, and what a random-init drafter takes ~10^5 blocks to learn (docs/results.md, "The
copy-circuit start"), is copying: if the block's first token x_a occurred before at p, propose what followed it
there. On the default run's replies, "the successor of x_a's latest earlier occurrence" is right for a third of the
slot-1 labels. The circuit, with two draft layers:

  layer 0, a sliding layer with window 2 and near-zero scores (every query averages itself and the slot before):
    slot 1 picks up a code of slot 0's token (v_proj; predictable_codes), written by o_proj into a subspace S_q of the
    residual that the mask token's embedding does not touch;
  layer 1, full attention: slot 1's query reads S_q; every context key is a code of the context token x_p,
    fitted by ridge regression from the target features at p; queries and keys live in the RoPE pairs that
    rotate least (so the match ignores distance) and q_norm / k_norm set how sharp the match is. The value at p
    is a rank-(kv heads x head_dim) code of the target's final-normed hidden state at p (the state whose lm_head
    row scores are the target's next-token logits there, so its argmax is x_{p+1} on the target's own text),
    again fitted by ridge regression from the features; o_proj writes it back in the target's hidden basis.
  Both MLPs start near zero, and the final norm carries the target's typical final-hidden scale.

Every fitted map goes into the z-lab tensors (fc, q/k/v/o_proj, norms): the checkpoint format is unchanged.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np

from dflash_model.config import ConfigError
from dflash_model.drafter import Drafter, train_logits
from dflash_model.drafter_config import check_pairing
from dflash_model.layers import rope_inv_freq
from dflash_model.target import config_of, embedding_table, final_norm, forward, is_maxtext, lm_head_weight
from train.objective import position_weights

log = logging.getLogger(__name__)

FIT_ROWS = 200  # training rows the fit reads at most (the default run has 151: ~1 min of target forwards here)


def unit_rms(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def ridge_fit(x: np.ndarray, y: np.ndarray, lam: float) -> np.ndarray:
    return np.linalg.solve(x.T @ x + lam * np.eye(x.shape[1]), x.T @ y)


def slow_rope_dims(head_dim: int, rope_theta: float, rope_scaling, max_distance: int, max_angle: float = 0.5):
    """Indices of the head dims whose RoPE pair turns by at most `max_angle` radians over `max_distance`
    positions (rotate-half layout: pair i is dims i and i + head_dim/2): there a q.k score is nearly the same at
    any distance, so it can match content."""
    inv = np.asarray(rope_inv_freq(head_dim, rope_theta, rope_scaling))
    slow = np.nonzero(inv * max_distance <= max_angle)[0]
    return np.concatenate([slow, slow + head_dim // 2])


def predictable_codes(e_hat: np.ndarray, ids: np.ndarray, feats: np.ndarray, mask_token_id: int, n: int, lam: float):
    """(code [n, D], w_code [F, n]): the directions of the (rms-normed) embeddings `e_hat` of the tokens `ids` that a
    ridge map of the features at their positions `feats` predicts best (canonical correlation), each scaled to unit
    variance over the positions, and that ridge map (`feats @ w_code` fits `e_hat[ids] @ code.T`). The mean of the
    seen embeddings (over distinct tokens, not positions) and the mask token's embedding are projected out first, so
    the mask codes to 0. `e_hat[t] @ code.T` is token t's code.

    Against the whitened principal directions of the embeddings (every direction, however hard to read from the
    features), held-out slot-1 accuracy of the circuit 0.284 -> 0.310 (docs/results.md, "The copy-circuit start")."""
    d = e_hat.shape[1]
    seen = np.unique(ids)
    fixed = np.linalg.qr(np.stack([e_hat[seen].mean(0), e_hat[mask_token_id]], 1))[0]  # [D, 2]
    e = e_hat[ids] @ (np.eye(d) - fixed @ fixed.T)
    lam_e, vec = np.linalg.eigh(e.T @ e / len(e))
    keep = lam_e > 1e-6 * lam_e.max()
    whiten = vec[:, keep] / np.sqrt(lam_e[keep])  # [D, D']: unit variance per dim over the positions
    z = e @ whiten
    w_z = ridge_fit(feats, z, lam)
    _, u = np.linalg.eigh(z.T @ (feats @ w_z) / len(z))  # z' P z (P the ridge hat matrix): ascending predictability
    best = u[:, ::-1][:, :n]
    return (whiten @ best).T, w_z @ best  # ridge fits are linear in their targets: the codes' map, not a refit


def head_rows(target_model, ids: np.ndarray) -> np.ndarray:
    """The lm_head rows of the tokens in `ids`, centred and weighted by sqrt(count): the scores that matter."""
    toks, counts = np.unique(ids, return_counts=True)
    rows = np.asarray(jnp.take(lm_head_weight(target_model), jnp.asarray(toks), axis=1).T, np.float32)
    w = counts / counts.sum()
    return (rows - w @ rows) * np.sqrt(counts / counts.mean())[:, None]


def _logit_preserving_rank(fitted: np.ndarray, w: np.ndarray, head: np.ndarray, rank: int):
    """Cut the fitted map w ([F, D], fitted = x @ w) to `rank` dims so that the lm_head scores `fitted @ head.T`
    change least (reduced-rank regression in the metric head.T @ head). Returns (w_code [F, rank], basis
    [rank, D]) with x @ w_code @ basis the cut map. The plain principal directions of the fitted hidden keep its
    largest components, most of which every token scores alike: on held-out rows of the default run's replies, the
    rank-192 value's argmax over the draft vocabulary is the next token 0.627 of the time this way, 0.543 that way
    (docs/results.md, "The copy-circuit start")."""
    ev, eq = np.linalg.eigh(head.T @ head)
    ev = np.maximum(ev, 1e-6 * ev.max())
    root, inv_root = (eq * np.sqrt(ev)) @ eq.T, (eq / np.sqrt(ev)) @ eq.T
    m = fitted @ root
    _, u = np.linalg.eigh(m.T @ m)
    u = u[:, ::-1][:, :rank]
    return w @ root @ u, u.T @ inv_root


def calibrate_output_scale(
    drafter: Drafter, target_model, data, gamma: float, loss_positions: int | None = None, rows: int = 16, anchors=32
):
    """The factor on the drafter's final norm that minimises the training loss of the circuit as built: the
    gamma-weighted cross-entropy of block slots 1.. (1..loss_positions) over the tokens of `data` (collect's
    rows), the labels the row's own next tokens. A copy circuit is right a quarter of the time and sure of itself
    every time; left uncalibrated, the first Adam steps spend the circuit's weights on lowering its confidence (on
    the default run, training slot-1 accuracy 0.20 -> 0.05 in 10 steps). A logit scale changes no argmax."""
    k = drafter.config.block_size
    slots = min(k - 1, int(np.ceil(3 * gamma)), loss_positions or k)  # weights past 3 gamma are < 5% of slot 1's
    weights = np.asarray(position_weights(k, gamma))[1 : slots + 1]
    vocab = np.unique(np.concatenate([x[0] for x in data]))
    head = jnp.take(lm_head_weight(target_model), jnp.asarray(vocab), axis=1)  # [D, V']
    hidden_fn = jax.jit(lambda f, t, a: train_logits(drafter, target_model, f, t, a, k, hidden_only=True))
    logits, labels, weight = [], [], []
    width = max(len(x[0]) for x in data[:rows])  # one compiled shape: a block sees only the context before it
    for ids, feats, _ in data[:rows]:
        at = np.full(anchors, -1, np.int32)  # padding anchors (< 0) are ignored
        at[: min(anchors, len(ids) - 2)] = np.linspace(1, len(ids) - 2, min(anchors, len(ids) - 2))
        pad = width - len(ids)
        hidden = hidden_fn(
            jnp.asarray(np.pad(feats, ((0, pad), (0, 0))))[None],
            jnp.asarray(np.pad(ids, (0, pad)), jnp.int32)[None],
            jnp.asarray(at)[None],
        )
        at = at[at >= 0]
        hidden = hidden[:, : len(at)]
        pos = at[:, None] + np.arange(1, slots + 1)[None]  # [N, S] the position each slot predicts
        ok = pos < len(ids)
        logits.append(np.asarray(hidden[0, :, 1 : slots + 1] @ head)[ok])
        labels.append(np.searchsorted(vocab, ids[np.minimum(pos, len(ids) - 1)])[ok])
        weight.append(np.broadcast_to(weights, pos.shape)[ok])
    logits, labels, weight = np.concatenate(logits), np.concatenate(labels), np.concatenate(weight)
    picked = logits[np.arange(len(labels)), labels]

    def loss(scale):
        z = scale * logits
        top = z.max(-1)
        lse = top + np.log(np.exp(z - top[:, None]).sum(-1))
        return float(np.sum(weight * (lse - scale * picked)) / weight.sum())

    grid = np.geomspace(1e-3, 4.0, 49)
    losses = [loss(s) for s in grid]
    best = int(np.argmin(losses))
    return float(grid[best]), loss(1.0), losses[best]


def collect(target_model, rows, layer_ids):
    """Per row: token ids [T], the concatenated features [T, F] and the target's final-normed hidden [T, D]."""
    last = config_of(target_model).num_hidden_layers - 1
    fwd = jax.jit(lambda ids: forward(target_model, ids, layer_ids=(*layer_ids, last), compute_logits=False))
    width = max(len(r) for r in rows)  # one compiled shape: causal attention leaves the padded tail unseen
    out = []
    for ids in rows:
        padded = np.zeros(width, np.int32)
        padded[: len(ids)] = ids
        f = fwd(jnp.asarray(padded)[None]).features[0, : len(ids)]
        d = f.shape[-1] // (len(layer_ids) + 1)
        out.append(
            (
                np.asarray(ids),
                np.asarray(f[:, :-d], np.float32),
                np.asarray(final_norm(target_model, f[:, -d:]), np.float32),
            )
        )
    return out


def fit_copy_circuit(
    drafter: Drafter,
    target_model,
    rows: list[np.ndarray],
    *,
    max_rows: int = FIT_ROWS,
    sharpness: float = 16.0,
    ridge: float = 10.0,
    query_scale: float = 1.0,
    value_scale: float = 64.0,
    gamma: float | None = None,
    loss_positions: int | None = None,
    seed: int = 0,
) -> Drafter:
    """Set every drafter weight to the copy circuit (module docstring), fitted on the first `max_rows` of `rows`
    (token id arrays).

    sharpness: the q.k score of a perfect match (before the softmax). query_scale / value_scale: RMS of the
    query code and of the copied value in the residual, relative to the mask embedding's. gamma: the training
    loss's decay over block slots (and loss_positions, the slots it trains); given, the final norm is scaled to
    the logit scale that minimises that loss on the fitted rows (calibrate_output_scale), else it carries the
    target's typical final-hidden RMS.
    """
    cfg, tcfg = drafter.config, config_of(target_model)
    check_pairing(cfg, tcfg)
    if is_maxtext(target_model):
        raise ConfigError("drafter.init=copy reads the Tunix target's embedding: not available with target.maxtext")
    if cfg.num_hidden_layers != 2 or cfg.layer_types != ("sliding_attention", "full_attention"):
        raise ConfigError(
            "drafter.init=copy builds a two-layer circuit: set drafter.num_layers=2, "
            "drafter.layer_types=[sliding_attention, full_attention], drafter.sliding_window=2 "
            f"(got {cfg.num_hidden_layers} layers, layer_types={cfg.layer_types})"
        )
    if cfg.sliding_window != 2:
        raise ConfigError(f"drafter.init=copy needs drafter.sliding_window=2 (got {cfg.sliding_window})")
    d, nq, g, h = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    per_group = nq // g
    rows = rows[:max_rows]
    lengths = [len(r) for r in rows]
    slow = slow_rope_dims(h, cfg.rope_theta, cfg.rope_scaling, max(lengths))
    r = len(slow)  # key code dims per kv head
    if r < 8:
        raise ConfigError(f"drafter.init=copy: only {r} RoPE dims turn slowly enough over {max(lengths)} positions")

    data = collect(target_model, rows, cfg.target_layer_ids)
    ids = np.concatenate([x[0][1:] for x in data])  # position 0 (BOS-like, outsized features) is left out
    feats = np.concatenate([unit_rms(x[1][1:]) for x in data])
    final = np.concatenate([x[2][1:] for x in data])

    # Token codes: the embedding directions (mean embedding and the mask token's projected out, so the mask codes
    # to 0) that a linear map of the features at a token's position predicts best, each at unit variance: the keys
    # are that map of the features (w_key), the queries read the embedding itself.
    emb = np.asarray(embedding_table(target_model), np.float32)
    e_hat = unit_rms(emb)
    code, w_key = predictable_codes(e_hat, ids, feats, cfg.mask_token_id, g * r, ridge)  # [g*r, D], [F, g*r]

    # Residual / context directions, least used by embeddings first: keys (D_k), the query subspace (S_q) and
    # values (D_v) do not overlap, and block slots (embeddings) barely reach the key and value directions.
    seen = np.unique(ids)
    energy = e_hat[seen].T @ e_hat[seen] + np.outer(e_hat[cfg.mask_token_id], e_hat[cfg.mask_token_id])
    _, basis = np.linalg.eigh(energy)  # ascending
    nv = g * h
    if 2 * g * r + nv > d:
        raise ConfigError(f"drafter.init=copy: {2 * g * r + nv} circuit dims do not fit hidden_size={d}")
    dk, sq, dv = basis[:, : g * r].T, basis[:, g * r : 2 * g * r].T, basis[:, 2 * g * r : 2 * g * r + nv].T

    # Fitted maps from the (rms-normed) features: key = code of the token at p (above); value = the target's
    # final-normed hidden at p, cut to nv dims in the metric of the lm_head rows that score it.
    w_val = ridge_fit(feats, final, ridge)  # [F, D]
    w_val, val_basis = _logit_preserving_rank(feats @ w_val, w_val, head_rows(target_model, ids), nv)
    key_part, token_code = feats @ w_key, e_hat[ids] @ code.T
    key_fit = np.mean(np.sum(key_part * token_code, -1)) / np.mean(np.sum(token_code**2, -1))
    log.info("copy init: %d rows, %d positions, %d key dims per kv head, key fit %.2f", len(data), len(ids), r, key_fit)

    # fc writes [key code ; value code] into D_k / D_v. hidden_norm then scales the context to unit RMS; the two
    # parts keep their ratio, and k_norm renormalises keys anyway.
    val_part = feats @ w_val
    ratio = np.sqrt(np.mean(key_part**2) / np.mean(val_part**2))
    fc = w_key @ dk + ratio * (w_val @ dv)  # raw features in: fc is linear, so rms-normed fits keep their direction

    mask_rms = float(np.sqrt(np.mean(emb[cfg.mask_token_id] ** 2)))
    final_rms = float(np.sqrt(np.mean(final**2)))
    layer0, layer1 = drafter.layers
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    put = lambda param, value: param.set_value(f32(value).astype(param.get_value().dtype))

    # Layer 0: uniform over (slot before, itself) (q/k below); v = token code, o writes it into S_q.
    v0 = np.zeros((d, g, h))
    o0 = np.zeros((nq, h, d))
    # A code vector has RMS 1 per dim after whitening; the attention halves it (mask slot codes to 0).
    q_gain = 2.0 * query_scale * mask_rms * np.sqrt(d / (g * r)) / per_group
    for j in range(g):
        v0[:, j, :r] = code[j * r : (j + 1) * r].T
        for i in range(per_group):
            o0[j * per_group + i, :r] = q_gain * sq[j * r : (j + 1) * r]
    put(layer0.self_attn.v_proj, v0)
    put(layer0.self_attn.o_proj, o0)

    # Layer 1: query from S_q, keys from D_k, both in the slow RoPE dims; values from D_v.
    q1 = np.zeros((d, nq, h))
    k1 = np.zeros((d, g, h))
    v1 = np.zeros((d, g, h))
    o1 = np.zeros((nq, h, d))
    for j in range(g):
        k1[:, j, slow] = dk[j * r : (j + 1) * r].T
        v1[:, j, :] = dv[j * h : (j + 1) * h].T
        for i in range(per_group):
            q1[:, j * per_group + i, slow] = sq[j * r : (j + 1) * r].T
            o1[j * per_group + i] = val_basis[j * h : (j + 1) * h] / per_group
    # q_norm / k_norm give unit RMS over head_dim with r of h dims nonzero: q.k = h * cos * w^2, scaled 1/sqrt(h).
    w = np.sqrt(sharpness / np.sqrt(h))
    norm_w = np.ones(h)
    norm_w[slow] = w
    put(layer1.self_attn.q_proj, q1)
    put(layer1.self_attn.k_proj, k1)
    put(layer1.self_attn.v_proj, v1)
    # hidden_norm divides the context by ctx_rms (per dim); scale the copied vector (the nv value dims written
    # back into D dims by val_basis) to value_scale x the mask embedding's RMS.
    ctx_rms = np.sqrt(np.mean(key_part**2) * g * r / d + np.mean((val_part * ratio) ** 2) * nv / d)
    copied_rms = ratio / ctx_rms * np.sqrt(np.mean((val_part @ val_basis) ** 2))
    o_gain = value_scale * mask_rms / max(copied_rms, 1e-9)
    put(layer1.self_attn.o_proj, o1 * o_gain)
    # What the circuit does not use starts small but not zero, so it can learn (a zero MLP or a zero q and k get
    # no gradient): layer 0's q/k random with q_norm / k_norm 0.1 (scores ~0.1 x cos: still uniform over the two
    # keys), the MLPs random with a down_proj 10x smaller than HF's init (outputs ~1% of the residual).
    rng = np.random.default_rng(seed)
    small = lambda shape, std: std * rng.standard_normal(shape)
    put(layer0.self_attn.q_proj, small((d, nq, h), 0.02))
    put(layer0.self_attn.k_proj, small((d, g, h), 0.02))
    put(layer0.self_attn.q_norm, np.full(h, 0.1))
    put(layer0.self_attn.k_norm, np.full(h, 0.1))
    put(layer1.self_attn.q_norm, norm_w)
    put(layer1.self_attn.k_norm, norm_w)
    for layer in (layer0, layer1):
        put(layer.input_layernorm, np.ones(d))
        put(layer.post_attention_layernorm, np.ones(d))
        put(layer.mlp.gate_proj, small(layer.mlp.gate_proj.get_value().shape, 0.02))
        put(layer.mlp.up_proj, small(layer.mlp.up_proj.get_value().shape, 0.02))
        put(layer.mlp.down_proj, small(layer.mlp.down_proj.get_value().shape, 0.002))
    put(drafter.fc, fc)
    put(drafter.hidden_norm, np.ones(d))
    put(drafter.norm, np.full(d, final_rms))
    if gamma is not None:
        scale, before, after = calibrate_output_scale(drafter, target_model, data, gamma, loss_positions)
        log.info("copy init: logit scale %.3g (training loss of the circuit %.2f -> %.2f)", scale, before, after)
        put(drafter.norm, np.full(d, final_rms * scale))
    return drafter
