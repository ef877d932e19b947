"""`python -m appserver ...` without paying Python's start and the imports each time: a fork server.

Most of an `appserver` process's start in the suite was Python starting and importing the CLI, the
kernel and their libraries: ~0.3 s wall and ~0.15-0.2 CPU-s for each of ~230 CLI calls and ~200
`serve` starts. A zygote imports them once per xdist worker; each process is then a fork of it that
runs `appserver/__main__.py` as `python -m appserver` does (runpy with the same `sys.argv`,
`__main__`, environment, working directory and standard streams) and ends through the
interpreter's own exit (atexit handlers, thread joins, a traceback and status 1 for an uncaught
exception). The zygote only imports: nothing it holds was touched by a command, so each process
starts from a fresh process's state.

Run as `python -m tests.support.zygote FD`, FD a Unix SOCK_SEQPACKET socket; each request on it is
one message: JSON {"args", "env", "cwd"} with four descriptors (the reply socket, stdin, stdout,
stderr). The reply socket gets the child's pid, then its exit code (negative: killed by a signal,
as in `subprocess`). The zygote exits when the worker closes its end.
"""

from __future__ import annotations

import array
import gc
import json
import os
import runpy
import selectors
import signal
import socket
import sys
from typing import Any

MAX_FDS = 4


def _recv_request(control: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    fds = array.array("i")
    msg, ancdata, _flags, _addr = control.recvmsg(1 << 20, socket.CMSG_LEN(MAX_FDS * fds.itemsize))
    if not msg:
        return None
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
    return json.loads(msg), list(fds)


def _serve(control: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """Fork a child per request; return (in the child) the request it is to run, or None (in the
    zygote) when the worker went away."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that SIGCHLD writes to the wakeup fd
    waiting: dict[int, socket.socket] = {}
    sel = selectors.DefaultSelector()
    sel.register(control, selectors.EVENT_READ, "control")
    sel.register(wake_r, selectors.EVENT_READ, "wake")
    while True:
        for key, _ in sel.select():
            if key.data == "wake":
                os.read(wake_r, 4096)
            else:
                request = _recv_request(control)
                if request is None:
                    return None
                body, fds = request
                pid = os.fork()
                if pid == 0:
                    sel.close()
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    os.close(wake_r)
                    os.close(wake_w)
                    for reply in waiting.values():
                        reply.close()
                    control.close()
                    os.close(fds[0])
                    return body, fds
                reply = socket.socket(fileno=fds[0])
                for fd in fds[1:]:
                    os.close(fd)
                waiting[pid] = reply
                try:
                    reply.sendall(json.dumps({"pid": pid}).encode() + b"\n")
                except OSError:  # the caller went away: its child still gets reaped below
                    pass
        while waiting:  # reap every child that ended
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            done = waiting.pop(pid, None)
            if done is not None:
                try:
                    done.sendall(json.dumps({"code": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                except OSError:
                    pass
                done.close()


def _run(body: dict[str, Any], fds: list[int]) -> None:
    """In the child: become `python -m appserver ARGS` run from CWD with ENV and the given streams."""
    for target, fd in zip((0, 1, 2), fds[1:], strict=True):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(body["cwd"])
    os.environ.clear()
    os.environ.update(body["env"])
    sys.path[0] = body["cwd"]  # as `-m` puts the working directory first
    sys.argv = ["-m", *body["args"]]  # runpy sets argv[0] to the module's file, as `-m` does
    runpy.run_module("appserver", run_name="__main__", alter_sys=True)


def _preload() -> None:
    """Import what the commands import, so that a call pays none of it."""
    from appserver.cli.main import COMMANDS

    for command in COMMANDS.values():
        command.load()
    import appserver.server  # noqa: F401  (the commands import it when they run)


def main() -> None:
    _preload()
    # What every child inherits lives as long as it: out of the collector's way, as a pre-forking
    # server does (a `serve` child then collects and freezes only what it built itself).
    gc.collect()
    gc.freeze()
    control = socket.socket(fileno=int(sys.argv[1]))
    request = _serve(control)
    if request is None:
        return
    _run(*request)


if __name__ == "__main__":
    main()
