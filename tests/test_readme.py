"""The README stays a true front door: its Layout table and docs/design.md's Modules table name paths that exist,
the Modules table names every module of the four packages, the README stays short, the relative links of the docs
and drafter READMEs lead to files that exist, and every entry of docs/results/ is named from outside itself."""

import re
import subprocess

import pytest
from conftest import REPO

PACKAGES = ("dflash_model", "train", "infer", "data")
LINKED = sorted(
    str(p.relative_to(REPO)) for p in [REPO / "README.md", *REPO.glob("docs/*.md"), *REPO.glob("drafters/*/README.md")]
)
MAX_README_LINES = 200


def _section(doc: str, heading: str) -> str:
    """The body of a `## heading` section of `doc`, up to the next `## ` heading."""
    m = re.search(rf"^## {re.escape(heading)}\s*$(.*?)(?=^## |\Z)", (REPO / doc).read_text(), flags=re.M | re.S)
    assert m, f"{doc} has no '## {heading}' section"
    return m.group(1)


def _table_paths(doc: str, heading: str) -> list[str]:
    """The backticked paths in the first column of the table under `## heading` in `doc`."""
    paths = []
    for line in _section(doc, heading).splitlines():
        cells = line.split("|")
        if not line.startswith("|") or len(cells) < 3 or set(cells[1].strip()) <= set("-: "):
            continue
        paths += re.findall(r"`([^`]+)`", cells[1])
    assert paths, f"the table under {doc}'s '## {heading}' names no path"
    return paths


@pytest.mark.parametrize("doc, heading", [("README.md", "Layout"), ("docs/design.md", "Modules")])
def test_layout_paths_exist(doc, heading):
    missing = [p for p in _table_paths(doc, heading) if not (REPO / p).exists()]
    assert not missing, f"{doc}'s {heading} table names paths that do not exist: {missing}"


def test_modules_table_names_every_module():
    named = {p.rstrip("/") for p in _table_paths("docs/design.md", "Modules")}
    modules = sorted(
        str(f.relative_to(REPO))
        for pkg in PACKAGES
        for f in (REPO / pkg).rglob("*.py")
        if f.name != "__init__.py" and "__pycache__" not in f.parts
    )
    assert modules, "no modules found"
    unnamed = [m for m in modules if m not in named]
    assert not unnamed, f"docs/design.md's Modules table does not name these modules: {unnamed}"


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


def test_every_result_is_named():
    """A results folder or file that no document, drafter README, other results page or code names is a leftover."""
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    entries = sorted({f.split("/")[2] for f in tracked if f.startswith("docs/results/")})
    texts = {f: (REPO / f).read_text(errors="ignore") for f in tracked if f.endswith((".md", ".py", ".yml", ".json"))}
    unnamed = [
        e
        for e in entries
        if not any(
            re.search(rf"results/{re.escape(e)}(?![\w.-])", text)
            for f, text in texts.items()
            if not f.startswith(f"docs/results/{e}")
        )
    ]
    assert not unnamed, f"docs/results/ holds entries nothing names: {unnamed}"
