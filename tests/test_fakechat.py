"""The loopback fake chat platform (tests/fakes/fakechat.py) and its plugin (tests/fakes/fakechat_plugin/), in
process: the plugin is loaded from its folder the way the gateway loads a user plugin, and driven through a
hand-built AdapterContext. The kill -9 hook runs the plugin in a subprocess."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

from plugins.contract import (
    Account,
    AccountError,
    AccountState,
    Adapter,
    AdapterContext,
    DeliveryError,
    InboundMessage,
    Target,
)
from tests.fakes.fakechat import FakeChat, install_plugin

ROOT = Path(__file__).resolve().parent.parent
PLUGIN_DIR = Path(__file__).resolve().parent / "fakes" / "fakechat_plugin"


def load_plugin() -> ModuleType:
    manifest = json.loads((PLUGIN_DIR / "channel.json").read_text())
    spec = importlib.util.spec_from_file_location("fakechat_plugin_under_test", PLUGIN_DIR / manifest["entry"])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PLUGIN = load_plugin()


@dataclass
class Harness:
    """What a gateway would be: records messages and states, acks unless told otherwise."""

    received: list[InboundMessage] = field(default_factory=list)
    states: list[tuple[AccountState, str | None]] = field(default_factory=list)
    # Called before the ack; returns False to withhold the ack, may raise to fail the hand-over.
    gate: Callable[[InboundMessage], bool] = lambda m: True

    async def on_message(self, msg: InboundMessage) -> None:
        self.received.append(msg)
        if self.gate(msg):
            assert msg.ack is not None
            await msg.ack()

    def report(self, state: AccountState, reason: str | None) -> None:
        self.states.append((state, reason))

    def ids(self) -> list[str]:
        return [m.message_id for m in self.received]

    def context(self, data_dir: Path) -> AdapterContext:
        return AdapterContext(
            on_message=self.on_message, report=self.report, data_dir=data_dir, log=logging.getLogger("fakechat-test")
        )


def make_adapter(
    harness: Harness,
    tmp_path: Path,
    settings: Mapping[str, Any],
    secrets: Mapping[str, str] | None = None,
) -> Any:
    account = Account(channel="fakechat", name="main", settings=settings, secrets=secrets or {})
    adapter = PLUGIN.create_adapter(account, harness.context(tmp_path))
    assert isinstance(adapter, Adapter)
    return adapter


@pytest.fixture
def fake() -> Iterator[FakeChat]:
    with FakeChat() as f:
        yield f


@pytest.fixture
async def running(fake: FakeChat, tmp_path: Path) -> AsyncIterator[tuple[Harness, Any]]:
    harness = Harness()
    adapter = make_adapter(harness, tmp_path, {"base_url": fake.url, "poll_timeout": 0.5})
    await adapter.start()
    try:
        yield harness, adapter
    finally:
        await adapter.stop()


async def until(condition: Callable[[], Any], timeout: float = 3.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)
    return value


# ---------------------------------------------------------------------- the fake's wire


def test_manifest_and_install(tmp_path: Path) -> None:
    assert json.loads((PLUGIN_DIR / "channel.json").read_text()) == {"id": "fakechat", "entry": "plugin.py"}
    for symlink in (False, True):
        home = tmp_path / f"home-{symlink}"
        dest = install_plugin(home, symlink=symlink)
        assert dest == home / "channels" / "fakechat"
        assert json.loads((dest / "channel.json").read_text())["id"] == "fakechat" and (dest / "plugin.py").is_file()
    with FakeChat() as fake:
        assert fake.account_settings(0.5) == {"base_url": fake.url, "poll_timeout": 0.5}
        assert fake.account_toml(token_env="T").splitlines() == [
            "[channels.fakechat.accounts.main]",
            f'base_url = "{fake.url}"',
            "poll_timeout = 1.0",
            'token_env = "T"',
        ]


def test_long_poll_redelivers_until_offset_passes(fake: FakeChat) -> None:
    with httpx.Client(base_url=fake.url, timeout=10) as c:
        t0 = time.monotonic()
        r = c.post("/getUpdates", json={"offset": 0, "timeout": 0.3})
        assert r.json() == {"ok": True, "result": []} and time.monotonic() - t0 >= 0.28

        timer = threading.Timer(0.1, lambda: fake.inject("c1", "hello", sender="u7", chat_type="group", thread="t1"))
        timer.start()
        t0 = time.monotonic()
        batch = c.post("/getUpdates", json={"offset": 0, "timeout": 5}).json()["result"]
        assert time.monotonic() - t0 < 1.5, "a long poll returns as soon as an update arrives"
        assert [u["update_id"] for u in batch] == [1]
        m = batch[0]["message"]
        assert (m["message_id"], m["chat"], m["chat_type"], m["thread"], m["sender"], m["text"]) == (
            "m1",
            "c1",
            "group",
            "t1",
            "u7",
            "hello",
        )
        # Redelivered until a later offset passes it, then forgotten.
        assert c.post("/getUpdates", json={"offset": 0, "timeout": 0}).json()["result"] == batch
        assert not fake.is_acked("m1")
        assert c.post("/getUpdates", json={"offset": 2, "timeout": 0}).json()["result"] == []
        assert fake.is_acked("m1") and fake.acked_offset == 2
        assert c.post("/getUpdates", json={"offset": 0, "timeout": 0}).json()["result"] == []
        assert fake.poll_count == 5


def test_wire_semantics(fake: FakeChat) -> None:
    with httpx.Client(base_url=fake.url, timeout=10) as c:
        sent = c.post("/sendMessage", json={"chat": "c1", "thread": None, "reply_to": None, "text": "a"}).json()
        mid = sent["result"]["message_id"]
        assert mid == "s1"
        r = c.post("/editMessageText", json={"chat": "c1", "message_id": mid, "text": "a"})
        assert r.status_code == 400 and "message is not modified" in r.json()["error"]
        assert c.post("/editMessageText", json={"chat": "c1", "message_id": "s9", "text": "b"}).status_code == 400
        fake.fail_next("sendMessage", 429, retry_after=3)
        r = c.post("/sendMessage", json={"chat": "c1", "text": "b"})
        assert r.status_code == 429 and r.json()["retry_after"] == 3 and r.headers["retry-after"] == "3"
        assert [c.status for c in fake.calls("sendMessage")] == [200, 429]
        assert [c.status for c in fake.calls(chat="c1")] == [200, 400, 400, 429]

        # A second poll terminates a held one with 409, like Telegram.
        first: dict[str, Any] = {}
        t = threading.Thread(target=lambda: first.update(r=httpx.post(f"{fake.url}/getUpdates", json={"timeout": 5})))
        t.start()
        fake.wait_for(lambda: fake.poll_count == 1)
        time.sleep(0.05)
        assert c.post("/getUpdates", json={"timeout": 0}).status_code == 200
        t.join(3)
        assert first["r"].status_code == 409


def test_token_is_checked() -> None:
    with FakeChat(token="sekrit") as fake:
        assert httpx.post(f"{fake.url}/getMe", json={}).status_code == 401
        r = httpx.post(f"{fake.url}/getMe", json={}, headers={"Authorization": "Bearer sekrit"})
        assert r.status_code == 200 and r.json()["ok"] is True


# ---------------------------------------------------------------------- the plugin, inbound


async def test_inbound_once_and_acked(fake: FakeChat, running: tuple[Harness, Any]) -> None:
    harness, adapter = running
    assert adapter.is_running and harness.states[-1] == ("running", None)
    m1 = fake.inject("c1", "hi", sender="u2", sender_name="Ann", chat_type="group", thread="t", mentions_bot=True)
    await until(lambda: len(harness.received) == 1)
    msg = harness.received[0]
    assert (msg.channel, msg.account, msg.message_id, msg.chat, msg.chat_type, msg.thread) == (
        "fakechat",
        "main",
        m1,
        "c1",
        "group",
        "t",
    )
    assert (msg.sender, msg.sender_name, msg.text, msg.mentions_bot, msg.reply_to) == ("u2", "Ann", "hi", True, None)
    assert msg.ts is not None and msg.raw["update_id"] == fake.update_id_of(m1)
    await fake.wait_for_async(lambda: fake.is_acked(m1))
    m2 = fake.inject("c1", "again", reply_to=m1)
    await until(lambda: len(harness.received) == 2)
    assert harness.ids() == [m1, m2], "an acknowledged update is not redelivered"
    assert harness.received[1].reply_to == m1 and harness.received[1].chat_type == "dm"


async def test_unacked_update_is_redelivered(fake: FakeChat, running: tuple[Harness, Any]) -> None:
    harness, _ = running
    seen: set[str] = set()

    def ack_second_time(msg: InboundMessage) -> bool:
        first = msg.message_id not in seen
        seen.add(msg.message_id)
        return not first

    harness.gate = ack_second_time
    m1 = fake.inject("c1", "one")
    await until(lambda: len(harness.received) == 2)
    assert harness.ids() == [m1, m1]
    await fake.wait_for_async(lambda: fake.is_acked(m1))
    harness.gate = lambda m: True
    m2 = fake.inject("c1", "two")
    await until(lambda: len(harness.received) == 3)
    assert harness.ids() == [m1, m1, m2]


async def test_failed_hand_over_keeps_order(fake: FakeChat, tmp_path: Path) -> None:
    harness = Harness()
    failed: list[str] = []

    def fail_once(msg: InboundMessage) -> bool:
        if not failed:
            failed.append(msg.message_id)
            raise RuntimeError("ledger is busy")
        return True

    harness.gate = fail_once
    m1, m2 = fake.inject("c1", "one"), fake.inject("c1", "two")  # one batch
    adapter = make_adapter(harness, tmp_path, {"base_url": fake.url, "poll_timeout": 0.5})
    await adapter.start()
    try:
        await until(lambda: len(harness.received) == 4)
        # The batch is handed over together (one group commit in the gateway); the failed update and
        # everything after it are redelivered, in order, and only then acknowledged.
        assert harness.ids() == [m1, m2, m1, m2]
        await fake.wait_for_async(lambda: fake.is_acked(m2))
    finally:
        await adapter.stop()


async def test_backoff_and_retry_after_then_running(fake: FakeChat, tmp_path: Path) -> None:
    harness = Harness()
    fake.fail_next("getUpdates", 500, count=2)
    fake.fail_next("getUpdates", 429, retry_after=0.5)
    adapter = make_adapter(harness, tmp_path, {"base_url": fake.url, "poll_timeout": 0.5})
    await adapter.start()
    try:
        m1 = fake.inject("c1", "hi")
        await until(lambda: harness.ids() == [m1])
        polls = fake.calls("getUpdates")
        assert [c.status for c in polls[:4]] == [500, 500, 429, 200]
        assert polls[1].t - polls[0].t >= 0.18 and polls[3].t - polls[2].t >= 0.5, "backoff and retry_after honoured"
        states = [s for s, _ in harness.states]
        assert states[:2] == ["starting", "running"] and states[2:5] == ["backoff"] * 3 and states[5] == "running"
    finally:
        await adapter.stop()
    assert harness.states[-1] == ("stopped", None) and not adapter.is_running


async def test_revoked_token_stops_polling(fake: FakeChat, running: tuple[Harness, Any]) -> None:
    harness, adapter = running
    fake.fail_next("getUpdates", 401, count=100)
    await until(lambda: harness.states[-1][0] == "error")
    await until(lambda: not adapter.is_running)
    polls = fake.poll_count
    await asyncio.sleep(0.3)
    assert fake.poll_count == polls, "no hot loop on a refused token"


async def test_account_errors(tmp_path: Path) -> None:
    with pytest.raises(AccountError, match="base_url"):
        await make_adapter(Harness(), tmp_path, {}).start()
    with pytest.raises(AccountError, match="poll_timeout"):
        await make_adapter(Harness(), tmp_path, {"base_url": "http://127.0.0.1:1", "poll_timeout": "x"}).start()
    with FakeChat(token="sekrit") as fake:
        with pytest.raises(AccountError, match="token"):
            await make_adapter(Harness(), tmp_path, {"base_url": fake.url}, {"token": "wrong"}).start()
        good = make_adapter(Harness(), tmp_path, {"base_url": fake.url, "poll_timeout": 0.5}, {"token": "sekrit"})
        await good.start()
        assert good.is_running
        await good.stop()


# ---------------------------------------------------------------------- the plugin, outbound


async def test_send_edit_react_typing(fake: FakeChat, tmp_path: Path) -> None:
    harness = Harness()
    settings = {"base_url": fake.url, "poll_timeout": 0.5, "max_length": 100, "can_edit": True}
    adapter = make_adapter(harness, tmp_path, settings)
    assert (adapter.limits.max_length, adapter.limits.can_edit, adapter.limits.can_react) == (100, True, True)
    assert adapter.format("**x**") == "**x**"
    await adapter.start()
    try:
        inbound = fake.inject("c1", "question", thread="t1")
        target = Target(chat="c1", thread="t1", reply_to=inbound)
        [mid] = await adapter.send(target, "Hel")
        await adapter.edit(target, mid, "Hello")
        await adapter.edit(target, mid, "Hello")  # identical: not an error, not an edit
        [msg] = fake.messages("c1")
        assert (msg.id, msg.text, msg.edits, msg.thread, msg.reply_to) == (mid, "Hello", 1, "t1", inbound)
        assert fake.messages("c1", "t1") == [msg] and fake.messages("c1", "other") == []
        assert (await fake.wait_for_text_async("c1", "Hello")).id == mid
        await adapter.react(target, inbound, "👀")
        await adapter.typing(target)
        assert fake.reactions("c1") == {inbound: "👀"}
        assert [c.status for c in fake.calls("editMessageText")] == [200, 400]
        assert fake.calls("sendChatAction")[0].payload["chat"] == "c1"
    finally:
        await adapter.stop()


async def test_delivery_errors(fake: FakeChat, running: tuple[Harness, Any]) -> None:
    _, adapter = running
    target = Target(chat="c1")
    fake.fail_next("sendMessage", 429, retry_after=1.5)
    with pytest.raises(DeliveryError) as e429:
        await adapter.send(target, "x")
    assert e429.value.retry_after == 1.5 and not e429.value.permanent
    fake.fail_next("editMessageText", 429, retry_after=2)
    with pytest.raises(DeliveryError) as edit429:
        await adapter.edit(target, "s1", "x")
    assert edit429.value.retry_after == 2
    fake.fail_next("sendMessage", 403)
    with pytest.raises(DeliveryError) as e403:
        await adapter.send(target, "x")
    assert e403.value.permanent and e403.value.retry_after is None
    fake.fail_next("sendMessage", 502)
    with pytest.raises(DeliveryError) as e502:
        await adapter.send(target, "x")
    assert not e502.value.permanent and e502.value.retry_after is None
    with pytest.raises(DeliveryError) as missing:
        await adapter.edit(target, "s404", "x")
    assert missing.value.permanent
    assert await adapter.send(target, "finally") == ["s1"]


async def test_network_error_is_retryable(tmp_path: Path) -> None:
    with FakeChat() as fake:
        url = fake.url
    harness = Harness()
    adapter = make_adapter(harness, tmp_path, {"base_url": url, "poll_timeout": 0.5})
    await adapter.start()  # the platform is down: start returns, the loop backs off
    try:
        assert adapter.is_running and harness.states[-1][0] == "backoff"
        with pytest.raises(DeliveryError) as e:
            await adapter.send(Target(chat="c1"), "x")
        assert not e.value.permanent
    finally:
        await adapter.stop()


# ---------------------------------------------------------------------- kill -9 between delivery and ledger

RUNNER = """
import asyncio, importlib.util, logging, sys, tempfile
from pathlib import Path
from plugins.contract import Account, AdapterContext

spec = importlib.util.spec_from_file_location("fakechat_plugin", sys.argv[1])
plugin = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plugin)

async def main() -> None:
    done = asyncio.Event()

    async def on_message(msg) -> None:
        print(msg.message_id, flush=True)
        await msg.ack()
        done.set()

    ctx = AdapterContext(on_message, lambda s, r: None, Path(tempfile.gettempdir()), logging.getLogger("runner"))
    account = Account("fakechat", "main", {"base_url": sys.argv[2], "poll_timeout": 0.5}, {})
    adapter = plugin.create_adapter(account, ctx)
    await adapter.start()
    await asyncio.wait_for(done.wait(), 10)
    await adapter.stop()

asyncio.run(main())
"""


def run_plugin_process(fake: FakeChat) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", RUNNER, str(PLUGIN_DIR / "plugin.py"), fake.url],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=20,
    )


def test_crash_before_record_redelivers(fake: FakeChat) -> None:
    fake.crash_next_delivery()
    mid = fake.inject("c1", "survive me")
    first = run_plugin_process(fake)
    assert first.returncode == -signal.SIGKILL, first.stderr
    assert first.stdout == "", "killed before the update reached the gateway"
    assert not fake.is_acked(mid)
    assert fake.calls("getUpdates")[-1].response.get("crash") is True

    second = run_plugin_process(fake)  # one crash per crash_next_delivery()
    assert second.returncode == 0, second.stderr
    assert second.stdout.split() == [mid]
    assert fake.is_acked(mid), "stop() confirmed the offset the gateway acknowledged"
