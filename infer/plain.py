"""Plain autoregressive decoding of the target: the lossless reference and the speedup denominator.

The whole generation (prefill + every decode step) is one jitted call with a `lax.while_loop`, so there is no
host round-trip per token. Prompts are right-padded to a length bucket: one compile per (batch, bucket,
max_new_tokens).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dflash_model.target import KVCache, config_of, forward

PROMPT_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096)


def bucket_length(n: int, buckets=PROMPT_BUCKETS) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"prompt of {n} tokens is longer than the largest bucket {buckets[-1]}")


def pad_prompts(prompts: list[list[int]], pad_id: int = 0, buckets=PROMPT_BUCKETS):
    """[B, bucket] int32 right-padded ids and [B] lengths."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    width = bucket_length(max(len(p) for p in prompts), buckets)
    ids = np.full((len(prompts), width), pad_id, np.int32)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = p
    return ids, np.asarray([len(p) for p in prompts], np.int32)


def _stop_mask(tokens, stop_ids):
    stop = jnp.asarray(stop_ids if len(stop_ids) else [-1], jnp.int32)
    return jnp.any(tokens[..., None] == stop, axis=-1)


def prefill(model, ids_BP, lengths_B, capacity: int, layer_ids=()):
    """Prefill right-padded prompts; returns (first greedy token [B], prefill output, cache cropped to lengths)."""
    cache = KVCache.init(config_of(model), ids_BP.shape[0], capacity)
    out = forward(model, ids_BP, cache, layer_ids=layer_ids, logits_at=lengths_B - 1)
    return jnp.argmax(out.logits, axis=-1).astype(jnp.int32), out, out.cache.crop(lengths_B)


# The module itself is the jit argument (NNX modules are pytrees): its GraphDef cannot be a static argument
# because Tunix's ModelConfig, held in it, is unhashable.
@functools.partial(jax.jit, static_argnames=("max_new_tokens", "stop_ids"))
def _greedy(model, ids_BP, lengths_B, *, max_new_tokens: int, stop_ids: tuple[int, ...]):
    b = ids_BP.shape[0]
    capacity = ids_BP.shape[1] + max_new_tokens
    first, _, cache = prefill(model, ids_BP, lengths_B, capacity)
    out = jnp.zeros((b, max_new_tokens), jnp.int32).at[:, 0].set(first)
    done = _stop_mask(first, stop_ids)

    def cond(carry):
        step, _, _, done = carry
        return (step < max_new_tokens) & ~jnp.all(done)

    def body(carry):
        step, cache, out, done = carry
        last = out[:, step - 1]
        res = forward(model, last[:, None], cache)
        nxt = jnp.argmax(res.logits[:, 0], axis=-1).astype(jnp.int32)
        out = out.at[:, step].set(jnp.where(done, 0, nxt))
        cache = res.cache.crop(cache.lengths + jnp.where(done, 0, 1))  # finished rows stay put
        return step + 1, cache, out, done | _stop_mask(nxt, stop_ids)

    steps, _, out, _ = jax.lax.while_loop(cond, body, (jnp.int32(1), cache, out, done))
    return out, steps


def greedy_generate(model, prompts: list[list[int]], max_new_tokens: int, stop_ids=(), pad_id: int = 0):
    """Greedy continuation of each prompt; returns a list of token lists (each cut after its first stop id)."""
    ids, lengths = pad_prompts(prompts, pad_id)
    out, _ = _greedy(
        model,
        jnp.asarray(ids),
        jnp.asarray(lengths),
        max_new_tokens=max_new_tokens,
        stop_ids=tuple(int(s) for s in stop_ids),
    )
    return [truncate_at_stop(row, stop_ids) for row in np.asarray(out).tolist()]


def truncate_at_stop(tokens: list[int], stop_ids) -> list[int]:
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[: i + 1]
    return tokens


def greedy_replies(model, prompts, *, max_new_tokens: int, stop_ids, batch_size: int, bar=None) -> list[list[int]]:
    """Each prompt's plain greedy reply (`greedy_generate`), cut after a stop token and at the budget;
    prompts batched by length bucket, a short last batch filled with copies of its first prompt (one shape, one
    compile per bucket; the copies' replies are dropped)."""
    replies: list[list[int] | None] = [None] * len(prompts)
    buckets: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        buckets.setdefault(bucket_length(len(p)), []).append(i)
    for idx in buckets.values():
        size = min(batch_size, len(idx))
        for start in range(0, len(idx), size):
            chunk = idx[start : start + size]
            rows = [prompts[i] for i in chunk]
            out = greedy_generate(model, rows + [rows[0]] * (size - len(rows)), max_new_tokens, stop_ids)
            for i, reply in zip(chunk, out):
                replies[i] = reply
            if bar is not None:
                bar.update(len(chunk))
    return replies
