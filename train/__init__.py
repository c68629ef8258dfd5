"""Training: DFlash objective, Tunix trainer, configs, checkpoints."""
