"""What a capability token grants is never wider than what was asked for.

`appserver token create --agents ""` minted a token valid for every agent: an empty value (a typo,
an unset shell variable: `--agents "$AGENTS"`) read as "not given". Only an absent `--agents` or a
lone `*` means all agents now; a value that names no agent, or mixes `*` with names, is refused
with one line and exit code 2 (appserver/auth/tokens.py `parse_agents`, appserver/cli/token.py).
The same holds for the other spellings that widened a grant: `--expires ""` and `--expires 0`
minted a token that never expires (`never` says so), and every refusal of `token create` is a usage
error (exit 2), not exit 1 with click's "Error:".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from appserver.auth import TokenStore, parse_agents, parse_duration
from tests.support.cli import run_cli


@pytest.mark.parametrize(
    "value", ["", " ", ",", " , ,", "\t", [], [" ", ""], "a,*", "*,a", ["*", "a"], [1], ["a", None]]
)
def test_a_value_that_names_no_agent_or_mixes_the_wildcard_is_refused(value: Any) -> None:
    with pytest.raises(ValueError):
        parse_agents(value)


@pytest.mark.parametrize(
    ("value", "agents"),
    [
        (None, None),  # not given: all agents, as documented
        ("*", None),
        (" * ", None),
        (["*"], None),
        ("a", frozenset({"a"})),
        ("a, b,", frozenset({"a", "b"})),  # a stray comma narrows nothing
        (["a", " b "], frozenset({"a", "b"})),
    ],
)
def test_what_parse_agents_takes(value: Any, agents: frozenset[str] | None) -> None:
    assert parse_agents(value) == agents


@pytest.mark.parametrize("value", ["", "  ", "0", " 0 "])
def test_an_empty_or_zero_expiry_is_refused_not_read_as_never(value: str) -> None:
    with pytest.raises(ValueError, match="never"):
        parse_duration(value)
    assert parse_duration("never") is None and parse_duration("None") is None


def test_the_store_refuses_an_empty_agent_list(tmp_path: Path) -> None:
    store = TokenStore(tmp_path)
    with pytest.raises(ValueError):
        store.create(name="none", agents=[])
    with pytest.raises(ValueError):
        store.create(name="empty", agents="")
    assert store.list() == []


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("--agents", ""), "names no agent"),
        (("--agents", " , "), "names no agent"),
        (("--agents", "ops,*"), "cannot be combined"),
        (("--expires", ""), "never"),
        (("--expires", "0"), "never"),
        (("--scopes", ""), "at least one scope"),
        (("--scopes", "root"), "unknown scope"),
        (("--name", "bad name"), "token name"),
    ],
)
def test_token_create_refuses_with_one_line_and_exit_code_2(tmp_path: Path, args: tuple[str, ...], says: str) -> None:
    home = tmp_path / "home"
    r = run_cli(home, "token", "create", "--name", "t", *args)  # a later --name wins
    assert r.code == 2, (r.code, r.out, r.err)
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], r.err
    assert "aps_" not in r.out and "Traceback" not in r.err
    assert TokenStore(home).list() == []  # nothing minted


def test_token_create_still_takes_all_agents_when_asked(tmp_path: Path) -> None:
    home = tmp_path / "home"
    for name, args, agents in (
        ("all", (), None),
        ("star", ("--agents", "*"), None),
        ("one", ("--agents", "ops"), ["ops"]),
    ):
        r = run_cli(home, "token", "create", "--name", name, "--json", *args)
        assert r.code == 0, r.err
        assert r.json()["agents"] == agents
    tokens = {rec.name: rec for rec in TokenStore(home).list()}
    assert tokens["one"].agents == ("ops",) and tokens["all"].agents is None and tokens["star"].agents is None
