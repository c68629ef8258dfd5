"""The README stays a true front door: its Layout table names paths that exist and every module of the four
packages, it stays short, and the relative links of the README and the results page lead to files that exist."""

import re

import pytest
from conftest import REPO

PACKAGES = ("dflash_model", "train", "infer", "data")
LINKED = ("README.md", "docs/results.md", "docs/training.md", "docs/decoding.md", "docs/design.md")
MAX_README_LINES = 200


def _section(text: str, heading: str) -> str:
    """The body of a `## heading` section, up to the next `## ` heading."""
    m = re.search(rf"^## {re.escape(heading)}\s*$(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    assert m, f"README.md has no '## {heading}' section"
    return m.group(1)


def _layout_paths() -> list[str]:
    """The backticked paths in the first column of the README's Layout table."""
    paths = []
    for line in _section((REPO / "README.md").read_text(), "Layout").splitlines():
        cells = line.split("|")
        if not line.startswith("|") or len(cells) < 3 or set(cells[1].strip()) <= set("-: "):
            continue
        paths += re.findall(r"`([^`]+)`", cells[1])
    assert paths, "the Layout table names no path"
    return paths


def test_layout_paths_exist():
    missing = [p for p in _layout_paths() if not (REPO / p).exists()]
    assert not missing, f"README.md's Layout table names paths that do not exist: {missing}"


def test_layout_names_every_module():
    named = {p.rstrip("/") for p in _layout_paths()}
    modules = sorted(
        str(f.relative_to(REPO))
        for pkg in PACKAGES
        for f in (REPO / pkg).rglob("*.py")
        if f.name != "__init__.py" and "__pycache__" not in f.parts
    )
    assert modules, "no modules found"
    unnamed = [m for m in modules if m not in named]
    assert not unnamed, f"README.md's Layout table does not name these modules: {unnamed}"


def test_readme_is_short():
    n = len((REPO / "README.md").read_text().splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines, more than {MAX_README_LINES}"


@pytest.mark.parametrize("doc", LINKED)
def test_relative_links_resolve(doc):
    path = REPO / doc
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # commands, not links
    broken = []
    for target in re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL or an anchor in the same file
        file = target.split("#", 1)[0]
        if not (path.parent / file).exists():
            broken.append(target)
    assert not broken, f"{doc} links to files that do not exist: {broken}"
