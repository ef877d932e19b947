"""A reply part on a platform that dedupes sends (Discord's nonce) whose post was performed but
answered with an error that says it was not (a 5xx Discord's adapter counts as a certain failure),
until the outbox gave up: the reply's final text went out under the same key, Discord answered with
the message the first attempt made, and the outbox took it as showing the final text. The chat kept
the first attempt's words for good, the ledger said delivered (session 34, found by an outside attack
against the loopback Discord with `/slow 30`). The repeat is now taken as found and edited."""

from __future__ import annotations

from gateway.delivery import DeliveryFailed
from plugins.contract import DeliveryError, Target
from tests.test_gateway_send_once import Clock, Deduping, sink


class PerformedThenRefused(Deduping):
    """Discord answering 503 to posts it performed, `failing` times."""

    def __init__(self, clock: Clock, failing: int) -> None:
        super().__init__(clock)
        self.failing = failing

    async def send(self, target: Target, text: str) -> list[str]:
        ids = await super().send(target, text)
        if self.failing:
            self.failing -= 1
            raise DeliveryError("discord send: 503 Service Unavailable")  # certain, as the adapter says
        return ids


async def test_a_post_performed_then_refused_is_edited_to_the_final_text() -> None:
    chat = PerformedThenRefused(Clock(), failing=100)
    reply = sink(chat)
    try:
        await reply.show("w1 w2 w3")
    except DeliveryFailed:
        pass  # the stream's update failed: the final text is still sent
    assert chat.texts() == ["w1 w2 w3"]  # performed once, deduped on every retry
    chat.failing = 0
    ids = await reply.finish("w1 w2 w3 w4 w5")
    assert chat.texts() == ["w1 w2 w3 w4 w5"], chat.texts()
    assert ids == list(chat.messages)


async def test_a_refused_post_that_was_never_performed_is_sent_once_with_the_final_text() -> None:
    chat = PerformedThenRefused(Clock(), failing=0)
    reply = sink(chat)
    chat.unsent(100)  # refused without being performed (as uncertain here: a timeout)
    try:
        await reply.show("w1 w2 w3")
    except DeliveryFailed:
        pass
    chat.script.clear()
    ids = await reply.finish("w1 w2 w3 w4 w5")
    assert chat.texts() == ["w1 w2 w3 w4 w5"] and len(ids) == 1, chat.texts()
