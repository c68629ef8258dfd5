"""run_dir=gs://bucket/run: the run's files reach object storage through etils.epath, and a fresh host resumes.

The bucket is fsspec's in-memory filesystem registered for gs://, so the path goes through epath's real gs://
code (its fsspec backend, as with gcsfs on a pod) with no network. Checkpoints are the exception: Orbax writes
gs:// through tensorstore's own GCS driver and google-auth, which no offline fake reaches, so these tests keep
checkpoint.dir local (a gs:// checkpoint directory is handed to Orbax as the URI, train.checkpointing).
"""

import json
import sys

import fsspec  # noqa: F401 - loads fsspec.registry
import pytest
from etils import epath
from fsspec.implementations.memory import MemoryFileSystem

from dflash_model.files import local_dir, pull, push
from train.config import load_config
from train.trainer import open_trainer
from train.workflow import export_run


class FakeGCS(MemoryFileSystem):
    """gs://bucket/key held in memory."""

    protocol = ("gs", "gcs")
    root_marker = ""
    store, pseudo_dirs = {}, [""]

    def __init__(self, *args, finalize_on_close=None, **kwargs):  # epath opens gcs with finalize_on_close
        super().__init__(*args, **kwargs)

    @classmethod
    def _strip_protocol(cls, path):
        path = str(path)
        for scheme in ("gs://", "gcs://"):
            path = path.removeprefix(scheme)
        return path.strip("/")


@pytest.fixture
def bucket(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    for name in ("gs", "gcs"):  # undone after the test (fsspec.register_implementation has no undo)
        monkeypatch.setitem(sys.modules["fsspec.registry"]._registry, name, FakeGCS)
    FakeGCS.store.clear()
    FakeGCS.pseudo_dirs[:] = [""]
    # epath caches one filesystem per scheme: drop any real gcsfs it made earlier.
    from etils.epath import backend

    backend.fsspec_backend._get_filesystem.cache_clear()
    yield epath.Path("gs://bucket")
    backend.fsspec_backend._get_filesystem.cache_clear()


def test_push_copies_new_and_changed_files_only(bucket, tmp_path):
    run = "gs://bucket/run"
    local = local_dir(run)
    assert local == tmp_path / "cache" / "staging" / "gs" / "bucket" / "run"
    (local / "eval").mkdir(parents=True)
    (local / "metrics.jsonl").write_text('{"step": 1}\n')
    (local / "eval" / "table.md").write_text("| a |\n")
    (local / "features").mkdir()
    (local / "features" / "features.npy").write_bytes(b"big")  # a local cache: never mirrored
    assert push(run) == 2
    assert push(run) == 0
    with (local / "metrics.jsonl").open("a") as f:
        f.write('{"step": 2}\n')
    assert push(run) == 1
    remote = bucket / "run"
    assert (remote / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
    assert (remote / "eval" / "table.md").read_text() == "| a |\n"
    assert not (remote / "features").exists()
    assert push(str(tmp_path / "plain")) == 0  # a local run_dir is its own copy


@pytest.mark.long
def test_uri_run_trains_mirrors_and_resumes_on_a_fresh_host(bucket, tmp_path, monkeypatch):
    keys = ["run_dir=gs://bucket/run", f"checkpoint.dir={tmp_path / 'ck'}", "train.steps=4", "checkpoint.every_steps=2"]
    monkeypatch.chdir(tmp_path)
    tr = open_trainer(load_config("tiny", keys), restore=False)
    tr.train()
    exported = export_run(tr)
    remote = bucket / "run"
    lines = (remote / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3, 4]
    export = remote / "export" / "model.safetensors"
    assert export.read_bytes() == (tr.run_dir / "export" / "model.safetensors").read_bytes()
    assert exported == tr.run_dir / "export"
    assert not (tmp_path / "gs:").exists()  # the old pathlib behaviour: a local directory named "gs:"

    # A fresh host: no staging directory. The metrics come back from the bucket, the state from the checkpoint.
    staging = local_dir("gs://bucket/run")
    for p in sorted(staging.rglob("*"), reverse=True):
        p.unlink() if p.is_file() else p.rmdir()
    more = open_trainer(load_config("tiny", [*keys, "train.steps=6"]))
    assert more.restored_step == 4
    assert (staging / "metrics.jsonl").read_text().splitlines() == lines
    more.train()
    assert len((remote / "metrics.jsonl").read_text().splitlines()) == 6
    assert pull("gs://bucket/run") == 0  # nothing left that the staging directory lacks


@pytest.mark.long
def test_eval_out_on_object_storage(bucket, tmp_path):
    from infer import eval as ev
    from tests.conftest import FIXTURES

    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"id": f"p{i}", "prompt_ids": list(range(5 + i, 30))}) for i in range(2)))
    argv = ["--target", str(FIXTURES / "tiny_qwen3"), "--draft", "ngram", "--block", "4", "--dataset", str(data)]
    ev.main([*argv, "--max-new-tokens", "8", "--out", "gs://bucket/eval", "--no-progress"])
    saved = json.loads((bucket / "eval" / "eval.json").read_text())
    assert saved["prompts"] == 2 and saved["lossless_mismatches"] == 0
    assert (bucket / "eval" / "table.md").exists() and (bucket / "eval" / "acceptance.png").exists()
