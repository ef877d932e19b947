"""Issue 14.7: the project's clients ride out a server stop (1012) or death (1006) when a
`serve --standby` takes over: they reconnect with backoff, find the new address in server.json,
resubscribe and resume the turn they were showing; without a server they give up after a bounded
wait with a clear error. Real processes only: a primary `serve`, a standby on another port, the
`appserver run` / `appserver chat` CLIs, SQLite on disk."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest

from appserver.serverinfo import read_live_server
from tests.support.cli import ROOT, cli_env
from tests.support.serve import ServeProcess, start_serve
from tests.support.wait import wait_for
from tests.support.zygote_client import appserver_popen
from tests.test_chat_terminal import Pty

pytestmark = pytest.mark.timeout(60)


def running_turn_with_draft(home: Path, draft: bool = True) -> bool:
    """A turn of the primary is running and has checkpointed visible text (what the standby keeps)."""
    try:
        db = sqlite3.connect(f"file:{home / 'appserver.db'}?mode=ro", uri=True, timeout=1)
    except sqlite3.Error:
        return False
    try:
        row = db.execute(
            "SELECT 1 FROM turns WHERE status='running'" + (" AND draft IS NOT NULL" if draft else "")
        ).fetchone()
    except sqlite3.Error:
        return False
    finally:
        db.close()
    return row is not None


def assistant_messages(home: Path) -> list[dict[str, Any]]:
    db = sqlite3.connect(f"file:{home / 'appserver.db'}?mode=ro", uri=True, timeout=5)
    try:
        rows = db.execute(
            "SELECT content, completion_status FROM messages WHERE role='assistant' ORDER BY id"
        ).fetchall()
    finally:
        db.close()
    return [{"content": json.loads(c), "completion_status": s} for c, s in rows]


class Standby:
    """`appserver serve --standby` on its own port (port 0: the OS picks one when it takes over)."""

    def __init__(self, home: Path, env: dict[str, str], log: Path) -> None:
        self.log_path = log
        self._log: IO[str] = log.open("w")
        self.proc = appserver_popen(
            ["serve", "--standby", "--listen", "127.0.0.1:0"],
            env=env,
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            text=True,
        )
        wait_for(lambda: "appserver standby:" in log.read_text(), 20, "the standby to start waiting")

    def serving(self, home: Path) -> dict[str, Any] | None:
        info = read_live_server(home / "server.json")
        return info if info is not None and info["pid"] == self.proc.pid else None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[Path, dict[str, str], ServeProcess, Standby]]:
    home = tmp_path / "home"
    env = cli_env(home, APPSERVER_LIMITS__DRAFT_INTERVAL_S="0.1", APPSERVER_CRON_TICK_S="1")
    primary = start_serve(home, env=env)
    standby = Standby(home, env, tmp_path / "standby.log")
    try:
        yield home, env, primary, standby
    finally:
        if primary.proc.poll() is None:
            primary.proc.kill()
            primary.proc.wait(10)
        standby.stop()


def test_run_prints_the_truthful_outcome_after_kill9_failover(
    pair: tuple[Path, dict[str, str], ServeProcess, Standby],
) -> None:
    home, env, primary, standby = pair
    run = appserver_popen(
        ["run", "/slow 40"],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: running_turn_with_draft(home), 15, "the turn to run and checkpoint text")
        primary.proc.kill()  # kill -9 mid-turn: the connection dies (1006), nothing is settled
        out, err = run.communicate(timeout=40)
    finally:
        if run.poll() is None:
            run.kill()
    new = standby.serving(home)
    assert new is not None and new["url"] != primary.url, "the standby did not take over on its own port"
    # run followed the failover to the standby's address and reported the turn as the store has it
    assert f"[reconnected to {new['url']}" in err, err
    assert run.returncode == 1, (run.returncode, out, err)
    assert "turn interrupted: the server stopped while this turn was running" in err, err
    kept = assistant_messages(home)
    assert len(kept) == 1 and kept[0]["completion_status"] == "interrupted", kept
    assert out.strip() == kept[0]["content"].strip() != "", (out, kept)  # the text the store kept
    assert out.startswith("w1") and "w40" not in out, out  # a draft of one word may be all it kept


def test_run_gives_up_with_a_clear_error_when_no_server_returns(tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = cli_env(home)
    primary = start_serve(home, env=env)
    run = appserver_popen(
        ["run", "--reconnect-wait", "1", "/slow 200"],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: running_turn_with_draft(home, draft=False), 15, "the turn to run")
        primary.proc.kill()
        start = time.monotonic()
        out, err = run.communicate(timeout=20)
        waited = time.monotonic() - start
    finally:
        for proc in (run, primary.proc):
            if proc.poll() is None:
                proc.kill()
        primary.proc.wait(10)
    assert run.returncode == 1, (out, err)
    assert "could not reconnect within 1 s" in err and err.strip().splitlines()[-1].startswith(
        "error: lost the server at"
    ), err
    assert 0.9 <= waited < 6, waited


def test_chat_reconnects_to_the_standby_after_a_clean_stop(
    pair: tuple[Path, dict[str, str], ServeProcess, Standby],
) -> None:
    home, env, primary, standby = pair
    chat = Pty([sys.executable, "-m", "appserver", "chat"], env)
    try:
        chat.expect("you> ")
        chat.write("before the stop\n")
        chat.expect("echo: before the stop")
        chat.expect("you> ")
        primary.proc.send_signal(signal.SIGTERM)  # server_stopping, then close 1012
        assert primary.proc.wait(15) == 0
        new = wait_for(lambda: standby.serving(home), 20, "the standby to take over")
        chat.expect(f"reconnected to {new['url']}")
        chat.write("/recall\n")  # the same conversation, now served by the standby
        chat.expect("before the stop")
        chat.expect("you> ")
        chat.write("/quit\n")
        assert chat.wait() == 0
    finally:
        chat.kill()


@pytest.mark.parametrize(
    ("messages", "status", "kind", "text"),
    [
        (
            [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "echo: hi", "completion_status": "completed"},
            ],
            "completed",
            None,
            "echo: hi",
        ),
        (
            [
                {"role": "user", "content": "/slow 9"},
                {"role": "assistant", "content": "w1 w2", "completion_status": "interrupted"},
            ],
            "cancelled",
            "interrupted",
            "w1 w2",
        ),
        (
            [
                {"role": "user", "content": "/slow 9"},
                {"role": "assistant", "content": "w1", "completion_status": "cancelled"},
            ],
            "cancelled",
            None,
            "w1",
        ),
        # a call answered, then nothing: the store cannot tell how it ended, and the client says so
        (
            [
                {"role": "user", "content": "/call clock {}"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"id": "c1", "name": "clock", "arguments": "{}"}],
                    "completion_status": "completed",
                },
                {
                    "role": "tool",
                    "tool_call_id": "c1",
                    "content": "The server stopped before the call to clock returned a result.",
                    "is_error": True,
                },
            ],
            "failed",
            "unknown",
            "",
        ),
        ([{"role": "user", "content": "hi"}], "failed", "unknown", ""),
    ],
)
def test_a_turn_that_ended_while_disconnected_is_reported_as_stored(
    messages: list[dict[str, Any]], status: str, kind: str | None, text: str
) -> None:
    from appserver.client import settled_from_history

    others = [{"role": "user", "content": "earlier", "turn_id": "turn_0"}]
    snap = settled_from_history("turn_1", "conv_1", "agt_1", others + [{**m, "turn_id": "turn_1"} for m in messages], 5)
    assert snap is not None and snap["status"] == status and snap["revision"] == 5, snap
    assert (snap["error"] or {}).get("kind") == kind
    assert "".join(b["text"] for b in snap["blocks"] if b["type"] == "text") == text
    assert settled_from_history("turn_2", "conv_1", "agt_1", others, 5) is None  # nothing committed yet: still queued


def test_ctrl_c_while_chat_waits_for_a_dead_server_exits_cleanly(tmp_path: Path) -> None:
    """kill -9, no standby: chat waits to reconnect; Ctrl-C there queues a cancel that can never be
    sent, and a second Ctrl-C leaves. The request given up with the connection leaves no
    'Future exception was never retrieved' traceback on the screen."""
    home = tmp_path / "home"
    env = cli_env(home)
    primary = start_serve(home, env=env)
    chat = Pty([sys.executable, "-m", "appserver", "chat", "--reconnect-wait", "20"], env)
    try:
        chat.expect("you> ")
        chat.write("/slow 200\n")
        chat.expect("w3 ")
        primary.proc.kill()
        primary.proc.wait(10)
        chat.expect("reconnecting for up to 20 s")
        chat.write("\x03")
        chat.expect("cancelling")
        time.sleep(0.3)
        chat.write("\x03")
        assert chat.wait() == 130
        chat.settle()
        assert "never retrieved" not in chat.text() and "Traceback" not in chat.text(), chat.text()
    finally:
        chat.kill()
        if primary.proc.poll() is None:
            primary.proc.kill()
            primary.proc.wait(10)


class _CutProxy:
    """A loopback TCP relay to the server whose connections can be cut (a link going down) and
    whose listener closed and opened again on the same port (the link coming back)."""

    def __init__(self, target_port: int) -> None:
        import socket as _socket

        self.target = target_port
        with _socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.server: Any = None
        self.writers: list[Any] = []

    async def up(self) -> None:
        import asyncio

        async def relay(reader: Any, writer: Any) -> None:
            try:
                up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target)
            except OSError:
                writer.close()
                return
            self.writers += [writer, up_w]

            async def pipe(src: Any, dst: Any) -> None:
                try:
                    while data := await src.read(65536):
                        dst.write(data)
                        await dst.drain()
                except (ConnectionError, OSError):
                    pass
                finally:
                    dst.close()

            await asyncio.gather(pipe(reader, up_w), pipe(up_r, writer))

        self.server = await asyncio.start_server(relay, "127.0.0.1", self.port)

    async def down(self) -> None:
        self.server.close()
        for w in self.writers:
            w.transport.abort()
        self.writers.clear()
        await self.server.wait_closed()


async def test_a_reconnect_finds_a_turn_that_ended_pages_back_in_the_history(tmp_path: Path) -> None:
    """While the client was away, big inputs after its turn filled more than one history page
    (a page stops at about 8 MiB): it pages back until it finds its turn, which completed,
    instead of reporting it lost."""
    import asyncio

    import websockets

    from appserver.client.connection import ProtocolClient
    from tests.support.serve import serving

    with serving(tmp_path / "home") as sp:
        port = int(sp.url.rsplit(":", 1)[1])
        proxy = _CutProxy(port)
        await proxy.up()
        via = f"http://127.0.0.1:{proxy.port}"
        a = await ProtocolClient.connect(via, reconnect=True, reconnect_s=30, url_source=lambda: via)
        try:
            conv = (await a.request({"type": "create_conversation", "agent": "assistant"}))["conversation"]["id"]
            await a.request({"type": "subscribe", "conversation": conv})
            t1 = (await a.submit("assistant", "/slow 40", conversation=conv))["turn_id"]
            ws_url = sp.url.replace("http://", "ws://") + "/ws"
            async with websockets.connect(ws_url, max_size=None) as b:
                await b.send(json.dumps({"type": "hello", "protocol": 1}))
                await b.recv()
                for i in range(2):  # queued behind t1: ~12 MB of history after it
                    big = chr(97 + i) * 3_000_000
                    await b.send(
                        json.dumps({"type": "submit_input", "agent": "assistant", "conversation": conv, "input": big})
                    )
                await asyncio.sleep(0.3)
                await proxy.down()  # the link goes down while t1 runs
                done = 0
                while done < 2:
                    frame = json.loads(await asyncio.wait_for(b.recv(), 60))
                    snap = frame.get("snapshot") or {}
                    if (
                        frame["type"] == "turn_updated"
                        and snap.get("turn_id") != t1
                        and snap.get("status") == "completed"
                    ):
                        done += 1
            await proxy.up()
            snap = await a.wait_turn(t1, timeout=60)
            text = "".join(b.get("text", "") for b in snap["blocks"] if b["type"] == "text")
            assert snap["status"] == "completed" and text.startswith("w1 w2 w3"), snap
        finally:
            await a.close()
            await proxy.down()
