"""Target checkpoints in: HF safetensors directories and GGUF files, checked strictly before anything loads.

Every tensor is checked by name, shape and dtype against the config before the first one is read, so a
mismatched checkpoint is an error naming the tensor and never a half-loaded model.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.flax import save_file

from dflash_model.config import ConfigError, RopeScaling, TargetConfig, architecture_json, jnp_dtype, load_hf_config
from dflash_model.sharding import param_shardings
from dflash_model.target import build_target, config_of

FLOAT_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


class CheckpointError(ValueError):
    """A checkpoint that does not match its config (names the file and tensor)."""


# ----------------------------------------------------------------------------------------------------------
# Tensor sources: name -> (shape, dtype) without reading data, then the data on demand.


class SafetensorsSource:
    """An HF directory: model.safetensors, or shards listed by model.safetensors.index.json."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.dir.glob("*.safetensors"))
            weight_map = None
        if not files:
            raise CheckpointError(f"{self.dir}: no *.safetensors files")
        self._handles, self.file_of = {}, {}
        for name in files:
            path = self.dir / name
            if not path.is_file():
                raise CheckpointError(f"{index}: lists {name}, which does not exist")
            try:
                handle = safe_open(str(path), framework="flax")
            except Exception as e:  # safetensors raises its own error types for bad headers
                raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from e
            self._handles[name] = handle
            for key in handle.keys():
                if key in self.file_of:
                    raise CheckpointError(f"{path}: tensor {key!r} also in {self.file_of[key]}")
                self.file_of[key] = name
        if weight_map is not None:
            for key, name in weight_map.items():
                if self.file_of.get(key) != name:
                    raise CheckpointError(f"{index}: maps {key!r} to {name}, which does not contain it")

    def where(self, name: str) -> str:
        return str(self.dir / self.file_of[name])

    def keys(self):
        return self.file_of.keys()

    def shape_dtype(self, name: str) -> tuple[tuple[int, ...], str]:
        sl = self._handles[self.file_of[name]].get_slice(name)
        return tuple(sl.get_shape()), sl.get_dtype()

    def get(self, name: str) -> jax.Array:
        return self._handles[self.file_of[name]].get_tensor(name)


# GGUF (llama.cpp) names for Llama-architecture tensors, mapped to HF names.
_GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_TO_HF = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _gguf_to_hf_name(name: str) -> str | None:
    if name in _GGUF_TO_HF:
        return _GGUF_TO_HF[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_TO_HF:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_TO_HF[parts[2]]}.{parts[3]}"
    return None


def undo_gguf_rope_permute(w_OI: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter reorders each head's q/k rows from rotate-half to interleaved RoPE order
    (row pairs (j, j + H/2) become rows (2j, 2j + 1)); undo it so the HF rotate-half forward applies."""
    out_dim = w_OI.shape[0]
    half = out_dim // n_heads // 2
    return w_OI.reshape(n_heads, half, 2, *w_OI.shape[1:]).swapaxes(1, 2).reshape(w_OI.shape)


@functools.lru_cache(maxsize=4)
def _gguf_reader(path: Path, size: int, mtime: float):
    """One parse per file and process: GGUFReader takes ~8 s on SmolLM2's 49k-token vocabulary."""
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # gguf raises ValueError/struct errors on bad magic or truncation
        raise CheckpointError(f"{path}: not a readable GGUF file ({e})") from e


class GGUFSource:
    """A GGUF file of a Llama-architecture model, dequantised to float32 tensors under HF names."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"{self.path}: GGUF file not found")
        stat = self.path.stat()
        self.reader = _gguf_reader(self.path.resolve(), stat.st_size, stat.st_mtime)
        self.metadata = {k: _field_value(f) for k, f in self.reader.fields.items()}
        arch = self.metadata.get("general.architecture")
        if arch != "llama":
            raise CheckpointError(f"{self.path}: general.architecture={arch!r}; only 'llama' GGUF files load")
        self._tensors, self.unmapped = {}, []
        for t in self.reader.tensors:
            hf = _gguf_to_hf_name(t.name)
            if hf is None:
                self.unmapped.append(t.name)
            else:
                self._tensors[hf] = t

    def config(self, dtype: str = "float32") -> TargetConfig:
        m = self.metadata

        def need(key):
            if key not in m:
                raise ConfigError(f"{self.path}: GGUF metadata lacks {key!r}")
            return m[key]

        heads = int(need("llama.attention.head_count"))
        hidden = int(need("llama.embedding_length"))
        embd = self._tensors.get("model.embed_tokens.weight")
        vocab = int(m.get("llama.vocab_size") or (embd.shape[-1] if embd is not None else 0))
        scaling = None
        if "llama.rope.scaling.type" in m and m["llama.rope.scaling.type"] not in ("none", "linear"):
            raise ConfigError(f"{self.path}: rope scaling {m['llama.rope.scaling.type']!r} not supported")
        return TargetConfig(
            family="llama",
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(need("llama.feed_forward_length")),
            num_hidden_layers=int(need("llama.block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(m.get("llama.attention.head_count_kv", heads)),
            head_dim=int(m.get("llama.attention.key_length", hidden // heads)),
            rope_theta=float(m.get("llama.rope.freq_base", 10000.0)),
            rms_norm_eps=float(need("llama.attention.layer_norm_rms_epsilon")),
            tie_word_embeddings="lm_head.weight" not in self._tensors,
            max_position_embeddings=int(m.get("llama.context_length", 8192)),
            rope_scaling=scaling,
            dtype=dtype,
        )

    def where(self, name: str) -> str:
        return f"{self.path} ({self._tensors[name].name})"

    def keys(self):
        return self._tensors.keys()

    def shape_dtype(self, name: str) -> tuple[tuple[int, ...], str]:
        # GGUF lists dims fastest-first; reversed they are torch's [out, in]. Values come out as float32.
        return tuple(int(d) for d in reversed(self._tensors[name].shape)), "F32"

    def get(self, name: str) -> np.ndarray:
        t = self._tensors[name]
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape(self.shape_dtype(name)[0])
        if name.endswith("self_attn.q_proj.weight"):
            w = undo_gguf_rope_permute(w, int(self.metadata["llama.attention.head_count"]))
        elif name.endswith("self_attn.k_proj.weight"):
            heads = self.metadata["llama.attention.head_count"]
            w = undo_gguf_rope_permute(w, int(self.metadata.get("llama.attention.head_count_kv", heads)))
        return w


def _field_value(field):
    try:
        return field.contents()
    except Exception:  # a field type gguf cannot decode is simply not used
        return None


# ----------------------------------------------------------------------------------------------------------
# The HF name -> Tunix parameter map.


@dataclass(frozen=True)
class TensorSpec:
    hf_shape: tuple[int, ...]
    path: tuple  # path of the nnx.Param in the Tunix module
    to_param: Callable  # HF (torch) layout -> Tunix layout
    to_hf: Callable  # and back


def torch_layouts(d: int, h: int):
    """(to_param, to_hf) converter pairs between torch Linear weights [out, in] and the einsum layouts of the
    modules here: identity, transpose, q/k/v [D, heads, H] (a function of heads) and o [heads, H, D] (same)."""
    same = (lambda w: w, lambda w: w)
    t = (lambda w: w.T, lambda w: w.T)

    def heads_in(n):
        return lambda w: w.reshape(n, h, d).transpose(2, 0, 1), lambda w: w.transpose(1, 2, 0).reshape(n * h, d)

    def heads_out(n):
        return lambda w: w.reshape(d, n, h).transpose(1, 2, 0), lambda w: w.transpose(2, 0, 1).reshape(d, n * h)

    return same, t, heads_in, heads_out


def hf_tensor_specs(cfg: TargetConfig) -> dict[str, TensorSpec]:
    """Every tensor an HF checkpoint of `cfg` must contain, with where it goes in the Tunix module."""
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    n, k, h = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    same, t, qkv, heads_out = torch_layouts(d, h)
    o = heads_out(n)
    specs = {
        "model.embed_tokens.weight": TensorSpec((v, d), ("embedder", "input_embedding"), *same),
        "model.norm.weight": TensorSpec((d,), ("final_norm", "w"), *same),
    }
    if not cfg.tie_word_embeddings:
        specs["lm_head.weight"] = TensorSpec((v, d), ("lm_head", "w"), *t)
    for i in range(cfg.num_hidden_layers):
        p, a = f"model.layers.{i}.", ("layers", i, "attn")
        specs |= {
            p + "input_layernorm.weight": TensorSpec((d,), ("layers", i, "input_layernorm", "w"), *same),
            p + "post_attention_layernorm.weight": TensorSpec(
                (d,), ("layers", i, "post_attention_layernorm", "w"), *same
            ),
            p + "self_attn.q_proj.weight": TensorSpec((n * h, d), (*a, "q_proj", "w"), *qkv(n)),
            p + "self_attn.k_proj.weight": TensorSpec((k * h, d), (*a, "k_proj", "w"), *qkv(k)),
            p + "self_attn.v_proj.weight": TensorSpec((k * h, d), (*a, "v_proj", "w"), *qkv(k)),
            p + "self_attn.o_proj.weight": TensorSpec((d, n * h), (*a, "o_proj", "w"), *o),
            p + "mlp.gate_proj.weight": TensorSpec((f, d), ("layers", i, "mlp", "gate_proj", "kernel"), *t),
            p + "mlp.up_proj.weight": TensorSpec((f, d), ("layers", i, "mlp", "up_proj", "kernel"), *t),
            p + "mlp.down_proj.weight": TensorSpec((d, f), ("layers", i, "mlp", "down_proj", "kernel"), *t),
        }
        if cfg.qk_norm:
            specs[p + "self_attn.q_norm.weight"] = TensorSpec((h,), (*a, "q_norm", "w"), *same)
            specs[p + "self_attn.k_norm.weight"] = TensorSpec((h,), (*a, "k_norm", "w"), *same)
    return specs


def tensor_problems(
    source, expected_shapes: dict[str, tuple], declared_dtype: str | None, tolerated=frozenset()
) -> list[str]:
    """Every missing, unexpected, mis-shaped or mis-typed tensor of `source` against `expected_shapes`.

    Dtypes are compared with `declared_dtype` only when it names a float dtype; `tolerated` names extra
    tensors that may be present and are ignored."""
    problems = [
        f"missing tensor {name!r} (expected shape {list(expected_shapes[name])})"
        for name in sorted(set(expected_shapes) - set(source.keys()))
    ]
    for name in sorted(set(source.keys()) - set(expected_shapes) - set(tolerated)):
        problems.append(f"unexpected tensor {name!r} in {source.where(name)}")
    compare_dtype = declared_dtype in FLOAT_DTYPES.values()
    for name in sorted(set(expected_shapes) & set(source.keys())):
        shape, dtype = source.shape_dtype(name)
        if shape != tuple(expected_shapes[name]):
            problems.append(
                f"tensor {name!r} in {source.where(name)} has shape {list(shape)}, "
                f"config expects {list(expected_shapes[name])}"
            )
        if dtype not in FLOAT_DTYPES:
            problems.append(f"tensor {name!r} in {source.where(name)} has dtype {dtype}, not a float type")
        elif compare_dtype and FLOAT_DTYPES[dtype] != declared_dtype:
            problems.append(
                f"tensor {name!r} in {source.where(name)} has dtype {FLOAT_DTYPES[dtype]}, "
                f"config declares {declared_dtype}"
            )
    return problems


def raise_problems(what: str, problems: list[str]) -> None:
    """CheckpointError listing the first 20 problems, if there are any."""
    if problems:
        shown = "\n  ".join(problems[:20]) + (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else "")
        raise CheckpointError(f"{what} ({len(problems)} problems):\n  {shown}")


def check_tensors(source, cfg: TargetConfig, expected_dtype: str | None) -> None:
    """Raise CheckpointError listing every missing, unexpected, mis-shaped or mis-typed tensor."""
    shapes = {name: spec.hf_shape for name, spec in hf_tensor_specs(cfg).items()}
    # Tied checkpoints may still carry a copy of the embedding as lm_head.weight; it is not used.
    tolerated = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    raise_problems("checkpoint does not match its config", tensor_problems(source, shapes, expected_dtype, tolerated))


def check_finite(value, name: str) -> None:
    """A NaN or inf weight makes every logit NaN, and argmax of NaN is token 0 for target and drafter alike: a
    checkpoint with one is refused at load, naming the tensor."""
    bad = int(jnp.size(value) - jnp.isfinite(value).sum())
    if bad:
        raise ValueError(f"{name}: {bad} non-finite values (NaN or inf) in the checkpoint")


def load_into_module(source, cfg: TargetConfig, *, mesh=None) -> nnx.Module:
    """Build the module abstractly, then fill every parameter from `source` (already checked), placing each
    one on `mesh` by the sharding rules as it is read (a big model is never whole on one device)."""
    abstract = nnx.eval_shape(lambda: build_target(cfg))
    shardings = None if mesh is None else param_shardings(abstract, mesh)
    params = {path: p for path, p in nnx.iter_graph(abstract) if isinstance(p, nnx.Param)}
    dtype = jnp_dtype(cfg.dtype)
    specs = hf_tensor_specs(cfg)
    if set(params) != {s.path for s in specs.values()}:  # a Tunix layout change must not load silently
        raise RuntimeError(f"Tunix parameter layout changed: {sorted(set(params) ^ {s.path for s in specs.values()})}")
    for name, spec in specs.items():
        value = spec.to_param(jnp.asarray(source.get(name))).astype(dtype)
        check_finite(value, name)
        param = params[spec.path]
        if value.shape != param.get_value().shape:
            raise RuntimeError(f"{name}: converted shape {value.shape} != module shape {param.get_value().shape}")
        if shardings is not None:
            value = jax.device_put(value, shardings[spec.path])
        param.set_value(value)
    return abstract


def load_hf_target(model_dir: str | Path, *, dtype: str | None = None, mesh=None):
    """(config, module) from an HF safetensors directory; dtype casts after the strict check."""
    file_cfg = load_hf_config(model_dir)
    source = SafetensorsSource(model_dir)
    check_tensors(source, file_cfg, expected_dtype=file_cfg.dtype)
    cfg = file_cfg if dtype is None else file_cfg.replace(dtype=dtype)
    return cfg, load_into_module(source, cfg, mesh=mesh)


def load_gguf_target(path: str | Path, *, dtype: str = "float32", mesh=None):
    """(config, module) from a Llama-architecture GGUF file, dequantised (Q4_1, Q8_0, F16, ... via gguf)."""
    source = GGUFSource(path)
    cfg = source.config(dtype=dtype)
    if source.unmapped:
        raise CheckpointError(f"{path}: unexpected GGUF tensors {source.unmapped[:5]}")
    check_tensors(source, cfg, expected_dtype=None)
    return cfg, load_into_module(source, cfg, mesh=mesh)


def to_hf_config(cfg: TargetConfig) -> dict:
    """The config.json an HF checkpoint of `cfg` carries."""
    return {
        "architectures": ["Qwen3ForCausalLM" if cfg.family == "qwen3" else "LlamaForCausalLM"],
        "model_type": cfg.family,
        **architecture_json(cfg),
        "tie_word_embeddings": cfg.tie_word_embeddings,
    }


def save_hf_target(model: nnx.Module, out_dir: str | Path, dtype: str | None = None) -> Path:
    """Write `model` as an HF directory (config.json + model.safetensors), the inverse of load_hf_target."""
    cfg = config_of(model)
    cfg = cfg if dtype is None else cfg.replace(dtype=dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    params = {path: p for path, p in nnx.iter_graph(model) if isinstance(p, nnx.Param)}
    jdtype = jnp_dtype(cfg.dtype)
    tensors = {
        name: jnp.asarray(spec.to_hf(params[spec.path][...])).astype(jdtype)
        for name, spec in hf_tensor_specs(cfg).items()
    }
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(to_hf_config(cfg), indent=2))
    return out


def _is_gguf(path: Path) -> bool:
    """True for a .gguf file, False for an HF directory; anything else is an error."""
    if path.suffix == ".gguf":
        return True
    if path.is_dir():
        return False
    raise CheckpointError(f"{path}: expected an HF model directory (config.json + *.safetensors) or a .gguf file")


def load_target_config(path: str | Path, *, dtype: str | None = None) -> TargetConfig:
    """The architecture of an HF directory (its config.json) or a .gguf file (its metadata), no weights read."""
    path = Path(path)
    if _is_gguf(path):
        return GGUFSource(path).config(dtype=dtype or "float32")
    return load_hf_config(path, dtype=dtype)


def load_target(path: str | Path, *, dtype: str | None = None, mesh=None):
    """An HF directory or a .gguf file."""
    path = Path(path)
    if _is_gguf(path):
        return load_gguf_target(path, dtype=dtype or "float32", mesh=mesh)
    return load_hf_target(path, dtype=dtype, mesh=mesh)


__all__ = [
    "CheckpointError",
    "GGUFSource",
    "RopeScaling",
    "SafetensorsSource",
    "check_tensors",
    "hf_tensor_specs",
    "load_gguf_target",
    "load_hf_target",
    "load_target",
    "load_target_config",
    "undo_gguf_rope_permute",
]
