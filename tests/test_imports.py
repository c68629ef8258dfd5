"""Imports go one way: dflash_model <- data <- infer <- train <- benchmarks (a package imports only those to its
left and itself), checked on every import statement, function-local ones included."""

import ast
from pathlib import Path

import pytest
from conftest import REPO

ORDER = ["dflash_model", "data", "infer", "train", "benchmarks"]


def _imported_names(path: Path) -> set[str]:
    """The top-level packages a file imports, function-local imports included."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


def _imported_packages(path: Path) -> set[str]:
    return _imported_names(path) & set(ORDER)


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


def _imported_modules(path: Path, package: str) -> set[str]:
    """Modules of `package` that `path` imports (`from infer import proposers` and `from infer.proposers import x`
    both name infer.proposers), function-local imports included."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith(f"{package}.")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == package:
                out |= {f"{package}.{a.name}" for a in node.names}
            elif node.module.startswith(f"{package}."):
                out.add(node.module)
    return out


def import_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the module graph (a list whose first and last names are the same), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt, [*path, nxt])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def _module_graph(package: str) -> dict[str, set[str]]:
    graph = {}
    for f in sorted((REPO / package).rglob("*.py")):
        parts = f.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        graph[name] = _imported_modules(f, package) - {name}
    return graph


@pytest.mark.parametrize("package", ORDER)
def test_no_import_cycle_inside_a_package(package):
    cycle = import_cycle(_module_graph(package))
    assert cycle is None, f"import cycle in {package}: {' -> '.join(cycle)}"


def test_the_cycle_check_sees_a_function_local_cycle(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("from pkg.b import x\n")
    (tmp_path / "pkg" / "b.py").write_text("def f():\n    from pkg import c\n")
    (tmp_path / "pkg" / "c.py").write_text("import pkg.a\n")
    graph = {f"pkg.{f.stem}": _imported_modules(f, "pkg") for f in sorted((tmp_path / "pkg").glob("*.py"))}
    assert graph == {"pkg.a": {"pkg.b"}, "pkg.b": {"pkg.c"}, "pkg.c": {"pkg.a"}}
    assert import_cycle(graph) == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]
    assert import_cycle({"pkg.a": {"pkg.b"}, "pkg.b": set()}) is None


def test_no_train_module_shadows_a_package():
    """`python train/run.py` puts train/ first on sys.path, so a train/NAME.py would hide a top-level package NAME
    (train/data.py once hid `data`)."""
    shadowing = sorted(f.stem for f in (REPO / "train").glob("*.py") if (REPO / f.stem / "__init__.py").is_file())
    assert not shadowing, f"train/ modules named like a top-level package: {shadowing}"


def test_evaluation_is_a_library_a_report_and_a_thin_command():
    """infer/measure.py measures, infer/report.py writes and formats, infer/eval.py is the command: each under 400
    lines, the library imports neither of the others, the report not the command, and no module but the command's
    own tests imports the command (the end-of-run eval and the teacher-forced command use the library)."""
    layers = ["infer/eval_sets.py", "infer/measure.py", "infer/report.py", "infer/eval.py"]
    for rel in layers:
        lines = (REPO / rel).read_text().count("\n")
        assert lines < 400, f"{rel} has {lines} lines"
    assert not _imported_modules(REPO / "infer/measure.py", "infer") & {"infer.report", "infer.eval"}
    assert "infer.eval" not in _imported_modules(REPO / "infer/report.py", "infer")
    users = {
        str(f.relative_to(REPO))
        for package in [*ORDER, "tools"]
        for f in (REPO / package).rglob("*.py")
        if "infer.eval" in _imported_modules(f, "infer")
    }
    assert not users, f"these import the eval command instead of infer.measure / infer.report: {sorted(users)}"


def test_proposer_capabilities_are_protocols_not_attribute_probes():
    """What a proposer can do is a typing.Protocol of infer/proposers/base.py checked with isinstance (Scores,
    DraftsTop, GrowsTree, WrapsDrafter), named where it is defined, not a hasattr on a method name."""
    probes = {
        str(f.relative_to(REPO)): f.read_text().count("hasattr(")
        for f in sorted((REPO / "infer").rglob("*.py"))
        if "hasattr(" in f.read_text()
    }
    assert not probes, probes


def test_the_trainer_receives_its_run_and_only_loops():
    """train.trainer.Trainer takes a built Run (train.assembly.build_run) and keeps it whole: no attribute copy
    of the run onto itself, no build, no export, no reporting of its own (train.reporting's hooks, train.workflow's
    export_run)."""
    import ast

    tree = ast.parse((REPO / "train/trainer.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer"]
    calls = {
        n.func.id if isinstance(n.func, ast.Name) else n.func.attr
        for n in ast.walk(cls)
        if isinstance(n, ast.Call) and isinstance(n.func, (ast.Name, ast.Attribute))
    }
    assert not calls & {"setattr", "build_run", "export_drafter", "SummaryWriter", "start_trace"}, calls
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    assert [a.arg for a in init.args.args] == ["self", "run"]


LIBRARY = ["dflash_model", "data", "infer", "train", "tools"]


def _library_files():
    return [f for package in LIBRARY for f in sorted((REPO / package).rglob("*.py"))]


def _reads_a_target_name(tree: ast.AST) -> list[int]:
    """Lines comparing a value with 'smollm2' / 'asset:...' or testing for the 'asset:' prefix."""

    def named(node) -> bool:
        values = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
        return any(isinstance(v, ast.Constant) and v.value in ("smollm2", "asset:smollm2") for v in values)

    lines = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Compare) and any(named(c) for c in [n.left, *n.comparators]):
            lines.append(n.lineno)
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "startswith":
            if any(isinstance(a, ast.Constant) and str(a.value).startswith("asset:") for a in n.args):
                lines.append(n.lineno)
    return lines


def test_one_function_reads_a_target_name():
    """`data.assets.target_file` is the one reading of a target's name ('smollm2', 'asset:NAME', a directory, a
    GGUF) for the CLIs and the trainer alike: no other library module compares a name with 'smollm2' or looks for
    the 'asset:' prefix."""
    readers = {
        str(f.relative_to(REPO)): lines
        for f in _library_files()
        if f != REPO / "data/assets.py" and (lines := _reads_a_target_name(ast.parse(f.read_text())))
    }
    assert not readers, readers
    assert _reads_a_target_name(ast.parse('if name == "smollm2" or name.startswith("asset:"): pass')) == [1, 1]


def test_one_grain_pipeline():
    """Every training batch, real rows or synthetic ones, comes from data/pipeline.py's grain pipeline: no other
    library module imports grain."""
    users = {str(f.relative_to(REPO)) for f in _library_files() if "grain" in _imported_names(f)}
    assert users == {"data/pipeline.py"}, users


def _top_level_names(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def test_committed_scripts_import_public_names_that_exist():
    """A script kept beside its results (docs/) or a benchmark imports from the project only public names its
    modules define: a renamed or removed function breaks the test, not a reader rerunning the command."""
    scripts = [f for f in sorted((REPO / "docs").rglob("*.py"))] + sorted((REPO / "benchmarks").glob("*.py"))
    problems = []
    for script in scripts:
        for node in ast.walk(ast.parse(script.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module):
                continue
            if node.module.split(".")[0] not in ORDER:
                continue
            base = REPO / node.module.replace(".", "/")
            module = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
            if not module.is_file():
                problems.append(f"{script.relative_to(REPO)}: no module {node.module}")
                continue
            defined = _top_level_names(module)
            for alias in node.names:
                sub = base / f"{alias.name}.py"
                if alias.name.startswith("_") or (alias.name not in defined and not sub.is_file()):
                    problems.append(f"{script.relative_to(REPO)}: {node.module}.{alias.name}")
    assert scripts and not problems, problems
