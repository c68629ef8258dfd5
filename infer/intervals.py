"""Uncertainty of the eval's numbers: a seeded percentile bootstrap over prompts, one decoder or two paired.

Prompts, not rounds, are the unit that is resampled: rounds of one prompt share its text (a code prompt's rounds all
run long), so treating them as independent would give intervals far too narrow. Every pooled number here is a ratio
of per-prompt sums (tau = committed tokens / rounds, S_j = rounds reaching j accepted drafts / rounds, projected
speedup = committed tokens / the rounds' cost), and a replicate recomputes the ratio over the resampled prompts.
Two decoders run on the same prompts are compared pairwise: one set of resampled prompts serves both, so what the
prompts share (a hard prompt is hard for both) cancels in the difference.

Hand-written (about 60 lines of numpy) because scipy.stats.bootstrap handles neither a ratio of sums with paired
samples nor the "not resolved" reading this project reports, and scipy is not otherwise a dependency.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

REPLICATES = 2000  # percentile-interval ends move by about 0.005 of their width between seeds at this count
# Below this many prompts a bootstrap has too few distinct resamples for its percentile ends to mean a 95% interval
# (2 prompts give 3 values), so no difference is called resolved, however far from 0 its interval lies.
MIN_PROMPTS = 10
SEED = 0
LEVEL = 0.95


def resamples(prompts: int, replicates: int = REPLICATES, seed: int = SEED) -> np.ndarray:
    """[replicates, prompts] prompt indices drawn with replacement; the same seed gives the same draws, so two
    decoders bootstrapped over the same prompts with the same seed are paired."""
    return np.random.default_rng(seed).integers(0, prompts, size=(replicates, prompts))


def percentile_interval(replicates: np.ndarray, level: float) -> tuple[float, float]:
    """The central `level` interval of bootstrap replicates (a percentile bootstrap), over the finite ones; NaNs
    where most replicates are undefined."""
    finite = replicates[np.isfinite(replicates)]
    if finite.size < 0.5 * replicates.size:  # most draws undefined (e.g. no round at all): no interval
        return math.nan, math.nan
    tail = 100 * (1 - level) / 2
    lo, hi = np.percentile(finite, [tail, 100 - tail])
    return float(lo), float(hi)


def _ratio(num: np.ndarray, den: np.ndarray, draws: np.ndarray) -> np.ndarray:
    top, bottom = num[draws].sum(axis=-1), den[draws].sum(axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(bottom > 0, top / np.where(bottom > 0, bottom, 1), np.nan)


def ratio_interval(
    num: Sequence[float], den: Sequence[float], *, replicates: int = REPLICATES, seed: int = SEED, level: float = LEVEL
) -> tuple[float, float]:
    """The bootstrap interval of sum(num) / sum(den), num and den one entry per prompt."""
    num, den = np.asarray(num, np.float64), np.asarray(den, np.float64)
    if num.shape != den.shape or num.ndim != 1:
        raise ValueError(f"one numerator and one denominator per prompt, got {num.shape} and {den.shape}")
    if not num.size or not np.all(np.isfinite(num)) or not np.all(np.isfinite(den)):
        return math.nan, math.nan
    return percentile_interval(_ratio(num, den, resamples(num.size, replicates, seed)), level)


def mean_interval(values: Sequence[float], **kwargs) -> tuple[float, float]:
    """The bootstrap interval of a mean over prompts (e.g. tau per prompt)."""
    values = np.asarray(values, np.float64)
    return ratio_interval(values, np.ones_like(values), **kwargs)


def paired_difference(
    a: tuple[Sequence[float], Sequence[float]],
    b: tuple[Sequence[float], Sequence[float]],
    *,
    replicates: int = REPLICATES,
    seed: int = SEED,
    level: float = LEVEL,
) -> dict:
    """A - B for two ratios of per-prompt sums over the same prompts in the same order, a = (num, den):
    {difference, low, high, prompts, resolved}; resolved = the interval excludes 0 over at least MIN_PROMPTS."""
    (an, ad), (bn, bd) = (tuple(np.asarray(x, np.float64) for x in side) for side in (a, b))
    if not (an.shape == ad.shape == bn.shape == bd.shape) or an.ndim != 1:
        raise ValueError("a paired comparison needs both decoders' numbers on the same prompts")
    n = an.size
    point = (an.sum() / ad.sum() - bn.sum() / bd.sum()) if n and ad.sum() > 0 and bd.sum() > 0 else math.nan
    lo = hi = math.nan
    if n and all(np.all(np.isfinite(x)) for x in (an, ad, bn, bd)):
        draws = resamples(n, replicates, seed)
        lo, hi = percentile_interval(_ratio(an, ad, draws) - _ratio(bn, bd, draws), level)
    resolved = bool(n >= MIN_PROMPTS and math.isfinite(lo) and (lo > 0 or hi < 0))
    return {"difference": float(point), "low": lo, "high": hi, "prompts": n, "resolved": resolved}


def sentence(name_a: str, name_b: str, diff: dict, what: str = "tau", digits: int = 3) -> str:
    """One line a reader can quote: 'A ahead of B on tau by d [lo, hi]' when the interval excludes 0, else
    'A against B on tau: not resolved at N prompts (d [lo, hi])'."""
    d, lo, hi, n = diff["difference"], diff["low"], diff["high"], diff["prompts"]
    span = (
        f"{name_a} - {name_b} = {d:+.{digits}f} [{lo:+.{digits}f}, {hi:+.{digits}f}], "
        f"95% paired bootstrap over {n} prompts"
    )
    if not diff["resolved"]:
        few = f", fewer than {MIN_PROMPTS}" if n < MIN_PROMPTS else ""
        return f"{name_a} against {name_b} on {what}: not resolved at {n} prompts{few} ({span})"
    ahead, behind = (name_a, name_b) if d > 0 else (name_b, name_a)
    return f"{ahead} ahead of {behind} on {what} by {abs(d):.{digits}f} ({span})"


# --- a decoder's per-prompt records (infer.eval's `per_prompt`): what each interval is computed from -------------


def prompt_sums(records: list[dict], k: int) -> dict:
    """Per prompt: committed tokens, rounds, and rounds reaching j accepted drafts (j = 1..K-1), counted on what
    each round committed (`accept_lengths`)."""
    lengths = [np.asarray(r["accept_lengths"], np.int64) for r in records]
    return {
        "tokens": np.array([x.sum() for x in lengths], np.float64),
        "rounds": np.array([x.size for x in lengths], np.float64),
        "reached": np.array([[np.sum(x - 1 >= j) for j in range(1, k)] for x in lengths], np.float64).reshape(
            len(lengths), max(k - 1, 0)
        ),
    }


def decoder_intervals(records: list[dict], k: int, costs: dict[str, list[float]] | None = None, **kwargs) -> dict:
    """95% bootstrap intervals over prompts of a decoder's tau (pooled and per prompt), survival S_1..S_{K-1} and
    the projected speedup under each profile (costs: {profile: each prompt's summed round cost in plain steps})."""
    sums = prompt_sums(records, k)
    per_prompt = [sums["tokens"][i] / sums["rounds"][i] for i in range(len(records)) if sums["rounds"][i]]
    return {
        "tau_ci": list(ratio_interval(sums["tokens"], sums["rounds"], **kwargs)),
        "tau_per_prompt_ci": list(mean_interval(per_prompt, **kwargs)),
        "survival_ci": [list(ratio_interval(sums["reached"][:, j], sums["rounds"], **kwargs)) for j in range(k - 1)],
        "projected_speedup_ci": {
            name: list(ratio_interval(sums["tokens"], cost, **kwargs)) for name, cost in (costs or {}).items()
        },
        "interval_note": f"95% percentile bootstrap over the {len(records)} prompts ({REPLICATES} replicates, seed "
        f"{SEED}); every ratio recomputed over the resampled prompts",
    }


def _same_prompts(a: list[dict], b: list[dict]) -> None:
    ids_a, ids_b = [r.get("id") for r in a], [r.get("id") for r in b]
    if ids_a != ids_b:
        raise ValueError("a paired comparison needs both decoders on the same prompts in the same order")


def compare_tau(records_a: list[dict], records_b: list[dict], **kwargs) -> dict:
    """Paired A - B on tau (committed tokens per round) over the same prompts."""
    _same_prompts(records_a, records_b)
    a, b = prompt_sums(records_a, 1), prompt_sums(records_b, 1)
    return paired_difference((a["tokens"], a["rounds"]), (b["tokens"], b["rounds"]), **kwargs)


def compare_projected(records_a: list[dict], costs_a, records_b: list[dict], costs_b, **kwargs) -> dict:
    """Paired A - B on projected speedup (committed tokens / the rounds' cost) over the same prompts: the
    comparison for decoders of different K, whose taus buy rounds of different cost."""
    _same_prompts(records_a, records_b)
    a, b = prompt_sums(records_a, 1), prompt_sums(records_b, 1)
    return paired_difference((a["tokens"], costs_a), (b["tokens"], costs_b), **kwargs)


# --- the comparisons a table states -------------------------------------------------------------------------------


def _is_baseline(name: str) -> bool:
    return name.startswith("ngram")


def comparisons(reports: dict[str, dict], profile: str, pairs: list[tuple[str, str]] = ()) -> list[dict]:
    """The paired comparisons an eval states, each {a, b, what, ...paired_difference, sentence}:
    - every drafter against n-gram at the drafter's own K, on tau (a baseline at another K is never the yardstick);
    - the first decoder (the one under test) against every other drafter: on tau at equal K; at different K on
      tau and on the projected speedup under `profile` (a wider block's tau buys rounds of another cost);
    - `pairs`: further (a, b) names, compared the same way.
    Reports need `per_prompt` records and, for projected comparisons, `projected_cost_per_prompt`."""
    names = list(reports)
    drafters = [n for n in names if not _is_baseline(n)]
    baseline_at = {}
    for n in names:
        if _is_baseline(n) and not reports[n].get("adaptive"):
            baseline_at.setdefault(reports[n]["block_size"], n)
    wanted = [(d, baseline_at[reports[d]["block_size"]]) for d in drafters if reports[d]["block_size"] in baseline_at]
    wanted += [(drafters[0], d) for d in drafters[1:]] + [p for p in pairs if p[0] in reports and p[1] in reports]
    out, seen = [], set()
    for a, b in wanted:
        if (a, b) in seen or a == b:
            continue
        seen.add((a, b))
        ra, rb = reports[a], reports[b]
        found = [("tau", compare_tau(ra["per_prompt"], rb["per_prompt"]))]
        if ra["block_size"] != rb["block_size"]:
            ca = (ra.get("projected_cost_per_prompt") or {}).get(profile)
            cb = (rb.get("projected_cost_per_prompt") or {}).get(profile)
            if ca is not None and cb is not None:
                found.append(
                    (f"projected speedup ({profile})", compare_projected(ra["per_prompt"], ca, rb["per_prompt"], cb))
                )
        for what, diff in found:
            name_a, name_b = f"{a} (K={ra['block_size']})", f"{b} (K={rb['block_size']})"
            out.append({"a": a, "b": b, "what": what, **diff, "sentence": sentence(name_a, name_b, diff, what)})
    return out


def format_comparisons(found: list[dict]) -> str:
    """The comparisons as lines, with how many were made: at 95% each, about 1 in 20 differences that are not
    there reads as resolved, so a lone resolved line among many asks for a second look."""
    if not found:
        return ""
    resolved = sum(c["resolved"] for c in found)
    head = (
        f"paired comparisons ({len(found)} made, {resolved} resolved; with {len(found)} at 95% each, about "
        f"{0.05 * len(found):.1f} would read as resolved by chance where nothing differs):"
    )
    return "\n".join([head, *(f"- {c['sentence']}" for c in found)])
