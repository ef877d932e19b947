"""Gateway fixes from the twentieth session's outside tests, against a real `appserver serve
--channels telegram` and the loopback fake Bot API (tests/fakes/telegram_api.py).

* After `/new` the reply still being written stays within reach: `/new` says so, `/status` shows
  it and `/cancel` stops it (was: "Nothing is running." while it streamed on).
* A photo whose base64 would not fit in the server's frame no longer fails the whole message: the
  largest size Telegram offers that fits goes to the model; when none fits, the caption goes on
  with a note that the image was too big (was: `frame_too_large`, the caption lost).
* Approval prompts show the arguments literally, whitespace included (was: runs of spaces squashed
  to one); since s20b a run of 8 or more is shown as its count (`⟨400 spaces⟩`).
* `channels status` keeps the last inbound and outbound times and the counters over a gateway
  restart, a kill -9 of the child included (was: `never` and zeros seconds after a message).
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.db import default_path
from gateway.ledger import Entry, UpdateKey
from gateway.turninput import frame_size, submit_frame
from plugins.contract import image_budget
from tests.fakes.telegram_api import FakeTelegram
from tests.support.cli import cli_env, run_cli
from tests.support.gateway import ChannelServer, channel_server, gateway_children, write_config
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(180)

JPEG_HEAD = bytes.fromhex("ffd8ffe000104a46494600010100000100010000ffdb004300")
MIB = 1 << 20


def _jpeg(size: int, fill: int) -> bytes:
    body = bytes([fill]) * (size - len(JPEG_HEAD) - 2)
    return JPEG_HEAD + body + b"\xff\xd9"


def _settings(tg: FakeTelegram, **extra: Any) -> dict[str, Any]:
    return {
        "api_url": tg.url,
        "poll_timeout": 1,
        "token_env": "TG_TOKEN",
        "dm_policy": "open",
        "default_agent": "assistant",
        **extra,
    }


@pytest.fixture(scope="module")
def tg() -> Iterator[FakeTelegram]:
    with FakeTelegram() as fake:
        yield fake


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, tg: FakeTelegram) -> Iterator[ChannelServer]:
    home = tmp_path_factory.mktemp("s20") / "home"
    write_config(home, {"telegram": {"main": _settings(tg)}}, ["telegram"])
    created = run_cli(home, "agents", "create", "--name", "careful", "--tool", "clock=ask")
    assert created.code == 0, created.err
    routed = run_cli(home, "channels", "route", "add", "telegram:main:5400:__root__", "careful")
    assert routed.code == 0, routed.err
    with channel_server(home, "--channels", "telegram", env=cli_env(home, TG_TOKEN=tg.token)) as server:
        yield server


def _user_inputs(home: Path) -> list[Any]:
    conn = sqlite3.connect(f"file:{home / 'appserver.db'}?mode=ro", uri=True)
    try:
        return [json.loads(c) for (c,) in conn.execute("SELECT content FROM messages WHERE role='user'")]
    finally:
        conn.close()


def _images_with(home: Path, fragment: str) -> list[str]:
    """The image data URLs of the stored user message holding `fragment`."""
    mine = [r for r in _user_inputs(home) if fragment in json.dumps(r)]
    assert mine, f"no stored input with {fragment!r}"
    last = mine[-1]
    if not isinstance(last, list):
        return []
    return [
        str(p.get("url") or p["image_url"]["url"])
        for p in last
        if isinstance(p, dict) and p.get("type") in ("image", "image_url")
    ]


def _ledger_row(home: Path, chat: int, message_id: int) -> tuple[str, str | None]:
    conn = sqlite3.connect(f"file:{default_path(home)}?mode=ro", uri=True)
    try:
        row = conn.execute(
            "SELECT state, reason FROM ledger WHERE channel='telegram' AND chat=? AND message_id LIKE ?",
            (str(chat), f"%{message_id}"),
        ).fetchone()
    finally:
        conn.close()
    assert row is not None
    return str(row[0]), row[1]


# ---------------------------------------------------------------------- 1. /new while a reply streams


def test_after_new_the_running_reply_is_still_shown_and_cancellable(srv: ChannelServer, tg: FakeTelegram) -> None:
    chat = 5100
    tg.dm("/slow 200", user_id=chat)
    reply = tg.wait_for_text(chat, lambda t: t.startswith("w1 w2"), timeout=20)  # it streams
    tg.dm("/new", user_id=chat)
    new = tg.wait_for_text(chat, lambda t: t.startswith("🆕"), timeout=15)
    assert "still being written" in new.text and "/cancel" in new.text, new.text
    tg.dm("/status", user_id=chat)
    status = tg.wait_for_text(chat, lambda t: t.startswith("Agent:"), timeout=15)
    assert "No conversation yet" in status.text, status.text  # the chat's own conversation is new
    assert "Still writing a reply from before /new" in status.text, status.text
    tg.dm("/cancel", user_id=chat)
    cancelled = tg.wait_for_text(chat, lambda t: t.startswith("⏹") or t == "Nothing is running.", timeout=15)
    assert cancelled.text == "⏹ Cancelled the reply from before /new.", cancelled.text

    def settled() -> str | None:
        text = tg.message(chat, reply.message_id).text
        return text if "w200" not in text and "cancel" in text.lower() else None

    final = wait_for(settled, 20, "the old reply to end as cancelled")
    assert not final.rstrip().endswith("w200"), final
    time.sleep(1.0)
    assert "w200" not in tg.message(chat, reply.message_id).text
    # and it is gone: nothing runs any more
    tg.dm("/cancel", user_id=chat)
    tg.wait_for_text(chat, "Nothing is running.", timeout=15)


def test_new_with_nothing_running_says_only_that(srv: ChannelServer, tg: FakeTelegram) -> None:
    chat = 5101
    tg.dm("hello there", user_id=chat)
    tg.wait_for_text(chat, "echo: hello there", timeout=15)
    tg.dm("/new", user_id=chat)
    tg.wait_for_text(chat, "🆕 Your next message starts a new conversation.", timeout=15)


# ---------------------------------------------------------------------- 2. photos and the frame limit


def test_a_photo_too_big_for_the_frame_goes_as_the_largest_size_that_fits(srv: ChannelServer, tg: FakeTelegram) -> None:
    """4.3 MiB (5.7 MiB of base64) cannot go in a 4 MiB frame: the 2.1 MiB size does."""
    small, mid, large = _jpeg(4096, 1), _jpeg(2200 * 1024, 2), _jpeg(4400 * 1024, 3)
    sent = tg.inject(5200, None, caption="a big picture", photo_sizes=[small, mid, large])
    tg.wait_for_text(5200, lambda t: "a big picture" in t, timeout=30)
    assert _images_with(srv.home, "a big picture") == ["data:image/jpeg;base64," + base64.b64encode(mid).decode()]
    wait_for(lambda: _ledger_row(srv.home, 5200, sent.message_id)[0] == "delivered", 10, "delivered")
    assert not [m for m in tg.messages(5200) if "Could not start a turn" in m.text]


def test_a_6_mib_photo_skips_the_3_mib_size_that_would_not_fit_either(srv: ChannelServer, tg: FakeTelegram) -> None:
    small, mid, large = _jpeg(64 * 1024, 4), _jpeg(3 * MIB, 5), _jpeg(6 * MIB, 6)
    assert len(mid) > image_budget()  # 4 MiB of base64 and more
    tg.inject(5201, None, caption="a huge picture", photo_sizes=[small, mid, large])
    tg.wait_for_text(5201, lambda t: "a huge picture" in t, timeout=30)
    assert _images_with(srv.home, "a huge picture") == ["data:image/jpeg;base64," + base64.b64encode(small).decode()]


def test_a_photo_with_no_size_that_fits_still_delivers_the_caption_with_a_note(
    srv: ChannelServer, tg: FakeTelegram
) -> None:
    only = _jpeg(4 * MIB + 300 * 1024, 7)
    before = len(tg.calls("getFile"))
    sent = tg.inject(5202, None, caption="look at this", photo_sizes=[only])
    reply = tg.wait_for_text(5202, lambda t: "look at this" in t, timeout=30)
    assert "too big to pass on" in reply.text and str(len(only)) in reply.text, reply.text
    assert _images_with(srv.home, "look at this") == []
    wait_for(lambda: _ledger_row(srv.home, 5202, sent.message_id)[0] == "delivered", 10, "delivered")
    assert len(tg.calls("getFile")) == before  # never fetched
    assert not [m for m in tg.messages(5202) if "Could not start a turn" in m.text]


def _entry(message_id: str, images: list[bytes]) -> Entry:
    now = time.time()
    return Entry(
        seq=1,
        key=UpdateKey("slack", "main", message_id),
        chat="C1",
        thread=None,
        sender="U1",
        payload={
            "text": "two pictures",
            "chat_type": "dm",
            "images": ["data:image/png;base64," + base64.b64encode(b).decode() for b in images],
            "image_names": [f"p{i}.png" for i in range(len(images))],
            "attachments": [],
        },
        state="allowed",
        decision="allow",
        reason=None,
        turn_id=None,
        conversation=None,
        reply=None,
        remote_ids=(),
        received_at=now,
        updated_at=now,
    )


def test_images_that_fit_alone_but_not_together_leave_the_biggest_out_with_a_note() -> None:
    """Slack and Discord take several images per message (each within the budget): the frame drops
    the biggest until it fits, naming each left out, and keeps the text."""
    limit = 4 * MIB
    a, b = b"\x89PNG" + b"a" * (2 * MIB), b"\x89PNG" + b"b" * (2 * MIB + 1000)
    entry = _entry("m1", [a, b])
    assert frame_size(submit_frame([entry], "assistant", "conv_1", False)) > limit
    frame = submit_frame([entry], "assistant", "conv_1", False, limit)
    assert frame_size(frame) <= limit
    parts = frame["input"]
    assert [p["url"] for p in parts if p["type"] == "image"] == [
        "data:image/png;base64," + base64.b64encode(a).decode()
    ]
    text = parts[0]["text"]
    assert "two pictures" in text and "[image too big to pass on to the model: p1.png (image/png, " in text, text
    assert str(len(b)) in text
    # within the limit nothing is dropped
    assert len(submit_frame([_entry("m2", [a])], "assistant", "conv_1", False, limit)["input"]) == 2


# ---------------------------------------------------------------------- 4. approval arguments literally


def test_approval_arguments_keep_their_whitespace_and_long_padding_is_counted(
    srv: ChannelServer, tg: FakeTelegram
) -> None:
    chat = 5400
    tg.dm('/call clock {"cmd": "printf \\"a    b\\""}', user_id=chat)
    prompt = tg.wait_for_text(chat, lambda t: t.startswith("🔐") and "printf" in t, timeout=20)
    assert 'printf \\"a    b\\"' in prompt.text, prompt.text  # four spaces, as will run
    assert "not shown" not in prompt.text
    short = re.search(r"/approve (\w+)", prompt.text)
    assert short
    tg.dm(f"/deny {short.group(1)}", user_id=chat)
    tg.wait_for_text(chat, lambda t: t.startswith("🔐") and "printf" in t and "Denied" in t, timeout=20)
    tg.wait_for_text(chat, lambda t: t.startswith("clock -> "), timeout=20)

    # 400 spaces of padding are shown as their count (since s20b): nothing is cut, the end is visible
    padded = '{"cmd": "ls' + " " * 400 + 'tail"}'
    tg.dm(f"/call clock {padded}", user_id=chat)
    prompt = tg.wait_for_text(chat, lambda t: t.startswith("🔐") and "tail" in t, timeout=20)
    assert 'ls⟨400 spaces⟩tail"}' in prompt.text, prompt.text
    assert "not shown" not in prompt.text


# ---------------------------------------------------------------------- 3. status over restarts


def _account_status(home: Path) -> dict[str, Any]:
    out = run_cli(home, "channels", "status", "--json")
    assert out.code == 0, out.err
    [account] = [a for a in out.json()["accounts"] if a.get("channel") == "telegram"]
    return dict(account)


def _saved_row(home: Path) -> dict[str, Any]:
    """The account's row in gateway.db as the gateway last saved it (what `channels status` shows),
    read directly: waiting on it costs no CLI process per look."""
    if not default_path(home).exists():
        return {}
    conn = sqlite3.connect(f"file:{default_path(home)}?mode=ro", uri=True)
    conn.row_factory = sqlite3.Row
    try:
        row = conn.execute("SELECT * FROM account_status WHERE channel='telegram'").fetchone()
    except sqlite3.OperationalError:  # the gateway is creating it
        return {}
    finally:
        conn.close()
    return dict(row) if row is not None else {}


def _saved_running_since(home: Path, since: float) -> bool:
    """Whether gateway.db holds the account's row as saved by a child that went `running` after
    `since` (a new child's first save: the one that wrote zeros and `never` over the counters)."""
    row = _saved_row(home)
    return row.get("state") == "running" and float(row["updated_at"]) > since


def test_last_inbound_outbound_and_counters_survive_gateway_restarts(tmp_path: Path) -> None:
    with FakeTelegram() as tg:
        home = tmp_path / "home"
        write_config(home, {"telegram": {"main": _settings(tg)}}, ["telegram"])
        env = cli_env(home, TG_TOKEN=tg.token)
        with channel_server(home, "--channels", "telegram", env=env) as srv:
            tg.dm("before the restart", user_id=5300)
            tg.wait_for_text(5300, "echo: before the restart", timeout=20)
            wait_for(lambda: _saved_row(home).get("replies", 0) >= 1, 10, "the reply counted in gateway.db")
            saved = wait_for(
                lambda: (s := _account_status(home))["last_outbound"] is not None and s["replies"] >= 1 and s,
                10,
                "the status saved",
            )
        assert saved["messages_in"] == 1 and saved["turns"] == 1, saved
        # a server restart (SIGTERM, then serve again)
        restarted = time.time()
        with channel_server(home, "--channels", "telegram", env=env) as srv:
            wait_for(lambda: _saved_running_since(home, restarted), 10, "the new child's first save")
            after = _account_status(home)
            assert after["state"] == "running", after
            assert after["last_inbound"] == pytest.approx(saved["last_inbound"], abs=0.01), after
            assert after["last_outbound"] == pytest.approx(saved["last_outbound"], abs=0.01), after
            assert (after["messages_in"], after["turns"], after["replies"]) == (1, 1, 1), after
            out = run_cli(home, "channels", "status")
            row = next(line for line in out.out.splitlines() if line.startswith("telegram"))
            assert "never" not in row, row

            # a kill -9 of the child right after a reply: the last save may predate it
            first = srv.gateway_pid()
            tg.dm("just before the kill", user_id=5301)
            tg.wait_for_text(5301, "echo: just before the kill", timeout=20)
            killed = time.time()
            os.kill(first, signal.SIGKILL)
            wait_for(lambda: [p for p in gateway_children(srv.proc.pid) if p != first], 30, "a new gateway child")
            srv.wait_channels_ready()
            wait_for(lambda: _saved_running_since(home, killed), 10, "the new child's first save")
            again = _account_status(home)
            assert again["last_inbound"] is not None and again["last_inbound"] >= after["last_inbound"], again
            # saves come once a second, so the reply just before the kill may not be in the last one:
            # what the new child shows is the older value at least, never a reset
            assert again["last_outbound"] is not None and again["last_outbound"] >= saved["last_outbound"], again
            assert again["messages_in"] >= 1 and again["replies"] >= 1, again
            # and the new child goes on from there: its own reply shows within a save or two
            tg.dm("after the kill", user_id=5302)
            tg.wait_for_text(5302, "echo: after the kill", timeout=20)
            wait_for(lambda: (_saved_row(home).get("last_outbound") or 0) > saved["last_outbound"], 10, "its save")
            wait_for(
                lambda: (_account_status(home)["last_outbound"] or 0) > saved["last_outbound"],
                10,
                "the new child's reply in the status",
            )
