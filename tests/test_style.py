"""House style, enforced where CI runs: `ruff check` and `ruff format --check` on the whole tree (ruff is pinned in
pyproject.toml's dev extra, so the formatter's output cannot drift between machines), and no function of the
library (dflash_model/, infer/, train/) above McCabe complexity 12."""

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
