"""The DFlash objective: labels and masks through values and gradients; loss equals a per-block recomputation."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import tiny_target
from flax import nnx

from dflash_model.drafter import DraftCache, build_drafter, draft_logits, extend_context
from dflash_model.drafter_config import drafter_config_for
from dflash_model.target import final_norm, forward, lm_head
from train.objective import block_labels, chunked_cross_entropy, default_gamma, dflash_loss, position_weights

K = 6
LAYER_IDS = (0, 2)


@pytest.fixture(scope="module")
def setup():
    target = tiny_target("qwen3")
    cfg = drafter_config_for(
        target.target_config, mask_token_id=511, num_layers=2, n_features=2, block_size=K, target_layer_ids=LAYER_IDS
    )
    drafter = build_drafter(cfg, seed=1)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 500, (2, 40)), jnp.int32)
    loss_mask = jnp.asarray(np.arange(40)[None, :] >= np.asarray([[8], [12]]))
    loss_mask = loss_mask.at[1, 30].set(False)  # a hole inside a block: that label must drop out
    anchors = jnp.asarray([[8, 15, 22, 36], [12, 25, 27, -1]], jnp.int32)  # 36 + K runs past T; -1 = padding
    features = forward(target, tokens, layer_ids=LAYER_IDS, compute_logits=False).features
    return target, drafter, tokens, loss_mask, anchors, features


def test_gamma_defaults():
    assert default_gamma(16) == 7 and default_gamma(10) == 5 and default_gamma(8) == 4
    assert default_gamma(64) == 18.47 and default_gamma(128) == 30.01
    w = np.asarray(position_weights(16, 7.0))
    assert w[0] == 0 and w[1] == 1 and np.isclose(w[15], np.exp(-14 / 7))


def test_labels_are_same_position_and_masked(setup):
    _, _, tokens, loss_mask, anchors, _ = setup
    labels, valid = block_labels(tokens, loss_mask, anchors, K)
    assert labels[0, 1, 3] == tokens[0, 15 + 3]  # output k of the block at a predicts token a + k
    assert not valid[:, :, 0].any()  # slot 0 holds the given token
    assert valid[0, 3].tolist() == [False, True, True, True, False, False]  # 36 + 4 = 40 is past the end
    assert not valid[1, 3].any()  # padding anchor
    assert valid[1, 2].tolist() == [False, True, True, False, True, True]  # 27 + 3 = 30 is out of the loss mask


@pytest.mark.parametrize("loss_positions, soft_weight", [(None, 0.0), (3, 0.0), (None, 0.4)])
def test_loss_equals_per_block_recomputation(setup, loss_positions, soft_weight):
    """The multi-block training pass + chunked CE equals drafting each block alone from a context cache; with
    loss_positions only slots 1..P count, and with a soft weight w the label of slot k is
    (1-w) onehot + w softmax(the target's logits at a+k-1)."""
    target, drafter, tokens, loss_mask, anchors, features = setup
    gamma = 3.0
    last = target.target_config.num_hidden_layers - 1
    teacher = final_norm(target, forward(target, tokens, layer_ids=(last,), compute_logits=False).features)
    loss, metrics = dflash_loss(
        drafter,
        target,
        features,
        tokens,
        loss_mask,
        anchors,
        block_size=K,
        gamma=gamma,
        ce_chunk=7,  # a chunk size that does not divide M exercises the padding
        loss_positions=loss_positions,
        teacher_BTD=teacher,
        soft_weight=soft_weight,
    )
    target_p = jax.nn.softmax(np.asarray(forward(target, tokens).logits, np.float64), -1)
    labels, valid = block_labels(tokens, loss_mask, anchors, K)
    slots = K if loss_positions is None else loss_positions + 1
    valid = valid.at[:, :, slots:].set(False)
    w = np.asarray(position_weights(K, gamma))
    num = den = 0.0
    for b in range(2):
        for n in range(anchors.shape[1]):
            a = int(anchors[b, n])
            if a < 0:
                continue
            cache = DraftCache.init(drafter.config, 1, 64)
            cache = extend_context(drafter, cache, features[b : b + 1, :a], jnp.asarray([a]))
            block = jnp.concatenate([tokens[b, a : a + 1], jnp.full((K - 1,), 511, jnp.int32)])[None]
            logp = jax.nn.log_softmax(np.asarray(draft_logits(drafter, target, cache, block)[0], np.float64), -1)
            for k in range(1, K):
                if valid[b, n, k]:
                    q = (1 - soft_weight) * np.eye(logp.shape[-1])[int(labels[b, n, k])]
                    q = q + soft_weight * target_p[b, a + k - 1]
                    num += w[k] * -float(np.sum(q * logp[k]))
                    den += w[k]
    np.testing.assert_allclose(float(loss), num / den, rtol=1e-5)
    assert int(metrics["valid_labels"]) == int(valid.sum())
    acc = np.asarray(metrics["acc"])
    assert acc.shape == (slots - 1,)
    np.testing.assert_allclose(float(metrics["sim_tau"]), 1 + np.cumprod(acc).sum(), rtol=1e-6)


def test_fused_cross_entropy_matches_the_plain_formula(setup):
    """The fused chunked CE (gradient formed in the forward pass) equals log-softmax CE through the full
    logits: values, argmax-correctness and d loss / d hidden, with a chunk that does not divide M."""
    target = setup[0]
    d, v = target.target_config.hidden_size, target.target_config.vocab_size
    h = jax.random.normal(jax.random.key(0), (23, d))
    y = jax.random.randint(jax.random.key(1), (23,), 0, v)
    g = jax.random.uniform(jax.random.key(2), (23,))  # a non-uniform upstream cotangent

    def plain(h):
        logits = lm_head(target, h)
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=-1)[:, 0]
        return jnp.sum(g * nll), (nll, jnp.argmax(logits, -1) == y)

    def fused(h):
        nll, correct = chunked_cross_entropy(target, h, y, chunk=5)
        return jnp.sum(g * nll), (nll, correct)

    (l0, (nll0, c0)), g0 = jax.value_and_grad(plain, has_aux=True)(h)
    (l1, (nll1, c1)), g1 = jax.jit(jax.value_and_grad(fused, has_aux=True))(h)
    np.testing.assert_allclose(np.asarray(nll1), np.asarray(nll0), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(c1), np.asarray(c0))
    np.testing.assert_allclose(np.asarray(g1), np.asarray(g0), rtol=1e-4, atol=1e-6)
    assert float(jnp.abs(g0).sum()) > 0

    # With a teacher: soft cross-entropy against (1-w) onehot + w softmax(teacher logits), same checks.
    t = jax.random.normal(jax.random.key(3), (23, d))
    q = 0.7 * jax.nn.one_hot(y, v) + 0.3 * jax.nn.softmax(lm_head(target, t))

    def plain_soft(h):
        logits = lm_head(target, h)
        ce = -jnp.sum(q * jax.nn.log_softmax(logits), axis=-1)
        return jnp.sum(g * ce), ce

    def fused_soft(h):
        ce, _ = chunked_cross_entropy(target, h, y, chunk=5, teacher_XD=t, soft_weight=0.3)
        return jnp.sum(g * ce), ce

    (_, ce0), gs0 = jax.value_and_grad(plain_soft, has_aux=True)(h)
    (_, ce1), gs1 = jax.jit(jax.value_and_grad(fused_soft, has_aux=True))(h)
    np.testing.assert_allclose(np.asarray(ce1), np.asarray(ce0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gs1), np.asarray(gs0), rtol=1e-4, atol=1e-6)
    assert float(jnp.abs(gs0 - g0).max()) > 1e-3  # the teacher changes the gradient


def test_gradients_respect_the_isolation_mask(setup):
    """d loss / d features is zero at and after the last real anchor of a single-anchor row, non-zero before."""
    target, drafter, tokens, loss_mask, _, features = setup
    anchors = jnp.asarray([[20, -1, -1, -1], [-1, -1, -1, -1]], jnp.int32)
    grad = jax.grad(lambda f: dflash_loss(drafter, target, f, tokens, loss_mask, anchors, block_size=K, gamma=7.0)[0])(
        features
    )
    per_pos = np.abs(np.asarray(grad)).sum(-1)
    assert (per_pos[0, 20:] == 0).all() and (per_pos[1] == 0).all()
    assert (per_pos[0, :20] > 0).all()


def test_loss_goes_down(setup):
    """AdamW on the drafter only (target frozen): 40 steps on one batch cut the loss by more than half."""
    target, drafter, tokens, loss_mask, anchors, features = setup
    drafter = nnx.clone(drafter)
    opt = nnx.Optimizer(drafter, optax.adamw(3e-3), wrt=nnx.Param)
    target_before = jax.tree.map(np.asarray, nnx.state(target, nnx.Param))

    @nnx.jit
    def step(drafter, opt):
        def loss_fn(d):
            return dflash_loss(d, target, features, tokens, loss_mask, anchors, block_size=K, gamma=7.0)[0]

        loss, grads = nnx.value_and_grad(loss_fn)(drafter)
        opt.update(drafter, grads)
        return loss

    losses = [float(step(drafter, opt)) for _ in range(40)]
    assert losses[-1] < 0.5 * losses[0], (losses[0], losses[-1])
    after = jax.tree.map(np.asarray, nnx.state(target, nnx.Param))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(target_before), jax.tree.leaves(after)))


def test_draft_vocab_loss_is_full_loss_restricted_to_it(setup):
    """A reduced-vocabulary loss (FR-Spec) equals the plain formula over those lm_head rows only, with labels
    outside the vocabulary left out; its gradient equals that formula's."""
    target, drafter, tokens, loss_mask, anchors, features = setup
    vocab = jnp.asarray(
        np.unique(np.concatenate([np.asarray(tokens).reshape(-1)[::3], [7, 300]]))[::-1].copy(), jnp.int32
    )  # about a third of the tokens in the text: many labels fall outside
    params = nnx.state(drafter, nnx.Param)
    graph = nnx.graphdef(drafter)

    def reduced(p):
        return dflash_loss(
            nnx.merge(graph, p),
            target,
            features,
            tokens,
            loss_mask,
            anchors,
            block_size=K,
            gamma=3.0,
            ce_chunk=7,
            vocab_ids_U=vocab,
        )[0]

    def plain(p):
        from dflash_model.drafter import train_logits

        h = train_logits(nnx.merge(graph, p), target, features, tokens, anchors, K, hidden_only=True)
        logits = jnp.einsum("BNKD,DV->BNKV", h, lm_head_weight_of(target)[:, vocab])
        labels, valid = block_labels(tokens, loss_mask, anchors, K)
        inside = (labels[..., None] == vocab).any(-1)
        sub = jnp.argmax(labels[..., None] == vocab, axis=-1)
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), sub[..., None], -1)[..., 0]
        w = position_weights(K, 3.0) * (valid & inside)
        return jnp.sum(w * nll) / jnp.sum(w)

    (a, ga), (b, gb) = jax.value_and_grad(reduced)(params), jax.value_and_grad(plain)(params)
    labels, valid = block_labels(tokens, loss_mask, anchors, K)
    outside = int(jnp.sum(valid & ~(labels[..., None] == vocab).any(-1)))
    assert outside > 10  # the restriction really drops labels
    np.testing.assert_allclose(a, b, rtol=1e-5)
    for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
        np.testing.assert_allclose(x, y, rtol=2e-4, atol=1e-7)
    full = dflash_loss(drafter, target, features, tokens, loss_mask, anchors, block_size=K, gamma=3.0)[0]
    assert abs(float(full) - float(a)) > 0.1  # negative control: the full-vocabulary loss is another number


def lm_head_weight_of(target):
    from dflash_model.target import lm_head_weight

    return lm_head_weight(target)


def test_target_labels_are_the_targets_argmax(setup):
    """data.labels=target: label t is argmax of the target's logits at t-1 (its greedy next token after the real
    prefix); block labels then read them instead of the text."""
    from train.objective import target_labels

    target, _, tokens, _, _, _ = setup
    logits = forward(target, tokens).logits
    labels = np.asarray(target_labels(tokens, logits))
    assert labels[:, 0].tolist() == np.asarray(tokens[:, 0]).tolist()
    for b in range(2):
        for t in range(1, tokens.shape[1]):
            assert labels[b, t] == int(np.argmax(np.asarray(logits[b, t - 1])))
    assert (labels[:, 1:] != np.asarray(tokens[:, 1:])).mean() > 0.5  # a random target disagrees with the text


@pytest.mark.long
def test_bf16_compute_matches_fp32(setup):
    """Mixed precision (bf16 activations and matmuls over fp32 parameters): the loss within 1% of fp32's and the
    gradients in fp32 with cosine similarity > 0.99 to fp32's."""
    target, drafter, tokens, loss_mask, anchors, features = setup
    params, graph = nnx.state(drafter, nnx.Param), nnx.graphdef(drafter)

    def loss(p, dt):
        return dflash_loss(
            nnx.merge(graph, p), target, features, tokens, loss_mask, anchors, block_size=K, gamma=3.0, compute_dtype=dt
        )[0]

    l32, g32 = jax.value_and_grad(lambda p: loss(p, jnp.float32))(params)
    l16, g16 = jax.value_and_grad(lambda p: loss(p, jnp.bfloat16))(params)
    assert abs(float(l16) / float(l32) - 1) < 0.01
    v32 = jnp.concatenate([x.reshape(-1) for x in jax.tree.leaves(g32)])
    v16 = jnp.concatenate([x.reshape(-1) for x in jax.tree.leaves(g16)])
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(g16))
    cos = float(v16 @ v32 / (jnp.linalg.norm(v16) * jnp.linalg.norm(v32)))
    assert cos > 0.99, cos


def test_greedy_path_mask():
    """Slot k of a target-labelled block counts only while the text's tokens a+1..a+k-1 equal the target's
    greedy labels there; labels equal to the text keep every slot."""
    from train.objective import on_greedy_path

    tokens = jnp.asarray([[5, 6, 7, 8, 9, 10, 11, 12]], jnp.int32)
    labels = tokens.at[0, 3].set(99)  # the target would not have written token 3
    anchors = jnp.asarray([[0, 3, 5]], jnp.int32)
    path = np.asarray(on_greedy_path(tokens, labels, anchors, 4))
    assert path[0, 0].tolist() == [True, True, True, True]  # slots 1,2 precede position 3; slot 3 IS position 3
    assert path[0, 1].tolist() == [True, True, True, True]  # anchor 3: positions 4, 5 agree
    labels2 = tokens.at[0, 2].set(99)
    assert np.asarray(on_greedy_path(tokens, labels2, anchors, 4))[0, 0].tolist() == [True, True, True, False]
    labels3 = tokens.at[0, 1].set(99)
    assert np.asarray(on_greedy_path(tokens, labels3, anchors, 4))[0, 0].tolist() == [True, True, False, False]
    assert np.asarray(on_greedy_path(tokens, tokens, anchors, 4)).all()


def test_dropping_padding_anchor_columns_keeps_loss_and_gradient(setup):
    """The trainer runs only the anchor columns some row fills (train.batches.kept_anchors): padding blocks carry
    no label, so the loss, its gradient and the accuracies are those of the full [B, N] batch."""
    from train.batches import kept_anchors

    target, drafter, tokens, loss_mask, _, features = setup
    anchors = jnp.asarray([[8, 15, -1, -1, -1, -1, -1, -1], [12, 25, 27, -1, -1, -1, -1, -1]], jnp.int32)
    assert kept_anchors(np.asarray(anchors), 4) == 4  # 3 real in the fullest row, rounded up to 8 / 4 = 2
    assert kept_anchors(np.asarray(anchors), 8) == 3 and kept_anchors(np.asarray(anchors), 1) == 8
    assert kept_anchors(np.full((2, 8), -1), 4) == 2  # an empty batch still runs one bucket

    graph, params = nnx.split(drafter)

    @jax.jit
    def loss_and_grad(p, a):
        def loss(p):
            return dflash_loss(nnx.merge(graph, p), target, features, tokens, loss_mask, a, block_size=K, gamma=3.0)

        return jax.value_and_grad(loss, has_aux=True)(p)

    (l_full, m_full), g_full = loss_and_grad(params, anchors)
    (l_kept, m_kept), g_kept = loss_and_grad(params, anchors[:, :3])
    np.testing.assert_allclose(float(l_kept), float(l_full), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(m_kept["acc"]), np.asarray(m_full["acc"]), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g_kept), jax.tree.leaves(g_full)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    assert float(l_full) > 0 and any(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(g_full))
