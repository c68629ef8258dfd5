"""The training step at the Qwen3-8B shape on an accelerator, with where its time goes: one prepared job.

  .venv/bin/python benchmarks/accelerator_step.py [--cells 16x512 64x128] [--attention einsum cudnn]
      [--steps 8] [--out runs/accelerator_step.json]
  .venv/bin/python benchmarks/accelerator_step.py --reduced      # the same job at a CPU-sized shape (a dry run)

Each cell (K x anchors per row) trains `--steps` steps of `--config qwen3-8b` on a random target (built on the
device, `target.path=null`), bf16, batch 1, rows of 2,048 synthetic tokens, once per attention kernel of the
target forward (`target.attention`: the project's einsum, cuDNN's flash kernel on an NVIDIA GPU, jax.nn's XLA
path elsewhere), and reports what benchmarks/train_throughput.py reports for a variant: the median step after the
ones that compiled, blocks/s, and each phase timed alone (target forward, drafter forward and backward, the fused
cross-entropy, the optimizer) with its matmul FLOPs over the time it takes, against this device's measured rate for
one matmul of that phase's shape. The step's share of the device's matmul limit is the number to compare with the
PyTorch reference trainer's on the same chip (its own benchmark; no third-party code runs here).

`--reduced` keeps Qwen3's layout at a CPU's size (2 target layers of width 256, an 8,192-token vocabulary, a 1-layer
drafter reading both), rows of 256 tokens and a thirty-second of the anchors: the whole job in a few minutes on a
CPU, to check it runs before an accelerator's time is spent on it (at Qwen3-8B's own width and vocabulary the CPU
run took more than 10 minutes and 17 GB). Its numbers are a CPU's, not a projection of anything.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # train_throughput, a sibling script
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dflash_model.files import atomic_write_text, check_out_file  # noqa: E402

FULL = ["train.max_len=2048", "data.num_records=64"]
REDUCED = [  # Qwen3's layout at a CPU's size: what is checked is that the job runs, not its numbers
    "train.max_len=256",
    "data.num_records=16",
    "target.arch={num_hidden_layers: 2, hidden_size: 256, intermediate_size: 768, num_attention_heads: 4,"
    " num_key_value_heads: 2, head_dim: 64, vocab_size: 8192}",
    "drafter.preset=null",
    "drafter.num_layers=1",
    "drafter.n_features=2",
    "drafter.target_layer_ids=[0,1]",
    "drafter.mask_token_id=8191",
]
SHARED = [
    "target.path=null",
    "target.dtype=bfloat16",
    "train.compute_dtype=bfloat16",
    "data.source=synthetic",
    "train.batch_size=1",
    "mesh.data=1",
    "mesh.fsdp=-1",
    "mesh.tensor=1",
]


def parse_cell(spec: str) -> tuple[int, int]:
    try:
        k, a = (int(x) for x in spec.split("x"))
    except ValueError:
        raise ValueError(f"cell {spec!r}: write KxANCHORS, e.g. 16x512") from None
    if k < 2 or a < 1:
        raise ValueError(f"cell {spec!r}: K >= 2 and anchors >= 1")
    return k, a


def attention_kinds(asked: list[str], backend: str) -> list[str]:
    """cuDNN's kernel exists only on NVIDIA GPUs: elsewhere the same library call runs its XLA implementation."""
    return list(dict.fromkeys(("xla" if a == "cudnn" and backend != "gpu" else a) for a in asked))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="qwen3-8b")
    ap.add_argument("--cells", nargs="+", default=["16x512", "64x128"], help="KxANCHORS (default 16x512 64x128)")
    ap.add_argument("--attention", nargs="+", default=["einsum", "cudnn"], choices=["einsum", "xla", "cudnn"])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--reduced", action="store_true", help="a CPU-sized Qwen3, 256-token rows, anchors / 32: a dry run")
    ap.add_argument("--out", default="runs/accelerator_step.json")
    args = ap.parse_args(argv)
    check_out_file(args.out, "--out")
    if args.steps < 2:
        ap.error(f"--steps must be at least 2 (the first compiles), got {args.steps}")
    try:
        cells = [parse_cell(c) for c in args.cells]
    except ValueError as e:
        ap.error(str(e))

    import jax
    from train_throughput import format_tables, fractions, measure

    from train.assembly import load_target_model, resolve_mesh
    from train.config import load_config

    backend = jax.default_backend()
    kinds = attention_kinds(args.attention, backend)
    shape = REDUCED if args.reduced else FULL
    rows, target = [], None
    for k, a in cells:
        anchors = max(1, a // 32) if args.reduced else a
        for kind in kinds:
            over = [*SHARED, *shape, f"block_size={k}", f"num_anchors={anchors}", f"target.attention={kind}"]
            if target is None:  # one random target serves every cell: the attention kind is the step's, not its
                cfg = load_config(args.config, over)
                target, _ = load_target_model(cfg, resolve_mesh(cfg.mesh))
            print(f"[accelerator-step] K={k} x {anchors} anchors, attention {kind}", flush=True)
            r = {"variant": kind, **measure(args.config, over, args.steps, target=target)}
            rows.append({**r, "anchors": anchors, "fraction_of_limit": fractions(r)})
            print(f"[accelerator-step]   {r['step_s']:.4f} s/step, {r['blocks_per_s']:.1f} blocks/s", flush=True)
    table = format_tables(rows, baseline="einsum")
    device = f"{jax.devices()[0].device_kind} ({backend}, {jax.device_count()} device(s))"
    print(f"\n{args.config}{' reduced' if args.reduced else ''} on {device}\n{table}")
    rep = {
        "command": shlex.join(["benchmarks/accelerator_step.py", *(sys.argv[1:] if argv is None else argv)]),
        "config": args.config,
        "reduced": args.reduced,
        "device": device,
        "host": platform.processor() or platform.machine(),
        "rows": rows,
        "table": table,
    }
    atomic_write_text(args.out, json.dumps(rep, indent=1))
    return rep


if __name__ == "__main__":
    from dflash_model.cli import run_main

    run_main(main)
