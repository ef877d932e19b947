"""Parsing the project's own source in a test, safe from finalizers of earlier tests' leftovers."""

from __future__ import annotations

import ast
import gc
from pathlib import Path


def parse_source(path: Path) -> ast.Module:
    """`ast.parse` of a file with the garbage collector held off: a finalizer that raises while the
    tree is built (an event loop an earlier test on this worker left unclosed, whose descriptor was
    closed under it) trips CPython 3.11's AST recursion check, a SystemError that has nothing to do
    with the file."""
    source = path.read_text(encoding="utf-8")
    enabled = gc.isenabled()
    gc.disable()  # (the cyclic collector runs such finalizers; a parse allocates enough to start it)
    try:
        return ast.parse(source, str(path))
    finally:
        if enabled:
            gc.enable()
