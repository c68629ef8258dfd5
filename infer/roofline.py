"""Roofline cost of a DFlash round on an accelerator, in plain decode steps, from the chip's two spec numbers.

A forward of T positions for a batch of B sequences, each with C tokens of context, takes

  time = max(flops / peak bf16 FLOP/s, bytes / HBM bytes/s)
  flops = 2 x B x (body x T + head x logits) + attention x B x T x (C + T)
  bytes = 2 x weights + B x C x kv

  body       matmul weights every position runs through (attention projections, MLP; a drafter's fc too)
  head       the lm_head (vocab x hidden), run at each of the `logits` positions
  weights    parameters read from HBM once per forward: every matrix and norm; not an untied input-embedding
             table, of which a forward gathers only B x T rows
  attention  FLOPs per (query, key) pair, all layers: 4 x layers x heads x head_dim (the scores and the weighted
             sum, 2 FLOPs a multiply-add each); each position attends to the context and to its own block
  kv         bf16 bytes of cached keys and values per context token: layers x 2 x kv_heads x head_dim x 2

Weights and cache are taken as bf16 whatever dtype a config names: that is how these targets are served on these
chips. One max over the whole forward is the optimistic roofline: it lets the weight reads hide the matmuls
entirely, so a verify costs one plain step for as long as its FLOPs fit in the time the reads take. Activations,
the cache write of the T new positions and the kernels' own inefficiency are left out; they are small next to the
weight reads at these widths, or the same in a K-token verify as in a one-token step.

A round of block size K, in plain steps (one-token forwards of the same target, batch and context):
  verify(K) = time(target, T=K, logits=K) / time(target, T=1, logits=1)
  draft(K)  = time(drafter, T=K, logits=K-1) / time(target, T=1, logits=1)
  round     = verify(K) + draft(K) + overhead      (no drafter forward: verify(K) + overhead)
The drafter is z-lab's DFlash layout: `layers` decoder layers at the target's width, heads and MLP size, an fc
projecting `features` target layers (features x hidden -> hidden), the target's embedding and lm_head shared, so
the lm_head's weights are read again by its forward and run over the K-1 drafted slots. Its fc is counted over
the K block positions (the round's newly committed context rows, at most K, go through it) and its attention
reads its own cache of the context's keys and values. `overhead` (acceptance, cache bookkeeping, the host round
trip) is not a roofline quantity: it is calibrated once, from a published round cost (`calibrate_overhead`).

numpy-free and jax-free: a shape is anything with TargetConfig's fields (dflash_model.config imports jax).
"""

from __future__ import annotations

import dataclasses

BF16_BYTES = 2
RIDGE_TOLERANCE = 1.05  # the ridge K: the widest verify still within 5% of a plain step


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator chip by its two published numbers."""

    name: str
    peak_flops: float  # dense bf16 FLOP/s (no 2:4 sparsity)
    hbm_bytes_per_s: float

    @property
    def ridge(self) -> float:
        """FLOPs per HBM byte at which the chip's compute and its memory take equal time."""
        return self.peak_flops / self.hbm_bytes_per_s


@dataclasses.dataclass(frozen=True)
class Forward:
    """One network's forward, by what its time depends on (see the module docstring)."""

    body_params: int
    head_params: int
    weight_params: int
    attention_flops: int
    kv_bytes: int

    def flops(self, tokens: int, logits: int, batch: int, context: int) -> float:
        matmuls = 2 * batch * (self.body_params * tokens + self.head_params * logits)
        return float(matmuls + self.attention_flops * batch * tokens * (context + tokens))

    def bytes(self, batch: int, context: int) -> float:
        return float(BF16_BYTES * self.weight_params + batch * context * self.kv_bytes)

    def seconds(self, chip: Chip, tokens: int, logits: int, batch: int, context: int) -> float:
        return max(
            self.flops(tokens, logits, batch, context) / chip.peak_flops,
            self.bytes(batch, context) / chip.hbm_bytes_per_s,
        )


def _layer_matmul_params(cfg) -> int:
    """q, k, v, o projections and the SwiGLU MLP (gate, up, down) of one decoder layer at cfg's shape."""
    d, h = cfg.hidden_size, cfg.head_dim
    return d * h * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads) + 3 * d * cfg.intermediate_size


def _layer_norm_params(cfg) -> int:
    """Two RMSNorms, plus q_norm and k_norm where the family has them (Qwen3)."""
    return 2 * cfg.hidden_size + (2 * cfg.head_dim if cfg.family == "qwen3" else 0)


def _attention(cfg, layers: int) -> tuple[int, int]:
    """(FLOPs per query-key pair, bf16 KV bytes per context token) over `layers` layers of cfg's attention."""
    flops = 4 * layers * cfg.num_attention_heads * cfg.head_dim
    kv = layers * 2 * cfg.num_key_value_heads * cfg.head_dim * BF16_BYTES
    return flops, kv


def target_forward(cfg) -> Forward:
    """The target's forward (cfg: a dflash_model.config.TargetConfig or anything with its fields)."""
    layers, head = cfg.num_hidden_layers, cfg.vocab_size * cfg.hidden_size
    body = layers * _layer_matmul_params(cfg)
    weights = body + head + layers * _layer_norm_params(cfg) + cfg.hidden_size  # + the final norm
    attention, kv = _attention(cfg, layers)
    return Forward(body, head, weights, attention, kv)


def drafter_forward(cfg, layers: int = 5, features: int = 5) -> Forward:
    """The forward of a DFlash drafter for target cfg: `layers` layers shaped like the target's, an fc from
    `features` concatenated target layers, the target's lm_head (whose weights its forward reads again)."""
    d, head = cfg.hidden_size, cfg.vocab_size * cfg.hidden_size
    body = layers * _layer_matmul_params(cfg) + features * d * d
    weights = body + head + layers * _layer_norm_params(cfg) + 2 * d  # + hidden_norm and the final norm
    attention, kv = _attention(cfg, layers)
    return Forward(body, head, weights, attention, kv)


@dataclasses.dataclass(frozen=True)
class RoundModel:
    """Roofline costs of one target + drafter on one chip at one batch and context, in plain decode steps."""

    chip: Chip
    target: Forward
    drafter: Forward
    batch: int = 1
    context: int = 1024

    @classmethod
    def of(
        cls, chip: Chip, cfg, drafter_layers: int = 5, drafter_features: int = 5, batch: int = 1, context: int = 1024
    ):
        if batch < 1 or context < 0 or drafter_layers < 0 or drafter_features < 1:
            raise ValueError(
                f"batch={batch}, context={context}, drafter_layers={drafter_layers}, "
                f"drafter_features={drafter_features}: expected batch >= 1, context >= 0, layers >= 0, features >= 1"
            )
        return cls(chip, target_forward(cfg), drafter_forward(cfg, drafter_layers, drafter_features), batch, context)

    def plain_step_s(self) -> float:
        return self.target.seconds(self.chip, 1, 1, self.batch, self.context)

    def verify(self, k: int) -> float:
        """A K-token verify (logits at every position) over a one-token step."""
        _check_width(k)
        return self.target.seconds(self.chip, k, k, self.batch, self.context) / self.plain_step_s()

    def draft(self, k: int) -> float:
        """The drafter's forward over a block of K (lm_head on the K-1 drafted slots) over a one-token step."""
        _check_width(k)
        return self.drafter.seconds(self.chip, k, k - 1, self.batch, self.context) / self.plain_step_s()

    def ridge_k(self, tolerance: float = RIDGE_TOLERANCE, limit: int = 1 << 20) -> int:
        """The largest K whose verify costs at most `tolerance` plain steps (verify(K) never falls as K grows)."""
        lo, hi = 1, limit
        if self.verify(hi) <= tolerance:
            return hi
        while hi - lo > 1:  # verify(lo) <= tolerance < verify(hi)
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.verify(mid) <= tolerance else (lo, mid)
        return lo


def _check_width(k: int) -> None:
    if int(k) != k or k < 1:
        raise ValueError(f"width K={k}: a verify covers at least the last committed token (K >= 1)")


def calibrate_overhead(model: RoundModel, block_size: int, round_cost: float) -> float:
    """The part of a measured round cost (plain steps, at `block_size`) that neither the verify nor the drafter's
    forward explains under this model: the round's own work, and whatever the two forwards lose to their roofline."""
    return round_cost - model.verify(block_size) - model.draft(block_size)
