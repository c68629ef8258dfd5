"""The z-lab DFlash checkpoint schema as serving engines read it: what vLLM (`method: dflash`) and SGLang (`DFLASH`)
need from a drafter directory's config.json and tensors, listed as problems rather than raised, so an export can be
checked before anything serves it (`check_zlab_schema`; export_drafter's result is checked by the tests).
"""

from __future__ import annotations

from pathlib import Path

from dflash_model.config import ConfigError, stored_dtype
from dflash_model.drafter_weights import SAFETENSORS_DTYPE, parse_zlab_config, read_config, tensor_problems
from dflash_model.weights import CheckpointError, SafetensorsSource

# Keys vLLM / SGLang read from a DFlash draft config (besides dflash_config), with the type each must have.
_REQUIRED_KEYS = {
    "hidden_size": int,
    "intermediate_size": int,
    "num_hidden_layers": int,
    "num_attention_heads": int,
    "num_key_value_heads": int,
    "head_dim": int,
    "rms_norm_eps": float,
    "max_position_embeddings": int,
    "vocab_size": int,
    "num_target_layers": int,
}


def check_zlab_schema(model_dir: str | Path) -> list[str]:
    """Problems a serving engine would hit reading `model_dir` as a DFlash drafter; [] when it is well formed.

    Mirrors what vLLM (`method: dflash`) and SGLang (`DFLASH`) read: architectures / model_type dispatch,
    dflash_config.{mask_token_id, target_layer_ids}, block_size, the Qwen3 keys, layer types (vLLM refuses mixed
    sliding/full layers), and the 3 + 11 * L tensors by name, shape and dtype.
    """
    model_dir = Path(model_dir)
    try:
        raw = read_config(model_dir)
    except (CheckpointError, ConfigError) as e:
        return [str(e)]
    problems = _header_problems(raw) + _key_problems(raw)
    if problems:
        return problems
    try:
        cfg = parse_zlab_config(raw, source=str(model_dir / "config.json"))
    except ConfigError as e:
        return [str(e)]
    try:
        source = SafetensorsSource(model_dir)
    except CheckpointError as e:
        return [str(e)]
    return tensor_problems(source, cfg, stored_dtype(raw))


def _header_problems(raw: dict) -> list[str]:
    """What a server's dispatch reads: architectures, model_type, dflash_config's keys, block_size."""
    problems = []
    if raw.get("architectures") != ["DFlashDraftModel"]:
        problems.append(f"architectures={raw.get('architectures')!r}, expected ['DFlashDraftModel']")
    if raw.get("model_type") != "qwen3":
        problems.append(f"model_type={raw.get('model_type')!r}, expected 'qwen3'")
    dflash = raw.get("dflash_config")
    if not isinstance(dflash, dict):
        problems.append("dflash_config missing or not an object")
        dflash = {}
    if not isinstance(dflash.get("mask_token_id"), int):
        problems.append(f"dflash_config.mask_token_id={dflash.get('mask_token_id')!r}, expected an int")
    ids = dflash.get("target_layer_ids")
    if not (isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids)):
        problems.append(f"dflash_config.target_layer_ids={ids!r}, expected a non-empty list of ints")
    block = raw.get("block_size", dflash.get("block_size"))
    if not (isinstance(block, int) and block >= 2):
        problems.append(f"block_size={block!r}, expected an int >= 2 (top level or in dflash_config)")
    return problems


def _key_problems(raw: dict) -> list[str]:
    """The Qwen3 keys a server builds the drafter from, its dtype and its layer types."""
    problems = []
    for key, kind in _REQUIRED_KEYS.items():
        value = raw.get(key)
        if not isinstance(value, (int, float) if kind is float else int) or isinstance(value, bool):
            problems.append(f"{key}={value!r}, expected {kind.__name__}")
    theta = raw.get("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta"))
    if not isinstance(theta, (int, float)):
        problems.append("rope_theta missing (top level or rope_parameters.rope_theta)")
    declared = stored_dtype(raw)
    if declared not in SAFETENSORS_DTYPE:
        problems.append(f"torch_dtype={declared!r}, expected one of {sorted(SAFETENSORS_DTYPE)}")
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        kinds = set(layer_types)
        if kinds == {"full_attention", "sliding_attention"}:
            problems.append("layer_types mixes sliding and full attention, which vLLM's DFlash does not support")
        if "sliding_attention" in kinds and not (raw.get("use_sliding_window") and raw.get("sliding_window")):
            problems.append("sliding layers need use_sliding_window=true and an int sliding_window (HF drops it)")
    return problems
