"""Discord button presses are acknowledged only once the gateway's ledger recorded them (session 28,
R). A press used to be deferred (interaction callback type 6) first and recorded after, possibly ~12 s
later behind an earlier message's image download: a kill -9 in between lost it without a trace
(Discord had shown no failure, so nobody pressed again). Now: recorded, then deferred; a press waits
for the channel's earlier messages at most `PRESS_WAIT_S`, one whose record is slower than
`PRESS_ACK_S` is deferred anyway, and one that cannot be recorded is answered with a note to press
again (an ephemeral message, or a followup when it was deferred already).

The real discord.py against the loopback fake of Discord (tests/fakes/discord_api.py): in-process
with a stand-in for the gateway's `on_message` (commits, then calls the ack, as gateway/app.py does),
and end to end through `appserver serve --channels discord` with kill -9 of the gateway child."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.requests import Request

from plugins.contract import Account, AdapterContext, InboundMessage, Target
from plugins.discord import DiscordAdapter, create_adapter
from plugins.discord.adapter import PRESS_NOT_RECORDED, PRESS_WAIT_S
from tests.fakes.discord_api import BotMessage, FakeDiscord
from tests.support.cli import cli_env, run_cli
from tests.support.gateway import ChannelServer, channel_server, write_config

pytestmark = pytest.mark.timeout(150)

PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 64
GENERAL = "300000000000000001"
APPROVALS = "300000000000000002"  # routed to `careful` (clock=ask) in the end-to-end tests
SLOW = "300000000000000003"  # the same, for the slow-download case
DEADLINE_S = 3.0  # Discord fails an interaction not answered within 3 s


class Fake(FakeDiscord):
    """The fake, plus interaction followups (`POST webhooks/{application}/{token}`, which discord.py
    sends without the bot token) and a hook called as an interaction callback arrives."""

    def __init__(self) -> None:
        super().__init__()
        self.followups: list[tuple[str, dict[str, Any]]] = []
        self.on_callback: Callable[[str], None] | None = None

    def _handle(
        self, request: Request, method: str, parts: list[str], body: Any, kind: str
    ) -> tuple[int, Any, dict[str, str] | None, float]:
        if parts[0] == "interactions" and parts[-1] == "callback":
            hook = self.on_callback
            if hook is not None:
                hook(parts[1])
        if parts[0] == "webhooks" and method == "POST" and len(parts) == 3:
            payload = body if isinstance(body, dict) else {}
            mid = self.snowflake()
            with self._lock:
                self.followups.append((parts[2], payload))
            message = {
                "id": mid, "channel_id": GENERAL, "author": self.bot_user, "content": str(payload.get("content")),
                "timestamp": "2026-01-01T00:00:00+00:00", "edited_timestamp": None, "tts": False,
                "mention_everyone": False, "mentions": [], "mention_roles": [], "attachments": [], "embeds": [],
                "pinned": False, "type": 0, "flags": int(payload.get("flags") or 0), "components": [],
                "webhook_id": parts[1],
            }  # fmt: skip
            return 200, message, None, 0.0
        return super()._handle(request, method, parts, body, kind)

    def callback_calls(self, iid: str) -> list[Any]:
        return [c for c in self.calls() if c.path.startswith(f"interactions/{iid}/")]


class Ledger:
    """The gateway's side of the contract: `on_message` commits, then calls the message's ack (as
    gateway/app.py does). `fail` records refused, `delay` seconds before each record."""

    def __init__(self, fake: Fake) -> None:
        self.fake = fake
        self.committed: dict[str, float] = {}  # message id -> time.monotonic() of the commit
        self.texts: list[str] = []
        self.callbacks_at_commit: dict[str, list[Any]] = {}
        self.fail = 0
        self.delay = 0.0

    async def on_message(self, msg: InboundMessage) -> None:
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.fail > 0:
            self.fail -= 1
            raise RuntimeError("ledger unavailable")
        iid = str(msg.raw.get("interaction_id") or "")
        self.callbacks_at_commit[msg.message_id] = [b for i, b in self.fake.interaction_callbacks() if i == iid]
        self.committed.setdefault(msg.message_id, time.monotonic())
        self.texts.append(msg.text)
        if msg.ack is not None:
            await msg.ack()

    def report(self, state: Any, reason: str | None) -> None:
        pass


@pytest.fixture(scope="module")
def fake() -> Iterator[Fake]:
    with Fake() as f:
        yield f


@pytest.fixture
async def running(fake: Fake, tmp_path: Path) -> AsyncIterator[tuple[DiscordAdapter, Ledger]]:
    ledger = Ledger(fake)
    ctx = AdapterContext(ledger.on_message, ledger.report, tmp_path, logging.getLogger("test.discord.s28r"))
    settings = {"api_url": fake.api_url, "gateway_url": fake.gateway_url}
    account = Account("discord", "main", settings, {"token": fake.token}, {"token": "environment variable X"})
    adapter = create_adapter(account, ctx)
    assert isinstance(adapter, DiscordAdapter)
    await adapter.start()
    try:
        yield adapter, ledger
    finally:
        fake.slow_attachments(0)
        await adapter.stop()


async def _prompt(adapter: DiscordAdapter, short: str) -> str:
    [mid] = await adapter.prompt_approval(Target(GENERAL), f"🔐 shell?\nReply /approve {short}", short)
    return mid


async def test_a_press_is_acknowledged_only_once_recorded(fake: Fake, running: tuple[DiscordAdapter, Ledger]) -> None:
    adapter, ledger = running
    mid = await _prompt(adapter, "aa11")
    iid = fake.click("801", GENERAL, mid, "approve:aa11", name="Bo")
    calls = await fake.wait_for_async(lambda: fake.callback_calls(iid), 5, "the press's callback")
    key = f"interaction:{iid}"
    assert key in ledger.committed and ledger.callbacks_at_commit[key] == []  # nothing told Discord before
    assert ledger.committed[key] <= calls[0].t
    await asyncio.sleep(0.3)
    assert [b for i, b in fake.interaction_callbacks() if i == iid] == [{"type": 6}]  # once


async def test_a_press_behind_a_slow_download_is_recorded_and_answered_within_3_s(
    fake: Fake, running: tuple[DiscordAdapter, Ledger]
) -> None:
    adapter, ledger = running
    mid = await _prompt(adapter, "bb22")
    # a download that outlasts both the press's wait for it (PRESS_WAIT_S) and Discord's 3 s
    fake.slow_attachments(PRESS_WAIT_S + 2.5)
    image = fake.add_attachment("p.png", PNG)
    looked = fake.inject_guild_message("802", "look at this", mention=True, attachments=[image])
    await asyncio.sleep(0.3)  # the download has begun and holds the channel's line
    pressed = time.monotonic()
    iid = fake.click("802", GENERAL, mid, "approve:bb22", name="Bo")
    await asyncio.sleep(0.1)
    after = fake.inject_guild_message("802", "after the press", mention=True)
    calls = await fake.wait_for_async(lambda: fake.callback_calls(iid), 5, "the press's callback")
    assert calls[0].t - pressed < DEADLINE_S, calls[0].t - pressed
    key = f"interaction:{iid}"
    assert key in ledger.committed and ledger.committed[key] <= calls[0].t  # recorded before Discord heard
    assert ledger.callbacks_at_commit[key] == []
    # the earlier message is not lost and the later one still waits for it
    await fake.wait_for_async(lambda: after in ledger.committed, 15, "the later message")
    assert looked in ledger.committed
    assert ledger.texts[-3:] == ["/approve bb22", "look at this", "after the press"]
    assert [b for i, b in fake.interaction_callbacks() if i == iid] == [{"type": 6}]


async def test_a_press_that_cannot_be_recorded_is_not_acknowledged_but_answered_to_press_again(
    fake: Fake, running: tuple[DiscordAdapter, Ledger]
) -> None:
    adapter, ledger = running
    mid = await _prompt(adapter, "cc33")
    ledger.fail = 1
    iid = fake.click("803", GENERAL, mid, "approve:cc33", name="Bo")
    await fake.wait_for_async(lambda: fake.callback_calls(iid), 5, "the press's answer")
    await asyncio.sleep(0.3)
    answers = [b for i, b in fake.interaction_callbacks() if i == iid]
    assert [(b.get("type"), b["data"].get("content"), b["data"].get("flags")) for b in answers] == [
        (4, PRESS_NOT_RECORDED, 64)  # a message only the presser sees; no deferred update (6)
    ], answers
    assert f"interaction:{iid}" not in ledger.committed
    again = fake.click("803", GENERAL, mid, "approve:cc33", name="Bo")  # the person presses again
    await fake.wait_for_async(lambda: fake.callback_calls(again), 5, "the second press's callback")
    assert f"interaction:{again}" in ledger.committed
    assert [b for i, b in fake.interaction_callbacks() if i == again] == [{"type": 6}]


async def test_a_record_slower_than_discord_allows_is_acknowledged_in_time_and_a_failure_followed_up(
    fake: Fake, running: tuple[DiscordAdapter, Ledger]
) -> None:
    adapter, ledger = running
    mid = await _prompt(adapter, "dd44")
    ledger.delay, ledger.fail = 3.5, 1
    pressed = time.monotonic()
    iid = fake.click("804", GENERAL, mid, "approve:dd44", name="Bo")
    calls = await fake.wait_for_async(lambda: fake.callback_calls(iid), 5, "the press's callback")
    assert calls[0].t - pressed < DEADLINE_S, calls[0].t - pressed
    assert [b for i, b in fake.interaction_callbacks() if i == iid] == [{"type": 6}]
    token = f"itoken-{iid}"
    [(_, note)] = await fake.wait_for_async(
        lambda: [f for f in fake.followups if f[0] == token], 5, "the followup saying to press again"
    )
    assert note.get("content") == PRESS_NOT_RECORDED and note.get("flags") == 64  # only the presser sees it
    assert f"interaction:{iid}" not in ledger.committed

    # slow but recorded: acknowledged once, in time, and nothing followed up
    ledger.delay = 3.5
    pressed = time.monotonic()
    ok = fake.click("804", GENERAL, mid, "approve:dd44", name="Bo")
    calls = await fake.wait_for_async(lambda: fake.callback_calls(ok), 5, "the second press's callback")
    assert calls[0].t - pressed < DEADLINE_S, calls[0].t - pressed
    await fake.wait_for_async(lambda: f"interaction:{ok}" in ledger.committed, 5, "the slow record")
    await asyncio.sleep(0.3)
    assert [b for i, b in fake.interaction_callbacks() if i == ok] == [{"type": 6}]
    assert not [f for f in fake.followups if f[0] == f"itoken-{ok}"]


# ---------------------------------------------------------------------- end to end, kill -9


@pytest.fixture(scope="module")
def efake() -> Iterator[Fake]:
    """A fake of its own for the server's gateway child (one bot connection per fake)."""
    with Fake() as f:
        yield f


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, efake: Fake) -> Iterator[ChannelServer]:
    fake = efake
    home = tmp_path_factory.mktemp("discord_s28r") / "home"
    settings = {"api_url": fake.api_url, "gateway_url": fake.gateway_url, "token_env": "DISCORD_BOT_TOKEN",
                "dm_policy": "open", "default_agent": "assistant"}  # fmt: skip
    write_config(home, {"discord": {"main": settings}}, ["discord"])
    created = run_cli(home, "agents", "create", "--name", "careful", "--tool", "clock=ask")
    assert created.code == 0, created.err
    for channel, name in ((APPROVALS, "approvals"), (SLOW, "slow")):
        fake.add_text_channel(channel, name)
        routed = run_cli(home, "channels", "route", "add", f"discord:main:{channel}", "careful")
        assert routed.code == 0, routed.err
    env = cli_env(home, DISCORD_BOT_TOKEN=fake.token)
    with channel_server(home, "--channels", "discord", env=env) as server:
        yield server


def _ask_for_approval(fake: Fake, channel: str, user: str) -> tuple[BotMessage, str]:
    fake.inject_guild_message(user, "/call clock {}", channel=channel, mention=True)
    shown = fake.wait_for(
        lambda: next((m for m in fake.messages(channel) if m.components), None), 30, "the approval prompt"
    )
    short = re.search(r"/approve (\w+)", shown.content)
    assert short, shown
    return shown, short.group(1)


def _catch_up_point_saved(srv: ChannelServer, channel: str) -> bool:
    """The adapter's state file (plugins/discord/adapter.py STATE_FILE) holds where `channel`'s catch-up starts."""
    path = srv.home / "channels" / "discord" / "data" / "main" / "last_seen.json"
    try:
        seen = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return int((seen.get(channel) or {}).get("last") or 0) > 0


def _kill_at_callback(fake: Fake, pid: int) -> list[float]:
    """kill -9 the gateway child the moment the fake receives the first interaction callback."""
    killed: list[float] = []

    def kill(_: str) -> None:
        if not killed:
            os.kill(pid, signal.SIGKILL)
            killed.append(time.monotonic())

    fake.on_callback = kill
    return killed


def _approved_after_restart(fake: Fake, srv: ChannelServer, channel: str, shown: BotMessage, pid: int) -> None:
    fake.wait_for(lambda: srv.gateway_pid() != pid or None, 20, "the restarted gateway child")
    decided = fake.wait_for(
        lambda: next((m for m in fake.messages(channel) if m.id == shown.id and not m.components), None),
        40,
        "the prompt edited to its decision after the restart",
    )
    assert "Approved by" in decided.content, decided.content
    fake.wait_for_text(channel, lambda t: t.startswith("clock -> "), timeout=30)


def test_kill_9_at_the_press_callback_still_applies_the_approval_after_restart(srv: ChannelServer, efake: Fake) -> None:
    fake = efake
    shown, short = _ask_for_approval(fake, APPROVALS, "811")
    pid = srv.gateway_pid()
    killed = _kill_at_callback(fake, pid)
    try:
        fake.click("811", APPROVALS, shown.id, f"approve:{short}", name="ann")
        fake.wait_for(lambda: killed, 10, "the press's callback")
    finally:
        fake.on_callback = None
    _approved_after_restart(fake, srv, APPROVALS, shown, pid)


def test_kill_9_at_the_callback_of_a_press_behind_a_slow_download_still_applies_it(
    srv: ChannelServer, efake: Fake
) -> None:
    fake = efake
    shown, short = _ask_for_approval(fake, SLOW, "812")
    # the channel's catch-up point is saved (at most once a second)
    fake.wait_for(lambda: _catch_up_point_saved(srv, SLOW) or None, 10, "the channel's catch-up point saved")
    pid = srv.gateway_pid()
    fake.slow_attachments(8.0)
    try:
        image = fake.add_attachment("p.png", PNG)
        fake.inject_guild_message("812", "look at this", channel=SLOW, mention=True, attachments=[image])
        time.sleep(0.3)  # its download has begun and holds the channel's line
        killed = _kill_at_callback(fake, pid)
        pressed = time.monotonic()
        fake.click("812", SLOW, shown.id, f"approve:{short}", name="ann")
        fake.wait_for(lambda: killed, 10, "the press's callback")
        assert killed[0] - pressed < DEADLINE_S, killed[0] - pressed
    finally:
        fake.on_callback = None
        fake.slow_attachments(0)
    _approved_after_restart(fake, srv, SLOW, shown, pid)
    fake.wait_for_text(SLOW, "echo: look at this", timeout=30)  # the message never recorded is caught up
