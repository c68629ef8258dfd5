"""python -m infer.teacher_forced: teacher-forced acceptance on held-out prompts with intervals over prompts, and its
gap to real decoding; the per-prompt bootstrap of the censored survival (infer/agreement.py)."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys

import numpy as np
import pytest
from conftest import FIXTURES, REPO

from data import prompt_sets
from data.prompt_sets import SUBSET_SEED
from dflash_model.drafter import build_drafter
from dflash_model.drafter_config import drafter_config_for
from dflash_model.drafter_weights import export_drafter
from infer import target_replies
from infer import teacher_forced as tf_cli
from infer.agreement import (
    censored_survival,
    gap_intervals,
    resampled_survival,
    survival_intervals,
    teacher_forced,
)
from infer.intervals import resamples
from infer.loading import load_draft_spec
from infer.plain import greedy_generate
from infer.target_spec import load_target_spec

TINY = str(FIXTURES / "tiny_qwen3")  # no tokenizer: prompts as token ids
K = 8
NEW = 16


def _nan_equal(a, b) -> bool:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return a.shape == b.shape and bool(np.all((a == b) | (np.isnan(a) & np.isnan(b))))


# --- the bootstrap of the censored survival ---------------------------------------------------------------------


def _random_rows(rng, prompts: int, k: int):
    lengths = [rng.integers(1, k + 1, rng.integers(0, 9)).tolist() for _ in range(prompts)]
    finals = [(rng.random(len(row)) < 0.8).tolist() for row in lengths]
    return lengths, finals


def test_a_resample_recomputes_the_censored_survival_over_its_prompts_blocks():
    rng = np.random.default_rng(0)
    for trial in range(50):
        lengths, finals = _random_rows(rng, int(rng.integers(1, 6)), 6)
        draws = resamples(len(lengths), 10, seed=trial)
        got = resampled_survival(lengths, finals, 6, draws)
        for r, drawn in enumerate(draws):
            a = np.asarray([x - 1 for i in drawn for x in lengths[i]], np.int64)
            f = np.asarray([x for i in drawn for x in finals[i]], bool)
            assert _nan_equal(got[r], censored_survival(a, f, 6)), (lengths, finals, drawn)


def test_intervals_hold_the_estimate_and_pair_the_gap():
    rng = np.random.default_rng(1)
    lengths = [rng.integers(1, 7, 40).tolist() for _ in range(30)]
    finals = [[True] * 39 + [False] for _ in lengths]
    a = np.asarray([x - 1 for row in lengths for x in row])
    point = censored_survival(a, np.asarray([f for row in finals for f in row]), 6)
    ci = survival_intervals(lengths, finals, 6)
    assert ci["prompts"] == 30 and len(ci["survival_ci"]) == 5
    for s, (lo, hi) in zip(point, ci["survival_ci"]):
        assert lo <= s <= hi and lo < hi
    assert ci["tau_ci"][0] <= 1 + sum(point) <= ci["tau_ci"][1]
    # Real decoding's rounds against themselves taken as never-censored blocks: no gap, in every replicate.
    same = gap_intervals(lengths, lengths, [[True] * len(r) for r in lengths], 6)
    assert all(lo == hi == 0.0 for lo, hi in same.values()) and list(same) == ["S_1", "S_2", "S_3", "tau"]
    assert all(math.isnan(x) for x in survival_intervals([], [], 4)["tau_ci"])


def test_held_out_prompts_skip_the_first_of_both_orders():
    order = list(range(80))
    random.Random(SUBSET_SEED).shuffle(order)
    held = prompt_sets.held_out_order(80, 40)
    assert not set(held) & (set(range(40)) | set(order[:40]))
    assert held == [i for i in order if i in set(held)]  # z-lab's order kept
    assert len(held) == 80 - len(set(range(40)) | set(order[:40]))
    five = list(range(5))
    random.Random(SUBSET_SEED).shuffle(five)
    assert prompt_sets.held_out_order(5, 0) == five  # --skip 0: z-lab's own subset
    rows = [{"id": "a", "text": "1"}, {"id": "a/turn2", "text": "2", "earlier_turns": ["1"]}, {"id": "b", "text": "3"}]
    assert [[r["id"] for r in item] for item in prompt_sets.group_items(rows)] == [["a", "a/turn2"], ["b"]]
    # Named sets keep items whole; a file's rows are taken after the first `skip`.
    picked, info = prompt_sets.held_out(rows, True, 0, 1)
    assert [r["id"] for r in picked] in (["a", "a/turn2"], ["b"]) and info["items_in_set"] == 2
    assert prompt_sets.held_out(rows, False, 1, 5)[0] == rows[1:]


# --- the CLI on the tiny target -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A random drafter for the tiny target exported to a directory, 5 prompts of token ids, and a run over the
    3 after the first (--skip 1 --limit 3) with the first 2 decoded for real."""
    tmp = tmp_path_factory.mktemp("tf")
    target = load_target_spec(TINY)
    cfg = drafter_config_for(target.config, mask_token_id=511, num_layers=1, block_size=K, target_layer_ids=(0, 1))
    # Its draft vocabulary: tokens the target repeats in these replies, so that the random drafter's drafts are
    # sometimes right (survival above 0, real rounds of several lengths) and the vocabulary path is the served one.
    vocab = [411, 209, 340]
    drafter_dir = export_drafter(build_drafter(cfg, seed=0), cfg, tmp / "drafter", dtype="float32", draft_vocab=vocab)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 500, n).tolist() for n in (7, 9, 14, 20, 11)]
    data = tmp / "p.jsonl"
    data.write_text("".join(json.dumps({"id": f"p{i}", "prompt_ids": p}) + "\n" for i, p in enumerate(prompts)))
    args = ["--target", TINY, "--draft", str(drafter_dir), "--dataset", str(data), "--skip", "1", "--limit", "3"]
    args += ["--max-new-tokens", str(NEW), "--real", "2", "--out", str(tmp / "out"), "--no-progress"]
    rep = tf_cli.main(args)
    return target, str(drafter_dir), prompts[1:4], rep, tmp / "out", args


def test_the_report_is_teacher_forced_called_directly(tiny_run):
    target, drafter_dir, prompts, rep, out, _ = tiny_run
    written = json.loads((out / "teacher_forced.json").read_text())
    assert written["sets"].keys() == rep["sets"].keys() and "uniformly chosen position" in written["estimates"]
    (name, got), *_ = written["sets"].items()
    assert got["prompts"] == 3 and [p["id"] for p in got["per_prompt"]] == ["p1", "p2", "p3"]
    replies = greedy_generate(target.model, prompts, NEW)
    assert [p["reply"] for p in got["per_prompt"]] == replies
    draft = load_draft_spec(drafter_dir, target.config)
    want = teacher_forced(target.model, draft.params, K, prompts, replies, vocab=draft.proposer.vocab)
    assert [p["accept_lengths"] for p in got["per_prompt"]] == want["accept_lengths"]
    assert [p["final"] for p in got["per_prompt"]] == want["final"]
    assert (got["blocks"], got["censored"]) == (want["blocks"], want["censored"]) == (3 * (NEW - 1), got["censored"])
    assert _nan_equal(got["survival"], want["survival"]) and got["tau"] == pytest.approx(want["tau"])
    assert draft.proposer.vocab == (411, 209, 340) and got["survival"][0] > 0.05 and got["tau_ci"][1] > 1.0
    for s, (lo, hi) in zip(got["survival"], got["survival_ci"]):
        assert lo <= hi and lo - 1e-12 <= s <= hi + 1e-12
    assert got["tau_ci"][0] <= got["tau"] <= got["tau_ci"][1]
    table = (out / "table.md").read_text()
    assert f"| {name} | 3 | {got['blocks']} |" in table and "real decoding" in table


def test_real_decoding_is_the_pass_at_its_own_round_starts(tiny_run):
    target, drafter_dir, prompts, rep, _, _ = tiny_run
    real = next(iter(rep["sets"].values()))["real"]
    check = real["rounds_check"]
    assert check["prompts"] == 2 and check["replies_equal"] == 2
    assert check["rounds_equal"] == check["rounds"] == sum(map(len, real["real_accept_lengths"])) > 0
    assert max(a for row in real["real_accept_lengths"] for a in row) >= 3  # rounds that accepted drafts
    # As tests/test_agreement.py checks it: replies K longer than the decode, so no round's block is censored.
    draft = load_draft_spec(drafter_dir, target.config)
    longer = greedy_generate(target.model, prompts[:2], NEW + K)
    at_rounds = teacher_forced(
        target.model,
        draft.params,
        K,
        prompts[:2],
        longer,
        rounds=real["real_accept_lengths"],
        vocab=draft.proposer.vocab,
    )
    assert at_rounds["censored"] == 0 and at_rounds["accept_lengths"] == real["real_accept_lengths"]
    assert real["gap"]["tau"] == pytest.approx(real["real"]["tau"] - real["teacher_forced"]["tau"])
    assert set(real["gap_ci"]) == {"S_1", "S_2", "S_3", "tau"}


def test_a_second_run_reuses_the_replies(tiny_run, tmp_path, monkeypatch):
    _, _, _, rep, out, args = tiny_run

    def refuse(*a, **k):
        raise AssertionError("a reply was decoded again")

    monkeypatch.setattr(target_replies, "greedy_replies", refuse)
    base = [a for a in args if a not in ("--real", "2")][:-3]  # without --real 2 and --out DIR --no-progress
    again = tf_cli.main([*base, "--replies", str(out), "--out", str(tmp_path / "again"), "--no-progress"])
    assert again["replies_reused"] == 3
    first, second = (next(iter(r["sets"].values())) for r in (rep, again))
    assert [p["reply"] for p in second["per_prompt"]] == [p["reply"] for p in first["per_prompt"]]
    assert _nan_equal(second["survival"], first["survival"]) and second["survival_ci"] == first["survival_ci"]
    with pytest.raises(ValueError, match=r"--replies .*: other replies .*max_new_tokens 16 there, 12 here"):
        tf_cli.main([*base, "--max-new-tokens", "12", "--replies", str(out), "--out", str(tmp_path / "o")])


# --- bad input ----------------------------------------------------------------------------------------------------


def _args(tmp_path, drafter: str, *extra):
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"prompt_ids": [1, 2, 3]}) + "\n")
    return ["--target", TINY, "--draft", drafter, "--dataset", str(data), "--skip", "0", *extra]


def test_bad_inputs_are_refused_by_name(tiny_run, tmp_path, capsys):
    _, drafter_dir, _, _, _, _ = tiny_run
    with pytest.raises(ValueError, match=r"--draft '.*nope': not a DFlash drafter directory"):
        tf_cli.main(_args(tmp_path, str(tmp_path / "nope"), "--out", str(tmp_path / "o")))
    with pytest.raises(ValueError, match=r"--block 9: this drafter was trained with K=8"):
        tf_cli.main(_args(tmp_path, drafter_dir, "--block", "9", "--out", str(tmp_path / "o")))
    afile = tmp_path / "a-file"
    afile.write_text("")
    with pytest.raises(ValueError, match=r"--out '.*a-file': an existing file"):
        tf_cli.main(_args(tmp_path, drafter_dir, "--out", str(afile)))
    with pytest.raises(ValueError, match=r"--dataset .*: no prompt left after --skip 5"):
        tf_cli.main(_args(tmp_path, drafter_dir, "--out", str(tmp_path / "o"), "--skip", "5"))
    for flag in ("--limit", "--real"):
        with pytest.raises(SystemExit) as exc:
            tf_cli.main(_args(tmp_path, drafter_dir, flag, "-1", "--out", str(tmp_path / "o")))
        assert exc.value.code == 2 and f"argument {flag}" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "DFLASH_TRACEBACK"}
    args = _args(tmp_path, str(tmp_path / "nope"), "--out", str(tmp_path / "o"))
    proc = subprocess.run(
        [sys.executable, "-m", "infer.teacher_forced", *args], capture_output=True, text=True, env=env, cwd=REPO
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-1500:]
    assert proc.stderr.startswith("error: --draft "), proc.stderr


# --- the shipped drafter on the embedded target -------------------------------------------------------------------


@pytest.mark.long
def test_shipped_drafter_on_held_out_humaneval(tmp_path):
    """2 held-out HumanEval prompts x 16 new tokens with the shipped drafter: the teacher-forced numbers are
    nontrivial and real decoding at its own round starts is the pass (a few minutes on a 2-core CPU)."""
    rep = tf_cli.main(
        [
            "--target",
            "smollm2",
            "--draft",
            str(REPO / "drafters" / "smollm2-135m-dflash"),
            "--dataset",
            "humaneval",
            "--offline",
            "--limit",
            "2",
            "--max-new-tokens",
            "16",
            "--real",
            "2",
            "--out",
            str(tmp_path / "o"),
            "--no-progress",
        ]
    )
    got = rep["sets"]["humaneval"]
    assert got["prompts"] == 2 and got["blocks"] > 20 and got["survival"][0] > 0.3
    check = got["real"]["rounds_check"]
    assert check["replies_equal"] == 2 and check["rounds_equal"] >= check["rounds"] - 1


def test_two_committed_drafters_compare_on_tau_and_projected_speedup():
    """benchmarks/teacher_forced_compare.py on two committed runs (K=64 against K=16, the same prompts and replies):
    the projected speedup is each tau over its K's round cost on the profile, paired over the same resamples."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("tfc", REPO / "benchmarks/teacher_forced_compare.py")
    tfc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tfc)
    from infer.projection import load_profiles

    base = REPO / "docs/results/teacher-forced"
    result = tfc.main([str(base / "main-job-k64-at64"), str(base / "shipped"), "--profiles", "tpu-v5p"])
    v5p = load_profiles(["tpu-v5p"])["tpu-v5p"]
    for r in result.values():
        p = r["projected@tpu-v5p"]
        assert p["a"] == pytest.approx(r["tau"]["a"] / tfc.round_cost(v5p, 64))
        assert p["b"] == pytest.approx(r["tau"]["b"] / tfc.round_cost(v5p, 16))
        assert p["low"] <= p["difference"] <= p["high"]
    gsm8k = result["gsm8k"]["tau"]
    assert gsm8k["resolved"] and gsm8k["difference"] == pytest.approx(-0.054, abs=5e-4)


def test_the_matrix_of_several_runs_agrees_with_each_run_and_with_the_pairwise_comparison(tmp_path):
    """benchmarks/teacher_forced_matrix.py over three committed runs (K=64 at 64, K=64 at 16, the shipped drafter at
    16; the same prompts and replies): each cell's tau and interval are its own run's (tau_ci, where every slot has
    an estimate), each difference from the reference cell equals teacher_forced_compare.py's paired one, and the
    reference's difference from itself is 0 and not resolved."""
    import importlib.util

    def script(name):
        spec = importlib.util.spec_from_file_location(name, REPO / f"benchmarks/{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    tfm, tfc = script("teacher_forced_matrix"), script("teacher_forced_compare")
    base = REPO / "docs/results/wide-blocks/500k"
    shipped = REPO / "docs/results/teacher-forced/shipped"
    runs = [f"shipped={shipped}", str(base / "tf-ft64-at64"), str(base / "tf-ft64-at16")]
    matrix = tfm.main([*runs, "--profiles", "tpu-v5p", "--shapes", "qwen3-8b,smollm2-135m", "--out", str(tmp_path)])
    pair = tfc.main([str(base / "tf-ft64-at64"), str(shipped), "--profiles", "tpu-v5p"])
    assert {c["label"] for c in next(iter(matrix["sets"].values()))["cells"]} == {"shipped", "ft64"}
    for name, result in matrix["sets"].items():
        ref, wide, narrow = result["cells"]
        own = json.loads((base / "tf-ft64-at16/teacher_forced.json").read_text())["sets"][name]
        assert narrow["k"] == 16 and narrow["tau"]["value"] == pytest.approx(own["tau"], abs=1e-9)
        assert narrow["tau"]["interval"] == pytest.approx(own["tau_ci"], abs=1e-9)
        assert wide["tau"]["minus_against"] == pytest.approx(pair[name]["tau"]["difference"], abs=1e-9)
        assert wide["tau"]["minus_against_interval"] == pytest.approx(
            [pair[name]["tau"]["low"], pair[name]["tau"]["high"]], abs=1e-9
        )
        assert wide["tau"]["resolved"] == pair[name]["tau"]["resolved"]
        key = "projected@tpu-v5p@qwen3-8b"
        assert wide[key]["minus_against"] == pytest.approx(pair[name]["projected@tpu-v5p"]["difference"], abs=1e-9)
        assert ref["tau"]["minus_against"] == 0 and ref["tau"]["minus_against_interval"] == [0, 0]
        assert not ref["tau"]["resolved"]
        # a SmolLM2-sized target's plain step is priced too: a different projection from the same tau
        assert wide["projected@tpu-v5p@smollm2-135m"]["value"] != pytest.approx(wide[key]["value"], abs=1e-3)
    assert (tmp_path / "matrix.md").read_text().count("| ft64 |") >= 3 * len(matrix["sets"])
    assert (tmp_path / "survival.png").stat().st_size > 0


def test_a_run_directory_that_is_not_a_teacher_forced_run_is_named(tmp_path):
    """teacher_forced_compare.py (and the matrix, which loads through it) refuses a teacher_forced.json that is not
    JSON or lacks what a comparison reads, naming the file and the missing keys."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("tfc", REPO / "benchmarks/teacher_forced_compare.py")
    tfc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tfc)
    shipped = json.loads((REPO / "docs/results/teacher-forced/shipped/teacher_forced.json").read_text())
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "teacher_forced.json").write_text("{not json")
    with pytest.raises(SystemExit, match=r"bad/teacher_forced.json: not JSON"):
        tfc.load(bad)
    del shipped["sets"]["gsm8k"]["per_prompt"]
    (bad / "teacher_forced.json").write_text(json.dumps(shipped))
    with pytest.raises(SystemExit, match=r"not a teacher_forced.json of .* \(no sets.gsm8k.per_prompt\)"):
        tfc.load(bad)
    assert tfc.load(REPO / "docs/results/teacher-forced/shipped")["block_size"] == 16
