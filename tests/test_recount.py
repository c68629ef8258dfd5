"""benchmarks/recount.py: committed eval.json files recounted on what was output, with intervals and paired
comparisons; every layout it reads, and a clear error for a file, pair or profile it cannot use."""

from __future__ import annotations

import importlib.util
import json

import pytest
from conftest import REPO

SMALL = REPO / "docs/results/zlab-shipped-small/eval.json"  # three sets, dflash and n-gram at K=16, 2-4 prompts


@pytest.fixture(scope="module")
def recount():
    spec = importlib.util.spec_from_file_location("recount", REPO / "benchmarks/recount.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_last_round_past_the_budget_counts_only_what_was_output(recount):
    # 1 prefill token + rounds of 3 and 5 (drafts + 1) where the budget left room for 2: 6 tokens were output
    record = {"id": "p", "accept_lengths": [3, 5], "spec_tokens": list(range(6))}
    assert recount.committed(record) == ([3, 2], [3, 5])
    # a file that already holds both counts is read as it is
    both = {"accept_lengths": [3, 2], "accept_lengths_uncut": [3, 5], "spec_tokens": list(range(6))}
    assert recount.committed(both) == ([3, 2], [3, 5])
    with pytest.raises(ValueError, match="prompt p: 9 output tokens do not fit rounds"):
        recount.committed({**record, "spec_tokens": list(range(10))})


def test_a_committed_eval_recounted_matches_its_own_records(recount, tmp_path):
    out = tmp_path / "recount"
    recount.main([str(SMALL), "--pair", "dflash,ngram", "--out", str(out)])
    saved = json.loads((out / "recount.json").read_text())
    raw = json.loads(SMALL.read_text())["datasets"]
    assert len(saved["results"]) == 3 and saved["command"].startswith("python benchmarks/recount.py ")
    for key, got in saved["results"].items():
        set_name = key.split(" | ")[1]
        for name, report in raw[set_name]["reports"].items():
            mine = got["decoders"][name]
            output = sum(len(p["spec_tokens"]) - 1 for p in report["per_prompt"])
            rounds = sum(len(p["accept_lengths"]) for p in report["per_prompt"])
            assert mine["rounds"] == rounds and mine["tau"] == pytest.approx(output / rounds, abs=1e-12)
            assert mine["tau_ci"][0] <= mine["tau"] <= mine["tau_ci"][1]
        (pair,) = [c for c in got["comparisons"] if c["what"] == "tau"]  # dflash against n-gram at K=16, once
        assert (pair["a"], pair["b"]) == ("dflash", "ngram") and pair["low"] <= pair["difference"] <= pair["high"]
    table = (out / "table.md").read_text()
    assert table.startswith("Made by `python benchmarks/recount.py ") and table.count("| dflash | 16 |") == 3


def test_a_set_kept_by_a_several_set_eval_is_read_under_its_set_name(recount, tmp_path):
    reports = json.loads(SMALL.read_text())["datasets"]["gsm8k"]["reports"]
    kept = tmp_path / "sets" / "gsm8k.json"
    kept.parent.mkdir()
    kept.write_text(json.dumps({"about": {"command": "python -m infer.eval"}, "result": {"reports": reports}}))
    assert recount.reports_of(kept) == {"gsm8k": reports}


@pytest.mark.parametrize(
    "args, message",
    [
        (["{tmp}/missing.json"], "missing.json: no such file"),
        (["{tmp}/notes.json"], "notes.json: not an eval.json of python -m infer.eval"),
        (["{small}", "--pair", "dflash"], "--pair 'dflash': give two decoder names as A,B"),
        (["{small}", "--pair", "dflash,ngram@8"], r"--pair dflash,ngram@8: no file has both decoders.*'ngram'"),
        (["{small}", "--profile", "tpu-v9"], "--profile 'tpu-v9': no such profile; the profiles are"),
    ],
)
def test_a_file_pair_or_profile_it_cannot_use_is_named(recount, tmp_path, args, message):
    (tmp_path / "notes.json").write_text(json.dumps({"note": "not an eval"}))
    argv = [a.format(tmp=tmp_path, small=SMALL) for a in args]
    with pytest.raises(ValueError, match=message):
        recount.main(argv)
