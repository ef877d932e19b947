"""Session 25: a server's stop, as the CLI and the clients see it. Real `appserver serve` processes,
real signals, real `appserver run` / `chat` processes, SQLite on disk.

* SIGHUP (a closed terminal or SSH session) killed `serve` at once: requests cut with no 503
  `server_shutting_down`, server.json left behind, the turn still `running` in the store, nothing
  logged. It now stops the server as SIGTERM does (there is no reload).
* `appserver run` (and `chat`) started while the server was stopping failed at once (`cannot reach
  the server`, exit 1), though server.json still named it. They now wait for it to exit, then run
  in-process (`run`) or go to the server that took over (a standby).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from appserver.cli.serve import DRAIN_S, GRACE_S
from tests.support.cli import cli_env, run_cli
from tests.support.net import free_port
from tests.support.serve import ServeProcess, start_serve
from tests.support.wait import wait_for
from tests.test_cron_failover import Serve

pytestmark = pytest.mark.timeout(30)


@contextlib.contextmanager
def slow_stream(sp: ServeProcess, words: int) -> Iterator[Iterator[str]]:
    """A streamed chat completion of `words` words (50 ms apart), started: its remaining lines."""
    body = {"model": "assistant", "messages": [{"role": "user", "content": f"/slow {words}"}], "stream": True}
    with (
        httpx.Client(timeout=20) as client,
        client.stream("POST", f"{sp.url}/v1/chat/completions", json=body, headers={"X-Conversation-Id": "new"}) as r,
    ):
        assert r.status_code == 200
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data:"))  # the stream is under way
        yield lines


def rest_of(lines: Iterator[str]) -> str:
    """What the stream still sends; a cut (the process killed) as `CUT`."""
    got: list[str] = []
    try:
        got.extend(lines)
    except httpx.HTTPError as exc:
        got.append(f"CUT: {exc!r}")
    return "\n".join(got)


def refuses(url: str) -> bool:
    """Whether the server's listener is closed (a stopping server's first step)."""
    parts = urlsplit(url)
    try:
        socket.create_connection((parts.hostname, parts.port), timeout=0.5).close()
    except ConnectionRefusedError:
        return True
    return False


def statuses(home: Path) -> list[str]:
    with contextlib.closing(sqlite3.connect(f"file:{home / 'appserver.db'}?mode=ro", uri=True)) as db:
        return [row[0] for row in db.execute("SELECT status FROM turns ORDER BY rowid")]


@pytest.mark.skipif(
    signal.getsignal(signal.SIGHUP) is signal.SIG_IGN, reason="SIGHUP is ignored here (nohup), as the server keeps it"
)
def test_sighup_stops_serve_as_sigterm_does(tmp_path: Path) -> None:
    home = tmp_path / "home"
    sp = start_serve(home)
    try:
        with slow_stream(sp, 400) as lines:  # 20 s of words: still streaming when the drain ends
            sp.proc.send_signal(signal.SIGHUP)
            rest = rest_of(lines)
        code = sp.proc.wait(15)
    finally:
        sp.kill()
    assert code == 0, code  # a clean stop, not killed by the signal (-1)
    assert "CUT" not in rest and "server_shutting_down" in rest, rest[-300:]  # the stop's stream error
    assert not (home / "server.json").exists()
    assert statuses(home) == ["interrupted"]  # settled by the stop itself, not at the next start
    assert sp.proc.stderr is not None
    assert "SIGHUP: stopping" in sp.proc.stderr.read(5)


def test_sighup_ignored_at_start_stays_ignored() -> None:
    """`nohup appserver serve`: the terminal's hang-up is meant to pass the server by."""
    from appserver.cli.serve import stop_signals

    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        assert signal.SIGHUP not in stop_signals()
    finally:
        signal.signal(signal.SIGHUP, before)
    assert signal.SIGTERM in stop_signals() and signal.SIGINT in stop_signals()


def test_the_stop_wait_outlasts_the_servers_drain() -> None:
    from appserver.cli.run import STOP_WAIT_S

    assert STOP_WAIT_S > GRACE_S + DRAIN_S


def test_run_started_while_the_server_stops_runs_in_process_after_it_exits(tmp_path: Path) -> None:
    home = tmp_path / "home"
    sp = start_serve(home)
    try:
        with slow_stream(sp, 60) as lines:  # 3 s of words: the drain waits for them
            sp.proc.send_signal(signal.SIGTERM)
            wait_for(partial(refuses, sp.url), 5, "the stopping server to close its listener")
            assert sp.proc.poll() is None and (home / "server.json").exists()  # still draining
            started = time.monotonic()
            r = run_cli(home, "run", "hello during the stop", timeout=25)
            took = time.monotonic() - started
            rest = rest_of(lines)
        code = sp.proc.wait(15)
    finally:
        sp.kill()
    assert r.code == 0, (r.code, r.err)
    assert r.out == "echo: hello during the stop\n", r.out
    assert "is stopping; waiting up to" in r.err, r.err
    assert took < GRACE_S + DRAIN_S  # it waited for the drain (3 s), not for a deadline
    assert rest.rstrip().endswith("data: [DONE]"), rest[-300:]  # the short request finished in the drain
    assert code == 0
    assert not (home / "server.json").exists()
    assert statuses(home) == ["completed", "completed"]  # the stream's turn, then run's: once each


def test_chat_started_while_the_server_stops_goes_to_the_standby_that_takes_over(tmp_path: Path) -> None:
    home = tmp_path / "home"
    sp = start_serve(home)
    env = cli_env(home, APPSERVER_CRON_TICK_S="0.2")  # the standby checks the holder every 0.2 s
    standby = Serve(home, free_port(), "--standby", env=env)
    try:
        wait_for(partial(standby.said, "appserver standby:"), 10, "the standby to wait")
        with slow_stream(sp, 40) as lines:  # 2 s of words
            sp.proc.send_signal(signal.SIGTERM)
            wait_for(partial(refuses, sp.url), 5, "the stopping server to close its listener")
            r = run_cli(home, "chat", "--conversation", "new", stdin="hello standby\n/quit\n", env=env, timeout=25)
            rest_of(lines)
        assert sp.proc.wait(15) == 0
        assert r.code == 0, (r.code, r.err)
        assert "echo: hello standby" in r.out, r.out
        assert "is stopping; waiting up to" in r.err, r.err
        assert standby.said("taking over")
    finally:
        sp.kill()
        standby.kill()


def test_sighup_to_the_terminals_process_group_stops_the_gateway_child_cleanly(tmp_path: Path) -> None:
    """A closed terminal sends SIGHUP to serve's whole process group, the gateway child included:
    the child died of it (exit -1, restarted, its accounts never stopped) while serve drained."""
    home = tmp_path / "home"
    env = cli_env(home, WEBHOOK_SECRET="0123456789abcdef0123456789abcdef")
    added = run_cli(
        home, "channels", "add", "webhook", "home", "--set", f"listen=127.0.0.1:{free_port()}",
        "--set", "default_agent=assistant", "--secret", "secret=env:WEBHOOK_SECRET",
        "--set", "reply_url=http://127.0.0.1:9/agent-reply", "--enable", env=env,
    )  # fmt: skip
    assert added.code == 0, added.err
    proc = subprocess.Popen(
        [sys.executable, "-m", "appserver", "serve", "--listen", "127.0.0.1:0", "--channels", "webhook"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own group, as a terminal's foreground job
        # as from a terminal: a test run started under nohup would pass on SIGHUP ignored, which
        # serve keeps (a server started with nohup is meant to outlive its terminal)
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL),
    )
    try:

        def channels_ready() -> bool:
            try:
                base = json.loads((home / "server.json").read_text())["url"]
                body = httpx.get(base + "/readyz", timeout=2).json()
            except (OSError, ValueError, KeyError, httpx.HTTPError):
                return False
            return any(c["name"] == "channels" and c["status"] == "ok" for c in body.get("checks", []))

        wait_for(channels_ready, 20, "the webhook account running")
        os.killpg(proc.pid, signal.SIGHUP)
        _, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode == 0, err[-2000:]
    assert "exited with code -1" not in err and "restarting" not in err, err[-2000:]
    assert "webhook:home: stopped" in err, err[-2000:]
