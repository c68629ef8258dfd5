"""Target-regenerated training data: record structure, equality with direct greedy decoding, crash-safe resume."""

import json

import pytest
from conftest import tiny_target

from dflash_model.tokenizer import chat_prompt_ids, stop_token_ids
from infer.plain import bucket_length, greedy_generate
from train.regenerate import first_turn_prompt, pending, plan, read_done, regenerate

NEW = 6  # new tokens per reply: enough to see text, short enough to keep the test fast


@pytest.fixture(scope="module")
def smol_tok(tmp_path_factory):
    """The real SmolLM2 tokenizer (saved as HF files by whichever test module converted the GGUF first)."""
    from dflash_model.tokenizer import load_tokenizer

    saved = tmp_path_factory.getbasetemp() / "smollm2_tokenizer"
    if (saved / "tokenizer.json").is_file():
        return load_tokenizer(saved)
    from data.assets import smollm2_gguf

    tok = load_tokenizer(smollm2_gguf())
    tok.save_pretrained(saved)
    return tok


def tiny_smol(**changes):
    """A random Llama with SmolLM2's vocabulary (so its tokenizer applies) and a tiny body."""
    return tiny_target(
        "llama",
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        **changes,
    )


@pytest.fixture(scope="module")
def model():
    return tiny_smol()


def conversations():
    user = lambda text: {"role": "user", "content": text}
    return [
        {
            "id": "a",
            "messages": [
                user("Name a colour."),
                {"role": "assistant", "content": "Blue."},
                user("Another?"),
                {"role": "assistant", "content": "Red."},
            ],
        },
        {"id": "b", "messages": [{"role": "system", "content": "Be brief."}, user("Say hi.")]},
        {"id": "too-long", "messages": [user("many words " * 40)]},
        {"id": "c", "messages": [user("What is 3 + 4?")]},
        {"id": "no-user", "messages": [{"role": "system", "content": "Alone."}]},
        {"id": "d", "messages": [user("Write a haiku.")]},
        {"id": "a", "messages": [user("Same id as the first.")]},
        {"id": "e", "messages": [user("One more.")]},
    ]


def run(model, tok, out, **kw):
    return regenerate(
        model, tok, conversations(), out, batch_size=2, max_new_tokens=NEW, max_prompt_tokens=48, progress=False, **kw
    )


def test_first_turn_prompt():
    s, u, a = ({"role": r, "content": r} for r in ("system", "user", "assistant"))
    assert first_turn_prompt([s, u, a, u, a]) == [s, u]
    assert first_turn_prompt([u, a]) == [u]
    assert first_turn_prompt([s, a]) is None


def test_plan_groups_prompts_by_length_bucket(smol_tok):
    user = lambda i, n: {"id": str(i), "messages": [{"role": "user", "content": "word " * n}]}
    convs = [user(0, 150), user(1, 5), user(2, 60), user(3, 5), user(4, 300), user(5, 5)]
    eligible, skipped = plan(convs, smol_tok, max_prompt_tokens=256)
    lengths = [len(e[2]) for e in eligible]
    assert [e[0] for e in eligible] == ["1", "3", "5", "2", "0"] and skipped == {"prompt_too_long": 1}
    assert [bucket_length(n) for n in lengths] == [64, 64, 64, 128, 256]
    with pytest.raises(ValueError, match="largest prompt bucket"):
        plan(convs, smol_tok, max_prompt_tokens=10_000)


def test_records_structure_and_equal_direct_greedy(tmp_path, model, smol_tok):
    out = tmp_path / "out.jsonl"
    stats = run(model, smol_tok, out)
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in lines] == ["a", "b", "c", "d", "e"]
    assert stats["written"] == 5 and stats["already_done"] == 0 and stats["new_tokens"] == 5 * NEW
    assert stats["skipped"] == {"prompt_too_long": 1, "no_user_turn": 1, "duplicate_id": 1}
    convs = {}
    for c in conversations():
        convs.setdefault(c["id"], c)  # the first "a" is the one kept
    for r in lines:
        prompt = first_turn_prompt(convs[r["id"]]["messages"])
        assert r["messages"][:-1] == prompt and r["messages"][-1]["role"] == "assistant"
        assert r["finish"] == "length"  # a random model does not say <|im_end|> within 6 tokens
    assert lines[1]["messages"][0] == {"role": "system", "content": "Be brief."}
    # The same batches through greedy_generate directly give the same text (5 prompts: [a, b] [c, d] [e, e]).
    prompts = [chat_prompt_ids(smol_tok, r["messages"][:-1]) for r in lines]
    direct = []
    for lo in (0, 2, 4):
        batch = (prompts[lo : lo + 2] + prompts[-1:])[:2]
        direct += greedy_generate(model, batch, NEW, stop_ids=stop_token_ids(smol_tok), pad_id=2)[: len(prompts) - lo]
    assert [r["messages"][-1]["content"] for r in lines] == [smol_tok.decode(t) for t in direct]
    assert all(len(t) == NEW for t in direct)


@pytest.mark.parametrize("cut_line", [2, 3])  # 2: a batch's first line cut; 3: its second line cut
def test_resume_after_crash_matches_uninterrupted_run(tmp_path, model, smol_tok, cut_line):
    full = tmp_path / "full.jsonl"
    run(model, smol_tok, full)
    reference = full.read_bytes()
    lines = reference.splitlines(keepends=True)
    crashed = tmp_path / "crashed.jsonl"
    crashed.write_bytes(b"".join(lines[:cut_line]) + lines[cut_line][: len(lines[cut_line]) // 2])
    # What the run's plan announces: the eligible replies not yet written (5 of the 8 conversations are eligible).
    torn = crashed.read_bytes()
    assert pending(conversations(), smol_tok, crashed, 48) == 5 - cut_line
    assert crashed.read_bytes() == torn  # read only: the repair is regenerate's
    stats = run(model, smol_tok, crashed)
    assert crashed.read_bytes() == reference
    assert stats["already_done"] == cut_line and stats["written"] == 5 - cut_line
    assert pending(conversations(), smol_tok, crashed, 48) == 0
    assert run(model, smol_tok, crashed)["written"] == 0  # a finished file is left alone
    assert crashed.read_bytes() == reference


def test_resume_under_other_settings_is_refused(tmp_path, model, smol_tok):
    """A file started with one --max-new-tokens (or target) is not topped up with replies made otherwise."""
    out = tmp_path / "out.jsonl"
    out.write_text("")  # an empty file is a fresh start: nothing to mix with
    run(model, smol_tok, out)
    assert json.loads((tmp_path / "out.jsonl.settings.json").read_text())["max_new_tokens"] == NEW
    with pytest.raises(ValueError, match=rf"out.jsonl: .*max_new_tokens={NEW} there but {NEW + 1} now"):
        regenerate(
            model,
            smol_tok,
            conversations(),
            out,
            batch_size=2,
            max_new_tokens=NEW + 1,
            max_prompt_tokens=48,
            progress=False,
        )
    with pytest.raises(ValueError, match=r"target='arch-\w+' there but 'other' now"):
        run(model, smol_tok, out, target_name="other")
    assert run(model, smol_tok, out)["written"] == 0


def test_read_done_drops_partial_line_and_rejects_corruption(tmp_path):
    out = tmp_path / "o.jsonl"
    out.write_text('{"id": "x", "messages": []}\n{"id": "y", "mess')
    assert read_done(out) == ["x"]
    assert out.read_text() == '{"id": "x", "messages": []}\n'
    out.write_text('{"id": "x"}\ngarbage\n{"id": "z"}\n')
    with pytest.raises(ValueError, match=r"o\.jsonl:2"):
        read_done(out)
    assert read_done(tmp_path / "missing.jsonl") == []


def test_read_done_keeps_unicode_line_separators_inside_a_record(tmp_path):
    # A reply written with ensure_ascii=False keeps U+2028 / U+0085 raw; one such reply stopped a GPU run's
    # check of its own output (str.splitlines() splits there).
    out = tmp_path / "o.jsonl"
    recs = [{"id": "a", "messages": [{"role": "assistant", "content": "one\u2028two\x85three"}]}, {"id": "b"}]
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs), encoding="utf-8")
    assert "\u2028" in out.read_text(encoding="utf-8")
    assert read_done(out) == ["a", "b"]


def test_resume_in_another_dtype_is_refused_and_old_files_count_as_float32(tmp_path, model, smol_tok):
    """bfloat16 replies are not mixed into a float32 file; a settings file from before the dtype was recorded
    (every such file was made in float32) resumes in float32 and refuses bfloat16."""
    bf16 = tiny_smol(dtype="bfloat16")
    out = tmp_path / "out.jsonl"
    first = run(model, smol_tok, out, target_name="t")
    side = tmp_path / "out.jsonl.settings.json"
    settings = json.loads(side.read_text())
    assert settings["dtype"] == "float32" and first["written"] == 5
    with pytest.raises(ValueError, match=r"dtype='float32' there but 'bfloat16' now"):
        run(bf16, smol_tok, out, target_name="t")
    del settings["dtype"]
    side.write_text(json.dumps(settings))
    assert run(model, smol_tok, out, target_name="t")["already_done"] == 5
    with pytest.raises(ValueError, match=r"dtype='float32' there but 'bfloat16' now"):
        run(bf16, smol_tok, out, target_name="t")
