"""The guards of every entry point beyond the core CLIs: output places locked and probed before work, files read back
validated where they are read, offline meaning offline, staged parts checked, and one `error:` line for each."""

import errno
import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from dflash_model.cli import INPUT_ERROR_EXIT, run_main
from dflash_model.files import RunLock, check_out_dir, check_out_file, claim_dir, open_run_dir

REPO = Path(__file__).resolve().parent.parent


def _load_script(relpath: str):
    """A script under benchmarks/ or tools/ as a module (they are not packages)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(Path(relpath).stem, REPO / relpath)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- one error line -------------------------------------------------------------------------------------------------


def test_a_named_stop_and_a_full_disk_read_as_one_error_line(capsys):
    def stops(_argv):
        raise SystemExit("error: results/eval.json: no such run")

    with pytest.raises(SystemExit) as e:
        run_main(stops)
    assert e.value.code == INPUT_ERROR_EXIT
    assert capsys.readouterr().err.splitlines()[0] == "error: results/eval.json: no such run"

    def fills(_argv):
        raise OSError(errno.ENOSPC, "No space left on device", "out/eval.json")

    with pytest.raises(SystemExit) as e:
        run_main(fills)
    assert e.value.code == INPUT_ERROR_EXIT
    assert "error: out/eval.json: No space left on device" in capsys.readouterr().err

    def exits_zero(_argv):
        raise SystemExit(0)

    with pytest.raises(SystemExit) as e:  # a plain exit status is left alone
        run_main(exits_zero)
    assert e.value.code == 0


# ---- output places --------------------------------------------------------------------------------------------------


def test_an_output_directory_is_locked_and_a_file_there_is_refused_by_name(tmp_path):
    lock = claim_dir(tmp_path / "out", key="--out", doing="written by an eval", name=".eval.lock")
    with pytest.raises(RuntimeError, match=rf"{tmp_path / 'out'} is being written by an eval by pid {os.getpid()}"):
        claim_dir(tmp_path / "out", key="--out", doing="written by an eval", name=".eval.lock")
    lock.release()
    claim_dir(tmp_path / "out", key="--out", doing="written by an eval", name=".eval.lock").release()  # free again

    (tmp_path / "a-file").write_text("x")
    with pytest.raises(ValueError, match=r"--out=.*a-file is a file, not a directory"):
        claim_dir(tmp_path / "a-file", key="--out", doing="written", name=".eval.lock")
    with pytest.raises(ValueError, match=r"--out .*a-file/sub: .*a-file is a file"):
        check_out_dir(tmp_path / "a-file" / "sub", "--out")
    with pytest.raises(ValueError, match=r"--out .* is a directory: name the file"):
        check_out_file(tmp_path, "--out")
    assert check_out_file(tmp_path / "new" / "r.json", "--out").parent.is_dir()


def test_two_runs_sharing_a_checkpoint_dir_are_refused(tmp_path):
    shared = tmp_path / "ckpt"
    first = open_run_dir(tmp_path / "run-a", checkpoint_dir=str(shared))
    with pytest.raises(RuntimeError, match=r"ckpt is being trained by pid .*checkpoint.dir"):
        open_run_dir(tmp_path / "run-b", checkpoint_dir=str(shared))
    RunLock(tmp_path / "run-b").release()  # run-b's own lock was given back on the refusal
    first.release()  # releases the checkpoint.dir lock with it
    open_run_dir(tmp_path / "run-b", checkpoint_dir=str(shared)).release()
    # the default checkpoint.dir (inside the run directory) needs no second lock
    open_run_dir(tmp_path / "run-c", checkpoint_dir=str(tmp_path / "run-c" / "checkpoints")).release()


def test_an_unreachable_checkpoint_store_is_refused_in_seconds(tmp_path, monkeypatch):
    from dflash_model import files

    calls = []

    def unreachable(uri, timeout_s=None, key="run_dir"):
        calls.append((uri, key))
        raise ValueError(f"{key}={uri}: cannot be reached or written: ConnectionError: offline")

    monkeypatch.setattr(files, "probe_uri", unreachable)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"checkpoint.dir=gs://b/ckpt: cannot be reached"):
        open_run_dir(tmp_path / "run", checkpoint_dir="gs://b/ckpt")
    assert calls == [("gs://b/ckpt", "checkpoint.dir")] and time.monotonic() - t0 < 5
    RunLock(tmp_path / "run").release()  # the run directory's lock was given back on the refusal


def test_a_shared_feature_cache_waits_for_its_builder(tmp_path):
    """The second user of a cache waits for the first to release it (then finds the cache built), instead of both
    rebuilding it over each other."""
    builder = RunLock(tmp_path, key="features.cache_dir", name=".features.lock", doing="built", wait=True)
    got = []
    waiter = threading.Thread(
        target=lambda: got.append(RunLock(tmp_path, name=".features.lock", doing="built", wait=True))
    )
    waiter.start()
    time.sleep(0.3)
    assert not got  # still waiting while the builder holds it
    builder.release()
    waiter.join(5)
    assert got and got[0].held
    got[0].release()


def test_eval_refuses_a_file_as_out_before_any_work(tmp_path, capsys):
    from infer import eval as infer_eval

    out = tmp_path / "results.json"
    out.write_text("{}")
    t0 = time.monotonic()
    with pytest.raises(SystemExit) as e:
        run_main(infer_eval.main, ["--target", "smollm2", "--dataset", "humaneval", "--draft", "ngram@4", "--out",
                                    str(out)])  # fmt: skip
    assert e.value.code == INPUT_ERROR_EXIT and time.monotonic() - t0 < 10
    assert f"--out={out} is a file, not a directory" in capsys.readouterr().err
    assert out.read_text() == "{}"


# ---- offline means offline ------------------------------------------------------------------------------------------


def test_offline_never_opens_a_connection_for_a_hub_dataset(monkeypatch):
    import socket

    from data import prompt_sets

    def no_network(*_a, **_k):
        raise AssertionError("a connection was opened")

    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    with pytest.raises(prompt_sets.Unavailable, match=r"hf:someorg/someset: on the HF hub, and --offline"):
        prompt_sets.hf_prompts("someorg/someset", offline=True)


def test_an_unreachable_hub_is_one_line_in_seconds(monkeypatch):
    import socket

    from data import prompt_sets

    for key in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "HF_ENDPOINT", "HF_HUB_OFFLINE",
                "HF_DATASETS_OFFLINE"):  # fmt: skip
        monkeypatch.delenv(key, raising=False)

    def refused(*_a, **_k):
        raise ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")

    monkeypatch.setattr(socket, "create_connection", refused)
    t0 = time.monotonic()
    with pytest.raises(prompt_sets.Unavailable, match=r"hf:someorg/someset: on the HF hub, which cannot be reached"):
        prompt_sets.hf_prompts("someorg/someset")
    assert time.monotonic() - t0 < 5
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(prompt_sets.Unavailable, match="HF_HUB_OFFLINE"):
        prompt_sets.check_hub_reachable("hf:x/y")


# ---- files read back ------------------------------------------------------------------------------------------------


def test_a_damaged_study_result_is_named_and_recomputed(tmp_path, capsys):
    wide = _load_script("benchmarks/wide_blocks.py")
    path = tmp_path / "eval.json"
    path.write_text('{"reports": {"a": 1')  # cut mid-write
    assert wide.read_result(path) is None
    assert "eval.json: damaged (JSONDecodeError" in capsys.readouterr().out
    assert not path.exists() and (tmp_path / "eval.json.damaged").exists()
    path.write_text('{"reports": {}}')
    assert wide.read_result(path) == {"reports": {}}
    assert wide.read_result(tmp_path / "none.json") is None

    assert wide.check_arms("ft16,ft64s1,scratch16") == ["ft16", "ft64s1", "scratch16"]
    for bad, said in (("ft16,ft16", "ft16 named twice"), ("ft1", "'ft1' is not"), ("wide64", "'wide64' is not")):
        with pytest.raises(ValueError, match=said):
            wide.check_arms(bad)


def _stage(tmp_path, monkeypatch, part_mb=0.00005):
    """Pack two small files into parts of `part_mb` MB (several chunks each)."""
    pack = _load_script("tools/accelerator_pack.py")
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(os.urandom(180))
    (src / "b.txt").write_text("hello " * 20)
    os.utime(src / "a.bin", (1_000_000_000, 1_000_000_000))
    monkeypatch.setattr(
        pack, "logical_files", lambda args, tmp: {"cache/x/a.bin": src / "a.bin", "b.txt": src / "b.txt"}
    )
    stage = tmp_path / "stage"
    pack.main(["--out", str(stage), "--part-mb", str(part_mb), "--wheels", ""])
    flat = tmp_path / "flat"  # what the machine holds: every part's files copied into one folder
    flat.mkdir()
    for part in sorted(stage.iterdir()):
        for f in part.iterdir():
            (flat / f.name).write_bytes(f.read_bytes())
    return pack, src, flat


def test_staged_parts_round_trip_and_damage_is_named_with_nothing_partial_left(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("DFLASH_CACHE", str(cache))
    pack, src, flat = _stage(tmp_path, monkeypatch)
    manifest = json.loads((flat / "manifest.json").read_text())
    assert manifest["cache/x/a.bin"]["bytes"] == 180 and len(manifest["cache/x/a.bin"]["sha256"]) == 64
    assert len(manifest["cache/x/a.bin"]["chunks"]) > 1

    pack.main(["--unpack", str(flat)])
    assert (cache / "x/a.bin").read_bytes() == (src / "a.bin").read_bytes()
    assert (cache / "x/a.bin").stat().st_mtime == 1_000_000_000
    assert (flat / "files/b.txt").read_text() == (src / "b.txt").read_text()

    # a truncated chunk: the file is named, nothing of it is written
    (cache / "x/a.bin").unlink()
    chunk = manifest["cache/x/a.bin"]["chunks"][-1]
    (flat / chunk).write_bytes((flat / chunk).read_bytes()[:-3])
    with pytest.raises(SystemExit, match=r"cache/x/a.bin: its chunks .* damaged or truncated"):
        pack.main(["--unpack", str(flat)])
    assert not (cache / "x/a.bin").exists() and not list(cache.rglob("*.partial"))

    # a missing chunk: named before anything is written
    (flat / chunk).unlink()
    with pytest.raises(SystemExit, match=rf"1 chunk\(s\) missing, e.g. {chunk}"):
        pack.main(["--unpack", str(flat)])

    # --out holding anything but part folders is not replaced
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match="holds files other than part folders"):
        pack.main(["--out", str(keep), "--wheels", ""])
    assert (keep / "notes.txt").read_text() == "mine"


# ---- tools that train -----------------------------------------------------------------------------------------------


def test_train_to_deadline_refuses_a_past_deadline_and_a_directory_holding_a_run(tmp_path, capsys):
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import train_to_deadline as tool
    finally:
        sys.path.remove(str(REPO / "tools"))
    run_dir = tmp_path / "run"
    base = ["--config", "tiny", f"run_dir={run_dir}"]
    with pytest.raises(ValueError, match=r"--deadline \d+ is -\d+ s from now"):
        tool.main(["--deadline", str(time.time() - 5), *base])
    with pytest.raises(ValueError, match=r"is \d+ s from now: at least 60 s"):
        tool.main(["--deadline", str(time.time() + 10.5), *base])
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ValueError, match=r"holds a run already \(metrics.jsonl\).*--restart"):
        tool.main(["--deadline", str(time.time() + 3600), *base])
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1}\n'  # nothing replaced
    RunLock(run_dir).release()  # and the lock was given back


# ---- values, not just types -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("override", ["train.lr=inf", "train.lr=nan", "gamma=.inf", "distill_weight=nan",
                                      "train.grad_clip=inf", "train.b1=nan"])  # fmt: skip
def test_non_finite_numbers_are_refused_by_key(override):
    from train.config import load_config

    key = override.split("=")[0]
    with pytest.raises(ValueError, match=rf"{key}=.*: must be a finite number"):
        load_config("tiny", [override])


@pytest.mark.parametrize(
    "override, said",
    [("drafter.target_layer_ids=[1,1]", "a layer named twice"), ("eval.also_blocks=[8,8]", "a block size named twice")],
)
def test_entries_that_must_be_distinct_are_refused(override, said):
    from train.config import load_config

    with pytest.raises(ValueError, match=said):
        load_config("tiny", ["drafter.n_features=2", override] if "layer_ids" in override else [override])


@pytest.mark.parametrize("text", ["inf", "nan", "-0.5", "x"])
def test_a_temperature_that_cannot_work_is_refused(text):
    import argparse

    from infer.loading import non_negative

    with pytest.raises(argparse.ArgumentTypeError):
        non_negative(text)


def test_a_full_disk_keeps_the_earlier_file_and_names_the_path(tmp_path, monkeypatch, capsys):
    """A write that fails for want of space (simulated: os.fsync raises ENOSPC) leaves the earlier file whole, no
    temporary file beside it, and the one error line names the file."""
    from dflash_model import files

    out = tmp_path / "eval.json"
    files.atomic_write_text(out, '{"tau": 2.0}')

    def full(_fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files.os, "fsync", full)
    with pytest.raises(SystemExit) as e:
        run_main(lambda _argv: files.atomic_write_text(out, '{"tau": 3.0}'))
    assert e.value.code == INPUT_ERROR_EXIT
    assert f"error: {out}: No space left on device" in capsys.readouterr().err
    assert out.read_text() == '{"tau": 2.0}' and [p.name for p in tmp_path.iterdir()] == ["eval.json"]
