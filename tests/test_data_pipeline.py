"""Conversation loading, assistant-only loss masks on the real SmolLM2 tokenizer, and the grain pipeline:
anchors, per-host sharding, epochs, exact resume, tokenization cache."""

import gzip
import itertools
import json
import pickle

import numpy as np
import pytest
from conftest import FIXTURES

from data import conversations as conv
from data import pipeline
from data.conversations import load_conversations, normalize_record, tokenize_conversation
from data.pipeline import TokenizedRecords, build_dataset, sample_anchors


@pytest.fixture(scope="session")
def smol_tok(tmp_path_factory):
    """The real SmolLM2 tokenizer. Converting it from the GGUF takes ~20 s here, so the first test module that
    needs it saves it as an HF tokenizer in the session's temp root and later ones load that in ~1 s."""
    from dflash_model.tokenizer import load_tokenizer

    saved = tmp_path_factory.getbasetemp() / "smollm2_tokenizer"
    if (saved / "tokenizer.json").is_file():
        return load_tokenizer(saved)
    from data.assets import smollm2_gguf

    tok = load_tokenizer(smollm2_gguf())
    tok.save_pretrained(saved)
    return tok


def mask_runs(ids, mask):
    """[(start, stop)] of the contiguous True runs of `mask`."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return list(zip(edges[::2], edges[1::2]))


# ---------------------------------------------------------------------------------------------- loading


def test_normalize_roles_and_drop_rules():
    rec = {
        "id": "a",
        "conversations": [
            {"from": "system", "value": "S"},
            {"from": "gpt", "value": "orphan reply"},
            {"from": "human", "value": "q1"},
            {"from": "chatgpt", "value": "r1"},
            {"from": "user", "value": "q2"},
            {"from": "bard", "value": "r2"},
            {"from": "bing", "value": "  "},
            {"from": "human", "value": "after the empty turn"},
        ],
    }
    out = normalize_record(rec, "x")
    assert out == {
        "id": "a",
        "messages": [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "q1"},
            {"role": "assistant", "content": "r1"},
            {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "r2"},
        ],
    }
    oai = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "r"}]}
    assert normalize_record(oai, "f:7") == {"id": "f:7", "messages": oai["messages"]}
    assert normalize_record({"messages": [{"role": "narrator", "content": "x"}]}, "x") == "malformed"
    assert normalize_record({"messages": [{"role": "user", "content": 3}]}, "x") == "malformed"
    assert normalize_record({"conversations": "text"}, "x") == "malformed"
    assert normalize_record(["not", "a", "dict"], "x") == "malformed"
    assert normalize_record({"messages": [{"role": "user", "content": "q"}]}, "x") == "empty"
    assert normalize_record({"messages": [{"role": "user", "content": "q"}]}, "x", require_assistant=False) == {
        "id": "x",
        "messages": [{"role": "user", "content": "q"}],
    }
    assert (
        normalize_record({"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "r"}]}, "x")
        == "empty"
    )


def test_jsonl_loading_counts_drops_and_names_bad_lines(tmp_path, caplog):
    good = {"id": "g", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "r"}]}
    lines = [
        json.dumps(good),
        "",
        json.dumps({"messages": []}),
        json.dumps({"messages": [{"role": "x"}]}),
        json.dumps({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "r"}]}),
    ]
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with caplog.at_level("WARNING"):
        convs, dropped = load_conversations(path)
    assert [c["id"] for c in convs] == ["g", "c.jsonl:5"]
    assert dropped == {"empty": 1, "malformed": 1}
    assert "dropped 2 of 4 records" in caplog.text
    path.write_text(json.dumps(good) + "\n" + json.dumps(good) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"c\.jsonl:3: invalid JSON"):
        load_conversations(path)
    # A gzipped file reads as the same lines.
    gz = tmp_path / "c.jsonl.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    assert [(n, r) for n, r in itertools.islice(conv.iter_jsonl(gz), 2)] == [(1, good), (2, good)]
    with pytest.raises(ValueError, match=r"c\.jsonl\.gz:3: invalid JSON"):
        list(conv.iter_jsonl(gz))


def test_sharegpt_records_normalise():
    convs, dropped = load_conversations("sharegpt", limit=200)
    assert len(convs) == 196 and dropped == {"empty": 4}
    roles = {m["role"] for c in convs for m in c["messages"]}
    assert roles == {"user", "assistant"}
    assert all(c["messages"][0]["role"] == "user" for c in convs)
    assert len({c["id"] for c in convs}) == 196


def test_skip_passes_over_records_and_keys_the_cache(tmp_path, smol_tok):
    """data.skip: records [skip, skip + limit) of the source, and a tokenized cache of its own."""
    convs, _ = load_conversations("sharegpt", limit=200)
    later, _ = load_conversations("sharegpt", limit=100, skip=100)
    first_ids = {c["id"] for c in convs}
    assert [c["id"] for c in later] == [c["id"] for c in convs if c["id"] in {x["id"] for x in later}]
    assert later[0]["id"] not in {c["id"] for c in load_conversations("sharegpt", limit=100)[0]}
    assert {c["id"] for c in later} <= first_ids and len(later) >= 95
    recs = [
        {"id": f"c{i}", "messages": [{"role": "user", "content": f"Q{i}?"}, {"role": "assistant", "content": f"A{i}."}]}
        for i in range(5)
    ]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert pipeline.load_tokenized(path, smol_tok, 64, skip=2).ids == ["c2", "c3", "c4"]
    assert pipeline.load_tokenized(path, smol_tok, 64).ids == [f"c{i}" for i in range(5)]  # not the skip's cache
    assert len(list(tmp_path.glob("d.jsonl.tok-*"))) == 2


# --------------------------------------------------------------------------------------- loss masks


def test_single_turn_mask_is_reply_plus_end_marker(smol_tok):
    from dflash_model.tokenizer import chat_prompt_ids

    msgs = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "2+2 = 4, of course."}]
    ex = tokenize_conversation(smol_tok, msgs, max_len=512)
    ids, mask = ex["input_ids"], ex["loss_mask"]
    assert ids.dtype == np.int32 and mask.dtype == bool and ids.shape == mask.shape
    ((start, stop),) = mask_runs(ids, mask)
    assert smol_tok.decode(ids[start:stop]) == "2+2 = 4, of course.<|im_end|>"
    # The reply starts exactly where inference's generation prompt ends, and only ChatML's "\n" glue follows.
    assert ids[:start].tolist() == chat_prompt_ids(smol_tok, msgs[:1])
    assert smol_tok.decode(ids[stop:]) == "\n"


def test_multi_turn_with_system_prompt(smol_tok):
    msgs = [
        {"role": "system", "content": "Answer tersely."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
        {"role": "assistant", "content": " Rome,\nof course"},
    ]
    ex = tokenize_conversation(smol_tok, msgs, max_len=512)
    ids, mask = ex["input_ids"], ex["loss_mask"]
    runs = mask_runs(ids, mask)
    assert [smol_tok.decode(ids[a:b]) for a, b in runs] == ["Paris.<|im_end|>", " Rome,\nof course<|im_end|>"]
    unmasked = smol_tok.decode(ids[~mask])
    assert "Answer tersely." in unmasked and "And of Italy?" in unmasked
    assert unmasked.count("<|im_start|>assistant\n") == 2  # role headers are context, never labels
    # Token-prefix property of the second turn's header: the rendering inference would prompt with.
    from dflash_model.tokenizer import chat_prompt_ids

    assert ids[: runs[1][0]].tolist() == chat_prompt_ids(smol_tok, msgs[:4])


def test_truncation_keeps_the_mask_prefix(smol_tok):
    msgs = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": " ".join(map(str, range(60)))}]
    full = tokenize_conversation(smol_tok, msgs, max_len=4096)
    cut = tokenize_conversation(smol_tok, msgs, max_len=40)
    assert len(full["input_ids"]) > 60 and len(cut["input_ids"]) == 40
    np.testing.assert_array_equal(cut["input_ids"], full["input_ids"][:40])
    np.testing.assert_array_equal(cut["loss_mask"], full["loss_mask"][:40])
    assert cut["loss_mask"][-1] and not cut["loss_mask"][0]


def test_sharegpt_masks_on_real_data(smol_tok):
    """Every assistant turn of 12 real (multi-turn, markdown, code) conversations: masked text == reply + marker,
    and each header rendering is a token prefix of the whole conversation."""
    from dflash_model.tokenizer import chat_prompt_ids

    convs, _ = load_conversations("sharegpt", limit=12)
    turns = 0
    for c in convs:
        msgs = c["messages"]
        ids, spans = conv.assistant_spans(smol_tok, msgs)
        at = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        assert [smol_tok.decode(ids[a:b]) for a, b in spans] == [msgs[i]["content"] + "<|im_end|>" for i in at]
        assert all(ids[:a] == chat_prompt_ids(smol_tok, msgs[:i]) for i, (a, _) in zip(at, spans))
        turns += len(spans)
    assert turns == 43


def test_think_template_past_turns_use_offset_fallback(monkeypatch):
    """A template that, like Qwen3's, renders an empty think block only in the last assistant turn (and the
    generation prompt): earlier turns fail the prefix property and are found by character offsets; the last
    turn's mask starts after the think block. tests/fixtures/think_tokenizer (tools/make_think_tokenizer.py)."""
    from transformers import AutoTokenizer

    from data import conversations

    tok = AutoTokenizer.from_pretrained(str(FIXTURES / "think_tokenizer"))
    found = []
    by_offsets = conversations._span_by_offsets
    monkeypatch.setattr(conversations, "_span_by_offsets", lambda *a: found.append(by_offsets(*a)[0]) or by_offsets(*a))
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello there."},
        {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "Goodbye."},
    ]
    ex = tokenize_conversation(tok, msgs, max_len=512)
    ids = ex["input_ids"]
    runs = mask_runs(ids, ex["loss_mask"])
    assert [tok.decode(ids[a:b]) for a, b in runs] == ["Hello there.<|im_end|>", "Goodbye.<|im_end|>"]
    assert tok.decode(ids[: runs[1][0]]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert found == [runs[0]]  # the first turn, and only it, was found by character offsets


# ------------------------------------------------------------------------------------------- anchors


def test_sample_anchors_rule_and_padding():
    rng = np.random.default_rng(0)
    mask = np.zeros(40, bool)
    mask[5:12] = mask[20:23] = mask[30:40] = True  # the run 30..39 touches the row end
    cand = [a for a in range(39) if mask[a] and mask[a + 1] and a + 4 <= 40]
    assert cand == [5, 6, 7, 8, 9, 10, 20, 21, 30, 31, 32, 33, 34, 35, 36]
    seen = set()
    for _ in range(50):
        a = sample_anchors(mask, 6, 4, rng)
        assert a.dtype == np.int32 and a.shape == (6,)
        assert np.all(np.diff(a) > 0) and set(a.tolist()) <= set(cand)
        seen |= set(a.tolist())
    assert seen == set(cand)  # every valid position gets drawn eventually
    few = sample_anchors(mask, 20, 4, rng)
    assert few[:15].tolist() == cand and few[15:].tolist() == [-1] * 5
    assert sample_anchors(np.zeros(8, bool), 3, 4, rng).tolist() == [-1, -1, -1]


# -------------------------------------------------------------------------------------------- pipeline


def synthetic_records(n, seed=0):
    """Records whose tokens name them (token = 1000 * record + position); loss on the last two thirds."""
    rng = np.random.default_rng(seed)
    examples = []
    for i in range(n):
        t = int(rng.integers(8, 30))
        mask = np.zeros(t, bool)
        mask[t // 3 :] = True
        examples.append({"input_ids": 1000 * i + np.arange(t), "loss_mask": mask})
    return TokenizedRecords.from_examples(examples, [f"r{i}" for i in range(n)])


def take(it, n):
    return [next(it) for _ in range(n)]


def test_batches_are_padded_records():
    recs = synthetic_records(10)
    batches = list(build_dataset(recs, None, max_len=32, batch_size=4, seed=3, shard_index=0, shard_count=1))
    assert len(batches) == 2  # 10 records, batch 4, remainder dropped
    for b in batches:
        assert b["input_ids"].shape == b["loss_mask"].shape == (4, 32)
        assert b["input_ids"].dtype == np.int32 and b["loss_mask"].dtype == bool and b["lengths"].dtype == np.int32
        for row, i in enumerate(b["index"]):
            rec, n = recs[int(i)], int(b["lengths"][row])
            assert n == len(rec["input_ids"])
            np.testing.assert_array_equal(b["input_ids"][row, :n], rec["input_ids"])
            np.testing.assert_array_equal(b["loss_mask"][row, :n], rec["loss_mask"])
            assert not b["loss_mask"][row, n:].any() and not b["input_ids"][row, n:].any()


def test_shards_are_disjoint_cover_and_equal():
    recs = synthetic_records(20)

    def epochs(shard, count, n_records=None):
        ds = build_dataset(
            recs if n_records is None else synthetic_records(n_records),
            None,
            32,
            2,
            seed=5,
            num_epochs=2,
            shard_index=shard,
            shard_count=count,
        )
        idx = np.concatenate([b["index"] for b in ds]).tolist()
        return idx[: len(idx) // 2], idx[len(idx) // 2 :]

    (a0, a1), (b0, b1) = epochs(0, 2), epochs(1, 2)
    assert len(a0) == len(b0) == 10
    assert set(a0).isdisjoint(b0) and sorted(a0 + b0) == list(range(20))
    assert set(a1).isdisjoint(b1) and sorted(a1 + b1) == list(range(20))
    assert a0 != a1  # each epoch is a new permutation
    # 21 records on 2 hosts: both get 10 (equal batch counts keep multi-host steps in lock-step).
    (c0, _), (d0, _) = epochs(0, 2, 21), epochs(1, 2, 21)
    assert len(c0) == len(d0) == 10 and set(c0).isdisjoint(d0)


def test_iterator_state_round_trip():
    ds = build_dataset(
        synthetic_records(24),
        None,
        32,
        4,
        seed=7,
        num_epochs=3,
        shard_index=0,
        shard_count=1,
        num_anchors=5,
        block_size=4,
    )
    it = iter(ds)
    take(it, 3)
    state = it.get_state()
    expected = take(it, 2)
    fresh = iter(ds)
    fresh.set_state(json.loads(json.dumps(state)))  # survives a JSON checkpoint (Tunix custom metadata)
    got = take(fresh, 2)
    for e, g in zip(expected, got):
        assert e.keys() == g.keys() == {"input_ids", "loss_mask", "lengths", "index", "anchors"}
        for k in e:
            np.testing.assert_array_equal(e[k], g[k])


def test_anchors_valid_redrawn_each_epoch_and_seeded():
    recs = synthetic_records(8)

    def run(seed):
        ds = build_dataset(
            recs, None, 32, 4, seed=seed, num_epochs=2, shard_index=0, shard_count=1, num_anchors=3, block_size=4
        )
        return [{int(i): a.tolist() for i, a in zip(b["index"], b["anchors"])} for b in ds], list(ds)

    per_batch, batches = run(11)
    for b in batches:
        for mask, anchors in zip(b["loss_mask"], b["anchors"]):
            for a in anchors[anchors >= 0]:
                assert mask[a] and mask[a + 1] and a + 4 <= 32
            assert (anchors >= 0).sum() == min(3, pipeline.anchor_candidates(mask))
    epoch0 = per_batch[0] | per_batch[1]
    epoch1 = per_batch[2] | per_batch[3]
    assert sorted(epoch0) == sorted(epoch1) == list(range(8))
    assert sum(epoch0[i] != epoch1[i] for i in range(8)) >= 6  # redrawn, not replayed
    assert run(11)[0] == per_batch
    assert run(12)[0] != per_batch


def test_jsonl_is_tokenized_once_then_cached(tmp_path, smol_tok, monkeypatch):
    recs = [
        {
            "id": f"c{i}",
            "messages": [
                {"role": "user", "content": f"Question {i}?"},
                {"role": "assistant", "content": f"Answer number {i}, twice {2 * i}."},
            ],
        }
        for i in range(6)
    ]
    recs.append(
        {"id": "long", "messages": [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "ok"}]}
    )
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    first = list(build_dataset(path, smol_tok, 64, 2, seed=0, shard_index=0, shard_count=1, num_anchors=4))
    caches = sorted(p.name for p in tmp_path.glob("train.jsonl.tok-*"))
    assert len(caches) == 1
    cached = TokenizedRecords.load(tmp_path / caches[0])
    assert cached.ids == [f"c{i}" for i in range(6)]  # "long" has no loss token inside 64: dropped
    shipped = pickle.loads(pickle.dumps(cached))  # what a grain worker process receives: the path, no arrays
    assert len(pickle.dumps(cached)) < 2000 and shipped[5]["input_ids"].tolist() == cached[5]["input_ids"].tolist()

    def boom(*a, **k):
        raise AssertionError("tokenized again despite the cache")

    monkeypatch.setattr(pipeline, "tokenize_conversation", boom)
    again = list(build_dataset(path, smol_tok, 64, 2, seed=0, shard_index=0, shard_count=1, num_anchors=4))
    assert len(first) == len(again) == 3
    for a, b in zip(first, again):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
    with pytest.raises(AssertionError, match="tokenized again"):  # another max_len is another cache entry
        build_dataset(path, smol_tok, 48, 2, seed=0, shard_index=0, shard_count=1)
    with pytest.raises(ValueError, match="more than max_len=16"):
        next(iter(build_dataset(cached, smol_tok, 16, 2, seed=0, shard_index=0, shard_count=1)))


def test_synthetic_rows_draw_anchors_by_the_same_rule():
    """The synthetic pipeline uses the one sampler: every anchor has a label after it and its block inside the
    row (once a different rule let synthetic blocks run past the row's end)."""
    from train.batches import build_train_dataset
    from train.config import load_config

    cfg = load_config("tiny", ["block_size=16", "num_anchors=64"])
    ds, _, _ = build_train_dataset(cfg, vocab_size=512, mask_token_id=511)
    batch = next(iter(ds))
    t = batch["input_ids"].shape[1]
    drawn = 0
    for mask, anchors in zip(batch["loss_mask"], batch["anchors"]):
        cand = {a for a in range(t - 1) if mask[a] and mask[a + 1] and a + 16 <= t}
        real = [int(a) for a in anchors if a >= 0]
        assert real and set(real) <= cand and len(real) == min(64, len(cand))
        drawn += len(real)
    assert drawn > 0
