"""The `telegram` channel end to end: a real `appserver serve --channels telegram`, its gateway child
running the plugin with the real python-telegram-bot, and the loopback fake Bot API
(tests/fakes/telegram_api.py). One server serves the tests that break nothing (each in chats of its
own); the kill -9 tests share another, each in a chat of its own."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import signal
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.db import default_path
from gateway.ledger import Entry, Ledger, UpdateKey
from tests.fakes.telegram_api import Call, FakeTelegram, Injected
from tests.support.cli import cli_env, run_cli
from tests.support.gateway import ChannelServer, channel_server, gateway_children, store_turns, write_config
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(120)

JPEG = bytes.fromhex("ffd8ffe000104a46494600010100000100010000ffdb004300") + bytes(range(64)) * 8 + b"\xff\xd9"


def _settings(tg: FakeTelegram, **extra: Any) -> dict[str, Any]:
    return {
        "api_url": tg.url,
        "poll_timeout": 1,
        "token_env": "TG_TOKEN",
        "dm_policy": "open",
        "default_agent": "assistant",
        **extra,
    }


def _home(tmp: Path, tg: FakeTelegram) -> Path:
    home = tmp / "home"
    write_config(home, {"telegram": {"main": _settings(tg)}}, ["telegram"])
    return home


@pytest.fixture(scope="module")
def tg() -> Iterator[FakeTelegram]:
    with FakeTelegram() as fake:
        yield fake


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, tg: FakeTelegram) -> Iterator[ChannelServer]:
    home = _home(tmp_path_factory.mktemp("telegram"), tg)
    created = run_cli(home, "agents", "create", "--name", "careful", "--tool", "clock=ask")
    assert created.code == 0, created.err
    routed = run_cli(home, "channels", "route", "add", "telegram:main:4500:__root__", "careful")
    assert routed.code == 0, routed.err
    with channel_server(home, "--channels", "telegram", env=cli_env(home, TG_TOKEN=tg.token)) as server:
        yield server


def test_a_dm_is_answered_by_edits_and_the_final_text_is_exact(srv: ChannelServer, tg: FakeTelegram) -> None:
    sent = tg.dm("/slow 40", user_id=4100)
    words = " ".join(f"w{i}" for i in range(1, 41))
    message = tg.wait_for_text(4100, words, timeout=30)
    assert len(tg.messages(4100)) == 1 and message.edits >= 1, tg.messages(4100)
    assert message.history[-1] == words and message.parse_mode == "HTML"
    assert tg.acked(sent) and tg.deliveries(sent) == 1
    assert "telegram:main running" in srv.channels_check()["detail"]
    # typing while the turn ran
    assert tg.calls("sendChatAction", chat_id=4100)


def test_markdown_with_angle_brackets_and_ampersands_renders_as_html(srv: ChannelServer, tg: FakeTelegram) -> None:
    tg.dm("**bold** if a < b && c > d: `x<y>`", user_id=4101)
    reply = tg.wait_for_text(4101, lambda t: t.startswith("echo:") and t.endswith("x<y>"), timeout=15)
    assert reply.text == "echo: bold if a < b && c > d: x<y>"
    assert "<b>bold</b>" in reply.source and "&lt; b &amp;&amp; c &gt; d" in reply.source
    assert "<code>x&lt;y&gt;</code>" in reply.source
    refused = [c for c in tg.calls(chat_id=4101) if c.status == 400 and "parse entities" in json.dumps(c.response)]
    assert refused == []


def test_a_short_reply_with_a_fence_in_mid_line_shows_a_code_block(srv: ChannelServer, tg: FakeTelegram) -> None:
    """A fence opening mid-line (`Here it is: ```python`) in a reply short enough for one message
    was shown as a stray inline backtick, plain code and an empty <pre> (outside finding, s21)."""
    tg.dm("Here it is: ```python\nprint(1)\n```", user_id=4102)
    reply = tg.wait_for_text(4102, lambda t: "print(1)" in t, timeout=15)
    assert re.search(r"<pre><code[^>]*>print\(1\)\s*</code></pre>", reply.source), reply.source
    assert "`" not in reply.text and reply.source.count("<pre>") == 1, reply.source


def test_a_long_reply_is_split_within_telegrams_limit(srv: ChannelServer, tg: FakeTelegram) -> None:
    text = "\n\n".join(f"Paragraph {i}: " + "lorem & ipsum < dolor " * 60 for i in range(6))
    assert len(text) > 8000
    tg.dm(text, user_id=4102)
    tg.wait_for(
        lambda: len(tg.messages(4102)) >= 2 and tg.messages(4102)[-1].text.endswith("dolor") or None,
        timeout=30,
        what="a split reply",
    )
    parts = [m.text for m in tg.messages(4102)]
    assert all(len(p) <= 4096 for p in parts), [len(p) for p in parts]
    assert "".join(parts).count("Paragraph") == 6


def test_a_group_message_needs_a_mention_and_is_answered_in_its_topic(srv: ChannelServer, tg: FakeTelegram) -> None:
    group = -1009001
    bob = tg.user(4200, "Bob", "bob")
    quiet = tg.inject(group, "just chatting here", kind="supergroup", thread=77, sender=bob)
    asked = tg.inject(group, f"@{tg.username} are you there?", kind="supergroup", thread=77, sender=bob)
    reply = tg.wait_for_text(group, lambda t: "are you there?" in t, timeout=15)
    assert reply.thread == 77 and reply.reply_to == asked.message_id
    time.sleep(0.5)
    assert [m.text for m in tg.messages(group)] == [f"echo: @{tg.username} are you there?"]
    assert tg.acked(quiet) and tg.acked(asked)
    # a reply to the bot counts as a mention too
    tg.inject(group, "and now?", kind="supergroup", thread=77, sender=bob, reply_to=reply.message_id)
    tg.wait_for_text(group, "echo: and now?", timeout=15, thread=77)


def test_a_photo_reaches_the_model_as_an_image(srv: ChannelServer, tg: FakeTelegram) -> None:
    tg.dm(None, photo=JPEG, caption="what is in this picture?", user_id=4300)  # type: ignore[arg-type]
    tg.wait_for_text(4300, lambda t: "what is in this picture?" in t, timeout=15)
    assert tg.calls("getFile")
    conn = sqlite3.connect(f"file:{srv.home / 'appserver.db'}?mode=ro", uri=True)
    try:
        rows = [json.loads(c) for (c,) in conn.execute("SELECT content FROM messages WHERE role='user'")]
    finally:
        conn.close()
    mine = [r for r in rows if isinstance(r, list) and any("what is in this picture?" in str(p) for p in r)]
    assert mine, rows
    images = [p for p in mine[-1] if isinstance(p, dict) and p.get("type") in ("image", "image_url")]
    assert len(images) == 1, mine[-1]
    url = str(images[0].get("url") or images[0]["image_url"]["url"])
    assert url == "data:image/jpeg;base64," + base64.b64encode(JPEG).decode()  # the largest size, whole


def test_an_approval_is_answered_by_the_inline_button(srv: ChannelServer, tg: FakeTelegram) -> None:
    tg.dm("/call clock {}", user_id=4500, first_name="Ann")
    prompt = tg.wait_for_text(4500, lambda t: t.startswith("🔐") and "clock" in t, timeout=20)
    short = re.search(r"/approve (\w+)", prompt.text)
    assert short, prompt.text
    buttons = [b["callback_data"] for row in (prompt.reply_markup or {})["inline_keyboard"] for b in row]
    assert buttons == [f"approve:{short.group(1)}", f"deny:{short.group(1)}"]
    pressed = tg.press(4500, prompt.message_id, f"approve:{short.group(1)}", sender=tg.user(4500, "Ann"))
    tg.wait_for_text(4500, lambda t: t.startswith("clock -> "), timeout=20)

    # The prompt is edited after the answer was taken; the resumed turn's reply may come first.
    def edited() -> object:
        message = tg.message(4500, prompt.message_id)
        return message if "✅ Approved by Ann" in message.text else None

    decided = wait_for(edited, 10, "the prompt edited")
    assert decided.reply_markup is None  # buttons gone with the edit
    assert tg.callback_answer(pressed.callback_id or "") is not None


def test_429_retry_after_is_honoured(srv: ChannelServer, tg: FakeTelegram) -> None:
    tg.chat(4600)
    tg.fail_next("sendMessage", 429, retry_after=2)  # a transient retry would come after 0.5 s
    tg.dm("patience", user_id=4600)
    tg.wait_for_text(4600, "echo: patience", timeout=20)
    sends = [c for c in tg.calls(chat_id=4600) if c.method in ("sendMessage", "editMessageText")]
    assert [c.status for c in sends][:2] == [429, 200], [c.status for c in sends]
    assert sends[1].t - sends[0].t >= 2.0, sends[1].t - sends[0].t
    assert len(tg.messages(4600)) == 1


def test_a_5xx_the_bot_api_answers_is_retried_and_the_reply_arrives_once(srv: ChannelServer, tg: FakeTelegram) -> None:
    """A 500 (or 502) in the Bot API's JSON is Telegram refusing the call, not a send that may have
    landed: the reply is sent again after a pause and arrives exactly once (it was lost for good)."""
    for chat, status in ((4610, 500), (4611, 502)):
        tg.chat(chat)
        tg.fail_next("sendMessage", status)
        tg.dm(f"hiccup {status}", user_id=chat)
        tg.wait_for_text(chat, f"echo: hiccup {status}", timeout=20)
        sends = [c.status for c in tg.calls(chat_id=chat) if c.method == "sendMessage"]
        assert sends == [status, 200], sends
        assert [m.text for m in tg.messages(chat)] == [f"echo: hiccup {status}"]


def test_a_conflict_is_shown_then_recovers(srv: ChannelServer, tg: FakeTelegram) -> None:
    tg.other_poller(True)
    try:
        wait_for(lambda: "telegram:main conflict" in srv.channels_check()["detail"], 10, "state conflict")
        wait_for(lambda: _status(srv)["state"] == "conflict", 10, "conflict in `channels status`")
        assert "409" in str(_status(srv)["reason"])
    finally:
        tg.other_poller(False)
    wait_for(lambda: srv.channels_check()["status"] == "ok", 15, "recovery")
    tg.dm("after the conflict", user_id=4700)
    tg.wait_for_text(4700, "echo: after the conflict", timeout=15)


def test_a_chat_that_removed_the_bot_gets_no_retry_storm(srv: ChannelServer, tg: FakeTelegram) -> None:
    tg.dm("are you still there?", user_id=4900)
    tg.block(4900, "Forbidden: bot was blocked by the user")
    wait_for(lambda: [c for c in tg.calls("sendMessage", chat_id=4900) if c.status == 403], 15, "the refused send")
    time.sleep(2.0)  # transient retries would come at 0.5, 1 and 2 s
    assert [c.status for c in tg.calls("sendMessage", chat_id=4900)] == [403]
    assert tg.messages(4900) == []


def _status(srv: ChannelServer) -> dict[str, Any]:
    out = run_cli(srv.home, "channels", "status", "--json")
    assert out.code == 0, out.err
    [account] = [a for a in out.json()["accounts"] if a.get("channel") == "telegram"]
    return dict(account)


# ---------------------------------------------------------------------- kill -9 at exact steps
#
# Each kill comes from one of the fake's crash hooks, which run on the fake's loop at their step (never
# after it, in a worker thread: there the kill once lagged ~100 ms behind the delivery on a loaded
# machine, the dying child had meanwhile put the reply's sendMessage on the wire, and the restarted one
# sent it again). The tests share one server and fake of their own (`killed`): each kills the child
# the one before restarted, in a chat of its own, and `_after_the_restart` waits for that test's
# restarted child to have delivered, so the next starts from a running one.


class _KillOnce:
    """SIGKILLs the gateway child the first time it is called (from a fake's hook)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.done = threading.Event()

    def __call__(self) -> None:
        if not self.done.is_set():
            self.done.set()
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


def _entry(home: Path, sent: Injected) -> Entry | None:
    ledger = Ledger.open(default_path(home))
    try:
        return ledger.get(UpdateKey("telegram", "main", f"{sent.chat_id}:{sent.message_id}"))
    finally:
        ledger.close()


def _after_the_restart(srv: ChannelServer, tg: FakeTelegram, sent: Injected, first: int, kill: _KillOnce) -> Entry:
    """Wait for the kill, the restarted child and the reply recorded as delivered (after which nothing
    sends for this update again); returns the ledger row."""
    wait_for(kill.done.is_set, timeout=20, what="the step the child is killed at")
    wait_for(lambda: first not in gateway_children(srv.proc.pid), timeout=20, what="the child to die")
    entry: Entry = wait_for(
        lambda: (e := _entry(srv.home, sent)) is not None and e.state == "delivered" and e,
        timeout=40,
        what="the reply recorded as delivered",
    )
    assert srv.gateway_pid() != first, "the supervisor restarted the child"
    assert entry.remote_ids == tuple(str(m.message_id) for m in tg.messages(sent.chat_id)[-1:]), entry
    assert store_turns(srv.home, f'message_id="{sent.chat_id}:') == 1  # one turn, whoever submitted it
    assert tg.acked(sent)
    # acknowledged once: no poll after the one that passed it was given it again
    polls = tg.polls()
    passed = next(i for i, (offset, _, _) in enumerate(polls) if offset > sent.update_id)
    assert all(sent.update_id not in ids for _, _, ids in polls[passed:])
    return entry


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ChannelServer, FakeTelegram]]:
    """The kill -9 tests' server and fake: apart from `srv`, which no test kills."""
    with FakeTelegram() as tg:
        home = _home(tmp_path_factory.mktemp("telegram-kill"), tg)
        with channel_server(home, "--channels", "telegram", env=cli_env(home, TG_TOKEN=tg.token)) as srv:
            yield srv, tg


def _running_child(srv: ChannelServer) -> int:
    """The gateway child once its account polls again (after the previous test's kill and restart)."""
    srv.wait_channels_ready()
    return srv.gateway_pid()


def test_kill_9_after_the_update_was_delivered_answers_once(killed: tuple[ChannelServer, FakeTelegram]) -> None:
    """Killed with getUpdates' answer on the wire, unread: Telegram delivers the update again and the
    restarted child answers it, once."""
    srv, tg = killed
    first = _running_child(srv)
    kill = _KillOnce(first)
    tg.on_delivery = lambda ids: kill()  # just before the answer is written
    try:
        sent = tg.dm("once please", user_id=4800)
        _after_the_restart(srv, tg, sent, first, kill)
    finally:
        tg.on_delivery = None
    assert [m.text for m in tg.messages(4800)] == ["echo: once please"]
    assert tg.deliveries(sent) == 2  # to the killed child, then to the restarted one


def test_kill_9_after_the_update_was_recorded_and_acknowledged_answers_once(
    killed: tuple[ChannelServer, FakeTelegram],
) -> None:
    """Killed as the offset that acknowledges the update reaches Telegram (the ledger committed the
    update first): it is never delivered again, so the restarted child resumes it from the ledger alone."""
    srv, tg = killed
    first = _running_child(srv)
    kill = _KillOnce(first)
    delivered: list[int] = []

    def on_request(method: str, params: dict[str, Any]) -> None:
        if method == "getUpdates" and delivered and int(params.get("offset") or 0) > delivered[0]:
            kill()  # the fake still acts on the call: the offset is acknowledged

    tg.on_delivery = delivered.extend
    tg.on_request = on_request
    try:
        sent = tg.dm("once again", user_id=4801)
        _after_the_restart(srv, tg, sent, first, kill)
    finally:
        tg.on_delivery = tg.on_request = None
    assert [m.text for m in tg.messages(4801)] == ["echo: once again"]
    assert tg.deliveries(sent) == 1


def test_kill_9_between_a_performed_send_and_the_ledger_noting_it_repeats_that_send_once(
    killed: tuple[ChannelServer, FakeTelegram],
) -> None:
    """The one window no design closes (docs/channels.md, "Exactly once"): Telegram performed the reply's
    sendMessage and the child died before it read the answer, so the ledger never noted the message.
    sendMessage takes no idempotency key and a bot cannot read a chat back, so the restarted child sends
    that part again: the chat shows it twice (never more) and the turn is still one."""
    srv, tg = killed
    first = _running_child(srv)
    kill = _KillOnce(first)

    def on_answer(call: Call) -> None:
        if call.method == "sendMessage" and call.chat_id == 4802 and call.status == 200:
            kill()  # the message is in the chat; its id never reaches the child

    tg.on_answer = on_answer
    try:
        sent = tg.dm("the window", user_id=4802)
        entry = _after_the_restart(srv, tg, sent, first, kill)
    finally:
        tg.on_answer = None
    time.sleep(0.5)
    texts = [m.text for m in tg.messages(4802)]
    # the dying child's send (the final text, or a first streamed part of it), then the restart's
    assert len(texts) == 2 and texts[1] == "echo: the window", texts
    assert texts[1].startswith(texts[0]), texts
    assert entry.remote_ids == (str(tg.messages(4802)[1].message_id),)
