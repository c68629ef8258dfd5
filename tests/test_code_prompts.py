"""The HumanEval-shaped code prompts of data/code_prompts.py: a signature and its docstring, body left out."""

import ast

from data.code_prompts import code_prompts

DOC = "Return the sum of a and b, each an int; raises TypeError for anything else given."

SOURCE = f'''
import os

def add(a: int, b: int = 2) -> int:
    """{DOC}"""
    return a + b

def short(x):
    """Too short."""
    return x

def _private(x):
    """{DOC}"""
    return x

class Box:
    def put(self, item, *, force=False):
        """{DOC}"""
        self.items.append(item)

    def _hidden(self):
        """{DOC}"""

class _Secret:
    def get(self):
        """{DOC}"""
'''


def test_code_prompts_keep_public_documented_functions_without_their_bodies(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(SOURCE)
    (tmp_path / "tests").mkdir()  # test folders are left out
    (tmp_path / "tests" / "test_mod.py").write_text(SOURCE)
    (tmp_path / "broken.py").write_text("def (:\n")  # unparsable files are passed over
    rows = code_prompts(tmp_path, "site", None)
    assert [r["id"] for r in rows] == ["site/pkg/mod.py:add", "site/pkg/mod.py:Box.put"]
    add = rows[0]["messages"][0]["content"]
    assert rows[0]["messages"][0]["role"] == "user"
    assert add == f'def add(a: int, b: int=2) -> int:\n    """{DOC}"""\n'
    stub = ast.parse(rows[1]["messages"][0]["content"]).body[0]
    assert stub.name == "put" and len(stub.body) == 1 and ast.get_docstring(stub) == DOC
    assert [r["id"] for r in code_prompts(tmp_path, "site", 1)] == ["site/pkg/mod.py:add"]
