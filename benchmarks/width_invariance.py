"""Does a verify of W tokens give each token the logits that one-token steps give it? Greedy speculative decoding is
lossless only where the target's argmax at a position does not depend on how many tokens the forward carried.

  .venv/bin/python benchmarks/width_invariance.py [--target smollm2] [--dtype float32|bfloat16] [--context 40]
      [--widths 2,4,8,12] [--out docs/results/decoding/width-invariance-DTYPE.json]

After a prefill of `--context` random tokens, the same next tokens go through the target three ways:
  * one forward of W tokens (a verify of width W), for each W in --widths;
  * W one-token steps (plain decoding);
  * W two-token steps, each padded with token 0 and the cache cropped back by one (a plain step of width 2).
It prints, for each pair, the largest logit difference and whether every position's argmax agrees.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--context", type=int, default=40)
    ap.add_argument("--widths", default="2,4,8,12")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from dflash_model.target import KVCache, forward
    from infer.target_spec import load_target_spec

    target = load_target_spec(args.target, args.dtype)
    widths = [int(w) for w in args.widths.split(",")]
    n, p = max(widths), args.context
    rng = np.random.default_rng(args.seed)
    tokens = jnp.asarray(rng.integers(100, min(20000, target.config.vocab_size), (1, p + n)), jnp.int32)
    graph, weights = nnx.split(target.model)  # weights as arguments, not constants folded into each program
    forward_jit = jax.jit(lambda w, toks, cache: forward(nnx.merge(graph, w), toks, cache))
    step = lambda toks, cache: forward_jit(weights, toks, cache)
    prefilled = step(tokens[:, :p], KVCache.init(target.config, 1, p + n + 2)).cache

    verify = {w: np.asarray(step(tokens[:, p : p + w], prefilled).logits[0]) for w in widths}
    stepped = {}
    for width in (1, 2):
        cache, rows = prefilled, []
        for j in range(n):
            toks = tokens[:, p + j : p + j + 1]
            if width == 2:
                toks = jnp.concatenate([toks, jnp.zeros((1, 1), jnp.int32)], axis=1)
            out = step(toks, cache)
            rows.append(np.asarray(out.logits[0, 0]))
            cache = out.cache.crop(p + j + 1)
        stepped[f"steps of width {width}"] = np.stack(rows)
    for w in widths:
        stepped[f"verify of width {w}"] = verify[w]

    names = list(stepped)
    rows = []
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            m = min(len(stepped[a]), len(stepped[b]))
            la, lb = stepped[a][:m], stepped[b][:m]
            rows.append(
                dict(
                    a=a,
                    b=b,
                    positions=m,
                    max_logit_diff=float(np.abs(la - lb).max()),
                    argmax_equal=bool((la.argmax(-1) == lb.argmax(-1)).all()),
                )
            )
    print(f"{args.target}, {args.dtype}, context {p}: logits of the same positions computed two ways")
    print("| a | b | positions | max logit difference | argmax equal |\n|---|---|---:|---:|---|")
    for r in rows:
        print(f"| {r['a']} | {r['b']} | {r['positions']} | {r['max_logit_diff']:.3g} | {r['argmax_equal']} |")
    if args.out:
        cmd = "python " + " ".join(shlex.quote(a) for a in sys.argv)
        meta = dict(command=cmd, target=args.target, dtype=args.dtype, context=p, machine=platform.machine())
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(dict(meta, rows=rows), indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
