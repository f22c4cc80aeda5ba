"""What the source-literal tests (tests/test_homes.py, tests/test_version_literals.py) share."""

from __future__ import annotations

import ast


def docstring_ids(tree) -> set:
    """``id()`` of every docstring constant in `tree` (module, class and function docstrings).

    A literal in a docstring documents a fact; it is not code that depends on it.
    """
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found
