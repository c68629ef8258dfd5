"""The eval's prompt sets: z-lab dflash's wording and subset on known items, the package-shipped sets, a set only the
hub has skipped offline, local HF-format datasets and JSONL prompt files of every form, and bad rows named."""

import json
import random

import pytest

from data import prompt_sets as ps

BOXED = "\nPlease reason step by step, and put your final answer within \\boxed{}."


def test_zlab_wording_on_known_items():
    gsm = ps.named_prompts("gsm8k")
    assert len(gsm) == 1319 and gsm[0]["id"] == "gsm8k/0"
    assert gsm[0]["text"].startswith("Janet") and gsm[0]["text"].endswith("?" + BOXED)
    he = ps.named_prompts("humaneval")[0]
    assert he["id"] == "HumanEval/0"
    head = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
    assert he["text"].startswith(head + "from typing import List") and he["text"].endswith("\n```")
    aime = ps.named_prompts("aime25")
    assert (
        len(aime) == 30
        and aime[0]["text"]
        == "Find the sum of all integer bases $b>9$ for which $17_{b}$ is a divisor of $97_{b}$." + BOXED
    )
    # raw: the bare text, as this eval asked before.
    assert ps.named_prompts("gsm8k", 1, style="raw")[0]["text"] == gsm[0]["text"][: -len(BOXED)]


def test_mtbench_has_both_turns_the_second_after_the_first():
    rows = ps.named_prompts("mtbench")
    assert len(rows) == 160
    first, second = rows[0], rows[1]
    assert first["id"] == "mtbench/81" and "earlier_turns" not in first
    assert second["id"] == "mtbench/81/turn2" and second["earlier_turns"] == [first["text"]]
    assert second["text"].startswith("Rewrite your previous response")
    assert [r["id"] for r in ps.named_prompts("mtbench", 3, style="raw")] == ["mtbench/81", "mtbench/82", "mtbench/83"]


def test_a_limit_takes_zlabs_shuffled_subset():
    order = list(range(1319))
    random.Random(0).shuffle(order)  # z-lab: random.seed(0), then random.shuffle of the whole set
    assert [r["id"] for r in ps.named_prompts("gsm8k", 4)] == [f"gsm8k/{i}" for i in order[:4]]
    assert [r["id"] for r in ps.named_prompts("gsm8k", 4, style="raw")] == [f"gsm8k/{i}" for i in range(4)]
    assert len(ps.named_prompts("humaneval", 500)) == 164  # a limit over the set's size takes it all, unshuffled


def test_held_out_prompts_never_include_the_first_of_either_order():
    """--skip 40 (infer.eval, infer.teacher_forced): none of the prompts any `--limit 40` run saw, in either style."""
    for name in ("humaneval", "mtbench"):
        every = ps.named_prompts(name, None, style="raw")
        rows, info = ps.held_out(every, True, 40, 20)
        seen = {r["id"] for style in ("raw", "zlab") for r in ps.named_prompts(name, 40, style=style)}
        assert rows and not {r["id"] for r in rows} & seen, name
        assert len(ps.group_items(rows)) == min(20, info["items_held_out"])
    # MT-Bench: 80 items, 60 of them among the first 40 of one order or the other.
    rows, info = ps.held_out(ps.named_prompts("mtbench", None, style="raw"), True, 40, None)
    assert info["items_held_out"] == 20 and len(ps.group_items(rows)) == 20


def test_a_hub_only_set_is_unavailable_offline():
    for name in ("math500", "mbpp", "alpaca"):
        with pytest.raises(ps.Unavailable, match=rf"{name}: online only \(.* on the HF hub; no package ships it\)"):
            ps.named_prompts(name, offline=True)
    assert ps.SETS["mbpp"].hub == ("google-research-datasets/mbpp", "sanitized")
    assert ps.SETS["alpaca"].zlab({"instruction": "Do x.", "input": "y"}) == ["Do x.\n\nInput:\ny"]
    assert ps.SETS["alpaca"].zlab({"instruction": "Do x.", "input": ""}) == ["Do x."]


ROWS = [
    {"id": "a", "prompt": "Hello"},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]},
    {"input_ids": [5, 6, 7]},
    {"token_ids": [8, 9]},
]
PARSED = [
    {"id": "a", "text": "Hello"},
    {"id": "p/1", "messages": ROWS[1]["messages"]},
    {"id": "p/2", "prompt_ids": [5, 6, 7]},
    {"id": "p/3", "prompt_ids": [8, 9]},
]


def test_jsonl_rows_of_every_form(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    assert ps.jsonl_prompts(path) == PARSED
    assert ps.jsonl_prompts(path, 2) == PARSED[:2]


@pytest.mark.parametrize(
    "row, key",
    [
        ({"input_ids": [1, "x"]}, "input_ids"),
        ({"token_ids": []}, "token_ids"),
        ({"messages": [{"role": "user"}]}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": 3}, "prompt"),
    ],
)
def test_a_bad_row_is_named_by_file_line_and_key(tmp_path, row, key):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=rf"{path}:2: key '{key}' must be"):
        ps.jsonl_prompts(path)
    path.write_text(json.dumps({"text": "no known key"}) + "\n")
    with pytest.raises(ValueError, match=rf"{path}:1: no prompt, messages, input_ids or token_ids .*'text'"):
        ps.jsonl_prompts(path)


def test_local_hf_datasets_saved_to_disk_and_as_parquet(tmp_path):
    import datasets

    rows = [{"id": "x", "prompt": "Hello"}, {"id": "y", "prompt": "World"}]
    ds = datasets.Dataset.from_list(rows)
    ds.save_to_disk(str(tmp_path / "saved"))
    assert ps.hf_prompts(str(tmp_path / "saved")) == [{"id": "x", "text": "Hello"}, {"id": "y", "text": "World"}]
    datasets.DatasetDict({"test": ds, "train": ds.select([1])}).save_to_disk(str(tmp_path / "dict"))
    assert [r["id"] for r in ps.hf_prompts(f"{tmp_path / 'dict'}:train")] == ["y"]
    assert [r["id"] for r in ps.hf_prompts(str(tmp_path / "dict"), 1)] == ["x"]  # 'test' without a split named
    (tmp_path / "pq").mkdir()
    datasets.Dataset.from_list([{"input_ids": [3, 4]}, {"input_ids": [5]}]).to_parquet(
        str(tmp_path / "pq/test.parquet")
    )
    assert ps.hf_prompts(f"{tmp_path / 'pq'}:test") == [
        {"id": "pq/0", "prompt_ids": [3, 4]},
        {"id": "pq/1", "prompt_ids": [5]},
    ]
    with pytest.raises(ValueError, match=r"hf:.*pq:test row 0: key 'input_ids'"):
        datasets.Dataset.from_list([{"input_ids": [-0.5]}]).to_parquet(str(tmp_path / "pq/test.parquet"))
        ps.hf_prompts(f"{tmp_path / 'pq'}:test")
