"""Session 28 J: a state file of the home the disk refuses to take, met by a live server.

- `appserver cron run` through a running server whose crons.json cannot be written (a full disk) was
  `error: OSError: the server could not handle this frame` and three chained tracebacks in the
  server's log: now the one line every command gives (naming crons.json), in the error frame
  (`storage_error`) and in the log.
- stopping that server logged a whole traceback ("cron scheduler stopped with an error") from the
  lease's release: now one line.

The disk's refusal is real: the server's file size limit is lowered under it (RLIMIT_FSIZE, which
Python meets with SIGXFSZ ignored, so a write past it fails with EFBIG), a test's stand-in for a
full file system that needs no root and no mount.
"""

from __future__ import annotations

import resource
import time
from pathlib import Path

import pytest

from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, start_serve

pytestmark = pytest.mark.timeout(90)


def _wait(what: str, predicate: object, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _serve_on_a_refusing_disk(home: Path, port: int) -> ServeProcess:
    """A server holding the scheduler lease, then made unable to write any file past 64 bytes:
    crons.json (far larger) can no longer be rewritten."""
    env = cli_env(home)
    add = run_cli(
        home, "cron", "add", "--name", "c2", "--agent", "assistant", "--every", "1h", "--prompt", "y", env=env
    )
    assert add.code == 0, add.err
    sp = start_serve(home, "--listen", f"127.0.0.1:{port}", env=env)
    _wait("the scheduler lease", lambda: sp.proc.stderr.seen("now runs the scheduler"))  # type: ignore[union-attr]
    resource.prlimit(sp.proc.pid, resource.RLIMIT_FSIZE, (64, resource.RLIM_INFINITY))
    return sp


def test_cron_run_through_a_server_that_cannot_write_crons_json_says_one_line(home: Path) -> None:
    crons = home / "crons.json"
    sp = _serve_on_a_refusing_disk(home, 32710)
    try:
        r = run_cli(home, "cron", "run", "c2")
        assert r.code != 0, (r.code, r.out, r.err)
        lines = r.err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), r.err
        assert str(crons) in lines[0] and "could not be written" in lines[0], r.err
        assert "could not handle this frame" not in r.err and "OSError" not in r.err, r.err
        _wait("the frame's log line", lambda: sp.proc.stderr.seen("ws frame failed"))  # type: ignore[union-attr]
        out = sp.proc.stderr.so_far()  # type: ignore[union-attr]
    finally:
        sp.kill()
    failed = [line for line in out.splitlines() if "ws frame failed" in line]
    assert len(failed) == 1 and str(crons) in failed[0] and "file size limit" in failed[0], out
    assert "Traceback" not in out, out


def test_stopping_a_server_that_cannot_release_its_lease_logs_one_line(home: Path) -> None:
    crons = home / "crons.json"
    sp = _serve_on_a_refusing_disk(home, 32711)
    try:
        assert sp.stop() == 0
        out = sp.proc.stderr.read()  # type: ignore[union-attr]
    finally:
        sp.kill()
    released = [line for line in out.splitlines() if "could not release the scheduler lease" in line]
    assert len(released) == 1 and str(crons) in released[0] and "expires" in released[0], out
    assert "Traceback" not in out and "stopped with an error" not in out, out
