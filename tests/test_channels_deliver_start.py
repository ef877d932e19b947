"""A cron reply delivered while the gateway child is still starting (appserver/channels.py
`ChannelService.deliver`): a run fired at serve's start can finish before the child is ready, and
its reply must still go out once it is, not be logged `delivery_failed: the gateway is not running`.
A target this server can never deliver to fails at once, saying why.

Real `serve` processes, the real webhook channel and a local receiver of its replies. The child is
held back by holding its lock (`channels/gateway.lock`, gateway/main.py `lock_ledger`): it waits
for the lock up to 15 s, as it does for a previous child that is still stopping."""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from appserver.channels import DELIVER_START_WAIT_S
from gateway.db import default_path
from tests.support.cli import cli_env, run_cli
from tests.support.gateway import channel_server, write_config
from tests.support.net import free_port
from tests.support.wait import wait_for
from tests.test_cron_recover_delivery import Receiver

pytestmark = pytest.mark.timeout(120)

SECRET = "s3cr3t-for-the-webhook"
HOLD_S = 1.5  # how long the child is still kept from starting once the run ended and the others failed


@pytest.fixture()
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.server.shutdown()


@contextmanager
def gateway_held_back(home: Path) -> Iterator[Callable[[], None]]:
    """Hold the gateway's lock, so a child started meanwhile waits for it (as for an old child);
    yields the function that lets go of it."""
    path = default_path(home).with_name("gateway.lock")
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield lambda: fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def records(home: Path, task_id: str) -> list[dict[str, Any]]:
    path = home / "cron-runs" / f"{task_id}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def events(home: Path, task_id: str) -> list[str]:
    return [str(r["event"]) for r in records(home, task_id)]


def add_due_task(home: Path, name: str, target: str, env: dict[str, str]) -> tuple[str, datetime]:
    """A one-shot task due a second from now: it fires at the first tick of the next server started
    once it is due (`wait_until_due`). Its id and when it is due."""
    r = run_cli(home, "cron", "add", "--name", name, "--agent", "assistant", "--in", "1s", "--exact",
                "--misfire", "run_once", "--prompt", f"say {name}", "--deliver", target, "--json", env=env)  # fmt: skip
    assert r.code == 0, (r.out, r.err)
    return str(r.json()["id"]), datetime.fromisoformat(r.json()["next_due_at"])


def wait_until_due(*due: datetime) -> None:
    """Until every one of these times has passed (by the clock the server reads too)."""
    wait_for(lambda: datetime.now(UTC) > max(due), 10, "the tasks to be due")


def test_a_reply_of_a_run_fired_at_start_waits_for_the_starting_gateway(tmp_path: Path, receiver: Receiver) -> None:
    home = tmp_path / "home"
    settings = {"listen": f"127.0.0.1:{free_port()}", "secret_env": "WH_SECRET", "reply_url": receiver.url}
    telegram = {"main": {"token_env": "TG_TOKEN"}}
    # The tasks are made while every target is configured; then one account is removed and one
    # channel disabled (a hand edit of config.toml): those two targets can no longer be reached.
    write_config(
        home, {"webhook": {"main": settings, "nobody": settings}, "telegram": telegram}, ["webhook", "telegram"]
    )
    env = cli_env(home, WH_SECRET=SECRET)
    kept, kept_due = add_due_task(home, "kept", "webhook:main:kitchen", env)
    unknown, unknown_due = add_due_task(home, "unknown", "webhook:nobody:hall", env)
    disabled, disabled_due = add_due_task(home, "disabled", "telegram:main:den", env)
    write_config(home, {"webhook": {"main": settings}, "telegram": telegram}, ["webhook"])
    wait_until_due(kept_due, unknown_due, disabled_due)  # all three are due before the server starts

    with gateway_held_back(home) as let_go, channel_server(home, env=env, ready=False) as srv:
        # The run ends while the child waits for its lock; the targets it can never reach fail at once.
        wait_for(lambda: "outcome" in events(home, kept), 20, "the run's outcome")
        for task_id in (unknown, disabled):
            wait_for(lambda t=task_id: "delivery_failed" in events(home, t), 5, f"the verdict for {task_id}")
        assert "no account webhook:nobody is configured" in records(home, unknown)[-1]["error"]
        assert "channel telegram is not enabled" in records(home, disabled)[-1]["error"]
        time.sleep(HOLD_S)
        assert events(home, kept)[-1] == "outcome", records(home, kept)  # waiting for the gateway
        assert receiver.posts == [] and srv.channels_check()["status"] != "ok"
        let_go()
        wait_for(lambda: "delivered" in events(home, kept), 30, "the reply to be delivered")
    assert events(home, kept) == ["fired", "submitted", "outcome", "delivered"], records(home, kept)
    assert [p["chat"] for p in receiver.posts] == ["kitchen"], receiver.posts
    assert "say kept" in receiver.posts[0]["text"], receiver.posts


def test_a_gateway_that_does_not_come_up_fails_the_delivery_after_a_bounded_wait(tmp_path: Path) -> None:
    """The wait is bounded (DELIVER_START_WAIT_S, within cron's own limit): the run log then says
    the gateway is still not running, not a timeout of cron's."""
    home = tmp_path / "home"
    settings = {"listen": f"127.0.0.1:{free_port()}", "secret_env": "WH_SECRET", "reply_url": "http://127.0.0.1:9/"}
    write_config(home, {"webhook": {"main": settings}}, ["webhook"])
    env = cli_env(home, WH_SECRET=SECRET)
    task_id, due = add_due_task(home, "late", "webhook:main:kitchen", env)
    wait_until_due(due)
    with gateway_held_back(home), channel_server(home, env=env, ready=False):
        wait_for(lambda: "outcome" in events(home, task_id), 20, "the run's outcome")
        ended = time.monotonic()
        wait_for(lambda: "delivery_failed" in events(home, task_id), DELIVER_START_WAIT_S + 10, "the verdict")
        waited = time.monotonic() - ended
    error = records(home, task_id)[-1]["error"]
    assert f"the gateway is not running after waiting {DELIVER_START_WAIT_S:g} s (starting" in error, error
    assert DELIVER_START_WAIT_S - 2 <= waited <= DELIVER_START_WAIT_S + 2, waited
