"""The eval's metrics from a hand-made acceptance record, checked against numbers worked out by hand: survival,
conditional acceptance, both taus, projected speedups (flat and K-dependent verify costs, interpolation, refusal),
the committed accelerator profiles, the tables and plot, and eval.json's strict JSON."""

import json
import math

import numpy as np
import pytest

from infer import eval as ev
from infer import measure, metrics, report
from infer.loading import Draft
from infer.projection import HEADLINE_PROFILE, PROFILE_DIR, Profile, available_profiles, load_profiles, project
from infer.proposers import NGramProposer

# Two prompts: accepted drafts per round 3, 0, 5 and 1, 1; committed = accepted + 1 (the bonus token).
ACCEPTED = [[3, 0, 5], [1, 1]]
LENGTHS = [[a + 1 for a in prompt] for prompt in ACCEPTED]  # [4, 1, 6], [2, 2]
POOLED = [a for prompt in LENGTHS for a in prompt]
K = 6  # up to 5 drafts a round

FLAT = Profile("flat", {1: 1.0, 64: 1.0}, draft_cost=0.7)
# Verify cost rising with K: 1 at K=1, 2 at K=4, 3 at K=8 (linear between).
RISING = Profile("rising", {1: 1.0, 4: 2.0, 8: 3.0}, draft_cost=0.5, lookup_draft_cost=0.1)


class _Drafter:
    """Stands in for a DFlash proposer: anything not a lookup proposer counts as running a drafter forward."""


def _records(widths=None, drafted=None) -> list[dict]:
    out = []
    for i, lengths in enumerate(LENGTHS):
        tokens = list(range(sum(lengths) + 1))
        rec = {
            "id": f"p{i}",
            "plain_tokens": tokens,
            "spec_tokens": tokens,
            "accept_lengths": lengths,
            "plain_decode_s": [1.0],
            "spec_decode_s": [0.5],
        }
        if widths is not None:
            rec["verify_widths"] = widths[i]
        if drafted is not None:
            rec["drafted"] = drafted[i]
        out.append(rec)
    return out


def _strict_loads(text: str):
    """json.loads that refuses NaN and Infinity, as a strict (RFC 8259) parser does."""

    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_survival_and_conditional_acceptance():
    # Rounds with >= j accepted drafts: j=0: 5, 1: 4, 2: 2, 3: 2, 4: 1, 5: 1.
    assert metrics.survival(POOLED, K) == [4 / 5, 2 / 5, 2 / 5, 1 / 5, 1 / 5]
    assert metrics.conditional_acceptance(POOLED, K) == [4 / 5, 2 / 4, 2 / 2, 1 / 2, 1 / 1]
    # 1 + sum of the survival = committed tokens per round.
    assert 1 + sum(metrics.survival(POOLED, K)) == pytest.approx(metrics.tau_pooled(POOLED))
    # A position no round reached has no conditional rate; no rounds at all, no survival.
    assert math.isnan(metrics.conditional_acceptance([1, 2], 4)[2])
    assert all(math.isnan(s) for s in metrics.survival([], 3))


def test_the_two_taus_differ_on_unequal_prompts():
    assert metrics.tau_pooled(POOLED) == 15 / 5 == 1 + sum(map(sum, ACCEPTED)) / 5
    assert metrics.tau_per_prompt(LENGTHS) == pytest.approx(((4 + 1 + 6) / 3 + (2 + 2) / 2) / 2)  # 17/6
    assert metrics.tau_per_prompt(LENGTHS) != metrics.tau_pooled(POOLED)
    # A prompt with no round (its answer ended at the prefill's token) has no mean: left out, not a zero.
    assert metrics.tau_per_prompt([*LENGTHS, []]) == metrics.tau_per_prompt(LENGTHS)
    assert math.isnan(metrics.tau_per_prompt([[]])) and math.isnan(metrics.tau_pooled([]))


def test_interpolation_between_measured_widths():
    points = {1: 1.0, 4: 2.5, 8: 4.5}
    assert metrics.interpolate_cost(points, 1) == 1.0 and metrics.interpolate_cost(points, 8) == 4.5
    assert metrics.interpolate_cost(points, 2) == pytest.approx(1.5)
    assert metrics.interpolate_cost(points, 6) == pytest.approx(3.5)
    assert metrics.interpolate_cost({"1": 1.0, "16": 2.0}, 4) == pytest.approx(1.2)  # keys as read from JSON
    for outside in (0, 9):
        with pytest.raises(ValueError, match=rf"profile p: width K={outside} is outside .* K=1\.\.8"):
            metrics.interpolate_cost(points, outside, "profile p")


def test_projected_speedup_on_a_flat_profile():
    n = len(POOLED)
    speedup, cost = metrics.projected_speedup(
        POOLED, [K] * n, [True] * n, verify_cost=FLAT.verify_cost, draft_cost=FLAT.draft_cost
    )
    assert cost == pytest.approx(1.7) and speedup == pytest.approx(3.0 / 1.7)
    # The same rounds from a lookup proposer pay the verify only (lookup_draft_cost 0).
    speedup, cost = metrics.projected_speedup(
        POOLED, [K] * n, [False] * n, verify_cost=FLAT.verify_cost, draft_cost=FLAT.draft_cost
    )
    assert cost == 1.0 and speedup == 3.0


def test_projected_speedup_when_the_verify_cost_rises_with_k():
    n = len(POOLED)

    def at(width, drafted=True):
        return metrics.projected_speedup(
            POOLED,
            [width] * n,
            [drafted] * n,
            verify_cost=RISING.verify_cost,
            draft_cost=RISING.draft_cost,
            lookup_draft_cost=RISING.lookup_draft_cost,
        )

    # K=6: verify 2 + (6 - 4) / 4 = 2.5, + draft 0.5 = 3.0 plain steps a round; tau 3.0.
    assert at(6) == pytest.approx((1.0, 3.0))
    # K=2: verify 1 + 1/3, + 0.5; K=8: 3 + 0.5. Same tau, different projections.
    assert at(2)[0] == pytest.approx(3.0 / (4 / 3 + 0.5)) and at(8)[0] == pytest.approx(3.0 / 3.5)
    assert at(6, drafted=False) == pytest.approx((3.0 / 2.6, 2.6))
    # Per-round widths and drafter flags (an adaptive hybrid): each round costs its own.
    widths, drafted = [6, 2, 6, 4, 4], [True, False, True, True, False]
    costs = [2.5 + 0.5, 4 / 3 + 0.1, 2.5 + 0.5, 2.0 + 0.5, 2.0 + 0.1]
    speedup, cost = metrics.projected_speedup(
        POOLED, widths, drafted, verify_cost=RISING.verify_cost, draft_cost=0.5, lookup_draft_cost=0.1
    )
    assert speedup == pytest.approx(15 / sum(costs)) and cost == pytest.approx(sum(costs) / 5)


def test_project_reads_widths_and_drafter_flags_from_the_records_and_refuses_by_name():
    profiles = {"flat": FLAT, "rising": RISING}
    # No verify_widths or drafted in the records: every round at the block size, a drafter forward each round.
    out = project(profiles, _records(), K, has_drafter=True)
    assert out["projected_speedup"] == pytest.approx({"flat": 3.0 / 1.7, "rising": 1.0})
    assert out["projected_round_cost"] == pytest.approx({"flat": 1.7, "rising": 3.0})
    assert out["projection_refused"] == {}
    # The hybrid skipped the drafter in two rounds; those pay lookup_draft_cost.
    out = project(profiles, _records(drafted=[[True, False, True], [False, True]]), K, has_drafter=True)
    assert out["projected_round_cost"]["rising"] == pytest.approx((3 * 3.0 + 2 * 2.6) / 5)
    # A lookup proposer's rounds never pay draft_cost, whatever its flags say (a lookup tree's build sets them).
    assert project({"flat": FLAT}, _records(), K, has_drafter=False)["projected_speedup"]["flat"] == 3.0
    # A width past a profile's curve: that profile refuses, by name; the others still project.
    out = project(profiles, _records(widths=[[6, 6, 9], [6, 6]]), K, has_drafter=True)
    assert math.isnan(out["projected_speedup"]["rising"]) and "profile rising" in out["projection_refused"]["rising"]
    assert "K=9" in out["projection_refused"]["rising"] and out["projected_speedup"]["flat"] == pytest.approx(3 / 1.7)


def test_summarize_reports_every_new_key():
    rep = measure.summarize(
        _records(), Draft("dflash", _Drafter(), None, K), max_new_tokens=16, profiles={"flat": FLAT}
    )
    assert rep["tau"] == rep["tau_pooled"] == 3.0 and rep["tau_headline"] == "tau_pooled"
    assert rep["tau_per_prompt"] == pytest.approx(17 / 6)
    assert rep["survival"] == rep["acceptance_unconditional"] == [4 / 5, 2 / 5, 2 / 5, 1 / 5, 1 / 5]
    assert rep["acceptance_conditional"] == [4 / 5, 2 / 4, 2 / 2, 1 / 2, 1 / 1]
    assert rep["projected_speedup"] == {"flat": pytest.approx(3.0 / 1.7)}
    assert "tau_pooled" in rep["tau_note"] and "not a timing" in rep["projection_note"]
    # An n-gram decoder on the same rounds is projected with no drafter forward.
    ngram = measure.summarize(_records(), Draft("ngram", NGramProposer(), None, K), 16, profiles={"flat": FLAT})
    assert ngram["projected_speedup"] == {"flat": 3.0}
    # Default: every committed profile.
    assert set(measure.summarize(_records(), Draft("ngram", NGramProposer(), None, K), 16)["projected_speedup"]) == set(
        available_profiles()
    )


def _verify(p, k: int) -> float:
    """A profile's verify cost at width k, whatever its kind (a measured table or a roofline's function)."""
    return metrics.round_costs([k], [False], verify_cost=p.verify_cost, draft_cost=0.0, lookup_draft_cost=0.0)[0]


def test_committed_profiles():
    profiles = load_profiles()
    roofline = {"tpu-v5p", "tpu-v6e", "h100", "h200"}
    assert roofline | {"this-machine"} <= set(profiles) and next(iter(profiles)) == HEADLINE_PROFILE
    for name, p in profiles.items():
        assert _verify(p, 1) == 1.0 and p.source, name
        raw = json.loads((PROFILE_DIR / f"{name}.json").read_text())
        assert raw["name"] == name and raw["derivation"], name
    for name in roofline:
        summary = profiles[name].summary()
        assert summary["kind"] == "roofline" and all(summary["spec_sources"].values()), name
        assert (summary["target"], summary["batch"], summary["context"]) == ("qwen3-8b", 1, 1024), name
        assert summary["peak_bf16_flops"] > 0 and summary["hbm_bytes_per_s"] > 0 and summary["ridge_k"] > 16, name
        # one overhead for every chip, calibrated on v5p; a lookup round pays it, a DFlash round pays it and more
        assert summary["overhead"] == pytest.approx(0.4514, abs=1e-4), name
        p = profiles[name]
        assert p.lookup_draft_cost(16) < p.draft_cost(16), name
    v5p, cpu = profiles["tpu-v5p"], profiles["this-machine"]
    # v5p, Qwen3-8B at batch 1: flat to its ridge (K=168), then about linear in K (infer/roofline.py; the numbers
    # are worked by hand in tests/test_roofline.py)
    assert _verify(v5p, 16) == _verify(v5p, 128) == 1.0 and _verify(v5p, 256) == pytest.approx(1.603, abs=1e-3)
    assert v5p.summary()["ridge_k"] == 168
    # the measured curve: interpolated, a width past it refused by name
    assert metrics.interpolate_cost(cpu.verify_cost, 16) == pytest.approx(1.944)
    with pytest.raises(ValueError, match="profile this-machine"):
        metrics.projected_speedup([2], [256], [True], verify_cost=cpu.verify_cost, draft_cost=0.17, name="this-machine")
    # another target shape: the roofline profiles priced for it, the measured one as timed
    small = load_profiles(["tpu-v5p", "this-machine"], shape="smollm2-135m", batch=8)
    assert small["tpu-v5p"].summary()["target"] == "smollm2-135m" and small["tpu-v5p"].summary()["batch"] == 8
    assert small["this-machine"] == cpu
    with pytest.raises(ValueError, match="no accelerator profile 'tpu-v9'"):
        load_profiles(["tpu-v9"])


def test_strict_json_writes_nan_and_infinity_as_null():
    report = {"tau": math.nan, "speedup": math.inf, "rates": [0.5, -math.inf, np.float32(0.25)], "n": np.int64(3)}
    with pytest.raises(ValueError):
        _strict_loads(json.dumps(report, default=float))  # Python's default output is not JSON
    assert _strict_loads(metrics.strict_dumps(report)) == {
        "tau": None,
        "speedup": None,
        "rates": [0.5, None, 0.25],
        "n": 3,
    }
    # A real report: a position no round reached has a NaN conditional rate and the projection a refusal.
    rep = measure.summarize(_records(widths=[[6, 6, 200], [6, 6]]), Draft("dflash", _Drafter(), None, 8), 16)
    assert math.isnan(rep["acceptance_conditional"][-1]) and math.isnan(rep["projected_speedup"]["this-machine"])
    saved = _strict_loads(metrics.strict_dumps(rep, indent=1))
    assert saved["acceptance_conditional"][-1] is None and saved["projected_speedup"]["this-machine"] is None
    assert saved["tau_per_prompt"] == pytest.approx(17 / 6)


def test_tables_and_plot_show_both_taus_and_the_projections(tmp_path):
    profiles = load_profiles()
    wide = measure.summarize(_records(), Draft("dflash", _Drafter(), None, 64), 16, profiles=profiles)
    reports = {"dflash": wide, "ngram": measure.summarize(_records(), Draft("ngram", NGramProposer(), None, K), 16)}
    table = report.format_comparison(reports)
    assert "| tau [95%] | tau/prompt | tau, z-lab |" in table and "projected, tpu-v5p" in table
    assert "speedup, measured" in table
    p = profiles["tpu-v5p"]
    v5p = 3.0 / (p.verify_cost(64) + p.draft_cost(64))  # a K=64 round on v5p: verify, drafter forward, overhead
    # The two prompts commit 3.67 and 2.0 tokens a round: resampling them spreads every cell into a [lo, hi].
    lo, hi = wide["projected_speedup_ci"]["tpu-v5p"]
    assert lo < v5p < hi and f"| {v5p:.2f}x [{lo:.2f}, {hi:.2f}] | h100 " in table
    assert "tau (the headline) = tau_pooled" in table and f"| {wide['tau']:.3f} [" in table
    single = report.format_table(wide)
    assert "tau (committed tokens per round" in single and "| tau per prompt" in single
    assert f"| projected speedup, tpu-v5p profile (not a timing) | {v5p:.2f}x [" in single
    assert "| survival S_j" in single and "| conditional P(j" in single
    # Read back from a strict eval.json (None where a rate was NaN), the tables and plots still draw.
    saved = _strict_loads(metrics.strict_dumps(reports))
    assert report.format_comparison(saved).count("\n") == table.count("\n")
    report.plot_comparison(saved, tmp_path / "acceptance.png", title="survival")
    report.plot_acceptance(saved["dflash"], tmp_path / "one.png")
    assert (tmp_path / "acceptance.png").stat().st_size > 1000 and (tmp_path / "one.png").stat().st_size > 1000


def test_help_documents_the_profiles_and_the_headline_tau(capsys):
    with pytest.raises(SystemExit):
        ev.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--profiles" in text and "tau_pooled" in text and "headline" in text
    assert all(name in text for name in available_profiles())
    args = ["--target", "t", "--draft", "ngram", "--dataset", "d", "--max-new-tokens", "4", "--out", "o"]
    assert ev.parse_args(args).profiles is None
    assert ev.parse_args([*args, "--profiles", "h100,tpu-v5p"]).profiles == ["h100", "tpu-v5p"]
    assert ev.parse_args([*args, "--profiles", "none"]).profiles == []
    with pytest.raises(SystemExit):
        ev.parse_args([*args, "--profiles", "tpu-v9"])
