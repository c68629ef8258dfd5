"""Decoding metrics from the committed lengths of verify rounds, and a speedup projected from a round's cost.

A round commits `length` = accepted drafts + 1 tokens (the bonus: the target's own token after the last accepted
draft). With a = length - 1 accepted drafts, a round of block K accepts 0..K-1 drafts.

  survival[j-1]    S_j = P(a >= j), j = 1..K-1: the share of rounds whose first j drafts were all accepted
                   (the same numbers as `acceptance_unconditional`); 1 + sum_j S_j = tau_pooled.
  conditional[j-1] P(a >= j | a >= j-1): draft j accepted given drafts 1..j-1 were (NaN where no round got there).
  tau_pooled       1 + total accepted / total rounds = total committed / total rounds (every round weighs the same).
  tau_per_prompt   mean over prompts of each prompt's mean committed per round (every prompt weighs the same).

Projection: a plain decode step (a one-token verify) costs 1; a round of width w costs verify_cost(w) + draft_cost(w)
(lookup_draft_cost(w) where no drafter forward ran), all in plain steps, so projected speedup = committed tokens /
the rounds' summed cost. numpy only: no jax, so these numbers can be recomputed from a saved eval.json anywhere (a
roofline profile's costs with infer/roofline.py, plain Python).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence

import numpy as np


def _reached(accept_lengths: Sequence[int], k: int) -> np.ndarray:
    """reached[j] = rounds with at least j accepted drafts, j = 0..K-1 (reached[0] = every round)."""
    accepted = np.asarray(accept_lengths, np.int64) - 1
    return np.array([int(np.sum(accepted >= j)) for j in range(k)], np.int64)


def survival(accept_lengths: Sequence[int], k: int) -> list[float]:
    """[S_1, ..., S_{K-1}], S_j = #(rounds with >= j accepted drafts) / rounds; NaN for every j with no round."""
    reached = _reached(accept_lengths, k)
    rounds = int(reached[0]) if k else 0
    return [int(reached[j]) / rounds if rounds else math.nan for j in range(1, k)]


def conditional_acceptance(accept_lengths: Sequence[int], k: int) -> list[float]:
    """[c_1, ..., c_{K-1}], c_j = #(>= j accepted) / #(>= j-1 accepted); NaN where no round reached draft j."""
    reached = _reached(accept_lengths, k)
    return [int(reached[j]) / int(reached[j - 1]) if reached[j - 1] else math.nan for j in range(1, k)]


def tau_pooled(accept_lengths: Sequence[int]) -> float:
    """Committed tokens per round over all rounds of all prompts; NaN with no round."""
    lengths = np.asarray(accept_lengths, np.float64)
    return float(lengths.mean()) if lengths.size else math.nan


def tau_per_prompt(per_prompt_lengths: Sequence[Sequence[int]]) -> float:
    """Mean over prompts of each prompt's committed tokens per round. A prompt with no round (its answer ended at
    the prefill's token) has no mean and is left out; NaN when no prompt has a round."""
    means = [tau_pooled(lengths) for lengths in per_prompt_lengths if len(lengths)]
    return float(np.mean(means)) if means else math.nan


def interpolate_cost(points: Mapping[int, float], k: int, what: str = "cost") -> float:
    """A cost at width k, linear between the two nearest measured widths. A width outside the measured ones is
    refused: the curve past its last point is unknown (on a CPU it keeps rising, on an accelerator it turns up once
    the verify stops being bound by weight reads)."""
    pairs = sorted((int(w), float(c)) for w, c in points.items())
    if not pairs:
        raise ValueError(f"{what}: no measured width")
    ks, costs = zip(*pairs)
    if not ks[0] <= k <= ks[-1]:
        raise ValueError(f"{what}: width K={k} is outside its measured range K={ks[0]}..{ks[-1]}")
    return float(np.interp(k, ks, costs))


def _cost_at(cost, k: int, name: str) -> float:
    """A profile's cost at width k: a {width: cost} table (interpolated, refused outside its widths), a function of
    the width, or one number for every width."""
    if isinstance(cost, Mapping):
        return interpolate_cost(cost, k, f"profile {name}")
    if callable(cost):
        return float(cost(k))
    return float(cost)


def round_costs(
    widths: Sequence[int],
    drafter_rounds: Sequence[bool],
    *,
    verify_cost,
    draft_cost,
    lookup_draft_cost=0.0,
    name: str = "profile",
) -> list[float]:
    """Each round's cost in plain steps: verify_cost(widths[r]) plus draft_cost(widths[r]) where a drafter forward
    ran (drafter_rounds[r]), else lookup_draft_cost(widths[r]). Each cost is a {width: cost} table (linear between
    its widths; a width outside them raises ValueError naming the profile), a function of the width, or a number."""
    if len(widths) != len(drafter_rounds):
        raise ValueError("one width and one drafter flag per round")
    cache: dict[tuple[int, bool], float] = {}
    out = []
    for w, d in zip(widths, drafter_rounds):
        key = (int(w), bool(d))
        if key not in cache:
            extra = draft_cost if d else lookup_draft_cost
            cache[key] = _cost_at(verify_cost, key[0], name) + _cost_at(extra, key[0], name)
        out.append(cache[key])
    return out


def projected_speedup(
    accept_lengths: Sequence[int],
    widths: Sequence[int],
    drafter_rounds: Sequence[bool],
    *,
    verify_cost,
    draft_cost,
    lookup_draft_cost=0.0,
    name: str = "profile",
) -> tuple[float, float]:
    """(speedup, mean round cost in plain steps) of these rounds where costs follow a profile (`round_costs`: a
    table, a function of the width or a number each). Plain decoding commits 1 token per plain step, so speedup =
    committed tokens / summed round cost. Raises ValueError naming the profile for a width outside a table."""
    if not (len(accept_lengths) == len(widths) == len(drafter_rounds)):
        raise ValueError("one width and one drafter flag per round")
    if not len(accept_lengths):
        return math.nan, math.nan
    costs = round_costs(
        widths,
        drafter_rounds,
        verify_cost=verify_cost,
        draft_cost=draft_cost,
        lookup_draft_cost=lookup_draft_cost,
        name=name,
    )
    total = float(np.sum(costs))
    return float(np.sum(accept_lengths)) / total, total / len(costs)


def json_safe(obj):
    """`obj` with every NaN and infinity as None and numpy scalars and arrays as Python ones: what a strict JSON
    parser accepts (Python's json writes NaN, which JSON does not have)."""
    if isinstance(obj, Mapping):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, np.ndarray)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def strict_dumps(obj, **kwargs) -> str:
    """JSON text of `obj` with NaN and infinities written as null; raises where anything non-finite is left."""
    return json.dumps(json_safe(obj), allow_nan=False, **kwargs)
