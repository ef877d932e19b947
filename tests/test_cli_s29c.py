"""Session 29, fix helper C: three CLI findings of an outside tester. Real processes throughout.

* A standby whose --listen address another program held waited in silence; at the takeover it said
  "taking over", failed to bind and exited 2, leaving the home with no server. Now the standby warns
  while it waits, and after a takeover waits (bounded) for the address to be freed.
* `appserver run --idempotency-key K` in-process, a second time with another text, printed the first
  turn's reply without a word; through a server it says so on stderr. Now in-process says it too.
* Ctrl-C (or SIGTERM/SIGHUP) in `appserver chat` while still connecting printed click's "Aborted!"
  and exited 1; `run` prints one error line and exits 128 + the signal. Now chat does as run.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import pytest

from tests.support.cli import cli_env, run_cli
from tests.support.net import free_port
from tests.support.wait import wait_for
from tests.test_chat_terminal import Pty
from tests.test_cron_failover import Serve

pytestmark = pytest.mark.timeout(120)


@contextmanager
def stalled_listener() -> Iterator[tuple[int, threading.Event]]:
    """A loopback port that accepts connections and never answers (an unrelated program, or a
    stalled server); the event is set once a connection was accepted."""
    accepted = threading.Event()
    conns: list[socket.socket] = []
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)

    def accept() -> None:
        try:
            while True:
                conn, _ = srv.accept()
                conns.append(conn)
                accepted.set()
        except OSError:
            pass  # closed: the test is over

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield int(srv.getsockname()[1]), accepted
    finally:
        srv.shutdown(socket.SHUT_RDWR)
        srv.close()
        for conn in conns:
            conn.close()


# ------------------------------------------------------------------ 1. standby, --listen held


def test_a_standby_warns_of_a_held_listen_address_and_takes_over_once_it_is_freed(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    env = cli_env(home, APPSERVER_CRON_TICK_S="0.2")
    holder = Serve(home, free_port(), env=env)
    standby: Serve | None = None
    with stalled_listener() as (held_port, _):
        try:
            wait_for(partial(holder.said, "listening on"), 20, "the holder to listen")
            standby = Serve(home, held_port, "--standby", env=env)
            wait_for(partial(standby.said, "appserver standby:"), 20, "the standby to wait")
            # said while waiting, naming the address: not only at the takeover
            wait_for(partial(standby.said, "is in use by another program"), 10, "the warning")
            warning = next(line for line in standby.lines if "is in use by another program" in line)
            assert f"127.0.0.1:{held_port}" in warning and "--listen" in warning, warning
            holder.proc.kill()
            holder.proc.wait(10)
            wait_for(partial(standby.said, "taking over"), 20, "the takeover")
            wait_for(partial(standby.said, "waiting up to"), 10, "the wait for the address")
        finally:
            holder.kill()
    # the program let go of the address: the standby binds it and serves the home
    try:
        wait_for(partial(standby.said, "listening on"), 30, "the standby to listen")
        assert standby.proc.poll() is None, standby.lines
        info = json.loads((home / "server.json").read_text())
        assert info["pid"] == standby.proc.pid and info["url"].endswith(f":{held_port}"), info
    finally:
        standby.kill()


def test_a_standby_sharing_the_servers_own_address_is_not_warned(tmp_path: Path) -> None:
    """The supported setup (the standby takes the holder's --listen over) is no wrong setting."""
    home = tmp_path / "home"
    home.mkdir()
    env = cli_env(home, APPSERVER_CRON_TICK_S="0.2")
    port = free_port()
    holder = Serve(home, port, env=env)
    standby: Serve | None = None
    try:
        wait_for(partial(holder.said, "listening on"), 20, "the holder to listen")
        standby = Serve(home, port, "--standby", env=env)
        wait_for(partial(standby.said, "appserver standby:"), 20, "the standby to wait")
        holder.proc.kill()
        holder.proc.wait(10)
        wait_for(partial(standby.said, "listening on"), 30, "the standby to listen")
        assert not any("in use" in line for line in standby.lines), standby.lines
    finally:
        for p in (holder, standby):
            if p is not None:
                p.kill()


# ------------------------------------------------------------------ 2. in-process idempotency key


def test_in_process_run_with_a_used_idempotency_key_says_so(tmp_path: Path) -> None:
    home = tmp_path / "home"
    first = run_cli(home, "run", "--idempotency-key", "k-29c", "first")
    assert first.code == 0, first.err
    assert "echo: first" in first.out
    assert "idempotency key" not in first.err, first.err
    second = run_cli(home, "run", "--idempotency-key", "k-29c", "second")
    assert second.code == 0, second.err
    assert "echo: first" in second.out, second.out  # the earlier input's turn, as the key promises
    assert "[an input with this idempotency key was sent before: following its turn turn_" in second.err, second.err


# ------------------------------------------------------------------ 3. chat stopped while connecting


@pytest.mark.parametrize(
    ("signum", "via_key"),
    [(signal.SIGINT, True), (signal.SIGTERM, False), (signal.SIGHUP, False)],
)
def test_chat_stopped_while_connecting_says_one_error_line_and_exits_128_plus_signum(
    tmp_path: Path, signum: int, via_key: bool
) -> None:
    home = tmp_path / "home"
    env = cli_env(home)
    with stalled_listener() as (port, accepted):
        chat = Pty([sys.executable, "-m", "appserver", "chat", "--url", f"http://127.0.0.1:{port}"], env)
        try:
            assert accepted.wait(30), "chat never connected"
            if via_key:
                chat.write("\x03")  # Ctrl-C at the terminal
            else:
                chat.settle(0.2)
                os.kill(chat.pid, signum)
            code = chat.wait(20)
            text = chat.text()
        finally:
            chat.kill()
    name = signal.Signals(signum).name
    assert code == 128 + signum, (code, text)
    assert f"error: interrupted by {name}: no turn was started" in text, text
    assert "Aborted!" not in text and "Traceback" not in text, text
