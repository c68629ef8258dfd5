"""The target's one-token step with the attention output projection as one einsum over (heads, head_dim), as it was
written before, against `layers.out_projection` (one matmul over the flattened heads), timed alternately in one
process so that the machine's drift hits both alike.

  .venv/bin/python benchmarks/out_projection_ab.py [--width 1] [--rounds 8] [--reps 20] [--out FILE.json]

Each round times `--reps` steps of each variant in a jitted loop (cache carried, 256 tokens of context) and
reports the median over rounds of each and of their ratio.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import dflash_model.target as target_module
    from dflash_model.target import KVCache, forward
    from infer.target_spec import load_target_spec

    target = load_target_spec("smollm2", "float32")
    graph, weights = nnx.split(target.model)
    context = 256
    tokens = jnp.asarray(np.random.default_rng(0).integers(100, 20000, (1, context)), jnp.int32)
    prefill = jax.jit(lambda w, t, c: forward(nnx.merge(graph, w), t, c).cache)
    cache = prefill(weights, tokens, KVCache.init(target.config, 1, context + 256 + 16))
    block = tokens[:, : args.width]

    def one_einsum(o, w):  # the formulation before out_projection
        return jnp.einsum("BTQH,QHD->BTD", o, w.astype(o.dtype))

    def make_loop():
        @jax.jit
        def loop(w, cache, x):
            def body(i, carry):
                c, acc = carry
                out = forward(nnx.merge(graph, w), x + i, c)
                return out.cache.crop(context), acc + jnp.sum(jnp.argmax(out.logits, -1))

            return jax.lax.fori_loop(0, args.reps, body, (cache, jnp.int32(0)))[1]

        return loop

    loops = {}
    current = target_module.out_projection
    for name, fn in (("einsum over (heads, head_dim)", one_einsum), ("out_projection", current)):
        target_module.out_projection = fn  # read by forward at trace time
        loops[name] = make_loop()
        loops[name](weights, cache, block).block_until_ready()  # compile with this variant
    target_module.out_projection = current

    times = {name: [] for name in loops}
    for _ in range(args.rounds):
        for name, loop in loops.items():
            t = time.perf_counter()
            loop(weights, cache, block).block_until_ready()
            times[name].append(1e3 * (time.perf_counter() - t) / args.reps)
    old, new = (np.asarray(times[n]) for n in loops)
    rows = {n: float(np.median(v)) for n, v in times.items()}
    ratio = float(np.median(old / new))
    print(f"SmolLM2 target step of width {args.width}, context {context}, {args.rounds} alternating rounds:")
    for name, ms in rows.items():
        print(f"  {name}: {ms:.1f} ms (rounds {min(times[name]):.1f}-{max(times[name]):.1f})")
    print(f"  before / after, median over rounds: {ratio:.2f}x")
    if args.out:
        cmd = "python " + " ".join(shlex.quote(a) for a in sys.argv)
        meta = dict(command=cmd, width=args.width, context=context, machine=platform.machine())
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(dict(meta, ms=rows, per_round=times, ratio=ratio), indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
