"""Atomic writes: the new file whole or the old one, with the permissions a plain write gives."""

import json
import os
import stat

import pytest

from dflash_model.files import atomic_write_text, atomic_writer


def test_atomic_write_replaces_whole_or_not_at_all(tmp_path):
    path = tmp_path / "eval.json"
    atomic_write_text(path, "old\n")
    with pytest.raises(RuntimeError), atomic_writer(path) as f:
        f.write(b"half of the new")
        raise RuntimeError("crash mid-write")
    assert path.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["eval.json"]
    atomic_write_text(path, "new\n")
    assert path.read_text() == "new\n"
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask  # not mkstemp's 0600


def test_no_committed_json_holds_nan_or_infinity():
    """Every committed JSON is strict JSON (no NaN / Infinity, which Python writes by default and other readers
    refuse): a number that does not exist is null. `infer.metrics.strict_dumps` writes them so."""
    import subprocess

    from conftest import REPO

    def refuse(constant):
        raise ValueError(constant)

    files = subprocess.run(["git", "-C", str(REPO), "ls-files", "*.json"], capture_output=True, text=True).stdout
    bad = []
    for name in files.split():
        try:
            json.loads((REPO / name).read_text(), parse_constant=refuse)
        except ValueError as e:
            bad.append(f"{name}: {e}")
    assert len(files.split()) > 100 and not bad, bad[:10]
