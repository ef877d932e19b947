"""`appserver chat`'s input editor and escape sequences, against a real `appserver serve` (fix 20b):

* From a pipe an ESC swallowed the line end: `first ESC LF second LF` became ONE turn `firstsecond`,
  and `one ESC [ LF 2 LF /quit LF four LF` sent `oneuit` then `four` (the CSI ran on to the `u` of
  `/quit`: the script's /quit never happened, a line after it ran). An escape sequence now ends
  (is abandoned) at the first character that cannot be part of it (LF, CR and the other controls,
  anything non-ASCII, in a CSI anything outside 0x20-0x7E); that character is taken as itself.
* At a terminal a lone Escape key ate the next key (Esc then `hello` Enter sent `ello`; `abc` Esc
  Enter `def` Enter sent `abcdef`). An ESC that ends a read is the Escape key alone unless the next
  read comes at once and begins with `[` or `O`; arrow keys split across reads are still swallowed.
* A piped script's `/quit`, held while a turn ran, was taken as the answer (deny) to an approval
  that turn asked next, and the lines after it ran: it now leaves, as `/quit` typed at the prompt.
"""

from __future__ import annotations

import json
import re
import sqlite3
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cli import CLIResult, cli_env, run_cli
from tests.support.serve import ServeProcess, serving
from tests.test_chat_terminal import Pty

pytestmark = pytest.mark.timeout(120)

CONVERSATION = re.compile(r"in conversation (conv_\w+)")
Server = tuple[Path, dict[str, str], ServeProcess]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    home = tmp_path_factory.mktemp("chat_s20b") / "home"
    env = cli_env(home)
    assert run_cli(home, "agents", "create", "--name", "careful", "--tool", "clock=ask", env=env).code == 0
    with serving(home, env=env) as sp:
        yield home, env, sp


def piped_chat(home: Path, env: dict[str, str], stdin: str, *args: str) -> CLIResult:
    return run_cli(home, "chat", "--conversation", "new", *args, stdin=stdin, env=env)


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


# ------------------------------------------------------------------ 1. piped: ESC never eats a line end


def test_a_piped_esc_before_a_line_end_does_not_merge_lines(server: Server) -> None:
    home, env, _ = server
    r = piped_chat(home, env, "first\x1b\nsecond\n")
    assert r.code == 0, (r.code, r.out, r.err)
    assert user_texts(home, r.out) == ["first", "second"]


def test_an_unfinished_csi_does_not_eat_the_scripts_quit(server: Server) -> None:
    home, env, _ = server
    r = piped_chat(home, env, "one\x1b[\n2\n/quit\nfour\n")
    assert r.code == 0, (r.code, r.out, r.err)
    assert user_texts(home, r.out) == ["one", "2"]  # the /quit left: `four` never ran
    assert "echo: four" not in r.out, r.out


def test_escape_sequences_are_abandoned_at_what_cannot_be_part_of_them(server: Server) -> None:
    home, env, _ = server
    r = piped_chat(
        home,
        env,
        "a\x1b[1\u00e9b\n"  # non-ASCII ends a CSI and is text
        "c\x1b[12\x07d\n"  # a control ends it (and is dropped itself)
        "e\x1bO\u00e9f\n"  # non-ASCII after ESC O
        "g\x1b\x1b[Ah\n"  # ESC ends the sequence before it; the arrow is swallowed
        "i\x1b\r\n"  # CR LF after an ESC: the line end
        "j\x1b[\r\n"
        "k\x1b[1;5Al\x1bOPm\x1bxn\n"  # whole sequences are still swallowed (Ctrl-Up, F1, Alt-x)
        "/quit\n"
        "never\n",
    )
    assert r.code == 0, (r.code, r.out, r.err)
    assert user_texts(home, r.out) == ["a\u00e9b", "cd", "e\u00e9f", "gh", "i", "j", "klmn"]


def test_a_piped_quit_held_behind_a_turn_is_no_answer_to_its_approval(server: Server) -> None:
    """The script's next line after a turn that asks is `/quit`: it leaves (the call unanswered),
    as `/quit` typed at the approval prompt does; it used to deny the call and run `four`."""
    home, env, _ = server
    r = piped_chat(home, env, "/call clock {}\n/quit\nfour\n", "--agent", "careful")
    assert r.code == 0, (r.code, r.out, r.err)
    assert "approve? [y/N] /quit" in r.out, r.out
    assert user_texts(home, r.out) == ["/call clock {}"]
    assert "four" not in r.out.split("approve? [y/N]")[1], r.out
    # a script's answer is still the next line
    r = piped_chat(home, env, "/call clock {}\ny\nfour\n", "--agent", "careful")
    assert r.code == 0, (r.code, r.out, r.err)
    assert user_texts(home, r.out) == ["/call clock {}", "four"]
    assert "[clock completed:" in r.out and "echo: four" in r.out, r.out


# ------------------------------------------------------------------ 2. terminal: the Escape key alone


def test_a_lone_escape_key_at_a_terminal_eats_no_key(server: Server) -> None:
    home, env, _ = server
    chat = Pty([sys.executable, "-m", "appserver", "chat", "--conversation", "new"], env)
    try:
        chat.expect("you> ")
        chat.write("\x1b")  # Escape, then a pause: the next key is its own
        time.sleep(0.3)
        chat.write("hello\r")
        chat.expect("echo: hello")
        chat.expect("you> ")
        chat.write("abc\x1b")
        time.sleep(0.3)
        chat.write("\r")  # Enter after Escape
        chat.expect("echo: abc")
        chat.expect("you> ")
        chat.write("abc\x1b\r")  # in one read: the CR ends the sequence, and is Enter
        chat.expect("echo: abc")
        chat.expect("you> ")
        # arrow keys split across reads are still swallowed
        chat.write("p\x1b[")
        time.sleep(0.2)
        chat.write("Aq\x1bO")
        time.sleep(0.2)
        chat.write("Dr\x1b")
        time.sleep(0.005)  # the rest of the sequence comes at once
        chat.write("[Cs\r")
        chat.expect("echo: pqrs")
        chat.expect("you> ")
        chat.write("/quit\r")
        assert chat.wait() == 0
    finally:
        chat.kill()
    assert user_texts(home, chat.text()) == ["hello", "abc", "abc", "pqrs"]
