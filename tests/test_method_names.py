"""No method name is typed in the harness's code outside methods/ (and baselines/ and conf/, which
are outside src/rbs_bench): every other module reads names from the registry (`methods.DENSE`,
`methods.headline()`, `MethodInfo` flags), a selector class's `name`, or an experiment's grid, so
that renaming or adding a method touches one file.

A name counts as typed where a string literal of the code (docstrings and comments are
documentation, not code) is exactly a registered name, or holds an override `method=<name>`.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from rbs_bench import methods

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "rbs_bench"
OWN = PACKAGE / "methods"  # the registry and the selectors that define the names


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def typed_names(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, literal) of every string literal in `source` that types one of `names`."""
    override = re.compile(r"\bmethod=(" + "|".join(map(re.escape, sorted(names))) + r")\b")
    tree = ast.parse(source)
    skip = _docstrings(tree)
    hits = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
            continue
        if id(node) in skip:
            continue
        if node.value in names or override.search(node.value):
            hits.append((node.lineno, node.value))
    return hits


def test_the_scan_finds_a_typed_name_and_passes_over_docs():
    names = {"rbs", "dense"}
    source = (
        '"""Run method=rbs."""\n'
        "X = ('rbs',)  # dense\n"
        "def f():\n"
        '    """dense"""\n'
        "    return f'method=dense budget={X}'\n"
    )
    assert typed_names(source, names) == [(2, "rbs"), (5, "method=dense budget=")]


def test_no_method_name_is_typed_outside_the_registry():
    names = set(methods.available())
    assert {methods.DENSE, methods.headline()} <= names
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if OWN in path.parents:
            continue
        for line, text in typed_names(path.read_text(), names):
            found.append(f"{path.relative_to(ROOT)}:{line}: {text!r}")
    assert found == [], "read these from the registry:\n" + "\n".join(found)
