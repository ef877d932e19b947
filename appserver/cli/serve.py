"""`appserver serve`: Starlette + uvicorn, server.json while running, clean stop on SIGTERM (SIGINT, SIGHUP).

One server per home (one SQLite store, one in-process runtime per conversation): a second `serve`
is refused, unless it is a `--standby`, which waits without a kernel and takes over (crash settle,
server.json, its listen address, the cron lease) when the holder stops or dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import logging
import math
import os
import signal
import socket
import ssl
import stat
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import urlsplit

import click
import uvicorn
from uvicorn.config import SSL_PROTOCOL_VERSION

from appserver.auth import Authenticator
from appserver.channelconfig import parse_enabled
from appserver.cli.common import StartupError, fail, get_config
from appserver.config import Config, ConfigError
from appserver.http.app import build_app
from appserver.http.requestid import install as install_request_ids
from appserver.http.stopping import Stopping
from appserver.logredact import from_config as redactor_from_config
from appserver.logredact import install as install_redactor
from appserver.netaddr import check_bind_allowed, parse_listen, parse_trusted_proxies
from appserver.security import SecurityGuard
from appserver.security.edge import (
    AcceptErrorThrottle,
    EdgeLimits,
    EdgeWebSocketProtocol,
    accept_backlog,
    fd_limit,
    protocol_class,
    raise_fd_limit,
)
from appserver.server import Server
from appserver.serverinfo import (
    SERVER_JSON_CHECK_S,
    HomeLock,
    ServerJsonKeeper,
    claim_home,
    holder_text,
    home_lock_path,
    lock_holder,
    remove_server_json,
    store_record,
    write_server_json,
)
from appserver.services import Services, build_services
from appserver.store.url import store_kind
from appserver.ws.hub import Hub

log = logging.getLogger("appserver.serve")

YOUNG_COLLECTION_EVERY = 20_000  # allocations less deallocations per young collection (CPython's default: 700)
FULL_COLLECTION_EVERY = 100  # generation-1 collections per full one (CPython's default: 10)


def pong_wait(interval_s: float, silence_s: float) -> float | None:
    """uvicorn waits `ws_ping_timeout` for the pong of each ping, and pings `interval` after the last
    answer; so a peer silent for `silence_s` since its last pong is closed when that wait is the rest."""
    if not silence_s:
        return None
    return max(1.0, silence_s - interval_s) if interval_s else silence_s


def url_for(host: str, port: int, tls: bool = False) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"{'https' if tls else 'http'}://{shown}:{port}"


STOP_NOTICE_S = 0.2
# A stop lets the requests in flight finish for GRACE_S; then the OpenAI requests still waiting on a
# turn are answered with a 503 `server_shutting_down` error object (a stream: its error event), and
# what still runs DRAIN_S later is cancelled by uvicorn (a plain-text 500, or a cut: the last resort).
GRACE_S = 5.0
DRAIN_S = 3.0


def _drop_cancelled(record: logging.LogRecord) -> bool:
    """False for a record of the lifespan task's cancellation (an exception, or Starlette's
    formatted traceback passed on as the message)."""
    exc = record.exc_info[1] if record.exc_info else None
    if isinstance(exc, asyncio.CancelledError):
        return False
    text = record.getMessage().rstrip()
    return not (text.startswith("Traceback") and text.endswith("CancelledError"))


def stop_signals() -> tuple[signal.Signals, ...]:
    """The signals that stop the server, each the same clean way (a second one forces the stop).
    SIGHUP is what a closed terminal or SSH session sends: there is no reload, and by default it
    killed the server at once (requests cut, server.json left behind, nothing logged). Unless it is
    ignored (`nohup appserver serve`): then it stays ignored, as asked."""
    ignored_hup = signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    return (signal.SIGINT, signal.SIGTERM) if ignored_hup else (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _UvicornServer(uvicorn.Server):
    """uvicorn re-raises a captured SIGTERM after shutdown (exit status -15); we own the signals so
    a clean stop exits 0 and the `finally` that removes server.json always runs."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        signals = stop_signals()
        for sig in signals:
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            yield
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)
                # The stop is under way (server.json goes, the loop closes, the interpreter ends):
                # a signal from here on asks for what is already happening, and must not end the
                # process with -15 (or a KeyboardInterrupt traceback) instead of 0. Ignored by the
                # kernel, not by a Python handler: the interpreter resets its own handlers to the
                # default while it finalizes, and a signal then would still kill it.
                signal.signal(sig, signal.SIG_IGN)

    def __init__(
        self,
        config: uvicorn.Config,
        hub: Hub,
        stopping: Stopping | None = None,
        pause_intake: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._exit_asked: asyncio.Event | None = None
        super().__init__(config)
        self.hub = hub
        self.requests = stopping or Stopping()
        self._stopping = False
        # the channels' gateway, in a cluster, takes no platform message once the stop began
        self._pause_intake = pause_intake
        self._stopper: asyncio.Task[None] | None = None

    # uvicorn's main loop looks at `should_exit` every 0.1 s: a stop asked for wakes it at once instead.
    @property
    def should_exit(self) -> bool:
        return self._should_exit

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        self._should_exit = value
        if value and self._exit_asked is not None:
            self._exit_asked.set()

    async def main_loop(self) -> None:
        """As uvicorn's (a tick every 0.1 s: the date header, the request limit), but a stop ends
        the wait for the next tick."""
        self._exit_asked = asyncio.Event()
        if self.should_exit:
            self._exit_asked.set()
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            counter = (counter + 1) % 864000
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._exit_asked.wait(), 0.1)
            should_exit = await self.on_tick(counter)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's: stop accepting, wait for the requests in flight (`timeout_graceful_shutdown`,
        GRACE_S + DRAIN_S), cancel what is left, then the lifespan's shutdown (the kernel settles
        running turns as interrupted). GRACE_S into that wait, the OpenAI requests still waiting are
        answered with an error object first (http/stopping.py), so uvicorn has none left to cancel
        into a plain-text "Internal Server Error" or a cut stream."""
        timer = asyncio.get_running_loop().call_later(GRACE_S, self._drain)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def _drain(self) -> None:
        stopped = self.requests.stop()
        if stopped:
            log.info("stopping: answered %d request(s) still waiting with 503 server_shutting_down", stopped)

    def _on_signal(self, signum: int) -> None:
        if self._stopping:  # a second signal: stop now
            self.force_exit = self.should_exit = True
            # uvicorn then skips the lifespan shutdown, and its task, cancelled at exit, would be
            # logged as an error with a CancelledError traceback: the stop was asked for twice.
            logging.getLogger("uvicorn.error").addFilter(_drop_cancelled)
            return
        self._stopping = True
        log.info(
            "%s: stopping (requests in flight get %g s, then an error; a second signal stops at once)",
            signal.Signals(signum).name,
            GRACE_S,
        )
        # Requests still running when the graceful wait ends are cancelled by uvicorn, which logs
        # each as "Exception in ASGI application" with a CancelledError traceback: the stop, not a fault.
        logging.getLogger("uvicorn.error").addFilter(_drop_cancelled)
        told = self.hub.broadcast_event("server_stopping", {"reason": "shutdown"})
        # Let the notice reach connected clients before uvicorn closes their sockets (1012).
        self._stopper = asyncio.get_running_loop().create_task(self._stop(STOP_NOTICE_S if told else 0.0))

    async def _stop(self, notice_s: float) -> None:
        """Pause the gateway's intake first (a cluster's: channels.py `pause_intake`), so nothing
        it acknowledges waits in this home's ledger while another server takes the account; then
        the drain, once the notice had its time."""
        try:
            pausing = self._pause_intake() if self._pause_intake is not None else asyncio.sleep(0)
            await asyncio.gather(pausing, asyncio.sleep(notice_s))
        except Exception:  # noqa: BLE001 - the stop goes on whatever the pause did
            log.exception("stopping: could not pause the gateway's intake")
        finally:
            self.should_exit = True


def build_asgi(
    config: Config, server: Server, services: Services, stopping: Stopping | None = None
) -> tuple[SecurityGuard, Authenticator]:
    """The whole app behind the security guard: every route, present and future, is covered."""
    authenticator = Authenticator(config)
    return SecurityGuard(build_app(server, services, stopping=stopping), config, authenticator), authenticator


SERVE = "appserver serve"  # how serve names itself in the home's lock file (serverinfo.lock_holder)


def refusal(config: Config, live: dict[str, Any] | None) -> str:
    """Why this `serve` may not run now, and what to do instead."""
    hint = "stop it first, or run `appserver serve --standby` to wait and take over when it stops"
    holder = lock_holder(home_lock_path(config.server_json)) if live is None else None
    if holder is not None and holder.get("command") != SERVE:  # an in-process `appserver run`
        return (
            f"{holder_text(holder)} is running a turn in-process on this home ({config.home}); wait for it "
            "to end (or stop it), or run `appserver serve --standby` to start as soon as it ends"
        )
    if live is None:
        return f"another `appserver serve` is starting on this home ({config.home}); {hint}"
    return f"a server already runs on this home: {live.get('url')} (pid {live.get('pid')}); {hint}"


# After a takeover, the --listen address still in use is waited for this long (checked every
# TAKEOVER_BIND_POLL_S) before the start fails: the dying holder's socket may linger a moment.
TAKEOVER_BIND_WAIT_S = 30.0
TAKEOVER_BIND_POLL_S = 0.5


def standby_poll_s(config: Config) -> float:
    """A standby checks the holder every cron tick, and at least once a second."""
    return max(0.05, min(config.cron.tick_s, 1.0))


async def wait_for_home(config: Config, host: str = "", port: int = 0) -> HomeLock | None:
    """Standby: no kernel, no socket, no turns; poll until the home is free and hold it (None when
    stopped by a signal while waiting). The holder is judged by serve.lock, which the OS releases
    when it dies, and server.json's process identity (a reused pid counts as dead). Its --listen
    address (HOST:PORT) held by another program is warned about while waiting, not at the takeover."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = stop_signals()
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    interval = standby_poll_s(config)
    shown: object = ()
    warned = False
    gc.enable()  # a standby may wait for hours: collect as usual meanwhile (cli/main.py `run`)
    try:
        while True:
            # In a thread: the probe waits up to half a second for a lock a CLI process holds for a
            # moment (serverinfo.HomeLock), and a blocked loop would not hear a stop meanwhile.
            lock, live = await asyncio.to_thread(claim_home, config.server_json, SERVE)
            if stop.is_set():  # told to stop while probing: never take over on the way out
                if lock is not None:
                    lock.release()
                return None
            if lock is not None:
                if shown != ():
                    click.echo("appserver standby: the holder is gone; taking over")
                return lock
            holder = (live or {}).get("identity")
            if holder != shown:
                shown = holder
                who = f"{live.get('url')} (pid {live.get('pid')})" if live else _starting_holder(config)
                click.echo(f"appserver standby: {who} holds {config.home}; checking every {interval:g} s")
            held = listen_held_by_another(live, host, port)
            if held and not warned:
                warn_listen_held(live or {}, host, port)
            warned = held
            try:
                await asyncio.wait_for(stop.wait(), timeout=interval)
                return None
            except TimeoutError:
                pass
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)


def listen_held_by_another(live: dict[str, Any] | None, host: str, port: int) -> bool:
    """Whether the standby's --listen address is in use by something other than the home's server
    (whose own address a standby may share: it takes it over). Unknown while no server.json names
    the holder (a `serve` starting, an in-process run): not judged then."""
    if live is None or port == 0:
        return False
    try:
        if urlsplit(str(live.get("url") or "")).port == port:
            return False
    except ValueError:
        pass
    return address_in_use(host, port)


def warn_listen_held(live: dict[str, Any], host: str, port: int) -> None:
    """The wrong setting said while waiting: at the takeover the start would fail on it, leaving the home
    with no server."""
    log.warning(
        "standby: %s (--listen) is in use by another program, not this home's server (%s, pid %s); "
        "unless it is freed, taking over will fail after %g s: stop that program or pick another --listen",
        shown_address(host, port),
        live.get("url"),
        live.get("pid"),
        TAKEOVER_BIND_WAIT_S,
    )


def _starting_holder(config: Config) -> str:
    """Who holds the home while no server.json names a server: an in-process run, or a `serve` starting."""
    holder = lock_holder(home_lock_path(config.server_json))
    if holder is not None and holder.get("command") != SERVE:
        return f"{holder_text(holder)} (a turn in-process)"
    return "another `serve` (starting)"


async def serve_async(
    config: Config, host: str, port: int, lock: HomeLock | None = None, *, accept_data_loss: bool = False
) -> None:
    """Serve while holding the home lock; without one (standby), wait for it first."""
    if lock is None:
        lock = await wait_for_home(config, host, port)
        if lock is None:
            return
        if not await wait_for_address(host, port):
            lock.release()
            return
    try:
        await _serve_locked(config, host, port, accept_data_loss=accept_data_loss)
    finally:
        lock.release()


def shown_address(host: str, port: int) -> str:
    """HOST:PORT as the error lines show it (an IPv6 host in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bind_error(host: str, port: int) -> OSError | None:
    """Why HOST:PORT cannot be bound now (None: it can). Binds and releases each address the host
    resolves to, as uvicorn is about to; a name that does not resolve is a socket.gaierror."""
    if port == 0:
        return None
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT is fine
            if family == socket.AF_INET6:  # as asyncio's create_server: v6 only
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(sockaddr)
            except OSError as exc:
                return exc
    return None


def address_in_use(host: str, port: int) -> bool:
    """Whether something listens on HOST:PORT now (a name that does not resolve: no)."""
    try:
        exc = bind_error(host, port)
    except socket.gaierror:
        return False
    return exc is not None and exc.errno == errno.EADDRINUSE


async def wait_for_address(host: str, port: int) -> bool:
    """After a takeover: the --listen address still in use (the dying holder's socket lingering, or
    a program that holds it) is waited for, up to TAKEOVER_BIND_WAIT_S, before the start fails on
    it. False: stopped by a signal meanwhile (as a standby waiting for the home is)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + TAKEOVER_BIND_WAIT_S
    if not address_in_use(host, port):
        return True
    log.warning(
        "standby: %s (--listen) is still in use; waiting up to %g s for it to be freed",
        shown_address(host, port),
        TAKEOVER_BIND_WAIT_S,
    )
    stop = asyncio.Event()
    signals = stop_signals()
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    try:
        while loop.time() < deadline and address_in_use(host, port):
            try:
                await asyncio.wait_for(stop.wait(), timeout=TAKEOVER_BIND_POLL_S)
                return False
            except TimeoutError:
                pass
        return True
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)


def check_port_free(host: str, port: int) -> None:
    """Fail with one line when HOST:PORT cannot be bound (uvicorn would print a traceback)."""
    shown = shown_address(host, port)
    try:
        exc = bind_error(host, port)
    except socket.gaierror as gai:
        raise StartupError(f"cannot listen on {shown}: {gai.strerror}; check --listen ([server] listen)") from None
    if exc is None:
        return
    hint = {
        errno.EADDRINUSE: (
            "the address is already in use (another server?); stop it, or pick another port with --listen HOST:PORT"
        ),
        errno.EACCES: "permission denied (ports below 1024 need privileges); pick a port >= 1024 with --listen",
        errno.EADDRNOTAVAIL: "the address does not belong to this machine; check --listen ([server] listen)",
    }.get(exc.errno or 0, f"{exc.strerror}; check --listen ([server] listen)")
    raise StartupError(f"cannot listen on {shown}: {hint}")


TLS_HINT = "check --tls-cert/--tls-key ([server] tls_cert/tls_key)"
TLS_UNUSABLE = "TLS certificate or key unusable"


class _PassphraseAsked(Exception):
    """OpenSSL asked for the key's pass phrase: the key file is encrypted."""


def _refuse_passphrase() -> NoReturn:
    """The password callback of load_cert_chain: without one, OpenSSL prompts on the terminal (a
    start that hangs there) or fails with a bare EINVAL. A server never prompts."""
    raise _PassphraseAsked


def check_tls_files(cert: str, key: str) -> None:
    """A missing or unusable TLS file fails with one line before anything starts."""
    load_tls_context(cert, key)


def load_tls_context(cert: str, key: str) -> ssl.SSLContext:
    """The server's TLS context, made as uvicorn makes it (no client certificates); whatever is wrong
    with either file is a StartupError whose one line names the file and what to do."""
    cert_pem, key_pem = _tls_file("certificate", cert), _tls_file("key", key)
    _check_cert_pem(cert, cert_pem)
    _check_key_pem(key, key_pem)
    context = ssl.SSLContext(SSL_PROTOCOL_VERSION)
    try:
        context.load_cert_chain(cert, key, _refuse_passphrase)
    except _PassphraseAsked:
        raise StartupError(_encrypted_key(key)) from None
    except ssl.SSLError as exc:
        raise StartupError(_tls_ssl_error(cert, key, exc)) from None
    except OSError as exc:  # the file changed since it was read, or OpenSSL's own errno
        raise StartupError(f"{TLS_UNUSABLE}: cannot load {cert} and {key}: {exc.strerror or exc}; {TLS_HINT}") from None
    context.verify_mode = ssl.CERT_NONE
    return context


def _tls_file(label: str, path: str) -> bytes:
    """The bytes of a TLS file: a StartupError when it is missing, not a regular file (a FIFO would
    block the start, /dev/null reads empty) or unreadable."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise StartupError(f"TLS {label} file not found: {path}; {TLS_HINT}") from None
    except OSError as exc:
        raise StartupError(f"TLS {label} file {path}: {exc.strerror}; {TLS_HINT}") from None
    if stat.S_ISDIR(mode):
        raise StartupError(f"TLS {label} file {path} is a directory, not a PEM file; {TLS_HINT}")
    if not stat.S_ISREG(mode):
        raise StartupError(
            f"TLS {label} file {path} is not a regular file (a device, a pipe or a socket): "
            f"give the PEM file itself; {TLS_HINT}"
        )
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise StartupError(
            f"TLS {label} file {path} cannot be read ({exc.strerror}): it must be readable by the user "
            f"running appserver; {TLS_HINT}"
        ) from None


def _check_cert_pem(path: str, pem: bytes) -> None:
    if b"-----BEGIN" in pem and b"CERTIFICATE-----" in pem:
        return
    if b"PRIVATE KEY-----" in pem:
        raise StartupError(
            f"{TLS_UNUSABLE}: the certificate file {path} holds a private key and no certificate "
            f"(--tls-cert and --tls-key swapped?); {TLS_HINT}"
        )
    raise StartupError(
        f"{TLS_UNUSABLE}: the certificate file {path} holds no PEM certificate (-----BEGIN CERTIFICATE-----); "
        f"a DER one converts with `openssl x509 -inform der -in {path} -out cert.pem`; {TLS_HINT}"
    )


def _check_key_pem(path: str, pem: bytes) -> None:
    if b"ENCRYPTED PRIVATE KEY-----" in pem or b"Proc-Type: 4,ENCRYPTED" in pem:
        raise StartupError(_encrypted_key(path))
    if b"-----BEGIN" in pem and b"PRIVATE KEY-----" in pem:
        return
    swapped = " (--tls-cert and --tls-key swapped?)" if b"CERTIFICATE-----" in pem else ""
    raise StartupError(
        f"{TLS_UNUSABLE}: the key file {path} holds no PEM private key (-----BEGIN PRIVATE KEY-----){swapped}; "
        f"{TLS_HINT}"
    )


def _encrypted_key(path: str) -> str:
    return (
        f"{TLS_UNUSABLE}: the key file {path} is encrypted (protected by a pass phrase), and the server "
        f"never asks for one: decrypt it once with `(umask 077; openssl pkey -in {path} -out {path}.plain)` "
        "and give that file to --tls-key ([server] tls_key)"
    )


def _tls_ssl_error(cert: str, key: str, exc: ssl.SSLError) -> str:
    """OpenSSL's refusal in words; "PEM lib" names no file, so the certificate is tried alone."""
    if exc.reason == "KEY_VALUES_MISMATCH":
        return (
            f"{TLS_UNUSABLE}: the key in {key} does not belong to the certificate in {cert}: "
            f"give the key the certificate was issued for; {TLS_HINT}"
        )
    if exc.reason is None or "PEM lib" in str(exc):
        try:
            ssl.SSLContext(SSL_PROTOCOL_VERSION).load_verify_locations(cafile=cert)
            damaged = f"the key file {key}"
        except (ssl.SSLError, OSError):
            damaged = f"the certificate file {cert}"
        return f"{TLS_UNUSABLE}: {damaged} is damaged (OpenSSL cannot parse its PEM); {TLS_HINT}"
    return f"{TLS_UNUSABLE}: {exc.reason} ({cert}, {key}); {TLS_HINT}"


async def _serve_locked(config: Config, host: str, port: int, *, accept_data_loss: bool = False) -> None:
    # The composition root: the Server (store, providers, tools, kernel), then the services around
    # it (hub, metrics, cron), each handed to the front ends that use it.
    before, after = raise_fd_limit()
    if after != before:
        log.info("open file limit raised from %d to %d (the hard limit)", before, after)
    server = Server(config)
    server.store.accept_data_loss = accept_data_loss
    services = build_services(server)
    stopping = Stopping()  # the requests a stop answers with an error object (GRACE_S)
    app, authenticator = build_asgi(config, server, services, stopping)
    check_port_free(host, port)
    # Open the store (refusing a damaged one) and settle crashed turns before uvicorn runs the
    # lifespan, which then finds the server open: a refusal is one line, not a lifespan traceback.
    try:
        await server.open(serve=True)
    except BaseException:
        await server.close()
        raise
    # Everything built so far (modules, config, the kernel) lives as long as the process: keep it out
    # of the collector's generations, so a full collection does not walk it again and again.
    gc.collect()
    gc.freeze()
    gc.enable()  # off since the start (cli/main.py `run`)
    # A full collection walks every tracked object not frozen (tens of milliseconds with a thousand
    # conversations in memory); the kernel leaves no cyclic garbage per turn (tests/test_kernel_memory.py),
    # so full collections can be ten times rarer than the default without holding more memory.
    # Young collections are rarer too: a request allocates thousands of objects that reference
    # counting frees anyway, and every 700 allocations (the default) the collector walked the ones
    # still alive (a few percent of the server's time at concurrency 64).
    _, gen1, _ = gc.get_threshold()
    gc.set_threshold(YOUNG_COLLECTION_EVERY, gen1, FULL_COLLECTION_EVERY)
    tls = bool(config.server.tls_cert and config.server.tls_key)
    # One refusal limit for the server: the edge's lines share the guard's (docs/security.md)
    edge = EdgeLimits.from_config(config.limits, refusal_lines=app.refusals)
    proxies = parse_trusted_proxies(config.server.trusted_proxies)
    # With a certificate, the edge does the TLS handshake itself, on a plain listener: so a
    # connection is counted by the cap from its accept and its handshake is timed
    # (edge.TlsAcceptProtocol), where uvicorn's TLS listener showed it to the edge only once the
    # handshake was done. The context is made as uvicorn would make it (load_tls_context).
    tls_context: ssl.SSLContext | None = None
    if config.server.tls_cert and config.server.tls_key:
        tls_context = load_tls_context(config.server.tls_cert, config.server.tls_key)
    uv_config = uvicorn.Config(
        app,
        host=host,
        port=port,
        # httptools, explicitly, with the edge limits (head cap, head/body/idle timeouts,
        # connection cap at accept): appserver/security/edge.py. Never "auto".
        http=protocol_class(edge, tls_context),
        backlog=accept_backlog(edge.max_connections),  # a burst of connects never reaches the fd limit
        ws=EdgeWebSocketProtocol,  # its handshake refusals carry x-request-id too
        timeout_keep_alive=max(1, math.ceil(edge.keepalive_timeout_s)),  # the protocol uses the exact value
        # Forwarding headers only from the configured proxies (none by default), so a client cannot
        # pick the address the per-client limit counts.
        proxy_headers=bool(proxies),
        forwarded_allow_ips=proxies,
        lifespan="on",
        log_level="warning",
        access_log=False,  # warnings only anyway; on, uvicorn formats each reply's access line before dropping it
        server_header=False,
        timeout_graceful_shutdown=int(GRACE_S + DRAIN_S),
        ws_max_size=config.limits.ws_frame_max_bytes,
        # Off by default: each subscriber's frames are compressed apart (its own zlib context), which
        # made fanning a turn out to 1,000 subscribers CPU-bound and doubled an idle connection's memory.
        ws_per_message_deflate=config.server.ws_compression,
        ws_ping_interval=config.limits.ws_ping_interval_s or None,
        ws_ping_timeout=pong_wait(config.limits.ws_ping_interval_s, config.limits.ws_ping_timeout_s),
        # no ssl_certfile/ssl_keyfile: the edge's protocol does TLS (tls_context above)
    )
    install_redactor(redactor_from_config(config, authenticator.secrets()))
    install_request_ids()
    logging.getLogger("asyncio").addFilter(AcceptErrorThrottle())
    log.info(
        "edge limits: %d connections (fd limit %d), head %d bytes in %g s, body stall %g s, idle %g s; "
        "trusted proxies: %s",
        edge.max_connections,
        fd_limit(),
        edge.head_max_bytes,
        edge.head_timeout_s,
        edge.body_timeout_s,
        edge.keepalive_timeout_s,
        ", ".join(proxies) or "none",
    )
    uv = _UvicornServer(uv_config, services.hub, stopping, services.channels.pause_intake)
    task = asyncio.create_task(uv.serve())
    while not uv.started:
        if task.done():
            await server.close()
            await task
            fail(f"could not start on {host}:{port}", 1)
        await asyncio.sleep(0.005)  # uvicorn binds within a few ms: so does server.json
    bound_port = uv.servers[0].sockets[0].getsockname()[1] if uv.servers and uv.servers[0].sockets else port
    url = url_for(host, bound_port, tls)
    try:
        info = write_server_json(
            config.server_json, url, config.auth.mode, home=str(config.home), store=store_record(config.store.url)
        )
    except OSError:  # e.g. a full disk: stop cleanly, then report it in one line
        uv.should_exit = True
        await task
        raise
    keeper = ServerJsonKeeper(config.server_json, info)
    server.readiness.amend("state_files", keeper.readiness)
    keeping = asyncio.create_task(_keep_server_json(keeper))
    click.echo(f"appserver listening on {url}  (home {config.home})", err=False)
    services.channels.server_bound(url)
    try:
        await task
    finally:
        keeping.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await keeping
        remove_server_json(config.server_json)
        authenticator.close()


async def _keep_server_json(keeper: ServerJsonKeeper) -> None:
    """Every SERVER_JSON_CHECK_S: server.json deleted, damaged or changed is written again (one
    stat while it is as written; on the event loop, so a stop never races a rewrite)."""
    while True:
        await asyncio.sleep(SERVER_JSON_CHECK_S)
        try:
            keeper.check()
        except Exception:  # never the end of the server: logged, and the next check tries again
            log.exception("could not check %s", keeper.path)


@click.command("serve")
@click.option("--listen", default=None, help="HOST:PORT to bind (default 127.0.0.1:8770).")
@click.option(
    "--auth",
    "auth_mode",
    type=click.Choice(["none", "token", "jwt"]),
    default=None,
    help="Authentication mode (overrides [auth] mode).",
)
@click.option(
    "--tls-cert",
    default=None,
    type=click.Path(dir_okay=False),
    help="PEM certificate: serve https.",
)
@click.option(
    "--tls-key",
    default=None,
    type=click.Path(dir_okay=False),
    help="PEM private key for --tls-cert.",
)
@click.option(
    "--standby",
    is_flag=True,
    help="When a server already runs on this home, wait (no kernel, no socket) and take over when it stops or dies.",
)
@click.option(
    "--accept-data-loss",
    is_flag=True,
    help="Start even though the store lost committed data (a damaged write-ahead log, or a store behind "
    "its recorded position); a copy of the files is kept. Only after reading the refusal message.",
)
@click.option(
    "--channels",
    "channels",
    default=None,
    metavar="IDS",
    help="Comma-separated channels to run (e.g. webhook,telegram); overrides [channels] enabled. '' runs none.",
)
@click.option(
    "--store",
    "store_url",
    default=None,
    metavar="URL",
    help="The store: postgresql://USER[:PASSWORD]@HOST[:PORT]/DB, or '' for the SQLite file in the home "
    "(overrides [store] url).",
)
def serve_command(
    channels: str | None,
    listen: str | None,
    auth_mode: str | None,
    tls_cert: str | None,
    tls_key: str | None,
    standby: bool,
    accept_data_loss: bool,
    store_url: str | None,
) -> None:
    """Run the server (one per home; see --standby)."""
    config = get_config(follow_server=False)  # its own store: what it says (and writes to server.json)
    if store_url is not None:
        config.store.url = store_url
    if auth_mode:
        config.auth.mode = auth_mode
    if channels is not None:
        try:
            config.channels.enabled = parse_enabled(channels, "--channels")
        except ValueError as exc:
            fail(str(exc), 2)
        _refuse_unknown_channels(config, config.channels.enabled)
    if tls_cert or tls_key:
        if not (tls_cert and tls_key):
            fail("--tls-cert and --tls-key go together", 2)
        config.server.tls_cert, config.server.tls_key = tls_cert, tls_key
    try:
        addr = parse_listen(listen or config.server.listen)
        check_bind_allowed(addr, config.auth.mode)
        Authenticator(config).close()  # a bad JWT/token configuration fails here, before any socket opens
        store_kind(config.store.url)  # a bad --store URL too (shown without its password)
        if config.server.tls_cert and config.server.tls_key:
            check_tls_files(config.server.tls_cert, config.server.tls_key)
    except (ValueError, ConfigError) as exc:
        fail(str(exc), 2)
    host, port = addr.host, addr.port
    lock, live = claim_home(config.server_json, SERVE)
    if lock is None and not standby:
        fail(refusal(config, live), 3)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # httpx logs every upstream request at INFO: a log line per model call costs latency and
    # floods the log; its warnings and errors still show.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    log.info("config: %s", config.source)
    config.server.listen = str(addr)
    with asyncio.Runner(loop_factory=event_loop_factory(config.server.event_loop)) as runner:
        runner.run(serve_async(config, host, port, lock, accept_data_loss=accept_data_loss))


def _refuse_unknown_channels(config: Config, wanted: list[str]) -> None:
    """`--channels` naming a channel that is neither first-party nor a plugin folder of this home
    (a typo) is refused before anything starts (exit 2, listing the known ones), as every other bad
    flag is: it used to start and say only that the channel "has no account". A plugin folder whose
    manifest is broken is known: the gateway reports what is wrong with it."""
    from plugins.loader import FIRST_PARTY, channels_dir, discover  # only when --channels is given

    known = sorted({*FIRST_PARTY, *discover(config.home)})
    unknown = [c for c in wanted if c not in known]
    if unknown:
        names = ", ".join(repr(c) for c in unknown)
        fail(
            f"--channels: unknown channel {names}: known channels are {', '.join(known)} "
            f"(a user plugin lives in {channels_dir(config.home) / unknown[0] / 'channel.json'})",
            2,
        )


def event_loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """`asyncio` (the default) is the standard loop; `uvloop` / `auto` (uvloop when installed)
    spend a few percent less CPU per request, but see docs/configuration.md for why uvloop is not
    the default."""
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            fail('[server] event_loop = "uvloop", but uvloop is not installed (pip install uvloop)', 2)
        return None
    return uvloop.new_event_loop
