"""HumanEval-shaped code-completion prompts (a signature and its docstring, the body left to the model) made from
installed Python source: prompts whose replies teach a drafter how the target writes code, without touching an
evaluation set. `tools/accelerator_pack.py --code N --code-site N` stages them for regeneration."""

from __future__ import annotations

import ast
import hashlib
import sysconfig
from pathlib import Path

# Standard-library folders left out of the code prompts: tests, GUIs, installers and demos.
STDLIB_SKIP = {"test", "tests", "idlelib", "site-packages", "lib2to3", "tkinter", "turtledemo", "ensurepip", "venv"}


def stdlib_code_prompts(limit: int) -> list[dict]:
    """Code-completion prompts from this Python's standard library, in the shape of HumanEval's (a signature and its
    docstring, the body left to the model): each public top-level function and public method of a public class
    with a docstring of at least 60 characters, in sorted file order. No benchmark prompt comes from here, so the
    target's replies to them are training data for code without touching an evaluation set.
    """
    return code_prompts(Path(sysconfig.get_paths()["stdlib"]), "stdlib", limit)


def site_code_prompts(limit: int) -> list[dict]:
    """The same kind of prompts from the packages installed beside this Python (the project's venv: numpy, jax,
    flax, transformers, ...), for more code than the standard library's 2,480 functions hold. Ordered by a hash of
    their ids, so that any first N mix every package rather than the alphabet's first few."""
    rows = code_prompts(Path(sysconfig.get_paths()["purelib"]), "site", None)
    rows.sort(key=lambda row: hashlib.sha1(row["id"].encode()).hexdigest())
    return rows[:limit]


def code_prompts(root: Path, prefix: str, limit: int | None) -> list[dict]:
    """HumanEval-shaped prompts (signature + docstring) under root, ids '{prefix}/{file}:{name}'."""
    rows: list[dict] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if STDLIB_SKIP & set(rel.parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        classes = [c for c in tree.body if isinstance(c, ast.ClassDef) and not c.name.startswith("_")]
        funcs = [(f.name, f) for f in tree.body if isinstance(f, ast.FunctionDef)]
        funcs += [(f"{c.name}.{f.name}", f) for c in classes for f in c.body if isinstance(f, ast.FunctionDef)]
        for name, f in funcs:
            doc = ast.get_docstring(f, clean=False)
            if f.name.startswith("_") or not doc or len(doc) < 60:
                continue
            stub = ast.FunctionDef(
                name=f.name, args=f.args, body=[ast.Expr(ast.Constant(doc))], decorator_list=[], returns=f.returns
            )
            text = ast.unparse(ast.fix_missing_locations(stub)) + "\n"
            rows.append({"id": f"{prefix}/{rel.as_posix()}:{name}", "messages": [{"role": "user", "content": text}]})
            if len(rows) == limit:
                return rows
    return rows
