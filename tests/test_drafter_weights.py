"""z-lab drafter checkpoints: bit-exact export/load round trips, the 58-tensor schema, every mismatch named,
pairing with the target checked, published configs parsed into the presets."""

import json
import re
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import param_arrays, rewrite_export
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import load_file

from dflash_model.config import ConfigError, TargetConfig
from dflash_model.drafter import build_drafter
from dflash_model.drafter_config import DrafterConfig, drafter_preset
from dflash_model.drafter_weights import (
    export_drafter,
    load_draft_vocab,
    load_drafter,
    parse_zlab_config,
    zlab_config,
    zlab_tensor_specs,
)
from dflash_model.target import randomize
from dflash_model.weights import CheckpointError, SafetensorsSource
from dflash_model.zlab_schema import check_zlab_schema

CFG = DrafterConfig(
    hidden_size=32, intermediate_size=48, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
    head_dim=8, rms_norm_eps=1e-6, rope_theta=1e6, vocab_size=128, block_size=4, mask_token_id=127,
    target_layer_ids=(0, 1, 3), num_target_layers=4,
)  # fmt: skip
TARGET = TargetConfig(
    family="qwen3", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=1e6, rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)  # fmt: skip


def _drafter(cfg=CFG, seed=0):
    return randomize(build_drafter(cfg), seed=seed, std=0.1)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(drafter, directory) of a 5-layer fp32 export."""
    drafter = _drafter()
    out = export_drafter(drafter, CFG, tmp_path_factory.mktemp("fp32"), dtype="float32")
    return drafter, out


def test_fp32_round_trip_is_bit_exact_and_in_zlab_format(exported):
    drafter, out = exported
    assert check_zlab_schema(out) == []
    tensors = load_file(str(out / "model.safetensors"))
    layer = ["input_layernorm", "post_attention_layernorm"] + [
        f"{part}.weight" for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                      "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj",
                                      "mlp.down_proj")
    ]  # fmt: skip
    layer = [name if name.endswith(".weight") else f"{name}.weight" for name in layer]
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{i}.{name}" for i in range(5) for name in layer
    }
    assert len(tensors) == 58 and set(tensors) == expected
    assert tensors["fc.weight"].shape == (32, 3 * 32)  # torch Linear [out, in]
    assert tensors["layers.0.self_attn.q_proj.weight"].shape == (4 * 8, 32)
    assert tensors["layers.0.self_attn.k_proj.weight"].shape == (2 * 8, 32)
    assert tensors["layers.0.self_attn.o_proj.weight"].shape == (32, 4 * 8)
    assert tensors["layers.0.self_attn.q_norm.weight"].shape == (8,)
    assert tensors["layers.0.mlp.down_proj.weight"].shape == (32, 48)
    assert all(t.dtype == np.float32 for t in tensors.values())
    with safe_open(str(out / "model.safetensors"), "np") as f:
        assert f.metadata() == {"format": "pt"}
    # torch layout: fc.weight row o is output unit o, so fc.weight.T is the module's [F, D] kernel.
    np.testing.assert_array_equal(tensors["fc.weight"].T, np.asarray(drafter.fc[...]))

    cfg, loaded = load_drafter(out, TARGET)
    assert cfg == CFG
    want, got = param_arrays(drafter), param_arrays(loaded)
    assert want.keys() == got.keys()
    for path in want:
        np.testing.assert_array_equal(got[path], want[path], err_msg=str(path))


def test_config_json_has_exactly_the_zlab_keys(exported):
    _, out = exported
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["model_type"] == "qwen3"
    assert raw["dflash_config"] == {"mask_token_id": 127, "target_layer_ids": [0, 1, 3]}
    assert (raw["block_size"], raw["num_target_layers"], raw["torch_dtype"]) == (4, 4, "float32")
    assert raw["layer_types"] == ["full_attention"] * 5 and raw["sliding_window"] is None
    assert set(raw) == {
        "architectures", "model_type", "block_size", "dflash_config", "num_target_layers", "hidden_size",
        "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
        "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings", "layer_types", "sliding_window",
        "use_sliding_window", "vocab_size", "hidden_act", "attention_bias", "torch_dtype", "auto_map",
    }  # fmt: skip


def test_automodel_route_points_at_zlab_modeling_code(exported):
    """`AutoModel.from_pretrained(dir, trust_remote_code=True)` (z-lab's documented route) must build z-lab's
    DFlashDraftModel: transformers reads auto_map.AutoModel, and a "<repo>--<module>.<Class>" reference makes it
    fetch that module from the z-lab model repository. Checked through transformers' own parsing, no network."""
    from transformers import AutoConfig
    from transformers.dynamic_module_utils import get_class_in_module  # noqa: F401  (the loader that reads it)

    _, out = exported
    cfg = AutoConfig.from_pretrained(out)
    assert cfg.model_type == "qwen3" and cfg.architectures == ["DFlashDraftModel"]
    ref = cfg.auto_map["AutoModel"]
    repo, module_class = ref.split("--")
    module, cls = module_class.rsplit(".", 1)
    assert repo.startswith("z-lab/") and module == "dflash" and cls == "DFlashDraftModel"
    assert cfg.dflash_config == {"mask_token_id": 127, "target_layer_ids": [0, 1, 3]} and cfg.block_size == 4


def test_bf16_round_trip_is_bit_exact(tmp_path):
    cfg = CFG.replace(dtype="bfloat16")
    drafter = _drafter(cfg, seed=1)
    out = export_drafter(drafter, cfg, tmp_path)
    assert check_zlab_schema(out) == []
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    source = SafetensorsSource(out)
    assert {source.shape_dtype(name)[1] for name in source.keys()} == {"BF16"}
    loaded_cfg, loaded = load_drafter(out, TARGET)
    assert loaded_cfg.dtype == "bfloat16"
    want, got = param_arrays(drafter), param_arrays(loaded)
    for path in want:
        assert got[path].dtype == jnp.bfloat16
        np.testing.assert_array_equal(got[path].view(np.uint16), want[path].view(np.uint16), err_msg=str(path))


def test_fp32_drafter_exported_as_bf16_loads_as_rounded_values(exported, tmp_path):
    drafter, _ = exported
    out = export_drafter(drafter, CFG, tmp_path, dtype="bfloat16")
    _, loaded = load_drafter(out, dtype="float32")
    want, got = param_arrays(drafter), param_arrays(loaded)
    for path in want:
        rounded = want[path].astype(ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(got[path], rounded, err_msg=str(path))


def test_draft_vocabulary_travels_beside_the_zlab_files(tmp_path):
    """export(draft_vocab=ids) writes draft_vocab.json, which loads back as the same ids in order and leaves the
    z-lab schema untouched; an export without one removes a stale file; a broken file is refused by name."""
    from dflash_model.drafter_weights import DRAFT_VOCAB_FILE

    drafter = _drafter(seed=2)
    ids = np.asarray([5, 3, 120, 0, 64], np.int32)
    out = export_drafter(drafter, CFG, tmp_path / "v", dtype="float32", draft_vocab=ids)
    assert load_draft_vocab(out, CFG.vocab_size) == (5, 3, 120, 0, 64)
    assert check_zlab_schema(out) == []
    again = export_drafter(drafter, CFG, out, dtype="float32")
    assert not (again / DRAFT_VOCAB_FILE).exists() and load_draft_vocab(again, CFG.vocab_size) is None
    for bad, why in (
        ({"token_ids": [1, 128]}, "token id 128 is outside the vocabulary 0..127"),
        ({"token_ids": [1, 2, 1]}, "repeats a token"),
        ({"token_ids": []}, "non-empty list of integers"),
        ({"ids": [1]}, "'token_ids' list"),
    ):
        (out / DRAFT_VOCAB_FILE).write_text(json.dumps(bad))
        with pytest.raises(ConfigError, match=re.escape(why)) as e:
            load_draft_vocab(out, CFG.vocab_size)
        assert DRAFT_VOCAB_FILE in str(e.value)
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        export_drafter(drafter, CFG, tmp_path / "w", draft_vocab=[0, 500])
    assert not (tmp_path / "w" / "model.safetensors").exists()  # refused before anything is written


def _drop(name):
    return lambda t: t.pop(name)


def _set(name, value):
    return lambda t: t.__setitem__(name, value)


TENSOR_CASES = {
    "missing": (_drop("layers.2.self_attn.k_norm.weight"), "missing tensor 'layers.2.self_attn.k_norm.weight'"),
    "unexpected": (_set("lm_head.weight", np.zeros((128, 32), np.float32)), "unexpected tensor 'lm_head.weight'"),
    "shape": (lambda t: t.__setitem__("fc.weight", t["fc.weight"].T.copy()), r"'fc.weight'.*shape \[96, 32\]"),
    "dtype": (
        lambda t: t.__setitem__("norm.weight", t["norm.weight"].astype(np.float16)),
        "'norm.weight'.*dtype float16, config declares float32",
    ),
    "not float": (_set("hidden_norm.weight", np.ones(32, np.int32)), "'hidden_norm.weight'.*not a float type"),
}


@pytest.mark.parametrize("case", sorted(TENSOR_CASES))
def test_tensor_mismatch_is_named_and_nothing_is_read(exported, tmp_path, monkeypatch, case):
    edit, message = TENSOR_CASES[case]
    bad = rewrite_export(exported[1], tmp_path / "bad", tensors=edit)
    reads = []
    original_get = SafetensorsSource.get
    monkeypatch.setattr(SafetensorsSource, "get", lambda self, name: reads.append(name) or original_get(self, name))
    with pytest.raises(CheckpointError, match=message):
        load_drafter(bad, TARGET)
    assert reads == []  # checked before any tensor was read: never a half-loaded drafter
    problems = check_zlab_schema(bad)
    assert len(problems) == 1 and re.search(message, problems[0])


CONFIG_CASES = {
    "hidden_size": (lambda c: c.pop("hidden_size"), "missing required key 'hidden_size'"),
    "mask id": (lambda c: c["dflash_config"].pop("mask_token_id"), "'dflash_config.mask_token_id'"),
    "block_size": (lambda c: c.pop("block_size"), "'block_size'"),
    "architectures": (lambda c: c.__setitem__("architectures", ["Qwen3ForCausalLM"]), "architectures"),
    "model_type": (lambda c: c.__setitem__("model_type", "llama"), "model_type"),
    "dflash2": (lambda c: c["dflash_config"].__setitem__("selector_rank", 256), r"\['selector_rank'\]"),
    "bias": (lambda c: c.__setitem__("attention_bias", True), "attention_bias"),
    "layer ids": (lambda c: c["dflash_config"].__setitem__("target_layer_ids", [0, 4]), r"target_layer_ids \[4\]"),
    "dtype": (lambda c: c.__setitem__("torch_dtype", "int8"), "torch_dtype='int8'"),
    "causal": (lambda c: c.__setitem__("is_causal", True), "is_causal=True"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_config_problem_is_named(exported, tmp_path, case):
    edit, message = CONFIG_CASES[case]
    bad = rewrite_export(exported[1], tmp_path / "bad", config=edit)
    with pytest.raises(ConfigError, match=message):
        load_drafter(bad)
    assert check_zlab_schema(bad)


def test_fewer_layers_in_config_than_in_tensors(exported, tmp_path):
    fewer = lambda c: c.update(num_hidden_layers=4, layer_types=None)  # noqa: E731
    bad = rewrite_export(exported[1], tmp_path / "bad", config=fewer)
    with pytest.raises(CheckpointError, match=r"(?s)11 problems.*unexpected tensor 'layers\.4\."):
        load_drafter(bad)


PAIRING_CASES = {
    "hidden": (TARGET.replace(hidden_size=48), "hidden_size=32 != target hidden_size=48"),
    "vocab": (TARGET.replace(vocab_size=256), "vocab_size=128 != target vocab_size=256"),
    "mask": (TARGET.replace(vocab_size=100), "mask_token_id=127 is not a row of the target's 100-row embedding"),
    "depth": (TARGET.replace(num_hidden_layers=3), "num_target_layers=4 != target num_hidden_layers=3"),
    "ids": (TARGET.replace(num_hidden_layers=3), r"target_layer_ids \[3\] outside the target's 0..2"),
}


@pytest.mark.parametrize("case", sorted(PAIRING_CASES))
def test_pairing_with_the_target_is_checked(exported, case):
    target_cfg, message = PAIRING_CASES[case]
    with pytest.raises(ConfigError, match=message):
        load_drafter(exported[1], target_cfg)


def test_missing_files_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="config.json: not found"):
        load_drafter(tmp_path)
    assert "not found" in check_zlab_schema(tmp_path)[0]
    (tmp_path / "config.json").write_text(json.dumps(zlab_config(CFG)))
    with pytest.raises(CheckpointError, match="no \\*.safetensors files"):
        load_drafter(tmp_path)


# The published z-lab config.json files (transformers-5 writes "dtype" where older files have "torch_dtype").
QWEN3_4B_B16 = {
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 16,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 5, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "num_target_layers": 36, "max_position_embeddings": 40960,
    "rope_theta": 1000000, "rms_norm_eps": 1e-06, "tie_word_embeddings": True, "vocab_size": 151936,
    "dtype": "bfloat16",
}  # fmt: skip


def test_published_configs_parse_into_the_presets():
    assert parse_zlab_config(QWEN3_4B_B16) == drafter_preset("qwen3-4b-dflash-b16")
    qwen3_8b = QWEN3_4B_B16 | {"hidden_size": 4096, "intermediate_size": 12288, "torch_dtype": "bfloat16"}
    assert parse_zlab_config(qwen3_8b) == drafter_preset("qwen3-8b-dflash-b16")
    for name in ("qwen3-8b-dflash-b16", "llama3.1-8b-dflash-ultrachat", "smollm2-135m-dflash"):
        cfg = drafter_preset(name)
        assert parse_zlab_config(json.loads(json.dumps(zlab_config(cfg)))) == cfg, name


def test_newer_config_layout_with_sliding_layers():
    """transformers-5 layout (rope_parameters, block_size inside dflash_config) with sliding layers, as the
    Qwen3.5 drafts ship; sliding_window only counts with use_sliding_window, as in HF's Qwen3Config."""
    raw = QWEN3_4B_B16 | {
        "rope_parameters": {"rope_theta": 10000000, "rope_type": "default"},
        "dflash_config": {"block_size": 16, "mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
        "layer_types": ["sliding_attention"] * 4 + ["full_attention"],
        "sliding_window": 4096,
        "use_sliding_window": True,
    }
    del raw["block_size"]
    raw.pop("rope_theta")
    cfg = parse_zlab_config(raw)
    assert (cfg.rope_theta, cfg.block_size, cfg.sliding_window) == (1e7, 16, 4096)
    assert cfg.layer_types == ("sliding_attention",) * 4 + ("full_attention",)
    assert parse_zlab_config(raw | {"use_sliding_window": False}).sliding_window is None
    round_trip = zlab_config(cfg)
    assert round_trip["use_sliding_window"] is True and parse_zlab_config(round_trip) == cfg
    with pytest.raises(ConfigError, match="block_size=8 but dflash_config.block_size=16"):
        parse_zlab_config(raw | {"block_size": 8})


def test_schema_flags_what_serving_engines_refuse(exported, tmp_path):
    mixed = rewrite_export(
        exported[1],
        tmp_path / "mixed",
        config=lambda c: c.update(layer_types=["sliding_attention"] + ["full_attention"] * 4, sliding_window=64),
    )
    problems = check_zlab_schema(mixed)
    assert any("mixes sliding and full" in p for p in problems)
    assert any("use_sliding_window" in p for p in problems)


def test_tensor_specs_cover_the_module_exactly():
    specs = zlab_tensor_specs(CFG)
    assert len(specs) == 3 + 11 * CFG.num_hidden_layers == 58
    module_paths = {path for path, p in nnx.iter_graph(build_drafter(CFG)) if isinstance(p, nnx.Param)}
    assert {s.path for s in specs.values()} == module_paths


def test_non_finite_weights_are_refused_at_load(exported, tmp_path):
    """A NaN weight would make every logit NaN and argmax emit token 0 for target and drafter alike: refused at
    load, naming the file and tensor."""

    def poison(t):
        w = t["fc.weight"].copy()
        w[0, 0] = np.nan
        t["fc.weight"] = w

    bad = rewrite_export(exported[1], tmp_path / "nan", tensors=poison)
    with pytest.raises(ValueError, match=r"nan/model.safetensors: fc.weight: 1 non-finite values"):
        load_drafter(bad, TARGET)


def test_continued_training_can_keep_the_init_drafters_vocabulary(tmp_path):
    """drafter.init_vocab=true takes draft_vocab.json from the drafter.init directory, in its order; a missing file, a
    size other than draft_vocab's, an init that is not a directory and no draft_vocab are refused by name."""
    from train.config import load_config
    from train.starts import init_draft_vocab

    shipped = Path(__file__).resolve().parents[1] / "drafters" / "smollm2-135m-dflash"
    want = json.loads((shipped / "draft_vocab.json").read_text())["token_ids"]
    cfg = load_config(
        "drafters/smollm2-135m-dflash/recipe/regen.yml", [f"drafter.init={shipped}", "drafter.init_vocab=true"]
    )
    assert cfg.draft_vocab == len(want) == 8192
    got = init_draft_vocab(cfg, 49152)
    assert got.dtype == np.int32 and got.tolist() == want
    small = load_config(
        "drafters/smollm2-135m-dflash/recipe/regen.yml", [f"drafter.init={shipped}", "draft_vocab=4096"]
    )
    with pytest.raises(ValueError, match="holds 8192 tokens, draft_vocab=4096"):
        init_draft_vocab(small, 49152)
    empty = load_config("drafters/smollm2-135m-dflash/recipe/regen.yml", [f"drafter.init={tmp_path}"])
    with pytest.raises(ValueError, match="draft_vocab.json does not exist"):
        init_draft_vocab(empty, 49152)
    # Refused when the config is read, before a target loads: an init that is not a directory, no draft_vocab.
    with pytest.raises(ValueError, match="needs drafter.init to be a drafter directory, not 'copy'"):
        load_config("drafters/smollm2-135m-dflash/recipe/long.yml", ["drafter.init_vocab=true"])
    with pytest.raises(ValueError, match=r"needs draft_vocab \(the size of the saved vocabulary\)"):
        load_config(
            "drafters/smollm2-135m-dflash/recipe/regen.yml",
            [f"drafter.init={shipped}", "drafter.init_vocab=true", "draft_vocab=null"],
        )
