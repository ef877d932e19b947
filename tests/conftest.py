"""Shared fixtures: a fresh home per test, the CLI as a real subprocess, a real `serve` on loopback.

The helpers behind them live in tests/support/ so that bench/ and examples can use them without pytest."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cli import CLIResult, run_cli
from tests.support.serve import ServeProcess, serving


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    h = tmp_path / "home"
    monkeypatch.setenv("APPSERVER_HOME", str(h))
    monkeypatch.setenv("APPSERVER_LIMITS__RETRY_BASE_MS", "10")
    return h


@pytest.fixture
def cli(home: Path):  # type: ignore[no-untyped-def]
    def _cli(*args: str, **kw) -> CLIResult:  # type: ignore[no-untyped-def]
        return run_cli(home, *args, **kw)

    return _cli


@pytest.fixture
def serve(home: Path) -> Iterator[ServeProcess]:
    with serving(home, graceful=False) as sp:
        yield sp


CONFORMANCE_SKIP = "conformance data not found"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Skips for missing conformance data are loud (issue 14.11): those tests validate every HTTP
    shape against OpenAI's published schema, and a clone without ../shared/conformance skips them."""
    skipped = [
        r for r in terminalreporter.stats.get("skipped", []) if CONFORMANCE_SKIP in str(getattr(r, "longrepr", ""))
    ]
    if skipped:
        terminalreporter.write_sep(
            "!",
            f"WARNING: {len(skipped)} tests skipped: {CONFORMANCE_SKIP} (../shared/conformance beside the repo); HTTP shapes were NOT validated",
            red=True,
            bold=True,
        )
