"""Target forward: cached decoding is exact, layer capture, sharding on a fake 8-device mesh, abstract presets."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config, tiny_target
from flax import nnx

from dflash_model.config import PRESETS, preset
from dflash_model.sharding import abstract_mesh, batch_sharding, make_mesh, memory_report, param_specs, shard_model
from dflash_model.target import KVCache, build_target, forward

FAMILIES = ["qwen3", "llama"]
fwd = nnx.jit(forward, static_argnames=("layer_ids", "compute_logits"))


def _tokens(b, t, seed=0, vocab=512):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, (b, t)), jnp.int32)


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_decoding_matches_full_forward(family):
    """prefill + token-by-token, prefill + K-blocks with crops in between, and one full forward agree (1e-5)."""
    model = tiny_target(family)
    cfg = model.target_config
    tokens = _tokens(2, 48)
    full = fwd(model, tokens, layer_ids=(0, 2)).logits

    # Prefill 16, then one token at a time.
    cache = KVCache.init(cfg, 2, 64)
    out = fwd(model, tokens[:, :16], cache)
    steps = [out.logits]
    cache = out.cache
    for i in range(16, 48):
        out = fwd(model, tokens[:, i : i + 1], cache)
        steps.append(out.logits)
        cache = out.cache
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=1e-5, rtol=0)

    # Prefill 10, then blocks of K=8 of which only part is kept each time (a verify that accepted a few).
    cache = fwd(model, tokens[:, :10], KVCache.init(cfg, 2, 64)).cache
    pos = 10
    for keep in (3, 8, 1, 5, 2):
        block = fwd(model, tokens[:, pos : pos + 8], cache, layer_ids=(0, 2))
        np.testing.assert_allclose(block.logits, full[:, pos : pos + 8], atol=1e-5, rtol=0)
        cache = block.cache.crop(pos + keep)
        pos += keep
    assert cache.lengths.tolist() == [pos, pos]


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_without_cache_write_then_append_equals_writing_forward(family):
    """A verify forward that only reads the cache (write_cache=False, the adaptive decode's switch branches), its
    new K/V appended after, gives the writing forward's logits, features and cache (rows at different lengths)."""
    model = tiny_target(family)
    tokens = _tokens(2, 30)
    cache = fwd(model, tokens[:, :20], KVCache.init(model.target_config, 2, 40)).cache.crop(jnp.array([14, 20]))
    written = fwd(model, tokens[:, 20:28], cache, layer_ids=(0, 2))
    read = nnx.jit(forward, static_argnames=("layer_ids", "write_cache"))(
        model, tokens[:, 20:28], cache, layer_ids=(0, 2), write_cache=False
    )
    assert read.cache is None
    np.testing.assert_allclose(read.logits, written.logits, atol=1e-5, rtol=0)
    np.testing.assert_allclose(read.features, written.features, atol=1e-5, rtol=0)
    appended = cache.append(*read.new_kv)
    np.testing.assert_array_equal(appended.lengths, written.cache.lengths)
    for got, want in ((appended.k, written.cache.k), (appended.v, written.cache.v)):
        np.testing.assert_allclose(got[:, 0, :22], want[:, 0, :22], atol=1e-5, rtol=0)  # row 0: 14 + 8 written
        np.testing.assert_allclose(got[:, 1, :28], want[:, 1, :28], atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_tree_forward_without_cache_write_equals_writing_tree_forward(family):
    """The same for a draft tree (the adaptive tree round's branches): node i at position start + depth[i], seeing
    the cache and its ancestors only; logits and the appended cache equal the writing tree forward's."""
    model = tiny_target(family)
    tokens = _tokens(2, 30)
    cache = fwd(model, tokens[:, :20], KVCache.init(model.target_config, 2, 40)).cache.crop(jnp.array([14, 20]))
    parent = [0, 0, 0, 1, 1, 3]  # node 0 the root; 1 and 2 its children; 3, 4 under 1; 5 under 3
    depth, visible = [0], [[True] + [False] * 5]
    for i in range(1, 6):
        depth.append(depth[parent[i]] + 1)
        visible.append([a or j == i for j, a in enumerate(visible[parent[i]])])
    tree = (jnp.asarray([depth] * 2, jnp.int32), jnp.asarray([visible] * 2))
    nodes = tokens[:, 20:26]
    step = nnx.jit(forward, static_argnames=("write_cache",))
    written = step(model, nodes, cache, tree=tree)
    read = step(model, nodes, cache, tree=tree, write_cache=False)
    np.testing.assert_allclose(read.logits, written.logits, atol=1e-5, rtol=0)
    appended = cache.append(*read.new_kv)
    for got, want in ((appended.k, written.cache.k), (appended.v, written.cache.v)):
        np.testing.assert_allclose(got[:, 0, :20], want[:, 0, :20], atol=1e-5, rtol=0)  # row 0: 14 + 6 nodes
        np.testing.assert_allclose(got[:, 1, :26], want[:, 1, :26], atol=1e-5, rtol=0)
    # A node's logits are its path's: node 5 (path 1, 3, 5) as a plain sequence after the cache.
    path = fwd(model, nodes[:, jnp.asarray([0, 1, 3, 5])], cache)
    np.testing.assert_allclose(read.logits[:, 5], path.logits[:, 3], atol=1e-5, rtol=0)


def _one_token_step_copies(model) -> list[tuple[str, str]]:
    """(dims, HLO line) of every fp32 copy or transpose in the compiled one-token forward (plain decoding's step)."""
    import re

    step = jax.jit(lambda m, t, c: forward(m, t, c).logits)
    hlo = step.lower(model, _tokens(1, 1), KVCache.init(model.target_config, 1, 64)).compile().as_text()
    copied = re.compile(r"= f32\[([0-9,]+)\]\S* (copy|transpose)\(")
    return [(m.group(1), line.strip()[:120]) for line in hlo.splitlines() if (m := copied.search(line))]


def test_one_token_step_reads_the_tied_embedding_in_place():
    """A one-token forward of a tied model (plain decoding's step) compiles without transposing or copying the
    [V, D] table. The transposed einsum did both on every step on XLA:CPU: 40% of SmolLM2's plain decode time."""
    model = tiny_target("qwen3", tie_word_embeddings=True)
    v, d = model.target_config.vocab_size, model.target_config.hidden_size
    assert not [line for dims, line in _one_token_step_copies(model) if dims in (f"{v},{d}", f"{d},{v}")]


def test_one_token_step_reads_every_layer_weight_in_place():
    """A one-token step copies no layer weight, in any order of its dims. The attention output projection, written
    as one einsum over (heads, head_dim), made XLA:CPU copy its [Q, H, D] weight transposed in every layer of every
    step: about 6 of SmolLM2's 34 ms plain step (docs/results/decoding/README.md)."""
    import itertools

    for family in ("qwen3", "llama"):
        model = tiny_target(family)
        weights = [w for w in jax.tree.leaves(nnx.state(model.layers[0])) if w.ndim >= 2]
        shapes = {tuple(w.shape) for w in weights}
        q, h, d = model.layers[0].attn.o_proj.w.shape
        shapes.add((q * h, d))  # the flattened form out_projection reads
        dims = {",".join(map(str, p)) for shape in shapes for p in itertools.permutations(shape)}
        hits = [line for found, line in _one_token_step_copies(model) if found in dims]
        assert not hits, (family, hits)


def test_rows_at_different_lengths():
    """Each row keeps its own length: a batch with rows at different positions equals the rows run alone."""
    model = tiny_target("qwen3")
    cfg = model.target_config
    tokens = _tokens(2, 30, seed=1)
    cache = fwd(model, tokens[:, :20], KVCache.init(cfg, 2, 40)).cache.crop(jnp.asarray([12, 20]))
    nxt = jnp.stack([tokens[0, 12:16], tokens[1, 20:24]])
    out = fwd(model, nxt, cache)
    for row, start in ((0, 12), (1, 20)):
        alone = fwd(model, tokens[row : row + 1, : start + 4]).logits[0, start:]
        np.testing.assert_allclose(out.logits[row], alone, atol=1e-5, rtol=0)
    assert out.cache.lengths.tolist() == [16, 24]


def test_layer_outputs_are_the_chosen_layers():
    """features = outputs of exactly the requested layers, in the requested order, concatenated."""
    model = tiny_target("llama")
    tokens = _tokens(1, 12)
    d = model.target_config.hidden_size
    a = fwd(model, tokens, layer_ids=(3, 0, 1)).features
    b = fwd(model, tokens, layer_ids=(0, 1, 3)).features
    assert a.shape == (1, 12, 3 * d)
    np.testing.assert_array_equal(a[..., :d], b[..., 2 * d :])
    np.testing.assert_array_equal(a[..., d:], b[..., : 2 * d])
    with pytest.raises(ValueError, match="outside"):
        fwd(model, tokens, layer_ids=(4,))
    # Without logits the forward stops at the deepest wanted layer: the same features as the full forward's.
    shallow = forward(model, tokens, layer_ids=(1, 0), compute_logits=False).features
    np.testing.assert_array_equal(shallow, forward(model, tokens, layer_ids=(1, 0)).features)

    def matmuls(ids):  # per layer: q, k, v, o and the three MLP projections
        jaxpr = jax.make_jaxpr(lambda t: forward(model, t, layer_ids=ids, compute_logits=False).features)(tokens)
        return str(jaxpr).count("dot_general")

    assert matmuls((1, 0)) < matmuls((3,))


def test_logits_at_one_position_per_row():
    model = tiny_target("qwen3")
    tokens = _tokens(2, 10)
    full = fwd(model, tokens).logits
    picked = fwd(model, tokens, logits_at=jnp.asarray([3, 9])).logits
    np.testing.assert_allclose(picked, np.stack([full[0, 3], full[1, 9]]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_sharded_forward_on_8_fake_devices(family):
    """data x fsdp x tensor = 2x2x2 mesh: parameters really split, same logits and cache as one device."""
    assert len(jax.devices()) == 8
    model = tiny_target(family)
    cfg = model.target_config
    tokens = _tokens(4, 24)
    ref = fwd(model, tokens, KVCache.init(cfg, 4, 32), layer_ids=(1,))

    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    specs = param_specs(model, mesh)
    assert specs[("layers", 0, "attn", "q_proj", "w")] == jax.sharding.PartitionSpec("fsdp", "tensor", None)
    sharded = shard_model(model, mesh)
    w = sharded.layers[0].mlp.gate_proj.kernel[...]
    assert len(w.sharding.device_set) == 8 and w.addressable_shards[0].data.shape == (32, cfg.intermediate_size // 2)
    tokens = jax.device_put(tokens, batch_sharding(mesh, 2))
    out = fwd(sharded, tokens, KVCache.init(cfg, 4, 32), layer_ids=(1,))
    assert len(out.logits.sharding.device_set) == 8
    np.testing.assert_allclose(out.logits, ref.logits, atol=1e-5, rtol=0)
    np.testing.assert_allclose(out.features, ref.features, atol=1e-5, rtol=0)
    np.testing.assert_allclose(out.cache.k, ref.cache.k, atol=1e-5, rtol=0)


# Parameter counts of the real checkpoints (HF model cards / config.json arithmetic).
REAL_PARAMS = {
    "qwen3-4b": 4_022_468_096,
    "qwen3-8b": 8_190_735_360,
    "llama-3.1-8b": 8_030_261_248,
    "smollm2-135m": 134_515_008,
}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_real_presets_build_abstractly(name):
    """Real sizes are built with nnx.eval_shape (nothing allocated) and planned on a 64-chip pod mesh."""
    cfg = preset(name)
    abstract = nnx.eval_shape(lambda: build_target(cfg))
    report = memory_report(abstract, abstract_mesh(data=4, fsdp=8, tensor=2))
    assert report["params"] == REAL_PARAMS[name] == cfg.num_params()
    bytes_per = 2 if cfg.dtype == "bfloat16" else 4
    assert report["bytes"] == REAL_PARAMS[name] * bytes_per
    # fsdp x tensor = 16-way for everything large; only norms (and non-dividing dims) replicate.
    assert report["bytes_per_device"] < report["bytes"] / 12
    print(
        f"{name}: {report['params'] / 1e9:.3f}B params, {report['bytes'] / 2**30:.2f} GiB, "
        f"{report['bytes_per_device'] / 2**20:.0f} MiB per device on {report['mesh']}"
    )


def test_attention_in_query_chunks_equals_dense_and_bounds_memory(monkeypatch):
    """Above layers.MAX_SCORES the target's attention goes through the queries in chunks: the same logits and
    features as the dense pass (to fp32 rounding), cached or not, and the compiled forward's temporaries no longer
    hold the [B, heads, T, S] fp32 score tensor."""
    from dflash_model import layers

    target = tiny_target("qwen3")
    cfg = target.target_config
    tokens = _tokens(2, 96)

    def run(cache):
        out = forward(target, tokens, cache, layer_ids=(1, 3))
        return out.logits, out.features

    dense = [run(None), run(KVCache.init(cfg, 2, 128))]
    monkeypatch.setattr(layers, "MAX_SCORES", 2 * cfg.num_attention_heads * 128 * 10)  # 10 query rows a chunk
    chunked = [run(None), run(KVCache.init(cfg, 2, 128))]
    for (dl, df), (cl, cf) in zip(dense, chunked):
        np.testing.assert_allclose(cl, dl, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(cf, df, rtol=1e-5, atol=1e-5)

    q = jnp.ones((2, 2048, cfg.num_attention_heads, cfg.head_dim))
    kv = jnp.ones((2, 2048, cfg.num_key_value_heads, cfg.head_dim))
    mask = jnp.tril(jnp.ones((2048, 2048), bool))[None]
    scores_bytes = 2 * cfg.num_attention_heads * 2048 * 2048 * 4

    def temp_bytes(max_scores):
        fn = jax.jit(lambda q, k, v: layers.attend(q, k, v, mask, max_scores=max_scores))
        return fn.lower(q, kv, kv).compile().memory_analysis().temp_size_in_bytes

    assert temp_bytes(1 << 40) >= scores_bytes  # the dense call holds every score
    assert temp_bytes(1 << 20) < scores_bytes / 4  # 4 MiB of scores a chunk; the broadcast mask is 8 MiB


def test_mesh_over_two_slices_puts_data_across_them():
    """Multislice (devices with a slice_index): the data axis spans the slices, fsdp x tensor stay inside one;
    a data axis the slice count does not divide is refused naming mesh.data. One slice: a plain grid."""
    import types

    from dflash_model.sharding import device_grid

    fake = [types.SimpleNamespace(id=i, slice_index=i // 4, platform="cpu", device_kind="cpu") for i in range(8)]
    slices_of = lambda grid: np.vectorize(lambda d: d.slice_index)(grid)
    grid = device_grid(2, 4, 1, fake)
    assert grid.shape == (2, 4, 1) and slices_of(grid)[:, :, 0].tolist() == [[0] * 4, [1] * 4]
    grid = device_grid(4, 1, 2, fake)
    assert slices_of(grid)[:, 0, :].tolist() == [[0, 0], [0, 0], [1, 1], [1, 1]]
    with pytest.raises(ValueError, match="mesh.data=1 over 2 slices"):
        device_grid(1, 8, 1, fake)
    single = device_grid(1, 4, 2, jax.devices())
    assert sorted(d.id for d in single.flat) == sorted(d.id for d in jax.devices())


def test_random_weights_do_not_depend_on_the_mesh():
    """randomize on a (2, 2, 2) mesh gives each parameter the mesh's sharding and exactly the values drawn on one
    device: each device draws its own shard, and the values are a function of the seed and the index only."""
    from dflash_model.sharding import param_shardings
    from dflash_model.target import random_target

    cfg = tiny_config("qwen3")
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    one = nnx.state(random_target(cfg, seed=3), nnx.Param)
    sharded_model = random_target(cfg, seed=3, mesh=mesh)
    want = param_shardings(sharded_model, mesh)
    for path, param in nnx.iter_graph(sharded_model):
        if isinstance(param, nnx.Param):
            assert param.get_value().sharding.is_equivalent_to(want[path], param.get_value().ndim), path
    leaves_one = jax.tree.leaves(one)
    leaves_sharded = jax.tree.leaves(nnx.state(sharded_model, nnx.Param))
    assert len(leaves_one) == len(leaves_sharded) > 10
    for a, b in zip(leaves_one, leaves_sharded):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    other = jax.tree.leaves(nnx.state(random_target(cfg, seed=4), nnx.Param))
    assert not np.array_equal(np.asarray(leaves_one[0]), np.asarray(other[0]))  # the seed matters
    # two parameters of one shape are not copies of each other (each has its own seeds)
    shapes = [x.shape for x in leaves_one]
    same_shape = [x for x in leaves_one if x.shape == max(shapes, key=shapes.count)]
    assert len(same_shape) > 1 and not np.array_equal(np.asarray(same_shape[0]), np.asarray(same_shape[1]))


@pytest.mark.parametrize("hidden, vocab", [(64, 512), (1024, 8192)])
def test_untrained_loss_of_a_random_target_is_near_ln_vocab(hidden, vocab):
    """At two widths 16x apart, the random target's own next-token loss and the DFlash loss of a freshly built drafter
    on it are within 20% of ln(vocab): logits stay O(1) at any width (the 0.08 scale used before gave 11.6 at
    hidden 1024, 40% over ln 8192, and 23-40 at Qwen3-8B's 4096)."""
    from dflash_model.drafter import build_drafter
    from dflash_model.drafter_config import drafter_config_for
    from dflash_model.target import random_target
    from train.objective import dflash_loss

    cfg = tiny_config("qwen3").replace(
        hidden_size=hidden, vocab_size=vocab, num_hidden_layers=2, intermediate_size=3 * hidden, head_dim=hidden // 4
    )
    target = random_target(cfg, seed=0)
    tokens = _tokens(2, 64, vocab=vocab)
    out = fwd(target, tokens, layer_ids=(0, 1))
    lm_loss = float(-jnp.take_along_axis(jax.nn.log_softmax(out.logits[:, :-1]), tokens[:, 1:, None], -1).mean())
    block = 8
    dcfg = drafter_config_for(
        cfg, mask_token_id=vocab - 1, num_layers=1, n_features=2, block_size=block, target_layer_ids=(0, 1)
    )
    drafter = build_drafter(dcfg, seed=0)
    anchors = jnp.asarray([[2, 12, 22, 32, 42], [5, 15, 25, 35, 45]], jnp.int32)
    dflash, _ = dflash_loss(
        drafter, target, out.features, tokens, jnp.ones_like(tokens, bool), anchors, block_size=block, gamma=7.0
    )
    ln_v = float(np.log(vocab))
    for name, loss in (("target next-token", lm_loss), ("DFlash", float(dflash))):
        assert abs(loss - ln_v) < 0.2 * ln_v, f"{name} loss {loss:.2f} against ln V = {ln_v:.2f} at hidden {hidden}"


@pytest.mark.parametrize("family", FAMILIES)
def test_library_attention_equals_the_einsum_in_the_training_forward(family):
    """target.attention=xla (jax.nn.dot_product_attention, the call the cuDNN kernel shares) gives the einsum's
    features and logits: within 2e-5 in fp32 and within bf16's own rounding at 16 bits; decoding refuses it."""
    tokens = _tokens(2, 24, seed=3)
    for dtype, tol in (("float32", 2e-5), ("bfloat16", 3e-2)):
        model = tiny_target(family, dtype=dtype)
        ref = forward(model, tokens, layer_ids=(0, 2))
        lib = forward(model, tokens, layer_ids=(0, 2), attention="xla")
        scale = float(jnp.max(jnp.abs(ref.logits.astype(jnp.float32))))
        for a, b in ((ref.features, lib.features), (ref.logits, lib.logits)):
            gap = float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
            assert gap <= tol * max(scale, 1.0), (dtype, gap)
    cache = KVCache.init(tiny_config(family), 2, 32)
    with pytest.raises(ValueError, match="decoding uses einsum"):
        forward(model, tokens, cache, attention="xla")
    with pytest.raises(ValueError, match="einsum, xla or cudnn"):
        forward(model, tokens, attention="flash")
