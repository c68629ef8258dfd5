"""vLLM speculators-format DFlash drafters: the config.json writer and reader, and the draft-vocabulary mappings.

The speculators format is the second way serving engines load a DFlash drafter (vLLM reads it natively; its
config is translated into the z-lab shape there, which is what tpu-inference's DFlash model then reads). This
module only translates configs (dict <-> dict) and vocabulary mappings (numpy); dflash_model.drafter_weights writes
and reads the tensors, which are the z-lab body tensors under the same names.

Facts, with where each was read (vllm-project/speculators at commit c05b95b3, 2026-08-20; vllm-project/vllm
files by path, the commit given where one was pinned):

- Top level: `speculators_model_type: "dflash"` selects the algorithm (speculators src/speculators/models/dflash/
  config.py registers DFlashSpeculatorConfig under "dflash"; vLLM vllm/transformers_utils/configs/speculators/
  base.py refuses a type its algos.py has no updater for). vLLM tells a speculators directory from any other
  checkpoint by the presence of `speculators_config` (vllm/transformers_utils/config.py,
  maybe_override_with_speculators); the speculators library by `speculators_model_type` (src/speculators/
  config.py, SpeculatorModelConfig.from_pretrained).
- `speculators_config`: {algorithm, proposal_methods, default_proposal_method, verifier} (src/speculators/
  config.py, SpeculatorsConfig: all four required). A proposal method is {proposal_type: "greedy",
  speculative_tokens, verifier_accept_k, accept_tolerance} (src/speculators/proposals/greedy.py); vLLM needs
  `proposal_methods[i].proposal_type`, the selected method's `speculative_tokens` and `verifier.name_or_path`
  (base.py, validate_speculators_config / build_vllm_speculative_config), and serves `verifier.name_or_path` as
  the target model (config.py, maybe_override_with_speculators). `verifier` is {name_or_path, architectures}
  (src/speculators/config.py, VerifierConfig). For DFlash, speculative_tokens = block_size - 1
  (src/speculators/convert/dflash/converter.py; src/speculators/models/dflash/core.py, _build_base_config_kwargs,
  with sample_from_anchor false).
- `transformer_layer_config`: the draft layers' Qwen3 config as a dict (hidden_size, num_hidden_layers = draft
  layers, heads, head_dim, intermediate_size, rms_norm_eps, rope, vocab_size = the target's vocabulary,
  layer_types, sliding_window, model_type "qwen3"); vLLM requires it to be a dict and builds the draft's HF config
  from it (base.py). The speculators converter fills it with the z-lab config.json minus `architectures`,
  `auto_map`, `block_size`, `dflash_config` and `num_target_layers` (converter.py, _NON_TRANSFORMER_KEYS).
- DFlash fields beside it (src/speculators/models/dflash/config.py): `block_size`, `draft_vocab_size`,
  `target_hidden_size` (null = the draft's hidden size), `aux_hidden_state_layer_ids`, `mask_token_id`,
  `sliding_window_non_causal` (default false: sliding layers causal inside the block, full layers always
  bidirectional), `sample_from_anchor` (default false: slot 0 is the known last token, block_size - 1 drafted).
  vLLM's updater (vllm/transformers_utils/configs/speculators/algos.py, update_dflash) indexes
  `aux_hidden_state_layer_ids` and `mask_token_id` (required) and reads `draft_vocab_size`, `target_hidden_size`.
- Target layers: `aux_hidden_state_layer_ids[i] = dflash_config.target_layer_ids[i] + 1`. z-lab's ids index the
  target's hidden_states output of layer i (hidden_states[i + 1], index 0 being the embeddings); speculators and
  vLLM count the hidden state entering layer i (converter.py adds 1; vLLM's update_dflash subtracts 1, and its
  target models capture `aux_hidden_state_layers` at layer inputs). So the target's last layer (aux id = its
  depth) is a feature vLLM never captures; the speculators converter drops it (converter.py) and this writer
  refuses it rather than change the drafter.
- Tensors (src/speculators/models/dflash/core.py and model_definitions.py, DFlashDraftModel): unprefixed
  `fc.weight`, `hidden_norm.weight`, `norm.weight` and `layers.{i}.{input_layernorm, post_attention_layernorm,
  self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm, mlp.{gate,up,down}_proj}.weight`: the z-lab names and torch
  [out, in] layouts. Besides them, copies of the verifier's `embed_tokens.weight` [vocab, hidden] and
  `lm_head.weight` [draft_vocab_size, hidden] (filled from the verifier and frozen, src/speculators/model.py,
  DraftVocabMixin) and, with a reduced draft vocabulary, `d2t` [draft_vocab_size] int64 and `t2d` [vocab] bool.
  `verifier_lm_head` / `verifier_norm` are never saved (core.py, _keys_to_ignore_on_save). vLLM loads
  embed_tokens / lm_head only when present (sharing the target's otherwise), skips `t2d` and loads `d2t` as
  draft_id_to_target_id (vllm/model_executor/models/qwen3_dflash.py at commit 036a00d1, load_weights).
- Draft vocabulary: `t2d` marks the target ids in the draft vocabulary; `d2t[j]` is an offset, target id =
  j + d2t[j], the ids ascending (src/speculators/train/vocab_mapping.py, build_vocab_mappings_from_distribution;
  vLLM's compute_logits adds the offset the same way). `lm_head.weight` then holds those rows of the verifier's.

Choices where the sources leave it open:
- Causality. One stored version of vLLM's update_dflash sets `dflash_config.causal = not
  sliding_window_non_causal`, an absent key reading as non-causal; another sets no `causal` (each layer then
  takes its default: sliding causal, full bidirectional, qwen3_dflash.py _dflash_layer_causal); and
  qwen3_dflash.py (036a00d1) applies a set `causal` to every layer. This writer puts `sliding_window_non_causal:
  false` only in a config with sliding layers (which need it in the speculators library) and leaves it out
  otherwise, so an all-full drafter is bidirectional under either version.
- The target's depth has no speculators field; this writer adds `num_target_layers` at the top level (both
  readers keep unknown keys) and the reader takes it from the target when a config has none.
- `draft_vocab_size` and `block_size` have library defaults (32000, 8) that describe no real drafter: the reader
  requires them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dflash_model.config import ConfigError

SPECULATORS_MODEL_TYPE = "dflash"
# What the speculators library's save_pretrained writes (the model class name) and vLLM's updater sets.
ARCHITECTURE = "DFlashDraftModel"

# Fields a DFlash speculators config.json must carry: vLLM (base.py validate_speculators_config, algos.py
# update_dflash) and the speculators library (config.py SpeculatorsConfig / VerifierConfig required fields) fail
# without them; block_size and draft_vocab_size because their library defaults are placeholders.
REQUIRED_FIELDS = (
    "speculators_model_type",
    "speculators_config",
    "speculators_config.algorithm",
    "speculators_config.proposal_methods",
    "speculators_config.default_proposal_method",
    "speculators_config.verifier",
    "speculators_config.verifier.name_or_path",
    "speculators_config.verifier.architectures",
    "transformer_layer_config",
    "aux_hidden_state_layer_ids",
    "mask_token_id",
    "block_size",
    "draft_vocab_size",
)
# Per proposal method (vLLM base.py: every method names its type; the selected one its token count).
REQUIRED_METHOD_FIELDS = ("proposal_type", "speculative_tokens")

# z-lab config.json keys that are not part of the draft layers' config (the speculators converter's list).
_NON_TRANSFORMER_KEYS = frozenset({"architectures", "auto_map", "block_size", "dflash_config", "num_target_layers"})

# The HF class a verifier of each target family is (speculators_config.verifier.architectures).
VERIFIER_ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}


def is_speculators_config(raw: dict[str, Any]) -> bool:
    """Whether a config.json dict is in the speculators format (either reader's test)."""
    return "speculators_config" in raw or "speculators_model_type" in raw


def speculators_config(zlab: dict[str, Any], *, name_or_path: str | None, architectures=()) -> dict[str, Any]:
    """The speculators config.json of the drafter whose z-lab config.json dict is `zlab` (drafter_weights.
    zlab_config's output); `name_or_path` / `architectures` describe the verifier (the target) a server loads
    beside it. A drafter that reads the target's last layer is refused: vLLM captures no such feature."""
    dflash = zlab["dflash_config"]
    ids, depth, block = list(dflash["target_layer_ids"]), int(zlab["num_target_layers"]), int(zlab["block_size"])
    if depth - 1 in ids:
        raise ValueError(
            f"dflash_config.target_layer_ids={ids} reads the target's last layer {depth - 1}: its speculators "
            f"aux_hidden_state_layer_id would be {depth}, a layer input vLLM never captures (the z-lab format "
            "carries this drafter as is)"
        )
    layers = {k: v for k, v in zlab.items() if k not in _NON_TRANSFORMER_KEYS}
    out = {
        "architectures": [ARCHITECTURE],
        "speculators_model_type": SPECULATORS_MODEL_TYPE,
        "speculators_config": {
            "algorithm": SPECULATORS_MODEL_TYPE,
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": block - 1,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": name_or_path, "architectures": list(architectures)},
        },
        "transformer_layer_config": layers,
        "block_size": block,
        "draft_vocab_size": int(zlab["vocab_size"]),
        "target_hidden_size": None,
        "aux_hidden_state_layer_ids": [i + 1 for i in ids],
        "mask_token_id": int(dflash["mask_token_id"]),
        "sample_from_anchor": False,
        "num_target_layers": depth,
        "torch_dtype": zlab["torch_dtype"],
    }
    if "sliding_attention" in (zlab.get("layer_types") or ()):
        out["sliding_window_non_causal"] = False
    return out


def _field(raw: dict, dotted: str, source: str):
    """raw's value at a dotted path; a missing one is a ConfigError naming the whole path."""
    value = raw
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            raise ConfigError(f"{source}: missing required field {dotted!r}")
        value = value[part]
    return value


def _int_field(raw: dict, dotted: str, source: str, low: int = 0) -> int:
    value = _field(raw, dotted, source)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{source}: {dotted}={value!r}, expected an integer >= {low}")
    return value


def _check_header(raw: dict, source: str) -> None:
    """The fields that say what the file is: a DFlash speculator with a proposal method and a verifier."""
    for dotted in REQUIRED_FIELDS:
        _field(raw, dotted, source)
    kind = raw["speculators_model_type"]
    if kind != SPECULATORS_MODEL_TYPE:
        raise ConfigError(
            f"{source}: speculators_model_type={kind!r}; only {SPECULATORS_MODEL_TYPE!r} is a DFlash drafter"
        )
    algorithm = raw["speculators_config"]["algorithm"]
    if algorithm != SPECULATORS_MODEL_TYPE:
        raise ConfigError(f"{source}: speculators_config.algorithm={algorithm!r}, expected {SPECULATORS_MODEL_TYPE!r}")
    methods = raw["speculators_config"]["proposal_methods"]
    if not isinstance(methods, list) or not methods:
        raise ConfigError(f"{source}: speculators_config.proposal_methods must be a non-empty list")
    for i, method in enumerate(methods):
        for key in REQUIRED_METHOD_FIELDS:
            _field(method, key, f"{source}: speculators_config.proposal_methods[{i}]")
    if not isinstance(raw["transformer_layer_config"], dict):
        raise ConfigError(f"{source}: transformer_layer_config must be a JSON object")


def _check_block_options(raw: dict, layers: dict, block: int, source: str) -> None:
    """Options that change what the drafter computes: only this implementation's choices are accepted."""
    if raw.get("sample_from_anchor"):
        raise ConfigError(
            f"{source}: sample_from_anchor=true (the anchor slot drafts too) is not supported: slot 0 is the known "
            "last token here"
        )
    if raw.get("sliding_window_non_causal") and "sliding_attention" in (layers.get("layer_types") or ()):
        raise ConfigError(
            f"{source}: sliding_window_non_causal=true is not supported (sliding layers are causal inside the block)"
        )
    methods = raw["speculators_config"]["proposal_methods"]
    default = raw["speculators_config"]["default_proposal_method"]
    method = next((m for m in methods if m.get("proposal_type") == default), methods[0])
    tokens = method["speculative_tokens"]
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= block - 1:
        raise ConfigError(
            f"{source}: speculators_config.proposal_methods speculative_tokens={tokens!r}, expected 1..{block - 1} "
            f"(block_size={block})"
        )


def zlab_view(raw: dict[str, Any], source: str, num_target_layers: int | None = None) -> dict[str, Any]:
    """The z-lab config.json dict equivalent to a speculators config.json dict `raw` (drafter_weights.
    parse_zlab_config then checks the architecture keys); every missing or unsupported field is a ConfigError
    naming it. `num_target_layers` (the target's depth) stands in when the config has none."""
    _check_header(raw, source)
    layers = raw["transformer_layer_config"]
    block = _int_field(raw, "block_size", source, low=2)
    _check_block_options(raw, layers, block, source)
    aux = raw["aux_hidden_state_layer_ids"]
    if not isinstance(aux, list) or not aux or not all(isinstance(i, int) and not isinstance(i, bool) for i in aux):
        raise ConfigError(f"{source}: aux_hidden_state_layer_ids={aux!r}, expected a non-empty list of integers")
    if min(aux) < 1:
        raise ConfigError(f"{source}: aux_hidden_state_layer_ids={aux}: ids count layer inputs from 1")
    depth = raw.get("num_target_layers", num_target_layers)
    if depth is None:
        raise ConfigError(f"{source}: missing field 'num_target_layers' (the target's depth): load it with its target")
    out = {k: v for k, v in layers.items() if k not in _NON_TRANSFORMER_KEYS}
    out.setdefault("model_type", "qwen3")  # the speculators library's default layer config is Qwen3Config
    dtype = raw.get("torch_dtype", raw.get("dtype"))  # the saved model's dtype; the layer config's may be stale
    if dtype is not None:
        out["torch_dtype"] = dtype
    if raw.get("target_hidden_size") is not None:
        out["target_hidden_size"] = raw["target_hidden_size"]
    out.update(
        architectures=[ARCHITECTURE],
        block_size=block,
        num_target_layers=depth,
        dflash_config={
            "mask_token_id": _int_field(raw, "mask_token_id", source),
            "target_layer_ids": [i - 1 for i in aux],
        },
    )
    return out


def draft_vocab_size(raw: dict[str, Any], vocab_size: int, source: str) -> int:
    """The checked draft_vocab_size of a speculators config (1..vocab_size)."""
    n = _int_field(raw, "draft_vocab_size", source, low=1)
    if n > vocab_size:
        raise ConfigError(f"{source}: draft_vocab_size={n} exceeds the vocabulary ({vocab_size})")
    return n


def extra_tensors(vocab_size: int, draft_size: int, hidden_size: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """Tensors a speculators checkpoint may hold beside the z-lab body: name -> (shape, dtype kind: "float",
    "int" or "bool")."""
    return {
        "embed_tokens.weight": ((vocab_size, hidden_size), "float"),
        "lm_head.weight": ((draft_size, hidden_size), "float"),
        "d2t": ((draft_size,), "int"),
        "t2d": ((vocab_size,), "bool"),
    }


def vocab_mappings(token_ids, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(d2t, t2d) of a draft vocabulary: d2t[j] = (j-th smallest id) - j as int64, t2d the bool mask of the ids."""
    ids = np.sort(np.asarray(token_ids, np.int64))
    t2d = np.zeros(vocab_size, bool)
    t2d[ids] = True
    return ids - np.arange(len(ids), dtype=np.int64), t2d


def draft_vocab_from_mappings(d2t: np.ndarray, t2d: np.ndarray | None, vocab_size: int, source: str) -> tuple[int, ...]:
    """The draft vocabulary's target ids (ascending, as d2t orders them) from d2t, checked against t2d when the
    checkpoint has one; ids outside the vocabulary, repeated ids or a disagreeing t2d are a ConfigError."""
    ids = np.arange(len(d2t), dtype=np.int64) + np.asarray(d2t, np.int64)
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise ConfigError(f"{source}: d2t maps to token id {int(bad[0])}, outside the vocabulary 0..{vocab_size - 1}")
    if len(np.unique(ids)) != len(ids):
        raise ConfigError(f"{source}: d2t maps two draft ids to one token")
    if t2d is not None:
        mask = np.asarray(t2d).astype(bool)
        if int(mask.sum()) != len(ids) or not mask[ids].all():
            raise ConfigError(f"{source}: t2d marks {int(mask.sum())} tokens that are not the {len(ids)} d2t maps to")
    return tuple(int(i) for i in ids)


__all__ = [
    "ARCHITECTURE",
    "REQUIRED_FIELDS",
    "REQUIRED_METHOD_FIELDS",
    "SPECULATORS_MODEL_TYPE",
    "VERIFIER_ARCHITECTURES",
    "draft_vocab_from_mappings",
    "draft_vocab_size",
    "extra_tensors",
    "is_speculators_config",
    "speculators_config",
    "vocab_mappings",
    "zlab_view",
]
