"""What every proposer shares: the `Proposer` protocol the engine calls, a round's `Proposal`, where drafts came
from (`SOURCES`, for the acceptance an adaptive engine measures per source), and the stateless hooks.

A proposer is a small frozen (hashable) object, static under jit, whose methods are pure functions of explicit
arguments; its parameters (if any) travel separately as a pytree `params`.

Dimension letters: docs/glossary.md (one glossary for the repository).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

import flax
import jax
import jax.numpy as jnp

# Where a row's drafts came from: an adaptive engine keeps a measured acceptance rate per source and position.
# Lookups are split by how far back the context agrees with the match (its match length, in buckets): inside a
# repetition loop the match is long and nearly every copied token is accepted, after a short chance match few
# are, and one rate for both would verify too little in loops and too much elsewhere.
MATCH_BUCKETS = (1, 2, 3, 4, 8, 16)  # lower bounds of the lookup buckets (a match has >= 1 token)
# "lookup 4-7": a lookup whose match is 4 to 7 tokens long (one name per bucket of MATCH_BUCKETS).
SOURCES = ("drafter", "repeat", "lookup 1", "lookup 2", "lookup 3", "lookup 4-7", "lookup 8-15", "lookup 16+")
DRAFTER, REPEAT, LOOKUP = 0, 1, 2  # LOOKUP: the first lookup bucket
LOOKUP_TREE_ORDERS = (1, 4)  # the reply n-gram orders (min_n, max_n) a lookup tree's index is built with
# Reply lookup (infer.replies) is split by how often its first draft followed its n-gram in the replies, so that an
# adaptive engine measures the acceptance of a near-certain continuation apart from a guess among many.
REPLY_BUCKETS = (0.0, 0.4, 0.6, 0.8)  # lower bounds of the reply-lookup buckets
SOURCES += ("replies <0.4", "replies 0.4-0.6", "replies 0.6-0.8", "replies 0.8+")
SOURCES += ("lookup tree",)  # the source of a grown lookup tree's round (a tree round keeps no per-source counts)
LOOKUP_TREE = SOURCES.index("lookup tree")
REPLIES = SOURCES.index("replies <0.4")  # the first reply bucket


def _bucket(value_B, lower_bounds):
    """[B] index of the bucket each value falls in, buckets given by their ascending lower bounds."""
    return jnp.sum(value_B[:, None] >= jnp.asarray(lower_bounds[1:])[None, :], axis=1).astype(jnp.int32)


def lookup_source(match_len_B):
    """SOURCES index of a lookup whose match is match_len_B tokens long."""
    return LOOKUP + _bucket(match_len_B, MATCH_BUCKETS)


def reply_source(prob_B):
    """SOURCES index of a reply lookup whose first draft followed its n-gram this often (prob_B) in the replies."""
    return REPLIES + _bucket(prob_B, REPLY_BUCKETS)


@flax.struct.dataclass
class Proposal:
    tokens: jax.Array  # [B, K-1] int32 drafts
    prob: jax.Array  # [B, K-1] fp32 the proposer's probability that each draft is the target's token; NaN = none
    source: jax.Array  # [B] int32 index into SOURCES
    drafted: jax.Array  # [] bool: a drafter forward ran this round (its cost was paid)

    @classmethod
    def unscored(cls, tokens, source, drafted: bool) -> Proposal:
        """Drafts without a probability (NaN: the engine uses the acceptance rate it measured for `source`)."""
        source = jnp.broadcast_to(jnp.asarray(source, jnp.int32), tokens.shape[:1])
        return cls(tokens, jnp.full(tokens.shape, jnp.nan), source, jnp.bool_(drafted))


def scored(proposer, params, target, state, history_BC, n_B, k) -> Proposal:
    """`proposer.propose_scored` where it exists; otherwise its drafts with no confidence (NaN: the engine uses the
    rate it measured), counted as the drafter's, whose forward ran."""
    if isinstance(proposer, Scores):
        return proposer.propose_scored(params, target, state, history_BC, n_B, k)
    return Proposal.unscored(proposer.propose(params, target, state, history_BC, n_B, k), DRAFTER, True)


def last_tokens(history_BC, n_B):
    return jnp.take_along_axis(history_BC, (n_B - 1)[:, None], axis=1)[:, 0]


class Proposer(Protocol):
    """What the engine (infer/engine.py, infer/spec.py) calls on a proposer. Optional capabilities, each a protocol
    below checked with isinstance, give it more round strategies: `Scores` (drafts with their confidence),
    `DraftsTop` (a DDTree's input), `GrowsTree` (a tree of its own), `WrapsDrafter` (a model forward inside)."""

    name: str
    layer_ids: tuple[int, ...]  # target layers whose outputs `observe` receives (() = none needed)

    def init(self, params: Any, batch: int, capacity: int) -> Any:
        """The state (a pytree; () when stateless) before the prompt is observed."""

    def observe(self, params: Any, state: Any, feats_BTF: Any, num_new_B: jax.Array) -> Any:
        """The state after target layer outputs at positions state_len[b] + 0..T-1, of which only the first
        num_new_B[b] are committed tokens (the rest are rejected drafts: written past the length or dropped)."""

    def propose(self, params: Any, target: Any, state: Any, history_BC: jax.Array, n_B: jax.Array, k: int) -> jax.Array:
        """[B, k-1] int32 drafts. history_BC[b, :n_B[b]] is the committed sequence; the block to fill is
        [history[b, n_B[b]-1], d_1 .. d_{k-1}] at positions n_B[b]-1 .. n_B[b]+k-2."""


@runtime_checkable
class Scores(Protocol):
    """Drafts with their confidence, an adaptive width's input (`scored` gives the others NaN: the measured rate)."""

    def propose_scored(self, params, target, state, history_BC, n_B, k) -> Proposal: ...


@runtime_checkable
class DraftsTop(Protocol):
    """The top tokens at each block position: ([B, K-1, top] tokens, [B, K-1, top] log-probs), a DDTree's input."""

    def propose_top(self, params, target, state, history_BC, n_B, k, top): ...


@runtime_checkable
class GrowsTree(Protocol):
    """A draft tree grown by the proposer itself (the lookup tree): ([B, E] path probabilities, DraftTree),
    verified instead of one built from propose_top."""

    def propose_tree(self, params, target, state, history_BC, n_B, k, nodes): ...


@runtime_checkable
class WrapsDrafter(Protocol):
    """A proposer with a model forward inside (a hybrid): (the model, its params), whose cost a round pays."""

    def drafter(self, params): ...


class Stateless:
    """The engine hooks of a proposer that reads no target features and keeps no state between rounds."""

    layer_ids: tuple[int, ...] = ()

    def init(self, params, batch, capacity):
        return ()

    def observe(self, params, state, feats_BTF, num_new_B):
        return state

    def propose(self, params, target, state, history_BC, n_B, k):
        return self.propose_scored(params, target, state, history_BC, n_B, k).tokens


@dataclasses.dataclass(frozen=True)
class NoProposer(Stateless):
    """No drafts: with K = 1 the engine is plain autoregressive decoding (the speedup denominator)."""

    name: str = "none"

    def propose(self, params, target, state, history_BC, n_B, k):
        return jnp.zeros((history_BC.shape[0], k - 1), jnp.int32)
