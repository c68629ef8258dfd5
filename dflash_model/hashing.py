"""A 32-bit integer hash for counter-based values (random weights, reply-index keys): written by hand because
neither numpy nor jax has a vectorised integer hash, and threefry (jax.random) is 20x slower on a CPU."""

from __future__ import annotations

import numpy as np


def mix32(x):
    """MurmurHash3's finaliser over uint32 arrays (numpy or jax): every input bit reaches every output bit."""
    x = x ^ (x >> 16)
    x = x * np.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * np.uint32(0xC2B2AE35)
    return x ^ (x >> 16)
