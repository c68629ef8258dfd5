"""Target step with the committed KV cache layout against the patched kv-head-major one, alternating rounds in one
process: python docs/results/decoding/kv-head-major/ab.py WIDTH (after the set-up in README.md)."""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, "kvpkg")  # the patched copy, made as in README.md
import dflash_model_kv.target as B
from flax import nnx

import dflash_model.target as A
from infer.target_spec import load_target_spec

W = int(sys.argv[1])
reps = 20
rounds = 8
context = 256
t = load_target_spec("smollm2", "float32")
graph, weights = nnx.split(t.model)
toks = jnp.asarray(np.random.default_rng(0).integers(100, 20000, (1, context)), jnp.int32)
loops = {}
for name, mod in (("positions-major cache", A), ("kv-head-major cache", B)):
    pre = jax.jit(lambda w, tk, c, mod=mod: mod.forward(nnx.merge(graph, w), tk, c).cache)
    cache = pre(weights, toks, mod.KVCache.init(t.config, 1, context + 256 + 16))

    @jax.jit
    def loop(w, cache, x, mod=mod):
        def body(i, carry):
            c, acc = carry
            out = mod.forward(nnx.merge(graph, w), x + i, c)
            return out.cache.crop(context), acc + jnp.sum(jnp.argmax(out.logits, -1))

        return jax.lax.fori_loop(0, reps, body, (cache, jnp.int32(0)))[1]

    x = toks[:, :W]
    loop(weights, cache, x).block_until_ready()
    loops[name] = (loop, cache, x)
times = {n: [] for n in loops}
for _ in range(rounds):
    for n, (loop, cache, x) in loops.items():
        t0 = time.perf_counter()
        loop(weights, cache, x).block_until_ready()
        times[n].append(1e3 * (time.perf_counter() - t0) / reps)
a, b = (np.asarray(v) for v in times.values())
for n, v in times.items():
    print(W, n, f"{np.median(v):.1f} ms ({min(v):.1f}-{max(v):.1f})")
print(W, f"committed / patch, median ratio {np.median(a / b):.3f}")
