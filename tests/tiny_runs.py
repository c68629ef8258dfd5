"""Short training runs on the tiny random target of configs/tiny.yml: does training raise tau (`run_tiny_tau`),
and can a drafter learn what only its context tells it (`run_task` on synthetic token tasks). The runs behind
tests/test_tau_rises.py and tests/test_learns_context.py.

`run_tiny_tau`:
  1. Random token prompts (held-out ones from another seed), and the target's greedy continuations of them
     (`infer.plain.greedy_generate`, batched). Real tau is acceptance against exactly this greedy text, so the
     drafter must learn it: trained on any other text its real tau stays near 1 however far its loss falls.
  2. Training records of those token ids (the prompt outside the loss mask, the continuation inside), given to
     the Trainer as its data (`open_trainer(records=...)`: the conversation path's padding, anchors and iterator).
  3. `Trainer.train()`. sim_tau of the first step (the untrained drafter: metrics are computed before the update)
     against the mean of the last ten, from metrics.jsonl; and sim_tau of both drafters on held-out records.
  4. Real tau: both drafters exported in the z-lab format and read back with `infer.loading.load_draft_spec` (what
     `python -m infer.eval --draft DIR` does), then `infer.measure.run_comparison` on the held-out prompts with
     n-gram lookup as a reference: greedy, batch 1, lossless check against plain decoding.

Synthetic tasks (64-token sequences, K=8 blocks, 8 sequences x 16 anchors per step, lr 3e-3 constant):
  period2  each sequence alternates two random tokens, ABAB... Slot 1 of a block holds the token before the
           block's first one: only the context features can tell it. Slot 2 repeats slot 0: the block alone can.
  copy16   16 random distinct tokens, repeated to 64; the loss covers positions 16 on, where every token is
           the one 16 back: the simplest form of the repetition n-gram drafting feeds on.
"""

from __future__ import annotations

import dataclasses
import json
import math
import platform
import re
import shutil
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from trainer_probes import loss_and_metrics

from data.pipeline import TokenizedRecords, build_dataset
from dflash_model.config import preset
from dflash_model.drafter_weights import export_drafter
from dflash_model.target import build_target as build_model
from dflash_model.target import randomize
from infer.loading import Draft, load_draft_spec
from infer.measure import run_comparison
from infer.plain import greedy_generate
from infer.proposers import NGramProposer
from train.config import load_config
from train.trainer import open_trainer

DEFAULT_STD = 0.08  # the scale these runs' expectations were set at (conftest.TINY_STD); the Trainer's is init_std
WINDOW = 20  # steps per accuracy window
TASKS = ("period2", "copy16")
LENGTH = 64
PERIOD = 16
TASK_ROWS = 2048  # sequences of a synthetic task


@dataclasses.dataclass
class Settings:
    steps: int = 600
    block_size: int = 8
    target_std: float | None = DEFAULT_STD
    train_prompts: int = 2048  # distinct training sequences (the batches cycle over them)
    eval_prompts: int = 16  # held out: never trained on
    prompt_len: tuple[int, int] = (4, 16)  # random prompt lengths, inclusive
    new_tokens: int = 48  # greedy continuation length, in training and at eval
    batch_size: int = 8
    num_anchors: int = 16
    lr: float = 3e-3
    schedule: str = "cosine"  # or constant (short runs: a cosine spends half of them at a low rate)
    seed: int = 0
    ngram: bool = True  # also evaluate n-gram prompt lookup (a reference; one more decode-loop compile)
    data: str = "target"  # "synthetic": a control, trained on the Trainer's synthetic cycles instead of target text
    overrides: tuple[str, ...] = ()  # further trainer config overrides (key=value)


# ----------------------------------------------------------------------------------------------------------
# Data: the target's own greedy text as token-id records.


def random_prompts(n: int, lengths: tuple[int, int], vocab_size: int, mask_token_id: int, seed: int):
    """n random token-id prompts with lengths in [lo, hi], never containing the drafter's mask token."""
    rng = np.random.default_rng(seed)
    allowed = np.asarray([t for t in range(vocab_size) if t != mask_token_id])
    return [rng.choice(allowed, int(rng.integers(lengths[0], lengths[1] + 1))).tolist() for _ in range(n)]


def greedy_records(target, prompts: list[list[int]], new_tokens: int):
    """TokenizedRecords of prompt + the target's greedy continuation, the continuation alone in the loss mask."""

    replies = greedy_generate(target, prompts, new_tokens)
    examples = [{"input_ids": p + r, "loss_mask": [False] * len(p) + [True] * len(r)} for p, r in zip(prompts, replies)]
    return TokenizedRecords.from_examples(examples, ids=[str(i) for i in range(len(prompts))]), replies


# ----------------------------------------------------------------------------------------------------------
# The run.


def trainer_config(s: Settings, run_dir: Path, rows: int | None = None):
    """configs/tiny.yml with the settings' keys. rows: training records given to the Trainer (None: the synthetic
    control's). train.steps must fit in the data's batches x epochs: the epochs are sized for both. One checkpoint
    at the end; the export is float32 (no bf16 rounding in the eval)."""
    max_len = s.prompt_len[1] + s.new_tokens
    synthetic = max(512, s.batch_size)
    per_epoch = max(min(synthetic, rows or synthetic) // s.batch_size, 1)
    epochs = max(6, math.ceil(s.steps / per_epoch))
    return load_config(
        "tiny",
        [
            f"run_dir={run_dir}",
            f"seed={s.seed}",
            f"block_size={s.block_size}",
            f"num_anchors={s.num_anchors}",
            f"train.steps={s.steps}",
            f"train.batch_size={s.batch_size}",
            f"train.max_len={max_len}",
            f"train.lr={s.lr}",
            f"train.schedule={s.schedule}",
            f"data.num_records={synthetic}",
            f"train.epochs={epochs}",
            f"checkpoint.every_steps={s.steps}",
            "checkpoint.async=false",
            "export.dtype=float32",
            "log.tensorboard=false",
            *s.overrides,
        ],
    )


def tiny_target(cfg, std: float | None):
    """configs/tiny.yml's random target exactly as train.assembly.load_target_model builds it, at init scale std."""

    t = cfg.target
    tcfg = preset(t.preset).replace(**dict(t.arch), dtype=t.dtype)
    return randomize(nnx.eval_shape(lambda: build_model(tcfg, seed=int(cfg.seed))), seed=int(cfg.seed), std=std)


def heldout_sim_tau(trainer, params, records, seed: int) -> float:
    """The training objective's sim_tau of `params` on one batch of held-out records (all of them, anchors drawn
    as in training)."""

    cfg = trainer.cfg
    ds = build_dataset(
        records,
        None,
        int(cfg.train.max_len),
        len(records),
        seed,
        num_anchors=int(cfg.num_anchors),
        block_size=int(cfg.block_size),
    )
    batch = {k: jnp.asarray(v) for k, v in next(iter(ds)).items() if k != "index"}
    fn = jax.jit(lambda p, t, b: loss_and_metrics(trainer, p, t, b)[1]["sim_tau"])
    return float(fn(params, trainer.run.t_state, batch))


def _copy(tree):
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln]


def run_tiny_tau(s: Settings, run_dir: Path, *, progress: bool = False) -> dict:
    """Generate, train, evaluate; returns the report (also the JSON the script writes)."""

    t_start = time.perf_counter()
    run_dir = Path(run_dir)
    if run_dir.exists():  # a run directory of this script: a previous run's checkpoints would be resumed into
        shutil.rmtree(run_dir)
    cfg = trainer_config(s, run_dir, s.train_prompts)
    target = tiny_target(cfg, s.target_std)
    mask = int(cfg.drafter.mask_token_id)
    vocab = int(cfg.target.arch["vocab_size"])

    t0 = time.perf_counter()
    prompts = random_prompts(s.train_prompts + s.eval_prompts, s.prompt_len, vocab, mask, s.seed + 1)
    records, replies = greedy_records(target, prompts, s.new_tokens)  # one batched call for both sets
    train_idx, held_idx = range(s.train_prompts), range(s.train_prompts, len(prompts))
    train_records = TokenizedRecords.from_examples([records[i] for i in train_idx])
    held_records = TokenizedRecords.from_examples([records[i] for i in held_idx])
    held_prompts = [prompts[i] for i in held_idx]
    gen_s = time.perf_counter() - t0
    cont = [replies[i] for i in train_idx]
    repeat_rate = float(np.mean([np.mean(np.asarray(r[1:]) == np.asarray(r[:-1])) for r in cont]))

    if s.data not in ("target", "synthetic"):
        raise ValueError(f"data={s.data!r}: expected target or synthetic")
    trainer = open_trainer(cfg, target=target, records=train_records if s.data == "target" else None, restore=False)
    untrained = _copy(trainer.state["params"])  # the step donates the state's buffers
    t0 = time.perf_counter()
    summary = trainer.train()
    train_s = time.perf_counter() - t0
    trained = trainer.state["params"]

    recs = _metrics(run_dir)
    tail = recs[-10:]
    sim = {
        "first_step": recs[0]["sim_tau"],
        "last10_mean": float(np.mean([r["sim_tau"] for r in tail])),
        "loss_first_step": recs[0]["loss"],
        "loss_last10_mean": float(np.mean([r["loss"] for r in tail])),
        "acc_first_step": recs[0]["acc"],
        "acc_last10_mean": np.mean([r["acc"] for r in tail], axis=0).tolist(),
        "heldout_untrained": heldout_sim_tau(trainer, untrained, held_records, s.seed + 2),
        "heldout_trained": heldout_sim_tau(trainer, trained, held_records, s.seed + 2),
    }

    # Real tau: both drafters through the z-lab export and infer.eval's loader and decode loop.
    dcfg = trainer.run.drafter_cfg
    drafts = []
    for name, params in (("untrained", untrained), ("trained", trained)):
        out = export_drafter(nnx.merge(trainer.d_graph, params), dcfg, run_dir / f"export-{name}", dtype="float32")
        drafts.append(dataclasses.replace(load_draft_spec(str(out), trainer.run.target_cfg), name=name))
    if s.ngram:
        drafts.append(Draft("ngram", NGramProposer(), None, s.block_size))
    t0 = time.perf_counter()
    reports = run_comparison(target, drafts, held_prompts, max_new_tokens=s.new_tokens, progress=progress)
    eval_s = time.perf_counter() - t0

    real = {
        name: {
            k: r[k]
            for k in (
                "tau",
                "rounds",
                "acceptance_unconditional",
                "lossless_mismatches",
                "mismatch_examples",
                "speedup",
                "tau_histogram",
            )
        }
        for name, r in reports.items()
    }
    return {
        "settings": {**dataclasses.asdict(s), "overrides": list(s.overrides)},
        "target": {"config": "tiny", "init_std": s.target_std, **dict(cfg.target.arch)},
        "drafter": {
            "num_layers": dcfg.num_hidden_layers,
            "target_layer_ids": list(dcfg.target_layer_ids),
            "mask_token_id": dcfg.mask_token_id,
            "block_size": dcfg.block_size,
        },
        "data": {
            "train_sequences": len(train_records),
            "heldout_prompts": len(held_prompts),
            "target_repeats_last_token": repeat_rate,
        },
        "steps": trainer.step,
        "sim_tau": sim,
        "real_tau": real,
        "seconds": {
            "generate": gen_s,
            "train": train_s,
            "train_step": summary["step_s"],
            "train_compile_step": summary["compile_step_s"],
            "eval": eval_s,
            "total": time.perf_counter() - t_start,
        },
        "device": str(jax.devices()[0]),
        "run_dir": str(run_dir),
    }


def format_tiny_tau(rep: dict) -> str:
    s, sim, real = rep["settings"], rep["sim_tau"], rep["real_tau"]
    lines = [
        f"tiny target (init std {s['target_std']}), K={s['block_size']}, {rep['steps']} steps x {s['batch_size']} "
        f"sequences, {rep['data']['train_sequences']} training / {rep['data']['heldout_prompts']} held-out prompts, "
        f"{s['new_tokens']} new tokens" + (", CONTROL: trained on synthetic data" if s["data"] != "target" else ""),
        "| drafter | sim_tau (train batch) | sim_tau (held-out) | real tau (held-out) | acc. pos 1 | lossless |",
        "|---|---:|---:|---:|---:|---|",
    ]
    rows = [
        ("untrained", sim["first_step"], sim["heldout_untrained"]),
        ("trained", sim["last10_mean"], sim["heldout_trained"]),
        ("ngram", None, None),
    ]
    for name, train_sim, held_sim in rows:
        if name not in real:
            continue
        r = real[name]
        f = lambda x: "-" if x is None else f"{x:.3f}"
        n = rep["data"]["heldout_prompts"]
        lines.append(
            f"| {name} | {f(train_sim)} | {f(held_sim)} | {r['tau']:.3f} | "
            f"{r['acceptance_unconditional'][0]:.3f} | {n - r['lossless_mismatches']}/{n} equal |"
        )
    sec = rep["seconds"]
    lines.append(
        f"(train-batch sim_tau: step 1 for untrained, mean of the last 10 steps for trained; loss "
        f"{sim['loss_first_step']:.3f} -> {sim['loss_last10_mean']:.3f})"
    )
    lines.append(
        f"time: generate {sec['generate']:.1f}s, train {sec['train']:.1f}s "
        f"({sec['train_step'] or float('nan'):.3f}s/step), eval {sec['eval']:.1f}s, total {sec['total']:.1f}s"
    )
    return "\n".join(lines)


def task_records(task: str, n: int, vocab_size: int, mask_token_id: int, seed: int):
    """n TokenizedRecords of `task`, never containing the mask token; the loss mask starts where the context can
    already tell the next token (position 2 for period2, 16 for copy16)."""

    rng = np.random.default_rng(seed)
    allowed = np.asarray([t for t in range(vocab_size) if t != mask_token_id])
    examples = []
    for _ in range(n):
        if task == "period2":
            ids, start = np.resize(rng.choice(allowed, 2, replace=False), LENGTH), 2
        elif task == "copy16":
            ids, start = np.resize(rng.choice(allowed, PERIOD, replace=False), LENGTH), PERIOD
        else:
            raise ValueError(f"task {task!r}: expected one of {', '.join(TASKS)}")
        examples.append({"input_ids": ids.tolist(), "loss_mask": [False] * start + [True] * (LENGTH - start)})
    return TokenizedRecords.from_examples(examples, ids=[str(i) for i in range(n)])


def run_task(
    task: str,
    steps: int,
    *,
    seed: int = 0,
    features: bool = True,
    overrides: tuple[str, ...] = (),
    run_dir: Path | None = None,
) -> dict:
    """Train the tiny drafter on `task` for `steps` steps; returns the report (windows of 20 steps)."""

    name = f"synthetic-{task}{'' if features else '-nofeat'}-{steps}" + "".join(
        "-" + re.sub(r"[^A-Za-z0-9.=]+", "_", o) for o in overrides
    )
    run_dir = Path(run_dir or Path("runs") / "probes" / name)
    over = (*overrides, *(() if features else ("features.zero=true",)))
    # tiny_tau sizes train.max_len as its longest prompt plus new_tokens: make that LENGTH.
    s = Settings(
        steps=steps,
        block_size=8,
        new_tokens=LENGTH - Settings.prompt_len[1],
        lr=3e-3,
        schedule="constant",
        seed=seed,
        overrides=over,
    )
    cfg = trainer_config(s, run_dir, TASK_ROWS)
    assert int(cfg.train.max_len) == LENGTH, cfg.train.max_len
    target = tiny_target(cfg, s.target_std)
    records = task_records(task, TASK_ROWS, int(cfg.target.arch["vocab_size"]), int(cfg.drafter.mask_token_id), seed)
    t0 = time.time()
    open_trainer(cfg, target=target, records=records, restore=False).train()
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return {
        "name": name,
        "task": task,
        "features": features,
        "overrides": list(overrides),
        "steps": steps,
        "seed": seed,
        "blocks_per_step": int(cfg.train.batch_size) * int(cfg.num_anchors),
        "wall_s": time.time() - t0,
        "windows": accuracy_windows(recs),
        "machine": platform.processor() or platform.machine(),
    }


def accuracy_windows(recs: list[dict]) -> list[dict]:
    """Loss, top-1 of block positions 1-3 (weighted by valid labels) and step time over WINDOW-step windows of
    metrics.jsonl records."""
    windows = []
    for lo in range(0, len(recs), WINDOW):
        win = recs[lo : lo + WINDOW]
        n = sum(r["valid_labels"] for r in win)
        windows.append(
            {
                "steps": [win[0]["step"], win[-1]["step"]],
                "loss": statistics.mean(r["loss"] for r in win),
                # loss_positions=1 trains (and reports) position 1 only
                "acc_1_2_3": [
                    sum(r["acc"][i] * r["valid_labels"] for r in win) / n for i in range(min(3, len(win[0]["acc"])))
                ],
                "step_s": statistics.median(r["step_s"] for r in win),
            }
        )
    return windows
