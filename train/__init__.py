"""Training: the DFlash objective, the trainer (step, checkpoints, loop), configs, regeneration, features."""
