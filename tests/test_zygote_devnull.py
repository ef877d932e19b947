"""`appserver_popen` (tests/support/zygote_client.py) takes every kind of stream `subprocess.Popen`
takes: DEVNULL, PIPE, None (inherit) and an open file. DEVNULL used to fail with EBADF: Popen's own
`_close_pipe_fds` closes its /dev/null descriptor, and the zygote client closed it a second time."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.support import zygote_client
from tests.support.cli import ROOT
from tests.support.zygote_client import ZygotePopen, appserver_popen

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _forked() -> None:
    if not zygote_client._can_fork(None):
        pytest.skip("the zygote is off (APPSERVER_TEST_ZYGOTE=0): plain Popen runs instead")


def _open_fds() -> set[int]:
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


def test_devnull_for_every_stream() -> None:
    zygote_client._get()  # its control socket stays open for the worker's life: not counted
    before = _open_fds()
    proc = appserver_popen(
        ["--help"], cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    assert isinstance(proc, ZygotePopen)
    assert proc.wait(30) == 0
    assert _open_fds() <= before  # no descriptor left open (nor one of ours closed twice)


def test_pipe_none_and_a_file(tmp_path: Path) -> None:
    out = tmp_path / "out.txt"
    with open(out, "wb") as file:
        proc = appserver_popen(["--help"], cwd=ROOT, stdin=None, stdout=file, stderr=subprocess.PIPE)
        assert isinstance(proc, ZygotePopen)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and err == b""
    assert b"Usage" in out.read_bytes()
    piped = appserver_popen(["--help"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    text, _ = piped.communicate(timeout=30)
    assert piped.returncode == 0 and "Usage" in text
