"""Adaptive width, a round strategy of infer/spec.py: verify only the first w tokens of the block, w chosen each
round to maximise the expected committed tokens per unit of measured cost.

The candidates (`infer.width_choice.default_widths`) are the branches of one `lax.switch`, so each compiles once.
Confidence comes from the proposer (its probability for each draft) or, where it gives none, from the acceptance
measured so far for the row's source (`infer.width_choice.measured_rates`). The costs are a verify at each width
and the drafter's forward, timed by `infer.engine.Engine.calibrate` at the decode's own shapes; they and the
acceptance counts are this strategy's own state (`infer.width_choice.WidthState`, the decode state's `strategy`),
data rather than static arguments, so no recompile.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from infer.proposers import SOURCES, scored
from infer.spec import DecodePlan, DecodeState, Verified, verify_forward
from infer.width_choice import best_rate, measured_rates


@jax.named_scope("choose_width")
def choose_width(conf_BJ, live_B, widths: tuple[int, ...], cost_Z):
    """Index into `widths` of the verify width with the most expected committed tokens per unit of cost.

    conf_BJ[b, j-1]: probability that draft j of row b is right given drafts 1..j-1 were (a row's K-1 drafts);
    verifying w tokens commits 1 + sum_{j < w} prod_{i <= j} conf[b, i-1] in expectation (the bonus plus the
    accepted drafts). cost_Z: the round's cost at each width (same unit). Rows that are done count for nothing.
    """
    reach_BJ = jnp.cumprod(conf_BJ, axis=1)  # P(drafts 1..j all accepted)
    return best_rate(reach_BJ, live_B, widths, cost_Z)


def verify_width(target, proposer, params, st: DecodeState, last_B, key, plan: DecodePlan) -> Verified:
    """The adaptive strategy: draft K-1 tokens, verify the first w of the block, w in `widths` chosen by
    `choose_width` from the drafts' confidence and the measured cost of a round at each width."""
    k, widths, own = plan.k, plan.widths, st.strategy
    prop = scored(proposer, params, target, st.draft, st.history, st.n, k)
    measured_BJ = measured_rates(own.tries, own.hits)[prop.source]
    conf = jnp.where(jnp.isnan(prop.prob), measured_BJ, prop.prob)
    cost_Z = own.verify_ms_Z + jnp.where(prop.drafted, own.draft_ms, 0.0)
    choice = choose_width(conf, ~st.done, widths, cost_Z)
    branches = [
        functools.partial(verify_forward, target, proposer, width=w, k=k, temperature=plan.temperature, branch=True)
        for w in widths
    ]
    tok, a, feats, kv, nonfinite = jax.lax.switch(choice, branches, st, last_B, prop.tokens, key)
    cache = st.cache.append(*kv)  # positions past the chosen width hold padding, above what crop keeps
    width = jnp.asarray(widths, jnp.int32)[choice]
    # Draft j was tried when it was verified and drafts 1..j-1 were accepted; hit when it was accepted too.
    j = jnp.arange(1, k)[None, :]
    tried_BJ = (~st.done[:, None] & (j < width) & (a[:, None] >= j - 1)).astype(jnp.float32)
    hit_BJ = tried_BJ * (a[:, None] >= j)
    by_source = jax.nn.one_hot(prop.source, len(SOURCES), dtype=jnp.float32)  # [B, sources]
    own = own.replace(tries=own.tries + by_source.T @ tried_BJ, hits=own.hits + by_source.T @ hit_BJ)
    return Verified(prop, tok, a, feats, cache, nonfinite, width, own)
