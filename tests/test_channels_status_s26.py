"""`channels status` while the server restarts a gateway child that was killed: the row showed the
`running` the dead child last recorded (for up to the 60 s of the backoff); it shows the running
gateway's state, the recorded one beside it."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from tests.fakes.telegram_api import FakeTelegram
from tests.support.cli import cli_env, run_cli
from tests.support.gateway import channel_server, write_config
from tests.support.wait import wait_for


def _status(home: Path, env: dict[str, str]) -> dict:
    shown = run_cli(home, "channels", "status", "--json", env=env)
    assert shown.code == 0, shown.err
    return json.loads(shown.out)


def _recorded_running(home: Path, env: dict[str, str]) -> bool:
    account = _status(home, env)["accounts"][0]
    return account["state"] == "running" and "recorded_state" not in account


def test_a_killed_gateway_child_shows_as_restarting_not_running(tmp_path: Path) -> None:
    with FakeTelegram() as tg:
        home = tmp_path / "home"
        settings = {"api_url": tg.url, "poll_timeout": 1, "token_env": "TG_TOKEN", "dm_policy": "open",
                    "default_agent": "assistant"}  # fmt: skip
        write_config(home, {"telegram": {"main": settings}}, ["telegram"])
        env = cli_env(home, TG_TOKEN=tg.token, APPSERVER_GATEWAY_RESTART_BACKOFF_S="30")
        with channel_server(home, "--channels", "telegram", env=env) as srv:
            # running, as the child recorded it too (no live state over another recorded one)
            wait_for(lambda: _recorded_running(home, env), 20, "up")
            os.kill(srv.gateway_pid(), signal.SIGKILL)  # the server restarts it in 30 s
            status = wait_for(lambda: (s := _status(home, env))["accounts"][0]["state"] != "running" and s, 20, "seen")
            [account] = status["accounts"]
            assert account["state"] == "stopped" and account["reason"] == "the gateway process is restarting"
            assert account["recorded_state"] == "running", account  # what the dead child saved
            table = run_cli(home, "channels", "status", env=env).out
            row = next(line for line in table.splitlines() if line.startswith("telegram"))
            assert " stopped " in row and "restarting" in row and " running " not in row, table
