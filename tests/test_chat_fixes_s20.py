"""`appserver chat` and the protocol client, against a real `appserver serve` (fix 20):

* `chat` dropped what it typed unless `str.isprintable()`: ZWNJ (Persian `می‌خواهم` became
  `میخواهم`), ZWJ (emoji sequences broke), no-break space, zero-width space, combining marks; a tab
  became a space. Only controls are keys of the editor (C0 but tab, DEL, C1, escape sequences);
  every other character is text, sent exactly, from a pipe and at a terminal (LineEditor.take).
* From a pipe a bare CR ended a line (one line became two turns): lines end at LF or CRLF there, a
  lone CR is text; at a terminal CR stays Enter. A Ctrl-D byte in piped input at a line's start
  was taken for the end of the input (an approval asked after it was denied, "no input left"): only
  the pipe's end ends it, and a CR at its very end is text too.
* Piped `chat` exited 0 after refusing and dropping a line (`error: line too long: …`): lost input,
  so exit 1 at the end, after running the other lines.
* The client wrote frames with `ensure_ascii`: each non-ASCII character cost 6 bytes, so non-ASCII
  text was refused at about a third of the server's limit. Frames are now UTF-8 and measured in
  those bytes, as the server measures them; a lone surrogate is still sent (as its JSON escape).
* WS `client_tools[].name` took `.` (and so a name the upstream APIs refuse, failing the turn after
  it began): it follows the HTTP front end's rule, `^[a-zA-Z0-9_-]{1,64}$`, with `bad_frame`.
"""

from __future__ import annotations

import asyncio
import json
import re
import sqlite3
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from appserver.client import ProtocolClient, ProtocolError, encode_frame
from tests.support.cli import CLIResult, cli_env, run_cli
from tests.support.serve import ServeProcess, serving
from tests.test_chat_terminal import Pty

pytestmark = pytest.mark.timeout(120)

FRAME_MAX = 64 * 1024
CONVERSATION = re.compile(r"in conversation (conv_\w+)")

PERSIAN = "می\u200cخواهم"  # "I want", with its ZERO WIDTH NON-JOINER
FAMILY = "\U0001f468\u200d\U0001f469\u200d\U0001f467"  # one emoji: three joined by ZWJ
INVISIBLE = "a\u00a0b\u200bc\td e\u0301 \u200fok\u2028x\ue000"  # NBSP, ZWSP, tab, combining, RLM, LS, private use


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, str], ServeProcess]]:
    home = tmp_path_factory.mktemp("chat_s20") / "home"
    env = cli_env(home, APPSERVER_LIMITS__WS_FRAME_MAX_BYTES=str(FRAME_MAX))
    with serving(home, env=env) as sp:
        yield home, env, sp


def piped_chat(home: Path, env: dict[str, str], stdin: str) -> CLIResult:
    return run_cli(home, "chat", "--conversation", "new", stdin=stdin, env=env)


def user_texts(home: Path, out: str) -> list[str]:
    """What the server stored as the user's inputs in the conversation `chat` said it chats in."""
    found = CONVERSATION.search(out)
    assert found, out
    db = sqlite3.connect(f"file:{home / 'appserver.db'}?mode=ro", uri=True, timeout=5)
    try:
        rows = db.execute(
            "SELECT content FROM messages WHERE conversation_id=? AND role='user' ORDER BY id", (found.group(1),)
        ).fetchall()
    finally:
        db.close()
    return [json.loads(r[0]) for r in rows]


# ------------------------------------------------------------------ 1. invisible characters are text


def test_piped_chat_sends_invisible_characters_exactly(server: tuple[Path, dict[str, str], ServeProcess]) -> None:
    home, env, _ = server
    r = piped_chat(home, env, f"{PERSIAN}\n{FAMILY}\n{INVISIBLE}\n")
    assert r.code == 0, (r.code, r.out, r.err)
    assert user_texts(home, r.out) == [PERSIAN, FAMILY, INVISIBLE]
    # `run` stores the same strings: chat now agrees with it
    ran = run_cli(home, "run", "--conversation", "new", "--json", INVISIBLE, env=env)
    assert ran.code == 0, ran.err
    assert ran.json()["blocks"][-1]["text"] == f"echo: {INVISIBLE}"


def test_piped_chat_still_drops_controls_and_escape_sequences(
    server: tuple[Path, dict[str, str], ServeProcess],
) -> None:
    """Controls are no text: C0 (but tab), DEL as Backspace, C1, and an arrow key's escape sequence."""
    home, env, _ = server
    r = piped_chat(home, env, "a\x01b\x1b[Ac\x9bd\x07e\n")
    assert r.code == 0, (r.code, r.out, r.err)
    assert user_texts(home, r.out) == ["abcde"]


def test_invisible_characters_typed_at_a_terminal_are_sent_exactly(
    server: tuple[Path, dict[str, str], ServeProcess],
) -> None:
    home, env, _ = server
    chat = Pty([sys.executable, "-m", "appserver", "chat", "--conversation", "new"], env)
    try:
        chat.expect("you> ")
        for line in (PERSIAN, FAMILY, INVISIBLE):
            chat.write(line + "\r")  # Enter
            chat.expect("echo: ")
            chat.expect("you> ")
        chat.write("ab\u0301\x7fc\r")  # Backspace takes the combining mark back, not the `b`
        chat.expect("echo: abc")
        chat.expect("you> ")
        chat.write("first\rsecond\r")  # at a terminal CR is Enter: two lines
        chat.expect("echo: second")
        chat.expect("you> ")
        chat.write("/quit\r")
        assert chat.wait() == 0
    finally:
        chat.kill()
    assert user_texts(home, chat.text()) == [PERSIAN, FAMILY, INVISIBLE, "abc", "first", "second"]


# ------------------------------------------------------------------ 4. CR in piped input


def test_a_bare_cr_in_a_piped_line_is_text_and_crlf_ends_a_line(
    server: tuple[Path, dict[str, str], ServeProcess],
) -> None:
    home, env, _ = server
    r = piped_chat(home, env, "part one\rpart two\nwindows line\r\nlast\r\r\n")
    assert r.code == 0, (r.code, r.out, r.err)
    assert user_texts(home, r.out) == ["part one\rpart two", "windows line", "last\r"]
    assert "\r" not in r.out, r.out  # shown, never acted on: `\x0d`
    assert "part one\\x0dpart two" in r.out, r.out


def test_a_ctrl_d_byte_in_piped_input_does_not_end_it(server: tuple[Path, dict[str, str], ServeProcess]) -> None:
    """Only the end of the pipe ends the input; an input ending in a bare CR still ends."""
    home, env, _ = server
    r = piped_chat(home, env, "first\n\x04second\nthird\r")
    assert r.code == 0, (r.code, r.out, r.err)
    assert user_texts(home, r.out) == ["first", "second", "third\r"]


# ------------------------------------------------------------------ 2. a dropped line is lost input


def test_piped_chat_exits_1_after_dropping_a_line_too_long(server: tuple[Path, dict[str, str], ServeProcess]) -> None:
    home, env, _ = server
    for tail in ("after\n", "after\n/quit\n"):
        r = piped_chat(home, env, "before\n" + "x" * (FRAME_MAX + 10) + "\n" + tail)
        assert r.code == 1, (tail, r.code, r.out[-2000:], r.err)
        assert "error: line too long:" in r.out, r.out[-2000:]
        assert "echo: before" in r.out and "echo: after" in r.out, r.out[-2000:]  # every other line ran
        assert "Traceback" not in r.err, r.err
    ok = piped_chat(home, env, "before\nafter\n")
    assert ok.code == 0, (ok.code, ok.out, ok.err)


# ------------------------------------------------------------------ 3. the frame limit counts UTF-8 bytes


def test_a_non_ascii_line_up_to_the_limit_in_utf8_bytes_is_sent(
    server: tuple[Path, dict[str, str], ServeProcess],
) -> None:
    """40,000 UTF-8 bytes of `é` (120,000 bytes as `\\u00e9` escapes) fit a 64 KiB frame."""
    home, env, _ = server
    line = "é" * 20_000
    r = piped_chat(home, env, line + "\n")
    assert r.code == 0, (r.code, r.out[-500:], r.err)
    assert "line too long" not in r.out
    assert user_texts(home, r.out) == [line]
    too_big = piped_chat(home, env, "é" * 40_000 + "\n")  # 80,000 bytes: over, and said in UTF-8 bytes
    assert too_big.code == 1, (too_big.code, too_big.err)
    size = int(re.search(r"frame would be ([\d,]+) bytes", too_big.out).group(1).replace(",", ""))  # type: ignore[union-attr]
    assert 80_000 < size < 80_500, too_big.out[-500:]


def test_the_client_measures_a_frame_as_the_server_does(server: tuple[Path, dict[str, str], ServeProcess]) -> None:
    """A frame of exactly the server's limit in UTF-8 bytes is sent and taken; one byte more is
    refused by the client, unsent (the connection goes on). A lone surrogate still goes out."""
    _, _, sp = server

    def frame(chars: int, extra: str = "") -> dict[str, Any]:
        return {
            "type": "submit_input",
            "agent": "assistant",
            "conversation": "new",
            "input": "ж" * chars + extra,
            "request_id": "exact",
        }

    base = encode_frame(frame(0))[1]
    chars, odd = divmod(FRAME_MAX - base, 2)  # `ж` is 2 bytes; an ASCII byte makes up an odd rest
    exact = frame(chars, "x" * odd)
    text, size = encode_frame(exact)
    assert size == len(text.encode("utf-8")) == FRAME_MAX and "\\u" not in text

    async def go() -> None:
        async with await ProtocolClient.connect(sp.url) as c:
            assert c.max_frame_bytes == FRAME_MAX
            ack = await c.request(exact)
            assert ack["type"] == "ack", ack
            with pytest.raises(ProtocolError) as refused:
                await c.request(frame(chars, "x" * (odd + 1)))
            assert refused.value.code == "frame_too_large", refused.value
            assert f"{FRAME_MAX + 1:,} bytes" in refused.value.message
            try:  # a lone surrogate: no UnicodeEncodeError, the server answers it
                await c.request(frame(1, "\ud800"))
            except ProtocolError as exc:
                assert exc.code != "frame_too_large", exc
            assert (await c.request({"type": "ping"}))["type"] == "pong"  # still connected

    asyncio.run(go())
    assert (
        encode_frame({"t": "a\ud83d\ude00b"})[0] == '{"t": "a\\ud83d\\ude00b"}'
    )  # surrogates escaped, as JSON has them


# ------------------------------------------------------------------ 5. client tool names


def test_ws_client_tool_names_follow_the_function_name_rule(server: tuple[Path, dict[str, str], ServeProcess]) -> None:
    _, _, sp = server

    async def submit(name: str) -> dict[str, Any]:
        async with await ProtocolClient.connect(sp.url) as c:
            return await c.submit(
                "assistant", "hi", "new", client_tools=[{"name": name, "description": "", "parameters": {}}]
            )

    async def go() -> None:
        for bad in ("msg.send", "a b", "", "ä", "x" * 65):
            with pytest.raises(ProtocolError) as refused:
                await submit(bad)
            assert refused.value.code == "bad_frame", (bad, refused.value)
            assert refused.value.param == "client_tools[0].name", (bad, refused.value.param)
            assert "^[a-zA-Z0-9_-]{1,64}$" in refused.value.message, refused.value.message
        for good in ("msg_send", "Send-Message9", "x" * 64):
            assert (await submit(good))["type"] == "ack", good

    asyncio.run(go())
