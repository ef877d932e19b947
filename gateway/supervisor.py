"""The supervisor of the gateway child, run inside `appserver serve` as a service (DESIGN §8).

It starts `python -m gateway`, gives it a credential of its own (minted per start by the server,
sent on stdin with the start envelope — never argv — and revoked when that child ends), relays the
child's stderr into the server log with a `gateway` prefix (the accounts' secrets masked: `_redact`),
reads only control lines from its stdout, answers commands within a timeout, and restarts the child
after an unexpected exit with capped exponential backoff (1 s → 60 s, reset after 5 minutes of
health); it pings the running child and kills one that stops answering (hung or stopped), which
is then restarted. For a server of a cluster it passes on the server's word on the child's intake
(`intake`, `vouch`: until when the child may acknowledge platform messages, `gateway.intake.IntakeGate`).
It never takes the server down. It knows the child only by its control lines (`gateway.stdio`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import re
import stat
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from gateway.stdio import COMMAND_MAX_LINE, MAX_LINE, ControlLine, read_lines

log = logging.getLogger("appserver.gateway")
child_log = logging.getLogger("gateway")

# The directory holding this `gateway` package (and `appserver`, `plugins`): a source checkout or
# site-packages. The child imports from it, never from the working directory.
CODE_ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 30.0
COMMAND_TIMEOUT_S = 30.0
# `deliver` (cron) waits for the outbox's own verdict: the child gives up at 90 s
# (gateway/replies.py DELIVER_GIVE_UP_S) and answers; this waits a little longer, and cron's
# DELIVER_TIMEOUT_S longer still, so nobody stops waiting while the reply may still go out.
DELIVER_COMMAND_TIMEOUT_S = 100.0
STOP_GRACE_S = 5.0
# The first restart's wait. A test suite that kills the child on purpose may shorten it with
# APPSERVER_GATEWAY_RESTART_BACKOFF_S (a positive number of seconds); unset, it is 1 s.
BACKOFF_MIN_S = 1.0
BACKOFF_MAX_S = 60.0
HEALTHY_RESET_S = 300.0
# The relay's own redaction of the accounts' secrets (the child masks its log first): values shorter
# than this would mangle ordinary text; a secret file is read up to this many bytes.
SECRET_MIN_LEN = 8
SECRET_FILE_MAX = 64 << 10
# The relay of the child's stderr runs on the server's event loop: a plugin writing lines as fast as
# the pipe takes them made every request wait behind it and grew the server log by megabytes a
# second. At most STDERR_LINES_PER_S lines are logged (bursts of STDERR_BURST); past that, lines are
# read in chunks, dropped and counted until half the burst has come back, then one summary line says
# how many went. The pipe is always read, so the child never blocks on it. The relay yields to the
# loop after STDERR_BATCH lines or chunks.
STDERR_LINES_PER_S = 200.0
STDERR_BURST = 500.0
STDERR_BATCH = 64
STDERR_CHUNK = 64 << 10


def _env_seconds(environ: Mapping[str, str], name: str, default: float) -> float:
    """A positive number of seconds from the environment; the default when unset or not one."""
    try:
        value = float(environ.get(name, ""))
    except ValueError:
        return default
    return value if 0 < value < float("inf") else default


# A running child is pinged every PING_INTERVAL_S; no answer within PING_TIMEOUT_S makes readiness
# `unresponsive`, and HUNG_KILL_S without an answered ping kills it (then the usual restart). A
# stopped (SIGSTOP) or wedged child otherwise looked healthy forever. Overridable like the backoff:
# each read from the supervisor's environment when it is made, not when this module is imported.
PING_INTERVAL_S = 10.0
PING_TIMEOUT_S = 10.0
HUNG_KILL_S = 60.0


class CommandTooLarge(RuntimeError):
    """A command whose line is longer than the child reads (COMMAND_MAX_LINE): never sent."""


@dataclass(frozen=True, slots=True)
class Credential:
    token: str | None  # None: the server needs none (auth mode `none`, loopback)
    revoke: Callable[[], None]


@dataclass(frozen=True, slots=True)
class Secrets:
    """The accounts' secrets as the relay looks for them: each form (as it is, URL-encoded) -> name."""

    pattern: re.Pattern[str]
    names: dict[str, str]


@dataclass
class ChildView:
    """What the server knows of the child and its accounts (kept current by GATEWAY_EVENTs)."""

    state: str = "stopped"  # starting | running | unresponsive | backoff | stopped
    reason: str | None = None
    pid: int | None = None
    restarts: int = 0
    accounts: dict[str, dict[str, Any]] = field(default_factory=dict)  # "channel:account" -> state


class GatewaySupervisor:
    def __init__(
        self,
        *,
        home: Path,
        url: Callable[[], str],
        accounts: list[dict[str, Any]],
        credential: Callable[[], Credential],
        python: str = sys.executable,
        env: dict[str, str] | None = None,
        ready_timeout: float = READY_TIMEOUT_S,
        stop_grace: float = STOP_GRACE_S,
        backoff_min: float | None = None,
        backoff_max: float = BACKOFF_MAX_S,
        ping_interval: float | None = None,
        ping_timeout: float | None = None,
        hung_kill: float | None = None,
        intake: Callable[[], float] | None = None,
        store: Callable[[], dict[str, Any] | None] | None = None,
    ) -> None:
        def knob(given: float | None, name: str, default: float) -> float:
            return given if given is not None else _env_seconds(self._env, name, default)

        self.home = home
        self.view = ChildView()
        self.view.accounts = {
            f"{a['channel']}:{a['name']}": {"channel": a["channel"], "account": a["name"], "state": "starting"}
            for a in accounts
        }
        self._url = url
        self._accounts = accounts
        self._credential = credential
        self._python = python
        self._env = dict(os.environ if env is None else env)
        self._ready_timeout = ready_timeout
        self._stop_grace = stop_grace
        self._backoff_min = knob(backoff_min, "APPSERVER_GATEWAY_RESTART_BACKOFF_S", BACKOFF_MIN_S)
        self._backoff_max = backoff_max
        self._ping_interval = knob(ping_interval, "APPSERVER_GATEWAY_PING_INTERVAL_S", PING_INTERVAL_S)
        self._ping_timeout = knob(ping_timeout, "APPSERVER_GATEWAY_PING_TIMEOUT_S", PING_TIMEOUT_S)
        self._hung_kill = knob(hung_kill, "APPSERVER_GATEWAY_HUNG_KILL_S", HUNG_KILL_S)
        self._hung: str | None = None  # why the watchdog killed the current child
        # A server of a cluster: until when (monotonic) a child starting now may take messages;
        # `vouch` moves it on. None: the child takes messages for as long as it runs.
        self._intake = intake
        # A server on PostgreSQL: `{"url", "instance"}`, sent in the start envelope (stdin, never argv or
        # a log line: the URL may carry a password); the child keeps its tables there (gateway/sqlstore.py).
        self._store = store
        self._words: set[asyncio.Future[bool]] = set()  # the words said at a child's READY, in flight
        self._proc: asyncio.subprocess.Process | None = None
        self._pending: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._ids = itertools.count(1)
        self._stopping = False
        self._runner: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()
        self._first_outcome = asyncio.Event()
        self._stderr_tail: deque[str] = deque(maxlen=20)
        self._secrets: Secrets | None = None  # the accounts' secrets, read at each child's start

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Start the child; returns once it is READY or its first start failed (logged clearly)."""
        self._runner = asyncio.get_running_loop().create_task(self._run())
        await self._first_outcome.wait()

    async def stop(self) -> None:
        self._stopping = True
        proc = self._proc
        if proc is not None and proc.returncode is None:
            # Ask, then close stdin: the grace period counts once, from here, before the kill.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.command("stop", timeout=self._stop_grace / 2), self._stop_grace / 2)
            await self._end(proc, grace=self._stop_grace / 2)
        if self._runner is not None:
            self._runner.cancel()
            await asyncio.gather(self._runner, return_exceptions=True)
        self.view.state = "stopped"

    async def command(self, op: str, *, timeout: float | None = None, **args: Any) -> dict[str, Any]:
        """Send a command envelope and wait for its GATEWAY_RESPONSE (or TimeoutError); by default
        30 s, and for `deliver` long enough for the child's own verdict."""
        if timeout is None:
            timeout = DELIVER_COMMAND_TIMEOUT_S if op == "deliver" else COMMAND_TIMEOUT_S
        proc = self._proc
        if proc is None or proc.returncode is not None or proc.stdin is None or not self._ready.is_set():
            raise RuntimeError(f"the gateway is not running ({self.view.state}: {self.view.reason or 'no reason'})")
        request_id = f"r{next(self._ids)}"
        line = json.dumps({"id": request_id, "op": op, **args}).encode()
        if len(line) > COMMAND_MAX_LINE:  # the child would skip it: refuse it here, with the sizes
            raise CommandTooLarge(
                f"the gateway command {op!r} would be {len(line):,} bytes, over the {COMMAND_MAX_LINE:,} the gateway "
                "reads; not sent"
            )
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        try:
            proc.stdin.write(line + b"\n")
            await proc.stdin.drain()
            return await asyncio.wait_for(future, timeout)
        finally:
            self._pending.pop(request_id, None)

    async def vouch(self, until: float, timeout: float) -> bool:
        """Tell the running child it may take platform messages until `until` (monotonic; 0: pause
        now). Bounded as a whole, as a ping is; False when it went unanswered."""
        try:
            await asyncio.wait_for(self.command("intake", timeout=timeout, until=until), timeout)
        except (TimeoutError, RuntimeError, OSError):
            return False
        return True

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Ready when the child runs and every enabled account runs; detail per account."""
        accounts = {ref: dict(a) for ref, a in self.view.accounts.items()}
        ok = self.view.state == "running" and all(a.get("state") == "running" for a in accounts.values())
        return ok, {"gateway": self.view.state, "reason": self.view.reason, "accounts": accounts}

    # ---------------------------------------------------------------- the child

    async def _run(self) -> None:
        backoff = self._backoff_min
        while not self._stopping:
            started = time.monotonic()
            failure: str | None = None
            try:
                code = await self._one_child()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the server must outlive any supervisor fault
                log.exception("gateway: supervising the child failed")
                code, failure = None, f"{type(exc).__name__}: {exc}"
            self._ready.clear()
            self._fail_pending("the gateway exited")
            if self._stopping:
                return
            if time.monotonic() - started >= HEALTHY_RESET_S:
                backoff = self._backoff_min
            self.view.state = "backoff"
            ended = f"exited with code {code}" if failure is None else f"could not be run ({failure})"
            if self._hung is not None:
                ended = self._hung
            self.view.reason = f"{ended}; restarting in {backoff:g} s"
            for a in self.view.accounts.values():
                a["state"], a["reason"] = "stopped", "the gateway process is restarting"
            log.error("gateway: the child %s", self.view.reason)
            self._first_outcome.set()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self._backoff_max)
            self.view.restarts += 1

    async def _one_child(self) -> int | None:
        self.view.state, self.view.reason = "starting", None
        self._hung = None
        self._stderr_tail.clear()  # the last lines of this child, not of the one before
        self._secrets = _secret_pattern(self._accounts, self._env, self.home)
        credential = self._credential()
        try:
            env = {**self._env, "APPSERVER_HOME": str(self.home), "PYTHONUNBUFFERED": "1"}
            env.pop("APPSERVER_TOKEN", None)  # the child gets its own credential, on stdin
            # `-P`: nothing from the working directory (`-m` would put it first on sys.path, so a
            # `concurrent.py` where `serve` started ran in the child, which reads the credential).
            # The code root of this package comes first instead: the child runs the parent's code.
            env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(CODE_ROOT), env.get("PYTHONPATH"))))
            proc = await asyncio.create_subprocess_exec(
                self._python,
                "-P",
                "-m",
                "gateway",
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=env,
                limit=MAX_LINE + 1024,
            )
            self._proc = proc
            self.view.pid = proc.pid
            assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
            start: dict[str, Any] = {
                "op": "start",
                "url": self._url(),
                "token": credential.token,
                "home": str(self.home),
                "accounts": self._accounts,
            }
            if self._intake is not None:
                start["intake_until"] = self._intake()
            store = self._store() if self._store is not None else None
            if store is not None:
                start["store"] = store
            proc.stdin.write((json.dumps(start) + "\n").encode())
            await proc.stdin.drain()
            relay = asyncio.ensure_future(self._relay_stderr(proc.stderr))
            control = asyncio.ensure_future(self._read_control(proc.stdout))
            # READY, or the child's exit (a failed start is known at once), or the timeout.
            ready = asyncio.ensure_future(self._ready.wait())
            exited = asyncio.ensure_future(proc.wait())
            try:
                await asyncio.wait({ready, exited}, timeout=self._ready_timeout, return_when=asyncio.FIRST_COMPLETED)
            finally:
                ready.cancel()
                exited.cancel()
            if not self._ready.is_set() and proc.returncode is None:
                tail = " | ".join(self._stderr_tail) or "no output"
                log.error("gateway: not ready within %g s; stopping it (last log lines: %s)", self._ready_timeout, tail)
                await self._end(proc)
            watchdog = asyncio.ensure_future(self._watch(proc))
            try:
                code = await proc.wait()
            finally:
                watchdog.cancel()
                await asyncio.gather(watchdog, return_exceptions=True)
            # A grandchild a plugin started may hold the pipes open after the child is gone: do not
            # wait for it to let go before restarting.
            _done, pending = await asyncio.wait({relay, control}, timeout=1.0)
            for task in pending:
                task.cancel()
            await asyncio.gather(relay, control, return_exceptions=True)
            return code
        finally:
            credential.revoke()

    async def _watch(self, proc: asyncio.subprocess.Process) -> None:
        """Ping the child while it runs: a child that stops answering is `unresponsive` in readiness
        (logged), and one silent for `hung_kill` seconds is killed, so `_run` restarts it."""
        answered = time.monotonic()
        while proc.returncode is None and not self._stopping:
            await asyncio.sleep(self._ping_interval)
            if not self._ready.is_set() or proc.returncode is not None or self._stopping:
                return
            try:
                # bounded as a whole: a stopped child's full stdin pipe would block the write itself
                await asyncio.wait_for(self.command("ping", timeout=self._ping_timeout), self._ping_timeout)
            except (TimeoutError, RuntimeError, OSError) as exc:
                silent = time.monotonic() - answered
                if self.view.state == "running":
                    self.view.state = "unresponsive"
                    log.error("gateway: the child (pid %s) does not answer pings (%s)", proc.pid, _why(exc))
                self.view.reason = f"no answer to a ping for {silent:.0f} s"
                if silent >= self._hung_kill and proc.returncode is None:
                    self._hung = f"answered no ping for {silent:.0f} s and was killed"
                    log.error("gateway: the child (pid %s) %s", proc.pid, self._hung)
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
                    return
                continue
            answered = time.monotonic()
            if self.view.state == "unresponsive":
                self.view.state, self.view.reason = "running", None
                log.warning("gateway: the child (pid %s) answers pings again", proc.pid)

    async def _end(self, proc: asyncio.subprocess.Process, grace: float | None = None) -> None:
        """Close stdin (the child's signal to stop), wait the grace period, then kill."""
        grace = self._stop_grace if grace is None else grace
        if proc.stdin is not None and not proc.stdin.is_closing():
            proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), grace)
        except TimeoutError:
            log.warning("gateway: did not stop in time; killing it")
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()

    async def _read_control(self, stdout: asyncio.StreamReader) -> None:
        async for item in read_lines(stdout):
            if not isinstance(item, ControlLine):
                log.warning("gateway: ignored a line on the control channel: %r", item[:200])
                continue
            if item.kind == "ready":
                self.view.state, self.view.reason = "running", None
                self._ready.set()
                self._vouch_at_ready()
                self._first_outcome.set()
                log.info("gateway: ready (pid %s)", self.view.pid)
            elif item.kind == "response":
                future = self._pending.get(str(item.payload["id"]))
                if future is not None and not future.done():
                    future.set_result(item.payload)
            elif item.kind == "event":
                self._event(item.payload)

    def _vouch_at_ready(self) -> None:
        """A server of a cluster renews its word the moment the child is ready: the start envelope's
        may have run out while the child started (the word lasts a second), and a child ready but
        paused until the next periodic word would refuse its first messages."""
        if self._intake is None:
            return
        word = asyncio.ensure_future(self.vouch(self._intake(), timeout=self._ping_timeout))
        self._words.add(word)
        word.add_done_callback(self._words.discard)

    def _event(self, payload: dict[str, Any]) -> None:
        if payload.get("type") == "account_state":
            ref = f"{payload.get('channel')}:{payload.get('account')}"
            if ref in self.view.accounts:
                reason = payload.get("reason")
                reason = self._redact(reason) if isinstance(reason, str) else reason
                self.view.accounts[ref].update(state=payload.get("state"), reason=reason)
        elif payload.get("type") == "gateway_error":
            log.error("gateway: %s", self._redact(str(payload.get("message"))))

    async def _relay_stderr(self, stderr: asyncio.StreamReader) -> None:
        """Log the child's stderr lines, redacted, within the rate bound (STDERR_LINES_PER_S)."""
        budget = _LineBudget(STDERR_LINES_PER_S, STDERR_BURST)
        suppressed = 0
        since = 0.0  # when the current run of dropped lines began
        partial = False  # the last dropped chunk ended inside a line: its rest is dropped too
        done = 0
        while True:
            done += 1
            if done % STDERR_BATCH == 0:
                await asyncio.sleep(0)  # a buffered read returns at once: let the server answer
            now = time.monotonic()
            if suppressed and not budget.refilled(now):
                chunk = await stderr.read(STDERR_CHUNK)
                if not chunk:
                    self._suppressed(suppressed, now - since)
                    return
                suppressed += chunk.count(b"\n")
                partial = not chunk.endswith(b"\n")
                continue
            try:
                line = await stderr.readline()
            except (ValueError, asyncio.LimitOverrunError):
                continue
            if not line:
                if suppressed:
                    self._suppressed(suppressed, time.monotonic() - since)
                return
            if partial:  # the rest of a line its dropped chunk began
                partial = False
                suppressed += 1
                continue
            if not budget.take(now):
                if not suppressed:
                    since = now
                suppressed += 1
                continue
            if suppressed:
                self._suppressed(suppressed, now - since)
                suppressed = 0
            text = self._redact(line.decode("utf-8", "replace").rstrip())
            self._stderr_tail.append(text[:300])
            level = logging.ERROR if text.startswith(("ERROR", "CRITICAL", "Traceback")) else logging.INFO
            level = logging.WARNING if text.startswith("WARNING") else level
            child_log.log(level, "gateway| %s", text)

    def _suppressed(self, count: int, seconds: float) -> None:
        log.warning(
            "gateway: %d stderr lines suppressed in the last %.1f s (more than %g lines/s)",
            count,
            seconds,
            STDERR_LINES_PER_S,
        )

    def _redact(self, text: str) -> str:
        """`text` with each account secret the server can read replaced by `<name>`: a second line
        of defence behind the child's own log filter (gateway/redact.py), for what reaches its
        stderr past logging (a traceback `sys.excepthook` prints, a library's `print`)."""
        secrets = self._secrets
        if secrets is None:
            return text
        return secrets.pattern.sub(lambda m: f"<{secrets.names.get(m.group(0), 'secret')}>", text)

    def _fail_pending(self, reason: str) -> None:
        for future in self._pending.values():
            if not future.done():
                future.set_exception(RuntimeError(reason))
        self._pending.clear()


class _LineBudget:
    """A token bucket of log lines: `rate` a second, at most `burst` saved up."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst = rate, burst
        self.tokens = burst
        self.at = time.monotonic()

    def _fill(self, now: float) -> None:
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now

    def take(self, now: float) -> bool:
        self._fill(now)
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True

    def refilled(self, now: float) -> bool:
        """Half the burst is back: dropping ends (so a steady flood gives runs of lines, not one
        summary line per line logged)."""
        self._fill(now)
        return self.tokens >= self.burst / 2


def _secret_pattern(accounts: list[dict[str, Any]], env: dict[str, str], home: Path) -> Secrets | None:
    """A pattern matching every secret the accounts reference (`<name>_env` in the child's
    environment, `<name>_file` read as the child reads it), as it is and URL-encoded, with each
    form's secret name; None when there is none to look for. Read at each child's start, so a
    rotated file is known; a reference that cannot be read is the child's error to report."""
    forms: dict[str, str] = {}
    for account in accounts:
        for name, ref in (account.get("secrets") or {}).items():
            value = env.get(ref["env"], "") if "env" in ref else _read_secret(home, str(ref.get("file") or ""))
            value = value.strip()
            if len(value) < SECRET_MIN_LEN:
                continue
            for form in (value, quote(value, safe=""), quote(value, safe=":/")):
                forms.setdefault(form, str(name))
    if not forms:
        return None
    pattern = re.compile("|".join(re.escape(f) for f in sorted(forms, key=len, reverse=True)))
    return Secrets(pattern, forms)


def _read_secret(home: Path, name: str) -> str:
    """A secret file's text, or "" when it cannot be read: only a regular file, opened without
    blocking (a FIFO must not stall the server's loop), at most SECRET_FILE_MAX bytes."""
    if not name:
        return ""
    path = Path(name).expanduser()
    path = path if path.is_absolute() else home / path
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # before opening: opening a device may do something
            return ""
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return ""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return ""
        return os.read(fd, SECRET_FILE_MAX).decode("utf-8", "replace")
    except OSError:
        return ""
    finally:
        os.close(fd)


def _why(exc: BaseException) -> str:
    """An exception for a log line: its message, else its kind (`timeout` for a bare TimeoutError,
    whose message is empty, while the exception itself is always truthy)."""
    if str(exc):
        return str(exc)
    return "timeout" if isinstance(exc, TimeoutError) else type(exc).__name__
