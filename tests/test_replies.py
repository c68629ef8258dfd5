"""Reply lookup (infer.replies): the index against a dict-of-counts reference, the hash in numpy and jax, the
stored reply file (round trip, refusals naming the file) and `python -m infer.replies`."""

import collections
import json

import jax.numpy as jnp
import numpy as np
import pytest

from data.pipeline import TokenizedRecords
from infer.replies import (
    MAX_ORDER,
    build_index,
    concat_replies,
    continue_rows,
    load_index,
    load_replies,
    ngram_hash,
    save_replies,
    stored_replies,
)


def _reference(records, min_n, max_n):
    """{n-gram tuple: Counter of the reply tokens that followed it inside its record}."""
    table = collections.defaultdict(collections.Counter)
    for ids, mask in records:
        for i in range(len(ids)):
            for n in range(min_n, max_n + 1):
                if mask[i] and i - n >= 0:
                    table[tuple(ids[i - n : i])][ids[i]] += 1
    return table


def _reference_continue(table, history, steps, min_n, max_n):
    """Greedy continuation, longest n-gram first, ties to the smaller id; no n-gram: repeat the last token."""
    ctx, out, first = list(history), [], []
    for _ in range(steps):
        hit = None
        for n in range(max_n, min_n - 1, -1):
            c = table.get(tuple(ctx[-n:])) if len(ctx) >= n else None
            if c:
                best = max(c.values())
                hit = (min(t for t, v in c.items() if v == best), best / sum(c.values()))
                break
        tok = hit[0] if hit else ctx[-1]
        first.append(hit)
        out.append(tok)
        ctx.append(tok)
    return out, first[0]


def _records(rng, count, vocab=12):
    out = []
    for _ in range(count):
        ids = rng.integers(0, vocab, int(rng.integers(3, 30))).tolist()
        mask = [i >= 2 for i in range(len(ids))]  # a 2-token "header", then the reply
        out.append((ids, mask))
    return out


def _flat(records):
    offsets = np.cumsum([0] + [len(i) for i, _ in records])
    return (
        np.concatenate([i for i, _ in records]).astype(np.int32),
        np.concatenate([m for _, m in records]).astype(bool),
        offsets,
    )


@pytest.mark.parametrize("min_n,max_n", [(2, 4), (1, 3)])
def test_continuations_equal_a_dict_of_counts(min_n, max_n):
    """Over random records of a 12-token vocabulary (collisions of n-grams across orders and records abound):
    every row's drafts and first-draft probability equal the reference's, including rows shorter than max_n and
    n-grams that would cross a record boundary or end on a header token (not indexed)."""
    rng = np.random.default_rng(0)
    records = _records(rng, 40)
    index = build_index(*_flat(records), min_n=min_n, max_n=max_n)
    table = _reference(records, min_n, max_n)
    assert index.keys_A.shape[0] == len(table)  # one entry per distinct n-gram: no hash collision here
    assert bool(jnp.all(index.keys_A[1:] > index.keys_A[:-1]))
    rows = [rng.integers(0, 12, int(rng.integers(1, 9))).tolist() for _ in range(64)]
    history = np.zeros((len(rows), 16), np.int32)
    for b, r in enumerate(rows):
        history[b, : len(r)] = r
        history[b, len(r) :] = 11  # stale tokens past the committed length are never read
    n = jnp.asarray([len(r) for r in rows], jnp.int32)
    tokens, prob, found = continue_rows(index, jnp.asarray(history), n, 6)
    for b, r in enumerate(rows):
        want, first = _reference_continue(table, r, 6, min_n, max_n)
        assert np.asarray(tokens[b]).tolist() == want, (r, want)
        assert bool(found[b]) == (first is not None)
        if first is not None:
            assert float(prob[b]) == pytest.approx(first[1], rel=1e-6)


def test_hash_is_the_same_in_numpy_and_jax():
    rng = np.random.default_rng(1)
    for n in (1, 2, 4, MAX_ORDER):
        grams = rng.integers(0, 2**31 - 1, (100, n)).astype(np.uint32)
        h_np = ngram_hash(grams)
        h_jax = np.asarray(ngram_hash(jnp.asarray(grams), jnp))
        np.testing.assert_array_equal(h_np, h_jax)
        assert len(set(h_np.tolist())) == 100
    # The order seeds the hash: [0] and [0, 0] differ.
    assert ngram_hash(np.asarray([[0]], np.uint32)) != ngram_hash(np.asarray([[0, 0]], np.uint32))


def test_reply_file_round_trip_and_refusals(tmp_path):
    """A stored file keeps each assistant span with the MAX_ORDER tokens before it, and indexes exactly as the
    records it came from; a file for another vocabulary, another format or no reply file at all is refused,
    naming the file."""
    header = list(range(100, 100 + MAX_ORDER + 3))
    rec_ids = [header + [1, 2, 3, 4] + [200, 201] + [5, 6, 7], [300, 301, 1, 2, 9]]
    rec_mask = [[False] * len(header) + [True] * 4 + [False] * 2 + [True] * 3, [False, False, True, True, True]]
    records = TokenizedRecords.from_examples([{"input_ids": i, "loss_mask": m} for i, m in zip(rec_ids, rec_mask)])
    arrays = stored_replies(records)
    offs = arrays["offsets"]
    spans = [arrays["input_ids"][offs[i] : offs[i + 1]].tolist() for i in range(len(offs) - 1)]
    second = (header + [1, 2, 3, 4, 200, 201])[-MAX_ORDER:] + [5, 6, 7]
    assert spans == [header[3:] + [1, 2, 3, 4], second, [300, 301, 1, 2, 9]]
    path = tmp_path / "r.npz"
    save_replies(path, arrays, vocab_size=512)
    index = load_index(path, 512, min_n=2, max_n=2)
    history = jnp.asarray([[1, 2, 0], [301, 1, 0]], jnp.int32)
    tokens, prob, _ = continue_rows(index, history, jnp.asarray([2, 2]), 2)
    assert np.asarray(tokens).tolist() == [[3, 4], [2, 3]]  # [1, 2] -> 3 (once) or 9 (once): the smaller id
    np.testing.assert_allclose(np.asarray(prob), [0.5, 1.0])
    assert continue_rows(index, history, jnp.asarray([2, 2]), 0)[0].shape == (2, 0)  # K = 1: nothing to draft
    with pytest.raises(ValueError, match=r"r\.npz: its replies were tokenized for a vocabulary of 512"):
        load_index(path, 1000)
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match=r"bad\.npz: not a reply file"):
        load_index(tmp_path / "bad.npz", 512)
    np.savez(tmp_path / "old.npz", format=np.int64(0), vocab_size=np.int64(512), **arrays)
    with pytest.raises(ValueError, match=r"old\.npz: reply file format 0"):
        load_index(tmp_path / "old.npz", 512)
    empty = build_index(np.zeros(3, np.int32), np.zeros(3, bool), np.asarray([0, 3]))  # no reply token at all
    tokens, _, found = continue_rows(empty, history, jnp.asarray([2, 2]), 2)
    assert np.asarray(tokens).tolist() == [[2, 2], [1, 1]] and not bool(jnp.any(found))
    with pytest.raises(ValueError, match="1 <= min_n <= max_n"):
        build_index(*_flat([(rec_ids[1], rec_mask[1])]), min_n=3, max_n=2)
    # A grown file (`--base`) holds the base's records, then the new ones, each span as before.
    extra = stored_replies(TokenizedRecords.from_examples([{"input_ids": [7, 8, 9], "loss_mask": [0, 1, 1]}]))
    grown = concat_replies(load_replies(path, 512), extra)
    g_offs = grown["offsets"]
    assert [grown["input_ids"][g_offs[i] : g_offs[i + 1]].tolist() for i in range(4)] == [*spans, [7, 8, 9]]
    assert grown["loss_mask"].tolist() == arrays["loss_mask"].tolist() + [False, True, True]


@pytest.mark.slow
def test_cli_stores_the_assistant_turns_of_a_jsonl(tmp_path, smollm2):
    """`python -m infer.replies` on the real tokenizer: the stored reply tokens are the assistant turns' content
    and end-of-turn marker (the training data's loss mask), each after its role header."""
    from infer.replies import main

    _, _, tok = smollm2
    rows = [
        {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi there!"}]},
        {"messages": [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "One, two."}]},
    ]
    src = tmp_path / "replies.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["--input", str(src), "--out", str(tmp_path / "r.npz")]) == 0
    z = np.load(tmp_path / "r.npz")
    offs, ids, mask = z["offsets"], z["input_ids"], z["loss_mask"]
    assert len(offs) == 3 and int(z["vocab_size"]) == 49152
    for i, r in enumerate(rows):
        span = ids[offs[i] : offs[i + 1]]
        reply = tok.decode(span[mask[offs[i] : offs[i + 1]]])
        assert reply == r["messages"][1]["content"] + "<|im_end|>"
        assert tok.decode(span[~mask[offs[i] : offs[i + 1]]]).endswith("assistant\n")


def test_draft_spec_loads_a_reply_file(tmp_path):
    """`replies:FILE` (and adaptive:replies:FILE) load the file's index into a ReplyLookupProposer at the n-gram
    block size unless a block is given; a missing file is refused naming it; `lookuptree:FILE` loads a tree."""
    from types import SimpleNamespace

    from infer.loading import NGRAM_BLOCK, load_draft_spec
    from infer.proposers import ReplyLookupProposer

    rng = np.random.default_rng(2)
    records = TokenizedRecords.from_examples([{"input_ids": i, "loss_mask": m} for i, m in _records(rng, 5)])
    save_replies(tmp_path / "r.npz", stored_replies(records), vocab_size=512)
    cfg = SimpleNamespace(vocab_size=512)
    draft = load_draft_spec(f"replies:{tmp_path / 'r.npz'}", cfg)
    assert isinstance(draft.proposer, ReplyLookupProposer) and draft.block_size == NGRAM_BLOCK
    assert draft.params.keys_A.shape[0] > 0 and not draft.adaptive
    adaptive = load_draft_spec(f"adaptive:replies:{tmp_path / 'r.npz'}", cfg, block=16)
    assert adaptive.adaptive and adaptive.block_size == 16 and adaptive.name == "adaptive-replies"
    with pytest.raises(ValueError, match=r"missing\.npz: not a reply file"):
        load_draft_spec(f"replies:{tmp_path / 'missing.npz'}", cfg)
    # lookuptreeN:FILE: a tree of N nodes, paths up to N deep, over an index that also keeps 1-token n-grams.
    tree = load_draft_spec(f"lookuptree5:{tmp_path / 'r.npz'}", cfg)
    assert (tree.name, tree.tree_nodes, tree.block_size, tree.params.min_n) == ("lookuptree5", 5, 6, 1)
    assert load_draft_spec(f"adaptive:lookuptree:{tmp_path / 'r.npz'}", cfg).engine_options() == dict(
        block_size=8, adaptive=True, tree_nodes=7
    )
    with pytest.raises(ValueError, match="lookuptreeN, not @K"):
        load_draft_spec(f"lookuptree:{tmp_path / 'r.npz'}", cfg, block=16)
    # lookuptreeauto:FILE leaves the size to the engine, among those of the tree_tau.json beside the file (refused
    # without one); lookuptree:FILE keeps the default size, and adaptive: takes a fixed size only.
    with pytest.raises(ValueError, match="tree_tau.json to choose the size from"):
        load_draft_spec(f"lookuptreeauto:{tmp_path / 'r.npz'}", cfg)
    (tmp_path / "tree_tau.json").write_text(json.dumps({"tau": {"3": 2.0, "9": 2.5}}))
    auto = load_draft_spec(f"lookuptreeauto:{tmp_path / 'r.npz'}", cfg)
    assert (auto.name, auto.block_size) == ("lookuptree-auto", 10)
    assert auto.engine_options() == dict(tree_prior={3: 2.0, 9: 2.5})
    assert load_draft_spec(f"lookuptree:{tmp_path / 'r.npz'}", cfg).engine_options()["tree_nodes"] == 7
    with pytest.raises(ValueError, match="not both"):
        load_draft_spec(f"adaptive:lookuptreeauto:{tmp_path / 'r.npz'}", cfg)
    for bad in ({"tau": {"0": 2.0}}, {"tau": {"3": -1}}, {"taus": {}}, {"tau": ["3"]}):
        (tmp_path / "tree_tau.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match="tree_tau.json"):
            load_draft_spec(f"lookuptreeauto:{tmp_path / 'r.npz'}", cfg)


def test_reply_lookup_takes_context_matches_then_replies_then_short_matches():
    """Per row: a context match of 2+ tokens gives prompt lookup's continuation; otherwise the replies' (its source
    bucketed by the first draft's frequency); a 1-token context match where the replies have nothing gives the
    lookup; nothing at all repeats the last token."""
    from infer.proposers import REPEAT, REPLIES, SOURCES, NGramProposer, ReplyLookupProposer

    reply = [40, 41, 42, 43, 44]  # indexed twice: [40, 41] -> 42 always (prob 1), and so on
    other = [40, 41, 50]  # [40, 41] -> 50 once: prob 2/3 for 42
    records = [([1] + reply, [False] + [True] * 5)] * 2 + [([1] + other, [False, True, True, True])]
    index = build_index(*_flat(records), min_n=2, max_n=3)
    rows = [
        [7, 8, 9, 7, 8],  # [7, 8] seen before: lookup -> 9, 7, 8, 9
        [3, 40, 41],  # no context match; replies: [40, 41] -> 42 (2 of 3), [40, 41, 42] -> 43, ...
        [5, 6, 5, 60],  # [5, 60] unseen, [60] unseen; 1-token match? [60] no; repeat
        [5, 60, 5],  # 1-token match [5] at 0 -> 60; replies have nothing for [60, 5]
        [41, 3, 40, 41],  # 1-token match [41] at 0 -> 3, but the replies know [40, 41]: they come first
    ]
    history = np.zeros((len(rows), 12), np.int32)
    for b, r in enumerate(rows):
        history[b, : len(r)] = r
    n = jnp.asarray([len(r) for r in rows], jnp.int32)
    prop = ReplyLookupProposer().propose_scored(index, None, (), jnp.asarray(history), n, 5)
    assert np.asarray(prop.tokens).tolist() == [
        [9, 7, 8, 9],
        [42, 43, 44, 44],
        [60] * 4,
        [60, 5, 60, 5],
        [42, 43, 44, 44],
    ]
    _, match_len = NGramProposer().lookup(jnp.asarray(history), n, 5)
    assert np.asarray(match_len).tolist() == [2, 0, 0, 1, 1]
    assert [SOURCES[s] for s in np.asarray(prop.source).tolist()] == [
        "lookup 2",
        "replies 0.6-0.8",
        SOURCES[REPEAT],
        "lookup 1",
        "replies 0.6-0.8",
    ]
    # min_match=1 would take the 1-token match of the last row instead.
    short = ReplyLookupProposer(min_match=1).propose_scored(index, None, (), jnp.asarray(history), n, 5)
    assert np.asarray(short.tokens)[4].tolist() == [3, 40, 41, 3]
    assert SOURCES[REPLIES] == "replies <0.4" and not bool(prop.drafted)
