"""The MaxText target backend: MaxText's own HF-to-MaxText conversion, MaxText's own loader and decoder, and the
layer outputs, logits and shared weights training reads, against HF transformers' references and the Tunix
target on the committed HF fixtures (fp32)."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from dflash_model.maxtext_target import MaxTextError, checkpoint_items, convert, load_maxtext_target
from dflash_model.target import embedding_table, final_norm, forward, lm_head_weight
from dflash_model.weights import load_hf_target
from tests.conftest import FIXTURES

pytestmark = pytest.mark.slow

# fp32 on CPU: MaxText's decoder and the Tunix-parameter forward agree to ~6e-6 on activations of size ~6
# (different summation orders); HF transformers' references to the same order.
ATOL = 5e-5


@pytest.fixture(scope="module")
def qwen3_maxtext(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3_maxtext")
    return convert(FIXTURES / "tiny_qwen3", out, dtype="float32")


@pytest.fixture(scope="module")
def qwen3_target(qwen3_maxtext):
    return load_maxtext_target(FIXTURES / "tiny_qwen3", qwen3_maxtext, dtype="float32")


@pytest.fixture(scope="module")
def llama31_dir(tmp_path_factory):
    """tiny_llama with Llama-3.1's own RoPE scaling constants (the fixture's original context is 128; MaxText
    implements only 8192)."""
    d = tmp_path_factory.mktemp("tiny_llama31")
    shutil.copytree(FIXTURES / "tiny_llama", d, dirs_exist_ok=True, ignore=shutil.ignore_patterns("reference.npz"))
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_parameters"]["original_max_position_embeddings"] = 8192
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_qwen3_layers_and_logits_equal_hf_transformers(qwen3_target):
    ref, target = np.load(FIXTURES / "tiny_qwen3" / "reference.npz"), qwen3_target
    tokens = jnp.asarray(ref["input_ids"][:, :256])
    out = forward(target, tokens, layer_ids=(0, 1, 2), compute_logits=True)
    d = 64
    for i in range(3):  # HF hidden_states[i + 1] is layer i's output
        np.testing.assert_allclose(
            out.features[0, :, i * d : (i + 1) * d], ref["hidden_states"][i + 1, :256], atol=ATOL
        )
    np.testing.assert_allclose(out.logits[0], ref["logits"][:256], atol=1e-4)
    # Only the wanted layers come back, in layer_ids order; the last layer without logits too.
    top = forward(target, tokens, layer_ids=(3, 0), compute_logits=False)
    np.testing.assert_allclose(top.features[0, :, :d], ref["last_layer_prenorm"][:256], atol=ATOL)
    np.testing.assert_allclose(top.features[0, :, d:], ref["hidden_states"][1, :256], atol=ATOL)
    assert top.logits is None


def test_shared_weights_equal_the_tunix_target(qwen3_target):
    """The embedding, lm_head and final norm the drafter shares come from the MaxText parameters unchanged."""
    target = qwen3_target
    _, tunix = load_hf_target(FIXTURES / "tiny_qwen3", dtype="float32")
    np.testing.assert_array_equal(embedding_table(target), embedding_table(tunix))
    np.testing.assert_array_equal(lm_head_weight(target), lm_head_weight(tunix))
    h = jnp.linspace(-2, 2, 64)[None]
    np.testing.assert_array_equal(final_norm(target, h), final_norm(tunix, h))


@pytest.mark.long
def test_llama31_layers_equal_the_tunix_target(llama31_dir, tmp_path):
    items = convert(llama31_dir, tmp_path / "mx", dtype="float32")
    assert str(items) == str(checkpoint_items(tmp_path / "mx")) == str(tmp_path / "mx" / "0" / "items")
    target = load_maxtext_target(llama31_dir, tmp_path / "mx", dtype="float32")
    _, tunix = load_hf_target(llama31_dir, dtype="float32")
    tokens = jnp.asarray(np.load(FIXTURES / "tiny_llama" / "reference.npz")["input_ids"][:, :300])
    ids = (1, 3)
    got = forward(target, tokens, layer_ids=ids, compute_logits=True)
    want = forward(tunix, tokens, layer_ids=ids, compute_logits=True)
    np.testing.assert_allclose(got.features, want.features, atol=ATOL)
    np.testing.assert_allclose(got.logits, want.logits, atol=1e-4)


def test_rope_scaling_maxtext_cannot_run_is_refused(tmp_path):
    with pytest.raises(MaxTextError, match="original_max_position_embeddings"):
        convert(FIXTURES / "tiny_llama", tmp_path / "mx")  # its original context is 128, not Llama-3.1's 8192


def test_missing_checkpoint_names_the_path(tmp_path):
    with pytest.raises(MaxTextError, match=str(tmp_path)):
        checkpoint_items(tmp_path)


@pytest.mark.long
def test_training_step_equals_the_tunix_target(qwen3_maxtext, tmp_path):
    """target.maxtext in the trainer: the same loss and drafter gradients as the Tunix target on the same weights,
    on data=2 x fsdp=4 (MaxText's FSDP-sharded parameters on a mesh over the trainer's devices, in one jit)."""
    import jax
    from flax import nnx

    from train.config import load_config
    from train.trainer import open_trainer

    keys = [f"target.path={FIXTURES / 'tiny_qwen3'}", "mesh.data=2", "mesh.fsdp=4"]
    tunix = open_trainer(load_config("tiny", [f"run_dir={tmp_path / 'a'}", *keys]), restore=False)
    mx = open_trainer(load_config("tiny", [f"run_dir={tmp_path / 'b'}", *keys, f"target.maxtext={qwen3_maxtext}"]),
                 restore=False)  # fmt: skip
    assert type(mx.run.target).__name__ == "MaxTextTarget"
    specs = [p.sharding.spec for p in jax.tree.leaves(nnx.state(mx.run.target, nnx.Param))]
    assert any("fsdp" in s for s in specs), specs
    batch = next(tunix.iterator)
    from trainer_probes import loss_and_grads

    loss_t, g_t = loss_and_grads(tunix, batch)
    loss_m, g_m = loss_and_grads(mx, batch)
    assert abs(float(loss_t) - float(loss_m)) < 1e-5 * max(1.0, abs(float(loss_t)))
    for a, b in zip(jax.tree.leaves(g_t), jax.tree.leaves(g_m), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6)
