"""Parsing psrl's own source in tests (the layer and config-key scans)."""

import ast
from pathlib import Path


def parse(path: Path) -> ast.Module:
    """``ast.parse``, again on CPython 3.11's spurious ``SystemError: AST constructor recursion depth mismatch``
    (python/cpython#106905: the AST builder's depth counter is shared, and a thread an earlier test left
    running -- a hung reward in its worker -- can disturb it; seen once in a fresh-clone CI run)."""
    for attempt in range(3):
        try:
            return ast.parse(path.read_text())
        except SystemError:
            if attempt == 2:
                raise
