"""A crons.json that lost its `tasks` is damaged, not empty (session 31).

Found from outside: `{"version": 1}` (a hand edit, another tool, a half-restored backup) read as "no
cron tasks": `cron list` said so with exit 0 and nothing moved aside, and the next `cron add` wrote a
file holding only the new task, so the lost ones were never reported. `auth/tokens.json` in the same
shape was already refused. Every write says `"tasks": []` when empty; without it the file is set
aside with a loud error, as any other damaged crons.json. Real CLI on a real home.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.cli import cli_env, run_cli


def test_a_crons_json_without_tasks_is_set_aside_never_read_as_empty(tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = cli_env(home, APPSERVER_DISABLE_CRON="1")
    added = run_cli(
        home, "cron", "add", "--name", "kept", "--agent", "assistant", "--every", "1h", "--prompt", "hi", env=env
    )
    assert added.code == 0, added.err
    path = home / "crons.json"
    path.write_text(json.dumps({"version": 1}))

    listed = run_cli(home, "cron", "list", env=env)
    said = listed.out + listed.err
    assert listed.code != 0, said
    assert "no cron tasks" not in said, said
    assert "tasks is missing" in said, said

    # a command that changes tasks sets the damaged file aside, loudly, and keeps it whole
    again = run_cli(
        home, "cron", "add", "--name", "new", "--agent", "assistant", "--every", "1h", "--prompt", "hi", env=env
    )
    said = again.out + again.err
    assert "crons.json.corrupt-" in said, said
    aside = list(home.glob("crons.json.corrupt-*"))
    assert len(aside) == 1, said
    assert json.loads(aside[0].read_text()) == {"version": 1}


def test_an_empty_task_list_is_still_empty(tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = cli_env(home, APPSERVER_DISABLE_CRON="1")
    home.mkdir(mode=0o700)
    (home / "crons.json").write_text(json.dumps({"version": 1, "tasks": []}))
    listed = run_cli(home, "cron", "list", env=env)
    assert listed.code == 0, listed.err
    assert "no cron tasks" in listed.out + listed.err
    assert not list(home.glob("crons.json.corrupt-*"))
