"""A reply that shrank at its end (a long text, then "⏸ waiting for approval of clock" in a part of
its own, then a final reply that fits in one part) blanks the part it no longer needs to "…"
(gateway/delivery.py `ReplySink`). Two ways that went wrong (session 35, H; an outside attack on the
loopback Discord and Slack):

- The surplus part was deleted by a moderator (Discord 404 Unknown Message, Slack
  message_not_found) or can no longer be edited (Slack edit_window_closed): the refused blank
  escaped `finish()` and the whole reply was recorded failed, though the chat showed its final
  text. It is now left as it is, with a warning, as a deleted earlier part already was. A refused
  edit of a part that carries final text still sends that text anew.
- Discord refused the post of that part for certain (400/403, a rate limit given up on): nothing
  was created, yet the shrink repeated the post as "…" under its nonce, which created a stray "…"
  message (Slack looked it up for nothing). A part is now blanked or looked up only when it may be
  in the chat: in flight at a crash, or failed in a way that may have been performed (a timeout,
  a 5xx).

In memory, with the platform fakes of tests/test_gateway_send_once.py; the first case also end to
end: `appserver serve --channels discord` against the loopback fake of Discord, the `careful` agent
on the loopback OpenAI-compatible fake (echo cannot write text before a tool call)."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from starlette.requests import Request

from gateway.delivery import DeliveryFailed
from plugins.contract import DeliveryError, Target
from tests import test_gateway_send_once as send_once
from tests.fakes.discord_api import FakeDiscord
from tests.fakes.openai_upstream import FakeOpenAI, chunk, openai_sse, tool_delta
from tests.support.cli import cli_env, run_cli
from tests.support.gateway import channel_server, end_pending_turn, write_config
from tests.support.wait import wait_for
from tests.test_gateway_send_once import KEY, Chat, Deduping, Searchable, sink

BODY = "x" * 45  # with the status line, two parts of at most 50; with " ok", one
WAITING = "⏸ waiting for approval of clock"
WHILE_WAITING = f"{BODY}\n\n{WAITING}"
FINAL = BODY + " ok"


class Clock(send_once.Clock):
    """Time that moves only when someone sleeps, by at least a millisecond: near 1.7e9 s a float
    cannot move by the rate limiter's last sub-microsecond wait, which then spun for good."""

    async def sleep(self, seconds: float) -> None:
        await super().sleep(max(seconds, 0.001))


class Moderated(Chat):
    """A chat whose messages a moderator can delete (an edit of one is then refused for good with
    `gone`), and where a post of the status line can be refused (`refuse`) without being performed,
    or performed and then answered with an error (`performed_then`)."""

    def __init__(self, clock: Clock) -> None:
        super().__init__(clock)
        self.deleted: set[str] = set()
        self.gone = DeliveryError("discord edit: 404 Unknown Message", permanent=True)
        self.refuse: DeliveryError | None = None
        self.performed_then: DeliveryError | None = None

    def delete(self, message_id: str) -> None:
        """A moderator deletes the message: it is gone, and an edit of it is refused for good."""
        del self.messages[message_id]
        self.deleted.add(message_id)

    async def send(self, target: Target, text: str) -> list[str]:
        if WAITING in text and self.refuse is not None:
            self.sends.append(target)
            raise self.refuse
        ids = await super().send(target, text)
        if WAITING in text and self.performed_then is not None:
            raise self.performed_then
        return ids

    async def edit(self, target: Target, message_id: str, text: str) -> None:
        if message_id in self.deleted:
            raise self.gone
        await super().edit(target, message_id, text)


class Discord(Moderated, Deduping):
    """Discord: a repeated post with the same nonce answers the message it made; a deleted message
    answers an edit with 404 Unknown Message."""


class Slack(Moderated, Searchable):
    """Slack: a sent message is found by its key (message metadata)."""


def discord() -> Moderated:
    return Discord(Clock())


def slack(error: str = "message_not_found") -> Slack:
    chat = Slack(Clock())
    chat.gone = DeliveryError(f"slack chat.update: {error}", permanent=True)
    return chat


def keys(chat: Chat) -> list[str | None]:
    return [t.key for t in chat.sends]


# ---------------------------------------------------------------- 1. a surplus part that cannot be blanked


@pytest.mark.parametrize("make", [discord, slack], ids=["discord-404", "slack-message_not_found"])
async def test_a_deleted_surplus_part_is_left_and_the_reply_is_delivered(
    make: Callable[[], Moderated], caplog: pytest.LogCaptureFixture
) -> None:
    chat = make()
    reply = sink(chat)
    assert await reply.show(WHILE_WAITING) == ["m1", "m2"]
    chat.delete("m2")  # the stale status line
    ids = await reply.finish(FINAL)  # EditRefused escaped here: the reply was recorded failed
    assert chat.texts() == [FINAL] and ids == ["m1", "m2"]  # the gone part stays noted, as a deleted earlier one
    assert keys(chat) == [f"{KEY}:0", f"{KEY}:1"]  # nothing posted in its place
    assert any(r.levelno == logging.WARNING and "m2" in r.getMessage() for r in caplog.records)


async def test_a_surplus_part_too_old_to_edit_is_left_and_the_reply_is_delivered() -> None:
    """Slack with a message-edit window: a long wait for the approval leaves the status line uneditable."""
    chat = slack("edit_window_closed")
    reply = sink(chat)
    await reply.show(WHILE_WAITING)
    chat.deleted.add("m2")  # not deleted: every edit of it is refused
    assert await reply.finish(FINAL) == ["m1", "m2"]
    assert chat.texts() == [FINAL, WAITING] and len(chat.sends) == 2


async def test_a_refused_edit_of_a_part_with_final_text_still_sends_that_text_anew() -> None:
    """The distinction kept: a part the final reply occupies must show its text; a surplus one need not."""
    chat = discord()
    reply = sink(chat)
    long_body = f"{BODY}\n\n{'y' * 45}"  # two parts
    assert await reply.show(f"{long_body}\n\n{WAITING}") == ["m1", "m2", "m3"]
    chat.delete("m2")
    chat.delete("m3")
    ids = await reply.finish(f"{BODY}\n\n{'y' * 40} done")
    assert chat.texts() == [BODY, "y" * 40 + " done"] and ids == ["m1", "m4", "m3"]
    assert keys(chat)[-1] == f"{KEY}:1:new"


# ---------------------------------------------------------------- 2. a part that was refused for certain


REFUSALS = [
    DeliveryError("discord send: 400 Invalid Form Body", permanent=True),
    DeliveryError("discord send: 403 Missing Permissions", permanent=True),
    DeliveryError("discord send: 429 Too Many Requests", retry_after=30.0),  # until the outbox gives up
]


@pytest.mark.parametrize("refusal", REFUSALS, ids=["400", "403", "429"])
async def test_a_post_refused_for_certain_leaves_no_stray_blank_when_the_reply_shrinks(refusal: DeliveryError) -> None:
    chat = discord()
    chat.refuse = refusal
    reply = sink(chat)
    with pytest.raises(DeliveryFailed):
        await reply.show(WHILE_WAITING)  # the stream's update is given up
    assert chat.texts() == [BODY]
    chat.refuse = None
    ids = await reply.finish(FINAL)
    assert chat.texts() == [FINAL], f"a stray message was posted: {chat.texts()}"
    assert ids == ["m1"] and set(keys(chat)) == {f"{KEY}:0", f"{KEY}:1"}


async def test_a_post_refused_for_certain_is_not_looked_up_when_the_reply_shrinks() -> None:
    chat = slack()
    chat.refuse = DeliveryError("slack chat.postMessage: restricted_action", permanent=True)
    reply = sink(chat)
    with pytest.raises(DeliveryFailed):
        await reply.show(WHILE_WAITING)
    chat.refuse = None
    assert await reply.finish(FINAL) == ["m1"]
    assert chat.texts() == [FINAL] and chat.lookups == []  # nothing to look for


async def test_a_post_refused_for_certain_then_posted_goes_as_any_part() -> None:
    chat = discord()
    chat.refuse = DeliveryError("discord send: 403 Missing Permissions", permanent=True)
    reply = sink(chat)
    with pytest.raises(DeliveryFailed):
        await reply.show(WHILE_WAITING)
    chat.refuse = None
    assert await reply.show(WHILE_WAITING + " still") == ["m1", "m2"]
    assert await reply.finish(FINAL) == ["m1", "m2"]
    assert chat.texts() == [FINAL, "…"]


async def test_a_post_answered_5xx_may_have_been_performed_and_is_still_found_and_blanked() -> None:
    """The judgement kept: a platform can perform a post and answer a 5xx (session 34's fix), so
    such a part is found by the nonce repeat and blanked, never left with its stale status line."""
    chat = discord()
    chat.performed_then = DeliveryError("discord send: 503 Service Unavailable")
    reply = sink(chat)
    with pytest.raises(DeliveryFailed):
        await reply.show(WHILE_WAITING)
    assert chat.texts() == [BODY, WAITING]
    chat.performed_then = None
    assert await reply.finish(FINAL) == ["m1", "m2"]
    assert chat.texts() == [FINAL, "…"]


async def test_a_part_that_may_have_been_performed_stays_so_after_a_later_refusal() -> None:
    """Performed and answered 503 by one update, its repeat refused by the next: the first may be
    in the chat (it is), so the shrink still finds and blanks it."""
    chat = discord()
    chat.performed_then = DeliveryError("discord send: 503 Service Unavailable")
    reply = sink(chat)
    with pytest.raises(DeliveryFailed):
        await reply.show(WHILE_WAITING)
    chat.performed_then = None
    chat.refuse = DeliveryError("discord send: 403 Missing Permissions", permanent=True)
    with pytest.raises(DeliveryFailed):
        await reply.show(WHILE_WAITING + " still")
    chat.refuse = None
    assert await reply.finish(FINAL) == ["m1", "m2"]
    assert chat.texts() == [FINAL, "…"]


# ---------------------------------------------------------------- end to end (Discord)


APPROVALS = "300000000000000002"  # routed to `careful` (clock=ask, on the fake model)
LONG_TEXT = ("lorem ipsum dolor sit amet " * 80)[:1960].strip()  # with the status lines, two parts


class ModeratedDiscord(FakeDiscord):
    """The fake, where a message in `deleted` is gone: an edit of it answers 404 Unknown Message."""

    def __init__(self) -> None:
        super().__init__()
        self.deleted: set[str] = set()

    def _handle(
        self, request: Request, method: str, parts: list[str], body: Any, kind: str
    ) -> tuple[int, Any, dict[str, str] | None, float]:
        if method == "PATCH" and len(parts) > 3 and parts[3] in self.deleted:
            return 404, {"message": "Unknown Message", "code": 10008}, None, 0.0
        return super()._handle(request, method, parts, body, kind)


def _settled(home: Path, message_id: str) -> tuple[str, str | None] | None:
    """The ledger's state and reason for the reply to `message_id`, once delivered or failed."""
    db = home / "channels" / "gateway.db"
    if not db.exists():
        return None
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        row = conn.execute("SELECT state, reason FROM ledger WHERE message_id LIKE ?", (f"%{message_id}",)).fetchone()
    finally:
        conn.close()
    return (str(row[0]), row[1]) if row and row[0] in ("delivered", "failed") else None


@pytest.mark.timeout(120)
def test_a_deleted_status_part_leaves_the_reply_delivered_end_to_end(tmp_path: Path) -> None:
    home = tmp_path / "home"
    with ModeratedDiscord() as fake, FakeOpenAI() as model:
        tool_call = tool_delta(0, id="call_1", name="clock", arguments="{}")
        model.script(openai_sse([chunk(role="assistant", content=LONG_TEXT), chunk(tool_calls=[tool_call]),
                                 chunk(finish_reason="tool_calls")]))  # fmt: skip
        model.script(openai_sse([chunk(role="assistant", content=""), chunk(finish_reason="stop")]))
        settings = {"api_url": fake.api_url, "gateway_url": fake.gateway_url, "token_env": "DISCORD_BOT_TOKEN",
                    "dm_policy": "open", "default_agent": "assistant"}  # fmt: skip
        write_config(home, {"discord": {"main": settings}}, ["discord"])
        with (home / "config.toml").open("a") as config:
            config.write(
                f'\n[providers.fake]\nkind = "openai"\nbase_url = "{model.base_url}"\napi_key_env = "FAKE_KEY"\n'
            )
        fake.add_text_channel(APPROVALS, "approvals")
        env = cli_env(home, DISCORD_BOT_TOKEN=fake.token, FAKE_KEY="k")
        created = run_cli(
            home, "agents", "create", "--name", "careful", "--model", "fake:m", "--tool", "clock=ask", env=env
        )
        assert created.code == 0, created.err
        routed = run_cli(home, "channels", "route", "add", f"discord:main:{APPROVALS}", "careful", env=env)
        assert routed.code == 0, routed.err
        with channel_server(home, "--channels", "discord", env=env) as srv:
            asked = fake.inject_guild_message("821", "go", channel=APPROVALS, mention=True)

            def status_part() -> Any:
                mine = [m for m in fake.messages(APPROVALS) if m.reference == asked and not m.components]
                return next((m for m in mine if WAITING in m.content), None)

            status = wait_for(status_part, 30, "the reply's status part")
            fake.deleted.add(status.id)  # a moderator deletes it
            asyncio.run(end_pending_turn(srv, "careful", "approve"))
            row = wait_for(lambda: _settled(home, asked), 30, "the reply delivered or failed")
            shown = [m.content for m in fake.messages(APPROVALS) if m.reference == asked and m.id != status.id]
            assert LONG_TEXT in shown
            assert row[0] == "delivered", row  # was: failed, "delivery failed: discord edit: 404 Unknown Message"
            assert "reply not delivered" not in srv.log()
