"""vLLM speculators-format export and load: the config carries the fields vLLM and the speculators library require,
the tensors are the speculators DFlash names, the shipped drafter round-trips bit for bit (its logits too), every
damaged field or tensor is refused by name, a reduced draft vocabulary comes back from d2t, and `export.format=both`
writes both directories at the end of a run."""

import json
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import param_arrays, rewrite_export
from safetensors.numpy import load_file, save_file

from dflash_model import speculators_format
from dflash_model.config import ConfigError, TargetConfig
from dflash_model.drafter import build_drafter, train_logits
from dflash_model.drafter_config import DrafterConfig
from dflash_model.drafter_weights import export_drafter, load_draft_vocab, load_drafter
from dflash_model.target import randomize
from dflash_model.weights import CheckpointError

SHIPPED = Path(__file__).resolve().parents[1] / "drafters" / "smollm2-135m-dflash"

CFG = DrafterConfig(
    hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    head_dim=8, rms_norm_eps=1e-6, rope_theta=1e6, vocab_size=128, block_size=4, mask_token_id=127,
    target_layer_ids=(0, 1, 2), num_target_layers=4,
)  # fmt: skip
TARGET = TargetConfig(
    family="qwen3", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=1e6, rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)  # fmt: skip
VERIFIER = {"name_or_path": "Qwen/Qwen3-0.6B", "architectures": ["Qwen3ForCausalLM"]}

# What a DFlash speculators config.json must carry, and who reads it:
REQUIRED = [
    # vllm-project/vllm vllm/transformers_utils/configs/speculators/base.py (validate_speculators_config,
    # build_vllm_speculative_config): KeyError / ValueError without them.
    "speculators_model_type",
    "speculators_config.proposal_methods",
    "speculators_config.verifier.name_or_path",
    "transformer_layer_config",
    # vllm-project/vllm vllm/transformers_utils/configs/speculators/algos.py (update_dflash) indexes these.
    "aux_hidden_state_layer_ids",
    "mask_token_id",
    # vllm-project/speculators src/speculators/config.py: SpeculatorsConfig and VerifierConfig fields without
    # defaults.
    "speculators_config.algorithm",
    "speculators_config.default_proposal_method",
    "speculators_config.verifier.architectures",
    # vllm-project/speculators src/speculators/models/dflash/config.py: defaults (8, 32000) that fit no real
    # drafter, so this project requires them.
    "block_size",
    "draft_vocab_size",
]
# Each proposal method (base.py: every entry names its type; the selected one its token count;
# src/speculators/proposals/greedy.py).
REQUIRED_METHOD = ["proposal_type", "speculative_tokens"]
# The draft layers' config vLLM builds the DFlash model from (vllm/model_executor/models/qwen3_dflash.py).
REQUIRED_LAYER_KEYS = [
    "model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings", "vocab_size",
    "hidden_act", "layer_types",
]  # fmt: skip


def _layer_names(i):
    """The speculators DFlash decoder layer's tensors (src/speculators/models/dflash/model_definitions.py)."""
    parts = ["input_layernorm", "post_attention_layernorm"] + [f"self_attn.{p}" for p in ("q_proj", "k_proj")]
    parts += [f"self_attn.{p}" for p in ("v_proj", "o_proj", "q_norm", "k_norm")]
    parts += [f"mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    return {f"layers.{i}.{p}.weight" for p in parts}


def _drafter(cfg=CFG, seed=0):
    return randomize(build_drafter(cfg), seed=seed, std=0.1)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    drafter = _drafter()
    out = tmp_path_factory.mktemp("spec")
    return drafter, export_drafter(drafter, CFG, out, dtype="float32", fmt="speculators", verifier=VERIFIER)


def _get(raw, dotted):
    for part in dotted.split("."):
        raw = raw[part]
    return raw


def test_config_has_the_fields_vllm_and_speculators_require(exported):
    raw = json.loads((exported[1] / "config.json").read_text())
    for dotted in REQUIRED:
        _get(raw, dotted)  # KeyError names a missing one
    assert set(REQUIRED) <= set(speculators_format.REQUIRED_FIELDS)
    for method in raw["speculators_config"]["proposal_methods"]:
        assert set(REQUIRED_METHOD) <= set(method)
    layers = raw["transformer_layer_config"]
    assert set(REQUIRED_LAYER_KEYS) <= set(layers)
    # The converter's non-transformer keys stay out of the layer config (src/speculators/convert/dflash/converter.py).
    assert not {"architectures", "auto_map", "block_size", "dflash_config", "num_target_layers"} & set(layers)
    assert raw["speculators_model_type"] == "dflash" and raw["speculators_config"]["algorithm"] == "dflash"
    assert raw["architectures"] == ["DFlashDraftModel"]
    method = raw["speculators_config"]["proposal_methods"][0]
    assert (method["proposal_type"], method["speculative_tokens"]) == ("greedy", CFG.block_size - 1)
    assert raw["speculators_config"]["default_proposal_method"] == "greedy"
    assert raw["speculators_config"]["verifier"] == VERIFIER
    # Target layers: z-lab counts layer outputs, speculators / vLLM layer inputs (vLLM's update_dflash maps back by
    # subtracting 1).
    assert raw["aux_hidden_state_layer_ids"] == [i + 1 for i in CFG.target_layer_ids]
    assert [i - 1 for i in raw["aux_hidden_state_layer_ids"]] == list(CFG.target_layer_ids)
    assert (raw["mask_token_id"], raw["block_size"], raw["draft_vocab_size"]) == (127, 4, 128)
    assert raw["sample_from_anchor"] is False and "sliding_window_non_causal" not in raw  # all layers full
    assert (layers["model_type"], layers["num_hidden_layers"], layers["vocab_size"]) == ("qwen3", 3, 128)
    assert raw["torch_dtype"] == layers["torch_dtype"] == "float32"


def test_tensor_names_are_the_speculators_dflash_names(exported):
    """fc / hidden_norm / norm and 11 per layer, torch [out, in]; no embedding or lm_head (optional in vLLM's
    load_weights: the target's are shared) and no d2t / t2d (the full vocabulary)."""
    tensors = load_file(str(exported[1] / "model.safetensors"))
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"}.union(*(_layer_names(i) for i in range(3)))
    assert set(tensors) == expected
    assert tensors["fc.weight"].shape == (32, 3 * 32)
    assert tensors["layers.0.self_attn.q_proj.weight"].shape == (4 * 8, 32)
    assert tensors["layers.0.self_attn.o_proj.weight"].shape == (32, 4 * 8)


def test_fp32_round_trip_through_the_projects_loader(exported):
    drafter, out = exported
    cfg, loaded = load_drafter(out, TARGET)
    assert cfg == CFG
    want, got = param_arrays(drafter), param_arrays(loaded)
    assert want.keys() == got.keys()
    for path in want:
        np.testing.assert_array_equal(got[path], want[path], err_msg=str(path))
    assert load_draft_vocab(out, CFG.vocab_size) is None


@pytest.mark.slow
def test_shipped_drafter_round_trips_exactly_with_equal_logits(smollm2, tmp_path):
    target_cfg, target, _ = smollm2
    cfg, shipped = load_drafter(SHIPPED, target_cfg)
    verifier = {"name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct", "architectures": ["LlamaForCausalLM"]}
    vocab = load_draft_vocab(SHIPPED, cfg.vocab_size)
    out = export_drafter(shipped, cfg, tmp_path / "spec", dtype="bfloat16", draft_vocab=vocab, fmt="speculators",
                         verifier=verifier)  # fmt: skip
    raw = json.loads((out / "config.json").read_text())
    assert raw["aux_hidden_state_layer_ids"] == [2, 9, 15, 21, 28]  # z-lab's [1, 8, 14, 20, 27] + 1
    assert raw["sliding_window_non_causal"] is False  # its first layer slides: causal inside the block
    assert raw["transformer_layer_config"]["layer_types"][0] == "sliding_attention"

    got_cfg, got = load_drafter(out, target_cfg)
    assert got_cfg == cfg
    assert load_draft_vocab(out, cfg.vocab_size) == vocab  # draft_vocab.json travels beside it, in its order
    want, have = param_arrays(shipped), param_arrays(got)
    assert want.keys() == have.keys()
    for path in want:
        assert have[path].dtype == want[path].dtype == jnp.bfloat16
        np.testing.assert_array_equal(have[path].view(np.uint16), want[path].view(np.uint16), err_msg=str(path))

    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, 10)), jnp.int32)
    features = jnp.asarray(rng.standard_normal((1, 10, cfg.n_features * cfg.hidden_size)), jnp.float32)
    anchors = jnp.asarray([[3, 6]], jnp.int32)
    a = train_logits(shipped, target, features, tokens, anchors, 4)
    b = train_logits(got, target, features, tokens, anchors, 4)
    assert a.shape == (1, 2, 4, cfg.vocab_size) and bool(jnp.isfinite(a).all())
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _pop(dotted):
    def edit(raw):
        *head, last = dotted.split(".")
        _get(raw, ".".join(head)).pop(last) if head else raw.pop(last)

    return edit


@pytest.mark.parametrize("field", REQUIRED)
def test_a_missing_required_field_is_refused_by_name(exported, tmp_path, field):
    bad = rewrite_export(exported[1], tmp_path / "bad", config=_pop(field))
    with pytest.raises(ConfigError, match=re.escape(f"missing required field '{field}'")):
        load_drafter(bad, TARGET)


def _set(dotted, value):
    def edit(raw):
        *head, last = dotted.split(".")
        (_get(raw, ".".join(head)) if head else raw)[last] = value

    return edit


CONFIG_CASES = {
    "method tokens": (
        lambda c: c["speculators_config"]["proposal_methods"][0].pop("speculative_tokens"),
        r"proposal_methods\[0\]: missing required field 'speculative_tokens'",
    ),
    "layer key": (_pop("transformer_layer_config.hidden_size"), r"transformer_layer_config.*'hidden_size'"),
    "eagle3": (_set("speculators_model_type", "eagle3"), "speculators_model_type='eagle3'"),
    "anchor drafts": (_set("sample_from_anchor", True), "sample_from_anchor=true"),
    "too many tokens": (
        lambda c: c["speculators_config"]["proposal_methods"][0].update(speculative_tokens=4),
        r"speculative_tokens=4, expected 1..3",
    ),
    "aux from 0": (_set("aux_hidden_state_layer_ids", [0, 1, 2]), "count layer inputs from 1"),
    "aux past the target": (_set("aux_hidden_state_layer_ids", [1, 2, 5]), r"target_layer_ids \[4\] outside"),
    "draft vocab": (_set("draft_vocab_size", 129), "draft_vocab_size=129 exceeds"),
    "target hidden": (_set("target_hidden_size", 64), "target_hidden_size=64"),
    "mask": (_set("mask_token_id", "127"), "mask_token_id='127'"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_config_problem_is_named(exported, tmp_path, case):
    edit, message = CONFIG_CASES[case]
    bad = rewrite_export(exported[1], tmp_path / "bad", config=edit)
    with pytest.raises(ConfigError, match=message):
        load_drafter(bad, TARGET)


def test_depth_comes_from_the_target_when_the_config_has_none(exported, tmp_path):
    bad = rewrite_export(exported[1], tmp_path / "bad", config=_pop("num_target_layers"))
    with pytest.raises(ConfigError, match="'num_target_layers'"):
        load_drafter(bad)
    assert load_drafter(bad, TARGET)[0] == CFG


TENSOR_CASES = {
    "missing": (lambda t: t.pop("norm.weight"), "missing tensor 'norm.weight'"),
    "unknown": (lambda t: t.update({"verifier_norm.weight": np.ones(32, np.float32)}), "unexpected tensor "),
    "shape": (lambda t: t.update({"lm_head.weight": np.ones((128, 31), np.float32)}), r"'lm_head.weight'.*\[128, 31\]"),
    "mapping dtype": (lambda t: t.update({"t2d": np.ones(128, np.float32)}), "'t2d'.*dtype F32, expected bool"),
    "body dtype": (lambda t: t.update({"fc.weight": t["fc.weight"].astype(np.float16)}), "'fc.weight'.*float16"),
}


@pytest.mark.parametrize("case", sorted(TENSOR_CASES))
def test_tensor_problem_is_named(exported, tmp_path, case):
    edit, message = TENSOR_CASES[case]
    bad = rewrite_export(exported[1], tmp_path / "bad", tensors=edit)
    with pytest.raises(CheckpointError, match=message):
        load_drafter(bad, TARGET)


def test_a_tensor_in_two_shards_is_refused(exported, tmp_path):
    bad = rewrite_export(exported[1], tmp_path / "bad")
    save_file({"fc.weight": load_file(str(bad / "model.safetensors"))["fc.weight"]}, str(bad / "model-2.safetensors"))
    with pytest.raises(CheckpointError, match="tensor 'fc.weight' also in"):
        load_drafter(bad, TARGET)


def test_verifier_copies_and_a_reduced_vocabulary_from_d2t(exported, tmp_path):
    """A checkpoint as the speculators library writes one: embed_tokens / lm_head copies of the verifier's (shape
    checked, not parameters here) and, for a reduced vocabulary, d2t (offsets) and t2d (a mask), which load as the
    draft vocabulary; a missing d2t, a t2d that disagrees, and a draft_vocab.json that disagrees are refused."""
    ids = [100, 3, 64, 7]
    d2t, t2d = speculators_format.vocab_mappings(ids, 128)
    assert d2t.tolist() == [3 - 0, 7 - 1, 64 - 2, 100 - 3] and int(t2d.sum()) == 4

    def add(t):
        t.update(
            {"embed_tokens.weight": np.ones((128, 32), np.float32), "lm_head.weight": np.ones((4, 32), np.float32)}
        )
        t.update({"d2t": d2t, "t2d": t2d})

    good = rewrite_export(exported[1], tmp_path / "good", tensors=add, config=_set("draft_vocab_size", 4))
    cfg, loaded = load_drafter(good, TARGET)
    assert cfg == CFG
    for path, value in param_arrays(exported[0]).items():
        np.testing.assert_array_equal(param_arrays(loaded)[path], value)
    assert load_draft_vocab(good, 128) == (3, 7, 64, 100)

    (good / "draft_vocab.json").write_text(json.dumps({"token_ids": [3, 7, 64, 99]}))
    with pytest.raises(ConfigError, match="not the 4 the checkpoint's d2t maps to"):
        load_draft_vocab(good, 128)

    def no_d2t(t):
        add(t)
        t.pop("d2t")

    bad = rewrite_export(exported[1], tmp_path / "no-d2t", tensors=no_d2t, config=_set("draft_vocab_size", 4))
    with pytest.raises(CheckpointError, match="missing tensor 'd2t'"):
        load_drafter(bad, TARGET)

    def other_t2d(t):
        add(t)
        t["t2d"] = speculators_format.vocab_mappings([1, 2, 3, 4], 128)[1]

    bad = rewrite_export(exported[1], tmp_path / "t2d", tensors=other_t2d, config=_set("draft_vocab_size", 4))
    with pytest.raises(ConfigError, match="t2d marks"):
        load_draft_vocab(bad, 128)


def test_a_drafter_on_the_targets_last_layer_is_refused_before_any_file(tmp_path):
    cfg = CFG.replace(target_layer_ids=(0, 1, 3))
    with pytest.raises(ValueError, match=r"target_layer_ids=\[0, 1, 3\] reads the target's last layer 3"):
        export_drafter(_drafter(cfg), cfg, tmp_path / "x", fmt="speculators")
    assert not (tmp_path / "x").exists()
    export_drafter(_drafter(cfg), cfg, tmp_path / "z")  # the z-lab format carries it


@pytest.mark.long
def test_export_format_both_writes_both_directories(tmp_path):
    """export.format=both at the end of a tiny run: z-lab at export/, speculators at export-speculators/, the same
    weights; export.format is checked with the other choices, export.verifier must be a string."""
    from train.config import load_config
    from train.trainer import open_trainer
    from train.workflow import export_run

    with pytest.raises(ValueError, match="export.format='onnx'"):
        load_config("tiny", ["export.format=onnx"])
    with pytest.raises(ValueError, match="export.verifier=3"):
        load_config("tiny", ["export.verifier=3"])
    run_dir = tmp_path / "run"
    cfg = load_config("tiny", [f"run_dir={run_dir}", "train.steps=2", "export.format=both", "export.verifier=org/m"])
    trainer = open_trainer(cfg)
    trainer.train()
    zlab, spec = run_dir / "export", run_dir / "export-speculators"
    assert export_run(trainer) == zlab
    assert "dflash_config" in json.loads((zlab / "config.json").read_text())
    raw = json.loads((spec / "config.json").read_text())
    assert raw["speculators_config"]["verifier"] == {"name_or_path": "org/m", "architectures": ["Qwen3ForCausalLM"]}
    a, b = load_drafter(zlab)[1], load_drafter(spec)[1]
    for path, value in param_arrays(a).items():
        np.testing.assert_array_equal(param_arrays(b)[path], value)
