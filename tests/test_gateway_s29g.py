"""gateway.db deleted under a running gateway is never a silently empty ledger (docs/channels.md,
"A corrupt gateway.db").

The CLI made a new, empty gateway.db beside the running gateway, which went on writing to the
deleted file: a stranger got a pairing code that `pairing list` never showed and `pairing approve`
did not know, and the next gateway start carried on with the empty ledger without a word. Now a
command refuses while the gateway holds `channels/gateway.lock` (one line, exit 1, nothing
created), and the gateway, at its next write, says the file is gone and exits (code 4) before
recording: the supervisor restarts it on a new ledger and the platform delivers the update again.

Real parts: `appserver serve --channels telegram` with python-telegram-bot against the loopback fake
Bot API (tests/fakes/telegram_api.py), the CLI in child processes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gateway.db import default_path
from tests.fakes.telegram_api import FakeTelegram
from tests.support.cli import cli_env, run_cli
from tests.support.gateway import channel_server, write_config
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(90)


def _home(tmp_path: Path, tg: FakeTelegram) -> Path:
    home = tmp_path / "home"
    settings = {"api_url": tg.url, "poll_timeout": 1, "token_env": "TG_TOKEN", "default_agent": "assistant",
                "dm_policy": "pairing"}  # fmt: skip
    write_config(home, {"telegram": {"main": settings}}, ["telegram"])
    return home


def _delete_ledger(home: Path) -> None:
    db = default_path(home)
    for suffix in ("", "-wal", "-shm"):
        db.with_name(db.name + suffix).unlink(missing_ok=True)


def test_a_ledger_deleted_under_the_running_gateway_is_refused_then_restarted_loudly(tmp_path: Path) -> None:
    stranger = 7290
    with FakeTelegram() as tg:
        home = _home(tmp_path, tg)
        env = cli_env(home, TG_TOKEN=tg.token, APPSERVER_GATEWAY_RESTART_BACKOFF_S="0.2")
        with channel_server(home, "--channels", "telegram", env=env) as srv:
            first = srv.gateway_pid()
            _delete_ledger(home)
            noticed = "was deleted while the gateway had it open: exiting (code 4)"

            # (1) the commands refuse, naming the holder; nothing is created beside the gateway.
            # Unless a write of the gateway's own (under load, a background one) noticed first and
            # it restarted on a new ledger meanwhile: then (1) has nothing left to show.
            answers = [
                (args, run_cli(home, *args, env=env))
                for args in (("pairing", "list"), ("channels", "status"), ("pairing", "approve", "ABCD2345"))
            ]
            if noticed not in srv.log():
                for args, r in answers:
                    assert r.code != 0, (args, r.out, r.err)
                    assert "missing" in r.err and f"pid {first}" in r.err, (args, r.err)
                    assert len(r.err.strip().splitlines()) == 1, (args, r.err)
                assert not default_path(home).exists()
                # (unless the gateway noticed in the moment since the log was read: it restarts then)
                assert srv.gateway_pid() == first or noticed in srv.log()

            # (2) the gateway's next write notices the file is gone: it exits, loudly, and restarts
            tg.dm("hi can I use this", user_id=stranger)
            wait_for(lambda: noticed in srv.log(), 20, "the gateway to notice")
            wait_for(lambda: "exited with code 4" in srv.log(), 20, "the gateway to exit")
            srv.wait_channels_ready()
            assert srv.gateway_pid() != first
            assert "starting a new, empty ledger" in srv.log()

            # the update was never recorded in the deleted file: delivered again, its code is listed
            text = tg.wait_for_text(stranger, lambda t: "approve" in t, 30).text
            code = re.search(r"approve (\w{8})", text)
            assert code, text
            listed = run_cli(home, "pairing", "list", env=env)
            assert listed.code == 0 and code.group(1) in listed.out, (listed.out, listed.err)
            assert run_cli(home, "pairing", "approve", code.group(1), env=env).code == 0
            tg.wait_for_text(stranger, "echo: hi can I use this", 30)
