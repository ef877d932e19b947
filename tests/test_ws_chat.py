"""Issue 5 acceptance 9: `appserver chat` through a pseudo-terminal; plus examples/ws_client.py."""

from __future__ import annotations

import os
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.support.cli import ROOT, cli_env, run_cli
from tests.support.serve import start_serve


class Pty:
    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        pid, fd = pty.fork()
        if pid == 0:  # child
            os.chdir(ROOT)
            os.execvpe(argv[0], argv, env)
        self.pid, self.fd = pid, fd
        self.buf = b""

    def write(self, data: str) -> None:
        os.write(self.fd, data.encode())

    def expect(self, needle: str, timeout: float = 15) -> str:
        deadline = time.monotonic() + timeout
        while needle.encode() not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{needle!r} not seen; output so far:\n{self.buf.decode(errors='replace')}")
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready:
                try:
                    chunk = os.read(self.fd, 65536)
                except OSError:
                    chunk = b""
                if not chunk:
                    raise AssertionError(f"chat exited before {needle!r}:\n{self.buf.decode(errors='replace')}")
                self.buf += chunk
        i = self.buf.index(needle.encode()) + len(needle)
        seen, self.buf = self.buf[:i], self.buf[i:]
        return seen.decode(errors="replace")

    def wait(self, timeout: float = 10) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            try:
                select.select([self.fd], [], [], 0.05)
                os.read(self.fd, 65536)
            except OSError:
                time.sleep(0.05)
        os.kill(self.pid, signal.SIGKILL)
        raise AssertionError("chat did not exit")


def test_chat_in_a_pseudo_terminal(tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = cli_env(home)
    assert run_cli(home, "agents", "create", "--name", "careful", "--tool", "clock=ask", env=env).code == 0
    sp = start_serve(home, env=env)
    try:
        chat = Pty([sys.executable, "-m", "appserver", "chat", "--agent", "careful"], env)
        chat.expect("you> ")
        chat.write("hello there\n")
        chat.expect("echo: hello there")
        chat.expect("you> ")
        chat.write("/call clock {}\n")
        chat.expect("approve? [y/N] ")
        chat.write("y\n")
        chat.expect("clock -> 20")
        chat.expect("you> ")
        chat.write("/slow 300\n")
        chat.expect("w5")
        chat.write("\x03")  # Ctrl-C: the terminal sends SIGINT; the running turn is cancelled
        chat.expect("[cancelled]")
        chat.expect("you> ")
        chat.write("/new\n")
        chat.expect("new conversation conv_")
        chat.write("/quit\n")
        assert chat.wait() == 0
        # what chat showed is what the server stored
        hist = run_cli(home, "conversations", "list", "--agent", "careful", "--json", env=env)
        assert hist.code == 0, hist.err
    finally:
        sp.stop()


def test_example_client_runs(tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = cli_env(home)
    assert run_cli(home, "agents", "create", "--name", "careful", "--tool", "clock=ask", env=env).code == 0
    sp = start_serve(home, env=env)
    try:
        out = subprocess.run(
            [
                sys.executable,
                "examples/ws_client.py",
                "--url",
                sp.url,
                "--agent",
                "careful",
                "--approve",
                "/call clock {}",
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 0, out.stderr
        assert "approval_request clock" in out.stdout and "completed: clock -> 20" in out.stdout
    finally:
        sp.stop()
