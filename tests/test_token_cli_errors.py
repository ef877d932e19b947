"""`appserver token` through the real CLI: refusals are the project's one `error:` line with a
non-zero exit code (2 for an id it does not know, as `agents show` answers), and `--agents` is
checked against the home's agents: an unknown id is refused (ids are never made again, so the
token would admit nothing), an unknown name only warned about (a name admits whichever agent
carries it when a request comes, docs/security.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from appserver.auth import TokenStore
from tests.support.cli import CLIResult, run_cli


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "home"


def one_error_line(r: CLIResult, code: int) -> str:
    assert r.code == code, (r.code, r.out, r.err)
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.err  # not click's "Error:"
    return lines[0]


def test_revoking_a_token_that_does_not_exist_is_one_error_line_and_exit_code_2(home: Path) -> None:
    line = one_error_line(run_cli(home, "token", "revoke", "nosuch"), 2)
    assert line == "error: no token with id or name 'nosuch'", line


def test_a_token_for_an_agent_id_that_does_not_exist_is_refused(home: Path) -> None:
    line = one_error_line(run_cli(home, "token", "create", "--name", "t", "--agents", "assistant,agt_000000000000"), 2)
    assert "agt_000000000000" in line, line
    assert TokenStore(home).list() == []  # nothing minted


def test_a_token_for_an_agent_name_that_does_not_exist_is_minted_with_a_warning(home: Path) -> None:
    r = run_cli(home, "token", "create", "--name", "later", "--agents", "nosuch", "--json")
    assert r.code == 0, r.err
    assert r.json()["agents"] == ["nosuch"]
    warnings = [x for x in r.err.splitlines() if x.startswith("warning: ")]
    assert len(warnings) == 1 and "'nosuch'" in warnings[0], r.err

    agent_id = run_cli(home, "agents", "show", "assistant", "--json").json()["id"]
    r = run_cli(home, "token", "create", "--name", "known", "--agents", f"assistant,{agent_id}", "--json")
    assert r.code == 0 and "warning" not in r.err, r.err
    assert sorted(t.name for t in TokenStore(home).list()) == ["known", "later"]
