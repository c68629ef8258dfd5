"""Train a DFlash drafter: `python train/run.py [--config smollm2-135m] [--block 64] [key=value ...]`.

`--dry-run [--pod v5p-128]` trains nothing: it compiles one training step of the config over abstract arrays on a
mesh of the pod's size (fake CPU devices) and prints memory per device against the chip's HBM and the step's FLOPs
(train/plan.py); `--pod` also takes DEVICES[:HBM_GIB].

The default config does the whole job on the embedded SmolLM2-135M-Instruct: mix the target's committed replies
(cached), widen the shipped drafter, checkpoint, export in the z-lab format, and evaluate against the shipped
drafter, plain decoding and n-gram drafting on prompts no drafter trained on (train/workflow.py).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

# Run as a script, Python puts train/ first on sys.path: no module there may share a name with a top-level package
# (`data`, `infer`, ...), which resolve through the editable install of scripts/venv.sh.
from dflash_model.files import atomic_write_text


def _target_name(cfg) -> str:
    from data.assets import target_name

    return f"random-{cfg.target.preset}" if cfg.target.path is None else target_name(cfg.target.path)


def on_cloud_tpu_vm() -> bool:
    """Whether this host is a Cloud TPU VM, read from what the TPU runtime sets up (environment, device files)
    without initialising a JAX backend, which jax.distributed must precede."""
    return (
        any(os.environ.get(k) for k in ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES")) or Path("/dev/accel0").exists()
    )


def init_distributed() -> bool:
    """Join a jax.distributed cluster (JAX multi-controller: one process per host). Must run before anything
    touches a device.

    - JAX_COORDINATOR_ADDRESS (host:port of process 0) set: that cluster, with JAX_NUM_PROCESSES and
      JAX_PROCESS_ID where given (else auto-detected where JAX can: Slurm, Open MPI). CPU processes talk over
      gloo (JAX's default). This is how the CPU tests run several processes.
    - on a Cloud TPU VM: `jax.distributed.initialize()` with no arguments (JAX reads the slice's hosts from the
      TPU environment); a single-host slice simply runs one process.
    - otherwise nothing happens: a single-process run.
    """
    import jax  # here, not at the top: `--help` answers without loading JAX

    addr = os.environ.get("JAX_COORDINATOR_ADDRESS")
    if addr:
        n, pid = os.environ.get("JAX_NUM_PROCESSES"), os.environ.get("JAX_PROCESS_ID")
        jax.distributed.initialize(addr, num_processes=int(n) if n else None, process_id=int(pid) if pid else None)
        return True
    if on_cloud_tpu_vm():
        jax.distributed.initialize()
        return True
    return False


def main(argv: list[str] | None = None) -> dict:
    from dflash_model.cli import add_xla_flags
    from train.config import load_config
    from train.presets import cli_overrides

    args = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in args):
        configs = sorted(p.stem for p in (Path(__file__).resolve().parent.parent / "configs").glob("*.yml"))
        print(__doc__.strip() + "\n\nconfigs: " + ", ".join(configs) + "\nkeys and defaults: configs/base.yml")
        return {}
    if "--dry-run" in args:
        return dry_run(args)
    name, overrides = cli_overrides(args)
    cfg = load_config(name, overrides)
    add_xla_flags(cfg.xla_flags)  # before init_distributed: the first thing that may start a JAX backend
    init_distributed()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every checkpoint step at INFO

    # Imported past --help and the config check only: those answer at once, without loading JAX or the trainer.
    import jax

    from dflash_model.files import open_run_dir

    # The run directory's lock before anything is read or written there (and before the data is regenerated): a
    # second training in it is refused with every file as it was. Held to the end of the eval.
    lock = open_run_dir(cfg.run_dir, checkpoint_dir=cfg.checkpoint.dir) if jax.process_index() == 0 else None
    try:
        return _run(name, cfg, lock)
    finally:
        if lock is not None:
            lock.release()


def _run(name: str, cfg, lock) -> dict:
    """The run under the run directory's lock: data, training, export, eval."""
    import jax

    from train import workflow
    from train.assembly import build_run, load_target_model, resolve_mesh, stage_run_dir
    from train.trainer import Trainer

    log = logging.getLogger("dflash.train")
    target = tokenizer = heldout = None
    if cfg.data.source == "regenerate":
        if jax.process_count() > 1:  # every process would append to the same JSONL
            raise ValueError(
                "data.source=regenerate runs in one process: regenerate first (python -m "
                "train.regenerate, or this config on one host), then give the JSONL as data.source"
            )
        from dflash_model.tokenizer import load_tokenizer

        target, tok_path = load_target_model(cfg, resolve_mesh(cfg.mesh))
        tok_source = cfg.data.tokenizer or tok_path
        tokenizer = load_tokenizer(tok_source)
        path, heldout = workflow.prepare_regenerated(cfg, target, tokenizer, _target_name(cfg))
        cfg = cfg.with_data(source=str(path), tokenizer=str(tok_source))
    else:
        if cfg.data.source == "mix":
            cfg = cfg.with_data(source=str(workflow.prepare_mix(cfg.data)))
        workflow.announce_start(cfg)
    log.info("resolved config (%s):\n%s", name, cfg.dump())

    trainer = Trainer(build_run(cfg, stage_run_dir(cfg), target=target), lock=lock)
    if jax.process_index() == 0:  # like metrics.jsonl and the export: one writer in a multi-process run
        atomic_write_text(trainer.run_dir / "config.yml", cfg.dump())
        trainer.push()
    left = trainer.total_steps - trainer.step
    what = cfg.target.path or f"random {cfg.target.preset}" + (" (arch overrides)" if cfg.target.arch else "")
    log.info(
        "will train a %d-layer K=%d drafter (gamma %.2f) on %s for %d more steps (%s), %d anchors/seq, "
        "batch %d x %d tokens; first step compiles (seconds for tiny, minutes for 4B+ targets); "
        "checkpoints every %d steps in %s",
        trainer.run.drafter_cfg.num_hidden_layers,
        trainer.block_size,
        trainer.gamma,
        what,
        left,
        f"resuming from step {trainer.step}" if trainer.step else "fresh start",
        cfg.num_anchors,
        cfg.train.batch_size,
        cfg.train.max_len,
        cfg.checkpoint.every_steps,
        trainer.checkpoints.dir,
    )
    summary = trainer.train()
    if trainer.step >= trainer.total_steps and summary["stopped_by"] is None and cfg.export.enabled:
        path = workflow.export_run(trainer)  # every process: FSDP shards are gathered from all; process 0 writes
        if path is not None:
            summary["export"] = str(path)
    log.info("done: %s", summary)

    reports = workflow.end_of_run_eval(cfg, trainer, summary, tokenizer, heldout)
    if reports is not None:
        summary["eval"] = reports
    return summary


def dry_run(args: list[str]) -> dict:
    """`--dry-run [--pod SPEC]`: plan the config on a pod (train/plan.py) and print the table."""
    from train import plan
    from train.config import load_config
    from train.presets import cli_overrides

    args = [a for a in args if a != "--dry-run"]
    pod_spec = "v5p-128"
    if "--pod" in args:
        i = args.index("--pod")
        if i + 1 >= len(args):
            raise ValueError("--pod needs a value (e.g. --pod v5p-128, or --pod 64:95 for 64 devices of 95 GiB)")
        pod_spec = args[i + 1]
        del args[i : i + 2]
    pod = plan.parse_pod(pod_spec)
    plan.use_fake_devices(pod)  # before anything initialises JAX
    name, overrides = cli_overrides(args)
    result = plan.plan(load_config(name, overrides), pod)
    print(plan.report(result))
    return result


# A run stopped by SIGTERM / SIGINT saved its step and can resume, but it did not finish: a scheduler must see that.
STOPPED_EXIT = 75  # EX_TEMPFAIL: "try again later"


if __name__ == "__main__":
    from dflash_model.cli import run_main

    summary = run_main(main)
    if summary.get("stopped_by"):
        print(
            f"stopped by {summary['stopped_by']} at step {summary['step']} after checkpointing it; run the same "
            f"command again to resume (exit {STOPPED_EXIT})",
            file=sys.stderr,
        )
        sys.exit(STOPPED_EXIT)
