"""One configured account in the child: its plugin, secrets, adapter, state and counters.

`AccountRunner.run` keeps the adapter alive: a configuration problem (missing secret, a plugin that
will not load, a token the platform refuses) is state `error` with the reason and no retry loop; any
other failure, or an adapter that stops running on its own, is `backoff` and a restart after 1 s,
doubling to 60 s, reset after 5 minutes of health. An adapter whose `start()` has not returned after
ADAPTER_START_TIMEOUT_S is stopped and backs off the same way (it stayed `starting` forever).
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.access import AccessPolicy, DmPolicy, PolicyError
from gateway.debounce import DebounceError, DebounceSettings
from gateway.intake import IntakeGate
from gateway.status import AccountStatus
from plugins.contract import (
    Account,
    AccountError,
    AccountState,
    Adapter,
    AdapterContext,
    OnMessage,
    check_keys,
    check_secret_refs,
    image_budget,
)
from plugins.loader import PluginError, load_plugin

log = logging.getLogger("gateway.accounts")

BACKOFF_MIN_S = 1.0
BACKOFF_MAX_S = 60.0
HEALTHY_RESET_S = 300.0
WATCH_INTERVAL_S = 1.0
STOP_TIMEOUT_S = 5.0
# How long an adapter's start() may take (a platform login, a listener bound): above the worst case of
# a first-party start on a slow network (Telegram's getMe: 10 s to connect, 15 s to read). The child
# goes READY after its own 25 s wait for the accounts (gateway/app.py); the account is `backoff` at this.
# A test may shorten it with APPSERVER_GATEWAY_START_TIMEOUT_S in the child's environment.
ADAPTER_START_TIMEOUT_S = 30.0
SECRET_FILE_MAX = 64 << 10  # bytes; a token is far smaller, so a bigger file is a mistake


@dataclass(frozen=True, slots=True)
class AccountSpec:
    """An account as the supervisor hands it over: settings plus secret references, no values."""

    channel: str
    name: str
    settings: dict[str, Any]
    secrets: dict[str, dict[str, str]]
    problem: str | None = None  # the server refused the account (e.g. a token another account has)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> AccountSpec:
        problem = d.get("problem")
        return cls(
            str(d["channel"]),
            str(d["name"]),
            dict(d.get("settings") or {}),
            dict(d.get("secrets") or {}),
            str(problem) if problem else None,
        )

    @property
    def ref(self) -> str:
        return f"{self.channel}:{self.name}"


def resolve_secrets(spec: AccountSpec, home: Path, environ: dict[str, str]) -> dict[str, str]:
    """Each `<name>_env` / `<name>_file` reference as its value; a missing one is an AccountError
    naming the variable or file, so `channels status` says exactly what to fix."""
    out: dict[str, str] = {}
    for name, ref in spec.secrets.items():
        if "env" in ref:
            value = environ.get(ref["env"], "")
            if not value.strip():
                raise AccountError(f"{name}_env: environment variable {ref['env']} is not set")
            out[name] = value.strip()
        elif "file" in ref:
            path = Path(ref["file"]).expanduser()
            path = path if path.is_absolute() else home / path
            value = read_secret_file(path, name).strip()
            if not value:
                raise AccountError(f"{name}_file: {path} is empty")
            out[name] = value
    return out


def read_secret_file(path: Path, name: str) -> str:
    """A secret file's text, read without blocking: the read runs on the gateway's event loop, where a
    FIFO with no writer froze every account and `/dev/zero` filled memory. Only a regular file of at
    most `SECRET_FILE_MAX` bytes, opened non-blocking (a FIFO swapped in after the check does not wait
    for a writer) and checked again once open; anything else is this account's AccountError."""
    what = f"{name}_file: cannot read {path}"
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # before opening: opening a device may do something
            raise AccountError(f"{what}: not a regular file")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise AccountError(f"{what}: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise AccountError(f"{what}: not a regular file")
        if info.st_size > SECRET_FILE_MAX:
            raise AccountError(f"{what}: {info.st_size:,} bytes, more than a secret's {SECRET_FILE_MAX:,}")
        data = os.read(fd, SECRET_FILE_MAX + 1)
    except OSError as exc:
        raise AccountError(f"{what}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(data) > SECRET_FILE_MAX:  # it grew since fstat
        raise AccountError(f"{what}: more than a secret's {SECRET_FILE_MAX:,} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise AccountError(f"{what}: not UTF-8 text") from None


@dataclass
class LiveStatus:
    """The account's state and counters in memory; saved to gateway.db by the gateway."""

    channel: str
    account: str
    state: AccountState = "stopped"  # until the runner reports `starting` (which then reaches the server)
    reason: str | None = "not started yet"
    last_inbound: float | None = None
    last_outbound: float | None = None
    messages_in: int = 0
    turns: int = 0
    replies: int = 0
    failures: int = 0
    updated_at: float = field(default_factory=time.time)

    def snapshot(self) -> AccountStatus:
        return AccountStatus(
            self.channel,
            self.account,
            self.state,
            self.reason,
            self.last_inbound,
            self.last_outbound,
            self.messages_in,
            self.turns,
            self.replies,
            self.failures,
            self.updated_at,
        )


StateListener = Callable[["AccountRunner"], None]


class StartTimeout(Exception):
    """The adapter's start() did not return in time: a failed start, backed off and retried."""


def _start_timeout(environ: dict[str, str]) -> float:
    try:
        value = float(environ.get("APPSERVER_GATEWAY_START_TIMEOUT_S", ""))
    except ValueError:
        return ADAPTER_START_TIMEOUT_S
    return value if 0 < value < float("inf") else ADAPTER_START_TIMEOUT_S


class AccountRunner:
    def __init__(
        self,
        spec: AccountSpec,
        home: Path,
        on_message: OnMessage,
        on_state: StateListener,
        environ: dict[str, str] | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        image_budget: Callable[[], int] = image_budget,
        on_secrets: Callable[[dict[str, str]], None] | None = None,
        move_chat: Callable[[str, str, str, str], Awaitable[None]] | None = None,
        gate: IntakeGate | None = None,
    ) -> None:
        self.spec = spec
        self._gate = gate if gate is not None else IntakeGate()  # whether messages are taken now
        self._move_chat = move_chat  # (channel, account, old chat, new chat): the gateway's re-pointing
        self._on_secrets = on_secrets  # the log's redaction learns each secret before the adapter has it
        self._image_budget = image_budget
        self.home = home
        self.adapter: Adapter | None = None
        self.live = LiveStatus(spec.channel, spec.name)
        self._on_message = on_message
        self._on_state = on_state
        self._environ = dict(os.environ) if environ is None else environ
        self._start_timeout = _start_timeout(self._environ)
        self._sleep = sleep
        self._stopping = False
        self.ready = asyncio.Event()
        self._debounce: DebounceSettings | None = None
        self._policy: tuple[bool, AccessPolicy] | None = (
            None  # set once the adapter first runs (or the account is in error)
        )

    @property
    def settings(self) -> dict[str, Any]:
        return self.spec.settings

    @property
    def debounce(self) -> DebounceSettings:
        if self._debounce is None:  # read once: every message of the account asks
            self._debounce = DebounceSettings.from_settings(self.spec.settings)
        return self._debounce

    @property
    def policy(self) -> AccessPolicy:
        """The account's access policy. A platform whose every message is authenticated by the
        integration itself (an adapter with `authenticated_senders = True`, e.g. the signed webhook)
        defaults to open DMs; every other one to pairing. Read once per kind of adapter."""
        trusted = bool(getattr(self.adapter, "authenticated_senders", False))
        if self._policy is None or self._policy[0] != trusted:
            default: DmPolicy = "open" if trusted else "pairing"
            self._policy = (trusted, AccessPolicy.from_settings(self.spec.settings, default_dm=default))
        return self._policy[1]

    def report(self, state: AccountState, reason: str | None = None) -> None:
        if (state, reason) == (self.live.state, self.live.reason):
            return
        self.live.state, self.live.reason, self.live.updated_at = state, reason, time.time()
        level = logging.ERROR if state == "error" else logging.INFO
        log.log(level, "%s: %s%s", self.spec.ref, state, f" ({reason})" if reason else "")
        self._on_state(self)

    async def run(self) -> None:
        backoff = BACKOFF_MIN_S
        while not self._stopping:
            self.report("starting")
            started = time.monotonic()
            try:
                if self.spec.problem:
                    raise AccountError(self.spec.problem)
                AccessPolicy.from_settings(self.spec.settings)  # bad policies are configuration errors
                DebounceSettings.from_settings(self.spec.settings)
                adapter = self._create()
                self._check_keys(adapter)
                self.adapter = adapter
                await self._start_adapter(adapter)
            except (AccountError, PluginError, PolicyError, DebounceError) as exc:
                self.report("error", str(exc))
                self.ready.set()
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a plugin may fail any way; it must not kill the gateway
                if isinstance(exc, StartTimeout):
                    log.error("%s: %s", self.spec.ref, exc)
                    why = str(exc)
                else:
                    log.exception("%s: the adapter failed to start", self.spec.ref)
                    why = f"start failed: {type(exc).__name__}: {exc}"
                await self._stop_adapter()  # it may hold what it opened before failing (a socket, a poller)
                if self._stopping:  # stop() came while start() ran: it has said `stopped`
                    return
                if isinstance(exc, StartTimeout):
                    self.ready.set()  # it had its time: the child need not wait for this account longer
                await self._backoff(why, backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_S)
                continue
            if self.live.state == "starting":
                self.report("running")
            self.ready.set()
            while not self._stopping and self._alive(adapter):
                await self._sleep(WATCH_INTERVAL_S)
            if self._stopping:
                return
            if time.monotonic() - started >= HEALTHY_RESET_S:
                backoff = BACKOFF_MIN_S
            await self._stop_adapter()
            await self._backoff("the adapter stopped running", backoff)
            backoff = min(backoff * 2, BACKOFF_MAX_S)

    async def _start_adapter(self, adapter: Adapter) -> None:
        """`adapter.start()`, or StartTimeout once it has taken `_start_timeout` seconds (then it is
        cancelled, waited for at most STOP_TIMEOUT_S: a plugin may ignore the cancellation)."""
        task = asyncio.ensure_future(adapter.start())
        try:
            done, _ = await asyncio.wait({task}, timeout=self._start_timeout)
        except asyncio.CancelledError:
            task.cancel()
            raise
        if task in done:
            task.result()
            return
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: never "never retrieved"
        task.cancel()
        await asyncio.wait({task}, timeout=STOP_TIMEOUT_S)
        raise StartTimeout(f"start() did not return within {self._start_timeout:g} s")

    def _check_keys(self, adapter: Adapter) -> None:
        """Refuse, before the adapter starts, a key the plugin did not declare (`settings_keys`,
        plugins/contract.py) and a secret reference (`<name>_env`, `<name>_file`) to a name that is
        no secret it reads (`secret_keys`), or to a setting. A plugin that declares no keys may read
        any, so none is refused for it; a setting is never read from a reference, whatever it declares."""
        keys = self._declared(adapter, "settings_keys")
        secrets = self._declared(adapter, "secret_keys")
        refs = [f"{name}_{kind}" for name, ref in self.spec.secrets.items() for kind in ref]
        if keys is None:
            check_secret_refs(refs, (), secrets, error=AccountError)
        else:
            check_keys(self.spec.settings, keys, secrets=secrets, refs=refs, error=AccountError)

    def _declared(self, adapter: Adapter, attribute: str) -> frozenset[str] | None:
        """The adapter's optional collection of names `attribute` (None when it has none)."""
        declared = getattr(adapter, attribute, None)
        if declared is None:
            return None
        try:
            keys = frozenset(declared) if not isinstance(declared, str) else None
        except TypeError:  # not iterable, or unhashable items
            keys = None
        if keys is None or not all(isinstance(k, str) for k in keys):
            raise AccountError(f"the {self.spec.channel} plugin's {attribute} must be a collection of strings")
        return keys

    def _alive(self, adapter: Adapter) -> bool:
        try:
            return bool(adapter.is_running)
        except Exception:  # noqa: BLE001 - a failing plugin is restarted, not left for dead
            log.exception("%s: the adapter's is_running failed", self.spec.ref)
            return False

    async def _backoff(self, reason: str, seconds: float) -> None:
        self.report("backoff", f"{reason}; retrying in {seconds:g} s")
        await self._sleep(seconds)

    def _create(self) -> Adapter:
        create = load_plugin(self.spec.channel, self.home)
        secrets = resolve_secrets(self.spec, self.home, self._environ)
        if self._on_secrets is not None:
            self._on_secrets(secrets)
        sources = {
            name: f"environment variable {ref['env']}" if "env" in ref else f"file {ref.get('file')}"
            for name, ref in self.spec.secrets.items()
        }
        account = Account(self.spec.channel, self.spec.name, dict(self.spec.settings), secrets, sources)
        data_dir = self.home / "channels" / self.spec.channel / "data" / self.spec.name
        data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        context = AdapterContext(
            on_message=self._on_message,
            report=self.report,
            data_dir=data_dir,
            log=logging.getLogger(f"gateway.{self.spec.channel}.{self.spec.name}"),
            max_image_bytes=self._image_budget,
            move_chat=self._chat_moved,
            intake_open=self._gate.is_open,
            intake_opened=self._gate.opened,
        )
        return create(account, context)

    async def _chat_moved(self, old: str, new: str) -> None:
        """The adapter's `move_chat`: this account's chat `old` is `new` from now on."""
        if self._move_chat is not None:
            await self._move_chat(self.spec.channel, self.spec.name, old, new)

    async def stop(self) -> None:
        self._stopping = True
        await self._stop_adapter()
        self.report("stopped")

    async def _stop_adapter(self) -> None:
        adapter = self.adapter
        if adapter is None:
            return
        try:
            await asyncio.wait_for(adapter.stop(), STOP_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - stopping must go on
            log.exception("%s: the adapter did not stop cleanly", self.spec.ref)
