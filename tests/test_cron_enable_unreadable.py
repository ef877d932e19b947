"""`appserver cron enable` on an unparseable crons.json (fix 17, item 3).

Every command that changes tasks sets an unparseable crons.json aside (the readers' message says
so: "let a command that changes tasks (cron add, remove, enable, disable) … set it aside"). `enable`
looked the task up with a reader's read first, so it left the file in place with the reader's
message. Now it does exactly what `disable` does. Through the real CLI, on a real home."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.cli import CLIResult, cli_env, run_cli

pytestmark = pytest.mark.timeout(60)

BAD = "{not json"


def corrupt_home(parent: Path) -> Path:
    """A home with task `brief`, whose crons.json was then damaged."""
    home = parent / "home"
    added = run_cli(
        home, "cron", "add", "--name", "brief", "--agent", "assistant", "--every", "1h", "--prompt", "hi",
        env=cli_env(home),
    )  # fmt: skip
    assert added.code == 0, added.err
    (home / "crons.json").write_text(BAD)
    return home


def outcome(home: Path, r: CLIResult) -> tuple[int, bool, list[str], list[str]]:
    """(exit code, crons.json still there, what was set aside, the `error:` lines) of a command."""
    aside = sorted(p.read_text() for p in home.glob("crons.json.corrupt-*"))
    errors = [line for line in r.err.splitlines() if line.startswith("error: ")]
    return r.code, (home / "crons.json").exists(), aside, errors


def test_enable_sets_an_unparseable_crons_json_aside_like_disable(tmp_path: Path) -> None:
    results = {}
    for verb in ("disable", "enable"):
        home = corrupt_home(tmp_path / verb)
        r = run_cli(home, "cron", verb, "brief", env=cli_env(home))
        assert "Traceback" not in r.err, r.err
        results[verb] = outcome(home, r)
    code, still_there, aside, errors = results["enable"]
    assert code == 1, results
    assert not still_there and aside == [BAD], results  # moved aside, not left in place
    assert len(errors) == 1 and "moved aside to" in errors[0] and "crons.json.corrupt-" in errors[0], errors
    assert "it was left in place" not in errors[0], errors
    # the same outcome as disable's (the message differs only in the file's name and time)
    assert results["disable"][:3] == results["enable"][:3], results
