"""Train a DFlash drafter: `python train/run.py [--config smollm2-135m] [--block 64] [key=value ...]`."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

# Run as a script from the repo root: make `train`, `dflash_model`, `data` importable without installing.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> dict:
    from train.config import cli_overrides, load_config

    name, overrides = cli_overrides(sys.argv[1:] if argv is None else argv)
    cfg = load_config(name, overrides)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every checkpoint step at INFO
    log = logging.getLogger("dflash.train")
    log.info("resolved config (%s):\n%s", name, cfg.dump())

    from train.trainer import Trainer

    trainer = Trainer(cfg)
    Path(cfg.run_dir, "config.yml").write_text(cfg.dump())
    left = trainer.total_steps - trainer.step
    target = cfg.target.path or f"random {cfg.target.preset}" + (" (arch overrides)" if cfg.target.arch else "")
    log.info("will train a %d-layer K=%d drafter (gamma %.2f) on %s for %d more steps (%s), %d anchors/seq, "
             "batch %d x %d tokens; first step compiles (seconds for tiny, minutes for 4B+ targets); "
             "checkpoints every %d steps in %s", trainer.drafter_cfg.num_hidden_layers, trainer.block_size,
             trainer.gamma, target, left,
             f"resuming from step {trainer.step}" if trainer.step else "fresh start", cfg.num_anchors,
             cfg.train.batch_size, cfg.train.max_len, cfg.checkpoint.every_steps, trainer.ckpt_dir)
    summary = trainer.train()
    log.info("done: %s", summary)
    return summary


if __name__ == "__main__":
    main()
