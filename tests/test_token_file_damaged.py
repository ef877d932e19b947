"""`appserver token` on a damaged auth/tokens.json (fix 17, item 5).

Was: `token list`, a reader, moved the file aside and printed the message twice; a later `token
create` started a new tokens.json holding only the new token, with a warning: auth came back on
with one token while docs/security.md said every token is refused until the operator restores the
file. Now (as cron's readers do) `list` reports the damage and exits 1 without moving anything;
`create` and `revoke` refuse and leave the file in place, and so does `create` after a server set
the file aside (nothing in its place), until the operator restores it or says
`token create --start-new-file`. A running server still refuses every token meanwhile."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from appserver.auth import TokenStore
from tests.support.cli import CLIResult, cli_env, run_cli
from tests.support.serve import serving

pytestmark = pytest.mark.timeout(90)

BAD = '{"version": 1, "tokens": [{"id": '  # a write cut short


def one_error(r: CLIResult) -> str:
    assert r.code == 1, (r.code, r.out, r.err)
    assert "Traceback" not in r.err, r.err
    errors = [line for line in r.err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, r.err  # said once
    assert not any("could not be read" in line for line in r.err.splitlines() if line not in errors), r.err
    return errors[0]


def test_token_commands_refuse_a_damaged_file_and_leave_it_in_place(tmp_path: Path) -> None:
    home = tmp_path / "home"
    TokenStore(home).create(name="old")
    path = home / "auth" / "tokens.json"
    path.write_text(BAD)
    for args, doing in (
        (("token", "list"), "listed"),
        (("token", "list", "--json"), "listed"),
        (("token", "create", "--name", "new"), "created"),
        (("token", "revoke", "old"), "revoked"),
    ):
        r = run_cli(home, *args)
        line = one_error(r)
        assert "tokens.json cannot be read" in line and f"Nothing was {doing}" in line, line
        assert "--start-new-file" in line and "refuses every token" in line, line
        assert r.out == "", r.out  # no token minted, no list
        assert path.read_text() == BAD, args  # left where it was
        assert not list(path.parent.glob("tokens.json.corrupt-*")), args


def test_after_a_server_set_the_file_aside_create_refuses_until_told_to_start_a_new_file(tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = cli_env(home)
    _, old = TokenStore(home).create(name="old")
    path = home / "auth" / "tokens.json"
    with serving(home, "--auth", "token", env=env) as sp, httpx.Client(base_url=sp.url, timeout=10) as http:
        auth = {"Authorization": f"Bearer {old}"}
        assert http.get("/v1/models", headers=auth).status_code == 200
        path.write_text(BAD)
        assert http.get("/v1/models", headers=auth).status_code == 401  # every token refused
        assert not path.exists() and len(list(path.parent.glob("tokens.json.corrupt-*"))) == 1  # the server's doing

        line = one_error(run_cli(home, "token", "create", "--name", "new", env=env))
        assert "set aside as unreadable" in line and "not restored" in line and "--start-new-file" in line, line
        assert not path.exists()  # no new file that would admit only a new token

        listed = run_cli(home, "token", "list", env=env)  # honest: no tokens, and why (a warning)
        assert listed.code == 0 and "no tokens" in listed.out, (listed.code, listed.out, listed.err)
        assert "warning: auth/tokens.json.corrupt-" in listed.err, listed.err
        assert http.get("/v1/models", headers=auth).status_code == 401  # still refused

        made = run_cli(home, "token", "create", "--name", "new", "--start-new-file", "--json", env=env)
        assert made.code == 0, made.err
        new = made.json()["token"]
        assert [t["name"] for t in json.loads(path.read_text())["tokens"]] == ["new"]
        assert http.get("/v1/models", headers={"Authorization": f"Bearer {new}"}).status_code == 200
        assert http.get("/v1/models", headers=auth).status_code == 401


def test_start_new_file_sets_a_damaged_file_aside_once_and_says_where(tmp_path: Path) -> None:
    home = tmp_path / "home"
    TokenStore(home).create(name="old")
    path = home / "auth" / "tokens.json"
    path.write_text(BAD)
    r = run_cli(home, "token", "create", "--name", "new", "--start-new-file", "--json")
    assert r.code == 0, r.err
    aside = list(path.parent.glob("tokens.json.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_text() == BAD
    assert r.err.count("moved aside to") == 1 and aside[0].name in r.err, r.err
    assert [t.name for t in TokenStore(home).list()] == ["new"]
    assert r.json()["name"] == "new"
