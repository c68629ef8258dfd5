"""The eval's uncertainty: bootstrap intervals over prompts worked out by hand, pairing that cancels what the prompts
share, the "not resolved" reading, and which comparisons an eval states (n-gram at the drafter's own K)."""

import math

import numpy as np
import pytest

from infer import intervals


def test_two_prompts_give_the_three_possible_ratios_as_the_interval_ends():
    # Prompt 1: 10 tokens in 5 rounds (tau 2), prompt 2: 30 in 10 (tau 3). A replicate draws both prompts from these:
    # (1, 1) -> 20/10 = 2.0, (2, 2) -> 60/20 = 3.0, mixed -> 40/15 = 2.667; each pure draw has chance 1/4 > 2.5%, so
    # the 95% ends are exactly 2.0 and 3.0.
    assert intervals.ratio_interval([10, 30], [5, 10]) == (2.0, 3.0)
    # One prompt: every replicate is that prompt; the interval is a point.
    assert intervals.ratio_interval([12], [4]) == (3.0, 3.0)
    assert all(math.isnan(x) for x in intervals.ratio_interval([], []))


def test_the_interval_is_seeded_and_narrows_with_more_prompts():
    rng = np.random.default_rng(1)
    rounds = rng.integers(5, 40, 200).astype(float)
    tokens = rounds * rng.uniform(1.5, 3.5, 200)
    few = intervals.ratio_interval(tokens[:20], rounds[:20])
    many = intervals.ratio_interval(tokens, rounds)
    assert intervals.ratio_interval(tokens[:20], rounds[:20]) == few  # same seed, same draws
    assert intervals.ratio_interval(tokens[:20], rounds[:20], seed=1) != few
    point = tokens.sum() / rounds.sum()
    assert many[0] < point < many[1]
    # sqrt(10) times the prompts: the width shrinks by about sqrt(10) = 3.2 (between 2 and 5 here).
    assert 2.0 < (few[1] - few[0]) / (many[1] - many[0]) < 5.0


def test_pairing_resolves_a_small_steady_gain_that_prompt_to_prompt_spread_hides():
    # 40 prompts whose tau runs from 1.5 to 4.5; decoder A commits 0.05 tokens a round more than B on every prompt.
    rng = np.random.default_rng(0)
    rounds = rng.integers(10, 30, 40).astype(float)
    tau_b = rng.uniform(1.5, 4.5, 40)
    b = (tau_b * rounds, rounds)
    a = ((tau_b + 0.05) * rounds, rounds)
    lo_a, hi_a = intervals.ratio_interval(*a)
    lo_b, hi_b = intervals.ratio_interval(*b)
    assert lo_a < hi_b and lo_b < hi_a  # each alone: the intervals overlap
    diff = intervals.paired_difference(a, b)
    assert diff["difference"] == pytest.approx(0.05)
    assert diff["resolved"] and diff["low"] == pytest.approx(0.05) and diff["high"] == pytest.approx(0.05)
    line = intervals.sentence("A", "B", diff)
    assert line.startswith("A ahead of B on tau by 0.050") and "40 prompts" in line
    # The same decoder against itself: no difference, not resolved.
    same = intervals.paired_difference(b, b)
    assert same["difference"] == 0.0 and not same["resolved"]
    assert "not resolved at 40 prompts" in intervals.sentence("A", "B", same)


def test_a_difference_inside_the_noise_is_not_resolved():
    rng = np.random.default_rng(2)
    rounds = np.full(10, 20.0)
    a = (rng.uniform(1.5, 4.5, 10) * rounds, rounds)
    b = (rng.uniform(1.5, 4.5, 10) * rounds, rounds)
    diff = intervals.paired_difference(a, b)
    assert diff["low"] < 0 < diff["high"] and not diff["resolved"]
    assert intervals.sentence("wide", "narrow", diff).startswith("wide against narrow on tau: not resolved at 10")
    with pytest.raises(ValueError, match="same prompts"):
        intervals.paired_difference(a, (b[0][:9], b[1][:9]))


def _report(k: int, lengths: list[list[int]], cost_per_round: float) -> dict:
    records = [{"id": i, "accept_lengths": x} for i, x in enumerate(lengths)]
    return {
        "block_size": k,
        "per_prompt": records,
        "projected_cost_per_prompt": {"p": [cost_per_round * len(x) for x in lengths]},
    }


def test_decoder_intervals_hold_their_point_estimates():
    lengths = [[4, 1, 6], [2, 2], [5, 5, 1, 1]]
    rep = _report(8, lengths, 1.5)
    out = intervals.decoder_intervals(rep["per_prompt"], 8, rep["projected_cost_per_prompt"])
    tau = sum(map(sum, lengths)) / sum(map(len, lengths))  # 27 / 9 = 3.0
    assert out["tau_ci"][0] <= tau <= out["tau_ci"][1]
    assert out["projected_speedup_ci"]["p"][0] <= tau / 1.5 <= out["projected_speedup_ci"]["p"][1]
    s1 = 6 / 9  # rounds with >= 1 accepted draft (length >= 2)
    assert out["survival_ci"][0][0] <= s1 <= out["survival_ci"][0][1] and len(out["survival_ci"]) == 7
    assert out["survival_ci"][6] == [0.0, 0.0]  # no round reached 7 accepted drafts


def test_an_eval_compares_a_drafter_with_ngram_at_its_own_k_and_other_ks_on_projected_speedup():
    reports = {
        "wide": _report(64, [[5, 3], [2, 2, 2]], 2.0),
        "narrow": _report(16, [[4, 3], [2, 2, 3]], 1.0),
        "ngram": _report(8, [[1, 1], [2, 1, 1]], 1.0),
        "ngram@64": _report(64, [[2, 1], [1, 1, 1]], 1.5),
    }
    found = intervals.comparisons(reports, "p")
    pairs = [(c["a"], c["b"], c["what"]) for c in found]
    # wide meets n-gram at 64, never n-gram at 8; narrow has no n-gram at 16 here; wide against narrow (other K) on
    # tau and on projected speedup.
    assert pairs == [
        ("wide", "ngram@64", "tau"),
        ("wide", "narrow", "tau"),
        ("wide", "narrow", "projected speedup (p)"),
    ]
    projected = found[2]
    # wide: 14 tokens / (5 rounds x 2.0) = 1.4; narrow: 14 / (5 x 1.0) = 2.8
    assert projected["difference"] == pytest.approx(1.4 - 2.8)
    # Two prompts: the paired interval of the projected speedups lies below 0, but two prompts resolve nothing.
    assert projected["high"] < 0 and not projected["resolved"]
    assert "not resolved at 2 prompts, fewer than 10" in projected["sentence"]
    text = intervals.format_comparisons(found)
    assert text.startswith("paired comparisons (3 made,") and "about 0.2 would read as resolved by chance" in text
    with pytest.raises(ValueError, match="same prompts"):
        intervals.compare_tau(reports["wide"]["per_prompt"], reports["narrow"]["per_prompt"][:1])
