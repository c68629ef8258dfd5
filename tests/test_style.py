"""House style, enforced where CI runs: `ruff check` and `ruff format --check` on the whole tree (ruff is pinned in
pyproject.toml's dev extra, so the formatter's output cannot drift between machines), and no function of the
library (dflash_model/, infer/, train/) above McCabe complexity 12, and no library module (those and data/) over 500
lines: a module that grows past one reader's sitting is split by job."""

import subprocess
import sys

import pytest
from conftest import REPO

COMPLEXITY = [
    "check",
    "--select",
    "C901",
    "--config",
    "lint.mccabe.max-complexity=12",
    "infer",
    "train",
    "dflash_model",
]


@pytest.mark.parametrize("args", [["check", "."], ["format", "--check", "."], COMPLEXITY])
def test_ruff_is_clean(args):
    proc = subprocess.run([sys.executable, "-m", "ruff", *args], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, f"ruff {' '.join(args)}:\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}"


MAX_MODULE_LINES = 500


def test_no_library_module_is_over_500_lines():
    sizes = {
        str(f.relative_to(REPO)): f.read_text().count("\n")
        for package in ("dflash_model", "data", "infer", "train")
        for f in sorted((REPO / package).rglob("*.py"))
    }
    assert len(sizes) > 40, sorted(sizes)  # the walk found the library
    assert not {f: n for f, n in sizes.items() if n > MAX_MODULE_LINES}
