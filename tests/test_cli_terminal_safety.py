"""Text from elsewhere never controls the user's terminal.

Another client wrote escape sequences into a conversation (`appserver run --conversation new
$'\\e]0;PWNED-TITLE\\a\\e]52;c;…\\a\\e[2J\\e[31m…'`); `appserver chat` then printed them raw when the
echo model repeated them (`/recall`): the terminal's title was set, its clipboard written, the screen
cleared and recoloured. `conversations history` and `run` printed them raw too, and a tool call's
arguments at chat's approval prompt could hide or reorder themselves (CR, ESC, bidi overrides).

Now the CLI shows such controls as escapes (`\\x1b`, `\\x0d`, `\\x9b`, appserver/cli/safetext.py); its
own styling (dimmed reasoning, erase-line) still works, and `--json` keeps every value exact.
"""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from appserver.cli.chat import Chat, Renderer, Screen
from appserver.cli.safetext import exact, json_text, visible
from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, serving
from tests.support.zygote_client import appserver_popen
from tests.test_chat_terminal import Pty

pytestmark = pytest.mark.timeout(90)

# What another client writes into the conversation: OSC 0 (title), OSC 52 (clipboard), CSI 2J (clear),
# CSI 31m (red), the 8-bit CSI (U+009B), a bare CR and a backspace that draw over the line, a BEL.
EVIL = "\x1b]0;PWNED-TITLE\x07\x1b]52;c;cm0gLXJmIH4K\x07\x1b[2J\x1b[31mfake-red \x9b2Jc1 x\rOVERWRITE\x08!"
SHOWN = (
    r"\x1b]0;PWNED-TITLE\x07",
    r"\x1b]52;c;cm0gLXJmIH4K\x07",
    r"\x1b[2J",
    r"\x1b[31mfake-red",
    r"\x9b2Jc1",
    r"x\x0dOVERWRITE\x08!",
)
# The client's own styling: dim, reset, erase to the end of the line, bracketed paste on and off.
OWN = re.compile(rb"\x1b\[(2|0)m|\x1b\[K|\x1b\[\?2004[hl]")
C1 = re.compile(rb"\xc2[\x80-\x9f]")  # U+0080..U+009F in UTF-8


def assert_no_foreign_controls(raw: bytes) -> None:
    """No ESC but the client's own, no BEL, no C1 control, no backspace in what reached the terminal."""
    rest = OWN.sub(b"", raw)
    assert b"\x1b" not in rest, raw
    assert b"\x07" not in rest and b"\x08" not in rest, raw
    assert not C1.search(rest), raw


def assert_shown(text: str) -> None:
    for form in SHOWN:
        assert form in text, (form, text)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, str], ServeProcess, str]]:
    """A server, an agent that asks before `clock`, and a conversation another client filled with EVIL."""
    home = tmp_path_factory.mktemp("safety") / "home"
    env = cli_env(home)
    assert run_cli(home, "agents", "create", "--name", "careful", "--tool", "clock=ask", env=env).code == 0
    with serving(home, env=env) as sp:
        made = run_cli(home, "run", "--json", "--conversation", "new", EVIL, env=env)
        assert made.code == 0, made.err
        yield home, env, sp, json.loads(made.out)["conversation_id"]


def test_visible_and_exact_show_controls_and_keep_text() -> None:
    assert visible("a\tb\nc\r\nd\re\x1b[2J\x7f\x9b\x00") == "a\tb\nc\nd\\x0de\\x1b[2J\\x7f\\x9b\\x00"
    assert visible("héllo → 世界 \u202e") == "héllo → 世界 \u202e"  # text (bidi too) stays as it is
    assert visible(None) == "None"
    assert exact('{"a":\n\t"\u202eb\u2066"}\x1b') == '{"a":\\x0a\\x09"\\u202eb\\u2066"}\\x1b'
    dumped = json.dumps({"t": "\x1b\x7f\x9b\u202e"}, ensure_ascii=False)
    assert json.loads(json_text(dumped)) == {"t": "\x1b\x7f\x9b\u202e"}  # the same value
    assert "\x9b" not in json_text(dumped) and "\x7f" not in json_text(dumped)


def test_renderer_shows_reasoning_text_and_tool_lines_safely(monkeypatch: pytest.MonkeyPatch) -> None:
    """chat's renderer, with --show-reasoning and colour: the dimming is its own, the rest is shown."""
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    r = Renderer(Screen(color=True, ansi=True), show_reasoning=True)
    r.snapshot(
        {
            "status": "running",
            "blocks": [{"type": "reasoning", "text": "\x1b]0;T\x07plan"}, {"type": "text", "text": "one\r"}],
        }
    )
    r.snapshot(
        {
            "status": "running",
            "blocks": [
                {"type": "reasoning", "text": "\x1b]0;T\x07plan"},
                {"type": "text", "text": "one\r\ntwo\x9b"},
                {
                    "type": "tool_call",
                    "status": "completed",
                    "name": "clock\u202e",
                    "arguments": "{}",
                    "output": "ok\n\x1b[2Jdone",
                },
            ],
        }
    )
    r.end({"status": "failed", "error": {"message": "boom\x1b[31m"}})
    shown = out.getvalue()
    assert "\x1b[2mthinking: \x1b[0m\x1b[2m\\x1b]0;T\\x07plan\x1b[0m" in shown, repr(shown)
    assert "one\ntwo\\x9b" in shown, repr(shown)  # the CRLF split across snapshots is a line end
    assert "\x1b[2m[clock\\u202e completed: ok \\x1b[2Jdone]\x1b[0m" in shown, repr(shown)
    assert "[failed: boom\\x1b[31m]" in shown, repr(shown)
    assert_no_foreign_controls(shown.encode())


def test_approval_prompt_text_shows_controls_between_json_tokens() -> None:
    """CR is JSON whitespace: `{"cmd": "rm -rf ~",\\r"x": "ls"}` would draw `"x": "ls"` over the command."""
    chat = Chat(None, "a", "a", "c", Screen(color=False, ansi=True), None, False, None)  # type: ignore[arg-type]
    frame = {"call_id": "call_1\x1b[8m", "name": "shell\u202e", "arguments": '{"cmd": "rm -rf ~",\r\n"x": "ls"}'}
    assert chat.approval_prompt(frame) == (
        r'[call_1\x1b[8m] shell\u202e({"cmd": "rm -rf ~",\x0d\x0a"x": "ls"}) wants to run. approve? [y/N] '
    )


def test_chat_recall_of_another_clients_escape_codes_reaches_the_terminal_as_text(
    served: tuple[Path, dict[str, str], ServeProcess, str],
) -> None:
    home, env, sp, conv = served
    chat = Pty([sys.executable, "-m", "appserver", "chat", "--conversation", conv], env)
    try:
        chat.expect("you> ")
        chat.write("/recall\n")
        chat.expect("OVERWRITE")
        chat.expect("you> ")
        chat.write("/quit\n")
        assert chat.wait() == 0
    finally:
        chat.kill()
    assert_no_foreign_controls(chat.raw)
    assert_shown(chat.text())
    assert b"\x1b[2m" in chat.raw  # the client's own dimming still works (the banner's command line)


def test_history_and_run_text_show_controls_but_json_is_exact(
    served: tuple[Path, dict[str, str], ServeProcess, str],
) -> None:
    home, env, sp, conv = served
    for argv in (["conversations", "history", conv], ["run", "--conversation", conv, "/recall"]):
        on_tty = Pty([sys.executable, "-m", "appserver", *argv], env)  # a terminal: what the user sees
        try:
            assert on_tty.wait(30) == 0, on_tty.text()
        finally:
            on_tty.kill()
        assert_no_foreign_controls(on_tty.raw)
        assert_shown(on_tty.text())
        piped = run_cli(home, *argv, env=env)  # a pipe (`| less -R`, a log): the same text
        assert piped.code == 0, piped.err
        assert_no_foreign_controls(piped.out.encode())
        assert_shown(piped.out)

    as_json = run_cli(home, "run", "--json", "--conversation", conv, "/recall", env=env)
    assert as_json.code == 0, as_json.err
    assert EVIL in as_json.json()["text"]  # the exact value
    assert "\x9b" not in as_json.out and "\x1b" not in as_json.out  # escaped as JSON, never raw
    history = run_cli(home, "conversations", "history", conv, "--json", env=env)
    assert history.code == 0, history.err
    assert history.json()[0]["content"] == EVIL  # the first message, as another client wrote it
    assert "\x9b" not in history.out and "\x1b" not in history.out


def test_approval_prompt_shows_a_tool_call_exactly(served: tuple[Path, dict[str, str], ServeProcess, str]) -> None:
    """Another client's call waits for approval in the chat: bidi controls in its arguments (valid
    JSON, so the call is asked about) cannot reorder what the prompt says; CR and ESC, which a real
    model may put between JSON tokens, are the next test's."""
    home, env, sp, _ = served
    made = run_cli(home, "run", "--agent", "careful", "--conversation", "new", "--json", "hi", env=env)
    assert made.code == 0, made.err
    conv = made.json()["conversation_id"]
    args = '{"cmd":\t"rm -rf ~/important \u202e\u2066txt.gol\u2069"}'  # valid JSON (else refused unasked)
    chat = Pty([sys.executable, "-m", "appserver", "chat", "--agent", "careful", "--conversation", conv], env)
    other: subprocess.Popen[str] | None = None
    try:
        chat.expect("you> ")
        other = appserver_popen(
            ["run", "--agent", "careful", "--conversation", conv, f"/call clock {args}"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        prompt = chat.expect("approve? [y/N] ")
        chat.write("n\n")
        chat.expect("you> ")
        out, err = other.communicate(timeout=30)
        chat.write("/quit\n")
        assert chat.wait() == 0
    finally:
        chat.kill()
        if other is not None and other.poll() is None:
            other.kill()
            other.wait()
    shown = r'{"cmd": "rm -rf ~/important \u202e\u2066txt.gol\u2069"}'  # the canonical form of what runs
    assert f"clock({shown}) wants to run" in prompt, repr(prompt)
    assert_no_foreign_controls(chat.raw)
    for ch in ("\u202e", "\u2066", "\u2069"):
        assert ch not in chat.text(), repr(chat.text())
    assert_no_foreign_controls((out + err).encode())


def test_an_error_line_carrying_the_servers_words_shows_their_controls(
    served: tuple[Path, dict[str, str], ServeProcess, str],
) -> None:
    """The server's refusal repeats the call id it was given (`no pending call … in this
    conversation`): the one error line (`fail`) shows its controls."""
    home, env, sp, _ = served
    asked = run_cli(home, "run", "--agent", "careful", "--conversation", "new", "--json", "/call clock {}", env=env)
    assert asked.code == 0 and asked.json()["status"] == "awaiting", (asked.out, asked.err)
    conv = asked.json()["conversation_id"]
    argv = ["run", "--agent", "careful", "--conversation", conv, "--approve", "call_\x1b]0;T\x07\x9b2J"]
    refused = Pty([sys.executable, "-m", "appserver", *argv], env)
    try:
        assert refused.wait(30) == 2, refused.text()
    finally:
        refused.kill()
    assert "error: no pending call call_\\x1b]0;T\\x07\\x9b2J in this conversation" in refused.text(), refused.text()
    assert_no_foreign_controls(refused.raw)


def test_history_with_a_damaged_text_is_shown_not_a_traceback(tmp_path: Path) -> None:
    """A stored text holding a lone surrogate (a damaged or hand-edited store): the history
    crashed with a UnicodeEncodeError traceback, as text and as JSON. It is shown escaped."""
    import sqlite3

    home = tmp_path / "home"
    env = cli_env(home)
    ran = run_cli(home, "run", "--json", "hello", env=env)
    assert ran.code == 0, ran.err
    conv = json.loads(ran.out)["conversation_id"]
    with sqlite3.connect(home / "appserver.db") as db:
        db.execute("UPDATE messages SET content = ? WHERE role = 'assistant'", ('"echo: \\ud800 hello"',))
    text = run_cli(home, "conversations", "history", conv, env=env)
    assert text.code == 0 and "Traceback" not in text.err, text.err
    assert "echo: \\ud800 hello" in text.out, text.out
    as_json = run_cli(home, "conversations", "history", conv, "--json", env=env)
    assert as_json.code == 0 and "Traceback" not in as_json.err, as_json.err
    assert "\\ud800" in as_json.out and "echo: \ud800 hello" in json.dumps(json.loads(as_json.out), ensure_ascii=False)
