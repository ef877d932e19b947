"""Server-side tools and the per-agent policy that gates them (allow | ask | deny)."""

from __future__ import annotations

import asyncio
import ctypes
import errno
import json
import logging
import math
import os
import re
import signal
import stat
import sys
import unicodedata
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from appserver.config import Config
from appserver.fsutil import dangling_link, error_text, file_kind
from appserver.logredact import ENV_SECRET_NAMES
from appserver.procid import identity, identity_alive
from appserver.providers.base import ToolSpec
from appserver.store.records import EVERY_TOOL, AgentRecord
from appserver.values import value

# Every tool process carries these in its environment (its children inherit them): which server
# started it and for which home, so the next server of that home can find and kill what a dead
# one left running (`reap_orphaned_tools`).
TOOL_OWNER_ENV = "APPSERVER_TOOL_OWNER"
TOOL_HOME_ENV = "APPSERVER_TOOL_HOME"
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36

log = logging.getLogger("appserver.agent")


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
    # why arguments that parse would be refused unrun (None: they would run); asked before approval
    check: Callable[[dict[str, Any]], str | None] | None = None

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
            configured = agent.tools.get(EVERY_TOOL)  # damaged policies (store/records.py)
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
    `finished` is done once the process has exited and its output pipe is closed; `exited` once
    the process has exited, `closed` once the pipe is closed (a process the command left behind
    may hold it open after the command ended)."""

    def __init__(self, cap: int, loop: asyncio.AbstractEventLoop) -> None:
        self.cap = cap
        self.kept = bytearray()
        self.total = 0
        self.finished: asyncio.Future[None] = loop.create_future()
        self.exited: asyncio.Future[None] = loop.create_future()  # the group leader (the guard) exited
        self.closed: asyncio.Future[None] = loop.create_future()  # the output pipe was closed

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        self.total += len(data)
        room = self.cap - len(self.kept)
        if room > 0:
            self.kept += data[:room]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.finished.done():
            self.finished.set_result(None)

    def process_exited(self) -> None:
        if not self.exited.done():
            self.exited.set_result(None)

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)

    def text(self) -> str:
        kept = bytes(self.kept)
        if self.total > len(kept):
            # the cap cut the output: drop a multi-byte character it cut in two (never a U+FFFD
            # at the end that the command did not write); a lead byte and its continuation bytes
            # stay only when they are all there
            kept = _whole_characters(kept)
            text = kept.decode("utf-8", "replace")
            text += f"\n[output truncated: {self.total} bytes, showing the first {len(kept)}]"
            return text
        return kept.decode("utf-8", "replace")


def _whole_characters(data: bytes) -> bytes:
    """`data` without a UTF-8 sequence cut off at its end (at most 3 bytes go)."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # not a continuation byte: ASCII or the lead byte of the last sequence
            need = 2 if byte & 0xE0 == 0xC0 else 3 if byte & 0xF0 == 0xE0 else 4 if byte & 0xF8 == 0xF0 else 1
            return data[:-back] if need > back else data
    return data


def _kill_group(pid: int | None) -> None:
    if pid is None:
        return
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _signal(pid: int | None, sig: int) -> None:
    if pid is None:
        return
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


PIPE_GRACE_S = 1.0  # after the command's shell exited, how long its output pipe may take to close


async def _wait(future: asyncio.Future[None], timeout: float) -> bool:
    """Wait (bounded, never cancelling `future`) until it is done; whether it is."""
    if not future.done():
        await asyncio.wait({future}, timeout=timeout)
    return future.done()


def tool_environment(config: Config, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a tool command gets: the server's, without the secrets the server knows it
    holds (defence in depth: the command still runs as the server's user and can read what that
    user can, docs/security.md): each provider's `api_key_env`, the well-known key and token names
    (`logredact.ENV_SECRET_NAMES`), the variables the channels' secret references name
    (`token_env = "…"`) and `PGPASSWORD`; and without every `APPSERVER_*` variable, which configure
    the server, not the command: a provider's `base_url` or `headers` (credentials in them), the
    store URL (its password), `APPSERVER_TOKEN`, `APPSERVER_HOME` (with it the server's own CLI
    acts as the server's owner). The tool's owner and home are added (`reap_orphaned_tools`)."""
    env = {
        name: text
        for name, text in (os.environ if environ is None else environ).items()
        if not name.startswith("APPSERVER_")
    }
    for name in secret_env_names(config):
        env.pop(name, None)
    env[TOOL_OWNER_ENV] = identity()
    env[TOOL_HOME_ENV] = str(config.home)
    return env


def secret_env_names(config: Config) -> set[str]:
    """The names of the environment variables that hold a secret the server knows of."""
    names = set(ENV_SECRET_NAMES)
    names.update(p.api_key_env for p in config.providers.values() if p.api_key_env)
    for accounts in config.channels.accounts.values():
        for account in accounts.values():
            for ref in account.secret_refs.values():
                if ref.get("env"):
                    names.add(ref["env"])
    names.update(("APPSERVER_STORE__URL", "PGPASSWORD"))
    return names


# Linux's MAX_ARG_STRLEN (32 pages of at least 4 KiB) bounds one argument of exec, its NUL included:
# a longer command cannot be handed to /bin/sh -c, so it is refused before anyone is asked about it.
SHELL_COMMAND_MAX_BYTES = 128 * 1024 - 1


def shell_arguments_problem(args: dict[str, Any]) -> str | None:
    """Why the shell tool would refuse these arguments without running anything, or None. The agent
    loop asks this before a call is put to a person for approval: a call that can only fail is
    answered at once, not asked about."""
    command = args.get("command")
    if not isinstance(command, str) or not command.strip():
        return "shell needs a non-empty string argument 'command'"
    if "\0" in command:
        return "'command' must not contain a NUL character (U+0000): a shell command cannot hold one"
    try:
        size = len(os.fsencode(command))
    except UnicodeEncodeError:
        return "'command' must be text: it holds a lone surrogate (a \\udXXX escape without its pair)"
    if size > SHELL_COMMAND_MAX_BYTES:
        return (
            f"'command' is {size} bytes (UTF-8), over the {SHELL_COMMAND_MAX_BYTES} a process argument may "
            "hold; write long content to a file in smaller commands (e.g. appending with >>), then run it"
        )
    asked = args.get("timeout_s")
    if asked is not None and (
        isinstance(asked, bool)
        or not isinstance(asked, (int, float))
        or (isinstance(asked, float) and not math.isfinite(asked))  # an int is exact: 10**400 is no float
        or asked <= 0
    ):  # a NaN or negative timeout killed the command at once, a huge integer failed converting to float
        shown = repr(asked) if len(repr(asked)) <= 40 else repr(asked)[:40] + "…"
        return f"'timeout_s' must be a positive number of seconds, got {shown}"
    return None


async def _shell(args: dict[str, Any], ctx: ToolContext) -> ToolOutput:
    problem = shell_arguments_problem(args)  # checked again: an approved call's arguments too
    if problem is not None:
        return ToolOutput(problem, is_error=True)
    command: str = args["command"]
    limits = ctx.config.limits
    asked = args.get("timeout_s")
    timeout = limits.shell_timeout_s if asked is None or asked >= limits.shell_timeout_s else float(asked)
    workspace = ctx.workspace
    problem = workspace_problem(workspace)
    if problem is not None:
        return _unusable_workspace(ctx, problem)
    loop = asyncio.get_running_loop()
    # A protocol of our own rather than Process.communicate(): its reader stops reading past its
    # buffer limit, and a command killed then never shows EOF, so the kill's wait never ended (and
    # the agent's workspace lock stayed held); and communicate() kept every byte until the end.
    try:
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
            env=tool_environment(ctx.config),
        )
    except OSError as exc:
        if exc.filename == str(workspace):  # it went (or lost its access) since it was checked: chdir failed
            return _unusable_workspace(ctx, workspace_problem(workspace) or error_text(exc))
        if exc.errno != errno.E2BIG:
            raise
        # the command fits one argument, but with the environment it is over the kernel's total
        return ToolOutput(
            f"the command ({len(os.fsencode(command))} bytes) and the server's environment together are "
            "too large for the kernel to start a process; use a shorter command",
            is_error=True,
        )
    guard = transport.get_pid()
    timed_out = False
    resumed = False
    try:
        # The call ends when the command's shell exits (the guard then kills what it left running
        # and exits with its status), not when the output pipe closes: a background child that
        # holds the pipe made a finished command wait for its whole timeout.
        timed_out = not await _wait(out.exited, timeout)
        if timed_out and _stopped(guard):
            # the command stopped its guard (`kill -STOP $PPID`): it could not see the command end.
            # Continued, it ends the call as it would have (killing what was left) when the command
            # has ended; otherwise the timeout's kill follows.
            resumed = True
            _signal(guard, signal.SIGCONT)
            timed_out = not await _wait(out.exited, PIPE_GRACE_S)
        if not timed_out:
            await _wait(out.closed, PIPE_GRACE_S)
    finally:  # timed out or cancelled: everything the command started goes, nothing waits unbounded
        if not out.exited.done():
            # the guard kills every descendant, also one that left the group (setsid); SIGCONT runs
            # a guard the command stopped (a stopped guard kept its SIGTERM pending until the group
            # kill, and what had left the group outlived it). SIGKILL for the group is the
            # backstop when it does not exit in time, after the server killed the guard's
            # descendants itself (a command that stops the guard again and again).
            _signal(guard, signal.SIGTERM)
            _signal(guard, signal.SIGCONT)
            if not await _wait(out.exited, KILL_GRACE_S):
                await _kill_descendants(guard)
            _kill_group(guard)
            await _wait(out.closed, PIPE_GRACE_S)
        else:
            # the guard killed what the command left, a round per level: a chain deeper than its
            # rounds (a re-attack nested 70 subshells) kept its lower levels; those still in the
            # group go now (the group's id stays taken while it has members)
            _kill_group(guard)
        transport.close()  # kills the leader if it still runs, closes the pipes (one still held open too)
    if timed_out:
        note = f"command timed out after {timeout:g} s and was killed"
        if resumed:
            note += " (it had stopped the tool's guard process, which was continued and then ended it)"
        return ToolOutput(f"{note}; its output until then:\n{out.text()}" if out.total else note, is_error=True)
    code = transport.get_returncode()
    text = out.text()
    if resumed:  # truthful as far as known: the command ended while the guard was stopped
        text += (
            f"\n[the command stopped the tool's guard process (SIGSTOP); it was continued after "
            f"{timeout:g} s and the call ended then]"
        )
    if code:
        return ToolOutput(f"exit code {code}\n{text}", is_error=True)
    return ToolOutput(text)


def workspace_problem(workspace: Path) -> str | None:
    """Why a command cannot run in the agent's workspace (made 0700 when missing), or None. Said
    plainly, naming the path at fault: a link to nothing (its disk not mounted) or a loop of links,
    the workspace's or `workspaces/`'s, with its target, and nothing made where it points; a file
    in the place of either; one the server's user cannot enter. mkdir alone said "File exists" of a
    path that, from the user's side, does not exist."""
    dangling = dangling_link(workspace, "directory")
    if dangling is not None:
        return str(dangling)
    try:
        workspace.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        dangling = dangling_link(workspace, "directory")  # it may have become one meanwhile
        if dangling is not None:
            return str(dangling)
        return _not_a_directory(workspace) or error_text(exc)
    if not os.access(workspace, os.X_OK):
        return f"permission denied: {workspace}: the server's user cannot enter it; give that user access to it"
    return None


def _not_a_directory(workspace: Path) -> str | None:
    """The line for `workspaces/` or the workspace when either is there but is no directory."""
    for path in (workspace.parent, workspace):
        try:
            mode = os.stat(path).st_mode
        except OSError:
            return None
        if stat.S_ISDIR(mode):
            continue
        kind = "regular file" if stat.S_ISREG(mode) else file_kind(mode)
        what = f"a {kind}"
        if os.path.islink(path):
            what = f"a symbolic link to {os.readlink(path)}, which is {what}"
        held = "" if path == workspace else f", so {workspace} cannot be made in it"
        return f"{path}: {what}, not a directory{held}: move it away (the next call makes an empty workspace)"
    return None


def _unusable_workspace(ctx: ToolContext, problem: str) -> ToolOutput:
    """The call's result (and a log line for the operator) when the workspace cannot be used."""
    log.warning("shell tool of agent %s: its workspace cannot be used: %s", ctx.agent.id, problem)
    return ToolOutput(f"the agent's workspace cannot be used, so nothing was run: {problem}", is_error=True)


def _stopped(pid: int | None) -> bool:
    """Whether process `pid` is stopped (SIGSTOP and the like), as /proc shows it."""
    if pid is None:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b") ", 1)[1][:1] == b"T"
    except (OSError, IndexError):
        return False


async def _kill_descendants(guard: int | None) -> None:
    """Kill the descendants of a guard that does not run its own kill (stopped again and again by
    the command): as the guard's `k`, in rounds over its children (a subreaper, it is handed the
    children of each one killed), skipping the zombies it cannot reap while stopped."""
    if guard is None:
        return
    for _ in range(200):
        try:
            with open(f"/proc/{guard}/task/{guard}/children") as f:
                children = [int(pid) for pid in f.read().split()]
        except (OSError, ValueError):
            return  # gone, or no such list: the group kill and reap_orphaned_tools remain
        alive = [pid for pid in children if not _zombie(pid)]
        if not alive:
            return
        for pid in alive:
            _signal(pid, signal.SIGKILL)
        await asyncio.sleep(0.01)  # the killed die, their children are handed to the guard


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b") ", 1)[1][:1] in (b"Z", b"X")
    except (OSError, IndexError):
        return True  # gone


# The tool's process-group leader (the guard), a child subreaper (PR_SET_CHILD_SUBREAPER, set by
# `_die_with_server`): every process the command starts stays its descendant, also one that left
# the group and the session (`setsid`) or cleared its environment (`env -i`), since an orphan is
# handed to the nearest subreaper, not to init. It runs the command in a child shell and waits for
# that shell; then `k` kills every descendant left (what the command put in the background) and it
# exits with the command's status. On SIGTERM (the server's timeout or cancel, or PR_SET_PDEATHSIG
# when the server died) it does the same and exits 143, ignoring further SIGTERMs meanwhile (the
# kernel sends the parent-death signal again as each of the dying server's threads exits).
# `k` kills the guard's children in rounds (each round's kills hand their children to it for the
# next; the round's `sleep` reaps the dead) until it has none. It reads them from the kernel's list
# (/proc/thread-self/children, read by the shell itself: no process of its own to skip) and stops
# only when that list is empty: the list holds zombies until they are reaped and an orphan is put
# on it as its parent dies, so an empty list means no descendant is left, also of a process that
# keeps changing its pid (fork, setsid, the parent exits) which a scan of /proc/*/stat missed
# between its two pids (the old one gone before its entry was read, the new one born after the
# list of entries was taken). A kernel without that file (CONFIG_PROC_CHILDREN off) gets that scan:
# one `awk` over /proc/*/stat (its children, other than the awk itself). The awk reads each file
# with getline, which skips a process that ended meanwhile (as awk's own input a file that cannot
# be opened ends the whole scan: the dying server's own entry ended it). Without awk it reads /proc
# in the shell (slower). What it cannot see (no /proc, or a pid-hopper missed by the scan) is left
# to the process-group kill and to the next server's `reap_orphaned_tools`; so is what outlives a
# guard killed with SIGKILL (docs/security.md).
_GROUP_GUARD = r"""k() {
  n=0
  while [ $n -lt 200 ]; do
    n=$((n+1))
    if [ -r /proc/thread-self/children ]; then
      c=; read -r c </proc/thread-self/children
    elif command -v awk >/dev/null 2>&1; then
      c=$(awk -v g=$$ 'BEGIN { if ((getline l < "/proc/self/stat") > 0) { me = l; sub(/ .*/, "", me) }
        for (i = 1; i < ARGC; i++) if ((getline l < ARGV[i]) > 0) { close(ARGV[i]); p = l; sub(/ .*/, "", p)
          sub(/.*\) /, "", l); split(l, a, " "); if (a[2] == g && a[1] != "Z" && p != me) printf " %s", p } }' \
        /proc/[0-9]*/stat 2>/dev/null)
    else
      c=
      for f in /proc/[0-9]*/stat; do
        { read -r l <"$f"; } 2>/dev/null || continue
        set -- ${l##*) }
        [ "$2" = $$ ] && [ "$1" != Z ] && { p=${f#/proc/}; c="$c ${p%/stat}"; }
      done
    fi
    [ -n "$c" ] || return 0
    kill -KILL $c 2>/dev/null
    sleep 0.01
  done
}
trap 'trap "" TERM; k; exit 143' TERM
/bin/sh -c "$1" & wait $!; s=$?; k; exit $s"""


def _die_with_server() -> Callable[[], None] | None:
    """On Linux, a preexec_fn that makes the tool's group leader a child subreaper (what the command
    leaves behind stays its descendant) and has the kernel signal it when the server dies
    (PR_SET_PDEATHSIG: SIGTERM, on which `_GROUP_GUARD` kills every descendant), so a server killed
    with kill -9 leaves nothing of the command running. What still escaped (the guard itself
    killed with SIGKILL) is killed by the next server (`reap_orphaned_tools`)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    server = os.getpid()

    def preexec() -> None:  # in the child, between fork and exec: no locks, no allocation to speak of
        prctl(
            ctypes.c_int(PR_SET_CHILD_SUBREAPER),
            ctypes.c_ulong(1),
            ctypes.c_ulong(0),
            ctypes.c_ulong(0),
            ctypes.c_ulong(0),
        )
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
    check=shell_arguments_problem,
)


def builtin_tools() -> list[Tool]:
    return [CLOCK, SHELL]


class _Refused(ValueError):
    """Arguments that parse as JSON but would run as something other than what they show."""


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key, item in pairs:
        if key in found:
            shown = key if len(key) <= 40 else key[:40] + "…"
            raise _Refused(f"arguments must not repeat a key: {shown!r} is given more than once")
        found[key] = item
    return found


def _number(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):
        raise _Refused(f"arguments must hold finite numbers, not {text[:40]!r}")
    return number


def _constant(name: str) -> Any:
    raise _Refused(f"arguments must be standard JSON: {name} is not a JSON value")


def parse_arguments(arguments: str) -> dict[str, Any]:
    """Parse tool-call arguments; raise ValueError with a model-readable message.

    Stricter than `json.loads`, so that what an approver is shown is what runs: a key repeated in
    an object (at any depth) is refused (json.loads kept the last one, and a prompt showing the
    raw text showed the first), and so are NaN, Infinity and numbers too large to be finite."""
    try:
        value = json.loads(arguments or "{}", object_pairs_hook=_object, parse_float=_number, parse_constant=_constant)
    except _Refused as exc:
        raise ValueError(str(exc)) from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"arguments are not valid JSON ({exc.msg} at position {exc.pos})") from None
    except RecursionError:
        raise ValueError("arguments are nested too deeply") from None
    if not isinstance(value, dict):
        raise ValueError("arguments must be a JSON object")
    return value


_NOT_ASCII = re.compile(r"[^\x20-\x7e]")


# Not of an escaped category, yet rendered as nothing (fillers, joiners; as gateway/approvals.py
# INVISIBLE) or as a blank that is no space (U+2800): escaped like them.
RENDERED_AS_NOTHING = frozenset("\u034f\u115f\u1160\u17b4\u17b5\u3164\uffa0\u2800")


def _visible_char(match: re.Match[str]) -> str:
    char = match.group()
    # controls, format characters (bidi, zero-width), separators, lone surrogates, and spaces
    # other than the space itself (U+00A0, U+2003, U+3000…: `rm\u2003-rf` reads as `rm -rf`)
    if unicodedata.category(char) not in ("Cc", "Cf", "Zl", "Zp", "Cs", "Zs") and char not in RENDERED_AS_NOTHING:
        return char
    code = ord(char)
    if code > 0xFFFF:  # as JSON writes it: a surrogate pair
        code -= 0x10000
        return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"
    return f"\\u{code:04x}"


def canonical_arguments(args: dict[str, Any]) -> str:
    """Parsed arguments as the server announces, stores and runs them: JSON with every character
    as itself (no `\\u0045` for an `E`: an approver reads what runs), except those that render as
    nothing, as a space that is not one, or reorder the text around them (controls, format
    characters such as bidi overrides, line and paragraph separators, spaces other than U+0020,
    fillers, lone surrogates), written as `\\uXXXX` escapes, and what JSON must escape (quote,
    backslash, control characters)."""
    text = json.dumps(args, ensure_ascii=False)
    return _NOT_ASCII.sub(_visible_char, text)


def announced_arguments(arguments: str) -> str | None:
    """The canonical form (`canonical_arguments`) of a server tool call's arguments text, or None
    when they are refused (`parse_arguments`): such a call never runs and is never announced."""
    try:
        return canonical_arguments(parse_arguments(arguments))
    except ValueError:
        return None
