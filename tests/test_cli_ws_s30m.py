"""Found by an outside tester:

- `chat` and `run`, started while this home's server was still starting (it holds `serve.lock` but
  has not written server.json), waited for it in silence (up to 20 s), and a stop signal then ended
  them the wrong way: Ctrl-C printed click's "Aborted!" (exit 1), SIGTERM and SIGHUP killed them
  without a word. README: stopped while still connecting, they say `error: interrupted by SIGINT:
  no turn was started` and exit 130 (143, 129). Now that wait is inside their signal handling, and
  a wait longer than a moment says on stderr which starting server it waits for.
- A client tool call never sent to anyone (its client declared the tool on an input queued behind
  another turn, then left before that turn started) was reported to the model as "the client
  disconnected before returning a result ... the tool may have acted". It is now reported as not
  executed: the client that supplies it is gone.

Real `appserver` subprocesses (the CLI and `serve`), a real flock on the home's `serve.lock` held as
a starting `serve` holds it, real WebSocket clients.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from appserver.serverinfo import HomeLock, home_lock_path
from tests.support.cli import ROOT, cli_env, run_cli
from tests.support.serve import DrainedStream, ServeProcess, start_serve_at, stop_all
from tests.support.wait import eventually, wait_for
from tests.support.ws import WS
from tests.support.zygote_client import appserver_popen

pytestmark = pytest.mark.timeout(120)

WAITING = "waiting up to 20 s for the server starting on this home: `appserver serve`"
MYTOOL = {"name": "mytool", "description": "a tool of the client", "parameters": {"type": "object", "properties": {}}}


@pytest.fixture
def starting_home(tmp_path: Path) -> Iterator[Path]:
    """A home whose `serve.lock` is held as a `serve` holds it while it starts, with no server.json."""
    home = tmp_path / "home"
    assert run_cli(home, "agents", "list").code == 0  # the home and its store exist
    lock = HomeLock(home_lock_path(home / "server.json"))
    assert lock.try_acquire(holder="appserver serve")
    try:
        yield home
    finally:
        lock.release()


def _start(home: Path, *args: str) -> tuple[subprocess.Popen[str], DrainedStream]:
    proc = appserver_popen(
        list(args),
        env=cli_env(home),
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    return proc, DrainedStream(proc.stderr)


@pytest.mark.parametrize(
    ("command", "sig"),
    [
        (("chat",), signal.SIGINT),
        (("run", "hi"), signal.SIGINT),
        (("chat",), signal.SIGTERM),
        (("run", "hi"), signal.SIGHUP),
    ],
)
def test_a_stop_signal_while_waiting_for_a_starting_server(
    starting_home: Path, command: tuple[str, ...], sig: signal.Signals
) -> None:
    proc, err = _start(starting_home, *command)
    try:
        # the line says it waits (before, nothing did: it is looked at after the signal's outcome)
        eventually(lambda: err.seen(WAITING), 10)
        assert proc.poll() is None, err.so_far()
        proc.send_signal(sig)
        out = proc.stdout.read() if proc.stdout else ""
        code = proc.wait(20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    said = err.read()
    assert code == 128 + sig, (code, out, said)
    assert "Aborted!" not in said
    lines = said.splitlines()
    assert len(lines) == 2 and WAITING in lines[0], said
    assert lines[1] == f"error: interrupted by {sig.name}: no turn was started", said


def test_run_goes_on_once_the_starting_server_is_gone(tmp_path: Path) -> None:
    """The signal handling of the wait is put back after it: the run then runs in-process as before."""
    home = tmp_path / "home"
    assert run_cli(home, "agents", "list").code == 0
    lock = HomeLock(home_lock_path(home / "server.json"))
    assert lock.try_acquire(holder="appserver serve")
    try:
        proc, err = _start(home, "run", "hi")
        wait_for(lambda: err.seen(WAITING), 20, "run to say it waits for the starting server")
    finally:
        lock.release()  # the server that was starting went away: the home is free
    try:
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0 and out.strip() == "echo: hi", (out, err.read())


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServeProcess]:
    home = tmp_path / "srvhome"
    sp = start_serve_at(home, 55510, cli_env(home), last=55560, step=1)
    try:
        yield sp
    finally:
        stop_all(sp)


def _turn(snapshot_of: str) -> Any:
    def is_it(frame: dict[str, Any]) -> bool:
        return frame.get("type") == "turn_updated" and frame["snapshot"]["turn_id"] == snapshot_of

    return is_it


async def test_a_client_call_never_sent_is_reported_as_not_executed(server: ServeProcess) -> None:
    first, declaring = await WS.open(server.url), await WS.open(server.url)
    try:
        slow = await first.request(
            {"type": "submit_input", "agent": "assistant", "conversation": "new", "input": "/slow 100000"}
        )
        conv = slow["conversation_id"]
        queued = await declaring.request(
            {
                "type": "submit_input",
                "agent": "assistant",
                "conversation": conv,
                "input": "/call mytool {}",
                "client_tools": [MYTOOL],
            }
        )
        assert queued["queue_position"] == 1, queued
        await declaring.close()  # gone before its turn started: no tool_call_request ever sent
        # The server handles the close at once; the slow turn streams a word per 50 ms meanwhile: ten
        # more of its snapshots are passes enough of the server's loop before its turn is cancelled.
        seen = (await first.expect(_turn(slow["turn_id"])))["snapshot"]["revision"]
        await first.expect(lambda f: _turn(slow["turn_id"])(f) and f["snapshot"]["revision"] >= seen + 10)
        cancel = {"type": "cancel", "conversation": conv, "turn_id": slow["turn_id"]}
        assert (await first.request(cancel))["cancelled"] is True
        snap = await first.terminal(queued["turn_id"], timeout=30)
    finally:
        await first.close()
    calls = [b for b in snap["blocks"] if b["type"] == "tool_call"]
    assert len(calls) == 1, snap["blocks"]
    told = calls[0]["output"]
    assert told.startswith("The tool mytool was not executed: the client that supplies it is gone"), told
    assert "may have acted" not in told
    assert snap["status"] == "completed", snap
