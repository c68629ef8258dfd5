"""Regeneration in bfloat16 against float32: replies/s, and how often the float32 target would have chosen the
bfloat16 replies' tokens itself.

  python benchmarks/regen_dtype.py --input PROMPTS.jsonl [--prompts 64] [--max-new-tokens 128] \
      [--xla-flags '--xla_cpu_use_onednn=true --xla_cpu_experimental_onednn_custom_call=true'] [--out FILE.json]

Both dtypes generate greedy replies to the same batch (the first --prompts conversations whose prompt fits 256
tokens, one padded batch, timed on a second call after a compiling one). Then each float32 and bfloat16 target
reads every bfloat16 reply teacher-forced (prompt + reply in one forward) and the share of reply positions where
its argmax is the reply's token is counted: the float32 share says whether bfloat16 replies are the float32
target's own greedy tokens (what DFlash trains on); the bfloat16 share, the same model's incremental decode against
its own full-sequence forward, is the floor rounding alone sets. XLA reads its flags once per process, so both
dtypes run under the same --xla-flags.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dflash_model.cli import add_xla_flags  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", required=True, help="conversation JSONL (the first user turn is the prompt)")
    ap.add_argument("--prompts", type=int, default=64, help="conversations read (those with a fitting prompt run)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--xla-flags", default="")
    ap.add_argument("--out", default=None, help="JSON to write")
    args = ap.parse_args()
    add_xla_flags(args.xla_flags)

    import jax.numpy as jnp
    import numpy as np

    from data.conversations import load_conversations
    from dflash_model.target import forward
    from dflash_model.tokenizer import stop_token_ids
    from infer.plain import greedy_generate
    from train.regenerate import load, plan

    convs, _ = load_conversations(args.input, limit=args.prompts, require_assistant=False)
    models = {dt: load("smollm2", dt) for dt in ("float32", "bfloat16")}
    tok = models["float32"][1]
    prompts = [ids for _, _, ids in plan(convs, tok, 256)[0]]
    stops = tuple(stop_token_ids(tok))
    pad = tok.pad_token_id or 0  # as train.regenerate pads
    rows, replies = {}, {}
    for dt, (model, _) in models.items():
        greedy_generate(model, prompts, args.max_new_tokens, stop_ids=stops, pad_id=pad)  # compile
        t0 = time.perf_counter()
        replies[dt] = greedy_generate(model, prompts, args.max_new_tokens, stop_ids=stops, pad_id=pad)
        secs = time.perf_counter() - t0
        tokens = sum(map(len, replies[dt]))
        rows[dt] = {"seconds": round(secs, 2), "new_tokens": tokens, "tokens_per_s": round(tokens / secs, 1)}
    for dt, (model, _) in models.items():
        same = total = 0
        for p, r in zip(prompts, replies["bfloat16"]):
            logits = np.asarray(forward(model, jnp.asarray([p + r])).logits[0], np.float32)
            same += int((logits[len(p) - 1 : len(p) + len(r) - 1].argmax(-1) == np.asarray(r)).sum())
            total += len(r)
        rows[dt]["argmax_equals_bf16_reply"] = round(same / total, 4)
    speedup = rows["bfloat16"]["tokens_per_s"] / rows["float32"]["tokens_per_s"]
    print(f"{len(prompts)} prompts, {args.max_new_tokens} new tokens, XLA_FLAGS extra: {args.xla_flags or '-'}")
    print("| dtype | s | new tokens | tokens/s | its argmax = bf16 reply token |")
    print("|---|---:|---:|---:|---:|")
    for dt, r in rows.items():
        print(f"| {dt} | {r['seconds']} | {r['new_tokens']} | {r['tokens_per_s']} | {r['argmax_equals_bf16_reply']} |")
    print(f"bfloat16 / float32 tokens/s: {speedup:.2f}x")
    if args.out:
        result = {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "xla_flags": args.xla_flags}
        Path(args.out).write_text(json.dumps({**result, "rows": rows, "speedup": round(speedup, 2)}, indent=1) + "\n")


if __name__ == "__main__":
    main()
