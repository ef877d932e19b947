"""Session 38 (k): a big paste into `appserver chat`, and `run --approve/--deny` alike with and without a server.

* A bracketed paste was applied one character at a time: the pending keys re-sliced per character
  and a write and a flush of stdout per character echoed. A megabyte took 13-21 s before chat sent
  it; 3 MB were still unsent after a minute.
* `run --deny CALL` told the model "denied … by cli" in-process but "by appserver-run" through a
  server; `run --conversation new --approve X` was refused in two wordings.

`appserver chat` runs in a pseudo-terminal against a real `serve` (the echo model); `run` runs as
the real CLI, in-process on one home and through a real `serve` on another.
"""

from __future__ import annotations

import json
import os
import select
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from appserver.cli.chat import LineEditor, Screen
from tests.support.cli import cli_env, run_cli
from tests.support.serve import serving
from tests.test_chat_terminal import Pty, rows

pytestmark = pytest.mark.timeout(90)

PASTE_START, PASTE_END = "\x1b[200~", "\x1b[201~"
REPLY_WAIT = 30.0  # seconds: a liveness bound (a megabyte took 13-21 s, three were unsent after 60 s)
PASTE_LINES = 3000  # of about 1000 characters: 3 MB (a frame holds 4 MiB)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, str]]]:
    home = tmp_path_factory.mktemp("chat38k") / "home"
    env = cli_env(home)
    with serving(home, env=env):
        yield home, env


def write_all(p: Pty, data: bytes, timeout: float) -> None:
    """Write `data` to the terminal while reading what chat echoes (a terminal reads its output:
    otherwise chat, blocked writing the echo, would stop reading the keys and both would wait)."""
    deadline = time.monotonic() + timeout
    sent = 0
    while sent < len(data):
        left = deadline - time.monotonic()
        assert left > 0, f"chat took {sent} of {len(data)} bytes in {timeout:g} s"
        readable, writable, _ = select.select([p.fd], [p.fd], [], min(left, 1.0))
        if readable:
            p._read(0)
        if writable:
            sent += os.write(p.fd, data[sent : sent + 4096])


def user_messages(home: Path, conv: str) -> list[str]:
    return [
        json.loads(c)
        for (c,) in rows(
            home, f"SELECT content FROM messages WHERE conversation_id='{conv}' AND role='user' ORDER BY id"
        )
    ]


def test_megabytes_pasted_at_a_terminal_are_sent_whole(server: tuple[Path, dict[str, str]]) -> None:
    home, env = server
    p = Pty([sys.executable, "-m", "appserver", "chat", "--conversation", "new"], env)
    try:
        banner = p.expect("you> ")
        conv = banner.split("conversation ", 1)[1].split()[0]
        pasted = ("pasted\té中" + "x" * 990 + "\n") * PASTE_LINES
        write_all(p, (PASTE_START + pasted + PASTE_END + "\r").encode(), REPLY_WAIT)
        p.expect("echo: pasted", timeout=REPLY_WAIT)  # sent: the reply to it begins
        deadline = time.monotonic() + REPLY_WAIT
        while not (stored := user_messages(home, conv)) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        p.kill()
    assert stored == [pasted]


class CountedWrites:
    """stdout for a LineEditor: what was written, and in how many writes."""

    def __init__(self) -> None:
        self.parts: list[str] = []

    def write(self, text: str) -> int:
        self.parts.append(text)
        return len(text)

    def flush(self) -> None:
        pass


def editor_fed(reads: list[bytes], monkeypatch: pytest.MonkeyPatch) -> tuple[list[tuple[str, str]], CountedWrites]:
    """A terminal's LineEditor (its prompt shown) given `reads` a millisecond apart: what it took,
    and what it echoed."""
    out = CountedWrites()
    monkeypatch.setattr(sys, "stdout", out)
    editor = LineEditor(Screen(color=False, ansi=False), echo=True)
    editor.visible = True
    taken: list[tuple[str, str]] = []
    for i, data in enumerate(reads):
        editor.add(data, read_at=100.0 + i / 1000)
        while (event := editor.take()) is not None:
            taken.append(event)
    return taken, out


def test_a_paste_is_echoed_in_runs_not_character_by_character(monkeypatch: pytest.MonkeyPatch) -> None:
    pasted = ("a line of text\twith a tab\r\n" * 4000).encode()  # ~100 KB in one read
    taken, out = editor_fed([PASTE_START.encode() + pasted + PASTE_END.encode() + b"\r"], monkeypatch)
    text = "a line of text\twith a tab\n" * 4000
    assert taken == [("pasted", text)]
    assert "".join(out.parts) == text.replace("\t", " ") + "\n"
    assert len(out.parts) < 10, len(out.parts)  # was a write per character


@pytest.mark.parametrize("split", [1, 3, 7, 4096])
def test_a_paste_taken_in_runs_is_what_it_was_one_key_at_a_time(monkeypatch: pytest.MonkeyPatch, split: int) -> None:
    """Line ends, controls, escape sequences, bytes that are not UTF-8 and typed keys around a
    paste, in one read or split anywhere: the same lines, the same echo."""
    keys = (
        b"typed\tone\x7fE\r"  # typed, with a Backspace
        + PASTE_START.encode()
        + b"p1\r\np2\rp3\n\x01\x7fp4\x1b[Ap5\t\xff\xc3\xa9\r"  # CRLF, CR, LF, controls, an arrow, not UTF-8
        + PASTE_END.encode()
        + b" tail\r"
        + b"\x1bOPafter \xe4\xb8\xad\x15cleared\r"  # an SS3 key, Ctrl-U
    )
    reads = [keys[i : i + split] for i in range(0, len(keys), split)]
    taken, out = editor_fed(reads, monkeypatch)
    assert taken == [
        ("line", "typed\tonE"),
        ("pasted", "p1\np2\np3\np4p5\t\udcffé\n tail"),
        ("line", "cleared"),
    ]
    echoed = "".join(out.parts)
    assert "p1\np2\np3\np4p5 \ufffdé\n tail\n" in echoed and "\x1b" not in echoed


def test_ctrl_c_drops_the_rest_of_a_paste_taken_in_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    out = CountedWrites()
    monkeypatch.setattr(sys, "stdout", out)
    editor = LineEditor(Screen(color=False, ansi=False), echo=True)
    editor.visible = True
    editor.add((PASTE_START + "kept?\r").encode(), read_at=100.0)
    assert editor.take() is None and editor.pasting
    editor.discard()  # Ctrl-C while the paste still arrives
    editor.add(("dropped " * 10000 + "\r/quit\r" + PASTE_END + "typed\r").encode(), read_at=100.001)
    assert editor.take() == ("line", "typed")
    assert "dropped" not in "".join(out.parts)


# ------------------------------------------------------------------ run --approve/--deny


def paused_call(home: Path, env: dict[str, str]) -> tuple[str, str]:
    """A conversation of agent `careful` whose turn waits for the approval of a clock call."""
    made = run_cli(home, "run", "--agent", "careful", "--conversation", "new", "--json", "/call clock {}", env=env)
    assert made.code == 0, made.err
    data = made.json()
    return data["conversation_id"], data["pending"][0]["call_id"]


def denied(home: Path, env: dict[str, str]) -> tuple[str, str]:
    """What `run --deny` prints (stdout, and the tool line on stderr) for a paused call on `home`."""
    conv, call = paused_call(home, env)
    args = ("run", "--agent", "careful", "--conversation", conv, "--deny", call, "--reason", "nope")
    out = run_cli(home, *args, env=env)
    assert out.code == 0, out.err
    return out.out.replace(call, "CALL"), out.err.replace(call, "CALL")


def test_run_deny_names_the_same_decider_in_process_and_through_a_server(tmp_path: Path) -> None:
    said: dict[str, tuple[str, str]] = {}
    for where in ("in-process", "server"):
        home = tmp_path / where
        env = cli_env(home)
        assert run_cli(home, "agents", "create", "--name", "careful", "--tool", "clock=ask", env=env).code == 0
        if where == "server":
            with serving(home, env=env):
                said[where] = denied(home, env)
        else:
            said[where] = denied(home, env)
    assert "denied this call to clock by appserver-run" in said["in-process"][0], said
    assert said["in-process"] == said["server"]


def test_run_answering_in_a_new_conversation_is_refused_alike(tmp_path: Path) -> None:
    said = []
    for where in ("in-process", "server"):
        home = tmp_path / where
        env = cli_env(home)
        args = ("run", "--conversation", "new", "--approve", "call_x")
        if where == "server":
            with serving(home, env=env):
                said.append(run_cli(home, *args, env=env))
        else:
            said.append(run_cli(home, *args, env=env))
    assert [(r.code, r.out, r.err) for r in said] == [(2, "", said[0].err)] * 2
    assert "'new' is not an existing conversation" in said[0].err, said[0].err
