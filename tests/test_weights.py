"""Strict checkpoint loading: every kind of mismatch is an error naming the tensor, and nothing loads half-way."""

import json
import shutil

import numpy as np
import pytest
from conftest import FIXTURES, tiny_target
from safetensors.numpy import load_file, save_file

from dflash_model.config import ConfigError
from dflash_model.target import forward
from dflash_model.weights import (
    CheckpointError,
    SafetensorsSource,
    load_hf_target,
    load_target,
    save_hf_target,
    undo_gguf_rope_permute,
)


@pytest.fixture
def qwen_dir(tmp_path):
    d = tmp_path / "qwen"
    shutil.copytree(FIXTURES / "tiny_qwen3", d, ignore=shutil.ignore_patterns("reference.npz"))
    return d


def _rewrite(model_dir, edit):
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def _no_reads(monkeypatch):
    """Fail the test if any tensor data is read: a bad checkpoint must be rejected before loading starts."""

    def boom(self, name):
        raise AssertionError(f"tensor {name} was read before the checkpoint was validated")

    monkeypatch.setattr(SafetensorsSource, "get", boom)


def test_missing_tensor(qwen_dir, monkeypatch):
    _rewrite(qwen_dir, lambda t: t.pop("model.layers.2.self_attn.k_norm.weight"))
    _no_reads(monkeypatch)
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.2\.self_attn\.k_norm\.weight'"):
        load_hf_target(qwen_dir)


def test_unexpected_tensor(qwen_dir, monkeypatch):
    _rewrite(qwen_dir, lambda t: t.__setitem__("model.layers.9.mlp.up_proj.weight", np.zeros((2, 2), np.float32)))
    _no_reads(monkeypatch)
    with pytest.raises(
        CheckpointError, match=r"unexpected tensor 'model\.layers\.9\.mlp\.up_proj\.weight' in .*model\.safetensors"
    ):
        load_hf_target(qwen_dir)


def test_wrong_shape(qwen_dir, monkeypatch):
    _rewrite(qwen_dir, lambda t: t.__setitem__("model.layers.0.mlp.down_proj.weight", np.zeros((64, 100), np.float32)))
    _no_reads(monkeypatch)
    with pytest.raises(
        CheckpointError,
        match=r"'model\.layers\.0\.mlp\.down_proj\.weight' .* shape \[64, 100\], config expects \[64, 128\]",
    ):
        load_hf_target(qwen_dir)


def test_wrong_dtype(qwen_dir, monkeypatch):
    def to_f16(t):
        t["model.norm.weight"] = t["model.norm.weight"].astype(np.float16)

    _rewrite(qwen_dir, to_f16)
    _no_reads(monkeypatch)
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' .* dtype float16, config declares float32"):
        load_hf_target(qwen_dir)
    _rewrite(qwen_dir, lambda t: t.__setitem__("model.norm.weight", np.zeros(64, np.int32)))
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' .* dtype I32, not a float type"):
        load_hf_target(qwen_dir)


def test_config_that_does_not_match_the_weights(qwen_dir, monkeypatch):
    cfg = json.loads((qwen_dir / "config.json").read_text())
    cfg["intermediate_size"] = 96
    cfg["num_hidden_layers"] = 5
    (qwen_dir / "config.json").write_text(json.dumps(cfg))
    _no_reads(monkeypatch)
    with pytest.raises(CheckpointError) as e:
        load_hf_target(qwen_dir)
    msg = str(e.value)
    assert "missing tensor 'model.layers.4.input_layernorm.weight'" in msg
    assert "'model.layers.0.mlp.gate_proj.weight'" in msg and "config expects [96, 64]" in msg


def test_bad_config_and_files(qwen_dir, tmp_path):
    cfg = json.loads((qwen_dir / "config.json").read_text())
    (qwen_dir / "config.json").write_text(json.dumps(cfg | {"model_type": "gpt2"}))
    with pytest.raises(ConfigError, match=r"config\.json: model_type='gpt2' is not supported"):
        load_hf_target(qwen_dir)
    del cfg["hidden_size"]
    (qwen_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="missing required key 'hidden_size'"):
        load_hf_target(qwen_dir)
    with pytest.raises(ConfigError, match="not found"):
        load_hf_target(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="expected an HF model directory"):
        load_target(tmp_path / "model.bin")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(CheckpointError, match=r"bad\.gguf: not a readable GGUF file"):
        load_target(bad)


def test_truncated_safetensors(qwen_dir):
    path = qwen_dir / "model.safetensors"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        load_hf_target(qwen_dir)


def test_sharded_index_consistency(tmp_path):
    d = tmp_path / "llama"
    shutil.copytree(FIXTURES / "tiny_llama", d)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    name = next(iter(index["weight_map"]))
    files = sorted(set(index["weight_map"].values()))
    index["weight_map"][name] = next(f for f in files if f != index["weight_map"][name])
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"maps '{name}'"):
        load_hf_target(d)
    (d / files[-1]).unlink()
    with pytest.raises(CheckpointError, match=f"lists {files[-1]}, which does not exist"):
        load_hf_target(d)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_save_load_round_trip(tmp_path, family, dtype):
    model = tiny_target(family, dtype=dtype)
    save_hf_target(model, tmp_path / "m")
    cfg, loaded = load_hf_target(tmp_path / "m")
    assert cfg == model.target_config
    tokens = np.arange(20, dtype=np.int32)[None]
    np.testing.assert_array_equal(forward(loaded, tokens).logits, forward(model, tokens).logits)


def test_gguf_rope_unpermute_inverts_llama_cpp_order():
    """llama.cpp stores each head's rotate-half rows (j, j + H/2) as interleaved pairs (2j, 2j + 1)."""
    heads, head_dim, d_in = 3, 8, 5
    hf = np.arange(heads * head_dim * d_in, dtype=np.float32).reshape(heads * head_dim, d_in)
    per_head = hf.reshape(heads, head_dim, d_in)
    interleaved = np.empty_like(per_head)
    interleaved[:, 0::2] = per_head[:, : head_dim // 2]
    interleaved[:, 1::2] = per_head[:, head_dim // 2 :]
    np.testing.assert_array_equal(undo_gguf_rope_permute(interleaved.reshape(hf.shape), heads), hf)


def test_non_finite_target_weights_are_refused(qwen_dir):
    def poison(t):
        name = next(k for k in t if k.endswith("embed_tokens.weight"))
        w = t[name].copy()
        w[3, :2] = np.inf
        t[name] = w

    _rewrite(qwen_dir, poison)
    with pytest.raises(ValueError, match=r"embed_tokens.weight: 2 non-finite values"):
        load_hf_target(qwen_dir)
