"""A target whose decoder layers run through MaxText (the `maxtext` extra): the training-time backend for pods.

On a TPU pod most users already hold their target as a MaxText checkpoint, and MaxText's decoder picks the
attention kernel for the hardware (splash on TPU, dot-product on CPU). `MaxTextTarget` wraps MaxText's own NNX
`Transformer`, loaded by MaxText's own `from_pretrained` from the Orbax checkpoint its HF-to-MaxText conversion
writes, and answers what training asks of a target: the outputs of chosen decoder layers (the drafter's
features), logits (target-labelled data), and the embedding, final norm and lm_head the drafter shares.

Decoding keeps the Tunix-parameter target (`dflash_model.target`): MaxText has no speculative decoding and its
KV cache takes one token per step, while verification needs per-row starts and roll-back.

Only the `target_layer_ids` outputs are kept: the scanned layer stack is run as consecutive slices that end at
each wanted layer (`_apply_layers_sequentially`, MaxText's own scan over a stacked layer module), so nothing
stacks all L layer outputs and nothing runs above the deepest wanted layer unless logits are asked for.

Written by hand because MaxText has no API that returns chosen layers' outputs. Pinned to maxtext 0.2.5: the
private decoder methods used here (`_apply_embedding`, `_apply_layers_sequentially`) may move in other versions.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_model.config import TargetConfig, load_hf_config
from dflash_model.sharding import MESH_AXES

# The MaxText model whose HF-to-MaxText parameter mapping and decoder block fit each family; every size field is
# overridden from the target's own config.json, so any Qwen3 / Llama size converts and loads.
MAXTEXT_MODEL_NAMES = {"qwen3": "qwen3-0.6b", "llama": "llama3.1-8b"}
# MaxText's Llama-3.1 RoPE scaling has these constants built in (layers/embeddings.py LLaMARotaryEmbedding).
MAXTEXT_LLAMA31_SCALING = (8.0, 1.0, 4.0, 8192)


class MaxTextError(ValueError):
    pass


def _require_maxtext():
    try:
        import maxtext  # noqa: F401
    except ImportError as e:
        raise MaxTextError(
            "the MaxText target backend needs MaxText: pip install -e '.[maxtext]' (see README, Training on a TPU pod)"
        ) from e


def maxtext_overrides(tcfg: TargetConfig) -> dict:
    """The MaxText config keys that give `tcfg`'s architecture (on top of its family's model yml)."""
    keys = dict(
        model_name=MAXTEXT_MODEL_NAMES[tcfg.family],
        override_model_config=True,  # our sizes replace the named model's
        base_emb_dim=tcfg.hidden_size,
        base_num_query_heads=tcfg.num_attention_heads,
        base_num_kv_heads=tcfg.num_key_value_heads,
        head_dim=tcfg.head_dim,
        base_mlp_dim=tcfg.intermediate_size,
        base_num_decoder_layers=tcfg.num_hidden_layers,
        vocab_size=tcfg.vocab_size,
        logits_via_embedding=tcfg.tie_word_embeddings,
        normalization_layer_epsilon=tcfg.rms_norm_eps,
        rope_max_timescale=tcfg.rope_theta,
        mlp_activations=["silu", "linear"],
        enable_dropout=False,
    )
    if tcfg.family == "qwen3":
        keys["use_qk_norm"] = True
    else:
        s = tcfg.rope_scaling
        if s is not None:
            have = (s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_position_embeddings)
            if tuple(map(float, have)) != tuple(map(float, MAXTEXT_LLAMA31_SCALING)):
                raise MaxTextError(
                    f"rope_scaling {have} (factor, low_freq_factor, high_freq_factor, "
                    f"original_max_position_embeddings): MaxText implements only Llama-3.1's {MAXTEXT_LLAMA31_SCALING}"
                )
        keys["rope_use_scale"] = s is not None
    return keys


def maxtext_config(tcfg: TargetConfig, *, checkpoint: str | Path | None = None, max_length: int = 2048):
    """MaxText's HyperParameters for `tcfg` (fp32 or bf16 as tcfg.dtype), loading `checkpoint` if given."""
    _require_maxtext()
    from maxtext.configs import pyconfig

    base = os.path.join(os.path.dirname(pyconfig.__file__), "base.yml")
    keys = dict(
        maxtext_overrides(tcfg),
        scan_layers=True,
        attention="autoselected",  # MaxText picks: splash ("flash") on TPU, dot_product elsewhere
        dtype=tcfg.dtype,
        weight_dtype=tcfg.dtype,
        max_target_length=int(max_length),
        per_device_batch_size=1,  # unused: the trainer sizes its own batches
        skip_jax_distributed_system=True,  # train/run.py has initialised it already
        enable_checkpointing=False,
        run_name="dflash-target",
        load_parameters_path=str(checkpoint) if checkpoint is not None else "",
    )
    if jax.default_backend() == "cpu":
        keys["hardware"] = "cpu"
    return pyconfig.initialize(["", base], **keys)


def checkpoint_items(path: str | Path):
    """The Orbax `items` directory of a MaxText parameter checkpoint, given it or the conversion's output dir."""
    from etils import epath  # a gs:// checkpoint stays a URI (pathlib would make it a local "gs:" directory)

    p = epath.Path(str(path))
    for cand in (p, p / "items", p / "0" / "items"):
        if (cand / "_METADATA").exists():
            return cand
    raise MaxTextError(
        f"{path}: not a MaxText parameter checkpoint (looked for _METADATA in it, items/ and 0/items/); write one "
        "with `python -m dflash_model.maxtext_target convert HF_DIR OUT_DIR`"
    )


class MaxTextTarget(nnx.Module):
    """MaxText's `Transformer` with the target_config the rest of the project reads (see dflash_model.target)."""

    backend = "maxtext"

    def __init__(self, transformer, target_config: TargetConfig):
        self.transformer = transformer
        self.target_config = target_config  # static graph data, like the Tunix targets'

    def embedding_table(self):
        return self.transformer.token_embedder.embedding[...]

    def output_weight_DV(self):
        """The untied lm_head (dflash_model.target.lm_head_weight serves tied models from the embedding)."""
        return self.transformer.decoder.logits_dense.kernel[...]

    def final_norm_scale(self):
        return self.transformer.decoder.decoder_norm.scale[...]

    def layer_outputs(self, tokens_BT, stops) -> dict[int, jax.Array]:
        """{layer: output} for the 0-based decoder layers in `stops`, positions 0..T-1, causal attention."""
        from maxtext.common.common_types import MODEL_MODE_TRAIN

        decoder = self.transformer.decoder
        positions_BT = jnp.broadcast_to(jnp.arange(tokens_BT.shape[1], dtype=jnp.int32), tokens_BT.shape)
        segments_BT = jnp.ones_like(tokens_BT)  # one segment per row: plain causal attention
        x = decoder._apply_embedding(self.transformer.token_embedder, tokens_BT, positions_BT, True, MODEL_MODE_TRAIN)
        graph, params, rest = nnx.split(decoder.layers, nnx.Param, ...)
        is_var = lambda v: isinstance(v, nnx.Variable)
        outs, start = {}, 0
        for stop in sorted(set(int(s) + 1 for s in stops)):

            def take(v, start=start, stop=stop):  # this segment's layers, along each variable's own layer axis
                return v.replace(jax.lax.slice_in_dim(v[...], start, stop, axis=getattr(v, "param_scan_axis", 0)))

            segment = nnx.merge(
                graph, jax.tree.map(take, params, is_leaf=is_var), jax.tree.map(take, rest, is_leaf=is_var)
            )
            with jax.named_scope(f"maxtext_layers{start}_{stop - 1}"):
                x = decoder._apply_layers_sequentially(
                    segment, x, segments_BT, positions_BT, True, MODEL_MODE_TRAIN, length=stop - start,
                    slot=None, previous_chunk=None,
                )[0]  # fmt: skip
            outs[stop - 1], start = x, stop
        return outs


def load_maxtext_target(hf_dir: str | Path, checkpoint: str | Path, *, dtype: str | None = None, mesh=None,
                        max_length: int = 2048) -> MaxTextTarget:  # fmt: skip
    """The target of `hf_dir`'s config.json with its parameters from the MaxText checkpoint `checkpoint`.

    mesh: the trainer's (data, fsdp, tensor) mesh; MaxText gets a mesh over the same devices in the same order
    with its own axis names, so its parameters and the trainer's arrays meet in one jit.
    """
    _require_maxtext()
    from maxtext.utils import model_creation_utils

    tcfg = load_hf_config(hf_dir)
    if dtype is not None:
        tcfg = tcfg.replace(dtype=dtype)
    config = maxtext_config(tcfg, checkpoint=checkpoint_items(checkpoint), max_length=max_length)
    mx_mesh = None
    if mesh is not None:
        # MaxText's axes hold data, fsdp and tensor in the trainer's order: the same grid, reshaped.
        axes = tuple(config.mesh_axes)
        assert [a for a in axes if a in MESH_AXES] == list(MESH_AXES), axes
        shape = [mesh.shape[a] if a in MESH_AXES else 1 for a in axes]
        mx_mesh = jax.sharding.Mesh(np.asarray(mesh.devices).reshape(shape), axes)
    model = model_creation_utils.from_pretrained(config, mesh=mx_mesh)
    transformer = model if mx_mesh is not None else model[0]
    return MaxTextTarget(transformer, tcfg)


def convert(hf_dir: str | Path, out_dir: str | Path, *, dtype: str = "bfloat16") -> Path:
    """Write `hf_dir` (Qwen3 or Llama safetensors) as a MaxText checkpoint with MaxText's own converter
    (`maxtext.checkpoint_conversion.to_maxtext`, scanned layers), for the architecture in hf_dir's config.json
    rather than a named MaxText model's. Returns the parameter checkpoint's `items` directory."""
    _require_maxtext()
    import transformers
    from maxtext.checkpoint_conversion import to_maxtext

    tcfg = load_hf_config(hf_dir)
    keys = maxtext_overrides(tcfg)
    name = keys["model_name"]
    # The converter maps tensors with a named model's HF config; give it this checkpoint's own (for this call).
    named_config = to_maxtext.HF_MODEL_CONFIGS[name]
    to_maxtext.HF_MODEL_CONFIGS[name] = transformers.AutoConfig.from_pretrained(str(hf_dir))
    save = to_maxtext.save_weights_to_checkpoint
    # maxtext 0.2.5's lazy loader registers its LazyTensor with Orbax's v0 type handlers only, while the save
    # goes through Orbax's v1 Checkpointer, which rejects it: materialise each tensor before saving. (Its eager
    # loader needs torch, which this project never installs.)
    to_maxtext.save_weights_to_checkpoint = lambda path, w, *a, **k: save(path, jax.tree.map(np.asarray, w), *a, **k)
    argv = ["", f"base_output_directory={out_dir}", "scan_layers=True", "skip_jax_distributed_system=True"]
    argv += [f"{k}={json.dumps(v) if isinstance(v, list) else v}" for k, v in keys.items()]
    if jax.default_backend() == "cpu":
        argv.append("hardware=cpu")
    try:
        to_maxtext.main(argv, hf_model_path=str(hf_dir), lazy_load_tensors=True, save_dtype=dtype,
                        simulated_cpu_devices_count=1)  # fmt: skip
    finally:
        to_maxtext.save_weights_to_checkpoint = save
        to_maxtext.HF_MODEL_CONFIGS[name] = named_config
    return checkpoint_items(out_dir)


def main(argv=None) -> None:
    import argparse

    p = argparse.ArgumentParser(description="Convert an HF Qwen3 / Llama checkpoint to a MaxText checkpoint.")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("convert", help="HF_DIR OUT_DIR: MaxText's to_maxtext for this checkpoint's architecture")
    c.add_argument("hf_dir")
    c.add_argument("out_dir")
    c.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = p.parse_args(argv)
    items = convert(args.hf_dir, args.out_dir, dtype=args.dtype)
    print(f"MaxText checkpoint: {items}\ntrain with: target.path={args.hf_dir} target.maxtext={args.out_dir}")


if __name__ == "__main__":
    from dflash_model.cli import run_main

    run_main(main)
