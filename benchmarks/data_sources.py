"""Which training data buys the most held-out acceptance per CPU-minute: regenerated replies or target labels?

  .venv/bin/python benchmarks/data_sources.py [--minutes 8] [--out docs/results/data-sources.json] [key=value ...]

Both arms train the same K=16 drafter config (configs/smollm2-135m.yml at --block 16 with the overrides) for the
same total CPU time, data included:
- regenerated: the default run's regenerated replies (the target's own greedy answers to ShareGPT first turns),
  first 80% of them. Their generation cost (measured: tokens / REGEN_TOKENS_PER_S of train.workflow) is taken
  out of this arm's training time.
- target-labelled: ShareGPT conversations past the default run's 216 (data.source=sharegpt, data.labels=target):
  the target's greedy next token at every assistant position of human text, computed in the training step's own
  target forward; no generation, so all of the budget trains.
Both are scored on the last 20% of the regenerated replies (never trained on by either): teacher-forced top-1
accuracy of block positions 1-3 and the simulated tau, on the target's own greedy text: the acceptance a
speculative round would see, position by position.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def heldout_score(trainer, records, anchors_per_row: int = 64) -> dict:
    """Teacher-forced accuracy of positions 1..3 and sim_tau over `records`, every eligible anchor up to
    `anchors_per_row` per row, text labels (on the target's greedy text they are its greedy choices)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from data.pipeline import _PadTo
    from dflash_model.target import forward
    from train.objective import dflash_loss

    prog = trainer.program()
    t = int(trainer.cfg.train.max_len)
    pad = _PadTo(t, 0)
    target = trainer.target

    @jax.jit
    def metrics(params, ids, mask, anchors):
        drafter = nnx.merge(prog.d_graph, params)
        feats = forward(target, ids, layer_ids=prog.layer_ids, compute_logits=False).features
        _, m = dflash_loss(drafter, target, feats, ids, mask, anchors, block_size=prog.block_size, gamma=prog.gamma)
        return m

    correct = np.zeros(prog.block_size - 1)
    count = np.zeros(prog.block_size - 1)
    for i in range(len(records)):
        r = pad.map(dict(records[i]))
        ok = np.flatnonzero(r["loss_mask"][:-1] & r["loss_mask"][1:])
        anchors = np.full((1, anchors_per_row), -1, np.int32)
        take = ok[:: max(1, len(ok) // anchors_per_row)][:anchors_per_row]
        anchors[0, : take.size] = take
        labels_valid = _valid_counts(r["loss_mask"], anchors[0], prog.block_size)
        m = metrics(trainer.state["params"], jnp.asarray(r["input_ids"][None]), jnp.asarray(r["loss_mask"][None]),
                    jnp.asarray(anchors))
        correct += np.asarray(m["acc"]) * labels_valid
        count += labels_valid
    acc = correct / np.maximum(count, 1)
    return {"acc": acc.tolist(), "sim_tau": float(1 + np.sum(np.cumprod(acc))), "labels": int(count.sum())}


def _valid_counts(mask, anchors, k):
    t = mask.size
    out = np.zeros(k - 1)
    for a in anchors[anchors >= 0]:
        for j in range(1, k):
            if a + j < t and mask[a + j]:
                out[j - 1] += 1
    return out


def train_for(cfg_overrides: list[str], seconds: float, heldout, target) -> dict:
    from train.config import load_config
    from train.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config("smollm2-135m", [*cfg_overrides, f"run_dir={tmp}", "export.enabled=false",
                                           "eval.enabled=false", "log.tensorboard=false", "train.steps=100000",
                                           "train.epochs=1000", "checkpoint.every_steps=100000",
                                           "train.schedule=constant", "train.warmup_ratio=0.0005"])
        t0 = time.perf_counter()
        tr = Trainer(cfg, restore=False, target=target)
        while time.perf_counter() - t0 < seconds:
            tr.train(max_steps=5)
        wall = time.perf_counter() - t0
        score = heldout_score(tr, heldout)
        return {"overrides": cfg_overrides, "train_wall_s": wall, "steps": tr.step, **score}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=8.0, help="CPU budget per arm, data included")
    ap.add_argument("--out", default="docs/results/data-sources.json")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)

    from data import pipeline
    from dflash_model.tokenizer import load_tokenizer
    from train.config import load_config
    from train.trainer import load_target_model, resolve_mesh
    from train.workflow import REGEN_TOKENS_PER_S, regenerated_path

    base = load_config("smollm2-135m", [])
    regen = regenerated_path(base.data.regenerate, "smollm2")
    if not regen.exists():
        sys.exit(f"{regen} does not exist: run `bash scripts/main.sh` once (it regenerates the default data)")
    target, tok_path = load_target_model(base, resolve_mesh(base))
    tok = load_tokenizer(tok_path)
    lines = regen.read_text().splitlines()
    cut = int(len(lines) * 0.8)
    tmp = Path(tempfile.mkdtemp())
    (tmp / "train.jsonl").write_text("\n".join(lines[:cut]) + "\n")
    (tmp / "heldout.jsonl").write_text("\n".join(lines[cut:]) + "\n")
    heldout = pipeline.load_tokenized(str(tmp / "heldout.jsonl"), tok, int(base.train.max_len))
    train_records = pipeline.load_tokenized(str(tmp / "train.jsonl"), tok, int(base.train.max_len))
    reply_tokens = int(sum(np.asarray(train_records[i]["loss_mask"]).sum() for i in range(len(train_records))))
    regen_s = reply_tokens / REGEN_TOKENS_PER_S
    budget = 60 * args.minutes
    shared = ["block_size=16", f"data.tokenizer={tok_path}", *args.overrides]
    arms = {
        "regenerated": [f"data.source={tmp / 'train.jsonl'}", *shared],
        "target-labelled": ["data.source=sharegpt", "data.labels=target", "data.skip=216", "data.limit=2000",
                            "train.max_len=512", *shared],
    }
    rows = {}
    for name, over in arms.items():
        secs = budget - regen_s if name == "regenerated" else budget
        print(f"[data] {name}: {secs / 60:.1f} min of training", flush=True)
        rows[name] = {**train_for(over, secs, heldout, target), "data_cost_s": budget - secs}
        r = rows[name]
        print(f"[data]   {r['steps']} steps, held-out acc pos 1/2/3 "
              f"{' / '.join(f'{a:.3f}' for a in r['acc'][:3])}, sim_tau {r['sim_tau']:.3f}", flush=True)
    table = ["| data | generation cost | training | steps | held-out acc pos 1 / 2 / 3 | sim tau |",
             "|---|---:|---:|---:|---|---:|"]
    for name, r in rows.items():
        table.append(f"| {name} | {r['data_cost_s'] / 60:.1f} min | {r['train_wall_s'] / 60:.1f} min | {r['steps']} | "
                     f"{' / '.join(f'{a:.3f}' for a in r['acc'][:3])} | {r['sim_tau']:.3f} |")
    print("\n".join(table))
    rep = {"command": shlex.join(["benchmarks/data_sources.py", *(sys.argv[1:] if argv is None else argv)]),
           "machine": platform.processor() or platform.machine(), "minutes_per_arm": args.minutes,
           "regenerated_reply_tokens": reply_tokens, "regen_tokens_per_s": REGEN_TOKENS_PER_S,
           "heldout_replies": len(heldout), "arms": rows, "table": "\n".join(table)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    # No path of this machine in a committed result: the home directory reads as ~.
    Path(args.out).write_text(json.dumps(rep, indent=1).replace(str(Path.home()), "~"))
    return rep


if __name__ == "__main__":
    main()
