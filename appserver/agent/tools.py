"""Server-side tools and the per-agent policy that gates them (allow | ask | deny)."""

from __future__ import annotations

import asyncio
import ctypes
import json
import math
import os
import re
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from appserver.config import Config
from appserver.procid import identity, identity_alive
from appserver.providers.base import ToolSpec
from appserver.store.records import AgentRecord
from appserver.values import value

# Every tool process carries these in its environment (its children inherit them): which server
# started it and for which home, so the next server of that home can find and kill what a dead
# one left running (`reap_orphaned_tools`).
TOOL_OWNER_ENV = "APPSERVER_TOOL_OWNER"
TOOL_HOME_ENV = "APPSERVER_TOOL_HOME"
PR_SET_PDEATHSIG = 1


@value
class ToolOutput:
    text: str
    is_error: bool = False


@dataclass(slots=True)
class ToolContext:
    agent: AgentRecord
    conversation_id: str
    turn_id: str
    config: Config  # what a tool needs beyond this is bound when the tool is built (e.g. `schedule_tool(store)`)

    @property
    def workspace(self) -> Path:
        return self.config.workspace(self.agent.id)


ToolFn = Callable[[dict[str, Any], ToolContext], Awaitable[ToolOutput]]


@value
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]
    run: ToolFn
    default_policy: str = "allow"
    enabled_by_default: bool = True  # False: offered only when the agent names it in its policies
    read_only: bool = True  # read-only tools run together; writers are serialised per resource key
    resource_key: Callable[[dict[str, Any], ToolContext], str] | None = None

    def spec(self) -> ToolSpec:
        return ToolSpec(self.name, self.description, self.parameters)


class ToolRegistry:
    """The server tools known to one Server. Built once; front ends never add to it."""

    def __init__(self, tools: list[Tool] | None = None) -> None:
        self._tools: dict[str, Tool] = {}
        # offered() per agent tool policies: asked twice per turn, and most agents share a few
        self._offered: dict[tuple[tuple[str, Any], ...], tuple[Tool, ...]] = {}
        for tool in tools or []:
            self.add(tool)

    def add(self, tool: Tool) -> None:
        self._tools[tool.name] = tool
        self._offered.clear()

    def get(self, name: str) -> Tool | None:
        return self._tools.get(name)

    def names(self) -> list[str]:
        return sorted(self._tools)

    def policy(self, agent: AgentRecord, name: str) -> str | None:
        """The effective policy of a server tool for an agent, or None when it is not offered."""
        tool = self._tools.get(name)
        if tool is None:
            return None
        configured = agent.tools.get(name)
        if configured is None:
            return tool.default_policy if tool.enabled_by_default else None
        return configured

    def offered(self, agent: AgentRecord) -> list[Tool]:
        key = tuple(agent.tools.items())
        try:
            hit = self._offered.get(key)
        except TypeError:  # a policy value that is not hashable: nothing to share
            return self._offer(agent)
        if hit is None:
            if len(self._offered) >= 256:
                self._offered.clear()
            hit = self._offered[key] = tuple(self._offer(agent))
        return list(hit)

    def _offer(self, agent: AgentRecord) -> list[Tool]:
        return [t for n, t in sorted(self._tools.items()) if self.policy(agent, n) in ("allow", "ask")]


# ---------------------------------------------------------------- built-in tools


TZ_NAME_MAX = 64  # the longest IANA name is about 32 characters; a longer one is refused unread
_TZ_NAME = re.compile(r"[A-Za-z0-9_+-]+(?:/[A-Za-z0-9_+-]+)*")


def zone_named(name: object) -> ZoneInfo | None:
    """The IANA zone a model or user named, or None when `name` is not one. Checked before the
    zone database is read (at most TZ_NAME_MAX characters of letters, digits, `_`, `+`, `-` in
    `/`-separated parts: no path, no NUL), and every error of the lookup (not found, not a zone
    file, a name the file system refuses) is None: the caller says "unknown timezone", never an
    OSError that names the server's files."""
    if not isinstance(name, str) or len(name) > TZ_NAME_MAX or not _TZ_NAME.fullmatch(name):
        return None
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        return None


def shown_zone(name: object) -> str:
    """A timezone name as an error message quotes it: shortened, never thousands of characters."""
    text = repr(name)
    return text if len(text) <= TZ_NAME_MAX + 2 else f"{text[:TZ_NAME_MAX]}… ({len(str(name)):,} characters)"


async def _clock(args: dict[str, Any], ctx: ToolContext) -> ToolOutput:
    tz_name = args.get("timezone") or "UTC"
    tz = zone_named(tz_name)
    if tz is None:
        return ToolOutput(
            f"unknown timezone {shown_zone(tz_name)}; use an IANA name such as Europe/Paris", is_error=True
        )
    return ToolOutput(datetime.now(tz).isoformat(timespec="seconds") + f" ({tz_name})")


KILL_GRACE_S = 5.0  # after the kill, how long the command's output pipe may take to close


class _BoundedOutput(asyncio.SubprocessProtocol):
    """The combined output of a shell command, read as it comes and never paused: the first `cap`
    bytes are kept, the rest only counted, so a command that floods its output neither grows the
    server's memory nor blocks on a full pipe (it runs to its end, or to its timeout).
    `finished` is done once the process has exited and its output pipe is closed."""

    def __init__(self, cap: int, loop: asyncio.AbstractEventLoop) -> None:
        self.cap = cap
        self.kept = bytearray()
        self.total = 0
        self.finished: asyncio.Future[None] = loop.create_future()

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        self.total += len(data)
        room = self.cap - len(self.kept)
        if room > 0:
            self.kept += data[:room]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.finished.done():
            self.finished.set_result(None)

    def text(self) -> str:
        text = bytes(self.kept).decode("utf-8", "replace")
        if self.total > len(self.kept):
            text += f"\n[output truncated: {self.total} bytes, showing the first {len(self.kept)}]"
        return text


def _kill_group(pid: int | None) -> None:
    if pid is None:
        return
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


async def _shell(args: dict[str, Any], ctx: ToolContext) -> ToolOutput:
    command = args.get("command")
    if not isinstance(command, str) or not command.strip():
        return ToolOutput("shell needs a non-empty string argument 'command'", is_error=True)
    limits = ctx.config.limits
    asked = args.get("timeout_s")
    if asked is not None and (
        isinstance(asked, bool) or not isinstance(asked, (int, float)) or not math.isfinite(asked) or asked <= 0
    ):  # checked before anything runs: a NaN or negative timeout killed the command at once
        return ToolOutput(f"'timeout_s' must be a positive number of seconds, got {asked!r}", is_error=True)
    timeout = min(float(asked or limits.shell_timeout_s), limits.shell_timeout_s)
    workspace = ctx.workspace
    workspace.mkdir(parents=True, exist_ok=True, mode=0o700)
    loop = asyncio.get_running_loop()
    # A protocol of our own rather than Process.communicate(): its reader stops reading past its
    # buffer limit, and a command killed then never shows EOF, so the kill's wait never ended (and
    # the agent's workspace lock stayed held); and communicate() kept every byte until the end.
    transport, out = await loop.subprocess_exec(
        lambda: _BoundedOutput(limits.shell_output_max_bytes, loop),
        "/bin/sh",
        "-c",
        _GROUP_GUARD,
        "appserver-tool",
        command,
        cwd=workspace,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        stdin=asyncio.subprocess.DEVNULL,
        start_new_session=True,  # its own process group: killed whole on timeout, cancel or reap
        preexec_fn=_die_with_server(),
        env={**os.environ, TOOL_OWNER_ENV: identity(), TOOL_HOME_ENV: str(ctx.config.home)},
    )
    timed_out = False
    try:
        await asyncio.wait({out.finished}, timeout=timeout)
        timed_out = not out.finished.done()
    finally:  # timed out or cancelled: the whole group goes, and nothing here waits unbounded
        if not out.finished.done():
            _kill_group(transport.get_pid())
            # the output drains until the pipe closes; one held open by a process that left the
            # group (setsid) is closed on our side below instead of waited for
            await asyncio.wait({out.finished}, timeout=KILL_GRACE_S)
        transport.close()  # kills the leader if it still runs, closes the pipes
    if timed_out:
        note = f"command timed out after {timeout:g} s and was killed"
        return ToolOutput(f"{note}; its output until then:\n{out.text()}" if out.total else note, is_error=True)
    code = transport.get_returncode()
    if code:
        return ToolOutput(f"exit code {code}\n{out.text()}", is_error=True)
    return ToolOutput(out.text())


# The tool's process-group leader: runs the command in a child shell and, when told the server
# died (SIGTERM from PR_SET_PDEATHSIG), kills the whole group at once, so nothing the command
# started in the background goes on making side effects until the next start. `wait` returns the
# command's status. What leaves the group (setsid) is killed by the next server's reap.
_GROUP_GUARD = 'trap "trap - TERM; kill -KILL 0" TERM; /bin/sh -c "$1" & wait $!'


def _die_with_server() -> Callable[[], None] | None:
    """On Linux, a preexec_fn that has the kernel signal the tool's group leader when the server
    dies (PR_SET_PDEATHSIG: SIGTERM, which `_GROUP_GUARD` turns into SIGKILL for its whole process
    group), so a server killed with kill -9 leaves nothing of the command running. What escaped the
    group is killed by the next server (`reap_orphaned_tools`)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    server = os.getpid()

    def preexec() -> None:  # in the child, between fork and exec: no locks, no allocation to speak of
        prctl(
            ctypes.c_int(PR_SET_PDEATHSIG),
            ctypes.c_ulong(signal.SIGTERM),
            ctypes.c_ulong(0),
            ctypes.c_ulong(0),
            ctypes.c_ulong(0),
        )
        if os.getppid() != server:  # the server died before the signal was armed
            os._exit(137)

    return preexec


def reap_orphaned_tools(home: Path, me: str) -> int:
    """Kill what tool commands of a dead server of this home left running (a kill -9 gives the
    server no chance to): every process whose environment names this home and a tool owner that
    is neither `me` nor alive, with its process group. Returns how many processes were found."""
    try:
        entries = [e.name for e in os.scandir("/proc") if e.name.isdigit()]
    except OSError:
        return 0  # no /proc: nothing to find this way
    want_home = str(home).encode()
    owner_key = TOOL_OWNER_ENV.encode() + b"="
    mine = os.getpgrp()
    found: list[tuple[int, int]] = []
    for name in entries:
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                raw = f.read()
        except OSError:
            continue  # gone, or not ours to read
        if owner_key not in raw:
            continue
        env = dict(item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
        owner = env.get(TOOL_OWNER_ENV.encode(), b"").decode("utf-8", "replace")
        if env.get(TOOL_HOME_ENV.encode()) != want_home or owner == me or identity_alive(owner):
            continue
        try:
            found.append((int(name), os.getpgid(int(name))))
        except ProcessLookupError:
            continue
    for pid, pgid in found:
        try:
            if pgid != mine:
                os.killpg(pgid, signal.SIGKILL)
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return len(found)


CLOCK = Tool(
    name="clock",
    description="Current date and time in a timezone (IANA name, default UTC).",
    parameters={"type": "object", "properties": {"timezone": {"type": "string"}}, "additionalProperties": False},
    run=_clock,
)

SHELL = Tool(
    name="shell",
    description="Run a shell command in the agent's workspace directory; returns its combined output.",
    parameters={
        "type": "object",
        "properties": {"command": {"type": "string"}, "timeout_s": {"type": "number"}},
        "required": ["command"],
    },
    run=_shell,
    default_policy="ask",
    enabled_by_default=False,
    read_only=False,
    resource_key=lambda args, ctx: f"workspace:{ctx.agent.id}",
)


def builtin_tools() -> list[Tool]:
    return [CLOCK, SHELL]


def parse_arguments(arguments: str) -> dict[str, Any]:
    """Parse tool-call arguments; raise ValueError with a model-readable message."""
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError as exc:
        raise ValueError(f"arguments are not valid JSON ({exc.msg} at position {exc.pos})") from None
    if not isinstance(value, dict):
        raise ValueError("arguments must be a JSON object")
    return value
