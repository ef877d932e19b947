"""`python -m gateway`: the child process the supervisor in `appserver serve` runs.

First thing, stdout is taken for control lines (nothing else can write to it). The first stdin line
is the start envelope (server URL, the gateway's credential, the home, the accounts with secret
references; for a server of a cluster `intake_until`, see `IntakeGate`); every later line is a
command envelope `{"id", "op", ...}` answered by one `GATEWAY_RESPONSE`. End of stdin means the
server is gone: stop and exit, so nothing is orphaned.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import signal
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any, cast

from gateway.accounts import AccountSpec
from gateway.app import Gateway
from gateway.db import (
    CorruptGatewayDB,
    LedgerFileRefused,
    SchemaTooNew,
    default_path,
    open_db,
    record_opened_ledger,
)
from gateway.delivery import DeliveryFailed
from gateway.intake import IntakeGate, ServerProcess
from gateway.ledger import Ledger
from gateway.link import ServerLink
from gateway.redact import SecretMask, known_secrets, mask_stored
from gateway.sqlstore import PgConnection, fence_exit, import_sqlite, open_pg, url_secrets
from gateway.stdio import COMMAND_MAX_LINE, ControlWriter, Overlong, read_command

log = logging.getLogger("gateway")

# how long the child waits for the supervisor's start envelope on stdin
START_ENVELOPE_TIMEOUT_S = 30.0
CONNECT_TIMEOUT_S = 25.0
# One gateway process per gateway.db. A child orphaned by a killed server (or one a standby took
# over from) is still stopping for a few seconds (STOP_TIMEOUT_S per account) after its stdin closed:
# the next child waits that long for it, so two never deliver the same replies side by side.
LOCK_WAIT_S = 15.0

EXIT_OK = 0
EXIT_BAD_START = 2
EXIT_SERVER_GONE = 3


def main() -> int:
    mask = SecretMask()  # before anything can log or say a secret: no account has resolved one yet
    control = ControlWriter.take_stdout(redact=mask.redact_all)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per platform request floods the log
    mask.install()
    try:
        return asyncio.run(_main(control, mask))
    except KeyboardInterrupt:
        return EXIT_OK


async def _stdin() -> asyncio.StreamReader:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=COMMAND_MAX_LINE)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(0, "rb", buffering=0))
    return reader


async def _main(control: ControlWriter, mask: SecretMask) -> int:
    loop = asyncio.get_running_loop()
    # the supervisor stops us through stdin; a closed terminal sends SIGHUP to serve's whole group
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, lambda: None)
    stdin = await _stdin()
    try:
        line = await asyncio.wait_for(stdin.readline(), START_ENVELOPE_TIMEOUT_S)
        start = json.loads(line)
        if not isinstance(start, dict) or start.get("op") != "start":
            raise ValueError("the first line must be the start envelope")
        home = Path(str(start["home"]))
        specs = [AccountSpec.from_json(a) for a in start.get("accounts") or []]
        gate = _intake_gate(start.get("intake_until"), stdin)
        store = _store_of(start.get("store"))
    except (TimeoutError, ValueError, KeyError, TypeError) as exc:
        log.error("no valid start envelope on stdin: %s", exc)
        return EXIT_BAD_START
    # Every account's secrets, before any plugin (or its library) can log one; an account resolves
    # its own again at each start (a rotated file), and hands them over then too.
    mask.add_all(known_secrets(specs, home, os.environ))
    if isinstance(start.get("token"), str):
        mask.add("gateway credential", start["token"])
    if store is not None:
        for secret in url_secrets(store[0]):
            mask.add("store password", secret)

    lock = await lock_ledger(home, control)  # held until this process exits
    if lock is None:
        return EXIT_BAD_START
    if store is None:
        ledger = _open_ledger(home, control)
        if ledger is None:
            return EXIT_BAD_START
        record_opened_ledger(default_path(home).with_name("gateway.lock"), ledger.connection)  # see LedgerReplacedInUse
    else:
        ledger = _open_pg_ledger(home, store, specs, control)
        if ledger is None:
            return EXIT_BAD_START
    mask_stored(ledger.connection, mask)  # a platform's error quoting a token, saved as a reason
    try:
        link = await asyncio.wait_for(ServerLink.open(str(start["url"]), start.get("token")), CONNECT_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - any failure to reach the server ends this start
        log.error("cannot reach the server at %s: %s", start.get("url"), exc)
        return EXIT_SERVER_GONE
    link.redact = mask.redact_all
    gateway = Gateway(home, ledger, link, specs, control.event, on_secrets=mask.add_all, gate=gate)
    try:
        await gateway.start()
        control.ready()
        log.info("ready: %s", ", ".join(f"{r['channel']}:{r['account']}={r['state']}" for r in gateway.statuses()))
        return await _serve_commands(gateway, stdin, control, link)
    finally:
        await gateway.stop()
        await link.close()
        ledger.close()


def _store_of(given: Any) -> tuple[str, str | None] | None:
    """(URL, instance id) of the server's PostgreSQL store from the start envelope's `store`
    (`{"url", "instance"}`), None for a server on SQLite: the gateway then keeps gateway.db."""
    if given is None:
        return None
    if not isinstance(given, dict) or not isinstance(given.get("url"), str) or not given["url"].strip():
        raise ValueError("store must be an object with a url")
    instance = given.get("instance")
    if instance is not None and not isinstance(instance, str):
        raise ValueError("store.instance must be a string")
    return given["url"], instance


def _open_pg_ledger(
    home: Path, store: tuple[str, str | None], specs: list[AccountSpec], control: ControlWriter
) -> Ledger | None:
    """The ledger in the server's PostgreSQL database (gateway/sqlstore.py): read for the accounts
    this gateway runs, its writes fenced by the cluster's `channel_owners` when the server is an
    instance of one. The home's gateway.db, if any, is imported once first (`import_sqlite`)."""
    url, instance = store
    try:
        conn = open_pg(url, instance=instance, scope=[(s.channel, s.name) for s in specs], on_fenced=fence_exit)
    except (sqlite3.Error, OSError, ImportError) as exc:
        message = f"cannot open the gateway tables in the server's PostgreSQL database: {exc}"
        log.error("%s", message)
        control.event("gateway_error", {"message": message})
        return None
    _import_gateway_db(home, conn, control)
    return Ledger(cast(sqlite3.Connection, conn))  # it runs the statements a sqlite3 connection runs


def _import_gateway_db(home: Path, conn: PgConnection, control: ControlWriter) -> None:
    """Copy the home's gateway.db (a server that ran on SQLite, or alone) into PostgreSQL, once.
    A file that cannot be read is named and left as it is; the gateway starts without it."""
    path = default_path(home)
    try:
        if not os.path.exists(path):  # (`ledger_exists` would see our own gateway.lock held)
            return
        source = open_db(path, gateway=True)
    except (CorruptGatewayDB, SchemaTooNew, LedgerFileRefused, sqlite3.Error, OSError) as exc:
        message = f"{path} was not imported into the PostgreSQL database: {exc}"
        log.error("%s", message)
        control.event("gateway_error", {"message": message})
        return
    try:
        copied = import_sqlite(conn, source, home)
    except sqlite3.Error as exc:
        message = f"{path} was not imported into the PostgreSQL database: {exc}"
        log.error("%s", message)
        control.event("gateway_error", {"message": message})
        return
    finally:
        source.close()
    if copied is not None:
        log.info(
            "imported %d row(s) of %s into the PostgreSQL database (once; the file is no longer used)", copied, path
        )


def _intake_gate(until: Any, stdin: asyncio.StreamReader) -> IntakeGate:
    """The intake gate the start envelope asks for: open for good without `intake_until` (a server
    alone on its store), else open until then (a server of a cluster vouches for it from then on)
    while the server, this process's parent, is not stopped, and has not closed our stdin (a
    stopping server may, before this child read any command, with no word to pause it)."""
    if until is None:
        return IntakeGate()
    if isinstance(until, bool) or not isinstance(until, int | float):
        raise ValueError("intake_until must be a number")
    return IntakeGate(float(until), ServerProcess.parent(), stdin.at_eof)


async def lock_ledger(home: Path, control: ControlWriter, wait_s: float = LOCK_WAIT_S) -> int | None:
    """Take `channels/gateway.lock` (flock, exclusive, held until this process exits, even on kill -9)
    and write our pid in it: one gateway process per gateway.db. Waits up to `wait_s` for the
    process holding it to exit; then refuses, naming it (the supervisor retries with backoff). The
    open descriptor is returned (kept for the process's life), or None when refused."""
    path = default_path(home).with_name("gateway.lock")
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:  # a directory in its place, no permission, a read-only home
        message = f"cannot open the gateway lock {path}: {exc.strerror or exc}"
        log.error("%s", message)
        control.event("gateway_error", {"message": message})
        return None
    deadline = time.monotonic() + wait_s
    waiting = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            who = f"another gateway process (pid {holder})" if holder.isdigit() else "another gateway process"
            if time.monotonic() >= deadline:
                os.close(fd)
                message = (
                    f"{who} still runs on {default_path(home)} after {wait_s:g} s; refusing to start a second"
                    " one on the same ledger (it would deliver the same replies)"
                )
                log.error("%s", message)
                control.event("gateway_error", {"message": message})
                return None
            if not waiting:
                log.warning("waiting for %s on %s to exit (at most %g s)", who, default_path(home), wait_s)
                waiting = True
            await asyncio.sleep(0.05)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError as exc:  # the pid is for people reading the file; the lock itself is held
        log.warning("could not write our pid in %s: %s", path, exc)
    return fd


def _open_ledger(home: Path, control: ControlWriter) -> Ledger | None:
    path = default_path(home)
    try:
        return Ledger.open(path, gateway=True)
    except CorruptGatewayDB as exc:
        log.error("%s; starting with an empty ledger", exc)
        control.event("gateway_error", {"message": str(exc)})
        return Ledger.open(path, gateway=True)
    except SchemaTooNew as exc:
        log.error("%s", exc)
        control.event("gateway_error", {"message": str(exc)})
        return None
    except LedgerFileRefused as exc:  # a link to nothing, a directory, read-only: left in place, named
        message = f"the gateway does not start: {exc}"
        log.error("%s", message)
        control.event("gateway_error", {"message": message})
        return None
    except (sqlite3.Error, OSError) as exc:  # busy, read-only, a failing disk: left where it is
        message = f"cannot open {path}: {exc}"
        log.error("%s", message)
        control.event("gateway_error", {"message": message})
        return None


async def _serve_commands(
    gateway: Gateway, stdin: asyncio.StreamReader, control: ControlWriter, link: ServerLink
) -> int:
    server_gone = asyncio.ensure_future(link.closed.wait())
    tasks: set[asyncio.Task[None]] = set()
    try:
        while True:
            read = asyncio.ensure_future(read_command(stdin))
            await asyncio.wait({read, server_gone}, return_when=asyncio.FIRST_COMPLETED)
            if not read.done():
                read.cancel()
                log.error("the server connection is gone for good; exiting")
                return EXIT_SERVER_GONE
            line = read.result()
            if isinstance(line, Overlong):
                # Skipped, not fatal: every channel runs on. The supervisor refuses to send such a
                # line, so this is a bug or a foreign writer; answer it when its id could be read.
                log.error(
                    "skipped a command line of %d bytes, over the %d-byte limit (command %s)",
                    line.size,
                    COMMAND_MAX_LINE,
                    line.request_id or "without a readable id",
                )
                if line.request_id is not None:
                    control.response(
                        line.request_id,
                        {
                            "ok": False,
                            "error": f"the command was {line.size} bytes, over the gateway's {COMMAND_MAX_LINE}",
                        },
                    )
                continue
            if not line:
                log.info("stdin closed: the server is gone or stopping us; exiting")
                return EXIT_OK
            try:
                command = json.loads(line)
                if not isinstance(command, dict) or not isinstance(command.get("id"), str):
                    raise ValueError("a command is a JSON object with a string id")
            except ValueError as exc:
                log.error("ignored a malformed command line: %s", exc)
                continue
            if command.get("op") == "stop":
                control.response(command["id"], {"ok": True})
                return EXIT_OK
            task = asyncio.ensure_future(_run_command(gateway, command, control))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
    finally:
        server_gone.cancel()
        for task in tasks:
            task.cancel()


async def _run_command(gateway: Gateway, command: dict[str, Any], control: ControlWriter) -> None:
    op, rid = command.get("op"), command["id"]
    try:
        if op == "status":
            control.response(rid, {"ok": True, "accounts": gateway.statuses()})
        elif op == "ping":
            control.response(rid, {"ok": True})
        elif op == "intake":
            gateway.gate.vouch(float(command.get("until") or 0.0))
            control.response(rid, {"ok": True})
        elif op == "deliver":
            ids = await gateway.deliver_text(str(command.get("target")), str(command.get("text") or ""))
            control.response(rid, {"ok": True, "remote_ids": ids})
        else:
            control.response(rid, {"ok": False, "error": f"unknown op {op!r}"})
    except DeliveryFailed as exc:  # the platform's reason, as the ledger and `channels status` show it
        control.response(rid, {"ok": False, "error": str(exc)})
    except Exception as exc:  # noqa: BLE001 - every command is answered, failures included
        control.response(rid, {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
