"""Inference: the speculative decode loop and evaluation."""
