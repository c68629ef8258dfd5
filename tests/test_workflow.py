"""The run around the trainer: held-out split, regenerated-data naming, and the end-of-run eval hook."""

from __future__ import annotations

import json

import numpy as np
import pytest

from train import workflow
from train.config import load_config


def test_heldout_split_keeps_the_tail_out_of_training():
    convs = [{"id": str(i)} for i in range(10)]
    train, held = workflow.split_heldout(convs, 3)
    assert [c["id"] for c in train] == [str(i) for i in range(7)]
    assert [c["id"] for c in held] == ["7", "8", "9"]
    with pytest.raises(ValueError, match="heldout=10 must be in 0..9"):
        workflow.split_heldout(convs, 10)


def test_heldout_split_holds_out_whole_conversations():
    """ShareGPT's parts of one conversation (`X_0`, `X_4`, ...) go to one side: a held-out conversation has no
    part in training, even one read before the cut; eval takes one prompt per held-out conversation."""
    ids = ["a_0", "b_0", "b_4", "c_0", "b_9", "d_0", "d_2", "e_x"]
    convs = [{"id": i, "messages": [{"role": "user", "content": i}]} for i in ids]
    train, held = workflow.split_heldout(convs, 2)  # conversations in order a, b, c, d, e_x: d and e_x held out
    assert [c["id"] for c in train] == ["a_0", "b_0", "b_4", "c_0", "b_9"]
    assert [c["id"] for c in held] == ["d_0", "d_2", "e_x"]
    assert [r["id"] for r in workflow.heldout_prompts(held)] == ["d_0", "e_x"]
    train, held = workflow.split_heldout(convs, 4)  # b, c, d, e_x: b_0 read early is held out with b_9
    assert [c["id"] for c in train] == ["a_0"]
    with pytest.raises(ValueError, match="heldout=5 must be in 0..4"):
        workflow.split_heldout(convs, 5)


def test_regenerated_path_names_every_setting(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    r = load_config("smollm2-135m").data.regenerate
    p = workflow.regenerated_path(r, "smollm2")
    assert p.parent == tmp_path / "regenerated"
    assert p.name == f"smollm2-sharegpt-n{r.limit}-hc{r.heldout}-p{r.max_prompt_tokens}-t{r.max_new_tokens}.jsonl"
    other = load_config("smollm2-135m", ["data.regenerate.max_new_tokens=7"]).data.regenerate
    assert workflow.regenerated_path(other, "smollm2") != p


def _jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_mix_is_cached_by_its_contents_and_reproducible(tmp_path, monkeypatch):
    """data.source=mix: the parts' lines, shuffled with data.mix_seed, in one cached JSONL named by its contents."""
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    a = _jsonl(tmp_path / "a.jsonl", [{"id": f"a{i}", "messages": msgs} for i in range(10)])
    b = _jsonl(tmp_path / "b.jsonl", [{"id": f"b{i}", "messages": msgs} for i in range(10)])
    keys = ["data.source=mix", f"data.mix=['{a}:seed=1:take=4', '{b}:take=3']"]
    cfg = load_config("tiny", keys)
    path = workflow.prepare_mix(cfg.data)
    ids = [json.loads(line)["id"] for line in path.read_text().splitlines()]
    assert len(ids) == 7 and sorted(i for i in ids if i[0] == "b") == ["b0", "b1", "b2"]
    assert workflow.prepare_mix(cfg.data) == path  # the same parts and seed: the same file
    other = workflow.prepare_mix(load_config("tiny", [*keys, "data.mix_seed=5"]).data)
    assert other != path and sorted(json.loads(x)["id"] for x in other.read_text().splitlines()) == sorted(ids)
    with pytest.raises(ValueError, match=r"data.mix=\[\]: data.source=mix needs a list of parts"):
        load_config("tiny", ["data.source=mix"])
    with pytest.raises(ValueError, match=r"data.mix part .*nope.jsonl.*: no such file"):
        load_config("tiny", ["data.source=mix", f"data.mix=['{tmp_path}/nope.jsonl']"])


def test_eval_drops_prompts_of_conversations_trained_on(tmp_path):
    """An eval prompt of a conversation the training JSONL holds (any part of it) is dropped; other sources pass."""
    trained = _jsonl(tmp_path / "train.jsonl", [{"id": "x_2"}, {"id": "y_0"}, {"id": "plain"}])
    rows = [{"id": i} for i in ("x_0", "y_4", "z_0", "plain", "w")]
    assert [r["id"] for r in workflow.untrained(rows, trained)] == ["z_0", "w"]
    assert workflow.untrained(rows, "synthetic") == rows


@pytest.mark.long
def test_run_ends_with_an_eval_of_the_exported_drafter(tmp_path):
    """train/run.py on the tiny config with eval on: the exported drafter (over its draft vocabulary, and over the
    whole one as a z-lab server runs it), n-gram and plain decoding run through the shared decode loop, every
    speculative output equals plain greedy, and a second run reuses the eval."""
    from train.run import main

    rng = np.random.default_rng(0)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"id": f"p{i}", "prompt_ids": rng.integers(0, 500, 12).tolist()}) + "\n" for i in range(3))
    )
    args = [
        "--config",
        "tiny",
        f"run_dir={tmp_path / 'run'}",
        "train.steps=6",
        "draft_vocab=64",
        "eval.enabled=true",
        f"eval.prompts={prompts}",
        "eval.max_new_tokens=12",
        "eval.num_prompts=2",
    ]
    summary = main(args)
    rep = json.loads((tmp_path / "run" / "eval" / "eval.json").read_text())
    assert rep["trained_steps"] == 6 and rep["num_prompts"] == 2 and rep["drafter"].endswith("export")
    assert set(rep["reports"]) == {"dflash", "dflash-fullvocab", "ngram"}
    for r in rep["reports"].values():
        assert r["lossless_mismatches"] == 0 and r["prompts"] == 2
        assert r["decode_tokens_plain"] == 2 * 11  # 12 new tokens each, the first from the prefill
        assert r["tau"] >= 1.0
    assert {r["block_size"] for r in rep["reports"].values()} == {8}
    assert (tmp_path / "run" / "export" / "draft_vocab.json").is_file()
    assert (tmp_path / "run" / "eval" / "acceptance.png").stat().st_size > 0
    assert summary["eval"]["dflash"]["tau"] == rep["reports"]["dflash"]["tau"]
    # The training pass's estimate beside real decoding, on the same prompts and the target's plain replies.
    agree, dflash = rep["train_serve"], rep["reports"]["dflash"]
    assert agree["teacher_forced"]["blocks"] == 2 * 11  # every reply position with a next token
    assert agree["real"]["rounds"] == sum(len(p["accept_lengths"]) for p in dflash["per_prompt"])
    assert agree["gap"]["tau"] == pytest.approx(dflash["tau"] - agree["teacher_forced"]["tau"])
    assert agree["teacher_forced_drafter"] == "trained, in memory"
    assert "train/serve agreement" in (tmp_path / "run" / "eval" / "table.md").read_text()
    again = main(args)  # nothing left to train; the eval of step 6 is reused, not recomputed
    assert "eval" not in again and again["step"] == 6


def test_a_cached_eval_is_reused_only_for_the_same_settings(tmp_path):
    """The end-of-run eval on disk is reused for the same step *and* the same prompts, lengths and K; a change
    of any of them (or a torn file) evaluates again."""
    import json

    from train.config import load_config
    from train.workflow import _same_eval, eval_settings

    cfg = load_config("tiny", ["eval.enabled=true"])
    prior = tmp_path / "eval.json"
    prior.write_text(json.dumps({"trained_steps": 30, "settings": eval_settings(cfg)}))
    assert _same_eval(prior, cfg, 30)
    assert not _same_eval(prior, cfg, 31)
    for change in (
        "eval.max_new_tokens=64",
        "eval.num_prompts=3",
        "eval.block=4",
        "eval.prompts=gsm8k",
        "block_size=4",
    ):
        assert not _same_eval(prior, load_config("tiny", ["eval.enabled=true", change]), 30), change
    prior.write_text('{"trained_steps": 30, "sett')
    assert not _same_eval(prior, cfg, 30)
