"""What the rounds that choose their verify width share (the adaptive chain, infer.adaptive, and the adaptive draft
tree, infer.tree_round): the state such a round carries, its candidate widths, and the choice of the width with the
most expected committed tokens per unit of measured cost. Below both strategies, so they stand side by side.
"""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp

from infer.proposers import SOURCES


@flax.struct.dataclass
class WidthState:
    """What a round choosing its verify width carries from round to round."""

    tries: jax.Array  # [sources, K-1] rounds where draft j was verified after drafts 1..j-1 were accepted
    hits: jax.Array  # [sources, K-1] ... and draft j was accepted too (the rates where a proposer gives none)
    verify_ms_Z: jax.Array  # [Z] measured cost of verifying each candidate width
    draft_ms: jax.Array  # [] measured cost of the drafter's forward


def initial_state(k: int, verify_ms, draft_ms) -> WidthState:
    """No round counted yet, and the costs `Engine.calibrate` measured (per candidate width, and the draft)."""
    zeros = jnp.zeros((len(SOURCES), k - 1), jnp.float32)
    return WidthState(zeros, zeros, jnp.asarray(verify_ms, jnp.float32), jnp.asarray(draft_ms, jnp.float32))


def default_widths(k: int) -> tuple[int, ...]:
    """Candidate verify widths for an adaptive engine of block size K: 1 (a plain step), powers of two, K."""
    return tuple(sorted({1, k, *(w for w in (2, 4, 8, 16, 32, 64) if w < k)}))


def best_rate(reach_BJ, live_B, widths, cost_Z):
    """argmax over widths of (expected committed tokens, summed over live rows) / cost, where verifying w tokens
    commits 1 + sum_{j < w} reach[b, j-1] in expectation: reach[b, j-1] is the probability that the j-th verified
    draft (a chain's draft j, a tree's node j in pop order) is on the accepted path."""
    expected_BK = 1.0 + jnp.concatenate([jnp.zeros_like(reach_BJ[:, :1]), jnp.cumsum(reach_BJ, axis=1)], axis=1)
    expected_BZ = expected_BK[:, jnp.asarray(widths) - 1]
    rate_Z = jnp.sum(jnp.where(live_B[:, None], expected_BZ, 0.0), axis=0) / cost_Z
    return jnp.argmax(rate_Z).astype(jnp.int32)


def measured_rates(tries, hits, prior_weight: float = 4.0):
    """[sources, K-1] acceptance rate of draft j given drafts 1..j-1 were accepted, per source: what an adaptive
    engine uses where the proposer gives no probability.

    Each position's count is shrunk towards its source's rate pooled over positions ((hits + 1) / (tries + 2)),
    worth `prior_weight` rounds. Without the pooling a position never verified keeps an even prior, so a
    proposer whose first drafts are nearly always right is still never verified wide enough to show it.
    """
    pooled = (jnp.sum(hits, axis=1) + 1.0) / (jnp.sum(tries, axis=1) + 2.0)
    return (hits + prior_weight * pooled[:, None]) / (tries + prior_weight)
