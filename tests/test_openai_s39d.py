"""A stream whose last writes the store refuses (a file size limit, as `ulimit -f` sets, lowered on
a real `appserver serve`; the real `openai` SDK as the client). Session 39, attacker D.

- A `/v1/responses` stream whose turn ended but whose Response object could not be stored was cut
  off without its last chunk (no `response.completed` or `response.failed`: the SDK raised
  mid-iteration), and the server logged a traceback. Now it ends with `response.failed` saying
  what the non-stream answer's 503 says (what the turn saved stays, do not send the input again),
  valid against OpenAI's schema, with one log line.
- A key whose last write (the stream's kept answer, or the key let go after that failure) was
  refused stayed `pending` under the live server: every repeat waited 120 s for a 409, until a
  restart. Now a repeat, once the store takes writes, takes the key over and follows its turn
  (no second run, the input kept once), and the refused write is one log line, no traceback.

A read transaction held on the store while the limit applies keeps its WAL from starting over at
its beginning: every write appends to it, so a limit of its size plus N bytes refuses, in order,
the first write that goes past N.
"""

from __future__ import annotations

import contextlib
import re
import resource
import sqlite3
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.openai_schema import require_conformance, validate
from tests.support.serve import ServeProcess
from tests.test_durability_attack import kill9, serve

pytestmark = [
    pytest.mark.timeout(150),
    pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_FSIZE on another process, as on Linux"),
    pytest.mark.skipif(not hasattr(resource, "prlimit"), reason="needs prlimit"),
]

AFTER = "what it saved stays in conversation"  # its Response object refused
SAVED = "input was saved in conversation"  # its reply refused
AGAIN = "Do not send the input again (it would be stored a second time)"
TAKEN = "its earlier request here ended but its end could not be written"
CLOSED = "the end of its stream in conversation"  # (then: NAME could not be kept)
REPEAT_S = 30  # a stuck key made a repeat wait 120 s (then 409)


def files_size(home: Path) -> int:
    return max(p.stat().st_size for p in (home / "appserver.db", home / "appserver.db-wal") if p.exists())


def limit(sp: ServeProcess, soft: int) -> None:
    resource.prlimit(sp.proc.pid, resource.RLIMIT_FSIZE, (soft, resource.RLIM_INFINITY))


def unlimit(sp: ServeProcess) -> None:
    resource.prlimit(sp.proc.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


@contextlib.contextmanager
def wal_only_grows(home: Path) -> Iterator[None]:
    db = sqlite3.connect(f"file:{home / 'appserver.db'}?mode=ro", uri=True, isolation_level=None)
    try:
        db.execute("BEGIN")
        db.execute("SELECT count(*) FROM turns").fetchall()
        yield
    finally:
        with contextlib.suppress(sqlite3.Error):
            db.execute("COMMIT")
        db.close()


def rows(home: Path, query: str, *args: Any) -> list[Any]:
    db = sqlite3.connect(f"file:{home / 'appserver.db'}?mode=ro", uri=True)
    try:
        return db.execute(query, args).fetchall()
    finally:
        db.close()


def key_state(home: Path, key: str) -> str | None:
    found = rows(home, "SELECT state FROM http_idempotency WHERE key=?", key)
    return str(found[0][0]) if found else None


def wait_for(what: Any, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def client(sp: ServeProcess, timeout: float = 60) -> openai.OpenAI:
    return openai.OpenAI(base_url=sp.url + "/v1", api_key="unused", max_retries=0, timeout=timeout)


def response_events(
    c: openai.OpenAI, body: dict[str, Any], key: str, on_delta: Any = None, conversation: str = "pin"
) -> list[dict[str, Any]]:
    """Every event of a Responses stream (as sent: `to_dict`), each validated."""
    out: list[dict[str, Any]] = []
    stream = c.responses.create(
        **body, stream=True, extra_headers={"Idempotency-Key": key, "X-Conversation-Id": conversation}
    )
    for e in stream:
        d = e.to_dict()
        validate("ResponseStreamEvent", d)
        out.append(d)
        if on_delta is not None and d["type"] == "response.output_text.delta":
            on_delta()
            on_delta = None
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


def text_of(events: list[dict[str, Any]]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


def no_traceback(log: Path) -> None:
    """No traceback in the server's log (but the WAL checkpointer's, which a file size limit may
    refuse: not these requests'), and no response left unfinished."""
    text = log.read_text(errors="replace")
    records = re.split(r"\n(?=\d{4}-\d\d-\d\d )", text)
    assert not [r for r in records if "Traceback" in r and "WAL checkpoint failed" not in r], text[-4000:]
    assert "ASGI callable returned without completing response" not in text


@pytest.mark.parametrize("room", ["reply", "none"])
def test_a_response_the_store_refuses_ends_its_stream_failed_and_its_key_is_taken_over(
    tmp_path: Path, room: str
) -> None:
    """`room`: what still fits once the turn's input is saved: its reply, not its Response object
    (the turn completed); or nothing (its reply refused too: the turn failed, its input saved),
    nor the release of its key."""
    require_conformance()
    home, log = tmp_path / "home", tmp_path / "serve.log"
    sp = serve(home, log)
    try:
        c = client(sp)
        assert c.responses.create(model="assistant", input="warm").status == "completed"
        big = "a" * 150_000
        # the turn's input is small and its reply too; the Response object holds the whole transcript
        body = {
            "model": "assistant",
            "input": [
                {"role": "user", "content": big},
                {"role": "assistant", "content": big},
                {"role": "user", "content": "/slow 40"},
            ],
        }
        margin = 64 * 1024 if room == "reply" else 0
        # A try the limit misses (the WAL started over at its beginning after all: a checkpoint
        # had copied all of it when the reader began) completes: then once more, in another
        # conversation under another key.
        for attempt in range(4):
            pin, key, seen = f"pin{attempt}", f"k{attempt}", len(log.read_text())
            with wal_only_grows(home):
                # the limit is set at its first delta (its input saved)
                events = response_events(
                    c, body, key, on_delta=lambda: limit(sp, files_size(home) + margin), conversation=pin
                )
                if events[-1]["type"] == "response.completed":
                    unlimit(sp)
                    continue
                last = events[-1]
                assert last["type"] == "response.failed", [e["type"] for e in events[-4:]]
                assert [e["type"] for e in events].count("response.failed") == 1
                failed = last["response"]
                validate("Response", failed)
                validate("ResponseResource", failed, doc="openresponses-openapi.json")
                message = failed["error"]["message"]
                assert (AFTER if room == "reply" else SAVED) + f" {pin}" in message, message
                assert AGAIN in message and "[store_unavailable]" in message, message
                assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
                # the output as the events showed it
                done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
                assert failed["output"] == done and text_of(events) == "w1 " + " ".join(f"w{i}" for i in range(2, 41))
                # its key let go, or that refused too (always when nothing fits)
                wait_for(
                    lambda k=key, at=seen: key_state(home, k) is None or "could not be let go" in log.read_text()[at:]
                )
                stuck = key_state(home, key) == "pending"
                assert stuck or room == "reply"
            break
        else:
            pytest.fail("the file size limit never refused the response's writes")
        unlimit(sp)
        assert log.read_text()[seen:].count("could not store response") == 1
        no_traceback(log)
        turns = rows(home, "SELECT count(*) FROM turns")[0][0]
        # room again: a repeat follows the key's turn at once, never runs it again
        t0 = time.monotonic()
        again = response_events(client(sp, REPEAT_S), body, key, conversation=pin)
        assert time.monotonic() - t0 < REPEAT_S
        assert rows(home, "SELECT count(*) FROM turns")[0][0] == turns
        # the input held once (when nothing fitted, only in its turn's row, open until the next start)
        assert rows(home, "SELECT count(*) FROM turns WHERE input LIKE '%/slow 40%'")[0][0] == attempt + 1
        kept = rows(home, "SELECT count(*) FROM messages WHERE role='user' AND content LIKE '%/slow 40%'")[0][0]
        assert kept == attempt + (1 if room == "reply" else 0)
        assert text_of(again) == text_of(events)
        if room == "reply":  # the turn's answer, kept for the key this time
            assert again[-1]["type"] == "response.completed", [e["type"] for e in again[-4:]]
            wait_for(lambda: key_state(home, key) == "done")
        else:  # the turn as it ended: its reply not saved, the input not to be sent again
            assert again[-1]["type"] == "response.failed", [e["type"] for e in again[-4:]]
            assert SAVED in again[-1]["response"]["error"]["message"]
        assert log.read_text()[seen:].count(TAKEN) == (1 if stuck else 0)
        no_traceback(log)
    finally:
        with contextlib.suppress(Exception):
            kill9(sp)
        sp.kill()


def chat_text(c: openai.OpenAI, text: str, key: str, conversation: str) -> tuple[str, str | None]:
    stream = c.chat.completions.create(
        model="assistant",
        messages=[{"role": "user", "content": text}],
        stream=True,
        extra_headers={"Idempotency-Key": key, "X-Conversation-Id": conversation},
    )
    out, finish = [], None
    for chunk in stream:
        validate("CreateChatCompletionStreamResponse", chunk.to_dict())
        for choice in chunk.choices:
            out.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return "".join(out), finish


def recall(c: openai.OpenAI, route: str, key: str, conversation: str) -> tuple[str, str | None]:
    """A `/recall` stream (its reply: the conversation's big input), as the client saw it end."""
    if route == "chat":
        return chat_text(c, "/recall", key, conversation)
    events: list[dict[str, Any]] = []
    for e in c.responses.create(
        model="assistant",
        input="/recall",
        stream=True,
        extra_headers={"Idempotency-Key": key, "X-Conversation-Id": conversation},
    ):
        d = e.to_dict()
        validate("ResponseStreamEvent", d)
        events.append(d)
    return text_of(events), events[-1]["type"]


@pytest.mark.parametrize("route", ["responses", "chat"])
def test_a_stream_whose_kept_answer_the_store_refuses_leaves_no_stuck_key(tmp_path: Path, route: str) -> None:
    require_conformance()
    home, log = tmp_path / "home", tmp_path / "serve.log"
    sp = serve(home, log)
    ended = "response.completed" if route == "responses" else "stop"
    try:
        c = client(sp)
        big = "x" * 200_000
        # A try the limit misses (the WAL started over at its beginning after all) keeps its
        # answer: then once more, in other conversations under other keys.
        for attempt in range(4):
            cal, one, key, seen = f"cal{attempt}", f"one{attempt}", f"k{attempt}", len(log.read_text())
            for conversation in (cal, one):  # two conversations alike: the first measures, the second is cut
                assert c.responses.create(
                    model="assistant", input=big, extra_headers={"X-Conversation-Id": conversation}
                )
            with wal_only_grows(home):
                before = files_size(home)
                assert recall(c, route, f"cal-{key}", cal) == (big, ended)
                wait_for(lambda k=f"cal-{key}": key_state(home, k) == "done")
                grown = files_size(home) - before
                kept = rows(home, "SELECT length(body) FROM http_idempotency WHERE key=?", f"cal-{key}")[0][0]
                assert kept > 150_000
                # room for everything of the request but half of its kept answer, its last write
                limit(sp, files_size(home) + grown - kept // 2)
                assert recall(c, route, key, one) == (big, ended)  # the client has it all
                # its end (the answer kept under its key) refused: one line (it was a traceback)
                wait_for(
                    lambda k=key, conv=one, at=seen: (
                        key_state(home, k) == "done"
                        or f"{CLOSED} {conv}" in log.read_text()
                        or "stream close handler failed" in log.read_text()[at:]
                    )
                )
                if key_state(home, key) == "done":
                    unlimit(sp)
                    continue
                assert key_state(home, key) == "pending"
            break
        else:
            pytest.fail("the file size limit never refused the stream's kept answer")
        unlimit(sp)
        turns = rows(home, "SELECT count(*) FROM turns")[0][0]
        t0 = time.monotonic()
        assert recall(client(sp, REPEAT_S), route, key, one) == (big, ended)
        assert time.monotonic() - t0 < REPEAT_S
        assert rows(home, "SELECT count(*) FROM turns")[0][0] == turns  # followed, not run again
        wait_for(lambda: key_state(home, key) == "done")
        assert log.read_text()[seen:].count(TAKEN) == 1
        assert log.read_text()[seen:].count(CLOSED) == 1
        no_traceback(log)
    finally:
        with contextlib.suppress(Exception):
            kill9(sp)
        sp.kill()
