"""A config's xla_flags: appended to XLA_FLAGS before JAX starts, and the oneDNN flags of the bf16 CPU config
accepted by the installed jaxlib with weight gradients that match fp32's."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dflash_model.cli import add_xla_flags
from train.config import load_config

ROOT = Path(__file__).resolve().parents[1]


def test_flags_are_appended_and_the_environment_wins(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2 --xla_cpu_use_onednn=false")
    add_xla_flags("--xla_cpu_use_onednn=true --xla_cpu_experimental_onednn_custom_call=true")
    assert os.environ["XLA_FLAGS"].split() == [
        "--xla_force_host_platform_device_count=2",
        "--xla_cpu_use_onednn=false",  # set by the user: kept
        "--xla_cpu_experimental_onednn_custom_call=true",
    ]
    monkeypatch.delenv("XLA_FLAGS")
    add_xla_flags("")
    assert "XLA_FLAGS" not in os.environ


def test_a_word_that_is_no_flag_is_named(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    with pytest.raises(ValueError, match="'xla_cpu_use_onednn=true' is not an XLA flag"):
        add_xla_flags("xla_cpu_use_onednn=true")


def test_xla_flags_must_be_a_string():
    assert load_config("smollm2-135m").xla_flags == ""
    with pytest.raises(ValueError, match="xla_flags=3: expected str"):
        load_config("smollm2-135m", ["xla_flags=3"])


def test_bf16_config_flags_run_and_keep_gradients(tmp_path):
    """In a fresh process under the flags of the shipped drafter's recipe/code-bf16.yml (an unknown flag would
    abort it), the MLP's weight gradient in bf16 (the matmul YNNPACK upcasts and oneDNN runs in bf16) stays within 2% of
    fp32's (relative Frobenius error; bf16 has an 8-bit mantissa)."""
    flags = load_config("drafters/smollm2-135m-dflash/recipe/code-bf16.yml", ["data.source=synthetic"]).xla_flags
    assert "--xla_cpu_use_onednn=true" in flags.split()
    script = textwrap.dedent(
        """
        import jax, jax.numpy as jnp
        from dflash_model.layers import swiglu
        k = jax.random.split(jax.random.PRNGKey(0), 4)
        x = jax.random.normal(k[0], (512, 64))
        g, u, d = (0.1 * jax.random.normal(k[i], s) for i, s in ((1, (64, 160)), (2, (64, 160)), (3, (160, 64))))
        def loss(w, dt):
            return jnp.sum(swiglu(x.astype(dt), *w).astype(jnp.float32) ** 2)
        f32 = jax.grad(loss)((g, u, d), jnp.float32)
        b16 = jax.grad(loss)((g, u, d), jnp.bfloat16)
        err = max(float(jnp.linalg.norm(a - b) / jnp.linalg.norm(a)) for a, b in zip(f32, b16))
        print(f"relative error {err:.4f}")
        assert err < 0.02, err
        """
    )
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "relative error" in out.stdout
