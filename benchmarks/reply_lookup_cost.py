"""What reply lookup costs inside a round: `infer.replies.continue_rows` (drafting `steps` tokens from a reply file's
index) timed alone in a jitted loop, at the widths a decode uses.

  .venv/bin/python benchmarks/reply_lookup_cost.py [--replies drafters/smollm2-135m-replies/replies.npz] \
      [--steps 7,15] [--batch 1] [--out docs/results/decoding/replies/lookup-cost.json]

The histories are windows of the stored replies themselves, so most lookups hit at the longest order, as they do
in a decode's repetitive stretches. Each call repeats the same history but its last token, so the binary searches
mostly walk cached paths: a lower bound on what a decode's lookups cost.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from infer.engine import _loop_ms
from infer.replies import continue_rows, load_index


def lookup_ms(index, history_BC, n_B, steps: int, reps: int = 200) -> float:
    """ms per continue_rows call: `reps` calls in one jitted loop, each on a history whose last token is the
    previous call's last draft (a dependency chain: nothing can be hoisted out of the loop or run ahead)."""

    @jax.jit
    def run(index, history_BC, n_B, r):
        def body(i, acc_B):
            hist = jax.vmap(lambda h, n, t: h.at[n - 1].set(t))(history_BC, n_B, acc_B)
            tokens, _, _ = continue_rows(index, hist, n_B, steps)
            return tokens[:, -1]

        return jax.lax.fori_loop(0, r, body, jnp.zeros(n_B.shape, jnp.int32))

    return _loop_ms(lambda r: run(index, history_BC, n_B, r), reps)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replies", default="drafters/smollm2-135m-replies/replies.npz")
    ap.add_argument("--steps", default="7,15", help="drafts per round (K-1), comma-separated")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    stored = np.load(Path(args.replies).expanduser())
    index = load_index(args.replies, int(stored["vocab_size"]))
    ids = stored["input_ids"]
    rng = np.random.default_rng(0)
    starts = rng.integers(0, len(ids) - 64, args.batch)
    history = jnp.asarray(np.stack([ids[s : s + 64] for s in starts]), jnp.int32)
    n = jnp.full((args.batch,), 48, jnp.int32)
    rows = []
    for steps in [int(s) for s in args.steps.split(",")]:
        ms = lookup_ms(index, history, n, steps)
        rows.append({"steps": steps, "batch": args.batch, "ms": ms})
        print(f"| {steps} drafts | batch {args.batch} | {ms:.3f} ms |", flush=True)
    rep = {
        "command": " ".join(["python benchmarks/reply_lookup_cost.py", *map(shlex.quote, sys.argv[1:])]),
        "index_entries": int(index.keys_A.shape[0]),
        "machine": f"{platform.machine()}, {jax.devices()[0].platform}, {jax.device_count()} device(s)",
        "rows": rows,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rep, indent=1) + "\n")
    return rep


if __name__ == "__main__":
    main()
