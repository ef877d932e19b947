"""Session 39 (e): `appserver chat` and `appserver run` at the edges of a session.

* `/new` against a stalled server awaited its three requests inside the session's one event loop:
  Ctrl-C, `/quit` and keys waited behind it, and after 30 s the TimeoutError ended the whole session
  (exit 1), held lines and all. Now `/new` runs beside the session, as a submitted line does: Ctrl-C
  calls it off at once (a second one exits 130), and chat stays in the conversation it was in.
* A Ctrl-C in the first second of `run` or `chat` (the CLI importing, loading its command, reading
  the home's config) was a KeyboardInterrupt traceback, or click's `Aborted!` and exit 1.
* A Ctrl-C while chat closed its connection after `/quit` (a stalled server, up to a second) said
  `error: interrupted by SIGINT: no turn was started` and exited 130.
* A line entered while a reply streamed (held, never echoed) vanished without a word when the
  connection was then lost for good.
* Backspace after a big paste drew the whole paste again, per key (a megabyte written each time).

Real `appserver serve` processes (the echo model), chat in a real pseudo-terminal, `run` as a real
`python -m appserver` (no zygote: the imports are what is interrupted).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cli import ROOT, cli_env
from tests.support.serve import ServeProcess, serving, start_serve
from tests.test_chat_terminal import Pty, rows

pytestmark = pytest.mark.timeout(60)

PASTE_START, PASTE_END = "\x1b[200~", "\x1b[201~"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeProcess, dict[str, str]]]:
    home = tmp_path_factory.mktemp("chat39e") / "home"
    env = cli_env(home)
    with serving(home, env=env) as sp:
        yield sp, env


def chat(env: dict[str, str], *args: str) -> Pty:
    return Pty([sys.executable, "-m", "appserver", "chat", "--conversation", "new", *args], env)


def conv_of(banner: str) -> str:
    return banner.split("in conversation ", 1)[1].split()[0]


def wait_exit(p: Pty, timeout: float) -> int | None:
    """The exit code once chat exits within `timeout` seconds, else None (it is still running)."""
    try:
        return p.wait(timeout)
    except AssertionError:
        return None


def user_messages(home: Path, conv: str) -> list[str]:
    sql = f"SELECT content FROM messages WHERE conversation_id='{conv}' AND role='user' ORDER BY id"
    return [json.loads(c) for (c,) in rows(home, sql)]


def test_ctrl_c_calls_off_a_new_conversation_the_stalled_server_has_not_answered(
    server: tuple[ServeProcess, dict[str, str]],
) -> None:
    sp, env = server
    # Ctrl-C while /new waits: called off at once; a second Ctrl-C exits 130
    p = chat(env)
    try:
        p.expect("you> ", timeout=30)
        os.kill(sp.proc.pid, signal.SIGSTOP)
        try:
            p.write("/new\r")
            p.expect("/new")
            time.sleep(0.3)
            os.kill(p.pid, signal.SIGINT)
            p.expect("^C calling /new off (Ctrl-C again to exit)", timeout=5)
            os.kill(p.pid, signal.SIGINT)
            code = wait_exit(p, 5)
        finally:
            os.kill(sp.proc.pid, signal.SIGCONT)
        assert code == 130, p.text()[-600:]
    finally:
        p.kill()
    # called off, then the server answers: chat stays in its conversation, and what was typed
    # meanwhile goes there; a /new later works
    p = chat(env)
    try:
        old = conv_of(p.expect("you> ", timeout=30))
        os.kill(sp.proc.pid, signal.SIGSTOP)
        try:
            p.write("/new\r")
            p.expect("/new")
            p.write("typed after it\r")  # held behind /new
            time.sleep(0.3)
            os.kill(p.pid, signal.SIGINT)
            p.expect("^C calling /new off", timeout=5)
        finally:
            os.kill(sp.proc.pid, signal.SIGCONT)
        p.expect(f"[/new called off: still in conversation {old}]", timeout=15)
        p.expect("echo: typed after it", timeout=15)
        p.expect("you> ", timeout=15)
        p.write("/new\r")
        new = p.expect("you> ", timeout=15).split("new conversation ", 1)[1].split()[0]
        assert new != old
        p.write("in the new one\r")
        p.expect("echo: in the new one", timeout=15)
        p.expect("you> ", timeout=15)
        p.write("/quit\r")
        assert p.wait(15) == 0
    finally:
        p.kill()
    assert user_messages(sp.home, old) == ["typed after it"]
    assert user_messages(sp.home, new) == ["in the new one"]


def test_ctrl_c_while_the_cli_starts_is_one_line_and_130(tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = cli_env(home)

    def started(code: str) -> float:
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, check=True, timeout=60)
        return time.monotonic() - t0

    bare = started("pass")  # the interpreter's own start (its site module), which no code of ours sees
    loaded = started("import appserver.cli.main, appserver.cli.run")
    for share in (0.3, 0.6, 0.9, 1.3):
        delay = bare + share * max(0.05, loaded - bare)
        proc = subprocess.Popen(
            [sys.executable, "-m", "appserver", "run", "/slow 60"],
            env=env,
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            time.sleep(delay)
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        said = f"Ctrl-C {delay:.2f} s in: exit {proc.returncode}, {err[-800:]!r}"
        assert "Traceback" not in err and "Aborted!" not in err, said
        assert proc.returncode == 130, said
        assert err.startswith("error: interrupted by SIGINT: "), said


def test_ctrl_c_while_chat_closes_after_quit_changes_nothing(server: tuple[ServeProcess, dict[str, str]]) -> None:
    sp, env = server
    p = chat(env)
    try:
        p.expect("you> ", timeout=30)
        p.write("hello\r")
        p.expect("echo: hello", timeout=15)
        p.expect("you> ", timeout=15)
        os.kill(sp.proc.pid, signal.SIGSTOP)  # the closing handshake goes unanswered (up to a second)
        try:
            p.write("/quit\r")
            p.expect("/quit")
            time.sleep(0.3)
            os.kill(p.pid, signal.SIGINT)
            code = wait_exit(p, 10)
        finally:
            os.kill(sp.proc.pid, signal.SIGCONT)
        assert "no turn was started" not in p.text(), p.text()[-400:]
        assert code == 0, p.text()[-400:]
    finally:
        p.kill()


def test_a_held_line_is_named_when_the_connection_is_lost_for_good(tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = cli_env(home)
    sp = start_serve(home, env=env)
    p = chat(env, "--reconnect-wait", "1")
    try:
        p.expect("you> ", timeout=30)
        p.write("/slow 400\r")
        p.expect("w3 ", timeout=15)
        p.write("my important question\r")  # held: sent after the turn, never echoed meanwhile
        p.write("and half a")  # typed, not entered
        time.sleep(0.3)
        sp.proc.kill()
        sp.proc.wait(10)
        assert p.wait(30) == 1
        text = p.text()
        assert "error: lost the server" in text, text[-600:]
        assert 'not sent: "my important question"' in text, text[-600:]
        assert 'not sent: "and half a"' in text, text[-600:]
    finally:
        p.kill()
        sp.kill()


def test_backspace_after_a_big_paste_draws_its_last_line_not_the_paste(
    server: tuple[ServeProcess, dict[str, str]],
) -> None:
    sp, env = server
    p = chat(env)
    try:
        conv = conv_of(p.expect("you> ", timeout=30))
        line = "line of text " * 40  # 520 columns: several rows each
        pasted = (line + "\n") * 500  # 260 kB
        data = (PASTE_START + pasted + PASTE_END).encode()
        for at in range(0, len(data), 4096):  # read the echo as it comes (a terminal does)
            p.write(data[at : at + 4096].decode())
            p.settle(0.01)
        p.settle(0.5)
        before = len(p.raw)
        p.write("\x7f\x7f\x7fZ")  # the last newline, and 2 characters of the line before it, then a key
        p.expect("Z", timeout=20)
        p.settle(0.3)
        drawn = len(p.raw) - before
        assert drawn < 5 * len(line), f"{drawn:,} bytes drawn for 4 keys after a {len(pasted):,}-character paste"
        p.write("\r")
        p.expect("echo: line of text", timeout=20)
        p.expect("you> ", timeout=20)
        p.write("/quit\r")
        assert p.wait(15) == 0
    finally:
        p.kill()
    assert user_messages(sp.home, conv) == [pasted[:-3] + "Z"]
