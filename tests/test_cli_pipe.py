"""`appserver … | head -1`: a reader that leaves early ends the command quietly.

The broken pipe (EPIPE) reached the CLI's one-line errors (appserver/cli/common.py `explain`) and
came out as `error: (no file named): Broken pipe` with exit code 2, or, with stderr on the same
pipe, as Python's `Exception ignored … BrokenPipeError` at exit. Now it ends the command with no
output and exit code 141 (128 + SIGPIPE), as a shell reports a writer its reader left. A broken
pipe that is not stdout's (a connection) is still reported, in a line that says what broke.

`appserver chat` caught every OSError of its session as the server's, so its closed stdout came out
as `error: cannot reach the server at … Broken pipe` with exit code 1: it now ends as the others do.
"""

from __future__ import annotations

import errno
import hashlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from appserver.cli.common import STDOUT_CLOSED_EXIT, explain, stdout_closed
from tests.support.cli import ROOT, cli_env
from tests.support.serve import ServeProcess, serving
from tests.support.zygote_client import appserver_popen

ROWS = 2000  # `token list`: ~100 bytes a row, far more than a pipe holds (64 KiB)


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A home with many tokens (written as the store writes them: hashes only)."""
    home = tmp_path_factory.mktemp("pipe") / "home"
    auth = home / "auth"
    auth.mkdir(parents=True, mode=0o700)
    tokens = [
        {
            "id": f"tok_{i:012x}",
            "name": f"token-{i}",
            "hash": hashlib.sha256(str(i).encode()).hexdigest(),
            "agents": None,
            "scopes": ["openai", "ws"],
            "created_at": 1767220000.0,
            "expires_at": None,
        }
        for i in range(ROWS)
    ]
    (auth / "tokens.json").write_text(json.dumps({"version": 1, "tokens": tokens}))
    (auth / "tokens.json").chmod(0o600)
    return home


@pytest.mark.parametrize("args", [("token", "list"), ("token", "list", "--json")])
def test_a_reader_that_leaves_early_ends_the_command_quietly(home: Path, args: tuple[str, ...]) -> None:
    with appserver_popen(
        list(args), env=cli_env(home), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    ) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        first = proc.stdout.read(100)  # what `head -c 100` takes, then it goes
        proc.stdout.close()
        err = proc.stderr.read().decode()
        code = proc.wait(30)
    assert first, err
    assert err == "", err  # no "error: … Broken pipe", no traceback, no "Exception ignored"
    # `--json` too: one write of the whole array, ended short by the kernel when the reader left
    # while it blocked, was reported done by Python (exit 0); it is written in pieces now.
    assert code == STDOUT_CLOSED_EXIT, code


def test_piped_into_head_with_stderr_on_the_same_pipe(home: Path) -> None:
    """As an operator types it, through a shell: `appserver token list 2>&1 | head -1`."""
    script = f'"{sys.executable}" -m appserver token list 2>&1 | head -1; echo "status=${{PIPESTATUS[0]}}"'
    done = subprocess.run(
        ["bash", "-c", script], env=cli_env(home), cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    lines = done.stdout.splitlines()
    assert len(lines) == 2 and lines[0].startswith("ID "), done.stdout
    assert lines[1] == f"status={STDOUT_CLOSED_EXIT}", done.stdout
    assert done.stderr == "", done.stderr


def test_a_broken_pipe_that_is_not_stdouts_is_still_an_error() -> None:
    """pytest's captured stdout is no pipe: a broken connection is reported, and says so."""
    exc = BrokenPipeError(errno.EPIPE, "Broken pipe")
    assert not stdout_closed(exc)
    message = explain(exc)
    assert message is not None and message.startswith("broken pipe:") and "no file named" not in message


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """A real `appserver serve` on loopback (its home comes with the echo agent `assistant`)."""
    with serving(tmp_path_factory.mktemp("pipechat") / "home") as sp:
        yield sp


def test_chat_whose_reader_leaves_ends_quietly_not_as_a_lost_server(server: ServeProcess) -> None:
    """`appserver chat | head -1`: the banner is read, the reader goes, a line comes in on stdin."""
    with appserver_popen(
        ["chat"],
        env=cli_env(server.home),
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    ) as proc:
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        first = proc.stdout.readline()  # what `head -1` takes, then it goes
        proc.stdout.close()
        proc.stdin.write(b"hello\n")  # the session writes again (the line, its reply): EPIPE
        proc.stdin.close()
        err = proc.stderr.read().decode()
        code = proc.wait(30)
    assert first.startswith(b"chatting with assistant"), (first, err)
    assert "cannot reach" not in err, err
    assert err == "", err  # no "error: … Broken pipe", no traceback, no "Exception ignored"
    assert code == STDOUT_CLOSED_EXIT, (code, err)


def test_a_piped_quit_waits_for_the_lines_before_it(server: ServeProcess) -> None:
    """`printf 'hello\n/quit\n' | appserver chat`: the /quit acted as it was read, while hello's
    reply streamed, so the reply never showed and the lines after it were dropped. A script's lines
    run in order, its /quit too."""
    with appserver_popen(
        ["chat", "--conversation", "new"],
        env=cli_env(server.home),
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    ) as proc:
        out, err = proc.communicate(b"/slow 12\nsecond\n/quit\nthird\n", timeout=30)
    text = out.decode()
    assert "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12" in text, (text, err)
    assert "echo: second" in text and "echo: third" not in text, (text, err)
    assert proc.returncode == 0, (proc.returncode, err)
