"""`appserver chat` leaving: its exit code and the terminal it leaves behind (fix 17, items 1-2).

* Piped input that ended with `/quit` made `chat` exit 0 after a failed turn (without `/quit`, 1):
  a script reads the outcome from the exit code however its input ends. A person at the terminal
  saw each `[failed: …]` line and went on: `/quit` there stays 0 (README).
* SIGTERM or SIGHUP while a reply streamed killed `chat` with its terminal left in cbreak mode (no
  echo, no line editing): only SIGINT was handled. Now the terminal is restored at once and `chat`
  exits with 128 + the signal number, as a shell reports a process the signal ended.
"""

from __future__ import annotations

import os
import signal
import sys
import termios
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cli import CLIResult, cli_env, run_cli
from tests.support.serve import ServeProcess, serving
from tests.test_chat_terminal import Pty

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, str], ServeProcess]]:
    home = tmp_path_factory.mktemp("chat_exit") / "home"
    env = cli_env(home)
    with serving(home, env=env) as sp:
        yield home, env, sp


def piped_chat(home: Path, stdin: str, timeout: float = 60) -> CLIResult:
    """`appserver chat` with `stdin` as its input (a pipe: no terminal)."""
    return run_cli(home, "chat", "--conversation", "new", stdin=stdin, timeout=timeout)


def test_piped_chat_that_ends_with_quit_still_exits_1_after_a_failed_turn(
    server: tuple[Path, dict[str, str], ServeProcess],
) -> None:
    home, _, _ = server
    for script in ("/error 401\n/quit\n", "/error 401\n/exit\n", "/error 401\nhello\n/quit\n"):
        r = piped_chat(home, script)
        assert r.code == 1, (script, r.code, r.out, r.err)
        assert "[failed:" in r.out, r.out
        assert "Traceback" not in r.err, r.err
    ok = piped_chat(home, "hello\n/quit\n")  # nothing failed: a success
    assert ok.code == 0, (ok.code, ok.out, ok.err)
    assert "echo: hello" in ok.out, ok.out


def test_interactive_quit_after_a_failed_turn_stays_0(server: tuple[Path, dict[str, str], ServeProcess]) -> None:
    """The person saw `[failed: …]` and chose to leave: as README says, only piped input turns a
    failure into exit code 1 (guards that item 1 did not change the terminal's behaviour)."""
    _, env, _ = server
    chat = Pty([sys.executable, "-m", "appserver", "chat", "--conversation", "new"], env)
    try:
        chat.expect("you> ")
        chat.write("/error 401\n")
        chat.expect("[failed:")
        chat.expect("you> ")
        chat.write("/quit\n")
        assert chat.wait() == 0
    finally:
        chat.kill()


def modes(fd: int) -> tuple[bool, bool]:
    """(echo, canonical) of the terminal behind the pty master `fd`."""
    lflag = termios.tcgetattr(fd)[3]
    return bool(lflag & termios.ECHO), bool(lflag & termios.ICANON)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_while_a_reply_streams_restores_the_terminal_and_exits_128_plus_signum(
    server: tuple[Path, dict[str, str], ServeProcess], signum: int
) -> None:
    _, env, _ = server
    chat = Pty([sys.executable, "-m", "appserver", "chat", "--conversation", "new"], env)
    try:
        before = modes(chat.fd)
        assert before == (True, True), before  # a fresh pty: echo and line editing
        chat.expect("you> ")
        assert modes(chat.fd) == (False, False)  # chat's cbreak mode
        chat.write("/slow 200\n")  # 200 words 50 ms apart: far longer than the test needs
        chat.expect("w3 ")
        os.kill(chat.pid, signum)
        code = chat.wait(timeout=15)
        assert code == 128 + signum, (code, chat.screen())  # exited by itself, not killed (-signum)
        assert modes(chat.fd) == before, "the terminal was left without echo / line editing"
        assert "Traceback" not in chat.text(), chat.text()
    finally:
        chat.kill()
