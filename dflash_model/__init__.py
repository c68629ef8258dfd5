"""DFlash drafter and target models in Flax NNX: configs, forwards, weights."""
