"""Issue 14.6: `appserver chat` used the way a person uses it: the real CLI in a pseudo-terminal
against a real `serve`, reading what ends up on the screen (a small VT model below: carriage
return, backspace, erase-to-end-of-line; colours stripped, but kept in the raw bytes to check
dimming)."""

from __future__ import annotations

import asyncio
import json
import os
import pty
import re
import select
import signal
import sqlite3
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from appserver.client import ProtocolClient
from tests.support.cli import ROOT, cli_env, run_cli
from tests.support.serve import ServeProcess, serving

pytestmark = pytest.mark.timeout(60)

DIM, RESET = "\x1b[2m", "\x1b[0m"
CSI = re.compile(r"\x1b\[([0-9;]*)([A-Za-z])")


def render_screen(raw: str) -> list[str]:
    """The lines a terminal would show for `raw` (enough VT100 for this client)."""
    lines: list[list[str]] = [[]]
    row = col = 0
    i = 0
    while i < len(raw):
        m = CSI.match(raw, i)
        if m:
            if m.group(2) == "K":
                del lines[row][col:]
            i = m.end()
            continue
        ch = raw[i]
        i += 1
        if ch == "\r":
            col = 0
        elif ch == "\n":
            row += 1
            if row == len(lines):
                lines.append([])
        elif ch == "\b":
            col = max(0, col - 1)
        elif ch >= " ":
            line = lines[row]
            line.extend(" " * (col - len(line)))
            if col < len(line):
                line[col] = ch
            else:
                line.append(ch)
            col += 1
    return ["".join(x).rstrip() for x in lines]


class Pty:
    """A command on a pseudo-terminal: write keys, wait for text, read the screen."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        pid, fd = pty.fork()
        if pid == 0:  # child
            os.chdir(ROOT)
            os.execvpe(argv[0], argv, env)
        self.pid, self.fd = pid, fd
        self.raw = b""
        self.pos = 0  # expect() searches from here
        self.status: int | None = None

    def write(self, data: str) -> None:
        os.write(self.fd, data.encode())

    def _read(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return True
        try:
            chunk = os.read(self.fd, 65536)
        except OSError:
            chunk = b""
        self.raw += chunk
        return bool(chunk)

    def expect(self, needle: str, timeout: float = 15) -> str:
        """Wait until `needle` appears after what earlier expects consumed; returns the text up to it."""
        deadline = time.monotonic() + timeout
        while (i := self.raw.find(needle.encode(), self.pos)) < 0:
            left = deadline - time.monotonic()
            if left <= 0 or not self._read(left):
                raise AssertionError(f"{needle!r} not seen; screen:\n" + "\n".join(self.screen()))
        seen = self.raw[self.pos : i + len(needle)].decode(errors="replace")
        self.pos = i + len(needle)
        return seen

    def settle(self, quiet: float = 0.3) -> None:
        """Read until the program has printed nothing for `quiet` seconds."""
        deadline = time.monotonic() + 5
        before = -1
        while len(self.raw) != before and time.monotonic() < deadline:
            before = len(self.raw)
            self._read(quiet)

    def screen(self) -> list[str]:
        return render_screen(self.raw.decode(errors="replace"))

    def text(self) -> str:
        return self.raw.decode(errors="replace")

    def wait(self, timeout: float = 10) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = os.waitstatus_to_exitcode(status)
                return self.status
            self._read(0.05)
        raise AssertionError("the program did not exit; screen:\n" + "\n".join(self.screen()))

    def kill(self) -> None:
        if self.status is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
            self.status = -9
        try:
            os.close(self.fd)
        except OSError:
            pass


def rows(home: Path, sql: str) -> list[tuple[Any, ...]]:
    db = sqlite3.connect(f"file:{home / 'appserver.db'}?mode=ro", uri=True, timeout=5)
    try:
        return db.execute(sql).fetchall()
    finally:
        db.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, str], ServeProcess]]:
    """One server for this module's sessions (each test uses its own agent and conversation)."""
    home = tmp_path_factory.mktemp("chat") / "home"
    env = cli_env(home)
    assert run_cli(home, "agents", "create", "--name", "careful", "--tool", "clock=ask", env=env).code == 0
    with serving(home, env=env) as sp:
        yield home, env, sp


async def answer_elsewhere(url: str, conv: str) -> tuple[str, dict[str, Any]]:
    """Another client of the conversation (a second WebSocket connection) approves its pending call."""
    async with await ProtocolClient.connect(url, client="other-client") as other:
        state = await other.request({"type": "subscribe", "conversation": conv})
        call_id = state["pending_approvals"][0]["call_id"]
        return call_id, await other.request(
            {
                "type": "approval_response",
                "conversation": conv,
                "decisions": [{"call_id": call_id, "decision": "approve"}],
            }
        )


def test_chat_commands_typeahead_and_reasoning(server: tuple[Path, dict[str, str], ServeProcess]) -> None:
    home, env, sp = server
    chat = Pty([sys.executable, "-m", "appserver", "chat"], env)
    try:
        banner = chat.expect("you> ")
        assert all(c in banner for c in ("/help", "/new", "/cancel", "/quit")), banner
        chat.write("/help\n")  # a client command: answered here, never sent to the model
        chat.expect("start a new conversation")
        chat.expect("you> ")
        chat.write("/think a secret plan\n")  # reasoning is hidden by default
        chat.expect("done thinking")
        chat.expect("you> ")
        chat.write("/slow 30\n")
        chat.expect("w3 ")
        chat.write("typed ahead\npart")  # typed while the reply streams: a whole line and a partial one
        chat.expect("w30")
        chat.expect("echo: typed ahead")  # the whole line ran after the turn
        chat.expect("you> ")
        chat.settle()
        screen = chat.screen()
        assert (
            "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12 w13 w14 w15 "
            "w16 w17 w18 w19 w20 w21 w22 w23 w24 w25 w26 w27 w28 w29 w30" in screen
        ), screen
        assert "you> typed ahead" in screen and screen[-1] == "you> part", screen  # kept, shown at the prompt
        assert chat.text().count("a secret plan") == 1 and "thinking:" not in chat.text()  # only as typed
        chat.write("\x15/quit\n")  # Ctrl-U clears the partial line
        assert chat.wait() == 0
    finally:
        chat.kill()
    users = [
        json.loads(c)
        for (c,) in rows(
            home,
            "SELECT m.content FROM messages m JOIN conversations c ON c.id = m.conversation_id "
            "JOIN agents a ON a.id = c.agent_id WHERE a.name='assistant' AND m.role='user' ORDER BY m.id",
        )
    ]
    assert users == ["/think a secret plan", "/slow 30", "typed ahead"], users  # no /help, no "part"

    shown = Pty([sys.executable, "-m", "appserver", "chat", "--show-reasoning"], env)
    try:
        shown.expect("you> ")
        shown.write("/think another plan\n")
        out = shown.expect("done thinking")
        shown.expect("you> ")
        assert f"{DIM}thinking: {RESET}{DIM}another plan{RESET}" in out, repr(out)
        assert out.rsplit("done thinking", 1)[0].rstrip("\r\n").endswith(RESET), repr(out)  # the reply is not dimmed
        shown.write("\x04")  # Ctrl-D leaves
        assert shown.wait() == 0
    finally:
        shown.kill()


def test_chat_approval_prompt_clears_when_answered_elsewhere_and_ctrl_c_cancels_alone(
    server: tuple[Path, dict[str, str], ServeProcess],
) -> None:
    home, env, sp = server
    chat = Pty([sys.executable, "-m", "appserver", "chat", "--agent", "careful"], env)
    try:
        banner = chat.expect("you> ")
        conv = re.search(r"conversation (conv_\w+)", banner).group(1)  # type: ignore[union-attr]
        chat.write("/call clock {}\n")
        chat.expect("approve? [y/N] ")
        # another client answers; nothing is typed into chat
        call_id, ack = asyncio.run(answer_elsewhere(sp.url, conv))
        assert ack["results"][0]["accepted"], ack
        chat.expect(f"{call_id} approved by other-client")
        chat.expect("clock -> 20")
        chat.expect("you> ")
        chat.settle()
        assert not any("approve? [y/N]" in line for line in chat.screen()), chat.screen()  # the prompt went away

        chat.write("/call clock {}\n")
        chat.expect("approve? [y/N] ")
        chat.write("\x03")  # Ctrl-C at the prompt, no Enter: the turn is cancelled at once
        chat.expect("[cancelled]", timeout=5)
        chat.expect("you> ")
        chat.write("/quit\n")
        assert chat.wait() == 0
    finally:
        chat.kill()
    # alone: the call was not denied on the way (no deny + cancel pair); its result says it was stopped
    ((second,),) = rows(
        home, f"SELECT call_id FROM pending_calls WHERE conversation_id='{conv}' AND call_id != '{call_id}'"
    )
    status, decided_by = rows(home, f"SELECT status, decided_by FROM pending_calls WHERE call_id='{second}'")[0]
    assert status != "denied" and decided_by in (None, ""), (status, decided_by)
    results = [
        json.loads(c)
        for (c,) in rows(home, f"SELECT content FROM messages WHERE role='tool' AND tool_call_id='{second}'")
    ]
    assert len(results) == 1 and "denied" not in results[0].lower(), results
    assert rows(home, f"SELECT status FROM turns WHERE conversation_id='{conv}' ORDER BY created_at DESC LIMIT 1") == [
        ("cancelled",)
    ]


def test_approval_prompt_of_a_watching_chat_goes_away_when_another_chat_cancels(
    server: tuple[Path, dict[str, str], ServeProcess],
) -> None:
    """Two terminals on one conversation; the one that submitted presses Ctrl-C at the approval
    prompt. The other one's prompt is taken off the screen before the call's outcome is drawn (a
    cancelled turn shows its call as failed one snapshot before it leaves `awaiting`)."""
    home, env, sp = server
    made = run_cli(home, "run", "--agent", "careful", "--conversation", "new", "--json", "hi", env=env)
    assert made.code == 0, made.err
    conv = json.loads(made.out)["conversation_id"]
    a = Pty([sys.executable, "-m", "appserver", "chat", "--agent", "careful", "--conversation", conv], env)
    b = Pty([sys.executable, "-m", "appserver", "chat", "--agent", "careful", "--conversation", conv], env)
    try:
        a.expect("you> ")
        b.expect("you> ")
        a.write("/call clock {}\n")
        a.expect("approve? [y/N] ")
        b.expect("approve? [y/N] ")
        a.write("\x03")
        a.expect("[cancelled]", timeout=5)
        b.expect("[cancelled]", timeout=5)
        b.expect("you> ")
        b.settle()
        screen = b.screen()
        assert not any("approve? [y/N]" in line for line in screen), screen
        assert screen[-1] == "you>", screen
        a.write("/quit\n")
        b.write("/quit\n")
        assert a.wait() == 0 and b.wait() == 0
    finally:
        a.kill()
        b.kill()


def test_chat_conversation_new_starts_one_like_run_does(server: tuple[Path, dict[str, str], ServeProcess]) -> None:
    home, env, sp = server
    chat = Pty([sys.executable, "-m", "appserver", "chat", "--conversation", "new"], env)
    try:
        banner = chat.expect("you> ")
        conv = re.search(r"conversation (conv_\w+)", banner).group(1)  # type: ignore[union-attr]
        chat.write("/recall\n")
        chat.expect("(nothing)")  # a fresh conversation
        chat.expect("you> ")
        chat.write("/quit\n")
        assert chat.wait() == 0
    finally:
        chat.kill()
    assert rows(home, f"SELECT count(*) FROM conversations WHERE id='{conv}'") == [(1,)]
