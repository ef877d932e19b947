"""A send whose outcome is unknown is never repeated where it could show twice (DESIGN §8: once,
never twice): gateway/delivery.py's `Outbox` and `ReplySink`, and the ledger's note of a send being
attempted, against a chat in memory that can answer like Slack (look a message up by its key),
like Discord (dedupe by the key itself) or like Telegram (neither)."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any

import pytest

from gateway.delivery import BACKOFF_S, LOOKUP_SETTLE_S, DeliveryFailed, Outbox, ReplySink, SendUncertain
from gateway.ledger import Ledger, UpdateKey
from gateway.ratelimit import ChatRateLimiter
from plugins.contract import DeliveryError, Limits, Target

HERE = Target("chat1")
KEY = "chan:main:m1"


class Clock:
    """Time that moves only when someone sleeps."""

    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds
        await asyncio.sleep(0)


class Chat:
    """A platform in memory. `lose_answer(n)`: the next n sends are performed, then fail as
    uncertain (the answer never came); `unsent(n)`: they fail as uncertain without being performed."""

    def __init__(self, clock: Clock, *, can_edit: bool = True) -> None:
        self.limits = Limits(max_length=50, can_edit=can_edit)
        self.clock = clock
        self.messages: dict[str, tuple[str, str | None, float]] = {}  # id -> text, key, time
        self.sends: list[Target] = []
        self.edits: list[tuple[str, str]] = []
        self.script: list[str] = []
        self._ids = itertools.count(1)

    @property
    def is_running(self) -> bool:
        return True

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def lose_answer(self, n: int = 1) -> None:
        self.script += ["lost"] * n

    def unsent(self, n: int = 1) -> None:
        self.script += ["unsent"] * n

    async def send(self, target: Target, text: str) -> list[str]:
        self.sends.append(target)
        step = self.script.pop(0) if self.script else "ok"
        if step == "unsent":
            raise DeliveryError("ReadTimeout", uncertain=True)
        message_id = f"m{next(self._ids)}"
        self.messages[message_id] = (text, target.key, self.clock())
        if step == "lost":
            raise DeliveryError("ReadTimeout", uncertain=True)
        return [message_id]

    async def edit(self, target: Target, message_id: str, text: str) -> None:
        step = self.script.pop(0) if self.script and self.script[0] == "edit-lost" else "ok"
        _, key, t = self.messages[message_id]
        self.messages[message_id] = (text, key, t)
        self.edits.append((message_id, text))
        if step == "edit-lost":
            raise DeliveryError("ReadTimeout", uncertain=True)

    def texts(self) -> list[str]:
        return [text for text, _, _ in self.messages.values()]


class Deduping(Chat):
    """Discord: a repeated send with the same key answers the message it already made."""

    dedupes_sends = True

    async def send(self, target: Target, text: str) -> list[str]:
        for message_id, (_, key, _) in self.messages.items():
            if target.key is not None and key == target.key:
                self.sends.append(target)
                return [message_id]
        return await super().send(target, text)


class Searchable(Chat):
    """Slack: a sent message can be found by its key (message metadata)."""

    def __init__(self, clock: Clock, **kw: Any) -> None:
        super().__init__(clock, **kw)
        self.lookups: list[tuple[str | None, float]] = []
        self.lookup_errors: list[DeliveryError] = []

    async def find_sent(self, target: Target, since: float) -> list[str] | None:
        self.lookups.append((target.key, since))
        if self.lookup_errors:
            raise self.lookup_errors.pop(0)
        found = [i for i, (_, key, t) in self.messages.items() if key == target.key and t >= since]
        return found or None


def outbox(chat: Chat) -> Outbox:
    limiter = ChatRateLimiter(100.0, 100, clock=chat.clock, sleep=chat.clock.sleep)
    return Outbox(chat, limiter, chat.clock.sleep, wall=chat.clock)  # type: ignore[arg-type]


def sink(chat: Chat, **kw: Any) -> ReplySink:
    return ReplySink(outbox(chat), HERE, key=KEY, clock=chat.clock, wall=chat.clock, **kw)


# ---------------------------------------------------------------- a platform that can neither (Telegram)


async def test_an_uncertain_send_is_not_repeated_where_the_platform_cannot_tell(caplog: Any) -> None:
    chat = Chat(Clock())
    chat.lose_answer()
    with pytest.raises(SendUncertain, match="may have reached the chat"):
        await outbox(chat).send(HERE, "hello")
    assert chat.texts() == ["hello"] and len(chat.sends) == 1
    assert any(r.levelname == "ERROR" and "not sent again" in r.getMessage() for r in caplog.records)


async def test_a_raw_timeout_from_a_plugin_counts_as_uncertain() -> None:
    chat = Chat(Clock())

    async def times_out(target: Target, text: str) -> list[str]:
        chat.sends.append(target)
        raise TimeoutError("no answer")

    chat.send = times_out  # type: ignore[method-assign]
    with pytest.raises(SendUncertain):
        await outbox(chat).send(HERE, "hello")
    assert len(chat.sends) == 1


async def test_a_certain_failure_is_still_retried() -> None:
    chat = Chat(Clock())

    failures = [DeliveryError("502"), DeliveryError("connect refused")]
    real = chat.send

    async def flaky(target: Target, text: str) -> list[str]:
        if failures:
            chat.sends.append(target)
            raise failures.pop(0)
        return await real(target, text)

    chat.send = flaky  # type: ignore[method-assign]
    assert await outbox(chat).send(HERE, "hello") == ["m1"]
    assert chat.texts() == ["hello"] and len(chat.sends) == 3


async def test_an_uncertain_edit_is_repeated_it_shows_the_same_either_way() -> None:
    chat = Chat(Clock())
    [mid] = await outbox(chat).send(HERE, "a")
    chat.script.append("edit-lost")
    await outbox(chat).edit(HERE, mid, "a b")
    assert chat.edits == [(mid, "a b"), (mid, "a b")]


async def test_a_reply_whose_part_may_be_in_the_chat_fails_instead_of_sending_it_twice() -> None:
    chat = Chat(Clock())
    reply = sink(chat)
    chat.lose_answer()
    with pytest.raises(SendUncertain):
        await reply.show("first words")
    with pytest.raises(SendUncertain, match="not sent again"):  # the turn goes on: still not sent again
        await reply.show("first words and more")
    with pytest.raises(DeliveryFailed):
        await reply.finish("first words and more, done")
    assert chat.texts() == ["first words"] and len(chat.sends) == 1


async def test_after_a_restart_a_part_that_may_exist_is_sent_again_where_nothing_can_tell(caplog: Any) -> None:
    """The one window left (docs/channels.md): Telegram cannot be asked, so the part goes out again."""
    chat = Chat(Clock())
    reply = sink(chat, attempted={f"{KEY}:0": chat.clock() - 5})
    assert await reply.finish("hello") == ["m1"]
    assert any("sending part" in r.getMessage() and "again" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------- a platform that dedupes (Discord)


async def test_an_uncertain_send_is_repeated_with_the_same_key_where_the_platform_dedupes() -> None:
    chat = Deduping(Clock())
    chat.lose_answer()
    assert await outbox(chat).send(Target("chat1", key="k:0"), "hello") == ["m1"]
    assert chat.texts() == ["hello"] and [t.key for t in chat.sends] == ["k:0", "k:0"]


async def test_a_send_outside_a_reply_gets_a_key_that_holds_over_its_retries() -> None:
    chat = Deduping(Clock())
    chat.lose_answer()
    assert await outbox(chat).send(HERE, "notice") == ["m1"]
    keys = {t.key for t in chat.sends}
    assert len(chat.sends) == 2 and len(keys) == 1 and None not in keys
    await outbox(chat).send(HERE, "another notice")
    assert chat.sends[-1].key not in keys  # each send its own


# ---------------------------------------------------------------- a platform that can be asked (Slack)


async def test_an_uncertain_send_that_was_performed_is_found_and_reused() -> None:
    clock = Clock()
    chat = Searchable(clock)
    chat.lose_answer()
    sent = await outbox(chat).send_part(Target("chat1", key="k:0"), "hello")
    assert sent.found and sent.ids == ["m1"]
    assert chat.texts() == ["hello"] and len(chat.sends) == 1
    assert chat.lookups == [("k:0", 1_700_000_000.0)]  # since the first attempt began


async def test_an_uncertain_send_that_was_not_performed_is_sent_again_after_the_lookup() -> None:
    chat = Searchable(Clock())
    chat.unsent()
    start = chat.clock()
    sent = await outbox(chat).send_part(Target("chat1", key="k:0"), "hello")
    assert not sent.found and sent.ids == ["m1"]
    # looked up, and once more LOOKUP_SETTLE_S after the send began (it may have been queued there)
    assert chat.texts() == ["hello"] and len(chat.sends) == 2 and len(chat.lookups) == 2
    assert chat.clock() - start >= LOOKUP_SETTLE_S


async def test_a_lookup_that_fails_for_now_is_retried_with_backoff() -> None:
    chat = Searchable(Clock())
    chat.lose_answer()
    chat.lookup_errors.append(DeliveryError("internal_error"))
    start = chat.clock()
    sent = await outbox(chat).send_part(Target("chat1", key="k:0"), "hello")
    assert sent.found and len(chat.sends) == 1 and len(chat.lookups) == 2
    assert chat.clock() - start >= BACKOFF_S[0] + BACKOFF_S[1]


async def test_a_lookup_refused_for_good_after_an_uncertain_send_gives_at_most_once() -> None:
    chat = Searchable(Clock())
    chat.lose_answer()
    chat.lookup_errors.append(DeliveryError("missing_scope", permanent=True))
    with pytest.raises(SendUncertain, match="missing_scope"):
        await outbox(chat).send(Target("chat1", key="k:0"), "hello")
    assert chat.texts() == ["hello"] and len(chat.sends) == 1


async def test_a_reply_continues_in_the_part_it_found_showing_the_newest_text() -> None:
    chat = Searchable(Clock())
    reply = sink(chat)
    chat.lose_answer()
    assert await reply.show("first") == ["m1"]
    assert chat.texts() == ["first"]
    await reply.show("first words")
    assert await reply.finish("first words, done") == ["m1"]
    assert chat.texts() == ["first words, done"] and len(chat.sends) == 1


async def test_a_found_part_is_edited_to_the_text_of_the_send_that_found_it() -> None:
    """Before a restart the part went out with an earlier text; after it, the lookup finds it and
    the final text replaces it (the sink does not take it for the text it meant to send)."""
    chat = Searchable(Clock())
    await outbox(chat).send(Target("chat1", key=f"{KEY}:0"), "the streamed start")  # the killed child's post
    reply = sink(chat, attempted={f"{KEY}:0": chat.clock() - 1})
    assert await reply.finish("the whole final text") == ["m1"]
    assert chat.texts() == ["the whole final text"] and len(chat.sends) == 1


async def test_after_a_restart_only_the_part_that_was_in_flight_is_looked_up() -> None:
    """Part 0 was noted; part 1 was posted by the killed child, its id never noted; part 2 never went."""
    chat = Searchable(Clock())
    text = "\n\n".join(f"paragraph {i} " + "x" * 30 for i in range(3))  # three parts of at most 50
    parts = [f"paragraph {i} " + "x" * 30 for i in range(3)]
    [m1] = await outbox(chat).send(Target("chat1", key=f"{KEY}:0"), parts[0])
    await outbox(chat).send(Target("chat1", key=f"{KEY}:1"), parts[1])
    attempted = {f"{KEY}:1": chat.clock()}
    resumed = ReplySink.resumed(
        outbox(chat), HERE, (m1,), key=KEY, clock=chat.clock, wall=chat.clock, attempted=attempted
    )
    assert await resumed.finish(text) == ["m1", "m2", "m3"]
    assert chat.texts() == parts and [k for k, _ in chat.lookups] == [f"{KEY}:1"]
    assert [t.key for t in chat.sends] == [f"{KEY}:0", f"{KEY}:1", f"{KEY}:2"]


async def test_a_final_text_the_platform_will_not_edit_goes_out_under_a_key_of_its_own() -> None:
    chat = Deduping(Clock())
    reply = sink(chat)
    await reply.show("start")
    refused = chat.edit

    async def refuse(target: Target, message_id: str, text: str) -> None:
        raise DeliveryError("message can't be edited", permanent=True)

    chat.edit = refuse  # type: ignore[method-assign]
    ids = await reply.finish("start, and the end")
    chat.edit = refused  # type: ignore[method-assign]
    assert ids == ["m2"] and [t.key for t in chat.sends] == [f"{KEY}:0", f"{KEY}:0:new"]


# ---------------------------------------------------------------- the ledger notes the attempt


def test_the_ledger_keeps_the_part_being_sent(tmp_path: Path) -> None:
    ledger = Ledger.open(tmp_path / "gateway.db")
    try:
        key = UpdateKey("slack", "main", "D1:1.2")
        ledger.record(key, chat="D1", sender="U1")
        ledger.decide(key, "allow", "open")
        ledger.note_sending(key, "slack:main:D1:1.2:0", 1.5)  # not yet submitted: nothing to note
        entry = ledger.get(key)
        assert entry is not None and entry.sending is None
        ledger.mark_submitted(key, "turn_1")
        ledger.note_sending(key, "slack:main:D1:1.2:0", 1_700_000_000.25)
        entry = ledger.get(key)
        assert entry is not None and entry.sending == ("slack:main:D1:1.2:0", 1_700_000_000.25)
        ledger.note_sent(key, ["1.3"], None)
        ledger.mark_finished(key, "hi")
        ledger.note_sending(key, "slack:main:D1:1.2:1", 1_700_000_001.0)
        entry = ledger.get(key)
        assert entry is not None and entry.sending == ("slack:main:D1:1.2:1", 1_700_000_001.0)
        assert entry.remote_ids == ("1.3",)
        ledger.mark_delivered(key, ["1.3"])
        ledger.note_sending(key, "slack:main:D1:1.2:2", 2.0)  # delivered: final, nothing moves
        entry = ledger.get(key)
        assert entry is not None and entry.sending == ("slack:main:D1:1.2:1", 1_700_000_001.0)
    finally:
        ledger.close()
