"""`appserver channels list|add|remove|enable|disable|status` and `appserver channels route add|remove|list`.

Configuration commands edit config.toml as text, so the owner's comments and layout stay as they
were: `add` appends one `[channels.<id>.accounts.<name>]` table, `remove` cuts that table out,
`enable`/`disable` rewrite the `enabled = [...]` line of `[channels]`. Every edit is checked before it
is written: the new text must parse and its `[channels]` must load (`channelconfig.load_channels`,
the rules `load_config` applies), the file must not have changed meanwhile, and the write is atomic.
Anything refused writes nothing and ends with one line on stderr and a non-zero exit code
(2 for a bad argument, 1 for a state that does not allow it).

`status` and the route commands use gateway.db (`$APPSERVER_HOME/channels/gateway.db`) directly, so
they work whether or not a server runs (SQLite WAL lets them write beside the gateway child). A home
whose store is PostgreSQL keeps those tables there (`gateway_*`, gateway/sqlstore.py): they are used
instead, and named as the database (its password masked), never as gateway.db.
"""

from __future__ import annotations

import functools
import importlib.util
import ipaddress
import json
import math
import os
import re
import sqlite3
import time
import tomllib
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import date, datetime
from datetime import time as dtime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

import click
import filelock

from appserver.channelconfig import (
    ACCOUNT_NAME,
    CHANNEL_ID,
    AccountConfig,
    ChannelConfigError,
    ChannelsConfig,
    check_account,
    first_party_settings,
    load_channels,
    shared_secrets,
)
from appserver.cli.common import fail, get_config, print_json, run_or_fail
from appserver.cli.safetext import exact, visible
from appserver.config import Config, ConfigError, expanded_home, load_config
from appserver.fsutil import atomic_write_text
from appserver.serverinfo import read_live_server
from appserver.shown import shown
from appserver.store.url import redact_url
from gateway.access import AccessPolicy, PolicyError
from gateway.accounts import AccountSpec
from gateway.db import (
    CorruptGatewayDB,
    CorruptGatewayDBInUse,
    LedgerFileRefused,
    SchemaTooNew,
    default_path,
    ledger_exists,
    open_db,
)
from gateway.debounce import DebounceError, DebounceSettings
from gateway.ledger import Ledger
from gateway.redact import SecretMask, account_mask
from gateway.routing import ROOT, Route, RouteKey, Router
from gateway.sqlstore import (
    CommitUnknown,
    PgConnection,
    PgDatabaseError,
    PgIntegrityError,
    PgOperationalError,
    migrate,
    open_pg,
)
from gateway.status import AccountStatus, StatusBoard
from plugins.loader import FIRST_PARTY, Manifest, discover

if TYPE_CHECKING:  # the kernel is imported by the commands that use it, not by `appserver --help`
    from appserver.server import Server
    from appserver.store import ConversationRecord

F = TypeVar("F", bound=Callable[..., Any])

BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
LEDGER_STATES = ("received", "allowed", "denied", "held", "submitted", "finished", "delivered", "failed")
READYZ_TIMEOUT_S = 2.0
# A last failure's reason in `status`: in the table (after its age), and in --json (an error answer's
# excerpt is at most 200 characters of the receiver's; a server's refusal may be longer)
FAILURE_CELL_CHARS = 100
FAILURE_JSON_CHARS = 1000
# How long an edit of config.toml waits for another command's edit (`config.toml.lock`) to end
CONFIG_LOCK_TIMEOUT_S = 10.0
# How deep a `--set` value's arrays and inline tables may nest: no channel setting needs more, and
# a value nested hundreds deep was a RecursionError traceback (in tomllib, or writing it back).
SET_MAX_DEPTH = 32


class Refused(Exception):
    """One line for the operator and the exit code: 2 for a bad argument, 1 for a state that forbids it."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _errors(fn: F) -> F:
    """Known failures become `error: <one line>` on stderr and a non-zero exit, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Refused as exc:
            fail(_one_line(exc), exc.code)
        except CorruptGatewayDB as exc:
            fail(
                f"{exc.path} is corrupt ({exc.reason}): it was moved aside to {exc.moved_to} and is kept there; "
                "the gateway starts a new, empty ledger and route table (routes must be added again)",
                1,
            )
        except (CorruptGatewayDBInUse, LedgerFileRefused) as exc:
            fail(_one_line(exc), 1)
        except SchemaTooNew as exc:
            fail(f"{_one_line(exc)}: upgrade appserver to use it (the file was left untouched)", 1)
        except (ConfigError, ChannelConfigError) as exc:
            fail(_one_line(exc), 2)
        except (PgOperationalError, PgIntegrityError, PgDatabaseError) as exc:
            fail(f"the gateway's tables in PostgreSQL: {_one_line(exc)}", 1)
        except sqlite3.Error as exc:
            fail(f"gateway.db: {_one_line(exc)}", 1)

    return wrapper  # type: ignore[return-value]


# ── config.toml as text ─────────────────────────────────────────────────────────────────────────


@dataclass(frozen=True, slots=True)
class _Header:
    line: int  # index into the file's lines
    path: tuple[str, ...]  # the table's key path, unquoted
    array: bool  # [[array of tables]]


@dataclass(slots=True)
class _Scan:
    """Where each line of a TOML document starts (outside any string or bracket: `top`), its table
    headers, and the column of a comment that starts on a line outside strings (`comment`)."""

    headers: list[_Header] = field(default_factory=list)
    top: list[bool] = field(default_factory=list)
    comment: list[int | None] = field(default_factory=list)


def _read_key(text: str, i: int) -> tuple[tuple[str, ...], int] | None:
    """Parse a dotted key starting at `text[i]` (after whitespace); the parts and the index after it."""
    parts: list[str] = []
    n = len(text)
    while True:
        while i < n and text[i] in " \t":
            i += 1
        if i >= n:
            return None
        if text[i] == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            if j >= n:
                return None
            try:
                parts.append(str(tomllib.loads(f"k = {text[i : j + 1]}")["k"]))
            except tomllib.TOMLDecodeError:
                return None
            i = j + 1
        elif text[i] == "'":
            j = text.find("'", i + 1)
            if j < 0:
                return None
            parts.append(text[i + 1 : j])
            i = j + 1
        else:
            m = BARE_KEY.match(text, i)
            if m is None:
                return None
            parts.append(m.group())
            i = m.end()
        while i < n and text[i] in " \t":
            i += 1
        if i < n and text[i] == ".":
            i += 1
            continue
        return tuple(parts), i


def _scan(lines: list[str]) -> _Scan:
    """A small TOML lexer, enough to tell table headers and top-level key lines from text inside
    multi-line strings and arrays. The document has been parsed by tomllib first, so it is valid."""
    out = _Scan()
    mode: str | None = None  # '"""' or "'''" inside a multi-line string
    depth = 0  # open [ and { of values
    for index, line in enumerate(lines):
        at_top = mode is None and depth == 0
        out.top.append(at_top)
        out.comment.append(None)
        i, n = 0, len(line)
        if at_top and line.lstrip().startswith("["):
            start = len(line) - len(line.lstrip())
            array = line.startswith("[[", start)
            key = _read_key(line, start + (2 if array else 1))
            out.headers.append(_Header(index, key[0] if key else (), array))
            if key is not None:
                i = key[1] + (2 if array else 1)
            else:
                i = n
        while i < n:
            if mode is not None:
                if mode == '"""' and line[i] == "\\":
                    i += 2
                elif line.startswith(mode, i):
                    i += 3
                    while i < n and line[i] == mode[0]:  # up to two quotes may close with it
                        i += 1
                    mode = None
                else:
                    i += 1
                continue
            c = line[i]
            if c == "#":
                out.comment[index] = i
                break
            if line.startswith('"""', i) or line.startswith("'''", i):
                mode = line[i : i + 3]
                i += 3
            elif c == '"':
                i += 1
                while i < n and line[i] != '"':
                    i += 2 if line[i] == "\\" else 1
                i += 1
            elif c == "'":
                end = line.find("'", i + 1)
                i = n if end < 0 else end + 1
            elif c in "[{":
                depth += 1
                i += 1
            elif c in "]}":
                depth = max(0, depth - 1)
                i += 1
            else:
                i += 1
    return out


def _is_blank(line: str) -> bool:
    return not line.strip()


def _is_comment(line: str) -> bool:
    return line.strip().startswith("#")


def _attached_comments(lines: list[str], scan: _Scan, header: int, floor: int) -> int:
    """The first line of the comment paragraph directly above `header` that belongs to it (one that
    starts the file or follows a blank line); `header` itself when there is none."""
    j = header
    while j - 1 >= floor and scan.top[j - 1] and _is_comment(lines[j - 1]):
        j -= 1
    if j == header or j == 0 or _is_blank(lines[j - 1]):
        return j
    return header


def _newline(text: str) -> str:
    return "\r\n" if "\r\n" in text else "\n"


def _toml_key(key: str) -> str:
    return key if BARE_KEY.fullmatch(key) else _toml_string(key)


def _toml_string(s: str) -> str:
    return json.dumps(s, ensure_ascii=False).replace("\x7f", "\\u007f")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, (datetime, date, dtime)):
        return value.isoformat()
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        if not value:
            return "{}"
        return "{ " + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def _parse_literal(text: str, given: str) -> Any:
    """`--set` value: a TOML literal when it is exactly one (`8080`, `true`, `["a"]`, `"quoted"`), else the text.
    Arrays or inline tables nested hundreds deep (tomllib: RecursionError) are a usage error."""
    try:
        doc = tomllib.loads(f"v = {text}")
    except tomllib.TOMLDecodeError:
        return text
    except RecursionError:
        doc = None
    if doc is not None and list(doc) != ["v"]:
        return text
    if doc is None or _nesting_depth(doc["v"]) > SET_MAX_DEPTH:
        raise Refused(
            f"{given}: the value nests arrays or inline tables more than {SET_MAX_DEPTH} deep; nothing written", 2
        )
    return doc["v"]


def _nesting_depth(value: Any) -> int:
    """How deep `value`'s lists and dicts nest (a scalar: 0), counted without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, dict)):
            depth += 1
            deepest = max(deepest, depth)
            stack.extend((v, depth) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


def _env_origin(*parts: str) -> str:
    return "APPSERVER_" + "__".join(p.upper() for p in parts)


@contextmanager
def _config_lock(path: Path) -> Iterator[None]:
    """Hold `config.toml.lock` beside config.toml (a `filelock`, as crons.json and tokens.json have:
    flock, which the OS releases when its holder dies, so a killed command never blocks the next)
    for one edit, read to write: concurrent edits take turns, each on the file the previous one
    wrote. Refused (exit 1, nothing written) after CONFIG_LOCK_TIMEOUT_S rather than hanging."""
    if not path.parent.is_dir():  # no home yet (`remove`): nothing to edit, nothing is written
        yield
        return
    lock_path = path.with_name(f"{path.name}.lock")
    lk = filelock.FileLock(str(lock_path), timeout=CONFIG_LOCK_TIMEOUT_S, mode=0o600)
    try:
        lk.acquire()
    except filelock.Timeout:
        raise Refused(
            f"timed out after {CONFIG_LOCK_TIMEOUT_S:g} s waiting for {lock_path}: another appserver command is "
            "editing config.toml; nothing written, try again"
        ) from None
    except OSError as exc:
        raise Refused(f"cannot lock {lock_path} ({_one_line(exc)}); nothing written") from None
    try:
        yield
    finally:
        lk.release()


@dataclass(slots=True)
class _ConfigFile:
    """config.toml's text as read (byte-exact), for one edit. Read and write it inside
    `_config_lock` (`_ConfigFile.editing`)."""

    path: Path  # config.toml (a symbolic link is written through to its target)
    text: str
    data: dict[str, Any]

    @classmethod
    @contextmanager
    def editing(cls, path: Path) -> Iterator[_ConfigFile]:
        """The file read under its lock, held until the block ends (its `write` included)."""
        with _config_lock(path):
            yield cls.read(path)

    @classmethod
    def read(cls, path: Path) -> _ConfigFile:
        try:
            text = path.read_bytes().decode("utf-8-sig")  # a byte-order mark, as load_config reads one
        except FileNotFoundError:
            text = ""
        except UnicodeDecodeError as exc:
            raise Refused(f"{path} is not UTF-8 text ({exc}); fix it first") from None
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise Refused(f"{path} is not valid TOML ({exc}); fix it first") from None
        except RecursionError:  # load_config sets such a file aside; one read here first says so too
            raise Refused(f"{path} is not valid TOML (nested too deeply); fix it first", 2) from None
        return cls(path, text, data)

    def check(self, text: str) -> tuple[dict[str, Any], ChannelsConfig]:
        """The edited text parsed and its `[channels]` loaded as the server would (env overrides aside)."""
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:  # e.g. [channels] written inline: never write it
            raise Refused(
                f"the edited {self.path} would not be valid TOML ({exc}); [channels] is probably written as "
                "dotted keys or an inline table there: edit it by hand; nothing written"
            ) from None
        except RecursionError:  # a --set value nested just short of what one literal could take
            raise Refused(
                f"the edited {self.path} would be nested too deeply to read back; nothing written", 2
            ) from None
        try:
            channels = load_channels(data.get("channels", {}), {}, str(self.path), _env_origin)
        except ChannelConfigError as exc:
            raise Refused(f"{_one_line(exc)}; nothing written", 2) from None
        return data, channels

    def write(self, text: str) -> None:
        """Replace the file with `text` (call with the lock held). A change made meanwhile by
        something that does not take the lock (an editor) refuses the write."""
        target = self.path.resolve()
        try:
            current = target.read_bytes().decode("utf-8-sig", "replace")
            mode = target.stat().st_mode & 0o777
        except FileNotFoundError:
            current, mode = "", 0o600
        if current != self.text:
            raise Refused(f"{self.path} changed while this command was editing it; nothing written, try again")
        atomic_write_text(target, text, mode=mode)


def _channels_table(data: dict[str, Any]) -> dict[str, Any]:
    table = data.get("channels", {})
    return table if isinstance(table, dict) else {}


def _file_accounts(data: dict[str, Any], channel: str) -> dict[str, Any]:
    table = _channels_table(data).get(channel, {})
    accounts = table.get("accounts", {}) if isinstance(table, dict) else {}
    return accounts if isinstance(accounts, dict) else {}


def _file_enabled(data: dict[str, Any]) -> list[str]:
    value = _channels_table(data).get("enabled", [])
    items = value.split(",") if isinstance(value, str) else value
    return [v.strip() for v in items if isinstance(v, str) and v.strip()] if isinstance(items, list) else []


def _set_enabled(text: str, enabled: list[str]) -> str:
    """`text` with `enabled = [...]` of `[channels]` set to `enabled` (the table or the key added
    when absent: the table before the first `[channels.*]` table, else at the end)."""
    nl = _newline(text)
    lines = text.splitlines(keepends=True)
    scan = _scan(lines)
    value = f"enabled = {_toml_value(enabled)}"
    headers = scan.headers
    for k, header in enumerate(headers):
        if header.path != ("channels",) or header.array:
            continue
        end = headers[k + 1].line if k + 1 < len(headers) else len(lines)
        for i in range(header.line + 1, end):
            key = _read_key(lines[i], 0) if scan.top[i] and not _is_comment(lines[i]) else None
            if key is None or key[0] != ("enabled",):
                continue
            last = next((j for j in range(i + 1, len(lines)) if scan.top[j]), len(lines)) - 1
            tail = lines[last]
            eol = tail[len(tail.rstrip("\r\n")) :] or nl
            col = scan.comment[last]
            comment = "  " + tail[col:].rstrip("\r\n") if col is not None else ""
            indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
            return "".join([*lines[:i], indent + value + comment + eol, *lines[last + 1 :]])
        head = lines[header.line]
        if not head.endswith("\n"):
            head += nl
        return "".join([*lines[: header.line], head, value + nl, *lines[header.line + 1 :]])
    block = f"[channels]{nl}{value}{nl}"
    prev = 0
    for header in headers:
        if header.path[:1] == ("channels",):
            at = _attached_comments(lines, scan, header.line, prev)
            return "".join([*lines[:at], block, nl, *lines[at:]])
        prev = header.line + 1
    return _append(text, block)


def _append(text: str, block: str) -> str:
    nl = _newline(text)
    if not text:
        return block
    if not text.endswith("\n"):
        text += nl
    if not text.endswith(nl + nl) and text.strip():
        text += nl
    return text + block


def _remove_tables(text: str, prefix: tuple[str, ...]) -> tuple[str, int]:
    """`text` without every table whose key path starts with `prefix` (its header line to the next
    header; a comment paragraph directly above a header goes with that header), and how many."""
    lines = text.splitlines(keepends=True)
    scan = _scan(lines)
    headers = scan.headers
    cuts: list[tuple[int, int]] = []
    for k, header in enumerate(headers):
        if header.path[: len(prefix)] != prefix:
            continue
        floor = headers[k - 1].line + 1 if k > 0 else 0
        start = _attached_comments(lines, scan, header.line, floor)
        end = len(lines)
        if k + 1 < len(headers):
            end = _attached_comments(lines, scan, headers[k + 1].line, header.line + 1)
        cuts.append((start, end))
    for start, end in reversed(cuts):
        del lines[start:end]
        if end >= len(lines) + (end - start):  # cut to the end: no blank lines left trailing
            while lines and _is_blank(lines[-1]):
                lines.pop()
    return "".join(lines), len(cuts)


# ── what exists: channels, plugins, the server ─────────────────────────────────────────────────


@dataclass(frozen=True, slots=True)
class _Channel:
    id: str
    kind: str  # first-party | plugin | unknown
    problem: str | None  # why it cannot run (not built, broken manifest, unknown)
    folder: str | None


def _first_party_built(channel: str) -> bool:
    try:
        return importlib.util.find_spec(FIRST_PARTY[channel]) is not None
    except (ImportError, ValueError):
        return False


def _known_channels(home: Path) -> dict[str, _Channel]:
    out: dict[str, _Channel] = {}
    for cid in FIRST_PARTY:
        out[cid] = _Channel(cid, "first-party", None if _first_party_built(cid) else "not built yet", None)
    shadowing: dict[str, str] = {}
    for cid, found in discover(home).items():
        if isinstance(found, Manifest):
            out[cid] = _Channel(cid, "plugin", None, str(found.folder))
        elif cid in FIRST_PARTY:
            shadowing[cid] = _one_line(found)
        else:
            folder = home / "channels" / cid
            problem = _one_line(found)
            asides = sorted(folder.glob("channel.json.corrupt-*"))
            if found.moved_to is None and not (folder / "channel.json").exists() and asides:
                problem = (
                    f"channel '{cid}' ({folder}): its channel.json was not valid JSON and was moved aside to "
                    f"{asides[-1].name}: repair it and move it back to channel.json"
                )
            out[cid] = _Channel(cid, "plugin", problem, str(folder))
    for cid, problem in shadowing.items():  # the first-party channel still runs; the folder is an error
        base = out[cid]
        out[cid] = _Channel(cid, base.kind, "; ".join(p for p in (base.problem, problem) if p), base.folder)
    return dict(sorted(out.items()))


def _require_known(home: Path, channel: str) -> _Channel:
    if not CHANNEL_ID.fullmatch(channel):
        raise Refused(f"{shown(channel)} is not a channel id (lowercase letters, digits, '_' and '-')", 2)
    known = _known_channels(home)
    if channel not in known:
        raise Refused(
            f"unknown channel {shown(channel)}: known channels are {', '.join(known)} "
            f"(a user plugin lives in {home / 'channels' / channel / 'channel.json'})",
            2,
        )
    return known[channel]


def _warn_if_broken(found: _Channel) -> None:
    """Said after a change succeeded, so a refusal stays one line."""
    if found.problem:
        click.echo(f"warning: channel {found.id!r}: {visible(found.problem)}", err=True)  # a plugin's words


def _restart_hint(config: Config, what: str) -> None:
    live = read_live_server(config.server_json)
    if live is not None:
        click.echo(
            f"A server is running at {exact(live.get('url'))} (pid {exact(live.get('pid'))}): it picks up {what} when "
            "restarted (stop it and run `appserver serve` again)."
        )
    else:
        click.echo(f"No server is running; {what} takes effect at the next `appserver serve`.")


def _env_overrides_enabled() -> bool:
    return "APPSERVER_CHANNELS__ENABLED" in os.environ


@functools.cache
def _plugin_check(channel: str) -> Callable[[Mapping[str, Any], Collection[str]], None] | None:
    """A first-party plugin's own `check_settings`, from its `settings.py` (standard library only),
    loaded by path so that the platform library (slack_sdk, discord.py, …) is not imported here.
    None when the plugin has no such file."""
    check = getattr(first_party_settings(channel), "check_settings", None)  # a user plugin is never imported here
    return check if callable(check) else None


def _settings_problem(channel: str, settings: Mapping[str, Any], refs: Collection[str] = ()) -> str | None:
    """Why the gateway would refuse this account's settings when it starts it (state `error`), by the
    gateway's own checks: the access policy, the debounce, and the first-party plugin's
    `check_settings` (which also refuses a secret reference in `refs` to a name it reads no secret
    by). None when they pass."""
    try:
        AccessPolicy.from_settings(settings)
        DebounceSettings.from_settings(settings)
    except (PolicyError, DebounceError) as exc:
        return _one_line(exc)
    try:
        check = _plugin_check(channel)
    except Exception as exc:  # noqa: BLE001 - a broken settings.py is reported, never a traceback
        return f"the {channel} plugin's settings check could not be loaded: {type(exc).__name__}: {_one_line(exc)}"
    if check is None:
        return None
    try:
        check(settings, refs)
    except ValueError as exc:
        return _one_line(exc)
    except Exception as exc:  # noqa: BLE001
        return f"the {channel} plugin's settings check failed: {type(exc).__name__}: {_one_line(exc)}"
    return None


def _account_problem(account: AccountConfig, shared: Mapping[str, tuple[str, str]]) -> str | None:
    """Why the gateway would not run this account: a problem found at load, its settings, else a
    token an earlier account of its channel already uses (`shared_secrets`). None when none."""
    problem = account.problem or _settings_problem(account.channel, account.settings, account.ref_keys)
    if problem is None and account.ref in shared:
        problem = shared[account.ref][1]
    return problem


# ── the group ───────────────────────────────────────────────────────────────────────────────────


@click.group("channels")
def channels_group() -> None:
    """Configure chat channels and their accounts, routes and status."""


@channels_group.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@_errors
def list_cmd(as_json: bool) -> None:
    """Every known channel: first-party and user plugins, enabled or not, with its accounts."""
    config = get_config()
    known = _known_channels(config.home)
    channels = config.channels
    shared = shared_secrets([a for by_name in channels.accounts.values() for a in by_name.values()], config.home)
    for cid in [*channels.enabled, *channels.accounts]:
        if cid not in known:
            known[cid] = _Channel(cid, "unknown", "not first-party and no user plugin", None)
    rows: list[dict[str, Any]] = [
        {
            "id": c.id,
            "kind": c.kind,
            "enabled": c.id in channels.enabled,
            "accounts": sorted(channels.accounts.get(c.id, {})),
            "error": c.problem,
            "folder": c.folder,
            # accounts whose settings the gateway would refuse (state `error` at start): name -> why
            "account_errors": {
                name: problem
                for name, account in sorted(channels.accounts.get(c.id, {}).items())
                if (problem := _account_problem(account, shared)) is not None
            },
            # accounts refused for using an earlier account's token: name -> that account's name
            "shared_token": {
                name: shared[account.ref][0]
                for name, account in sorted(channels.accounts.get(c.id, {}).items())
                if account.ref in shared
            },
        }
        for c in sorted(known.values(), key=lambda c: c.id)
    ]
    if as_json:
        print_json({"channels": rows, "enabled": channels.enabled})
        return
    table = [["CHANNEL", "KIND", "ENABLED", "ACCOUNTS", "PROBLEM"]]
    for r in rows:
        problems = [r["error"]] if r["error"] else []
        if r["kind"] == "plugin" and problems:
            problems = ["broken (below)"]
        bad = [name for name in r["account_errors"] if name not in r["shared_token"]]
        if bad:
            problems.append("bad settings: " + ", ".join(bad) + " (below)")
        problems += [f"{name} uses {owner}'s token (below)" for name, owner in r["shared_token"].items()]
        table.append(
            [
                r["id"],
                r["kind"],
                "yes" if r["enabled"] else "no",
                ", ".join(r["accounts"]) or "-",
                "; ".join(problems) or "-",
            ]
        )
    click.echo(_table(table))
    broken = [r for r in rows if r["kind"] == "plugin" and r["error"]]
    for r in broken:  # the error quotes the plugin's own files
        click.echo(f"\n{exact(r['id'])}: {visible(r['error'])}")
    if broken:
        click.echo("\nA broken plugin does not run; fix its channel.json (the error says how) and restart the server.")
    bad = [(r["id"], name, why) for r in rows for name, why in r["account_errors"].items()]
    for cid, name, why in bad:
        click.echo(f"\n{exact(cid)}:{exact(name)}: [channels.{exact(cid)}.accounts.{exact(name)}] {visible(why)}")
    if bad:
        click.echo(
            "\nAn account with bad settings does not start (its state is error); fix it in config.toml "
            "and restart the server."
        )


@channels_group.command("add")
@click.argument("channel")
@click.argument("account")
@click.option(
    "--set", "settings", multiple=True, metavar="KEY=VALUE", help="A setting (a TOML literal, else a string)."
)
@click.option(
    "--secret",
    "secrets",
    multiple=True,
    metavar="NAME=env:VAR|NAME=file:PATH",
    help="A secret by reference: written as NAME_env or NAME_file.",
)
@click.option("--enable", is_flag=True, help="Also add CHANNEL to [channels] enabled.")
@_errors
def add_cmd(channel: str, account: str, settings: tuple[str, ...], secrets: tuple[str, ...], enable: bool) -> None:
    """Add an account: append a [channels.CHANNEL.accounts.ACCOUNT] table to config.toml."""
    if not CHANNEL_ID.fullmatch(channel):
        raise Refused(f"{shown(channel)} is not a channel id (lowercase letters, digits, '_' and '-')", 2)
    if not ACCOUNT_NAME.fullmatch(account):
        raise Refused(f"{shown(account)} is not an account name (letters, digits, '_' or '-', at most 64)", 2)
    table = _account_table(settings, secrets)
    try:  # the arguments first: an inline secret is refused before anything is read
        checked = check_account(channel, account, table, "channels add")
    except ChannelConfigError as exc:
        raise Refused(_one_line(exc), 2) from None
    # what the gateway would refuse at start
    problem = checked.problem or _settings_problem(channel, checked.settings, checked.ref_keys)
    if problem is not None:
        raise Refused(f"channels add: [channels.{channel}.accounts.{account}] {problem}; nothing written", 2)
    config = get_config()
    others = [a for name, a in config.channels.accounts.get(channel, {}).items() if name != account]
    shared = shared_secrets([*others, checked], config.home).get(checked.ref)
    if shared is not None:
        raise Refused(f"channels add: [channels.{channel}.accounts.{account}] {shared[1]}; nothing written", 2)
    found = _require_known(config.home, channel)
    with _ConfigFile.editing(config.config_path) as file:
        if account in _file_accounts(file.data, channel):
            raise Refused(f"account {channel}:{account} already exists in {file.path}; remove it first to replace it")
        if account in config.channels.accounts.get(channel, {}):
            raise Refused(
                f"account {channel}:{account} is already defined by APPSERVER_CHANNELS__ environment variables"
            )
        nl = _newline(file.text)
        body = [f"[channels.{channel}.accounts.{account}]"] + [
            f"{_toml_key(k)} = {_toml_value(v)}" for k, v in table.items()
        ]
        text = _append(file.text, nl.join(body) + nl)
        enabled = _file_enabled(file.data)
        if enable and channel not in enabled:
            text = _set_enabled(text, [*enabled, channel])
        data, loaded = file.check(text)
        written = _file_accounts(data, channel).get(account)
        if not isinstance(written, dict) or set(written) != set(table):
            raise Refused(f"the edited {file.path} would not hold the account as given; nothing written")
        if enable and channel not in loaded.enabled:
            raise Refused(f"could not add {shown(channel)} to [channels] enabled in {file.path}; nothing written")
        file.write(text)
    click.echo(f"Added account {channel}:{account} to {file.path}.")
    _warn_if_broken(found)
    if enable or channel in config.channels.enabled:
        _restart_hint(config, "the new account")
    else:
        click.echo(f"Channel {channel!r} is not enabled: run `appserver channels enable {channel}` to run it.")


def _account_table(settings: tuple[str, ...], secrets: tuple[str, ...]) -> dict[str, Any]:
    table: dict[str, Any] = {}

    def put(key: str, value: Any, given: str) -> None:
        if not BARE_KEY.fullmatch(key):
            raise Refused(f"{given}: a key is letters, digits, '_' and '-'", 2)
        if key in table:
            raise Refused(f"{given}: {key} is given twice", 2)
        try:
            _toml_value(value).encode("utf-8")
        except UnicodeEncodeError:
            raise Refused(f"{given}: the value is not valid text", 2) from None
        table[key] = value

    for item in settings:
        key, eq, raw = item.partition("=")
        if not eq or not key.strip():
            raise Refused(f"--set {shown(item)}: write KEY=VALUE", 2)
        put(key.strip(), _parse_literal(raw, f"--set {shown(item)}"), f"--set {shown(item)}")
    for item in secrets:
        name, eq, ref = item.partition("=")
        kind, colon, where = ref.partition(":")
        name = name.strip()
        if not eq or not name or not colon or kind not in ("env", "file") or not where:
            raise Refused(f"--secret {shown(item)}: write NAME=env:VARIABLE or NAME=file:PATH", 2)
        if name.endswith(("_env", "_file")):
            raise Refused(
                f"--secret {shown(item)}: give the secret's name without _env/_file (e.g. token=env:BOT_TOKEN)", 2
            )
        put(f"{name}_{kind}", where, f"--secret {shown(item)}")
    return table


@channels_group.command("remove")
@click.argument("channel")
@click.argument("account")
@_errors
def remove_cmd(channel: str, account: str) -> None:
    """Remove an account's [channels.CHANNEL.accounts.ACCOUNT] table from config.toml."""
    home = expanded_home().resolve()
    config: Config | None = None
    problem: str | None = None
    try:  # a config that does not load (an inline secret, say) can still lose the account at fault
        config = load_config(home, create=False)
    except ConfigError as exc:
        problem = _one_line(exc)
    with _ConfigFile.editing(home / "config.toml") as file:
        if account not in _file_accounts(file.data, channel):
            if problem is not None:
                raise Refused(problem, 2)
            raise Refused(f"no account {channel}:{account} in {file.path}")
        text, cut = _remove_tables(file.text, ("channels", channel, "accounts", account))
        if cut == 0:
            raise Refused(
                f"account {channel}:{account} is not written as a [channels.{channel}.accounts.{account}] table in "
                f"{file.path} (dotted keys or an inline table): edit it by hand; nothing changed"
            )
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise Refused(f"the edited {file.path} would not be valid TOML ({exc}); nothing changed") from None
        except RecursionError:
            raise Refused(f"the edited {file.path} would be nested too deeply to read back; nothing changed") from None
        if account in _file_accounts(data, channel):
            raise Refused(
                f"account {channel}:{account} is also defined outside its [channels.{channel}.accounts.{account}] "
                f"table in {file.path}: edit it by hand; nothing changed"
            )
        still: str | None = None
        try:
            load_channels(data.get("channels", {}), {}, str(file.path), _env_origin)
        except ChannelConfigError as exc:
            if problem is None:  # removing a table made a valid config invalid: never write that
                raise Refused(f"{_one_line(exc)}; nothing changed", 2) from None
            still = _one_line(exc)
        file.write(text)
    click.echo(f"Removed account {channel}:{account} from {file.path}.")
    if still:
        click.echo(f"warning: {file.path} still has a problem: {visible(still)}", err=True)
    if config is not None:
        _restart_hint(config, "the change")
        if channel in config.channels.enabled and not _file_accounts(data, channel):
            click.echo(f"Channel {channel!r} is still enabled and has no account left.")


@channels_group.command("enable")
@click.argument("channel")
@_errors
def enable_cmd(channel: str) -> None:
    """Add CHANNEL to [channels] enabled in config.toml."""
    config = get_config()
    found = _require_known(config.home, channel)
    _edit_enabled(config, channel, add=True)
    _warn_if_broken(found)


@channels_group.command("disable")
@click.argument("channel")
@_errors
def disable_cmd(channel: str) -> None:
    """Remove CHANNEL from [channels] enabled in config.toml."""
    if not CHANNEL_ID.fullmatch(channel):
        raise Refused(f"{shown(channel)} is not a channel id (lowercase letters, digits, '_' and '-')", 2)
    _edit_enabled(get_config(), channel, add=False)


def _edit_enabled(config: Config, channel: str, *, add: bool) -> None:
    word = "enabled" if add else "disabled"
    with _ConfigFile.editing(config.config_path) as file:
        enabled = _file_enabled(file.data)
        loaded: ChannelsConfig | None = None
        if (channel in enabled) != add:
            wanted = [*enabled, channel] if add else [c for c in enabled if c != channel]
            text = _set_enabled(file.text, wanted)
            _, loaded = file.check(text)
            if loaded.enabled != wanted:
                raise Refused(
                    f"[channels] enabled is not written as `enabled = [...]` in a [channels] table in {file.path} "
                    "(dotted keys or an inline table): edit it by hand; nothing changed"
                )
            file.write(text)
    if loaded is None:
        click.echo(f"Channel {channel!r} is already {word} in {file.path}; nothing changed.")
    else:
        click.echo(f"Channel {channel!r} {word} in {file.path}.")
        if add and not loaded.accounts.get(channel):
            click.echo(f"It has no account yet: add one with `appserver channels add {channel} NAME --set ...`.")
        _restart_hint(config, "the change")
    if _env_overrides_enabled():
        click.echo("warning: APPSERVER_CHANNELS__ENABLED is set and overrides [channels] enabled of the file", err=True)


# ── status ──────────────────────────────────────────────────────────────────────────────────────


def _ago(t: float | None, now: float) -> str:
    if t is None:
        return "never"
    s = max(0.0, now - t)
    if s < 60:
        return f"{int(s)}s ago"
    if s < 3600:
        return f"{int(s // 60)}m ago"
    if s < 86400:
        return f"{int(s // 3600)}h ago"
    return f"{int(s // 86400)}d ago"


def _table(rows: list[list[str]]) -> str:
    """Aligned columns; each cell one line shown exactly (ids from platforms, a plugin's or a
    platform's reasons: their controls are escapes, never acted on by the terminal)."""
    rows = [[exact(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def _is_loopback_ip(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _live_channels(url: str) -> dict[str, Any]:
    """The `channels` check of the running server's /readyz, or why it could not be read."""
    import httpx

    out: dict[str, Any] = {"url": url, "reachable": False, "ready": None, "channels": None, "error": None}
    host = urlsplit(url).hostname or ""
    loopback = host == "localhost" or _is_loopback_ip(host)
    try:  # a proxy from the environment must not carry a loopback probe elsewhere
        resp = httpx.get(url.rstrip("/") + "/readyz", timeout=READYZ_TIMEOUT_S, trust_env=not loopback)
        body = resp.json()
    except (httpx.HTTPError, ValueError) as exc:
        out["error"] = _one_line(exc)
        return out
    out["reachable"] = True
    if not isinstance(body, dict):
        out["error"] = f"/readyz answered {resp.status_code} without a JSON object"
        return out
    out["ready"] = body.get("status") == "ready"
    for check in body.get("checks") or []:
        if isinstance(check, dict) and check.get("name") == "channels":
            data = check.get("data")
            live = data.get("accounts") if isinstance(data, dict) else None
            live = live if isinstance(live, dict) else {}
            out["channels"] = {"status": check.get("status"), "detail": check.get("detail", ""), "accounts": live}
    return out


@contextmanager
def _gateway_db(home: Path, *, create: bool, store_url: str = "") -> Iterator[sqlite3.Connection | None]:
    """gateway.db opened (and migrated); None when it does not exist and `create` is false (a link
    to nothing is no "does not exist yet": LedgerFileRefused, naming the link and its target). A home
    whose store is PostgreSQL (`store_url`) keeps the gateway's tables there (gateway/sqlstore.py):
    they are opened (and created) instead, every account's rows, with no fence (the owner's word);
    None when no gateway made them yet and `create` is false (nothing made by a look)."""
    if store_url.strip():
        if create:
            pg = open_pg(store_url.strip())
        else:
            pg = PgConnection(store_url.strip())
            try:
                if not _pg_has_tables(pg):
                    pg.close()
                    yield None
                    return
                migrate(pg)
            except BaseException:
                pg.close()
                raise
        try:
            yield pg  # type: ignore[misc]
        finally:
            pg.close()
        return
    path = default_path(home)
    if not create and not ledger_exists(path):
        yield None
        return
    conn = open_db(path)
    try:
        yield conn
    finally:
        conn.close()


def _pg_has_tables(pg: PgConnection) -> bool:
    """Whether the store's database holds the gateway's tables (a gateway, or a command that
    writes, made them)."""
    return bool(pg.raw("SELECT to_regclass('gateway_schema') IS NOT NULL")[0][0])


def _tables_where(config: Config, exists: bool) -> tuple[str, str]:
    """Where the gateway's tables of this home are, as `status` names them (the first line), and as
    `--json`'s `gateway_db` (a path, or the store's URL with its password masked)."""
    url = config.store.url.strip()
    if not url:
        path = default_path(config.home)
        if exists:
            return f"gateway.db: {path}", str(path)
        return (
            f"gateway.db: {path} does not exist yet (no gateway has run on this home, or its"
            " ledger was deleted and a gateway is starting a new one)",
            str(path),
        )
    shown_url = redact_url(url)
    if exists:
        return f"gateway tables: gateway_* in the store's PostgreSQL database {shown_url}", shown_url
    return (
        f"gateway tables: none yet in the store's PostgreSQL database {shown_url} (no gateway has run on this store)",
        shown_url,
    )


def _trimmed(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _secret_mask(config: Config) -> SecretMask:
    """The configured accounts' secrets this command can read (their files, its environment): a
    platform's error quoting a token, saved as a reason by a gateway before that was masked, is
    shown masked too."""
    accounts = (a for by_name in config.channels.accounts.values() for a in by_name.values())
    return account_mask((AccountSpec.from_json(a.to_json()) for a in accounts), config.home, os.environ)


def _last_failures(ledger: Ledger, board: StatusBoard, mask: SecretMask) -> dict[tuple[str, str], dict[str, Any]]:
    """Per account, its most recent failure: why (the reason the gateway recorded, such as
    `delivery failed: reply_url answered 404: …`), when, and which message (the failures counter
    alone never said why). The newer of the ledger's last `failed` row and the status row's last
    failed send without a ledger row (a cron delivery: no message, `message_id` null)."""
    found: dict[tuple[str, str], tuple[str | None, str | None, float]] = {
        key: (None, reason, at) for key, (reason, at) in board.last_failures().items()
    }
    for key, (message_id, reason, at) in ledger.last_failures().items():
        if key not in found or at >= found[key][2]:
            found[key] = (message_id, reason, at)
    return {
        key: {
            "at": at,
            "message_id": message_id,
            "reason": _trimmed(mask.redact(reason or "no reason recorded"), FAILURE_JSON_CHARS),
        }
        for key, (message_id, reason, at) in found.items()
    }


def _failure_cell(failure: dict[str, Any] | None, now: float) -> str:
    """`5m ago: <reason>`, cut to FAILURE_CELL_CHARS (the table escapes its controls)."""
    if failure is None:
        return "-"
    return _trimmed(f"{_ago(failure['at'], now)}: {failure['reason']}", FAILURE_CELL_CHARS)


def _account_rows(
    config: Config, rows: list[AccountStatus], failures: Mapping[tuple[str, str], dict[str, Any]]
) -> list[dict[str, Any]]:
    """Every configured account (with its row, or never started) and every row of an account no
    longer configured, each with its last failure (None when it has none)."""
    by_key = {(r.channel, r.account): r for r in rows}
    configured = [(ch, name) for ch, accounts in sorted(config.channels.accounts.items()) for name in sorted(accounts)]
    shared = shared_secrets([a for by_name in config.channels.accounts.values() for a in by_name.values()], config.home)
    others = sorted(k for k in by_key if k not in set(configured))
    out: list[dict[str, Any]] = []
    for ch, name in [*configured, *others]:
        row = by_key.get((ch, name))
        item: dict[str, Any] = {
            "channel": ch,
            "account": name,
            "configured": (ch, name) in configured,
            "enabled": ch in config.channels.enabled,
            "started": row is not None,
            "settings_error": (
                _account_problem(config.channels.accounts[ch][name], shared) if (ch, name) in configured else None
            ),
        }
        if row is not None:
            item.update(row.to_json())
        else:
            item.update(
                state=None,
                reason=None,
                last_inbound=None,
                last_outbound=None,
                messages_in=0,
                turns=0,
                replies=0,
                failures=0,
                updated_at=None,
            )
        item["last_failure"] = failures.get((ch, name))
        out.append(item)
    return out


def _show_live_states(accounts: list[dict[str, Any]], live: Mapping[str, Any], mask: SecretMask) -> None:
    """The running gateway's state of each account over the one gateway.db last recorded: the
    child records its own, so a child that was killed (or hangs) left `running` there while the
    server restarts it. The recorded state stays beside it (`recorded_state`, `recorded_reason`)."""
    for item in accounts:
        now = live.get(f"{item['channel']}:{item['account']}")
        if not isinstance(now, dict) or not isinstance(now.get("state"), str) or now["state"] == item["state"]:
            continue
        reason = now.get("reason") if isinstance(now.get("reason"), str) else None
        item["recorded_state"], item["recorded_reason"] = item["state"], item["reason"]
        item["state"], item["reason"] = now["state"], mask.redact(reason) if reason else None
        item["started"] = True


def _pin_hints(
    config: Config, pins: list[Route], failures: Mapping[tuple[str, str], dict[str, Any]]
) -> dict[tuple[str, str], str]:
    """Per account whose last failure names one of its pinned routes and that pin (the gateway's
    `… is pinned to conversation ID, which the server does not find …`): why the gateway cannot use
    it, read from the store. The server answers a conversation outside the gateway's namespace (a
    pin made before auth mode became `token`) as not found, so that no credential learns it exists,
    and the gateway cannot tell it from a deleted one; this command, on the operator's side, can.
    Nothing when the store cannot be read: the rest of `status` works without it."""
    import asyncio

    from appserver.cli.common import explain
    from appserver.errors import KernelError
    from appserver.server import Server  # the kernel: imported only when a pin failed

    suspects: dict[tuple[str, str], Route] = {}
    for route in pins:
        account = (route.key.channel, route.key.account)
        reason = str((failures.get(account) or {}).get("reason") or "")
        if route.conversation and str(route.key) in reason and route.conversation in reason:
            suspects[account] = route
    if not suspects:
        return {}
    namespace = _gateway_namespace(config)

    async def look_up() -> dict[tuple[str, str], str]:
        server = Server(config)
        await server.open()
        try:
            hints: dict[tuple[str, str], str] = {}
            for account, route in suspects.items():
                assert route.conversation is not None
                try:
                    agent_id, found = await _pin_candidates(server, route.agent, route.conversation, namespace)
                except KernelError as exc:  # the route's agent is gone or ambiguous: its own line says so
                    hints[account] = f"the route {route.key}: {exc}"
                    continue
                problem = _pin_problem(route.agent, agent_id, route.conversation, namespace, found)
                if problem is not None:
                    hints[account] = f"the route {route.key}: {problem}; fix it with `appserver channels route add`"
            return hints
        finally:
            await server.close()

    try:
        return asyncio.run(look_up())
    except Exception as exc:
        if explain(exc) is None:
            raise
        return {}


@channels_group.command("status")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@_errors
def status_cmd(as_json: bool) -> None:
    """Per account: state, last inbound and outbound, counters, the last failure and why; the ledger
    by state; the live server's view."""
    config = get_config()
    now = time.time()
    db_path = default_path(config.home)
    mask = _secret_mask(config)
    with _gateway_db(config.home, create=False, store_url=config.store.url) as conn:
        exists = conn is not None if config.store.url.strip() else db_path.exists()
        rows = StatusBoard(conn).all() if conn is not None else []
        counts = Ledger(conn).counts() if conn is not None else {}
        failures = _last_failures(Ledger(conn), StatusBoard(conn), mask) if conn is not None else {}
        pins = [r for r in Router(conn).routes() if r.conversation is not None] if conn is not None else []
    for account, hint in _pin_hints(config, pins, failures).items():
        failures[account]["hint"] = hint
    rows = [replace(r, reason=mask.redact(r.reason)) if r.reason else r for r in rows]
    accounts = _account_rows(config, rows, failures)
    ledger = {s: counts.get(s, 0) for s in LEDGER_STATES} | {s: n for s, n in counts.items() if s not in LEDGER_STATES}
    live = read_live_server(config.server_json)
    server = _live_channels(str(live.get("url"))) if live is not None and live.get("url") else None
    if server is not None and server["channels"] is not None:
        _show_live_states(accounts, server["channels"]["accounts"], mask)
    first, where = _tables_where(config, exists)
    if as_json:
        print_json(
            {
                "gateway_db": where,
                "gateway_db_exists": exists,
                "gateway_store": "postgresql" if config.store.url.strip() else "sqlite",
                "accounts": accounts,
                "ledger": ledger,
                "server": server,
            }
        )
        return
    click.echo(first)
    if accounts:
        table = [
            [
                "CHANNEL",
                "ACCOUNT",
                "STATE",
                "LAST IN",
                "LAST OUT",
                "IN",
                "TURNS",
                "REPLIES",
                "FAILURES",
                "REASON",
                "LAST FAILURE",
            ]
        ]
        for a in accounts:
            notes = [a["reason"]] if a["reason"] else []
            if a["settings_error"] and a["settings_error"] not in (a["reason"] or ""):
                notes.append(f"bad settings: {a['settings_error']}")
            if not a["configured"] and a["reason"] != "not configured":
                notes.append("not configured")
            elif a["configured"] and not a["enabled"]:
                notes.append("channel not enabled")
            started = a["started"]
            table.append(
                [
                    a["channel"],
                    a["account"],
                    a["state"] if started else "never started",
                    _ago(a["last_inbound"], now) if started else "-",
                    _ago(a["last_outbound"], now) if started else "-",
                    *(str(a[k]) if started else "-" for k in ("messages_in", "turns", "replies", "failures")),
                    "; ".join(notes) or "-",
                    _failure_cell(a["last_failure"], now),
                ]
            )
        click.echo(_table(table))
        for a in accounts:
            if a["last_failure"] is not None and a["last_failure"].get("hint"):
                click.echo(f"hint: {visible(a['last_failure']['hint'])}")
    else:
        click.echo("No channel accounts configured (add one with `appserver channels add CHANNEL NAME`).")
    if any(counts.values()):
        click.echo("Ledger: " + ", ".join(f"{n} {s}" for s, n in ledger.items() if n))
    elif exists:
        click.echo("Ledger: empty")
    if server is None:
        click.echo("Server: not running; this is the last recorded state.")
    elif not server["reachable"]:
        click.echo(
            f"Server: running at {exact(server['url'])} but /readyz could not be read ({visible(server['error'])}); "
            "the state above is the last recorded one."
        )
    elif server["channels"] is None:
        click.echo(
            f"Server: running at {exact(server['url'])} without channels (none enabled when it started; "
            "restart it after `appserver channels enable`)."
        )
    else:
        check = server["channels"]
        detail = f": {visible(check['detail'])}" if check.get("detail") else ""  # the platforms' words too
        click.echo(f"Server: running at {exact(server['url'])}; live channels check {exact(check['status'])}{detail}")


# ── routes ──────────────────────────────────────────────────────────────────────────────────────


@channels_group.group("route")
def route_group() -> None:
    """Routes: which agent answers a chat or thread (key channel:account:chat[:thread])."""


def _parse_key(text: str) -> RouteKey:
    try:
        key = RouteKey.typed(text)
    except ValueError as exc:
        message = _one_line(exc)
        if "channel:account:chat" not in message:
            message = f"bad route key {shown(text)}: {message}; a route key is channel:account:chat[:thread]"
        raise Refused(message, 2) from None
    _check_scope(key.channel, key.account, f"bad route key {shown(text)}: ")
    return key


def _check_scope(channel: str | None, account: str | None, head: str = "") -> None:
    if channel is not None and not CHANNEL_ID.fullmatch(channel):
        raise Refused(f"{head}{shown(channel)} is not a channel id (lowercase letters, digits, '_' and '-')", 2)
    if account is not None and not ACCOUNT_NAME.fullmatch(account):
        raise Refused(f"{head}{shown(account)} is not an account name (letters, digits, '_' or '-', at most 64)", 2)


def _route_json(route: Route) -> dict[str, Any]:
    return {
        "key": str(route.key),
        "channel": route.key.channel,
        "account": route.key.account,
        "chat": route.key.chat,
        "thread": route.key.thread,
        "agent": route.agent,
        "conversation": route.conversation,
    }


@route_group.command("add")
@click.argument("key")
@click.argument("agent")
@click.option(
    "--conversation", default=None, help="Continue this conversation id (default: a new one per chat/thread)."
)
@_errors
def route_add_cmd(key: str, agent: str, conversation: str | None) -> None:
    """Route KEY (channel:account:chat[:thread]) to AGENT; replaces a route at the same key."""
    route_key = _parse_key(key)
    if not agent.strip():
        raise Refused("AGENT must not be empty", 2)
    if conversation is not None and not conversation.strip():
        raise Refused("--conversation must not be empty", 2)
    config = get_config()
    _require_agent(config, agent.strip())
    if conversation is not None:
        _require_conversation(config, agent.strip(), conversation.strip())
    with _gateway_db(config.home, create=True, store_url=config.store.url) as conn:
        assert conn is not None
        router = Router(conn)
        old = router.get(route_key)
        try:
            router.add(route_key, agent.strip(), conversation.strip() if conversation else None)
        except CommitUnknown:  # PostgreSQL's answer to the COMMIT was lost: made or not, made again (an upsert)
            router.add(route_key, agent.strip(), conversation.strip() if conversation else None)
    target = agent.strip() + (f" (conversation {conversation.strip()})" if conversation else "")
    replaced = f"; replaced the route to {exact(old.agent)}" if old else ""  # gateway.db's, written by anyone
    click.echo(f"Route {exact(route_key)} -> {exact(target)}{replaced}.")
    click.echo("A running gateway uses it from the next message on (no restart needed).")
    if route_key.thread == ROOT:
        click.echo("Threads of this chat without a route of their own use it, each in a conversation of its own.")
    if route_key.account not in config.channels.accounts.get(route_key.channel, {}):
        click.echo(
            f"warning: no account {route_key.channel}:{route_key.account} is configured; "
            "the route is kept and used once it exists",
            err=True,
        )


def _require_agent(config: Config, agent: str) -> None:
    """Refuse a route to an agent the server would not find (by id or unique name, as the server
    resolves it for each message), before anything is written."""
    from appserver.cli.cron_run import validate_agent  # the kernel: imported only when needed

    def check() -> None:
        try:
            validate_agent(config, agent)
        except LookupError as exc:
            raise Refused(
                f"{_one_line(exc)}: a route must name an existing agent (see `appserver agents list`, "
                "or create it with `appserver agents create --name NAME`); nothing written",
                2,
            ) from None

    run_or_fail(check)  # a store that cannot be opened is one line too


def _require_conversation(config: Config, agent: str, conversation: str) -> None:
    """Refuse a pin to a conversation the gateway could not continue for `agent` (unknown, another
    agent's, or outside its credential's namespace), before anything is written: the gateway does
    not replace an operator's pin, so such a route would only fail each message."""
    import asyncio

    from appserver.server import Server  # the kernel: imported only when needed

    namespace = _gateway_namespace(config)

    async def look_up() -> tuple[str, list[ConversationRecord]]:
        server = Server(config)
        await server.open()
        try:
            return await _pin_candidates(server, agent, conversation, namespace)
        finally:
            await server.close()

    agent_id, found = run_or_fail(lambda: asyncio.run(look_up()))
    problem = _pin_problem(agent, agent_id, conversation, namespace, found)
    if problem is not None:
        raise Refused(f"{problem}; nothing written", 2)


def _gateway_namespace(config: Config) -> str | None:
    """The conversation namespace of the gateway's credential, derived as the server derives it
    (docs/security.md, "Conversation namespaces"). In auth mode `token` the gateway holds a token
    named `gateway` (`gateway@…` on a database several servers share) with the `ws` scope only
    (appserver/channels.py `mint_credential`): it sees only the conversations it made. In mode
    `none` it connects as the local owner, who sees them all (None); mode `jwt` runs no gateway.
    The mode is config.toml's or, when stricter, the running server's (`serve --auth token`): a pin
    must work for the gateway running now and for the one the next start runs."""
    live = read_live_server(config.server_json)
    if config.auth.mode != "token" and (live is None or live.get("auth") != "token"):
        return None
    from appserver.auth import Principal, conversation_namespace
    from appserver.channels import gateway_token_name

    # as TokenRecord.principal() gives it for the gateway's own token (its subject `token:<name>`)
    gateway = Principal(subject=f"token:{gateway_token_name(config)}", kind="token", scopes=frozenset({"ws"}))
    return conversation_namespace(gateway)


async def _pin_candidates(
    server: Server, agent: str, conversation: str, namespace: str | None
) -> tuple[str, list[ConversationRecord]]:
    """The id of `agent` and the conversations a pin may name for a caller of `namespace`: the ids
    the WebSocket `submit_input` tries for it (`name_ids`: a bare name is first the caller's own
    `NAME~<tag>`), those that exist."""
    from appserver.http.conversation_match import name_ids

    agent_id = (await server.kernel.resolve_agent(agent)).id
    found = []
    for cid in name_ids(conversation, namespace):
        record = await server.store.get_conversation(cid)
        if record is not None:
            found.append(record)
    return agent_id, found


def _pin_problem(
    agent: str, agent_id: str, conversation: str, namespace: str | None, found: list[ConversationRecord]
) -> str | None:
    """Why the gateway (of `namespace`) could not continue `conversation` for `agent`, or None when
    it can: the rule the server applies (`namespace_allows`, then the agent). The server answers
    `conversation_not_found` alike for all three, so that a credential learns nothing of another
    namespace: only the operator, who reads the store, can be told which it is."""
    from appserver.auth import namespace_allows

    usable = [c for c in found if namespace_allows(namespace, c.namespace)]
    if any(c.agent_id == agent_id for c in usable):
        return None
    if usable:
        return (
            f"conversation {exact(conversation)} belongs to agent {exact(usable[0].agent_id)}, not {exact(agent)}:"
            " a pinned route must name a conversation of its own agent"
        )
    if found:
        owner = found[0].namespace
        whose = (
            "has no owner (made by the CLI, cron, an admin credential or in auth mode none)"
            if owner is None
            else f"belongs to the credential namespace {exact(owner)}"
        )
        return (
            f"conversation {exact(conversation)} {whose}, and in auth mode token the channel gateway may use only"
            f" the conversations of its own credential ({exact(namespace or '')}), as any token may"
            ' (docs/security.md, "Conversation namespaces"): pin a conversation the gateway opened for a chat,'
            " or leave out --conversation"
        )
    return (
        f"no conversation {exact(conversation)}: a pinned route must name an existing conversation of"
        f" {exact(agent)} (see `appserver conversations list --agent {exact(agent)}`)"
    )


def _remove_route(router: Router, key: RouteKey, text: str) -> RouteKey | None:
    """The key removed: as typed (spaces around parts dropped), else exactly as written, since an
    older version kept keys with such spaces and `route list` shows them so."""
    try:
        literal = RouteKey.parse(text)
    except ValueError:
        literal = key
    for candidate in dict.fromkeys((key, literal)):
        if router.get(candidate) is None:
            continue
        try:
            if router.remove(candidate):
                return candidate
        except CommitUnknown:  # PostgreSQL's answer to the COMMIT was lost: removed if it is gone now
            if router.get(candidate) is None or router.remove(candidate):
                return candidate
    return None


@route_group.command("remove")
@click.argument("key")
@_errors
def route_remove_cmd(key: str) -> None:
    """Remove the route at KEY (channel:account:chat[:thread])."""
    try:
        route_key = _parse_key(key)
    except Refused:
        # a key an older version kept with spaces around a part, as `route list` shows it
        try:
            route_key = RouteKey.parse(key)
        except ValueError:
            raise Refused(f"bad route key {shown(key)}: a route key is channel:account:chat[:thread]", 2) from None
        _check_scope(route_key.channel, route_key.account, f"bad route key {shown(key)}: ")
    config = get_config()
    with _gateway_db(config.home, create=False, store_url=config.store.url) as conn:
        removed = _remove_route(Router(conn), route_key, key) if conn is not None else None
    if removed is None:
        raise Refused(f"no route at {route_key}")
    route_key = removed
    click.echo(f"Removed the route at {route_key}.")


@route_group.command("list")
@click.argument("channel", required=False)
@click.argument("account", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@_errors
def route_list_cmd(channel: str | None, account: str | None, as_json: bool) -> None:
    """Routes, of one CHANNEL (and ACCOUNT) when given, ordered by key."""
    _check_scope(channel, account)
    config = get_config()
    with _gateway_db(config.home, create=False, store_url=config.store.url) as conn:
        routes = Router(conn).routes(channel, account) if conn is not None else []
    if as_json:
        print_json([_route_json(r) for r in routes])
        return
    if not routes:
        if config.store.url.strip():  # the gateway's tables in the store's PostgreSQL database
            none = " (the store's PostgreSQL database has no gateway tables yet)"
            click.echo("No routes." + ("" if conn is not None else none))
        else:
            none = " (gateway.db does not exist yet)"
            click.echo("No routes." + ("" if default_path(config.home).exists() else none))
        return
    table = [["KEY", "AGENT", "CONVERSATION"]]
    table += [[str(r.key), r.agent, r.conversation or "-"] for r in routes]
    click.echo(_table(table))
