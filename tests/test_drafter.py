"""Drafter: inference equals the multi-block training pass, masks checked through gradients, RoPE positions,
an independent NumPy statement of one layer, presets and their parameter counts, sharding on 8 fake devices."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config, tiny_target
from flax import nnx

import dflash_model.drafter as dm
from dflash_model.config import PRESETS
from dflash_model.drafter import (
    DraftCache,
    abstract_drafter,
    block_tokens,
    build_drafter,
    draft_logits,
    extend_context,
    propose,
    train_hidden_from_embeds,
    train_logits,
)
from dflash_model.drafter_config import DRAFTER_PRESETS, DrafterConfig, check_pairing, default_target_layer_ids
from dflash_model.layers import rope_angles, rope_inv_freq
from dflash_model.sharding import abstract_mesh, make_mesh, memory_report, param_specs, shard_model
from dflash_model.target import build_target, forward, randomize

LAYER_IDS = (0, 2)
train_jit = nnx.jit(train_logits, static_argnames=("block_size", "hidden_only"))
extend_jit = nnx.jit(extend_context)
draft_jit = nnx.jit(draft_logits)
target_features = nnx.jit(
    lambda target, tokens: forward(target, tokens, layer_ids=LAYER_IDS, compute_logits=False).features
)


def tiny_drafter_config(**changes) -> DrafterConfig:
    """Pairs with conftest's tiny Qwen3 target (width 64, vocab 512, 4 layers). rope_theta 1e4 and head_dim 16
    make positions matter at small offsets."""
    cfg = DrafterConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4, vocab_size=512, block_size=6, mask_token_id=511,
        target_layer_ids=LAYER_IDS, num_target_layers=4,
    )  # fmt: skip
    return cfg.replace(**changes)


def tiny_drafter(seed: int = 1, **changes):
    return randomize(build_drafter(tiny_drafter_config(**changes)), seed=seed)


@pytest.fixture(scope="module")
def setup():
    """(target, drafter, tokens [2, 24], features [2, 24, 128]) with real target features."""
    target = tiny_target("qwen3")
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 500, (2, 24)), jnp.int32)
    return target, tiny_drafter(), tokens, target_features(target, tokens)


def _rows_from(features, starts, width, garbage_from):
    """features[b, starts[b] : starts[b] + width], with positions >= garbage_from[b] replaced by large noise:
    padding that must never be read."""
    feats = np.asarray(features)
    b, t, f = feats.shape
    out = 50.0 * np.random.default_rng(7).standard_normal((b, width, f)).astype(np.float32)
    for row in range(b):
        for i in range(width):
            pos = starts[row] + i
            if pos < min(t, garbage_from[row]):
                out[row, i] = feats[row, pos]
    return jnp.asarray(out)


def test_inference_equals_training_pass(setup):
    """For every block of the training layout, context = features of positions < a fed to the cache in two
    padded chunks, then draft_logits of the block at a: equal to the one-pass training logits (1e-5). Blocks
    are 9 long though the drafter says 6 (K is free); propose = argmax at slots 1..K-1, traced once."""
    target, drafter, tokens, features = setup
    cfg = drafter.config
    anchors = np.array([[5, 12, 0, -1], [3, 9, 17, 23]])
    k = 9
    train = train_jit(drafter, target, features, tokens, jnp.asarray(anchors), k)
    assert train.shape == (2, 4, k, 512) and train.dtype == jnp.float32
    traces = []

    def counted_propose(*args, **kwargs):
        traces.append(1)
        return propose(*args, **kwargs)

    propose_once = nnx.jit(counted_propose, static_argnames=("block_size",))
    for n in range(anchors.shape[1]):
        a = np.maximum(anchors[:, n], 0)
        first = np.minimum(a, 4)
        cache = DraftCache.init(cfg, 2, 40)
        cache = extend_jit(drafter, cache, _rows_from(features, [0, 0], 24, first), jnp.asarray(first))
        cache = extend_jit(drafter, cache, _rows_from(features, first, 24, a), jnp.asarray(a - first))
        assert cache.lengths.tolist() == a.tolist()
        blocks = block_tokens(cfg, tokens, jnp.asarray(anchors[:, n : n + 1]), k)[:, 0]
        logits = draft_jit(drafter, target, cache, blocks)
        np.testing.assert_allclose(logits, train[:, n], atol=1e-5, rtol=0)
        got = propose_once(drafter, target, cache, blocks[:, 0], block_size=k)
        assert got.shape == (2, k - 1) and got.dtype == jnp.int32
        np.testing.assert_array_equal(got, jnp.argmax(logits[:, 1:], axis=-1))
    assert len(traces) == 1


def test_extend_context_never_corrupts_valid_entries(setup):
    """Padding written past the capacity is dropped, not clamped back onto earlier, valid entries."""
    _, drafter, _, features = setup
    first = extend_jit(drafter, DraftCache.init(drafter.config, 2, 40), features, jnp.asarray([24, 20]))
    cache = extend_jit(drafter, first, features, jnp.asarray([6, 3]))  # writes 24..47 and 20..43 into 40 slots
    np.testing.assert_array_equal(cache.k[:, 0, :24], first.k[:, 0, :24])
    np.testing.assert_array_equal(cache.k[:, 1, :20], first.k[:, 1, :20])
    assert cache.lengths.tolist() == [30, 23]
    assert cache.crop(21).lengths.tolist() == [21, 21] and cache.crop(40).lengths.tolist() == [30, 23]


@nnx.jit
def _feature_grads(drafter, target, features, tokens, anchors, weights):
    """d(sum of block n's weighted hidden states)/d(features) for every block n: [N, B, T, F]."""

    def per_block(f):
        hidden = train_logits(drafter, target, f, tokens, anchors, 6, hidden_only=True)
        return jnp.einsum("BNKD,BKD->N", hidden, weights)

    return jax.jacrev(per_block)(features)


def test_block_sees_context_strictly_before_its_anchor(setup):
    """d(block n output)/d(features[t]) is exactly 0 for t >= a_n and nonzero for every t < a_n."""
    target, drafter, tokens, features = setup
    anchors = jnp.asarray([[5, 12, -1], [3, 9, 17]])
    weights = jnp.asarray(np.random.default_rng(1).standard_normal((2, 6, 64)), jnp.float32)
    grad = np.abs(np.asarray(_feature_grads(drafter, target, features, tokens, anchors, weights))).sum(-1)
    for n in range(3):
        for row in range(2):
            a = max(int(anchors[row, n]), 0)
            assert np.all(grad[n, row, a:] == 0.0), (row, n)
            assert np.all(grad[n, row, :a] > 0.0), (row, n)


SLOTS = ((0, 0), (1, 2), (2, 5))  # (block, slot) pairs whose input dependence is checked


@nnx.jit
def _embed_grads(drafter, features, embeds, anchors, w):
    """d(hidden[:, n, k] . w)/d(block embeddings) for each (n, k) in SLOTS: [3, B, N, K, D]."""

    def outs(e):
        hidden = train_hidden_from_embeds(drafter, features, e, anchors)
        return jnp.stack([jnp.sum(hidden[:, n, k] * w) for n, k in SLOTS])

    return jax.jacrev(outs)(embeds)


def test_blocks_are_isolated_and_bidirectional(setup):
    """d(block n, slot k)/d(embeddings): exactly 0 for every other block; nonzero for every slot of its own
    block, before and after k (no causal mask inside a block)."""
    _, drafter, _, features = setup
    anchors = jnp.asarray([[5, 12, -1], [3, 9, 17]])
    embeds = jnp.asarray(np.random.default_rng(2).standard_normal((2, 3, 6, 64)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(3).standard_normal(64), jnp.float32)
    grads = np.abs(np.asarray(_embed_grads(drafter, features, embeds, anchors, w))).sum(-1)  # [3, B, N, K]
    for i, (n, _) in enumerate(SLOTS):
        others = [m for m in range(3) if m != n]
        assert np.all(grads[i][:, others] == 0.0), n
        assert np.all(grads[i][:, n] > 0.0), n


@nnx.jit
def _sliding_grads(drafter, feats, embeds, anchors, w):
    def outs(f, e):
        return jnp.einsum("KD,D->K", train_hidden_from_embeds(drafter, f, e, anchors)[0, 0], w)

    return jax.jacrev(outs, argnums=(0, 1))(feats, embeds)


def test_sliding_layer_is_causal_in_block_and_windowed():
    """One sliding layer, window 4: slot k sees block slots j <= k with k - j < 4 and context t < a with
    (a + k) - t < 4."""
    drafter = tiny_drafter(num_hidden_layers=1, layer_types=("sliding_attention",), sliding_window=4)
    feats = jnp.asarray(np.random.default_rng(4).standard_normal((1, 16, 128)), jnp.float32)
    embeds = jnp.asarray(np.random.default_rng(5).standard_normal((1, 1, 6, 64)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(6).standard_normal(64), jnp.float32)
    g_feat, g_emb = _sliding_grads(drafter, feats, embeds, jnp.asarray([[10]]), w)
    g_feat = np.abs(np.asarray(g_feat[:, 0])).sum(-1)  # [K, T]
    g_emb = np.abs(np.asarray(g_emb[:, 0, 0])).sum(-1)  # [K, J]
    for k in range(6):
        assert np.nonzero(g_feat[k])[0].tolist() == [t for t in range(10) if (10 + k) - t < 4], k
        assert np.nonzero(g_emb[k])[0].tolist() == [j for j in range(k + 1) if k - j < 4], k


def test_sliding_inference_equals_training(setup):
    """A mixed sliding (window 5) / full drafter: cached drafting equals the training pass."""
    target, _, tokens, features = setup
    drafter = tiny_drafter(layer_types=("sliding_attention", "full_attention"), sliding_window=5)
    anchors = jnp.asarray([[11, 4], [20, 7]])
    train = train_jit(drafter, target, features, tokens, anchors, 6)
    for n in range(2):
        cache = extend_jit(drafter, DraftCache.init(drafter.config, 2, 40), features, anchors[:, n])
        blocks = block_tokens(drafter.config, tokens, anchors[:, n : n + 1], 6)[:, 0]
        np.testing.assert_allclose(draft_jit(drafter, target, cache, blocks), train[:, n], atol=1e-5, rtol=0)


def test_positions_enter_only_through_relative_rope(setup):
    """Shifting context and blocks by the same offset leaves outputs unchanged (q.k depends on offsets only);
    shifting only the blocks changes them."""
    _, drafter, _, features = setup
    anchors = jnp.asarray([[5, 12], [3, 9]])
    embeds = jnp.asarray(np.random.default_rng(9).standard_normal((2, 2, 6, 64)), jnp.float32)
    hidden = nnx.jit(train_hidden_from_embeds)
    base = hidden(drafter, features, embeds, anchors, jnp.asarray([0, 0]))
    shifted = hidden(drafter, features, embeds, anchors, jnp.asarray([37, 101]))
    np.testing.assert_allclose(shifted, base, atol=2e-5, rtol=0)
    same, moved = (
        _block_shift(drafter, features, embeds, anchors, 0),
        _block_shift(drafter, features, embeds, anchors, 3),
    )
    np.testing.assert_allclose(same, base, atol=1e-6, rtol=0)
    assert float(jnp.abs(moved - base).max()) > 1e-2


@nnx.jit
def _block_shift(drafter, features, embeds, anchors, shift):
    """The training pass with only the blocks' RoPE positions moved by `shift` (context positions kept)."""
    cfg = drafter.config
    t = features.shape[1]
    ctx = dm._context(drafter, features)
    cos, sin = rope_angles(jnp.arange(t)[None], rope_inv_freq(cfg.head_dim, cfg.rope_theta))
    ctx_kv = [dm._keys_values(layer.self_attn, ctx, cos, sin, cfg.rms_norm_eps) for layer in drafter.layers]
    idx = anchors[..., None] + jnp.arange(embeds.shape[2])
    visible = jnp.arange(t)[None, None, None, :] < anchors[:, :, None, None]
    return dm._run_blocks(drafter, embeds, idx, idx + shift, ctx_kv, jnp.arange(t), visible)


def _np_rms(x, w, eps):
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _np_rope(x, pos, theta):
    """Rotate-half RoPE on [T, heads, H] at integer positions [T], in float64."""
    h = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, h, 2) / h)
    ang = pos[:, None, None] * inv
    x1, x2 = x[..., : h // 2], x[..., h // 2 :]
    return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], axis=-1)


def test_one_layer_matches_numpy_restatement(setup, tmp_path):
    """A one-layer drafter, written from its exported z-lab tensors ([out, in] torch layout) in float64 NumPy:
    the softmax runs over the visible keys only (context < a, then the block), not over a mask."""
    from safetensors.numpy import load_file

    from dflash_model.drafter_weights import export_drafter

    target, _, tokens, features = setup
    drafter = tiny_drafter(seed=11, num_hidden_layers=1)
    cfg = drafter.config
    export_drafter(drafter, cfg, tmp_path, dtype="float32")
    w = {name: value.astype(np.float64) for name, value in load_file(str(tmp_path / "model.safetensors")).items()}
    table = np.asarray(target.embedder.input_embedding[...], np.float64)
    eps, theta = cfg.rms_norm_eps, cfg.rope_theta
    nq, ng, hd, k = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.block_size
    anchors = np.array([[7, 15], [2, 20]])
    got = train_jit(drafter, target, features, tokens, jnp.asarray(anchors), k, hidden_only=True)

    for row in range(2):
        feats = np.asarray(features[row], np.float64)
        ctx = _np_rms(feats @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
        for n, a in enumerate(anchors[row]):
            block = [int(tokens[row, a])] + [cfg.mask_token_id] * (k - 1)
            x = table[block]
            h = _np_rms(x, w["layers.0.input_layernorm.weight"], eps)
            pos = a + np.arange(k)
            q = _np_rope(_np_rms((h @ w["layers.0.self_attn.q_proj.weight"].T).reshape(k, nq, hd),
                                 w["layers.0.self_attn.q_norm.weight"], eps), pos, theta)  # fmt: skip
            kn = w["layers.0.self_attn.k_norm.weight"]
            k_ctx = _np_rope(_np_rms((ctx[:a] @ w["layers.0.self_attn.k_proj.weight"].T).reshape(a, ng, hd), kn, eps),
                             np.arange(a), theta)  # fmt: skip
            k_blk = _np_rope(_np_rms((h @ w["layers.0.self_attn.k_proj.weight"].T).reshape(k, ng, hd), kn, eps),
                             pos, theta)  # fmt: skip
            v_ctx = (ctx[:a] @ w["layers.0.self_attn.v_proj.weight"].T).reshape(a, ng, hd)
            v_blk = (h @ w["layers.0.self_attn.v_proj.weight"].T).reshape(k, ng, hd)
            keys, values = np.concatenate([k_ctx, k_blk]), np.concatenate([v_ctx, v_blk])
            out = np.zeros((k, nq, hd))
            for head in range(nq):
                g = head // (nq // ng)
                scores = q[:, head] @ keys[:, g].T / math.sqrt(hd)
                p = np.exp(scores - scores.max(-1, keepdims=True))
                out[:, head] = (p / p.sum(-1, keepdims=True)) @ values[:, g]
            x = x + out.reshape(k, nq * hd) @ w["layers.0.self_attn.o_proj.weight"].T
            h = _np_rms(x, w["layers.0.post_attention_layernorm.weight"], eps)
            gate = h @ w["layers.0.mlp.gate_proj.weight"].T
            x = (
                x
                + (gate / (1 + np.exp(-gate)) * (h @ w["layers.0.mlp.up_proj.weight"].T))
                @ w["layers.0.mlp.down_proj.weight"].T
            )
            want = _np_rms(x, w["norm.weight"], eps)
            np.testing.assert_allclose(got[row, n], want, atol=1e-5, rtol=0)


def test_default_target_layer_ids():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(32, 5) == [1, 8, 15, 22, 29]
    # (30-4)/4 = 6.5: Python's round-half-to-even gives 8 and 20 at the ties 7.5 and 20.5.
    assert default_target_layer_ids(30, 5) == [1, 8, 14, 20, 27]
    assert default_target_layer_ids(36, 3) == [1, 17, 33]
    assert default_target_layer_ids(28, 1) == [14]
    with pytest.raises(ValueError, match="explicitly"):
        default_target_layer_ids(4, 3)


def _drafter_formula(d, n_heads, n_kv, head_dim, inter, layers, n_feat):
    """Parameter count of a DFlash drafter, spelled out tensor by tensor."""
    per_layer = (
        d  # input_layernorm
        + d  # post_attention_layernorm
        + n_heads * head_dim * d  # q_proj
        + 2 * n_kv * head_dim * d  # k_proj, v_proj
        + d * n_heads * head_dim  # o_proj
        + 2 * head_dim  # q_norm, k_norm
        + 3 * inter * d  # gate, up, down
    )
    return d * n_feat * d + d + d + layers * per_layer  # fc, hidden_norm, norm


def test_presets_parameter_counts_and_sharding():
    mesh = abstract_mesh(data=1, fsdp=4, tensor=2)
    counts = {}
    for name, (cfg, target_name) in DRAFTER_PRESETS.items():
        check_pairing(cfg, PRESETS[target_name], source=name)
        abstract = abstract_drafter(cfg)
        report = memory_report(abstract, mesh)
        counts[name] = report["params"]
        assert report["params"] == cfg.num_params(), name
        assert report["bytes_per_device"] < report["bytes"] / 4, name
        print(f"{name}: {report['params']:,} params, {report['bytes'] / 1e9:.3f} GB {cfg.dtype}")
    assert counts["qwen3-8b-dflash-b16"] == _drafter_formula(4096, 32, 8, 128, 12288, 5, 5) == 1_048_626_432
    assert counts["qwen3-4b-dflash-b16"] == _drafter_formula(2560, 32, 8, 128, 9728, 5, 5) == 537_427_200
    # bf16 Qwen3-4B-b16: 1.07 GB, the size of the published model.safetensors.
    assert DRAFTER_PRESETS["qwen3-4b-dflash-b16"][0].dtype == "bfloat16"
    assert counts["llama3.1-8b-dflash-ultrachat"] == _drafter_formula(4096, 32, 8, 128, 14336, 5, 5)
    assert counts["smollm2-135m-dflash"] == _drafter_formula(576, 9, 3, 64, 1536, 5, 5) == 19_361_152
    specs = param_specs(abstract_drafter(DRAFTER_PRESETS["qwen3-8b-dflash-b16"][0]), mesh)
    assert specs[("layers", 0, "self_attn", "q_proj")] == jax.sharding.PartitionSpec("fsdp", "tensor", None)
    assert specs[("fc",)] == jax.sharding.PartitionSpec("tensor", "fsdp")


def test_published_and_default_presets():
    q8 = DRAFTER_PRESETS["qwen3-8b-dflash-b16"][0]
    assert (q8.hidden_size, q8.intermediate_size, q8.num_hidden_layers, q8.block_size) == (4096, 12288, 5, 16)
    assert (q8.num_attention_heads, q8.num_key_value_heads, q8.head_dim) == (32, 8, 128)
    assert (q8.rms_norm_eps, q8.rope_theta, q8.mask_token_id) == (1e-6, 1e6, 151669)
    assert q8.target_layer_ids == (1, 9, 17, 25, 33)
    llama = DRAFTER_PRESETS["llama3.1-8b-dflash-ultrachat"][0]
    assert (llama.block_size, llama.vocab_size, llama.target_layer_ids) == (10, 128256, (1, 8, 15, 22, 29))
    smol = DRAFTER_PRESETS["smollm2-135m-dflash"][0]
    assert smol.target_layer_ids == (1, 8, 14, 20, 27)
    assert (smol.hidden_size, smol.num_attention_heads, smol.num_key_value_heads, smol.head_dim) == (576, 9, 3, 64)
    assert (smol.intermediate_size, smol.rope_theta, smol.rms_norm_eps) == (1536, 1e5, 1e-5)
    assert (smol.mask_token_id, smol.vocab_size, smol.num_target_layers) == (4, 49152, 30)


def test_sharded_training_pass_on_8_devices(setup):
    """The drafter sharded over (data 2, fsdp 2, tensor 2) fake CPU devices gives the unsharded logits."""
    target, drafter, tokens, features = setup
    anchors = jnp.asarray([[5, 12], [3, 9]])
    want = train_jit(drafter, target, features, tokens, anchors, 6, hidden_only=True)
    sharded = shard_model(tiny_drafter(), make_mesh(data=2, fsdp=2, tensor=2))
    got = train_jit(sharded, target, features, tokens, anchors, 6, hidden_only=True)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_feature_width_and_target_pairing_are_checked(setup):
    target, drafter, tokens, features = setup
    with pytest.raises(ValueError, match="width 64"):
        train_logits(drafter, target, features[..., :64], tokens, jnp.asarray([[3], [3]]), 6)
    narrow = nnx.eval_shape(lambda: build_target(tiny_config("qwen3", hidden_size=32, intermediate_size=64)))
    with pytest.raises(ValueError, match="hidden_size=64 != target hidden_size=32"):
        train_logits(drafter, narrow, features, tokens, jnp.asarray([[3], [3]]), 6)


@pytest.mark.slow
def test_smollm2_mask_token_is_a_special_token_text_never_produces():
    """Mask id 4 of the SmolLM2 drafter is '<reponame>', an added special token outside the chat template,
    and tokenizing source code and chat-rendered prompts never produces it."""
    import sysconfig
    from pathlib import Path

    from data import assets
    from dflash_model.tokenizer import load_tokenizer

    tok = load_tokenizer(assets.smollm2_gguf())
    mask = DRAFTER_PRESETS["smollm2-135m-dflash"][0].mask_token_id
    assert tok.convert_ids_to_tokens(mask) == "<reponame>"
    assert tok.get_added_vocab()["<reponame>"] == mask
    assert "<reponame>" not in tok.chat_template
    texts = [p.read_text(errors="replace") for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:25]]
    texts += [tok.apply_chat_template([{"role": "user", "content": q["turns"][0]}], tokenize=False,
                                      add_generation_prompt=True) for q in assets.mtbench()]  # fmt: skip
    texts += [f"{r['question']}\n{r['answer']}" for r in assets.gsm8k()[:300]]
    ids = [i for text in texts for i in tok(text, add_special_tokens=False)["input_ids"]]
    assert len(ids) > 200_000 and mask not in ids


@pytest.mark.long
def test_blocks_in_chunks_equal_one_pass_with_gradients(setup, monkeypatch):
    """Above layers.MAX_SCORES the training pass attends block chunk by block chunk: the same hidden states and
    the same gradients with respect to the drafter's weights and the features as the one-pass layout."""
    from dflash_model import layers

    target, drafter, tokens, features = setup
    anchors = jnp.asarray([[5, 12, 0, -1, 7], [3, 9, 17, 23, 2]])
    graph, params = nnx.split(drafter)
    w = jnp.asarray(np.random.default_rng(4).standard_normal((2, 6, 64)), jnp.float32)

    def loss(params, f):
        hidden = train_logits(nnx.merge(graph, params), target, f, tokens, anchors, 6, hidden_only=True)
        return jnp.einsum("BNKD,BKD->", hidden, w), hidden

    def run():
        (_, hidden), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, features)
        return hidden, grads

    dense_hidden, dense_grads = run()
    # 2 rows x 4 heads x 6 slots x (24 context + 6 block keys) = 1,440 scores a block: 2 blocks a chunk
    monkeypatch.setattr(layers, "MAX_SCORES", 2 * 1440)
    hidden, grads = run()
    np.testing.assert_allclose(hidden, dense_hidden, rtol=1e-5, atol=1e-5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(dense_grads)):  # fp32 sums in another order
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-6 * float(np.abs(want).max()))
