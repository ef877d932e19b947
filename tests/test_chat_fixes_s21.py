"""`appserver chat` while a line awaits the server's ack (fix 21).

`Chat.line()` awaited the submit's ack inside the key handler, so the session's one event loop
handled nothing else until the request returned: with the server stalled (SIGSTOP here; a network
that keeps the connection open but carries nothing does the same) `chat` showed `you> hello` and
then ignored SIGTERM, SIGHUP, Ctrl-C and `/quit`. It left only when the server answered, or after
the 30 s request timeout with a fatal "did not answer in time" (exit 1), and an `error` frame
without a request_id (nobody's reply) was not shown until then either. Now the submit runs beside
the session: signals, Ctrl-C (it cancels the turn once the server names it) and `/quit` act at
once, lines typed meanwhile run after it in order, and a line the server does not confirm in time
is reported as unconfirmed (it may or may not have been taken) like a refused line: the session
goes on, and piped input exits 1 at its end. A client command that still awaits the server inline
(`/new`) is cut short by SIGTERM/SIGHUP too.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import termios
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.server import Server, ServerConnection, serve

from tests.support.cli import ROOT, cli_env
from tests.support.serve import ServeProcess, serving
from tests.test_chat_terminal import Pty

pytestmark = pytest.mark.timeout(90)

CONVERSATION = re.compile(r"in conversation (conv_\w+)")
UNCONFIRMED = "it may or may not have been taken"
Served = tuple[Path, dict[str, str], ServeProcess]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    home = tmp_path_factory.mktemp("chat_s21") / "home"
    env = cli_env(home)
    with serving(home, env=env) as sp:
        yield home, env, sp


@contextmanager
def stalled(sp: ServeProcess) -> Iterator[None]:
    """The server stopped (SIGSTOP): its connections stay open but nothing is answered."""
    os.kill(sp.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(sp.proc.pid, signal.SIGCONT)


def chat_pty(env: dict[str, str], *args: str) -> Pty:
    return Pty([sys.executable, "-m", "appserver", "chat", "--conversation", "new", *args], env)


def modes(fd: int) -> tuple[bool, bool]:
    lflag = termios.tcgetattr(fd)[3]
    return bool(lflag & termios.ECHO), bool(lflag & termios.ICANON)


def user_texts(home: Path, out: str) -> list[str]:
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


# ------------------------------------------------------------------ a real server, stalled


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_while_a_line_awaits_its_ack_exits_at_once(server: Served, signum: int) -> None:
    _, env, sp = server
    chat = chat_pty(env)
    try:
        before = modes(chat.fd)
        chat.expect("you> ")
        with stalled(sp):
            chat.write("hello\r")
            chat.expect("hello\r\n")  # Enter was taken: the line is being sent
            os.kill(chat.pid, signum)
            code = chat.wait(timeout=15)  # (it used to wait for the 30 s request timeout)
        assert code == 128 + signum, (code, chat.screen())
        assert modes(chat.fd) == before, "the terminal was left without echo / line editing"
        text = chat.text()
        assert "did not answer in time" not in text and "Traceback" not in text, text
        assert f'chat left before the server confirmed "hello": {UNCONFIRMED}' in text, text
    finally:
        chat.kill()


def test_sigterm_while_a_client_command_awaits_the_server_exits_at_once(server: Served) -> None:
    """`/new` still awaits its requests inline; SIGTERM stops that wait too."""
    _, env, sp = server
    chat = chat_pty(env)
    try:
        before = modes(chat.fd)
        chat.expect("you> ")
        with stalled(sp):
            chat.write("/new\r")
            chat.expect("/new\r\n")
            os.kill(chat.pid, signal.SIGTERM)
            code = chat.wait(timeout=15)
        assert code == 143, (code, chat.screen())
        assert modes(chat.fd) == before
        assert "Traceback" not in chat.text() and "did not answer in time" not in chat.text(), chat.text()
    finally:
        chat.kill()


def test_ctrl_c_while_a_line_awaits_its_ack_cancels_its_turn_once_confirmed(server: Served) -> None:
    home, env, sp = server
    chat = chat_pty(env)
    try:
        chat.expect("you> ")
        with stalled(sp):
            chat.write("/slow 200\r")
            chat.expect("/slow 200\r\n")
            chat.write("\x03")
            chat.expect("^C cancelling (Ctrl-C again to exit)", timeout=10)  # at once, server still stopped
        chat.expect("[cancelled]")  # the server answered: the turn it named was cancelled
        chat.expect("you> ")
        chat.write("/quit\r")
        assert chat.wait() == 0
    finally:
        chat.kill()
    assert user_texts(home, chat.text()) == ["/slow 200"]
    assert "w200" not in chat.text()


@pytest.mark.parametrize(("keys", "expected"), [(["/quit\r"], 0), (["\x03", "\x03"], 130)])
def test_quit_or_a_second_ctrl_c_while_a_line_awaits_its_ack_leaves(
    server: Served, keys: list[str], expected: int
) -> None:
    _, env, sp = server
    chat = chat_pty(env)
    try:
        chat.expect("you> ")
        with stalled(sp):
            chat.write("hello\r")
            chat.expect("hello\r\n")
            for i, key in enumerate(keys):
                chat.write(key)
                if key == "\x03" and i < len(keys) - 1:
                    chat.expect("^C cancelling", timeout=10)  # (two at once may come as one SIGINT)
            code = chat.wait(timeout=15)
        assert code == expected, (code, chat.screen())
        assert f'chat left before the server confirmed "hello": {UNCONFIRMED}' in chat.text(), chat.text()
    finally:
        chat.kill()


def test_lines_typed_while_a_line_awaits_its_ack_run_after_it_in_order(server: Served) -> None:
    home, env, sp = server
    chat = chat_pty(env)
    try:
        chat.expect("you> ")
        with stalled(sp):
            chat.write("first\r")
            chat.expect("first\r\n")
            chat.write("second\r")
            chat.write("third\r")
            chat.settle(0.3)
        chat.expect("echo: first")
        chat.expect("echo: second")
        chat.expect("echo: third")
        chat.expect("you> ")
        chat.write("/quit\r")
        assert chat.wait() == 0
    finally:
        chat.kill()
    assert user_texts(home, chat.text()) == ["first", "second", "third"]


# ------------------------------------------------------------------ a fake server that never confirms

CONV = {
    "id": "conv_fake",
    "agent_id": "agt_fake",
    "default": True,
    "title": "t",
    "user": None,
    "forked_from": None,
    "metadata": {},
    "created_at": 1.0,
    "updated_at": 1.0,
}

# `chat` with a shorter ack timeout (the module constant; 30 s by default), so no test waits 30 s
PATCHED = (
    "import sys, appserver.cli.chat as c; c.SUBMIT_TIMEOUT = float(sys.argv.pop(1)); "
    "from appserver.cli.main import run; run()"
)


class FakeServer:
    """A /ws server on a thread of its own (the test blocks on the pty). `mode`:
    `silent_first`: the first submit gets no answer at all, later ones an ack and a finished turn;
    `error_no_rid`: every submit is answered with an `error` frame that carries no request_id."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.submits = 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.server: Server | None = None
        self.url = ""

    def __enter__(self) -> FakeServer:
        self.thread.start()
        self.server = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        self.url = f"http://127.0.0.1:{next(iter(self.server.sockets)).getsockname()[1]}"
        return self

    async def _start(self) -> Server:
        return await serve(self._handler, "127.0.0.1", 0)

    async def _stop(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    def __exit__(self, *exc: object) -> None:
        try:
            asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()

    async def _handler(self, ws: ServerConnection) -> None:
        async for raw in ws:
            frame = json.loads(raw)
            rid, kind = frame.get("request_id"), frame["type"]
            reply: dict[str, Any]
            if kind == "hello":
                reply = {"type": "welcome", "protocol": 1, "server": "fake", "connection_id": "wsc_1"}
                reply |= {"subject": "local"}
            elif kind in ("subscribe", "create_conversation"):
                reply = {"type": "conversation_state", "conversation": CONV, "state": "idle", "active_turn": None}
            elif kind == "submit_input":
                self.submits += 1
                if self.mode == "error_no_rid":
                    await ws.send(json.dumps({"type": "error", "code": "internal_error", "message": "boom"}))
                    continue
                if self.submits == 1:
                    continue  # never answered
                turn = f"turn_{self.submits}"
                ack = {"type": "ack", "request_id": rid, "turn_id": turn, "conversation_id": "conv_fake"}
                await ws.send(json.dumps({**ack, "queue_position": 0, "duplicate": False}))
                snap = {"turn_id": turn, "conversation_id": "conv_fake", "revision": 1, "status": "completed"}
                snap["blocks"] = [{"type": "text", "text": f"fake: {frame['input']}"}]
                await ws.send(json.dumps({"type": "turn_updated", "snapshot": snap}))
                continue
            else:
                reply = {"type": "ack"}
            await ws.send(json.dumps({**reply, "request_id": rid}))


# the ack wait of the tests whose line is never confirmed: the fake answers a confirmed line at
# once, so half a second is plenty, and each of these tests sits it out
ACK_WAIT = 0.5


def patched_chat(timeout: float, url: str) -> list[str]:
    return [sys.executable, "-c", PATCHED, str(timeout), "chat", "--url", url, "--reconnect-wait", "0"]


def test_a_line_never_confirmed_is_reported_and_the_session_goes_on(tmp_path: Path) -> None:
    with FakeServer("silent_first") as fake:
        chat = Pty(patched_chat(ACK_WAIT, fake.url), cli_env(tmp_path / "home"))
        try:
            chat.expect("you> ")
            chat.write("hello\r")
            chat.write("next\r")  # typed while `hello` waits: sent after it, not before
            chat.expect(f'error: the server did not confirm "hello" within {ACK_WAIT:g} s: {UNCONFIRMED}', timeout=15)
            chat.expect("appserver conversations history conv_fake")
            chat.expect("fake: next")
            chat.expect("you> ")
            chat.write("/quit\r")
            assert chat.wait() == 0  # at a terminal: the person saw the error line and went on
        finally:
            chat.kill()
    text = chat.text()
    assert "did not answer in time" not in text and "Traceback" not in text, text


def test_a_piped_line_never_confirmed_exits_1_after_the_other_lines(tmp_path: Path) -> None:
    with FakeServer("silent_first") as fake:
        r = subprocess.run(
            patched_chat(ACK_WAIT, fake.url),
            input="hello\nnext\n",
            capture_output=True,
            text=True,
            timeout=30,
            env=cli_env(tmp_path / "home"),
            cwd=ROOT,
        )
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert f'did not confirm "hello" within {ACK_WAIT:g} s: {UNCONFIRMED}' in r.stdout, r.stdout
    assert "fake: next" in r.stdout, r.stdout
    assert "Traceback" not in r.stderr and "did not answer in time" not in r.stderr, r.stderr


def test_an_error_frame_without_request_id_is_shown_at_once(tmp_path: Path) -> None:
    """It is nobody's reply: the submit still waits for its own, but the user is told at once, and
    can leave; unanswered, the line is then reported as unconfirmed (piped: exit 1)."""
    env = cli_env(tmp_path / "home")
    with FakeServer("error_no_rid") as fake:
        chat = Pty(patched_chat(30.0, fake.url), env)
        try:
            chat.expect("you> ")
            chat.write("hello\r")
            chat.expect("error: boom", timeout=10)  # not after the 30 s timeout
            chat.write("/quit\r")
            assert chat.wait(timeout=10) == 0
        finally:
            chat.kill()
        assert f'chat left before the server confirmed "hello": {UNCONFIRMED}' in chat.text(), chat.text()
        r = subprocess.run(
            patched_chat(ACK_WAIT, fake.url),
            input="hello\n",
            capture_output=True,
            text=True,
            timeout=30,
            env=env,
            cwd=ROOT,
        )
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert "error: boom" in r.stdout, r.stdout
    assert f'did not confirm "hello" within {ACK_WAIT:g} s: {UNCONFIRMED}' in r.stdout, r.stdout
    assert "Traceback" not in r.stderr, r.stderr
