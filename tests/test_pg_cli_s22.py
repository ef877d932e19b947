"""Commands that read or write one table of a PostgreSQL store without opening the store (tokens,
cron tasks), on a database no server has used yet (found by an outside test): `token create`
failed with a traceback (`relation "token_state" does not exist`), `token list` too, and `cron
list` with a one-line error about the same missing table. They now make the schema first, as
`serve` and `agents create` do. A real PostgreSQL, its own database, dropped at the end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.cli import cli_env, run_cli
from tests.support.pg import temp_database

pytest.importorskip("psycopg")


def test_token_and_cron_commands_work_on_a_new_database(tmp_path: Path) -> None:
    with temp_database("cli_s22") as url:
        home = tmp_path / "home"
        env = cli_env(home, APPSERVER_STORE__URL=url, APPSERVER_AUTH__MODE="token")
        made = run_cli(home, "token", "create", "--name", "first", "--json", env=env)
        assert made.code == 0 and "Traceback" not in made.err, made.err
        token_id = json.loads(made.out)["id"]
        listed = run_cli(home, "token", "list", "--json", env=env)
        assert listed.code == 0 and token_id in listed.out, listed.err
        other = tmp_path / "other"  # a second home on the same database sees the same token
        seen = run_cli(other, "token", "list", "--json", env=cli_env(other, APPSERVER_STORE__URL=url))
        assert seen.code == 0 and token_id in seen.out, seen.err
    with temp_database("cli_s22b") as url:
        home = tmp_path / "cron-home"
        env = cli_env(home, APPSERVER_STORE__URL=url)
        listed = run_cli(home, "cron", "list", env=env)
        assert listed.code == 0 and "no cron tasks" in listed.out, (listed.out, listed.err)
        assert run_cli(home, "agents", "create", "--name", "helper", env=env).code == 0
        added = run_cli(
            home, "cron", "add", "--name", "t", "--every", "1h", "--agent", "helper", "--prompt", "hi", env=env
        )
        assert added.code == 0, added.err
        assert "t" in run_cli(home, "cron", "list", env=env).out
