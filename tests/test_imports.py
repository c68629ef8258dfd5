"""Imports go one way: dflash_model <- data <- infer <- train <- benchmarks (a package imports only those to its
left and itself), checked on every import statement, function-local ones included."""

import ast
from pathlib import Path

import pytest
from conftest import REPO

ORDER = ["dflash_model", "data", "infer", "train", "benchmarks"]


def _imported_packages(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out & set(ORDER)


@pytest.mark.parametrize("package", ORDER)
def test_imports_point_one_way(package):
    allowed = set(ORDER[: ORDER.index(package) + 1])
    bad = {
        str(f.relative_to(REPO)): sorted(_imported_packages(f) - allowed)
        for f in sorted((REPO / package).rglob("*.py"))
        if _imported_packages(f) - allowed
    }
    assert not bad, f"{package} may import only {sorted(allowed)}; these import more: {bad}"


def test_the_check_sees_a_backwards_import(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("def f():\n    from train.trainer import Trainer\n")
    assert _imported_packages(f) == {"train"}
