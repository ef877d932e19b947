"""Shared CLI plumbing: the home/config, JSON output, one-line errors with exit codes.

An operator's problem (bad config, damaged store, full disk, busy port, missing TLS file) ends a
command with one line saying what, where and what to do, and exit code 2; the traceback only
with `appserver --debug`. A bug (an error `explain` does not know) keeps its traceback. A stdout
whose reader left (`appserver … | head -1`) ends the command quietly with exit code 141.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import re
import select
import sqlite3
import ssl
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import click

from appserver.cli.safetext import json_text, visible
from appserver.config import Config, ConfigError, load_config
from appserver.errors import KernelError
from appserver.fsutil import CorruptStateFile, os_error_line
from appserver.serverinfo import HomeStarting, find_live_server, read_live_server
from appserver.store.base import StoreError
from appserver.store.url import REDACTED, redact_url, store_kind

if TYPE_CHECKING:  # the kernel is imported by the commands that run it, not by `appserver --help`
    from appserver.server import Server

T = TypeVar("T")

DEBUG_ENV = "APPSERVER_DEBUG"  # set by `appserver --debug`: tracebacks instead of one-line errors


class StartupError(Exception):
    """A start that cannot go on (busy port, missing TLS file); the message is the one line to show."""


def fail(message: str, code: int = 1) -> NoReturn:
    """One error line and exit `code`; the message often carries a server's or a model's words, so
    its controls are shown, not obeyed, and often the argument it refuses, so a long one is shortened
    (`short_values`)."""
    click.echo(error_line(message), err=True)
    sys.exit(code)


def error_line(message: str) -> str:
    """`error: <message>` as every command prints it (see `fail`)."""
    return f"error: {visible(short_values(message, sys.argv[1:]))}"


QUOTED_MAX = 100  # characters of a user's value that an error line shows
RUN_MAX = 1000  # a longer run without blanks in an error line is a value echoed whole, never prose


def quoted(value: str, limit: int = QUOTED_MAX) -> str:
    """A user's value as an error line shows it: repr-quoted, so an empty or blank one is seen, and
    cut after `limit` characters, so a refused 100 KB argument is not 100 KB on stderr."""
    if len(value) <= limit:
        return repr(value)
    shown = repr(value[:limit])
    return f"{shown[:-1]}…{shown[-1]} ({len(value)} characters)"


def short_values(message: str, args: Sequence[str]) -> str:
    """`message` with each long command-line value it echoes (repr-quoted or bare; as given, upper-
    or lower-cased, as the kernel's and the gateway's messages do) shown by `quoted`, and any other
    run of more than RUN_MAX characters without a blank (a value echoed after another change) cut."""
    message = _cut_in_value(message, args)
    for value in sorted(_long_values(args), key=len, reverse=True):
        for form in (value, value.upper(), value.lower()):
            message = message.replace(repr(form), quoted(form)).replace(form, quoted(form))
    return re.sub(rf"\S{{{RUN_MAX + 1},}}", lambda m: quoted(m.group()), message)


# The mark a server puts where it cut a message at its cap (`appserver.shown.capped_message`).
CAPPED = re.compile(r"(?P<head>.*)… \(\d+ characters\)", re.DOTALL)


def _cut_in_value(message: str, args: Sequence[str]) -> str:
    """A server's message that its cap cut inside a long command-line value it quoted whole (an
    older server's): that value shown by `quoted`, with its own length, and the cut said in words;
    else the cut text was quoted again as a run, with the message's length after the run's."""
    capped = CAPPED.fullmatch(message)
    if capped is None:
        return message
    head = capped["head"]
    for value in sorted(_long_values(args), key=len, reverse=True):
        for form in (value, value.upper(), value.lower()):
            for text in (repr(form), form):
                start = head.find(text[:QUOTED_MAX])
                while start >= 0:
                    if text.startswith(head[start:]):
                        return f"{head[:start]}{quoted(form)} (the rest of the message was cut)"
                    start = head.find(text[:QUOTED_MAX], start + 1)
    return message


def _long_values(args: Sequence[str]) -> set[str]:
    """The command-line values longer than QUOTED_MAX (an option's `--name=VALUE` too)."""
    values = {arg.split("=", 1)[1] if arg.startswith("--") and "=" in arg else arg for arg in args}
    return {value for value in values if len(value) > QUOTED_MAX}


def not_utf8(text: str) -> bool:
    """Does `text` hold bytes that were not UTF-8? Python hands such argv and environment bytes over as
    lone surrogates (surrogateescape), which every later encode (SQLite, JSON, a frame) refuses."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def shown_raw(text: str, limit: int = 80) -> str:
    """`text` as the bytes it came from, escaped (`'caf\\xe9'`), so that the line saying it is bad
    is readable and stays one line (the bad argument may be a whole prompt): a long one is shown
    around its first byte that is not UTF-8, cut with "..." on either side."""
    bad = next((i for i, ch in enumerate(text) if "\ud800" <= ch <= "\udfff"), 0)
    start = max(0, bad - limit // 4)
    window = text[start : start + limit // 2]

    def escaped(part: str) -> str:
        try:
            return repr(part.encode("utf-8", "surrogateescape"))[2:-1]
        except UnicodeEncodeError:  # a surrogate no byte decoded to (only from Python callers)
            return repr(part.encode("utf-8", "backslashreplace"))[2:-1]

    whole = escaped(text)
    if len(whole) + 2 <= limit:
        return f"'{whole}'"
    return (
        "'"
        + ("..." if start else "")
        + escaped(window)[:limit]
        + ("..." if start + len(window) < len(text) else "")
        + "'"
    )


def refuse_non_utf8_args(args: Sequence[str]) -> None:
    """Every command, before it parses anything: an argument that is not UTF-8 is one line and exit code
    2, naming it, instead of a traceback wherever the text is first encoded (or a server's refusal)."""
    for n, arg in enumerate(args, 1):
        if not_utf8(arg):
            after = f", after {args[n - 2]}" if n > 1 and args[n - 2].startswith("-") else ""
            fail(f"argument {n} ({shown_raw(arg)}{after}) is not valid UTF-8: give arguments as UTF-8 text", 2)


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV) == "1"


def _os_error(exc: OSError) -> str:
    named = os_error_line(exc)  # the server's log and error frames say a file's error the same way
    if named is not None:
        return named
    if exc.filename is not None:  # a file's error without an errno (`OSError("…", path)`)
        return f"{exc.filename}: {exc.strerror or exc}"
    return _os_error_unnamed(exc)


def _os_error_unnamed(exc: OSError) -> str:
    """An OSError that names no file (a library's bare errno, as OpenSSL's EINVAL was for an
    encrypted TLS key): what the system said, and how to see where it came from."""
    if exc.errno == errno.ENOSPC:
        return "no space left on a device this command writes to: free some space there and start again"
    if exc.errno == errno.EPIPE:
        return f"broken pipe: what this command was writing to (a pipe or a connection) went away ({exc.strerror})"
    name = errno.errorcode.get(exc.errno or 0)
    said = f"{exc.strerror} ({name})" if exc.strerror and name else str(exc) or type(exc).__name__
    return f"operating-system error: {said}; `appserver --debug …` shows where it happened"


# The most items one --limit/--count may ask for: far more than anyone reads in a terminal, far below the
# integers SQLite takes (a bigger LIMIT was an OverflowError traceback).
MAX_COUNT = 100_000


class Count(click.IntRange):
    """How many items to list: 1 to `maximum`. 0 and negative numbers (which SQLite takes as "no
    limit") and absurd ones are usage errors (exit 2), not everything or a traceback."""

    name = "count"

    def __init__(self, maximum: int = MAX_COUNT) -> None:
        super().__init__(min=1, max=maximum)


STDOUT_CLOSED_EXIT = 141  # 128 + SIGPIPE: what a shell shows for a writer its reader left (`| head`)


def _pipe_gone(stream: Any) -> bool:
    """Has the reader of this stream's pipe (or terminal) gone away? One poll, no wait."""
    try:
        fd = stream.fileno()
        poller = select.poll()
    except (AttributeError, OSError, ValueError):  # not a real file (a test runner's buffer), or no poll()
        return False
    poller.register(fd, 0)  # errors and hang-ups are reported whatever is asked for
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


def stdout_closed(exc: BaseException) -> bool:
    """Is `exc` the broken pipe of writing to a stdout nobody reads any more (`appserver … | head -1`)?

    That is no error worth a line: the reader had what it wanted. A broken pipe anywhere else (a
    connection to the server) is one, so it must be stdout's own pipe that is gone.
    """
    return isinstance(exc, OSError) and exc.errno == errno.EPIPE and _pipe_gone(sys.stdout)


def exit_stdout_closed() -> NoReturn:
    """Leave as a command piped into `head` does: say nothing, exit 141. What is still buffered goes
    to /dev/null, so the interpreter's last flush cannot print `Exception ignored … BrokenPipeError`."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for stream in (sys.stdout, sys.stderr):
            if _pipe_gone(stream):
                os.dup2(devnull, stream.fileno())
    finally:
        os.close(devnull)
    sys.exit(STDOUT_CLOSED_EXIT)


def explain(exc: BaseException) -> str | None:
    """One line for an error the operator can fix, or None for one they cannot (a bug)."""
    if isinstance(exc, (ConfigError, CorruptStateFile, StoreError, HomeStarting, StartupError)):
        return " ".join(str(exc).split())
    if isinstance(exc, TimeoutError) and exc.errno is None:
        # asyncio's wait_for/timeout: an OSError since Python 3.11, but no file's and no errno's
        return f"timed out{': ' + ' '.join(str(exc).split()) if str(exc) else ''} (a wait did not end in time)"
    if isinstance(exc, ssl.SSLError):
        return (
            f"TLS certificate or key unusable: {exc.reason or exc}; "
            "check --tls-cert/--tls-key ([server] tls_cert/tls_key)"
        )
    if isinstance(exc, OSError):
        return _os_error(exc)
    if isinstance(exc, sqlite3.Error):
        if "disk is full" in str(exc):
            return (
                "no space left for the store (SQLite: database or disk is full): "
                "free some space on the device holding the home directory and start again"
            )
        if "database is locked" in str(exc):
            return (
                "the store is locked by another process that keeps writing to it (SQLite: database is locked); "
                "wait for it to finish (a long command, a backup, an `sqlite3` shell with an open transaction) "
                "and try again"
            )
        return f"store error: {exc}"
    return None


def run_or_fail(fn: Callable[[], T]) -> T:
    """Run `fn`; an operator's error becomes one line and exit code 2 (traceback with --debug)."""
    try:
        return fn()
    except (click.ClickException, click.exceptions.Exit, click.Abort, KeyboardInterrupt, SystemExit):
        raise
    except Exception as exc:
        if stdout_closed(exc):
            exit_stdout_closed()
        message = explain(exc)
        if message is None or debug_enabled():
            raise
        fail(message, 2)


def get_config(*, follow_server: bool = True) -> Config:
    """The home's config; with `follow_server` (every command but `serve`), its store is the one
    the live server of the home uses (see `follow_server_store`)."""
    config = run_or_fail(load_config)
    if follow_server:
        follow_server_store(config)
    return config


# Commands that never open the home's store (they go through the server, or edit config.toml and
# gateway files): a store they cannot follow is no reason to refuse them. `store copy` refuses a
# live home itself.
STORE_FREE_COMMANDS = frozenset({"run", "chat", "serve", "channels", "pairing", "store"})


def follow_server_store(config: Config) -> None:
    """Act on the store the live server of this home uses, not on the one config.toml names: a
    server started with `serve --store URL` (or another APPSERVER_STORE__URL) keeps agents, tokens
    and cron tasks there, and a CLI command writing the home's other store was silently lost.

    server.json records that URL without its password. When nothing was withheld (SQLite, or a
    PostgreSQL URL with no password: trust, peer or .pgpass auth) the command follows it; else a
    command that opens the store is refused with one line saying how to point it there."""
    live = run_or_fail(lambda: read_live_server(config.server_json))
    record = (live or {}).get("store")
    if live is None or not isinstance(record, dict):
        return  # no server, or an older one that does not say: config.toml's store
    theirs = str(record.get("url") or "")
    ours = config.store.url.strip()
    if _without_password(redact_url(ours)) == _without_password(theirs):
        return  # the same store: ours may carry the password the server got elsewhere (.pgpass, PGPASSWORD)
    if record.get("complete") is True:
        if ours:
            click.echo(
                f"note: the server running on this home uses the store {_store_text(theirs, config)}; "
                f"this command acts on it, not on {_store_text(ours, config)}",
                err=True,
            )
        config.store.url = theirs
        return
    if _command_names() & STORE_FREE_COMMANDS:
        return
    fail(
        f"the server running on this home ({live.get('url')}, pid {live.get('pid')}) uses the store "
        f"{_store_text(theirs, config)}, but this command would use {_store_text(config.store.url, config)}; "
        "server.json keeps that URL without its password, so point this command at the same store: set "
        "APPSERVER_STORE__URL to its full URL (or [store] url in config.toml)",
        2,
    )


def _without_password(redacted: str) -> str:
    """A redacted store URL with its (hidden) password left out, to compare two names of one store."""
    return redacted.replace(f":{REDACTED}@", "@").replace(f"password={REDACTED}", "")


def _store_text(url: str, config: Config) -> str:
    return redact_url(url.strip()) if url.strip() else f"the SQLite file {config.db_path}"


def _command_names() -> set[str]:
    """The running subcommand's top-level name (`agents` of `appserver agents create`), as a set."""
    ctx = click.get_current_context(silent=True)
    names: list[str] = []
    while ctx is not None and ctx.parent is not None:
        names.append(ctx.info_name or "")
        ctx = ctx.parent
    return {names[-1]} if names else set()


def prepare_store_schema(config: Config) -> None:
    """A PostgreSQL store's schema made (on a new database) or brought up to date before a command
    reads or writes one of its tables without opening the store (tokens, cron tasks): a new
    database had no tables yet, and such a command failed on its first statement. SQLite: nothing
    to do (those live in files of the home)."""
    if store_kind(config.store.url) != "postgresql":
        return
    from appserver.store.select import make_store  # the driver, only for PostgreSQL

    store = make_store(config)
    prepare = getattr(store, "prepare_schema", None)
    if prepare is not None:
        run_or_fail(lambda: asyncio.run(prepare()))


def live_server_or_fail(server_json: Path) -> dict[str, Any] | None:
    """server.json of the server that owns this home (waiting while one starts), or None."""
    try:
        return find_live_server(server_json)
    except HomeStarting as exc:
        fail(f"{exc}; try again in a moment", 3)


OUTPUT_PIECE = 32 * 1024  # characters per write of a long output (see print_json)


def print_json(value: Any) -> None:
    """`--json` output: the exact values, with DEL and C1 controls as `\\u` escapes (as JSON does C0).

    Written in pieces: one write of a big text into a pipe whose reader left midway (`| head -1`)
    returns short, and Python reports it done, so the command went on and exited 0; the next
    piece's write fails with EPIPE, which ends it the way a plain listing ends (exit 141)."""
    echo_long(json_text(json.dumps(value, indent=2, ensure_ascii=False, default=str)))


def echo_long(text: str) -> None:
    """`click.echo(text)` for a text that may be long (a `--json` listing), in pieces: see print_json."""
    for start in range(0, len(text), OUTPUT_PIECE):
        click.echo(text[start : start + OUTPUT_PIECE], nl=False)
    click.echo()


def with_server(fn: Callable[[Server], Awaitable[T]], *, config: Config | None = None) -> T:
    """Run `fn` against an in-process Server on this home; kernel errors become one-line exits."""

    from appserver.server import Server

    async def runner() -> T:
        server = Server(config or get_config())
        await server.open()
        try:
            return await fn(server)
        finally:
            await server.close()

    try:
        return run_or_fail(lambda: asyncio.run(runner()))
    except KernelError as exc:
        fail(exc.message, 2 if exc.http_status in (400, 404, 409) else 1)


async def cancel_until_done(task: asyncio.Future[Any], wait_s: float, poll_s: float) -> bool:
    """Cancel `task`, and again every `poll_s` while it has not ended, for at most `wait_s`; True
    when it ended. Once is not enough: Python 3.11's `asyncio.wait_for` drops a cancel that lands as
    its inner awaitable completes (a server's reply arriving with the signal), and the task goes on."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while not task.done() and loop.time() < deadline:
        task.cancel()
        await asyncio.wait((task,), timeout=poll_s)
    return task.done()
