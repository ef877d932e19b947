"""gateway/ imports nothing of the server but the protocol client (issue 12.7, issue 15)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.support.source import parse_source

GATEWAY = Path(__file__).resolve().parents[1] / "gateway"
# plugins.contract / plugins.loader are outside appserver and cron; appserver.sqlitewal is the
# stdlib-only WAL check gateway.db shares with the store (tests/test_import_rules.py)
ALLOWED = ("appserver.client", "appserver.sqlitewal")


def imported_modules(path: Path) -> set[str]:
    """Every module (or `module.name`) a file imports, lazy and TYPE_CHECKING imports included."""
    names: set[str] = set()
    for node in ast.walk(parse_source(path)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_gateway_imports_only_the_protocol_client_of_the_server() -> None:
    files = sorted(GATEWAY.rglob("*.py"))
    assert files
    bad = {
        f"{path.relative_to(GATEWAY.parent)}: {name}"
        for path in files
        for name in imported_modules(path)
        if name.split(".")[0] in ("appserver", "cron")
        and not any(name == a or name.startswith(a + ".") for a in ALLOWED)
    }
    assert not bad, sorted(bad)


def test_docs_name_real_gateway_files() -> None:
    root = GATEWAY.parent
    for doc in ("docs/channels.md", "docs/architecture.md"):
        named = set(re.findall(r"`((?:gateway|tests)/[\w/]+\.py)`", (root / doc).read_text()))
        named = {n for n in named if "gateway" in n}
        assert named, doc
        missing = sorted(n for n in named if not (root / n).is_file())
        assert not missing, f"{doc} names files that do not exist: {missing}"
