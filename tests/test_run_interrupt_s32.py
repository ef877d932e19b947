"""A Ctrl-C of `appserver run` while its submit waits for the server's ack: the server took the
input (its turn runs), the ack is on its way. An ack that comes while the command stops (it waits
5 s for its cancelled work) names the turn, which is cancelled; one that never comes was said as
"no turn was started", though the turn ran on: now the line says a turn may have started there.

Real parts: `appserver serve`, `appserver run --url` through a loopback TCP proxy that holds the
server's bytes once the client has sent its submit (its third write: upgrade, hello, submit), until
the test lets them go: right after the SIGINT, or never (the client's close frame, sent once the
command has given up on the ack, cuts the connection, as a link that lost the ack would end: the
command then ends at once instead of waiting out its WebSocket close timeout, 10 s, for a close
reply held behind the ack). Each side's end is passed on at once (a shutdown, not only a close, which
another thread's pending recv on the socket would hold back)."""

from __future__ import annotations

import contextlib
import signal
import socket
import sqlite3
import subprocess
import threading
from pathlib import Path

import pytest

from tests.support.cli import ROOT, cli_env
from tests.support.serve import serving
from tests.support.wait import wait_for
from tests.support.zygote_client import appserver_popen

pytestmark = pytest.mark.timeout(60)


class AckHolder:
    """One connection at a time, passed on both ways; the server's bytes are held once the client
    has written three times, until `release()`."""

    def __init__(self, upstream_port: int, *, cut_on_close: bool = False) -> None:
        self.upstream_port = upstream_port
        self.cut_on_close = cut_on_close  # the client's close frame while bytes are held ends the connection
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.client_writes = 0
        self.released = threading.Event()
        self.held = threading.Event()
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=10)
            self.sockets += [client, server]
            threading.Thread(target=self._up, args=(client, server), daemon=True).start()
            threading.Thread(target=self._down, args=(server, client), daemon=True).start()

    def _up(self, client: socket.socket, server: socket.socket) -> None:
        while data := _recv(client):
            self.client_writes += 1
            try:
                server.sendall(data)
            except OSError:
                break
            if self.cut_on_close and self.held.is_set() and data[:1] == b"\x88":  # a (masked) close frame
                self.drop()  # the held bytes, the ack among them, never reach the client
                return
        _end(server)

    def _down(self, server: socket.socket, client: socket.socket) -> None:
        while data := _recv(server):
            if self.client_writes >= 3 and not self.released.is_set():
                self.held.set()
                self.released.wait(30)
            try:
                client.sendall(data)
            except OSError:  # dropped meanwhile
                break
        _end(client)

    def release(self) -> None:
        self.released.set()

    def drop(self) -> None:
        """The connection cut before the held bytes get through (a network cut, a server killed
        right after it committed the turn)."""
        for sock in self.sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def close(self) -> None:
        self.released.set()
        self.listener.close()


def _end(sock: socket.socket) -> None:
    """The peer sees the end at once: a close alone waits for the other thread's recv on it."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


def _recv(sock: socket.socket) -> bytes:
    try:
        return sock.recv(65536)
    except OSError:
        return b""


def _turn_statuses(home: Path) -> list[str]:
    with sqlite3.connect(home / "appserver.db") as db:
        return [row[0] for row in db.execute("SELECT status FROM turns ORDER BY rowid")]


def _interrupted_before_the_ack(home: Path, url: str, *, ack_after_exit: bool, drop: bool = False) -> tuple[int, str]:
    """`run` started through the proxy, SIGINT once the server runs its turn and the ack is held;
    the ack let go at once, or never (`ack_after_exit`: the connection cut once the command closes
    it, having given up on the ack), or the connection cut at once (`drop`). (exit code, stderr)"""
    proxy = AckHolder(int(url.rsplit(":", 1)[1]), cut_on_close=ack_after_exit and not drop)
    try:
        proc = appserver_popen(
            ["run", "--url", f"http://127.0.0.1:{proxy.port}", "--reconnect-wait", "0", "--conversation", "new"]
            + ["/slow 100000"],
            env=cli_env(home),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        wait_for(lambda: "running" in _turn_statuses(home), 20, "the server to take the input")
        assert proxy.held.wait(10), "the ack was not held"
        proc.send_signal(signal.SIGINT)
        if drop:
            proxy.drop()
        elif not ack_after_exit:
            proxy.release()
        _, err = proc.communicate(timeout=30)
        return proc.returncode, err
    finally:
        proxy.close()


def test_ctrl_c_before_the_ack_cancels_the_turn_the_ack_names(tmp_path: Path) -> None:
    home = tmp_path / "home"
    with serving(home) as sp:
        code, err = _interrupted_before_the_ack(home, sp.url, ack_after_exit=False)
        assert code == 130, err
        assert err.strip() == "error: interrupted by SIGINT: the turn was cancelled", err
        wait_for(lambda: _turn_statuses(home)[-1] == "cancelled", 10, "the turn cancelled")


def test_ctrl_c_whose_ack_never_comes_says_a_turn_may_have_started(tmp_path: Path) -> None:
    home = tmp_path / "home"
    with serving(home) as sp:
        code, err = _interrupted_before_the_ack(home, sp.url, ack_after_exit=True)
        assert code == 130, err
        assert "no turn was started" not in err, err
        assert "did not confirm the input in time, so a turn may have started there" in err, err
        assert _turn_statuses(home) == ["running"]  # as said: it runs on there


def test_ctrl_c_whose_connection_is_cut_before_the_ack_says_a_turn_may_have_started(tmp_path: Path) -> None:
    home = tmp_path / "home"
    with serving(home) as sp:
        code, err = _interrupted_before_the_ack(home, sp.url, ack_after_exit=True, drop=True)
        assert code == 130, err
        assert "no turn was started" not in err, err
        assert "the connection was lost before the server confirmed the input, so a turn may have started" in err, err
        assert _turn_statuses(home) == ["running"]
