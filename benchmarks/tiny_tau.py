"""Does training raise tau? A tiny random target, a drafter trained on the target's own greedy text, and tau
before and after: simulated (the training metric) and real (the speculative engine, infer/eval.py's loop).

  .venv/bin/python benchmarks/tiny_tau.py [--steps 600] [--block 8] [--target-std 0.08] [--eval-prompts 16]
      [--lr 3e-3] [--schedule cosine|constant] [--no-ngram] [--data target|synthetic] [--out runs/tiny_tau.json]
      [key=value trainer overrides ...]

What it does, all on the target of configs/tiny.yml (a 4-layer, 512-token random Qwen3; `--target-std` changes
the init scale, 0.08 being what the Trainer builds for a random preset):
  1. Random token prompts (held-out ones from another seed), and the target's greedy continuations of them
     (`infer.plain.greedy_generate`, batched). Real tau is acceptance against exactly this greedy text, so the
     drafter must learn it: trained on any other text its real tau stays near 1 however far its loss falls.
  2. Training records of those token ids: the prompt outside the loss mask, the continuation inside. The Trainer
     reads only synthetic or chat-conversation data, so its batches are swapped for `data.pipeline.build_dataset`
     over `TokenizedRecords` (same padding, anchors and resumable iterator as the conversation path).
  3. `Trainer.train()` for `--steps` steps. sim_tau of the first step (the untrained drafter: metrics are computed
     before the update) against the mean of the last ten, from metrics.jsonl; and sim_tau of both drafters on a
     batch of held-out records.
  4. Real tau: both drafters exported in the z-lab format and read back with `infer.loading.load_draft_spec` (what
     `python -m infer.eval --draft DIR` does), then `infer.eval.run_comparison` on the held-out prompts with
     n-gram lookup as a reference: greedy, batch 1, lossless check against plain decoding.

Prints a table and writes the report JSON (default runs/tiny_tau.json; the run directory, with metrics.jsonl and
the exported drafters, is the JSON's name without .json). tests/test_tau_rises.py runs a shorter version.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from dflash_model.target import RANDOM_INIT_STD  # noqa: E402

DEFAULT_STD = RANDOM_INIT_STD  # what the Trainer builds for a random preset target


@dataclasses.dataclass
class Settings:
    steps: int = 600
    block_size: int = 8
    target_std: float = DEFAULT_STD
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
    from data.pipeline import TokenizedRecords
    from infer.plain import greedy_generate

    replies = greedy_generate(target, prompts, new_tokens)
    examples = [{"input_ids": p + r, "loss_mask": [False] * len(p) + [True] * len(r)} for p, r in zip(prompts, replies)]
    return TokenizedRecords.from_examples(examples, ids=[str(i) for i in range(len(prompts))]), replies


def attach_records(trainer, records, num_epochs: int | None = None) -> None:
    """Make `trainer` train on `records` (TokenizedRecords) instead of the data its config names.

    The Trainer has no token-id data source, so its dataset and iterator are replaced right after construction
    (before any step or restore: build it with restore=False). The batches come from data.pipeline, the
    conversation path's own pipeline, so padding, anchors and the checkpointed iterator state are the real ones.
    """
    from data.pipeline import build_dataset

    cfg = trainer.cfg
    if trainer.step != 0:
        raise ValueError("attach_records needs a fresh trainer (restore=False): the restored iterator was another's")
    ds = build_dataset(
        records,
        None,
        int(cfg.train.max_len),
        int(cfg.train.batch_size),
        int(cfg.seed),
        num_epochs=num_epochs,
        num_anchors=int(cfg.num_anchors),
        block_size=int(cfg.block_size),
    )
    trainer.dataset = ds
    trainer.iterator = iter(ds)
    trainer.batches_per_epoch = len(records) // int(cfg.train.batch_size)


# ----------------------------------------------------------------------------------------------------------
# The run.


def trainer_config(s: Settings, run_dir: Path):
    from train.config import load_config

    max_len = s.prompt_len[1] + s.new_tokens
    # The Trainer sizes train.steps against its configured (synthetic) data set before the records replace it:
    # give that enough epochs. One checkpoint at the end; the export is float32 (no bf16 rounding in the eval).
    synthetic = max(512, s.batch_size)
    epochs = max(6, math.ceil(s.steps / (synthetic // s.batch_size)))
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


def build_target(cfg, std: float):
    """configs/tiny.yml's random target exactly as train.trainer.load_target_model builds it, at init scale std."""
    from dflash_model.config import preset
    from dflash_model.target import build_target as build
    from dflash_model.target import randomize

    t = cfg.target
    tcfg = preset(t.preset).replace(**dict(t.arch), dtype=t.dtype)
    return randomize(nnx.eval_shape(lambda: build(tcfg, seed=int(cfg.seed))), seed=int(cfg.seed), std=std)


def heldout_sim_tau(trainer, params, records, seed: int) -> float:
    """The training objective's sim_tau of `params` on one batch of held-out records (all of them, anchors drawn
    as in training)."""
    from data.pipeline import build_dataset

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
    fn = jax.jit(lambda p, t, b: trainer.loss_fn(p, t, b)[1]["sim_tau"])
    return float(fn(params, trainer.t_state, batch))


def _copy(tree):
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln]


def run(s: Settings, run_dir: Path, *, progress: bool = False) -> dict:
    """Generate, train, evaluate; returns the report (also the JSON the script writes)."""
    from data.pipeline import TokenizedRecords
    from dflash_model.drafter_weights import export_drafter
    from infer.eval import run_comparison
    from infer.loading import Draft, load_draft_spec
    from infer.proposers import NGramProposer
    from train.trainer import Trainer

    t_start = time.perf_counter()
    run_dir = Path(run_dir)
    if run_dir.exists():  # a run directory of this script: a previous run's checkpoints would be resumed into
        shutil.rmtree(run_dir)
    cfg = trainer_config(s, run_dir)
    target = build_target(cfg, s.target_std)
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

    trainer = Trainer(cfg, target=target, restore=False)
    if s.data == "target":
        attach_records(trainer, train_records)
    elif s.data != "synthetic":
        raise ValueError(f"data={s.data!r}: expected target or synthetic")
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
    dcfg = trainer.drafter_cfg
    drafts = []
    for name, params in (("untrained", untrained), ("trained", trained)):
        out = export_drafter(nnx.merge(trainer.d_graph, params), dcfg, run_dir / f"export-{name}", dtype="float32")
        drafts.append(dataclasses.replace(load_draft_spec(str(out), trainer.target_cfg), name=name))
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


def format_table(rep: dict) -> str:
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


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = Settings()
    ap.add_argument("--steps", type=int, default=d.steps)
    ap.add_argument("--block", type=int, default=d.block_size)
    ap.add_argument("--target-std", type=float, default=d.target_std)
    ap.add_argument("--train-prompts", type=int, default=d.train_prompts)
    ap.add_argument("--eval-prompts", type=int, default=d.eval_prompts)
    ap.add_argument("--new-tokens", type=int, default=d.new_tokens)
    ap.add_argument("--batch-size", type=int, default=d.batch_size)
    ap.add_argument("--anchors", type=int, default=d.num_anchors)
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--schedule", choices=["cosine", "constant"], default=d.schedule)
    ap.add_argument("--no-ngram", action="store_true", help="skip the n-gram reference")
    ap.add_argument(
        "--data",
        choices=["target", "synthetic"],
        default=d.data,
        help="synthetic: a control run on the Trainer's synthetic data (not the target's text)",
    )
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--out", default="runs/tiny_tau.json")
    ap.add_argument("overrides", nargs="*", help="trainer config overrides, key=value")
    a = ap.parse_args(argv)
    s = Settings(
        steps=a.steps,
        block_size=a.block,
        target_std=a.target_std,
        train_prompts=a.train_prompts,
        eval_prompts=a.eval_prompts,
        new_tokens=a.new_tokens,
        batch_size=a.batch_size,
        num_anchors=a.anchors,
        lr=a.lr,
        schedule=a.schedule,
        seed=a.seed,
        ngram=not a.no_ngram,
        data=a.data,
        overrides=tuple(a.overrides),
    )
    out = Path(a.out)
    rep = run(s, out.with_suffix(""), progress=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rep, indent=1))
    print(format_table(rep))
    print(f"wrote {out}")
    return rep


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("absl").setLevel(logging.WARNING)
    main()
