"""gateway/accounts.py: secret references, and AccountRunner keeping a real user plugin (written to a
temporary home and loaded by plugins/loader.py) alive: error vs backoff, restarts, state order."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from gateway.accounts import BACKOFF_MIN_S, AccountRunner, AccountSpec, resolve_secrets
from plugins.contract import AccountError, InboundMessage

# The plugin takes its script from its settings: `plan` (a list shared with the test, one step per
# start: "run", "account_error", "boom", "boom_after_open", "bad_is_running") and `events` (a list
# it appends what happened to). Settings are handed over by a shallow copy, so both stay shared.
PLUGIN = """
from plugins.contract import AccountError, Limits


class Adapter:
    def __init__(self, account, context):
        self.account = account
        self.context = context
        self.limits = Limits(max_length=100)
        self.events = account.settings["events"]
        self.plan = account.settings["plan"]
        self.running = False
        self.broken = False

    async def start(self):
        step = self.plan.pop(0) if self.plan else "run"
        self.events.append(("start", step, dict(self.account.secrets)))
        if step == "account_error":
            raise AccountError("the platform refused the token")
        if step == "boom":
            raise RuntimeError("boom")
        self.running = True
        if step == "boom_after_open":
            raise RuntimeError("failed after opening a connection")
        if step == "bad_is_running":
            self.broken = True

    async def stop(self):
        self.events.append(("stop", self.running))
        self.running = False

    @property
    def is_running(self):
        if self.broken:
            raise ValueError("is_running itself failed")
        return self.running

    async def send(self, target, text):
        return ["1"]


def create_adapter(account, context):
    return Adapter(account, context)
"""


def write_plugin(home: Path, channel: str = "toy", source: str = PLUGIN) -> None:
    folder = home / "channels" / channel
    folder.mkdir(parents=True)
    (folder / "channel.json").write_text(json.dumps({"id": channel, "entry": "plugin.py"}))
    (folder / "plugin.py").write_text(source)


def spec(**secrets: dict[str, str]) -> tuple[AccountSpec, list[str], list[tuple[Any, ...]]]:
    plan: list[str] = []
    events: list[tuple[Any, ...]] = []
    return AccountSpec("toy", "main", {"plan": plan, "events": events}, dict(secrets)), plan, events


# ---------------------------------------------------------------- resolve_secrets


def test_secrets_from_the_environment(tmp_path: Path) -> None:
    s = AccountSpec("toy", "main", {}, {"token": {"env": "TOY_TOKEN"}})
    assert resolve_secrets(s, tmp_path, {"TOY_TOKEN": " abc \n"}) == {"token": "abc"}
    with pytest.raises(AccountError, match="token_env: environment variable TOY_TOKEN is not set"):
        resolve_secrets(s, tmp_path, {})
    with pytest.raises(AccountError, match="TOY_TOKEN is not set"):
        resolve_secrets(s, tmp_path, {"TOY_TOKEN": "  "})


def test_secrets_from_files_relative_to_the_home(tmp_path: Path) -> None:
    (tmp_path / "secrets").mkdir()
    (tmp_path / "secrets" / "tok").write_text("s3cret\n")
    absolute = tmp_path / "abs.txt"
    absolute.write_text("other")
    s = AccountSpec("toy", "main", {}, {"token": {"file": "secrets/tok"}, "key": {"file": str(absolute)}})
    assert resolve_secrets(s, tmp_path, {}) == {"token": "s3cret", "key": "other"}


def test_missing_or_empty_secret_file_names_the_file(tmp_path: Path) -> None:
    missing = AccountSpec("toy", "main", {}, {"token": {"file": "nope.txt"}})
    with pytest.raises(AccountError, match=r"token_file: cannot read .*nope\.txt"):
        resolve_secrets(missing, tmp_path, {})
    (tmp_path / "empty.txt").write_text(" \n")
    empty = AccountSpec("toy", "main", {}, {"api": {"file": "empty.txt"}})
    with pytest.raises(AccountError, match=r"api_file: .*empty\.txt is empty"):
        resolve_secrets(empty, tmp_path, {})


def test_spec_from_json() -> None:
    s = AccountSpec.from_json({"channel": "toy", "name": "main", "secrets": {"token": {"env": "X"}}})
    assert (s.ref, s.settings, s.secrets) == ("toy:main", {}, {"token": {"env": "X"}})


# ---------------------------------------------------------------- AccountRunner


class Harness:
    def __init__(self, home: Path, account: AccountSpec, environ: dict[str, str] | None = None) -> None:
        self.states: list[tuple[str, str | None]] = []
        self.sleeps: list[float] = []
        self.runner = AccountRunner(account, home, self.on_message, self.on_state, environ or {}, sleep=self.sleep)
        self.task: asyncio.Task[None] | None = None

    async def on_message(self, msg: InboundMessage) -> None:
        pass

    def on_state(self, runner: AccountRunner) -> None:
        self.states.append((runner.live.state, runner.live.reason))

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        await asyncio.sleep(0.001)

    def start(self) -> None:
        self.task = asyncio.ensure_future(self.runner.run())

    async def until(self, predicate: Any, timeout: float = 3.0) -> None:
        async def poll() -> None:
            while not predicate():
                await asyncio.sleep(0.001)

        await asyncio.wait_for(poll(), timeout)

    async def close(self) -> None:
        await self.runner.stop()
        if self.task is not None:
            await asyncio.wait_for(self.task, 3.0)

    def names(self) -> list[str]:
        return [s for s, _ in self.states]


async def test_running_with_resolved_secrets(tmp_path: Path) -> None:
    write_plugin(tmp_path)
    account, _, events = spec(token={"env": "TOY_TOKEN"})
    h = Harness(tmp_path, account, {"TOY_TOKEN": "t0k"})
    h.start()
    await asyncio.wait_for(h.runner.ready.wait(), 3.0)
    # An account starts out `starting`: the first report is the move to `running`.
    assert h.states == [("starting", None), ("running", None)]  # `starting` reaches the server too
    assert events == [("start", "run", {"token": "t0k"})]
    assert (tmp_path / "channels" / "toy" / "data" / "main").is_dir()
    await h.close()
    assert h.names()[-1] == "stopped"
    assert events[-1] == ("stop", True)


async def test_account_error_in_start_is_error_without_restart(tmp_path: Path) -> None:
    write_plugin(tmp_path)
    account, plan, events = spec()
    plan.append("account_error")
    h = Harness(tmp_path, account)
    h.start()
    assert h.task is not None
    await asyncio.wait_for(h.task, 3.0)  # run() returns: no retry loop
    assert h.runner.ready.is_set()
    assert h.states == [("starting", None), ("error", "the platform refused the token")]
    assert [e[0] for e in events] == ["start"]
    assert h.sleeps == []


async def test_missing_secret_is_error_naming_the_variable(tmp_path: Path) -> None:
    write_plugin(tmp_path)
    account, _, events = spec(token={"env": "TOY_TOKEN"})
    h = Harness(tmp_path, account, {})
    h.start()
    assert h.task is not None
    await asyncio.wait_for(h.task, 3.0)
    assert h.states[-1] == ("error", "token_env: environment variable TOY_TOKEN is not set")
    assert events == []


async def test_a_plugin_that_will_not_load_is_error(tmp_path: Path) -> None:
    write_plugin(tmp_path, source="raise ImportError('no such platform library')\n")
    account, _, _ = spec()
    h = Harness(tmp_path, account)
    h.start()
    assert h.task is not None
    await asyncio.wait_for(h.task, 3.0)
    state, reason = h.states[-1]
    assert state == "error"
    assert reason is not None and "no such platform library" in reason
    missing = Harness(tmp_path, AccountSpec("absent", "main", {}, {}))
    missing.start()
    assert missing.task is not None
    await asyncio.wait_for(missing.task, 3.0)
    assert missing.states[-1][0] == "error" and "unknown channel" in str(missing.states[-1][1])


async def test_an_exception_in_start_is_backoff_then_restart(tmp_path: Path) -> None:
    write_plugin(tmp_path)
    account, plan, events = spec()
    plan.extend(["boom", "boom", "run"])
    h = Harness(tmp_path, account)
    h.start()
    await asyncio.wait_for(h.runner.ready.wait(), 3.0)
    assert h.states == [
        ("starting", None),
        ("backoff", "start failed: RuntimeError: boom; retrying in 1 s"),
        ("starting", None),
        ("backoff", "start failed: RuntimeError: boom; retrying in 2 s"),
        ("starting", None),
        ("running", None),
    ]
    assert h.sleeps[:2] == [BACKOFF_MIN_S, 2 * BACKOFF_MIN_S]
    assert [e[1] for e in events if e[0] == "start"] == ["boom", "boom", "run"]
    await h.close()


async def test_an_adapter_that_failed_after_opening_is_stopped_before_the_restart(tmp_path: Path) -> None:
    write_plugin(tmp_path)
    account, plan, events = spec()
    plan.append("boom_after_open")
    h = Harness(tmp_path, account)
    h.start()
    await asyncio.wait_for(h.runner.ready.wait(), 3.0)
    # The half-started adapter is stopped (it holds a connection) before a new one starts.
    assert events[:3] == [("start", "boom_after_open", {}), ("stop", True), ("start", "run", {})]
    await h.close()


async def test_an_adapter_that_stops_running_is_restarted(tmp_path: Path) -> None:
    write_plugin(tmp_path)
    account, _, events = spec()
    h = Harness(tmp_path, account)
    h.start()
    await asyncio.wait_for(h.runner.ready.wait(), 3.0)
    first = h.runner.adapter
    first.running = False  # type: ignore[union-attr]  # the connection dropped
    await h.until(lambda: h.runner.adapter is not first and h.runner.live.state == "running")
    assert h.states == [
        ("starting", None),
        ("running", None),
        ("backoff", "the adapter stopped running; retrying in 1 s"),
        ("starting", None),
        ("running", None),
    ]
    assert events == [("start", "run", {}), ("stop", False), ("start", "run", {})]
    # And again: the backoff doubles while the account is not healthy for long.
    second = h.runner.adapter
    second.running = False  # type: ignore[union-attr]
    await h.until(lambda: h.runner.adapter is not second and h.runner.live.state == "running")
    assert h.states[5] == ("backoff", "the adapter stopped running; retrying in 2 s")
    await h.close()
    assert h.names()[-1] == "stopped"


async def test_an_is_running_that_raises_is_a_restart_not_a_dead_runner(tmp_path: Path) -> None:
    write_plugin(tmp_path)
    account, plan, events = spec()
    plan.append("bad_is_running")
    h = Harness(tmp_path, account)
    h.start()
    await h.until(lambda: [e[1] for e in events if e[0] == "start"] == ["bad_is_running", "run"])
    await h.until(lambda: h.runner.live.state == "running")
    assert ("backoff", "the adapter stopped running; retrying in 1 s") in h.states
    assert h.task is not None and not h.task.done()
    await h.close()


async def test_stop_during_backoff_ends_the_runner(tmp_path: Path) -> None:
    write_plugin(tmp_path)
    account, plan, _ = spec()
    plan.extend(["boom"] * 100)
    h = Harness(tmp_path, account)
    h.start()
    await h.until(lambda: h.runner.live.state == "backoff")
    await h.close()
    assert h.task is not None and h.task.done()
    assert h.names()[-1] == "stopped"
