"""Training throughput, the yardstick: blocks/s, trained labels/s and where a step's time goes, for named variants
of a config side by side in one process on the same machine.

  .venv/bin/python benchmarks/train_throughput.py --data PATH [--config smollm2-135m] [--blocks 64 16]
      [--variants baseline bf16 ...] [--steps 8] [--out docs/results/throughput/NAME.json] [key=value ...]
  .venv/bin/python benchmarks/train_throughput.py --compare BEFORE.json AFTER.json   # two checkouts, step for step

`--data` is a conversation JSONL (the default run's regenerated replies work: ~/.cache/dflash-jax/regenerated/...)
or "sharegpt". Each variant is a set of config overrides (VARIANTS below; `baseline` is the config as it is) on
top of the shared overrides. Per variant and block size it trains `--steps` steps in a scratch directory and
reports the median step after the first (which compiles), and times each phase of one step alone, jitted the same
way: the target forward (features, plus logits with data.labels=target), the drafter's forward and backward
without the cross-entropy, the cross-entropy through the lm_head (forward and backward), the optimizer update, and
the host side (next batch from the grain iterator, offline features read, device put). Phases are timed apart, so
their sum differs from the step a little (XLA fuses across them in the real step).

Against the machine: each phase's matmul FLOPs (train.plan.model_flops, as the step computes them) over its time
is set against this machine's measured rate for one matmul of that phase's dominant shape and dtype (a
microbenchmark in the same process: the target's MLP over the row, the drafter's MLP over the block positions, a
cross-entropy chunk against the lm_head), giving the share of the matmul limit each phase reaches; the step's share
is its FLOPs over the time the three phases would take at those rates, over the measured step.

Counts: a block is one anchor (K positions); a trained label is a label with nonzero loss weight (valid, inside
loss_positions, inside the draft vocabulary). Offline features are precomputed once (the time is reported as
`precompute_s`, one target forward per record) and then read back every epoch.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

from dflash_model.files import atomic_write_text, check_out_file

# Each lever alone, then the combination the SmolLM2 config uses. Overrides are applied after the shared ones.
VARIANTS = {
    "baseline": [],
    "bf16": ["train.compute_dtype=bfloat16", "target.dtype=bfloat16"],
    "anchors": ["num_anchors=64"],
    "vocab": ["draft_vocab=4096"],
    "offline": ["features.mode=offline"],
    "pos8": ["loss_positions=8"],
    "1layer": ["drafter.num_layers=1"],
    "fast": ["num_anchors=64", "draft_vocab=4096", "features.mode=offline"],
    "fast-1layer": ["num_anchors=64", "draft_vocab=4096", "features.mode=offline", "drafter.num_layers=1"],
    "fast-bf16": ["num_anchors=64", "draft_vocab=4096", "features.mode=offline", "train.compute_dtype=bfloat16"],
}


def _time(fn, *args, repeats: int = 3) -> float:
    import jax

    jax.block_until_ready(fn(*args))  # compile
    t0 = time.perf_counter()
    for _ in range(repeats):
        jax.block_until_ready(fn(*args))
    return (time.perf_counter() - t0) / repeats


def matmul_rate(m: int, k: int, n: int, dtype: str, repeats: int = 5) -> float:
    """FLOP/s of one jitted [m, k] x [k, n] matmul in `dtype` (fp32 accumulation), the best of `repeats`: this
    machine's matmul limit at a phase's own shapes, through the same XLA kernels the step uses."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((m, k), dtype)
    w = jnp.ones((k, n), dtype)
    f = jax.jit(lambda x, w: jnp.einsum("mk,kn->mn", x, w, preferred_element_type=jnp.float32))
    jax.block_until_ready(f(x, w))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x, w))
        best = min(best, time.perf_counter() - t0)
    return 2.0 * m * k * n / best


def limits(trainer, batch: dict, slots: int) -> dict:
    """Matmul FLOPs of each phase (train.plan.model_flops, as the step computes them) and this machine's matmul
    rate at each phase's dominant shape and dtype: the target's MLP over the row's tokens, the drafter's MLP over
    the block positions, one cross-entropy chunk against the lm_head rows."""
    from train.plan import model_flops

    prog = trainer.program()
    b, t = batch["input_ids"].shape
    n = batch["anchors"].shape[1]
    tcfg, dcfg = trainer.run.target_cfg, trainer.run.drafter_cfg
    vocab = tcfg.vocab_size if trainer.run.vocab_ids is None else int(trainer.run.vocab_ids.shape[0])
    online = "features" not in batch
    flops = model_flops(
        tcfg,
        dcfg,
        batch=b,
        length=t,
        anchors=n,
        block=prog.block_size,
        online=online,
        labels=prog.target_labels,
        vocab=vocab,
        labelled_slots=slots - 1,
    )
    rows = b * n * (slots - 1)
    dt = prog.compute_dtype
    rate = {
        "target": matmul_rate(b * t, tcfg.hidden_size, tcfg.intermediate_size, str(tcfg.dtype)) if online else None,
        "drafter": matmul_rate(b * n * prog.block_size, dcfg.hidden_size, dcfg.intermediate_size, dt),
        "ce": matmul_rate(min(prog.ce_chunk, rows), dcfg.hidden_size, vocab, dt),
    }
    return {
        "anchors_run": n,
        "gflop": {
            "target": flops["target_forward"] / 1e9,
            "drafter": flops["drafter_forward_backward"] / 1e9,
            "ce": flops["cross_entropy"] / 1e9,
        },
        "matmul_gflops": {k: (v / 1e9 if v else None) for k, v in rate.items()},
    }


def phases(trainer, repeats: int = 3) -> dict:
    """Seconds of each phase of one step, timed alone (see the module docstring)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dflash_model.drafter import train_logits
    from dflash_model.target import forward
    from train.objective import chunked_cross_entropy, loss_slots

    t0 = time.perf_counter()
    batch = jax.block_until_ready(trainer.next_batch())
    out = {"host_s": time.perf_counter() - t0}

    prog = trainer.program()
    layer_ids = prog.layer_ids
    labels_too = prog.target_labels

    @jax.jit
    def target_fwd(t_state, ids):
        o = forward(nnx.merge(prog.t_graph, t_state), ids, layer_ids=layer_ids, compute_logits=labels_too)
        return o.features if not labels_too else (o.features, jnp.argmax(o.logits, -1))

    if "features" in batch:
        out["target_s"], features = 0.0, batch["features"]
    else:
        out["target_s"] = _time(target_fwd, trainer.run.t_state, batch["input_ids"], repeats=repeats)
        features = target_fwd(trainer.run.t_state, batch["input_ids"])
        features = features[0] if labels_too else features
    target = nnx.merge(prog.t_graph, trainer.run.t_state)
    dt = jnp.dtype(prog.compute_dtype)
    slots = loss_slots(prog.block_size, prog.loss_positions)

    def hidden_of(params):
        h = train_logits(
            nnx.merge(prog.d_graph, params),
            target,
            features,
            batch["input_ids"],
            batch["anchors"],
            prog.block_size,
            hidden_only=True,
            compute_dtype=dt,
        )
        return h[:, :, :slots]

    params = trainer.state["params"]
    h = jax.jit(hidden_of)(params)
    probe = jnp.ones_like(h)
    out["drafter_s"] = _time(
        jax.jit(jax.grad(lambda p: jnp.sum(hidden_of(p).astype(jnp.float32) * probe))), params, repeats=repeats
    )
    hm = h[:, :, 1:].reshape(-1, h.shape[-1])  # slot 0 is never a label: the step's cross-entropy skips it
    labels = jnp.zeros((hm.shape[0],), jnp.int32)
    vocab = trainer.run.vocab_ids

    @jax.jit
    def ce(hm):
        return jax.grad(
            lambda x: jnp.sum(chunked_cross_entropy(target, x, labels, prog.ce_chunk, vocab_ids_U=vocab)[0])
        )(hm)

    out["ce_s"] = _time(ce, hm, repeats=repeats)
    grads = jax.tree.map(jnp.zeros_like, params)
    tx = trainer.tx
    out["optimizer_s"] = _time(
        jax.jit(lambda g, o, p: tx.update(g, o, p)), grads, trainer.state["opt"], params, repeats=repeats
    )
    return {**out, **limits(trainer, batch, slots)}


def fractions(r: dict) -> dict:
    """Each phase's achieved matmul rate over this machine's rate at its shapes (1.0 = the phase runs at the
    machine's matmul limit), and the step's: its FLOPs over the time the phases would take at those limits."""
    g, lim = r["gflop"], r["matmul_gflops"]
    out = {}
    for phase, key in (("target", "target_s"), ("drafter", "drafter_s"), ("ce", "ce_s")):
        out[phase] = g[phase] / r[key] / lim[phase] if lim[phase] and r[key] > 0 else None
    at_limit = sum(g[p] / lim[p] for p in g if lim[p])
    # the FLOPs are those of the phase batch's anchor columns: set against the timed steps of that shape
    same = [x["step_s"] for x in r["per_step"] if x.get("anchor_columns") == r["anchors_run"] and not x["compiled"]]
    out["step"] = at_limit / statistics.median(same) if same else None
    return out


def measure(cfg_name: str, overrides: list[str], steps: int, target=None) -> dict:
    import jax

    from train.config import load_config
    from train.trainer import open_trainer

    with tempfile.TemporaryDirectory() as tmp:
        over = [
            *overrides,
            f"run_dir={tmp}",
            f"train.steps={steps}",
            "export.enabled=false",
            "eval.enabled=false",
            "log.tensorboard=false",
            f"checkpoint.every_steps={steps + 1}",
            "train.epochs=100",
        ]
        cfg = load_config(cfg_name, over)
        t0 = time.perf_counter()
        trainer = open_trainer(cfg, restore=False, target=target)
        build_s = time.perf_counter() - t0
        trainer.train()
        # steps that compiled (the first, and the first of each new anchor-column count) are not timed
        lines = Path(tmp, "metrics.jsonl").read_text().splitlines()
        all_recs = [r for r in map(json.loads, lines) if "step" in r]
        recs = [r for r in all_recs if not r.get("compiled", r["step"] == 1)]
        ph = phases(trainer)
    if not recs:
        raise SystemExit(f"every one of the {steps} steps compiled (new anchor-column counts): give --steps more")
    step_s = statistics.median(r["step_s"] for r in recs)
    # blocks/s over the timed steps as a whole: with anchor columns trimmed a step's time follows its blocks
    blocks_total = sum(r["anchors_per_s"] * r["step_s"] for r in recs)
    blocks = blocks_total / len(recs)
    labels = statistics.median(r["valid_labels"] for r in recs)
    return {
        "overrides": overrides,
        "block_size": int(cfg.block_size),
        "steps_timed": len(recs),
        "device": str(jax.devices()[0]),
        "step_s": step_s,
        "blocks_per_step": blocks,
        "blocks_per_s": blocks_total / sum(r["step_s"] for r in recs),
        "trained_labels_per_s": labels / step_s,
        "loss_last": recs[-1]["loss"] if recs else None,
        # every step: the same seed reads the same rows in the same order, so two trees compare step for step
        "per_step": [
            {k: r.get(k) for k in ("step", "step_s", "anchors_per_s", "anchor_columns", "compiled", "loss")}
            for r in all_recs
        ],
        "build_s": build_s,
        "precompute_s": build_s if cfg.features.mode == "offline" else None,
        **ph,
    }


def _load_targets(cfg_name: str, shared: list[str]):
    """The target once per dtype (loading SmolLM2 from its GGUF takes ~20 s): variants share it."""
    from train.assembly import load_target_model, resolve_mesh
    from train.config import load_config

    cache = {}

    def get(overrides):
        cfg = load_config(cfg_name, [*shared, *overrides])
        key = str(cfg.target.dtype)
        if key not in cache:
            cache[key] = load_target_model(cfg, resolve_mesh(cfg.mesh))
        return cache[key]

    return get


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def format_tables(rows: list[dict], baseline: str = "baseline") -> str:
    """Throughput per variant (against the `baseline` variant at the same K), then each phase's seconds, matmul
    GFLOP and share of this machine's matmul limit."""
    base = {r["block_size"]: r["blocks_per_s"] for r in rows if r["variant"] == baseline}
    lines = [
        f"| K | variant | s/step | blocks/step | blocks/s | x {baseline} | trained labels/s | step GFLOP "
        "| step at limit |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        x = f"{r['blocks_per_s'] / base[r['block_size']]:.2f}x" if r["block_size"] in base else "-"
        lines.append(
            f"| {r['block_size']} | {r['variant']} | {r['step_s']:.4g} | {r['blocks_per_step']:.0f} | "
            f"{r['blocks_per_s']:.1f} | {x} | {r['trained_labels_per_s']:.0f} | "
            f"{sum(r['gflop'].values()):.0f} | {_pct(r['fraction_of_limit']['step'])} |"
        )
    lines += [
        "",
        "| K | variant | anchor columns run | target s / GFLOP / at limit | drafter f+b | CE f+b | optimizer s "
        "| host s |",
        "|---:|---|---:|---|---|---|---:|---:|",
    ]
    for r in rows:
        g, f = r["gflop"], r["fraction_of_limit"]
        cell = {p: f"{r[p + '_s']:.2f} / {g[p]:.0f} / {_pct(f[p])}" for p in ("target", "drafter", "ce")}
        lines.append(
            f"| {r['block_size']} | {r['variant']} | {r['anchors_run']} | {cell['target']} | {cell['drafter']} | "
            f"{cell['ce']} | {r['optimizer_s']:.3f} | {r['host_s']:.3f} |"
        )
    return "\n".join(lines)


def compare_trees(before: str, after: str) -> str:
    """Two runs of this script from two checkouts (same config, data, seed and steps: the same rows in the same
    order), step for step over the steps neither compiled in: blocks/s of each and their ratio, per K."""
    rows_b, rows_a = (json.loads(Path(p).read_text())["rows"] for p in (before, after))
    lines = ["| K | variant | steps | blocks | before: s | after: s | before: blocks/s | after: blocks/s | x |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for rb, ra in zip(rows_b, rows_a, strict=True):
        sb, sa = ({x["step"]: x for x in r["per_step"]} for r in (rb, ra))
        common = [k for k in sa if k in sb and k != 1 and not sa[k].get("compiled") and not sb[k].get("compiled")]
        blocks = sum(sa[k]["anchors_per_s"] * sa[k]["step_s"] for k in common)
        tb, ta = sum(sb[k]["step_s"] for k in common), sum(sa[k]["step_s"] for k in common)
        lines.append(
            f"| {ra['block_size']} | {ra['variant']} | {len(common)} | {blocks:.0f} | {tb:.1f} | {ta:.1f} | "
            f"{blocks / tb:.2f} | {blocks / ta:.2f} | {tb / ta:.2f}x |"
        )
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="smollm2-135m")
    ap.add_argument("--data", help="conversation JSONL or 'sharegpt' (required unless --compare)")
    ap.add_argument(
        "--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="two runs' JSON side by side, step for step; no run"
    )
    ap.add_argument("--blocks", type=int, nargs="+", default=[64, 16])
    ap.add_argument("--variants", nargs="+", default=["baseline", "fast"], choices=sorted(VARIANTS))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default="runs/train_throughput.json")
    ap.add_argument("overrides", nargs="*", help="shared key=value overrides")
    args = ap.parse_args(argv)
    if args.compare:
        print(compare_trees(*args.compare))
        return {}
    if args.data is None:
        ap.error("--data is required (or --compare BEFORE.json AFTER.json)")
    if args.steps < 2:
        ap.error(f"--steps must be at least 2 (the first compiles), got {args.steps}")
    check_out_file(args.out, "--out")
    from dflash_model.cli import add_xla_flags
    from train.config import load_config

    # XLA reads its flags once per process: the config's xla_flags hold for every variant measured here.
    add_xla_flags(load_config(args.config, [f"data.source={args.data}", *args.overrides]).xla_flags)

    targets = None
    rows = []
    for k in args.blocks:
        for name in args.variants:
            shared = [f"data.source={args.data}", f"block_size={k}", *args.overrides]
            if targets is None:
                targets = _load_targets(args.config, shared)
            target, tok_path = targets(VARIANTS[name])
            over = [*shared, f"data.tokenizer={tok_path}", *VARIANTS[name]]
            print(f"[throughput] K={k} {name}: {' '.join(VARIANTS[name]) or '(config as is)'}", flush=True)
            r = {"variant": name, **measure(args.config, over, args.steps, target=target)}
            rows.append({**r, "fraction_of_limit": fractions(r)})
            print(f"[throughput]   {r['step_s']:.2f} s/step, {r['blocks_per_s']:.1f} blocks/s", flush=True)

    table = format_tables(rows)
    print(table)
    rep = {
        "command": shlex.join(["benchmarks/train_throughput.py", *(sys.argv[1:] if argv is None else argv)]),
        "config": args.config,
        "machine": platform.processor() or platform.machine(),
        "variants": {n: VARIANTS[n] for n in args.variants},
        "rows": rows,
        "table": table,
    }
    # No path of this machine in a committed result: the home directory reads as ~.
    atomic_write_text(args.out, json.dumps(rep, indent=1).replace(str(Path.home()), "~"))
    return rep


if __name__ == "__main__":
    from dflash_model.cli import run_main

    run_main(main)
