"""Cost of one target verify forward against the block size K: is verifying K=128 drafts much dearer than K=16?

  .venv/bin/python benchmarks/verify_cost.py [--preset tiny|smollm2-135m|qwen3-4b|...] [--random]
      [--ks 1,16,32,64,128,256] [--contexts 128,1024,4096] [--reps 20] [--out runs/verify_cost.json]

One verify = the engine's call: K block tokens for one row, from a KV cache already holding `context` positions,
returning fp32 logits for all K positions and the cache with the K new entries, rolled back to `context`
(donated, as in the decode loop). Each point is timed two ways, after a compile run:
  * block_until_ready on the outputs: the real device time;
  * jax.effects_barrier(): it waits only for side effects, NOT for a pure computation, so it measures dispatch.
    (A "verify cost is flat up to K=1024" claim was once timed this way.)
With --target (smollm2, an HF directory or a .gguf) the real model is timed the way the decode loop runs it
instead: `Engine.calibrate` at each context, every width in one jitted fori_loop with the cache carried in place
(no per-call dispatch or cache copy; what an adaptive engine chooses from). Context c = a prompt of c tokens,
decoding --max-new-tokens after it (the cache's capacity, which attention spans, is c + max_new + max K).
Presets other than `tiny` need --random: their weights are random (`dflash_model.target.random_target`, drawn on
the device in seconds; values do not change dense compute time), in the preset's dtype (bf16 for the Qwen3 and
Llama presets).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from dflash_model.config import PRESETS, TINY_PRESETS, TargetConfig
from dflash_model.files import check_out_file
from dflash_model.target import KVCache, config_of, forward, random_target

# The test suite's tiny Qwen3 shape: dispatch and per-op overheads dominate, the opposite extreme of a real model.
TINY = TINY_PRESETS["qwen3"]


def _verify(model, block_BK, cache: KVCache, context_B):
    out = forward(model, block_BK, cache)
    return out.logits, out.cache.crop(context_B)


verify = jax.jit(_verify, donate_argnames=("cache",))


def time_point(model, cfg: TargetConfig, k: int, context: int, reps: int, batch: int = 1) -> dict:
    capacity = context + k
    cache = KVCache.init(cfg, batch, capacity)
    context_B = jnp.full((batch,), context, jnp.int32)
    cache = cache.replace(lengths=jnp.full((batch,), context, jnp.int32))  # its own buffer: the cache is donated
    block = jax.random.randint(jax.random.key(k), (batch, k), 0, cfg.vocab_size, jnp.int32)
    logits, cache = verify(model, block, cache, context_B)  # compile
    jax.block_until_ready((logits, cache))

    synced, barrier = [], []
    for _ in range(reps):
        t = time.perf_counter()
        logits, cache = verify(model, block, cache, context_B)
        jax.block_until_ready((logits, cache))
        synced.append(time.perf_counter() - t)
    for _ in range(reps):
        t = time.perf_counter()
        logits, cache = verify(model, block, cache, context_B)
        jax.effects_barrier()
        barrier.append(time.perf_counter() - t)
        jax.block_until_ready((logits, cache))  # outside the timed region: do not queue work behind the next call
    return {
        "k": k,
        "context": context,
        "batch": batch,
        "ms_block_until_ready": 1e3 * statistics.median(synced),
        "ms_effects_barrier": 1e3 * statistics.median(barrier),
    }


def in_loop_points(target_model, ks: list[int], contexts: list[int], reps: int, max_new: int) -> list[dict]:
    """ms of a verify forward at each K inside the decode loop (`Engine.calibrate`), at each context."""
    import numpy as np

    from infer.engine import Engine
    from infer.proposers import NGramProposer

    widths = sorted(set(ks))
    engine = Engine(
        target_model,
        NGramProposer(),
        block_size=max(max(widths), 2),
        max_new_tokens=max_new,
        adaptive=True,
        widths=tuple(widths) if len(widths) > 1 else (1, widths[0]),
    )
    points = []
    for c in contexts:
        prompt = np.random.default_rng(c).integers(0, config_of(target_model).vocab_size, size=c).tolist()
        costs = engine.calibrate(*engine.inputs([prompt]), reps=reps)
        for k, ms in zip(costs["widths"], costs["verify_ms_measured"]):
            if k in widths:
                points.append({"k": k, "context": c, "batch": 1, "ms_in_loop": ms})
        print(f"context {c}: " + ", ".join(f"K={p['k']} {p['ms_in_loop']:.1f} ms" for p in points[-len(widths) :]))
    return points


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", help=f"tiny or one of {sorted(PRESETS)}")
    ap.add_argument("--random", action="store_true", help="random weights for a real-size preset")
    ap.add_argument("--target", help="time a real target inside the decode loop: smollm2, an HF directory or a .gguf")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="with --target: the decode length after c")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    ap.add_argument("--ks", default="1,16,32,64,128,256")
    ap.add_argument("--contexts", default="128,1024,4096")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="runs/verify_cost.json")
    args = ap.parse_args(argv)
    check_out_file(args.out, "--out")
    if args.preset != "tiny" and not args.random and not args.target:
        ap.error("real-size presets run with random weights only: pass --random")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.target:
        return main_in_loop(args)
    cfg = TINY if args.preset == "tiny" else PRESETS[args.preset]
    if args.dtype:
        cfg = cfg.replace(dtype=args.dtype)
    model = random_target(cfg, seed=0)
    ks = [int(x) for x in args.ks.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    points = [time_point(model, cfg, k, c, args.reps, args.batch) for c in contexts for k in ks]

    print(f"verify forward, preset={args.preset} dtype={cfg.dtype} batch={args.batch} on {jax.devices()[0]}")
    print("| context | K | ms (block_until_ready) | ms / K | ms (effects_barrier: dispatch only) |")
    print("|---:|---:|---:|---:|---:|")
    for p in points:
        print(
            f"| {p['context']} | {p['k']} | {p['ms_block_until_ready']:.3f} | "
            f"{p['ms_block_until_ready'] / p['k']:.4f} | {p['ms_effects_barrier']:.3f} |"
        )
    ratios = {}
    for c in contexts:
        by_k = {p["k"]: p for p in points if p["context"] == c}
        if 16 in by_k and 128 in by_k:
            ratios[c] = {m: by_k[128][m] / by_k[16][m] for m in ("ms_block_until_ready", "ms_effects_barrier")}
            print(
                f"context {c}: K=128 / K=16 = {ratios[c]['ms_block_until_ready']:.2f}x (block_until_ready), "
                f"{ratios[c]['ms_effects_barrier']:.2f}x (effects_barrier)"
            )
    result = {
        "preset": args.preset,
        "dtype": cfg.dtype,
        "batch": args.batch,
        "reps": args.reps,
        "device": str(jax.devices()[0]),
        "machine": platform.processor() or platform.machine(),
        "points": points,
        "ratio_k128_over_k16": {str(c): r for c, r in ratios.items()},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return result


def main_in_loop(args) -> dict:
    from infer.target_spec import load_target_spec

    target = load_target_spec(args.target, args.dtype)
    ks = [int(x) for x in args.ks.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    points = in_loop_points(target.model, ks, contexts, args.reps, args.max_new_tokens)
    print(f"verify forward inside the decode loop, target={args.target} dtype={target.config.dtype} batch 1")
    print(
        "| K | "
        + " | ".join(f"ms, context {c}" for c in contexts)
        + " | "
        + " | ".join(f"x K=1, context {c}" for c in contexts)
        + " |"
    )
    print("|---:|" + "---:|" * (2 * len(contexts)))
    by = {(p["context"], p["k"]): p["ms_in_loop"] for p in points}
    for k in sorted(set(ks)):
        ms = [by[(c, k)] for c in contexts]
        rel = [by[(c, k)] / by[(c, min(ks))] for c in contexts]
        print(f"| {k} | " + " | ".join(f"{m:.1f}" for m in ms) + " | " + " | ".join(f"{r:.2f}" for r in rel) + " |")
    result = {
        "command": "python benchmarks/verify_cost.py " + " ".join(sys.argv[1:]),
        "target": args.target,
        "dtype": target.config.dtype,
        "max_new_tokens": args.max_new_tokens,
        "reps": args.reps,
        "timing": "Engine.calibrate: each width repeated inside one jitted fori_loop, (t(1+reps) - t(1)) / reps, "
        "fastest of 3, block_until_ready",
        "device": str(jax.devices()[0]),
        "machine": platform.processor() or platform.machine(),
        "points": points,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    from dflash_model.cli import run_main

    run_main(main)
