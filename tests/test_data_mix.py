"""data.mix: the training JSONL of a continued stage (new replies plus a replay sample), rebuilt from its command."""

import gzip
import json
import random

import pytest

from data.mix import main, mix, parse_part


def _write(path, ids, gz=False):
    text = "".join(json.dumps({"id": i, "messages": []}) + "\n" for i in ids)
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text + "\n")  # a blank line at the end is skipped
    return str(path)


def _ids(path):
    return [json.loads(line)["id"] for line in open(path)]


def test_parts_are_shuffled_cut_and_mixed_as_stated(tmp_path):
    new = _write(tmp_path / "new.jsonl", [f"n{i}" for i in range(5)])
    old_a = _write(tmp_path / "a.jsonl.gz", [f"a{i}" for i in range(6)], gz=True)
    old_b = _write(tmp_path / "b.jsonl", [f"b{i}" for i in range(4)])
    out = tmp_path / "mix.jsonl"
    assert main([str(out), new, f"{old_a}+{old_b}:seed=1:skip=3:take=4", "--seed", "7"]) == 0

    replay = [f"a{i}" for i in range(6)] + [f"b{i}" for i in range(4)]
    random.Random(1).shuffle(replay)
    want = [f"n{i}" for i in range(5)] + replay[3:7]
    random.Random(7).shuffle(want)
    got = _ids(out)
    assert got == want
    assert len(got) == 9 and len(set(got)) == 9


def test_lines_are_copied_byte_for_byte(tmp_path):
    src = tmp_path / "r.jsonl"
    lines = ['{"id": "x",   "messages": []}\n', '{"messages": [], "id": "y"}']  # odd spacing, no final newline
    src.write_text("".join(lines))
    parts = [parse_part(str(src))]
    assert sorted(mix(parts, seed=0)) == sorted([lines[0], lines[1] + "\n"])


@pytest.mark.parametrize(
    "spec, message",
    [
        ("f.jsonl:take=x", "take='x' is not an integer"),
        ("f.jsonl:count=3", "unknown option 'count'"),
        ("f.jsonl:skip=-1", "skip must be >= 0"),
        (":take=3", "no file"),
    ],
)
def test_bad_part_names_the_spec(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_part(spec)


def test_bad_files_are_named(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: invalid JSON"):
        mix([parse_part(str(bad))], seed=0)
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        mix([parse_part(str(tmp_path / "missing.jsonl"))], seed=0)
    short = _write(tmp_path / "short.jsonl", ["a", "b"])
    with pytest.raises(ValueError, match="skip 1 \\+ take 2 > 2 lines"):
        mix([parse_part(f"{short}:skip=1:take=2")], seed=0)


def test_failed_mix_leaves_no_output(tmp_path):
    out = tmp_path / "mix.jsonl"
    with pytest.raises(FileNotFoundError):
        main([str(out), str(tmp_path / "missing.jsonl")])
    assert not out.exists()
