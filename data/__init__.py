"""Data: offline package-shipped assets, prompt sets and training data pipelines."""
