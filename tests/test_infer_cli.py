"""The generate and eval CLIs end to end on the tiny HF fixture, the eval statistics, and the SmolLM2 check:
n-gram speculative decoding equals plain greedy on real chat prompts."""

import json
import math

import pytest
from conftest import FIXTURES, REPO

from dflash_model.weights import load_target
from infer import eval as ev
from infer import eval_sets, generate, loading, measure, report
from infer.engine import Engine
from infer.loading import Draft, load_draft_spec
from infer.plain import greedy_generate
from infer.proposers import NGramProposer

PROMPT = [5, 6, 7, 5, 6, 7, 5, 6, 9, 5, 6, 7]


@pytest.fixture(scope="module")
def tiny():
    return load_target(FIXTURES / "tiny_qwen3")[1]


@pytest.mark.long
def test_generate_cli_json(tiny, capsys):
    """--json prints one object; tokens equal plain greedy for n-gram and for an untrained DFlash drafter."""
    ref = greedy_generate(tiny, [PROMPT], 12)[0]
    base = [
        "--target",
        str(FIXTURES / "tiny_qwen3"),
        "--prompt-ids",
        ",".join(map(str, PROMPT)),
        "--max-new-tokens",
        "12",
        "--json",
    ]
    for draft, k in (("ngram", 4), ("random", 3)):
        generate.main(base + ["--draft", draft, "--block", str(k)])
        out = json.loads(capsys.readouterr().out)
        assert out["tokens"] == ref, draft
        assert out["block_size"] == k and out["draft"] == draft
        assert len(out["proposals"]) == len(out["accept_lengths"]) >= 1
        assert all(len(p) == k - 1 for p in out["proposals"])
        assert sum(out["accept_lengths"]) >= len(ref) - 1


def test_acceptance_statistics():
    """tau, histogram, unconditional and conditional per-position acceptance from committed lengths."""
    s = measure.acceptance_stats([1, 3, 4, 2], k=4)  # accepted drafts a = 0, 2, 3, 1
    assert s["rounds"] == 4 and s["tau"] == 2.5
    assert s["tau_histogram"] == {"1": 1, "2": 1, "3": 1, "4": 1}
    assert s["acceptance_unconditional"] == [3 / 4, 2 / 4, 1 / 4]
    assert s["acceptance_conditional"] == [3 / 4, 2 / 3, 1 / 2]
    # No rounds at all (every answer ended at the prefill's token) gives NaN, not a crash.
    assert math.isnan(measure.acceptance_stats([], k=3)["tau"])


@pytest.mark.long
def test_eval_cli_on_a_jsonl_of_prompt_ids(tmp_path, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"id": f"p{i}", "prompt_ids": PROMPT[i:] + PROMPT}) for i in range(3)))
    out = tmp_path / "out"
    # Same target, K and max_new_tokens as the generate test: the speculative engine's compile is reused.
    rep = ev.main(
        [
            "--target",
            str(FIXTURES / "tiny_qwen3"),
            "--draft",
            "ngram",
            "--block",
            "4",
            "--dataset",
            str(data),
            "--limit",
            "2",
            "--max-new-tokens",
            "12",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    saved = json.loads((out / "eval.json").read_text())
    assert saved["prompts"] == 2 and saved["lossless_mismatches"] == 0
    assert sum(saved["tau_histogram"].values()) == saved["rounds"] > 0
    lengths = [a for r in saved["per_prompt"] for a in r["accept_lengths"]]
    assert saved["tau"] == pytest.approx(sum(lengths) / len(lengths))
    assert len(saved["acceptance_unconditional"]) == len(saved["acceptance_conditional"]) == 3
    assert saved["decode_tokens_plain"] == saved["decode_tokens_spec"] == 2 * 11
    assert saved["speedup"] == pytest.approx(saved["tpot_plain_ms"] / saved["tpot_spec_ms"])
    assert (out / "acceptance.png").stat().st_size > 1000
    assert "tau (committed tokens per round" in capsys.readouterr().out
    # The headline counts what was output: every decode token after the prefill's came from a round.
    assert saved["tau"] == pytest.approx(saved["decode_tokens_spec"] / saved["rounds"])
    assert saved["tau_ci"][0] <= saved["tau"] <= saved["tau_ci"][1] and saved["tau_zlab"] >= saved["tau_per_prompt"]
    assert rep["per_prompt"][0]["id"] == "p0"
    # The loop overhead: decode time over its verify forwards timed alone; a finite positive ratio.
    assert 0 < saved["loop_overhead"] < 100 and saved["costs_ms"]["plain"]["widths"] == [1]


def test_a_run_of_several_sets_resumes_after_the_sets_it_finished(tmp_path, monkeypatch):
    """Each set of a several-set eval is kept as it finishes: rerun after a crash in the second set, the same
    command decodes only the second, and eval.json equals an uninterrupted run's (timings aside)."""
    sets = []
    for name in ("first", "second"):
        path = tmp_path / f"{name}.jsonl"
        path.write_text(json.dumps({"id": f"{name}0", "prompt_ids": PROMPT}) + "\n")
        sets.append(str(path))
    args = ["--target", str(FIXTURES / "tiny_qwen3"), "--draft", "ngram", "--block", "4", "--max-new-tokens", "6"]
    args += ["--dataset", ",".join(sets), "--out", str(tmp_path / "out"), "--no-progress"]
    run_set, decoded = ev._run_set, []

    def crash_in_second(args, target, drafts, prepared, stop_ids):
        decoded.append(prepared[0][0]["id"])
        if prepared[0][0]["id"] == "second0" and len(decoded) == 2:
            raise RuntimeError("stopped mid-run")
        return run_set(args, target, drafts, prepared, stop_ids)

    monkeypatch.setattr(ev, "_run_set", crash_in_second)
    with pytest.raises(RuntimeError, match="stopped mid-run"):
        ev.main(args)
    resumed = ev.main(args)
    assert decoded == ["first0", "second0", "second0"]  # the first set was not decoded again
    assert not (tmp_path / "out" / report.KEPT).exists()  # the kept sets go once eval.json is written
    again = ev.main([*args[:-3], "--out", str(tmp_path / "again"), "--no-progress"])
    for name, res in resumed["datasets"].items():
        for key in ("tau", "rounds", "per_prompt", "survival"):
            mine, theirs = res["reports"]["ngram"][key], again["datasets"][name]["reports"]["ngram"][key]
            if key == "per_prompt":
                mine, theirs = ([r["accept_lengths"] for r in x] for x in (mine, theirs))
            assert mine == theirs, (name, key)


@pytest.mark.long
def test_eval_compares_adaptive_and_fixed_with_repeats(tmp_path):
    """Two decoders and plain interleaved, 2 repeats: one table, the speedup the median of the per-repeat
    ratios, every decoder lossless, the adaptive one verifying a width from its candidates each round."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"id": f"p{i}", "prompt_ids": PROMPT[i:] + PROMPT}) for i in range(2)))
    out = tmp_path / "out"
    args = ["--target", str(FIXTURES / "tiny_qwen3"), "--dataset", str(data), "--max-new-tokens", "12"]
    args += ["--draft", "ngram@4", "--draft", "adaptive:ngram@4", "--repeats", "2", "--out", str(out), "--no-progress"]
    rep = ev.main(args)["reports"]
    assert set(rep) == {"ngram", "adaptive-ngram"}
    for r in rep.values():
        assert r["lossless_mismatches"] == 0 and r["repeats"] == 2 and len(r["speedup_per_repeat"]) == 2
        assert min(r["speedup_per_repeat"]) <= r["speedup"] <= max(r["speedup_per_repeat"])
        assert all(len(p["spec_decode_s"]) == 2 for p in r["per_prompt"])
    widths = [w for p in rep["adaptive-ngram"]["per_prompt"] for w in p["verify_widths"]]
    assert set(widths) <= {1, 2, 4} and rep["adaptive-ngram"]["costs_ms"]["adaptive-ngram"]["widths"] == [1, 2, 4]
    assert rep["ngram"]["mean_verify_width"] == 4.0
    # One calibration per target, width and shape: both engines chose from the same width-4 cost (its value is a
    # timing: >= 0, 0 when the machine's noise swallows a tiny model's forward).
    fixed, adaptive = rep["ngram"]["costs_ms"]["ngram"], rep["adaptive-ngram"]["costs_ms"]["adaptive-ngram"]
    assert fixed["verify_ms_measured"][0] == adaptive["verify_ms_measured"][2] >= 0
    assert "| adaptive-ngram | 4 |" in (out / "table.md").read_text()
    assert loading.compare_specs("D") == [
        "ngram@8",
        "adaptive:ngram@16",
        "D",
        "adaptive:D",
        "hybrid:D",
        "adaptive:hybrid:D",
        "tree:D",
    ]


def test_eval_counts_lossless_mismatches():
    recs = [
        {
            "id": "a",
            "plain_tokens": [1, 2, 3],
            "spec_tokens": [1, 2, 3],
            "accept_lengths": [2],
            "plain_decode_s": 1.0,
            "spec_decode_s": 0.5,
        },
        {
            "id": "b",
            "plain_tokens": [1, 2, 3, 4],
            "spec_tokens": [1, 2, 5, 4],
            "accept_lengths": [1, 2],
            "plain_decode_s": 1.5,
            "spec_decode_s": 1.0,
        },
    ]
    rep = measure.summarize(recs, Draft("ngram", NGramProposer(), None, 2), max_new_tokens=4)
    assert rep["lossless_mismatches"] == 1
    assert rep["mismatch_examples"][0]["id"] == "b" and rep["mismatch_examples"][0]["first_diff"] == 2
    assert rep["tpot_plain_ms"] == pytest.approx(1e3 * 2.5 / 5) and rep["speedup"] == pytest.approx(5 / 3)
    # Repeats: the set's time per repeat, its median, and the speedup of each repeat (here 5/3, 2.5/2.5, 5/2).
    for r, plain, spec in zip(recs, ([1.0, 1.0, 2.0], [1.5, 1.5, 3.0]), ([0.5, 1.0, 1.0], [1.0, 1.5, 1.0])):
        r["plain_decode_s"], r["spec_decode_s"] = plain, spec
    rep = measure.summarize(recs, Draft("ngram", NGramProposer(), None, 2), max_new_tokens=4)
    assert rep["repeats"] == 3 and rep["speedup_per_repeat"] == pytest.approx([5 / 3, 1.0, 2.5])
    assert rep["tpot_plain_ms"] == pytest.approx(1e3 * 2.5 / 5) and rep["tpot_spec_ms"] == pytest.approx(1e3 * 2.0 / 5)


@pytest.mark.long
@pytest.mark.slow
def test_smollm2_ngram_equals_plain_greedy(smollm2):
    """The real target (SmolLM2-135M GGUF, fp32): 2 chat prompts of different lengths x 24 tokens at batch 2,
    n-gram K=8, equal the plain greedy ids committed in smollm2_greedy.json (HF's greedy decoding, which
    test_parity shows infer.plain reproduces; eos is not a stop there, so neither is it here)."""
    from dflash_model.tokenizer import chat_prompt_ids

    _, model, tok = smollm2
    examples = json.loads((FIXTURES / "smollm2_greedy.json").read_text())["examples"][1:3]
    prompts = [chat_prompt_ids(tok, ex["prompt"]) for ex in examples]
    assert prompts == [ex["prompt_ids"] for ex in examples] and len(prompts[0]) != len(prompts[1])
    out = Engine(model, NGramProposer(), block_size=8, max_new_tokens=24).generate(prompts)
    assert [g.tokens for g in out] == [ex["new_ids"][:24] for ex in examples]
    assert all(len(g.proposals[0]) == 7 for g in out)
    # The shipped drafter's DDTree (16 nodes): the same ids, and more tokens per round than its greedy chain.
    draft = load_draft_spec("tree:" + str(REPO / "drafters" / "smollm2-135m-dflash"), model.target_config)
    tree = Engine(model, draft.proposer, draft.params, max_new_tokens=24, **draft.engine_options()).generate(prompts)
    assert [g.tokens for g in tree] == [ex["new_ids"][:24] for ex in examples]
    assert all(w == 17 for g in tree for w in g.verify_widths)


def test_shipped_drafter_loads_with_its_draft_vocabulary_unless_fullvocab():
    """A drafter directory's draft_vocab.json restricts its proposer; 'fullvocab:DIR' (and the hybrid, tree and
    adaptive specs around either) keep or drop it as written; fullvocab: of anything but a directory is refused."""
    from dflash_model.config import PRESETS

    cfg = PRESETS["smollm2-135m"]
    shipped = str(REPO / "drafters" / "smollm2-135m-dflash")
    vocab = json.loads((REPO / "drafters" / "smollm2-135m-dflash" / "draft_vocab.json").read_text())["token_ids"]
    assert load_draft_spec(shipped, cfg).proposer.vocab == tuple(vocab) and len(vocab) == 8192
    assert load_draft_spec("tree:" + shipped, cfg).proposer.vocab == tuple(vocab)
    full = load_draft_spec("fullvocab:" + shipped, cfg)
    assert full.proposer.vocab is None and full.name == "fullvocab-dflash"
    assert load_draft_spec("hybrid:fullvocab:" + shipped, cfg).proposer.dflash.vocab is None
    # replies:FILE+DIR: the reply index and the drafter together, the drafter keeping its vocabulary.
    replies = str(REPO / "drafters" / "smollm2-135m-replies" / "replies.npz")
    both = load_draft_spec(f"adaptive:replies:{replies}+{shipped}", cfg)
    assert both.name == "adaptive-replies-hybrid" and both.adaptive and both.block_size == 16
    assert both.proposer.dflash.vocab == tuple(vocab) and both.params[1].keys_A.shape[0] > 0
    # lookuptreeauto:FILE over the shipped reply file: the size is left to the engine, from the committed prior
    # (the simulated tau rises with the tree's size).
    tree = load_draft_spec(f"lookuptreeauto:{replies}", cfg)
    assert tree.name == "lookuptree-auto" and sorted(tree.tree_prior) == [3, 5, 7, 9, 11, 15]
    taus = [tree.tree_prior[n] for n in sorted(tree.tree_prior)]
    assert all(a < b for a, b in zip(taus, taus[1:])) and tree.block_size == 16
    with pytest.raises(ValueError, match=r"replies:FILE\+DIR needs a DFlash drafter"):
        load_draft_spec(f"replies:{replies}+ngram", cfg)
    with pytest.raises(ValueError, match=r"needs a drafter directory after the '\+'"):
        load_draft_spec(f"replies:{replies}+", cfg)
    with pytest.raises(ValueError, match="fullvocab: applies to a DFlash drafter directory"):
        load_draft_spec("fullvocab:ngram", cfg)
    # Two directories, each also over the full vocabulary, in one comparison: the second keeps its prefix.
    other = str(REPO / "drafters" / "smollm2-135m-dflash" / ".." / "smollm2-135m-dflash")
    names = [
        d.name
        for d in loading.load_drafts([shipped, "fullvocab:" + shipped, other, "fullvocab:" + other], cfg, None, 0)
    ]
    assert names == ["dflash", "fullvocab-dflash", "smollm2-135m-dflash", "fullvocab-smollm2-135m-dflash"]
    # One directory at several K: the third is named by its K; NAME=SPEC names a row; a name twice is refused.
    names = [
        d.name
        for d in loading.load_drafts(
            [shipped + "@8", shipped + "@4", shipped, "start@2=" + shipped + "@2"], cfg, None, 0
        )
    ]
    assert names == ["dflash", "smollm2-135m-dflash", "smollm2-135m-dflash@16", "start@2"]
    assert [d.block_size for d in loading.load_drafts(["a=" + shipped + "@4"], cfg, None, 0)] == [4]
    with pytest.raises(ValueError, match="a second row named 'x'"):
        loading.load_drafts(["x=" + shipped, "x=ngram"], cfg, None, 0)


@pytest.mark.parametrize("bad", ["999999", "-1"])
def test_out_of_vocabulary_prompt_ids_are_refused(bad, tmp_path):
    """An id outside 0..V-1 would embed as NaN (or wrap) and let target and drafter agree on garbage: both CLIs
    refuse it, naming the id and the vocabulary."""
    target = ["--target", str(FIXTURES / "tiny_qwen3")]
    with pytest.raises(ValueError, match=f"token id {bad} is outside the target's vocabulary 0..511"):
        generate.main(target + ["--prompt-ids", f"1,2,{bad}", "--max-new-tokens", "4", "--draft", "ngram"])
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"id": "x", "prompt_ids": [3, int(bad)]}) + "\n")
    with pytest.raises(ValueError, match=f"prompt x: token id {bad}"):
        ev.main(
            target + ["--draft", "ngram", "--dataset", str(path), "--max-new-tokens", "4", "--out", str(tmp_path / "o")]
        )


def test_prompt_file_rows_keep_unicode_line_separators(tmp_path):
    """A prompt file is split on newlines only: U+2028 and U+0085 written raw (ensure_ascii=False) stay inside their
    row's text, and rows without an id are named by their line."""
    path = tmp_path / "p.jsonl"
    rows = [{"prompt": "a\u2028b"}, {"question": "c\x85d"}]
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    assert eval_sets.dataset_messages(str(path)) == [{"id": "p/0", "text": "a\u2028b"}, {"id": "p/1", "text": "c\x85d"}]


@pytest.mark.parametrize(
    "flag, value, cli",
    [
        ("--block", "0", "generate"),
        ("--block", "1", "eval"),
        ("--limit", "0", "eval"),
        ("--limit", "-1", "eval"),
        ("--max-new-tokens", "0", "generate"),
        ("--temperature", "-0.5", "generate"),
    ],
)
def test_out_of_range_arguments_are_refused(flag, value, cli, tmp_path, capsys):
    """A zero or negative count once meant 'the default' (--block 0), 'everything' (--limit 0) or dropped a
    prompt (--limit -1); argparse now refuses it by name before anything loads."""
    args = ["--target", str(FIXTURES / "tiny_qwen3"), "--draft", "ngram", flag, value]
    if flag != "--max-new-tokens":
        args += ["--max-new-tokens", "4"]
    if cli == "generate":
        args += ["--prompt-ids", "1,2,3"]
        main = generate.main
    else:
        args += ["--dataset", "gsm8k", "--out", str(tmp_path / "o")]
        main = ev.main
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2 and f"argument {flag}" in capsys.readouterr().err


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    """A drafter directory that does not exist, or a target that is not one: one line naming it, exit 2."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "DFLASH_TRACEBACK"}
    cases = [
        (
            [
                "infer.eval",
                "--target",
                str(FIXTURES / "tiny_qwen3"),
                "--draft",
                str(tmp_path / "nope"),
                "--dataset",
                "gsm8k",
                "--max-new-tokens",
                "2",
                "--out",
                str(tmp_path / "o"),
            ],
            "--draft '",
        ),
        (
            ["infer.generate", "--target", str(tmp_path / "nope"), "--prompt", "hi", "--max-new-tokens", "2"],
            "expected an HF model directory",
        ),
    ]
    for args, message in cases:
        proc = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, env=env)
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-1500:]


def test_count_flips_finds_the_first_differing_token():
    """bf16 answers against fp32 ones: identical, a flip at token 2, and one that stops early (a flip where it
    ends); later tokens are not compared (after a flip the texts go their own ways)."""
    ref = [[5, 6, 7, 8], [5, 6, 7, 8], [1, 2, 3]]
    got = [[5, 6, 7, 8], [5, 6, 9, 9], [1, 2]]
    flips = measure.count_flips(ref, got)
    assert flips["identical"] == 1 and flips["first_flip"] == [None, 2, 2] and flips["median_first_flip"] == 2.0
    assert "2/3" not in report.format_flips(flips) and "1/3 answers identical" in report.format_flips(flips)
    with pytest.raises(ValueError):
        measure.count_flips(ref, got[:2])  # one answer per prompt on both sides


@pytest.mark.long
def test_bf16_eval_reports_flips_against_fp32_and_decodes_a_tree(tmp_path):
    """--dtype bfloat16: every decoder (n-gram, a DDTree of an untrained drafter) is lossless against bf16 plain
    decoding, and the plain answers' flips against fp32 plain decoding are counted in eval.json and the table."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"id": f"p{i}", "prompt_ids": PROMPT[i:] + PROMPT}) for i in range(2)))
    out = tmp_path / "out"
    args = ["--target", str(FIXTURES / "tiny_qwen3"), "--dataset", str(data), "--max-new-tokens", "12"]
    args += ["--dtype", "bfloat16", "--draft", "ngram@4", "--draft", "tree4:random@4", "--out", str(out)]
    rep = ev.main([*args, "--no-progress"])
    assert rep["dtype"] == "bfloat16" and set(rep["reports"]) == {"ngram", "tree4-random"}
    assert all(r["lossless_mismatches"] == 0 for r in rep["reports"].values())
    assert rep["reports"]["tree4-random"]["mean_verify_width"] == 5.0  # 4 nodes + the root
    flips = json.loads((out / "eval.json").read_text())["flips_vs_fp32"]
    assert flips["prompts"] == 2 and len(flips["first_flip"]) == 2 and 0 <= flips["identical"] <= 2
    assert f"{flips['identical']}/2 answers identical" in (out / "table.md").read_text()
