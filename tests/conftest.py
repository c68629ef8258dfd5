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


def tiny_config(family: str, **changes):
    """Tiny Qwen3 / Llama configs shaped like the committed HF fixtures."""
    from dflash_model.config import RopeScaling, TargetConfig

    if family == "qwen3":
        cfg = TargetConfig(
            family="qwen3",
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            rope_theta=1e6,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            max_position_embeddings=2048,
        )
    else:
        cfg = TargetConfig(
            family="llama",
            vocab_size=512,
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            rope_theta=5e5,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            max_position_embeddings=2048,
            rope_scaling=RopeScaling(8.0, 1.0, 4.0, 128),
        )
    return cfg.replace(**changes)


def tiny_target(family: str, seed: int = 0, **changes):
    from dflash_model.target import build_target, randomize

    return randomize(build_target(tiny_config(family, **changes)), seed=seed)


@pytest.fixture(scope="session")
def smollm2():
    """(config, module, tokenizer) of the embedded default target, loaded once per session."""
    from data.assets import smollm2_gguf
    from dflash_model.tokenizer import load_tokenizer
    from dflash_model.weights import load_target

    path = smollm2_gguf()
    cfg, model = load_target(path)
    return cfg, model, load_tokenizer(path)
