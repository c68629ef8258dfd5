"""Target LLMs (Qwen3, Llama) on Tunix's NNX modules, with a cached forward that returns chosen layers' outputs.

The parameters live in Tunix's own `Qwen3` / `Llama3` modules (their presets, parameter layout and sharding
annotations). The forward pass is ours, written over those parameters, because Tunix's forward cannot do
what speculative decoding needs:
  * its KV cache keeps one `end_index` for the whole batch (rows cannot sit at different lengths) and has no
    crop; verification needs per-row starts and roll-back;
  * it returns only the final-norm output, not the outputs of chosen decoder layers;
  * Tunix's Qwen3 attention ignores `rope_theta` and its Llama3 has no Llama-3.1 frequency scaling.

Dimension letters: docs/glossary.md (one glossary for the repository).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import flax
import jax
import jax.numpy as jnp
from flax import nnx
from tunix.models.llama3 import model as llama3
from tunix.models.qwen3 import model as qwen3

from dflash_model.config import TargetConfig, jnp_dtype
from dflash_model.hashing import mix32
from dflash_model.layers import (
    apply_rope,
    attend,
    attend_context_and_blocks,
    out_projection,
    rms_norm,
    rope_angles,
    rope_inv_freq,
    swiglu,
)
from dflash_model.sharding import constrain_batch, param_shardings

# The spread of a random target's (and a test drafter's) norm weights around 1: unit norms would hide bugs.
RANDOM_NORM_SPREAD = 0.1


def init_std(hidden_size: int) -> float:
    """The weight scale of a random model of width `hidden_size`: 1/sqrt(hidden_size). Every matrix but the
    attention output and the MLP down projection reads the residual stream (fan-in = hidden size; the other two
    have fan-in num_heads x head_dim and intermediate_size, within 4x of it), so each projection keeps unit scale
    and the logits (lm_head, or the tied embedding) stay O(1) at any width: an untrained loss near ln(vocab)."""
    return float(hidden_size) ** -0.5


def build_target(cfg: TargetConfig, *, seed: int = 0) -> nnx.Module:
    """The Tunix module for `cfg` with Tunix's initialisation (use `nnx.eval_shape` for an abstract one)."""
    rngs = nnx.Rngs(seed)
    dtype = jnp_dtype(cfg.dtype)
    shape = dict(
        num_layers=cfg.num_hidden_layers,
        vocab_size=cfg.vocab_size,
        embed_dim=cfg.hidden_size,
        hidden_dim=cfg.intermediate_size,
        num_heads=cfg.num_attention_heads,
        head_dim=cfg.head_dim,
        num_kv_heads=cfg.num_key_value_heads,
        rope_theta=cfg.rope_theta,
        norm_eps=cfg.rms_norm_eps,
    )
    if cfg.family == "qwen3":
        tcfg = qwen3.ModelConfig(**shape, use_tied_embedding=cfg.tie_word_embeddings, dtype=dtype, param_dtype=dtype)
        model = qwen3.Qwen3(tcfg, rngs=rngs)
    else:
        model = llama3.Llama3(llama3.ModelConfig(**shape, weight_tying=cfg.tie_word_embeddings), rngs=rngs)
        if dtype != jnp.float32:  # Tunix's Llama3 always initialises fp32 parameters
            _cast_params(model, dtype)
    model.target_config = cfg  # plain attribute: static graph data, not a parameter
    return model


def _cast_params(model: nnx.Module, dtype) -> None:
    for _, param in nnx.iter_graph(model):
        if isinstance(param, nnx.Param):
            param.set_value(param[...].astype(dtype))


def _hidden_size(model: nnx.Module) -> int:
    cfg = getattr(model, "target_config", None) or getattr(model, "config", None)
    if cfg is None:
        raise ValueError("randomize: the model carries no config to take its hidden size from; pass std=")
    return int(cfg.hidden_size)


@functools.cache
def _random_fn(shape: tuple, dtype, sharding):
    """mean + scale * U (U uniform with unit variance) of `shape`, made in place with `sharding`; cached, since a
    model's layers share shapes.

    Hand-written rather than jax.random.normal over the whole tensor: threefry makes 40 M numbers/s on a 2-core
    AVX2 CPU (Qwen3-4B's 4.0 B weights: 100 s), this counter hash 800 M/s. jax.random still draws each
    parameter's two seeds; an element's value is a hash of its flat index under both, so the values do not depend
    on how the tensor is split across devices. Uniform, not normal: any zero-mean law of the right variance starts
    a random model alike (PyTorch's nn.Linear starts uniform too)."""
    size = math.prod(shape)
    if size >= 2**32:
        raise ValueError(f"a random parameter of shape {shape} has more than 2**32 elements: the hash counter wraps")

    def draw(seeds_2, scale, mean):
        index = jnp.zeros(shape, jnp.uint32)
        stride = 1
        for axis in reversed(range(len(shape))):
            index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride)
            stride *= shape[axis]
        bits = mix32(mix32(index ^ seeds_2[0]) ^ seeds_2[1])
        unit = ((bits >> 8).astype(jnp.float32) + 0.5) * 2.0**-24 - 0.5  # uniform on (-1/2, 1/2): variance 1/12
        return (mean + scale * math.sqrt(12.0) * unit).astype(dtype)

    return jax.jit(draw, out_shardings=sharding)


def randomize(model: nnx.Module, seed: int = 0, std: float | None = None, mesh=None) -> nnx.Module:
    """Fill every weight of `model` (concrete or abstract) with zero-mean noise of standard deviation std (default
    `init_std` of its width) and every norm with 1 + noise of deviation RANDOM_NORM_SPREAD, in place; returns it.
    Tunix zero-initialises the MLP, and a test model with zero MLPs or unit norms would hide bugs.

    Each parameter is drawn by a jitted function (`_random_fn`), laid out by `mesh` as it is made (each device
    draws only its own shard: no host copy of the model, and on a pod no host draws another's part); without a
    mesh, on the default device. One function per parameter shape, not one for the whole model: XLA would hold
    every parameter's temporaries at once (32 GB for Qwen3-4B on a CPU) and compile for minutes. A parameter's
    seeds come from `seed` folded with its index in graph order."""
    std = init_std(_hidden_size(model)) if std is None else float(std)
    shardings = param_shardings(model, mesh) if mesh is not None else {}
    key = jax.random.key(seed)
    index = 0
    for path, param in nnx.iter_graph(model):
        if isinstance(param, nnx.Param):
            value = param.get_value()
            is_norm = "norm" in "/".join(map(str, path))
            scale, mean = (RANDOM_NORM_SPREAD, 1.0) if is_norm else (std, 0.0)
            draw = _random_fn(tuple(value.shape), jnp.dtype(value.dtype), shardings.get(path))
            seeds_2 = jax.random.bits(jax.random.fold_in(key, index), (2,), jnp.uint32)
            param.set_value(draw(seeds_2, scale, mean))
            index += 1
    return model


def random_target(cfg: TargetConfig, *, seed: int = 0, mesh=None) -> nnx.Module:
    """A target of `cfg`'s shape with random weights (`randomize`), built abstract first: Tunix's initialisers would
    compile a few dozen functions and fill the device with values only to be overwritten."""
    return randomize(nnx.eval_shape(lambda: build_target(cfg, seed=seed)), seed=seed, mesh=mesh)


def config_of(model: nnx.Module) -> TargetConfig:
    return model.target_config


@flax.struct.dataclass
class KVCache:
    """Per-layer keys/values for every row, plus each row's committed length.

    Invariant: positions below `lengths[b]` hold the K/V of committed tokens; anything above is stale and is
    never read, because a forward at `start = lengths` overwrites positions start..start+T-1 before any query
    can see them (queries see keys at positions <= their own). Cropping is therefore just lowering `lengths`.
    """

    k: jax.Array  # [L, B, C, G, H]
    v: jax.Array  # [L, B, C, G, H]
    lengths: jax.Array  # [B] int32

    @classmethod
    def init(cls, cfg: TargetConfig, batch: int, capacity: int, dtype=None) -> KVCache:
        shape = (cfg.num_hidden_layers, batch, capacity, cfg.num_key_value_heads, cfg.head_dim)
        dtype = dtype or jnp_dtype(cfg.dtype)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def keep_path(self, start_B, path_BJ) -> KVCache:
        """Move the entries at slots start + path[b, j] to slots start + j (j = 0..J-1), every layer: after a tree
        forward, the accepted path's K/V lands where a sequential forward would have written it. O(L·B·J)."""
        rows_BJ = jnp.broadcast_to(jnp.arange(path_BJ.shape[0], dtype=jnp.int32)[:, None], path_BJ.shape)
        src_BJ = start_B[:, None] + path_BJ
        dst_BJ = start_B[:, None] + jnp.arange(path_BJ.shape[1], dtype=jnp.int32)[None, :]
        move = lambda buf: buf.at[:, rows_BJ, dst_BJ].set(buf[:, rows_BJ, src_BJ], mode="drop")
        return self.replace(k=move(self.k), v=move(self.v))

    def append(self, new_k_LBTGH, new_v_LBTGH) -> KVCache:
        """Write T new positions per row at lengths .. lengths + T - 1 (one in-place scatter over every layer; past
        the capacity dropped) and grow lengths by T: what a forward with the cache does, done after it."""
        b, t = new_k_LBTGH.shape[1:3]
        rows_BT = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, t))
        pos_BT = self.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        put = lambda buf, new: buf.at[:, rows_BT, pos_BT].set(new.astype(buf.dtype), mode="drop")
        return KVCache(put(self.k, new_k_LBTGH), put(self.v, new_v_LBTGH), self.lengths + t)

    def crop(self, lengths) -> KVCache:
        """Roll every row back to `lengths` (scalar or [B]); never grows a row."""
        return self.replace(lengths=jnp.minimum(self.lengths, jnp.asarray(lengths, jnp.int32)))


@dataclasses.dataclass(frozen=True)
class TargetOutput:
    logits: jax.Array | None  # [B, T, V] fp32, or [B, V] when `logits_at` was given
    features: jax.Array | None  # [B, T, len(layer_ids) * D], layer outputs concatenated in layer_ids order
    cache: KVCache | None
    new_kv: tuple[jax.Array, jax.Array] | None = None  # write_cache=False: the T new positions' K, V [L, B, T, G, H]


jax.tree_util.register_dataclass(TargetOutput, data_fields=["logits", "features", "cache", "new_kv"], meta_fields=[])


def is_maxtext(model) -> bool:
    """A MaxText-backed target (dflash_model.maxtext_target.MaxTextTarget): training features only."""
    return getattr(model, "backend", None) == "maxtext"


def embedding_table(model: nnx.Module):
    """The [V, D] input embedding."""
    return model.embedding_table() if is_maxtext(model) else model.embedder.input_embedding[...]


def embed(model: nnx.Module, tokens_BT):
    table = embedding_table(model)
    return jnp.take(table, tokens_BT, axis=0).astype(jnp_dtype(config_of(model).dtype))


def lm_head(model: nnx.Module, hidden_BTD, vocab_ids_U=None):
    """Logits in fp32 from final-normed hidden states (tied models use the embedding table). vocab_ids_U: only
    those tokens' logits, [..., U] in that order (a drafter served with its draft vocabulary)."""
    if config_of(model).tie_word_embeddings:
        # Contract with the [V, D] table as stored, not its transpose: on XLA:CPU the transposed form made a
        # one-token step (plain decoding) copy the whole table every call (docs/results/decoding/README.md).
        table_VD = embedding_table(model)
        if vocab_ids_U is not None:
            table_VD = jnp.take(table_VD, vocab_ids_U, axis=0)
        return jnp.einsum("...D,VD->...V", hidden_BTD, table_VD.astype(hidden_BTD.dtype)).astype(jnp.float32)
    w_DV = lm_head_weight(model)
    if vocab_ids_U is not None:
        w_DV = jnp.take(w_DV, vocab_ids_U, axis=1)
    return jnp.einsum("...D,DV->...V", hidden_BTD, w_DV.astype(hidden_BTD.dtype)).astype(jnp.float32)


def lm_head_weight(model: nnx.Module):
    """The [D, V] output projection (tied models use the embedding table)."""
    if config_of(model).tie_word_embeddings:
        return embedding_table(model).T
    return model.output_weight_DV() if is_maxtext(model) else model.lm_head.w[...]


def final_norm(model: nnx.Module, hidden):
    scale = model.final_norm_scale() if is_maxtext(model) else model.final_norm.w[...]
    return rms_norm(hidden, scale, config_of(model).rms_norm_eps)


def write_rows(stack_LBCGH, layer: int, new_BTGH, pos_BT):
    """Write row b's T new entries at cache positions pos_BT[b] into layer `layer` of a stacked cache buffer.

    One scatter straight into the [L, B, C, G, H] buffer: XLA updates it in place (the decode loop donates the
    cache), so a step costs O(B*T) writes, not a copy of the cache. (A vmapped dynamic_update_slice per row
    followed by `.at[layer].set` compiled to a whole-cache select: SmolLM2 TPOT was 8x higher at context 2048
    than at 256.) Entries past the capacity are dropped, not clamped onto earlier, valid positions.
    """
    b, t = new_BTGH.shape[:2]
    rows_BT = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, t))
    return stack_LBCGH.at[layer, rows_BT, pos_BT].set(new_BTGH.astype(stack_LBCGH.dtype), mode="drop")


def _positions_and_mask(positions_BT, kv_positions, start_B, tree, cached: bool):
    """(rope positions [B, T], attention mask [B, T, S]; True = may attend) of a sequence (causal) or, with a
    cache, of a draft tree's nodes: node t sits at start + depth[t] and sees the cache below start and its
    ancestors (visible[t, m])."""
    if tree is None:
        return positions_BT, kv_positions[None, None, :] <= positions_BT[:, :, None]
    if not cached:
        raise ValueError("a tree forward extends a cache: pass one")
    t = positions_BT.shape[1]
    depth_BT, visible_BTT = tree
    node_S = kv_positions[None, :] - start_B[:, None]  # [B, S]: the node a cache slot holds, if in 0..T-1
    in_tree = (node_S >= 0) & (node_S < t)
    sees_node = jnp.take_along_axis(visible_BTT, jnp.clip(node_S, 0, t - 1)[:, None, :].repeat(t, 1), axis=2)
    return start_B[:, None] + depth_BT, (node_S < 0)[:, None, :] | (in_tree[:, None, :] & sees_node)


@jax.named_scope("target_forward")
def forward(
    model: nnx.Module,
    tokens_BT,
    cache: KVCache | None = None,
    *,
    layer_ids: tuple[int, ...] = (),
    compute_logits: bool = True,
    logits_at=None,
    tree=None,
    write_cache: bool = True,
    attention: str = "einsum",
) -> TargetOutput:
    """One forward over T tokens per row.

    With a cache, row b's tokens sit at positions `cache.lengths[b] + 0..T-1` and attend causally to the
    cache; the returned cache has `lengths += T` (crop it to keep fewer). Without a cache, positions are
    0..T-1 and attention is causal within the tokens. The caller sizes the cache so that
    `lengths + T <= capacity` (entries beyond it are dropped, so those queries would see no own key).

    layer_ids: 0-based decoder layers whose outputs are returned (layer i = HF hidden_states[i + 1]); only
      those are kept. logits_at: optional [B] index into T, to compute logits at one position per row.
    tree: (depth_BT, visible_BTT), with a cache: the T tokens are the nodes of a draft tree (node 0 the root,
      depth 0) instead of a sequence. Node t still writes its K/V at cache slot lengths + t, but sits at position
      lengths + depth[t] and attends to the cache below `lengths` and to the nodes m with visible[t, m] (its
      ancestors and itself).
    write_cache False, with a cache: the cache is only read; the output has no cache but the new positions' K/V
      (`new_kv`), for `KVCache.append` after, e.g. outside a `lax.switch` over forwards (with a tree, K/V in node
      order, each at its node's position).
    attention, without a cache or tree (the training forward and the feature precompute): "einsum" (`layers.attend`,
      fp32 scores, any backend), "xla" or "cudnn": `jax.nn.dot_product_attention` with that implementation, cudnn
      being cuDNN's fused flash attention on NVIDIA GPUs (16-bit inputs), which never writes the [T, T] scores.
    """
    cfg = config_of(model)
    layer_ids = validate_layer_ids(cfg, layer_ids)
    _check_attention(attention, cached=cache is not None or tree is not None)
    if is_maxtext(model):
        return _maxtext_forward(model, tokens_BT, cache, layer_ids, compute_logits, logits_at, tree)
    deferred = cache is not None and not write_cache
    b, t = tokens_BT.shape
    start_B = jnp.zeros((b,), jnp.int32) if cache is None else cache.lengths
    positions_BT = start_B[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # also the cache slots written
    kv_positions = jnp.arange(t if cache is None else cache.capacity, dtype=jnp.int32)
    rope_positions_BT, mask_BTS = _positions_and_mask(positions_BT, kv_positions, start_B, tree, cache is not None)
    if deferred:
        block_mask = jnp.tril(jnp.ones((t, t), bool))[None, None] if tree is None else tree[1][:, None]
    cos, sin = rope_angles(rope_positions_BT, rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))

    eps = cfg.rms_norm_eps
    x = embed(model, tokens_BT)
    cache_k, cache_v = (None, None) if cache is None else (cache.k, cache.v)
    features, new_k, new_v = [], [], []
    wanted = set(layer_ids)
    # Without logits or a cache to fill, the layers above the deepest wanted one change nothing that is returned
    # (SmolLM2's features end at layer 27 of 30): the training forward and the feature precompute skip them.
    depth = len(model.layers) if compute_logits or cache is not None or not layer_ids else max(layer_ids) + 1
    for i, layer in enumerate(model.layers[:depth]):
        with jax.named_scope(f"layer{i}"):
            attn = layer.attn
            h = rms_norm(x, layer.input_layernorm.w[...], eps)
            q = jnp.einsum("BTD,DQH->BTQH", h, attn.q_proj.w[...].astype(h.dtype))
            k = jnp.einsum("BTD,DGH->BTGH", h, attn.k_proj.w[...].astype(h.dtype))
            v = jnp.einsum("BTD,DGH->BTGH", h, attn.v_proj.w[...].astype(h.dtype))
            if cfg.qk_norm:
                q = rms_norm(q, attn.q_norm.w[...], eps)
                k = rms_norm(k, attn.k_norm.w[...], eps)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            if deferred:
                new_k.append(k)
                new_v.append(v)
                # One block of the T new positions: they see the committed cache slots and, causally (a tree: their
                # ancestors), each other.
                cached_B11C = (kv_positions[None, :] < start_B[:, None])[:, None, None, :]
                kc, vc = cache_k[i].astype(q.dtype), cache_v[i].astype(q.dtype)
                o = attend_context_and_blocks(
                    q[:, None], kc, vc, k[:, None].astype(q.dtype), v[:, None].astype(q.dtype), cached_B11C, block_mask
                )[:, 0]
            else:
                if cache is not None:
                    cache_k = write_rows(cache_k, i, k, positions_BT)
                    cache_v = write_rows(cache_v, i, v, positions_BT)
                    k, v = cache_k[i], cache_v[i]
                o = causal_attention(q, k.astype(q.dtype), v.astype(q.dtype), mask_BTS, attention)
            x = x + out_projection(o, attn.o_proj.w[...])
            h = rms_norm(x, layer.post_attention_layernorm.w[...], eps)
            mlp = layer.mlp
            x = x + swiglu(h, mlp.gate_proj.kernel[...], mlp.up_proj.kernel[...], mlp.down_proj.kernel[...])
            x = constrain_batch(x)
        if i in wanted:
            features.append((i, x))

    feats = None
    if layer_ids:
        by_id = dict(features)
        feats = jnp.concatenate([by_id[i] for i in layer_ids], axis=-1)
    logits = _logits(model, x, logits_at) if compute_logits else None
    if deferred:
        return TargetOutput(logits, feats, None, (jnp.stack(new_k), jnp.stack(new_v)))
    new_cache = None
    if cache is not None:
        new_cache = KVCache(cache_k, cache_v, start_B + t)
    return TargetOutput(logits, feats, new_cache)


def _check_attention(attention: str, cached: bool) -> None:
    if attention not in ("einsum", "xla", "cudnn"):
        raise ValueError(f"attention={attention!r}: einsum, xla or cudnn")
    if attention != "einsum" and cached:
        raise ValueError(f"attention={attention!r} serves the cache-less causal forward; decoding uses einsum")


def _logits(model, x_BTD, logits_at):
    """The logits of every position, or of position logits_at[b] of each row b."""
    if logits_at is not None:
        x_BTD = jnp.take_along_axis(x_BTD, jnp.asarray(logits_at, jnp.int32)[:, None, None], axis=1)[:, 0]
    return lm_head(model, final_norm(model, x_BTD))


def causal_attention(q_BTQH, k_BSGH, v_BSGH, mask_BTS, attention: str):
    """The forward's attention: the project's einsum under `mask_BTS`, or (no cache: the mask is causal over the
    row) `jax.nn.dot_product_attention` with its XLA or cuDNN implementation. The library's call is used rather
    than a hand-written kernel so the backend's fused attention serves the training forward where it exists."""
    if attention == "einsum":
        return attend(q_BTQH, k_BSGH, v_BSGH, mask_BTS)
    return jax.nn.dot_product_attention(q_BTQH, k_BSGH, v_BSGH, is_causal=True, implementation=attention)


def _maxtext_forward(model, tokens_BT, cache, layer_ids, compute_logits, logits_at, tree) -> TargetOutput:
    if cache is not None or tree is not None:
        raise ValueError("a MaxText target serves training (features, logits); decoding uses the Tunix target")
    last = config_of(model).num_hidden_layers - 1
    by_id = model.layer_outputs(tokens_BT, (*layer_ids, last) if compute_logits else layer_ids)
    by_id = {i: constrain_batch(x) for i, x in by_id.items()}
    feats = jnp.concatenate([by_id[i] for i in layer_ids], axis=-1) if layer_ids else None
    logits = _logits(model, by_id[last], logits_at) if compute_logits else None
    return TargetOutput(logits, feats, None)


def validate_layer_ids(cfg: TargetConfig, layer_ids) -> tuple[int, ...]:
    ids = tuple(int(i) for i in layer_ids)
    bad = [i for i in ids if not 0 <= i < cfg.num_hidden_layers]
    if bad:
        raise ValueError(f"target_layer_ids {bad} outside the target's 0..{cfg.num_hidden_layers - 1} layers")
    return ids
