"""A reply part whose post was in flight at a crash (noted as attempted, its id never noted) and
that the final reply no longer needs (it shrank: "⏸ waiting for approval" went away) is found where
the platform can tell and blanked to "…" like any surplus part, instead of keeping its stale text
(gateway/delivery.py `ReplySink._blank_left`, `Outbox.find_left`)."""

from __future__ import annotations

from typing import Any

from gateway.delivery import ReplySink
from plugins.contract import Target
from tests.test_gateway_send_once import HERE, KEY, Chat, Clock, Deduping, Searchable, outbox

BODY = "the body of the reply"
WAITING = "⏸ waiting for approval of clock"


async def _killed_child(chat: Chat, *, landed: bool = True) -> str:
    """Part 0 posted and noted; part 1 posted by the child killed before its id was noted."""
    [m1] = await outbox(chat).send(Target("chat1", key=f"{KEY}:0"), BODY)
    if landed:
        await outbox(chat).send(Target("chat1", key=f"{KEY}:1"), WAITING)
    return m1


def _resumed(chat: Chat, m1: str, **kw: Any) -> ReplySink:
    """As gateway/replies.py `_deliver` builds it after a restart (entry.sending -> attempted)."""
    attempted = {f"{KEY}:1": chat.clock() - 1}
    return ReplySink.resumed(
        outbox(chat), HERE, (m1,), key=KEY, clock=chat.clock, wall=chat.clock, attempted=attempted, **kw
    )


async def test_a_part_in_flight_at_a_crash_is_blanked_when_the_reply_shrinks_where_the_platform_dedupes() -> None:
    chat = Deduping(Clock())
    m1 = await _killed_child(chat)
    ids = await _resumed(chat, m1).finish(BODY + " done.")
    assert chat.texts() == [BODY + " done.", "…"]  # no "waiting" left, no message added
    assert ids == ["m1", "m2"]  # the ledger notes the blanked part, as any surplus part


async def test_a_part_in_flight_at_a_crash_is_looked_up_and_blanked_when_the_reply_shrinks() -> None:
    chat = Searchable(Clock())
    m1 = await _killed_child(chat)
    ids = await _resumed(chat, m1).finish(BODY + " done.")
    assert chat.texts() == [BODY + " done.", "…"] and ids == ["m1", "m2"]
    assert [k for k, _ in chat.lookups] == [f"{KEY}:1"] and len(chat.sends) == 2  # found, not posted


async def test_a_part_that_never_landed_is_not_posted_where_the_platform_can_be_asked() -> None:
    chat = Searchable(Clock())
    m1 = await _killed_child(chat, landed=False)
    assert await _resumed(chat, m1).finish(BODY + " done.") == ["m1"]
    assert chat.texts() == [BODY + " done."] and len(chat.sends) == 1


async def test_past_the_dedupe_window_the_part_is_left_rather_than_posted_again() -> None:
    chat = Deduping(Clock())
    chat.dedupe_window_s = 300  # type: ignore[attr-defined]
    m1 = await _killed_child(chat)
    reply = _resumed(chat, m1)
    await chat.clock.sleep(600)
    assert await reply.finish(BODY + " done.") == ["m1"]
    assert chat.texts() == [BODY + " done.", WAITING] and len(chat.sends) == 2  # cannot tell: left


async def test_where_nothing_can_tell_the_part_is_left_as_it_is() -> None:
    chat = Chat(Clock())
    m1 = await _killed_child(chat)
    assert await _resumed(chat, m1).finish(BODY + " done.") == ["m1"]
    assert chat.texts() == [BODY + " done.", WAITING] and len(chat.sends) == 2


async def test_where_the_platform_dedupes_a_part_that_never_landed_leaves_the_blank_a_shrink_leaves() -> None:
    """The accepted cost: the repeat that would find the part posts "…" when it never went out,
    the same chat as a reply that posted the part and then shrank without a crash."""
    chat = Deduping(Clock())
    m1 = await _killed_child(chat, landed=False)
    assert await _resumed(chat, m1).finish(BODY + " done.") == ["m1", "m2"]
    assert chat.texts() == [BODY + " done.", "…"]
