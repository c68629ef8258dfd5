"""Test setup: 8 fake CPU devices (sharding bugs show without a TPU), no persistent compile cache, fixtures."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("DECOUPLE_GCLOUD", "TRUE")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_compilation_cache_dir", None)

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures"
REPO = Path(__file__).resolve().parent.parent


def tiny_config(family: str, **changes):
    """Tiny Qwen3 / Llama configs shaped like the committed HF fixtures (any family but qwen3 reads as llama)."""
    from dflash_model.config import TINY_PRESETS

    return TINY_PRESETS["qwen3" if family == "qwen3" else "llama"].replace(**changes)


# The weight scale the tests' expectations were set at. A random target's own default (init_std: 1/sqrt(64) = 0.125
# at the tiny width) makes the tiny targets' greedy text fall into one-token loops, which several tests' data (the
# teacher-forced censoring, the trained drafters' acceptance) were not built for.
TINY_STD = 0.08


def tiny_target(family: str, seed: int = 0, **changes):
    from flax import nnx

    from dflash_model.target import build_target, randomize

    return randomize(nnx.eval_shape(lambda: build_target(tiny_config(family, **changes))), seed=seed, std=TINY_STD)


@pytest.fixture(scope="session")
def smollm2():
    """(config, module, tokenizer) of the embedded default target, loaded once per session."""
    from data.assets import smollm2_gguf
    from dflash_model.tokenizer import load_tokenizer
    from dflash_model.weights import load_target

    path = smollm2_gguf()
    cfg, model = load_target(path)
    return cfg, model, load_tokenizer(path)


def param_arrays(model) -> dict:
    """{path: array} of every nnx.Param of a module (to compare two drafters parameter by parameter)."""
    import numpy as np
    from flax import nnx

    return {path: np.asarray(p.get_value()) for path, p in nnx.iter_graph(model) if isinstance(p, nnx.Param)}


def rewrite_export(src, dst, tensors=None, config=None):
    """A copy of the drafter export at `src` in `dst`, with `tensors(dict)` / `config(dict)` edits applied in place
    (damaged checkpoints for the loaders' refusal tests)."""
    import json

    from safetensors.numpy import load_file, save_file

    dst.mkdir()
    arrays = load_file(str(src / "model.safetensors"))
    raw = json.loads((src / "config.json").read_text())
    if tensors:
        tensors(arrays)
    if config:
        config(raw)
    save_file(arrays, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(raw))
    return dst
