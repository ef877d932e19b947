"""The worker's side of tests/support/zygote.py: `appserver_popen` starts `python -m appserver ARGS`
as a fork of this worker's zygote, behind the `subprocess.Popen` interface (pipes, poll, wait,
signals, communicate), or as a new interpreter when a fork cannot stand in for one."""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from appserver.procid import identity, identity_alive

ROOT = Path(__file__).resolve().parent.parent.parent

# Off unless the test suite turns it on (tests/conftest.py): bench/ and examples use these helpers
# too, and measure real `appserver` processes. APPSERVER_TEST_ZYGOTE=0 turns it off in the suite.
DISABLE_ENV = "APPSERVER_TEST_ZYGOTE"
enabled = False


class _Zygote:
    def __init__(self) -> None:
        self.env = dict(os.environ)
        self.env.pop("PYTHONDONTWRITEBYTECODE", None)
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.zygote", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            env=self.env,
            cwd=ROOT,
        )
        theirs.close()
        self.control = mine
        self.pid = os.getpid()
        self.lock = threading.Lock()

    def alive(self) -> bool:
        return self.pid == os.getpid() and self.proc.poll() is None


_lock = threading.Lock()
_zygote: _Zygote | None = None


def _get() -> _Zygote:
    global _zygote
    with _lock:
        if _zygote is None or not _zygote.alive():
            if _zygote is None:
                atexit.register(_stop)
            _zygote = _Zygote()
        return _zygote


def _stop() -> None:
    """At the worker's exit: the zygote ends when its control socket closes; reap it, so that its
    CPU time (and its children's) counts in the suite's as a new interpreter's did."""
    if _zygote is not None and _zygote.pid == os.getpid():
        _zygote.control.close()
        try:
            _zygote.proc.wait(5)
        except subprocess.TimeoutExpired:
            _zygote.proc.kill()


def _interpreter_env(env: dict[str, str]) -> dict[str, str]:
    """The variables read when an interpreter starts (a fork inherits the zygote's reading of them)."""
    return {k: v for k, v in env.items() if k.startswith(("PYTHON", "LC_")) or k in ("LANG", "LANGUAGE")}


def _can_fork(env: dict[str, str] | None) -> bool:
    if not enabled or os.environ.get(DISABLE_ENV) == "0":
        return False
    reference = {k: v for k, v in (_zygote.env if _zygote else os.environ).items() if k != "PYTHONDONTWRITEBYTECODE"}
    return _interpreter_env(dict(os.environ) if env is None else env) == _interpreter_env(reference)


class ZygotePopen(subprocess.Popen):  # type: ignore[type-arg]
    """`subprocess.Popen` of `python -m appserver ARGS` whose process is forked by the zygote: the
    zygote is its parent, so the exit status comes from it (over a socket) instead of waitpid."""

    _reply: socket.socket
    _replies: bytes
    _identity: str
    _orphaned: bool

    def _execute_child(  # type: ignore[override]
        self,
        args: list[str],
        executable: Any,
        preexec_fn: Any,
        close_fds: bool,
        pass_fds: Any,
        cwd: Any,
        env: Any,
        startupinfo: Any,
        creationflags: Any,
        shell: bool,
        p2cread: int,
        p2cwrite: int,
        c2pread: int,
        c2pwrite: int,
        errread: int,
        errwrite: int,
        *_rest: Any,
    ) -> None:
        assert list(args[:3]) == [sys.executable, "-m", "appserver"] and not pass_fds and preexec_fn is None
        zygote = _get()
        reply, theirs = socket.socketpair()
        body = {
            "args": list(args[3:]),
            "env": dict(os.environ) if env is None else {os.fsdecode(k): os.fsdecode(v) for k, v in env.items()},
            "cwd": os.fsdecode(cwd) if cwd is not None else os.getcwd(),
        }
        streams = [fd if fd != -1 else default for fd, default in ((p2cread, 0), (c2pwrite, 1), (errwrite, 2))]
        try:
            with zygote.lock:
                socket.send_fds(zygote.control, [json.dumps(body).encode()], [theirs.fileno(), *streams])
        finally:
            theirs.close()
            # Closes the child's ends here, /dev/null (DEVNULL) among them: closing that again would
            # fail with EBADF, or close a descriptor another thread has opened since.
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
        self._reply, self._replies = reply, b""
        message = self._next_message(None)
        if message is None or "pid" not in message:
            raise OSError(f"the zygote did not start {args}")
        self.pid = message["pid"]
        self._identity = identity(self.pid)
        self._orphaned = False
        self._child_created = True

    def _next_message(self, timeout: float | None) -> dict[str, Any] | None:
        """The zygote's next line (None at end of stream); TimeoutError when none came in time."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._replies:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._reply.settimeout(left)
            try:
                data = self._reply.recv(4096)
            except (TimeoutError, BlockingIOError):
                raise TimeoutError from None
            if not data:
                return None
            self._replies += data
        line, self._replies = self._replies.split(b"\n", 1)
        return dict(json.loads(line))

    def _collect(self, timeout: float | None) -> None:
        """The exit code, once the zygote reports it (the caller holds `_waitpid_lock`). Should the
        zygote die first, the process is known only by /proc: SIGKILL's code once it is gone."""
        if self.returncode is not None:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._orphaned:
            message = self._next_message(timeout)
            if message is not None:
                self.returncode = message["code"]
                self._reply.close()
                return
            self._orphaned = True
        while identity_alive(self._identity):
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError
            time.sleep(0.01)
        self.returncode = -signal.SIGKILL

    def send_signal(self, sig: int) -> None:
        """As Popen's, but the zygote reaps the process at once (no zombie holds its pid until a
        wait here): a pid that no longer names the same process (pid and start time) is left alone."""
        self.poll()
        if self.returncode is not None or not identity_alive(self._identity):
            return
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def _internal_poll(self, _deadstate: int | None = None, *_: Any, **__: Any) -> int | None:
        if self.returncode is None and self._waitpid_lock.acquire(False):  # as Popen: another thread waits
            try:
                self._collect(0)
            except TimeoutError:
                pass
            finally:
                self._waitpid_lock.release()
        return self.returncode

    def _wait(self, timeout: float | None) -> int:
        if self.returncode is None:
            with self._waitpid_lock:
                try:
                    self._collect(timeout)
                except TimeoutError:
                    raise subprocess.TimeoutExpired(self.args, timeout or 0) from None
        assert self.returncode is not None
        return self.returncode


def appserver_popen(args: list[str], *, env: dict[str, str] | None = None, **kw: Any) -> subprocess.Popen[Any]:
    """`subprocess.Popen([sys.executable, "-m", "appserver", *args], env=env, **kw)`, forked from the
    zygote when it can stand in for a new interpreter."""
    command = [sys.executable, "-m", "appserver", *args]
    if _can_fork(env) and not kw.get("pass_fds") and kw.get("preexec_fn") is None:
        return ZygotePopen(command, env=env, **kw)
    return subprocess.Popen(command, env=env, **kw)
