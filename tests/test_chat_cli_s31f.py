"""Session 31 (f): `appserver chat` at a terminal, driven in a pseudo-terminal against a real `serve`.

* `/cancel` at an idle prompt sent a `cancel` naming no turn: the server stopped whatever turn of
  the conversation ran, another client's that chat never showed, and chat said nothing.
* A prompt (or a typed line) that wraps over several rows was erased one row only: the rows above
  stayed on screen (an approval prompt drawn again above an answered call's line; Ctrl-U,
  Backspace and Ctrl-W left text on screen that the line no longer held).
* A paste of several lines ran as several turns, and a pasted `/new` or `/quit` as a command.

The screen is read through a small VT100 model of an 80- or 40-column terminal below (autowrap with
the pending wrap at a row's end, CR, LF, BS, erase in line and display, cursor up).
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import re
import signal
import struct
import sys
import termios
from collections.abc import Iterator
from pathlib import Path

import pytest

from appserver.client import ProtocolClient
from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, serving
from tests.support.wait import wait_until
from tests.test_chat_terminal import Pty, rows

pytestmark = pytest.mark.timeout(60)

CSI = re.compile(r"\x1b\[([?0-9;]*)([@-~])")
PASTE_ON, PASTE_OFF = "\x1b[?2004h", "\x1b[?2004l"
PASTE_START, PASTE_END = "\x1b[200~", "\x1b[201~"


def render(raw: str, columns: int) -> list[str]:
    """The rows a terminal `columns` wide shows for `raw` (the history as one tall screen)."""
    grid: list[list[str]] = [[]]
    row = col = 0
    pending_wrap = False  # the last column was written: the next character goes to the next row

    def down() -> None:
        nonlocal row
        row += 1
        while len(grid) <= row:
            grid.append([])

    i = 0
    while i < len(raw):
        m = CSI.match(raw, i)
        if m:
            i = m.end()
            params, final = m.groups()
            if final == "K":
                del grid[row][col:]
            elif final == "J":
                del grid[row][col:]
                del grid[row + 1 :]
            elif final == "A":
                row = max(0, row - (int(params) if params.isdigit() else 1))
            pending_wrap = False
            continue
        ch = raw[i]
        i += 1
        if ch == "\r":
            col, pending_wrap = 0, False
        elif ch == "\n":
            down()
            pending_wrap = False
        elif ch == "\b":
            col, pending_wrap = max(0, col - 1), False  # never to the row above
        elif ch >= " ":
            if pending_wrap:
                down()
                col, pending_wrap = 0, False
            line = grid[row]
            line.extend(" " * (col + 1 - len(line)))
            line[col] = ch
            if col == columns - 1:
                pending_wrap = True
            else:
                col += 1
    return ["".join(x).rstrip() for x in grid]


class SizedPty(Pty):
    """`Pty` on a terminal of a given size (chat asks for the width when it draws)."""

    def __init__(self, argv: list[str], env: dict[str, str], columns: int, lines: int = 24) -> None:
        super().__init__(argv, env)
        self.columns = columns
        fcntl.ioctl(self.fd, termios.TIOCSWINSZ, struct.pack("HHHH", lines, columns, 0, 0))

    def rendered(self) -> list[str]:
        return render(self.text(), self.columns)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, str], ServeProcess]]:
    home = tmp_path_factory.mktemp("chat31f") / "home"
    env = cli_env(home)
    assert run_cli(home, "agents", "create", "--name", "careful", "--tool", "clock=ask", env=env).code == 0
    with serving(home, env=env) as sp:
        yield home, env, sp


def chat(env: dict[str, str], columns: int, *args: str) -> tuple[SizedPty, str]:
    """A chat on a new conversation of `careful`, at its prompt; and the conversation's id."""
    p = SizedPty([sys.executable, "-m", "appserver", "chat", "--agent", "careful", *args], env, columns)
    banner = p.expect("you> ")
    found = re.search(r"conversation (conv_\w+)", banner)
    assert found is not None, banner
    return p, found.group(1)


def user_messages(home: Path, conv: str) -> list[str]:
    return [
        json.loads(c)
        for (c,) in rows(
            home, f"SELECT content FROM messages WHERE conversation_id='{conv}' AND role='user' ORDER BY id"
        )
    ]


def test_cancel_at_an_idle_prompt_stops_no_turn_of_another_client(
    server: tuple[Path, dict[str, str], ServeProcess],
) -> None:
    home, env, sp = server
    p, conv = chat(env, 80, "--conversation", "new")

    async def scenario() -> str:
        async with await ProtocolClient.connect(sp.url, client="desktop") as other:
            await other.request({"type": "subscribe", "conversation": conv})
            ack = await other.request(
                {"type": "submit_input", "agent": "careful", "conversation": conv, "input": "/slow 40"}
            )
            turn = ack["turn_id"]
            status: dict[str, str] = {}

            async def watch() -> None:
                async for frame in other.frames():
                    if frame.get("type") == "turn_updated" and frame["snapshot"]["turn_id"] == turn:
                        status["now"] = frame["snapshot"]["status"]
                        if status["now"] in ("completed", "cancelled", "failed"):
                            return

            watching = asyncio.get_running_loop().create_task(watch())
            await wait_until(lambda: status.get("now") == "running", 10, "the other client's turn runs")
            p.write("/cancel\r")  # chat shows no turn: it has nothing to cancel
            await asyncio.wait_for(watching, 15)
            return status["now"]

    try:
        final = asyncio.run(scenario())
        assert final == "completed", final  # the other client's turn ran to its end
        p.expect("[nothing to cancel]", timeout=5)
        p.expect("you> ")
        p.write("/quit\r")
        assert p.wait() == 0
    finally:
        p.kill()


def test_a_wrapped_approval_prompt_is_erased_whole_when_drawn_again(
    server: tuple[Path, dict[str, str], ServeProcess],
) -> None:
    home, env, sp = server
    p, conv = chat(env, 80, "--conversation", "new")
    pad = "Q" * 200  # the prompt of this call takes four rows of 80 columns

    async def scenario() -> str:
        async with await ProtocolClient.connect(sp.url, client="other") as other:
            await other.request({"type": "subscribe", "conversation": conv})
            await other.request(
                {
                    "type": "submit_input",
                    "agent": "careful",
                    "conversation": conv,
                    "input": f'/call clock {{"pad": "{pad}"}}\n/call clock {{}}',
                }
            )
            p.expect("approve? [y/N] ")
            state = await other.request({"type": "subscribe", "conversation": conv})
            pending = state["pending_approvals"]
            assert len(pending) == 2, pending
            (long_call,) = [c["call_id"] for c in pending if pad in c["arguments"]]
            (short_call,) = [c["call_id"] for c in pending if pad not in c["arguments"]]
            ack = await other.request(
                {
                    "type": "approval_response",
                    "conversation": conv,
                    "decisions": [{"call_id": short_call, "decision": "deny"}],
                }
            )
            assert ack["results"][0]["accepted"], ack
            return long_call

    try:
        long_call = asyncio.run(scenario())
        p.expect("clock({}) denied")  # the answered call's line, drawn above the prompt
        p.expect("approve? [y/N] ")  # … and the prompt drawn again below it
        p.settle()
        screen = p.rendered()
        prompt_rows = [i for i, line in enumerate(screen) if line.startswith(f"[{long_call}] clock(")]
        assert len(prompt_rows) == 1, "\n".join(screen)  # no row of the first drawing stays
        start = prompt_rows[0]
        assert "clock({}) denied" in screen[start - 1], "\n".join(screen)
        assert screen[-1].endswith("wants to run. approve? [y/N]"), "\n".join(screen)
        p.write("\x03")
        p.expect("[cancelled]", timeout=10)
        p.expect("you> ")
        p.write("/quit\r")
        assert p.wait() == 0
    finally:
        p.kill()


def test_rubbing_out_a_typed_line_that_wraps_clears_every_row(
    server: tuple[Path, dict[str, str], ServeProcess],
) -> None:
    home, env, sp = server
    p, conv = chat(env, 40, "--conversation", "new")
    try:
        p.write("A" * 30 + "B" * 30)  # "you> " and 60 characters: two rows of 40
        p.expect("B" * 30)
        p.write("\x15")  # Ctrl-U
        p.write("hi")
        p.expect("hi")
        p.settle()
        screen = p.rendered()
        assert not any("A" in line or "B" in line for line in screen), "\n".join(screen)
        assert screen[-1] == "you> hi", "\n".join(screen)
        p.write("\r")
        p.expect("echo: hi")
        p.expect("you> ")

        p.write("Z" * 50 + " " + "J" * 20)  # three rows
        p.expect("J" * 20)
        p.write("\x17")  # Ctrl-W: the J word goes
        p.write("\x7f" * 47)  # Backspace: the space and 46 Z's
        p.write("!")
        p.expect("!")
        p.settle()
        screen = p.rendered()
        assert not any("J" in line for line in screen), "\n".join(screen)
        assert sum(line.count("Z") for line in screen) == 4 and screen[-1] == "you> ZZZZ!", "\n".join(screen)
        p.write("\r")
        p.expect("echo: ZZZZ!")
        p.expect("you> ")
        p.write("/quit\r")
        assert p.wait() == 0
    finally:
        p.kill()
    assert user_messages(home, conv) == ["hi", "ZZZZ!"]  # what the screen showed is what was sent


def test_a_paste_of_several_lines_is_one_input_and_never_a_command(
    server: tuple[Path, dict[str, str], ServeProcess],
) -> None:
    home, env, sp = server
    p, conv = chat(env, 80, "--conversation", "new")
    try:
        # a terminal pastes line ends as CR
        p.write(PASTE_START + "Please review this snippet:\r/new\rdef f():\r    return 1" + PASTE_END)
        p.write("\r")  # Enter after the paste sends it all
        p.expect("return 1")
        p.expect("you> ")
        p.settle()
        assert "new conversation" not in p.text(), p.text()
        assert user_messages(home, conv) == ["Please review this snippet:\n/new\ndef f():\n    return 1"]
        assert PASTE_ON in p.text()  # the terminal marks what is pasted
        p.write(PASTE_START + "/quit" + PASTE_END + "\r")  # a pasted command is text for the model
        p.expect("echo: /quit")
        p.expect("you> ")
        p.settle()
        assert "new conversation" not in p.text() and p.status is None
        assert PASTE_OFF not in p.text()
        p.write("/quit\r")  # typed, it is the command
        assert p.wait() == 0
        assert p.text().rstrip("\r\n").endswith(PASTE_OFF), repr(p.text()[-80:])  # off again on the way out
    finally:
        p.kill()
    assert user_messages(home, conv) == ["Please review this snippet:\n/new\ndef f():\n    return 1", "/quit"]

    p, _ = chat(env, 80)  # a stop signal: bracketed paste is off again too
    try:
        os.kill(p.pid, signal.SIGTERM)
        assert p.wait() == 128 + signal.SIGTERM
        assert PASTE_OFF in p.text()[p.text().index(PASTE_ON) :]
    finally:
        p.kill()
