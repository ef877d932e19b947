"""One client's huge input must not starve the others: the echo model answers a big paste at once
(every chunk is ready, nothing awaits a socket), so the agent loop itself lets the event loop run
other work between chunks. Found by an outside test: an 18 MB chat input froze `/healthz` for 47 s."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from appserver.providers.base import ChatMessage, Done, ProviderRequest, Text, Usage
from appserver.providers.echo import WORDS_PER_BIG_CHUNK, EchoProvider
from appserver.runtime import SubmitRequest
from tests.support.kernel import open_server

pytestmark = pytest.mark.timeout(120)


async def test_other_tasks_run_while_a_huge_reply_streams(tmp_path: Path) -> None:
    server = await open_server(tmp_path / "home")
    seen: set[int] = set()  # the reply's revisions another task saw while it streamed

    try:
        words = 100_000
        sub = await server.kernel.submit(SubmitRequest(agent="assistant", input="a " * words, conversation="new"))
        controller = sub.handle.controller

        async def ticker() -> None:
            while True:
                await asyncio.sleep(0)
                if controller.status == "running":
                    seen.add(controller.revision)

        task = asyncio.ensure_future(ticker())
        end = await sub.wait(60)
        task.cancel()
        assert end.status == "completed" and end.text() == "echo: " + "a " * (words - 1) + "a"
        # a chunk is a revision: one yield per 64 chunks shows another task ~1,500 of them (the
        # turn's own awaits, without that, a handful)
        assert len(seen) >= words // 64 // 2, len(seen)
    finally:
        await server.close()


async def _echo(text: str, max_tokens: int | None = None) -> list[object]:
    request = ProviderRequest(model="echo", messages=[ChatMessage("user", text)], max_tokens=max_tokens)
    return [c async for c in EchoProvider().stream(request)]


async def test_echo_answers_a_big_paste_in_few_chunks_and_counts_every_word() -> None:
    words = 600_000  # 1.2 MB: past WORD_BY_WORD_MAX_CHARS
    chunks = await _echo("ab " * words)
    texts = [c.text for c in chunks if isinstance(c, Text)]
    assert "".join(texts) == "echo: " + "ab " * (words - 1) + "ab"
    assert len(texts) <= (words + 1) // WORDS_PER_BIG_CHUNK + 1
    usage = next(c for c in chunks if isinstance(c, Usage))
    assert usage.output_tokens == words + 1 and chunks[-1] == Done("stop")

    cut = await _echo("ab " * words, max_tokens=300)  # max_tokens still counts words
    assert "".join(c.text for c in cut if isinstance(c, Text)) == "echo:" + " ab" * 299
    assert cut[-1] == Done("length")


async def test_echo_max_tokens_equal_to_the_words_is_no_cut() -> None:
    chunks = await _echo("one two", max_tokens=3)  # "echo:", "one", "two"
    assert "".join(c.text for c in chunks if isinstance(c, Text)) == "echo: one two"
    assert chunks[-1] == Done("stop")
    chunks = await _echo("one two three", max_tokens=3)
    assert "".join(c.text for c in chunks if isinstance(c, Text)) == "echo: one two" and chunks[-1] == Done("length")
