"""The one `Config` object: home directory, config.toml, environment overrides.

Every key is documented in docs/configuration.md. Environment variables override the file:
`APPSERVER_<SECTION>__<KEY>` (and `APPSERVER_PROVIDERS__<NAME>__<KEY>` for providers).
"""

from __future__ import annotations

import calendar
import codecs
import os
import re
import time
import tomllib
import typing
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from appserver.channelconfig import ChannelConfigError, ChannelsConfig, load_channels
from appserver.configcheck import (
    NO_SUCH_USER,
    AmbiguousName,
    Invalid,
    NoSuchUser,
    Rule,
    convert,
    expand_user,
    fold_name,
    not_utf8_problem,
)
from appserver.fsutil import (
    CONFIG_MAX_BYTES,
    StateFileRefused,
    StateFileTooLarge,
    atomic_write_text,
    dangling_home_link,
    ensure_private_dir,
    move_aside,
    read_state_bytes,
)
from appserver.netaddr import parse_listen, parse_trusted_proxies
from appserver.shown import shown
from appserver.store.url import store_kind

DEFAULT_LISTEN = "127.0.0.1:8770"

DEFAULT_CONFIG_TOML = """\
# appserver configuration. Every key is documented in docs/configuration.md.
# Values are checked at every start (type and range; unknown keys are refused). A file that
# cannot be parsed is moved aside and the server refuses to start until you repair it.

[server]
# listen = "127.0.0.1:8770"
# allowed_origins = []            # browser origins allowed to call the server
# allowed_hosts = []              # extra Host names besides loopback and the listen address
# trusted_proxies = []            # proxies (IPs/CIDRs) whose X-Forwarded-For/-Proto is believed

[limits]
# queue_max = 32                  # queued inputs per conversation (429 / error beyond)
# approval_timeout_s = 600
# client_tool_timeout_s = 300
# max_steps = 24
# max_messages = 2048             # entries in `messages` / `input` per request (400 beyond)
# max_connections = 0             # open connections at once (503 beyond); 0 = from the fd limit
# head_max_bytes = 65536          # request line + headers (431 beyond)
# head_timeout_s = 10             # a request head must arrive within this (408)
# body_timeout_s = 30             # a request body may pause this long (408)
# body_min_rate_bytes_s = 1024    # after body_timeout_s, a body must average at least this (408)
# keepalive_timeout_s = 5         # an idle connection is closed after this
# send_timeout_s = 30             # a client that takes no byte of a pending reply this long is cut off
# min_free_disk_bytes = 16777216  # /readyz reports not ready below this free space (0 = off)

[store]
# url = ""                        # empty: the SQLite file in the home; or postgresql://USER:PASSWORD@HOST:PORT/DB

# [providers.openai]              # built in: base_url https://api.openai.com/v1, OPENAI_API_KEY
# [providers.ollama]
# kind = "openai"
# base_url = "http://127.0.0.1:11434/v1"
# [providers.claude]
# kind = "anthropic"
# api_key_env = "ANTHROPIC_API_KEY"
"""


class ConfigError(Exception):
    """The configuration cannot be used; the message names the file or variable and the key."""


@dataclass(slots=True)
class ProviderConfig:
    name: str
    kind: str = "openai"  # openai | anthropic
    base_url: str = "https://api.openai.com/v1"
    api_key_env: str | None = "OPENAI_API_KEY"
    timeout_s: float = 300.0
    connect_timeout_s: float = 10.0
    max_attempts: int = 4
    headers: dict[str, str] = field(default_factory=dict)
    context_windows: dict[str, int] = field(default_factory=dict)  # model → tokens
    transport: str = "lean"  # lean (providers/fasttransport.py) | httpx (httpx's own transport)
    max_connections: int = 1000  # model calls in flight to this provider at once (more wait for a slot)
    answer_max_bytes: int = 64 * 1024 * 1024  # one whole JSON answer or one SSE event, decoded

    def api_key(self) -> str | None:
        return os.environ.get(self.api_key_env) if self.api_key_env else None


@dataclass(slots=True)
class ServerConfig:
    listen: str = DEFAULT_LISTEN
    allowed_origins: list[str] = field(default_factory=list)
    allowed_hosts: list[str] = field(default_factory=list)
    tls_cert: str | None = None
    tls_key: str | None = None
    trusted_proxies: list[str] = field(default_factory=list)  # IPs/CIDRs whose X-Forwarded-For/-Proto is believed
    event_loop: str = "asyncio"  # asyncio | uvloop | auto (uvloop when installed); see docs/configuration.md
    ws_compression: bool = False  # permessage-deflate on the WebSocket (CPU and ~40 KiB per connection)


@dataclass(slots=True)
class LimitsConfig:
    queue_max: int = 32
    body_max_bytes: int = 20 * 1024 * 1024
    ws_frame_max_bytes: int = 4 * 1024 * 1024
    ws_outbound_max: int = 256
    ws_outbound_max_bytes: int = 16 * 1024 * 1024  # bytes queued per WebSocket before a slow client is closed
    ws_outbound_total_max_bytes: int = 256 * 1024 * 1024  # bytes all WebSockets hold unsent together (¼ per credential)
    ws_ping_interval_s: float = 30.0
    ws_ping_timeout_s: float = 90.0
    ws_send_timeout_s: float = 30.0  # a WebSocket frame not accepted by the client within this is a slow consumer
    connections_per_client: int = 256
    open_turns_per_client: int = 256  # turns a credential holds open over WebSocket and HTTP (paused too); 0 = no cap
    max_connections: int = 0  # open connections (HTTP + WebSocket) at once; 0 = from the fd limit (503 beyond)
    head_max_bytes: int = 64 * 1024  # request line + headers (431 beyond)
    head_timeout_s: float = 10.0  # a request head must arrive within this of its first byte (408)
    body_timeout_s: float = 30.0  # a request body that sends nothing for this long ends (408)
    body_min_rate_bytes_s: int = 1024  # past body_timeout_s, a body slower than this on average ends (408); 0 = off
    keepalive_timeout_s: float = 5.0  # an idle connection (no request in progress) is closed after this
    send_timeout_s: float = 30.0  # a client that takes no byte of a reply waiting for it this long is cut off
    max_messages: int = 2048  # entries in `messages` / `input` per request (400 beyond)
    approval_timeout_s: float = 600.0
    client_tool_timeout_s: float = 300.0
    max_steps: int = 24
    idle_evict_s: float = 60.0
    idle_runtimes_max: int = 256  # idle conversation runtimes kept in memory at most (oldest dropped first)
    shell_timeout_s: float = 60.0
    shell_output_max_bytes: int = 64 * 1024
    draft_interval_s: float = 0.5  # how often a running turn's visible text is checkpointed
    retry_base_ms: int = 500  # first provider retry backoff; doubles per attempt, capped at 20 s
    sse_keepalive_s: float = 15.0  # SSE keepalive comment interval on the OpenAI routes
    context_reserve_tokens: int = 0  # room kept for the reply; 0 = a quarter of the window, at most 8,192
    min_free_disk_bytes: int = 16 * 1024 * 1024  # /readyz fails below this much free space by the store; 0 = off


@dataclass(slots=True)
class AuthConfig:
    mode: str = "none"  # none | token | jwt
    jwt_algorithms: list[str] = field(default_factory=list)
    jwt_secret_file: str | None = None
    jwt_public_key_file: str | None = None
    jwt_issuer: str | None = None
    jwt_audience: str | None = None
    jwt_leeway_s: float = 30.0


@dataclass(slots=True)
class CronConfig:
    enabled: bool = True
    tick_s: float = 60.0  # 0.1 … 3600 (cron.scheduler MIN_TICK_S, MAX_TICK_S)
    lease_ttl_s: float = 90.0  # a scheduler lease not renewed this long expires (renewed every third)


@dataclass(slots=True)
class StoreConfig:
    url: str = ""  # empty: the SQLite file in the home; postgresql://…: a PostgreSQL database (docs/scale-out.md)
    # PostgreSQL only (several servers on one database, docs/scale-out.md): how often a server renews
    # its instance row, and how long one may stay silent before the others take over its work.
    heartbeat_s: float = 2.0
    instance_timeout_s: float = 30.0
    # PostgreSQL only: how long a statement of the store may wait for a lock another session holds,
    # and run at all, before its request fails with 503 store_unavailable (docs/scale-out.md).
    lock_timeout_s: float = 10.0
    statement_timeout_s: float = 120.0
    # PostgreSQL only: how long a connection to the database, or a wait for a pooled one, may take
    # before the request fails with 503 store_unavailable (docs/scale-out.md).
    connect_timeout_s: float = 10.0


@dataclass(slots=True)
class Config:
    home: Path
    server: ServerConfig = field(default_factory=ServerConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    cron: CronConfig = field(default_factory=CronConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    channels: ChannelsConfig = field(default_factory=ChannelsConfig)
    providers: dict[str, ProviderConfig] = field(default_factory=dict)
    source: str = ""  # what load_config read: the file (or that defaults are used) and env overrides

    @property
    def db_path(self) -> Path:
        return self.home / "appserver.db"

    @property
    def server_json(self) -> Path:
        return self.home / "server.json"

    @property
    def config_path(self) -> Path:
        return self.home / "config.toml"

    def workspace(self, agent_id: str) -> Path:
        return self.home / "workspaces" / agent_id


def default_home() -> Path:
    """$APPSERVER_HOME (its ~ expanded when it can be), else ~/.appserver. A `~user` of no user is
    left as written: load_config refuses it in one line (expanded_home), never a traceback here."""
    env = os.environ.get("APPSERVER_HOME")
    if env:
        try:
            return expand_user(env)
        except NoSuchUser:
            return Path(env)
    try:
        return Path.home() / ".appserver"
    except RuntimeError:  # no $HOME and no user entry: load_config says so
        return Path("~/.appserver")


def expanded_home(given: Path | None = None) -> Path:
    """The home `given` (else default_home()) with its ~ expanded; ConfigError, one line, when the
    ~ names no user of this system (or there is no home directory for a bare ~)."""
    home = given or default_home()
    try:
        return expand_user(home)
    except NoSuchUser:
        text = str(home)
        bare = text.split("/")[0] == "~"
        why = "$HOME is not set, so its ~ names no directory; give the path itself" if bare else NO_SUCH_USER
        raise ConfigError(f"the home {text!r} (--home or APPSERVER_HOME): {why}") from None


# The settings that name a file, in config.toml or their APPSERVER_<SECTION>__<KEY> variable: a
# relative path is the home's (the directory of config.toml), never the working directory's, so a
# server reads the same files wherever it is started from (docs/configuration.md, "Paths").
FILE_KEYS = (
    ("server", "tls_cert"),
    ("server", "tls_key"),
    ("auth", "jwt_secret_file"),
    ("auth", "jwt_public_key_file"),
)


def home_file(home: Path, value: str) -> Path:
    """The file a setting names: `~` expanded, and a relative path taken from `home`. (The
    gateway resolves a channel account's `<secret>_file` the same way: gateway/accounts.py.)
    NoSuchUser when its `~user` names no user: the caller names the setting."""
    path = expand_user(value)
    return path if path.is_absolute() else home / path


# ── validation: types from the dataclasses, ranges and choices from RULES ─────────────────────

_SECTIONS: dict[type, str] = {
    ServerConfig: "server",
    LimitsConfig: "limits",
    AuthConfig: "auth",
    CronConfig: "cron",
    StoreConfig: "store",
    ProviderConfig: "providers",
}

_POSITIVE = Rule(gt=0)
_NON_NEGATIVE = Rule(ge=0)
_AT_LEAST_ONE = Rule(ge=1)

# Bounds and choices per `section.key` (providers: `providers.key`). A key not listed here is still
# type-checked; list it when some values of its type are wrong (negative sizes, zero timeouts).
RULES: dict[str, Rule] = {
    "limits.queue_max": _AT_LEAST_ONE,
    "limits.body_max_bytes": Rule(ge=1024),
    "limits.ws_frame_max_bytes": Rule(ge=1024),
    "limits.ws_outbound_max": _AT_LEAST_ONE,
    "limits.ws_outbound_max_bytes": Rule(ge=1024),
    "limits.ws_outbound_total_max_bytes": Rule(ge=1024),
    "limits.ws_ping_interval_s": _NON_NEGATIVE,  # 0 = no pings
    "limits.ws_ping_timeout_s": _NON_NEGATIVE,  # 0 = never close a silent peer
    "limits.ws_send_timeout_s": _POSITIVE,
    "limits.connections_per_client": _NON_NEGATIVE,  # 0 = no cap
    "limits.open_turns_per_client": _NON_NEGATIVE,  # 0 = no cap
    "limits.max_connections": _NON_NEGATIVE,  # 0 = from the fd limit
    "limits.head_max_bytes": Rule(ge=1024, le=1 << 24),
    "limits.head_timeout_s": _POSITIVE,
    "limits.body_timeout_s": _POSITIVE,
    "limits.body_min_rate_bytes_s": _NON_NEGATIVE,  # 0 = no minimum rate
    "limits.keepalive_timeout_s": _POSITIVE,
    "limits.send_timeout_s": _POSITIVE,
    "limits.max_messages": _AT_LEAST_ONE,
    "limits.approval_timeout_s": _POSITIVE,
    "limits.client_tool_timeout_s": _POSITIVE,
    "limits.max_steps": Rule(ge=1, le=1000),
    "limits.idle_evict_s": _NON_NEGATIVE,
    "limits.idle_runtimes_max": _AT_LEAST_ONE,
    "limits.shell_timeout_s": _POSITIVE,
    "limits.shell_output_max_bytes": _AT_LEAST_ONE,
    "limits.draft_interval_s": _POSITIVE,
    "limits.retry_base_ms": _NON_NEGATIVE,
    "limits.sse_keepalive_s": _POSITIVE,
    "limits.context_reserve_tokens": _NON_NEGATIVE,
    "limits.min_free_disk_bytes": _NON_NEGATIVE,  # 0 = no free-space check
    "auth.mode": Rule(choices=("none", "token", "jwt")),
    "server.event_loop": Rule(choices=("auto", "uvloop", "asyncio")),
    "auth.jwt_leeway_s": Rule(ge=0, le=300),  # = auth/jwt.py MAX_JWT_LEEWAY_S (why: there)
    "cron.tick_s": Rule(gt=0, le=3600),  # and >= 0.1: see _check_value
    "cron.lease_ttl_s": Rule(ge=3, le=3600),
    "store.heartbeat_s": Rule(ge=0.1, le=60),
    "store.instance_timeout_s": Rule(ge=1, le=3600),
    "store.lock_timeout_s": Rule(ge=0.1, le=3600),
    "store.statement_timeout_s": Rule(ge=1, le=86400),
    "store.connect_timeout_s": Rule(ge=1, le=3600),
    "providers.kind": Rule(choices=("openai", "anthropic")),
    "providers.transport": Rule(choices=("lean", "httpx")),
    "providers.timeout_s": _POSITIVE,
    "providers.connect_timeout_s": _POSITIVE,
    "providers.max_attempts": Rule(ge=1, le=20),
    "providers.max_connections": _AT_LEAST_ONE,
    "providers.answer_max_bytes": Rule(ge=1024),
    "providers.context_windows": _AT_LEAST_ONE,
}


def _check_value(section: str, key: str, value: Any) -> str | None:
    """Checks a type and a range cannot express; the reason, or None."""
    if (section, key) == ("server", "listen"):
        try:
            parse_listen(value)
        except ValueError as exc:
            return str(exc)
    if (section, key) == ("server", "allowed_origins") and any(o.strip() == "*" for o in value):
        return "'*' is not supported; list each origin (e.g. https://app.example)"
    if (section, key) == ("server", "trusted_proxies"):
        try:
            parse_trusted_proxies(value)
        except ValueError as exc:
            return str(exc).removeprefix("[server] trusted_proxies: ")
    if (section, key) == ("store", "url"):
        try:
            store_kind(value)
        except ValueError as exc:
            return str(exc)
    if (section, key) == ("cron", "tick_s") and value < 0.1:
        return f"must be at least 0.1 (seconds; a shorter tick only busies the scheduler), got {value!r}"
    if section == "providers" and key == "base_url":
        return _base_url_problem(value)
    if section == "providers" and key == "headers":
        return _headers_problem(value)
    return None


# An RFC 9110 (7230) token: what a header name may be. A value may hold any visible ASCII character,
# space and tab, never CR, LF, NUL or another control: those would end the header line (a second
# header, or a request of its own, on the upstream's connection); and nothing beyond ASCII: the
# HTTP client encodes header values as ASCII (a `é` or a pasted non-breaking hyphen would fail every
# model call), and C1 controls (U+0080-U+009F) are controls too.
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_HEADER_VALUE_BAD = re.compile(r"[^\t\x20-\x7e]")
_HEADER_VALUE_BAD_NO_TAB = re.compile(r"[^\x20-\x7e]")
# Headers the HTTP client writes itself, from base_url and the request's body, and that keep the
# connection usable: one given here would contradict them (a second Host or Content-Length, a body
# framed twice, a pooled connection closed or upgraded under the client).
MANAGED_HEADERS = frozenset(
    {
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "upgrade",
    }
)


def _headers_problem(headers: dict[str, str]) -> str | None:
    for name, value in headers.items():
        if not _HEADER_NAME.fullmatch(name):
            return f"{name!r} is not a valid header name (letters, digits and !#$%&'*+.^_`|~- only, no spaces)"
        if name.lower() in MANAGED_HEADERS:
            return f"{name!r} is set by the HTTP client itself (from base_url and the request) and cannot be given"
        problem = header_text_problem(value)
        if problem is not None:
            return f"the value of {name!r} {problem}"
        if value != value.strip(" \t"):
            return f"the value of {name!r} starts or ends with white space"
    return None


def describe_char(c: str) -> str:
    """`U+2011 (NON-BREAKING HYPHEN)`: one character named without showing the text around it."""
    name = unicodedata.name(c, "") or _CONTROL_NAMES.get(ord(c), "")
    return f"U+{ord(c):04X}" + (f" ({name})" if name else "")


_CONTROL_NAMES = {0x00: "NUL", 0x09: "TAB", 0x0A: "LF", 0x0D: "CR", 0x1B: "ESC", 0x7F: "DEL", 0x85: "NEL"}


def header_text_problem(value: str, *, tab: bool = True) -> str | None:
    """Why `value` cannot be sent as an HTTP header value (a control or a character beyond ASCII),
    naming the character by its code point and its position (counted from 1), never quoting the
    value: it may be a secret. None when it can be sent. `tab=False`: a tab is refused too (a key)."""
    bad = (_HEADER_VALUE_BAD if tab else _HEADER_VALUE_BAD_NO_TAB).search(value)
    if bad is None:
        return None
    at, c = bad.start(), bad.group()
    if ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F:
        return (
            f"holds the control character {describe_char(c)} at position {at + 1} "
            "(CR, LF, NUL and other controls would split or end the header line)"
        )
    return (
        f"holds the non-ASCII character {describe_char(c)} at position {at + 1} (HTTP header values are "
        "sent as ASCII; a character pasted from a document, such as a non-breaking hyphen, a curly quote "
        "or a no-break space, is a common cause)"
    )


def api_key_problem(key: str, provider: str, variable: str) -> str | None:
    """Why the API key `key` (read from the environment variable `variable` for `[providers.NAME]`)
    cannot be sent in a header, naming the variable, the character (U+XXXX) and its position but
    never the key; None when it can."""
    problem = header_text_problem(key, tab=False)
    if problem is None:
        return None
    return f"{variable}: the API key of [providers.{provider}] (api_key_env = {variable!r}) {problem}; set it again"


def _base_url_problem(value: str) -> str | None:
    """Why `value` is no usable upstream URL (http or https, a host, no white space), or None. The
    URL is quoted with its secrets masked (a password in its user part, the values of its query)."""
    shown = _masked_url(value)
    if not value.startswith(("http://", "https://")):
        return f"must be an http:// or https:// URL, got {shown!r}"
    if any(c.isspace() or ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        return f"must be a URL without spaces or control characters, got {shown!r}"
    try:
        host = _url_host(value)
    except ValueError as exc:
        return f"must be a valid http:// or https:// URL ({exc}), got {shown!r}"
    if not host:
        return f"must name a host (http://HOST[:PORT]/PATH), got {shown!r}"
    return None


def _masked_url(value: str) -> str:
    """`value` for an error message: the password of its user part and its query's values as `***`."""
    masked = re.sub(r"(//[^/?#@:]*):[^/?#@]*@", r"\1:***@", value, count=1)
    return re.sub(r"([?&][^=&#]*=)[^&#]*", r"\1***", masked)


def _url_host(value: str) -> str:
    """The host `value` names (empty when it names none); ValueError when it cannot be parsed."""
    from urllib.parse import urlsplit

    parts = urlsplit(value)
    _ = parts.port  # ValueError: a port that is no number, or out of range
    host = parts.hostname or ""
    if not host.isascii():
        try:
            ascii_form = f": write it as {host.encode('idna').decode('ascii')!r}"
        except UnicodeError:
            ascii_form = ""
        raise ValueError(
            f"the host {host!r} is not ASCII (an internationalized name goes in its IDNA form{ascii_form})"
        )
    if host and not re.fullmatch(r"[A-Za-z0-9._~%!$&'()*+,;=:-]+", host):
        raise ValueError(f"{host!r} is not a host name or address")
    return host


def _apply_section(obj: Any, data: dict[str, Any], where: str, origin: Callable[[str], str], *, from_env: bool) -> None:
    """Set `data` onto the section dataclass `obj`, each value checked; errors name the key and
    where it came from (the file, or the environment variable)."""
    cls = type(obj)
    prefix = _SECTIONS[cls]
    hints = typing.get_type_hints(cls)
    known = [f.name for f in fields(obj) if f.name != "name"]
    for key, value in data.items():
        if from_env:
            _refuse_extra_name_parts(value, hints.get(key), where, key, origin(key))
        if key not in known:
            raise ConfigError(f"{origin(key)}: unknown key {key!r} in [{where}]; known keys: {', '.join(known)}")
        try:
            converted = convert(value, hints[key], RULES.get(f"{prefix}.{key}"), from_env=from_env)
        except Invalid as exc:
            raise ConfigError(f"{origin(key)}: [{where}] {key} must be {exc.expected}, got {shown(value)}") from None
        problem = _check_value(prefix, key, converted)
        if problem is not None:
            raise ConfigError(f"{origin(key)}: [{where}] {key}: {problem}")
        setattr(obj, key, converted)


def _refuse_extra_name_parts(value: Any, hint: Any, where: str, key: str, variable: str) -> None:
    """Refuses the variables below `variable` (`APPSERVER_LIMITS__QUEUE_MAX__X`) that have more name
    parts than the setting has levels (one more for a table, such as headers; none otherwise),
    naming them: their tree was reported as the value of `variable`, which nobody had set."""
    if not isinstance(value, dict):
        return
    table = typing.get_origin(hint) is dict
    extra = {k: v for k, v in value.items() if isinstance(v, dict)} if table else value
    if not extra:
        return
    names = ", ".join(f"{variable}__{n.removeprefix('APPSERVER_')}" for n in sorted(_env_names(extra)))
    if hint is None:
        what = f"{key!r} is no key of [{where}]"
    elif table:
        what = f"[{where}] {key} takes one name part after {variable} (a key of the table), not more"
    else:
        what = f"[{where}] {key} has no sub-keys: set {variable} itself"
    raise ConfigError(f"{names}: a name part too many: {what}")


# The APPSERVER_ variables read besides the APPSERVER_<SECTION>__<KEY> ones (docs/configuration.md),
# and those set for tests and tools. Any other APPSERVER_<SECTION>_… or APPSERVER_<KEY> is a typo of
# a setting (`APPSERVER_AUTH_MODE=token`, one underscore) and is refused, not ignored: the server
# would otherwise start without what it names.
OTHER_ENV = frozenset(
    {
        "APPSERVER_HOME",
        "APPSERVER_TOKEN",
        "APPSERVER_DEBUG",
        "APPSERVER_DISABLE_CRON",
        "APPSERVER_CRON_TICK_S",
        "APPSERVER_TOOL_OWNER",
        "APPSERVER_TOOL_HOME",
        "APPSERVER_TEST_PG",
        "APPSERVER_TEST_ZYGOTE",
        "APPSERVER_CLUSTER_DIR",
        "APPSERVER_GATEWAY_RESTART_BACKOFF_S",
        "APPSERVER_GATEWAY_PING_INTERVAL_S",
        "APPSERVER_GATEWAY_PING_TIMEOUT_S",
        "APPSERVER_GATEWAY_HUNG_KILL_S",
        "APPSERVER_DISCORD_REIDENTIFY_WAIT_S",
        "APPSERVER_DISCORD_GUILD_READY_TIMEOUT_S",
        "APPSERVER_SLACK_API_TIMEOUT_S",
        "APPSERVER_TELEGRAM_API_TIMEOUT_S",
        "APPSERVER_GATEWAY_DB_BUSY_TIMEOUT_S",
        "APPSERVER_GATEWAY_START_TIMEOUT_S",
        "APPSERVER_GATEWAY_LEDGER_RETENTION_DAYS",
        "APPSERVER_WEBHOOK_SEND_DEADLINE_S",
    }
)
SECTION_NAMES = ("server", "limits", "auth", "cron", "store", "channels", "providers")


def _setting_keys() -> dict[str, str]:
    """Every key of a section, to the section it belongs to (the first one, for a shared name)."""
    out: dict[str, str] = {}
    for cls, section in _SECTIONS.items():
        for f in fields(cls):
            if f.name != "name":
                out.setdefault(f.name, section)
    out.setdefault("enabled", "channels")
    return out


def _stray_env_problem(name: str) -> str | None:
    """Why the variable `name` (APPSERVER_ and no `__`) looks like a mistyped setting, or None."""
    if name in OTHER_ENV:
        return None
    if name.upper() in OTHER_ENV:  # read by its exact name: `APPSERVER_Disable_Cron` would be ignored
        return f"{name}: not read; did you mean {name.upper()}? (these variables are written in capitals)"
    rest = name[len("APPSERVER_") :].lower()
    for section in SECTION_NAMES:
        if rest.startswith(section + "_"):
            key = rest[len(section) + 1 :].lstrip("_")
            if not key:
                return f"{name}: not a setting; settings are APPSERVER_{section.upper()}__<KEY>"
            return f"{name}: not a setting; did you mean APPSERVER_{section.upper()}__{key.upper()}? (two underscores)"
        if rest == section:
            return f"{name}: not a setting; settings are APPSERVER_{section.upper()}__<KEY>"
    owner = _setting_keys().get(rest)
    if owner is not None:
        where = "PROVIDERS__<NAME>" if owner == "providers" else owner.upper()
        return f"{name}: not a setting; did you mean APPSERVER_{where}__{rest.upper()}?"
    return None


def _env_overrides(environ: dict[str, str]) -> dict[str, Any]:
    """The APPSERVER_<SECTION>__<KEY> variables as a tree, every part lower-cased: the parts are
    not case-sensitive, so two variables that differ only in case name one setting and are refused
    (which one won depended on the order of the environment). The prefix is written in capitals."""
    out: dict[str, Any] = {}
    seen: dict[tuple[str, ...], str] = {}
    for name in sorted(environ):
        if not name.startswith("APPSERVER_"):
            if name[: len("APPSERVER_")].upper() == "APPSERVER_" and _would_be_read(name.upper()):
                raise ConfigError(
                    f"{name}: not read; the prefix is written in capitals: APPSERVER_{name[len('APPSERVER_') :]}"
                )
            continue
        if "__" not in name:
            problem = _stray_env_problem(name)
            if problem is not None:
                raise ConfigError(problem)
            continue
        parts = name[len("APPSERVER_") :].split("__")
        if "" in parts:
            raise ConfigError(_empty_name_part(name, parts))
        problem = not_utf8_problem(environ[name])
        if problem is not None:  # would pass as text and fail where it is first encoded (a traceback)
            raise ConfigError(f"{name}: its value {problem}")
        path = tuple(p.lower() for p in parts)
        other = seen.setdefault(path, name)
        if other != name:
            raise ConfigError(
                f"{other} and {name} both set {'.'.join(path)} (the parts of an APPSERVER_ variable's name "
                "are not case-sensitive): unset one of them"
            )
        for other_path, other_name in seen.items():  # a whole table and a key of it: one would be lost
            shorter = min(len(path), len(other_path))
            if other_path != path and other_path[:shorter] == path[:shorter]:
                table = ".".join(path[:shorter])
                raise ConfigError(
                    f"{other_name} and {name} both set [{table}] (one the whole table, the other a key of it): "
                    "unset one of them"
                )
        cur = out
        for part in path[:-1]:
            cur = cur.setdefault(part, {})
        cur[path[-1]] = environ[name]
    return out


def _empty_name_part(name: str, parts: list[str]) -> str:
    """The refusal of a variable whose name has an empty part (`APPSERVER_LIMITS____QUEUE_MAX`): it
    was reported under the name its parts make without it, a variable that is not set."""
    meant = [p for p in parts if p]
    flat = len(meant) == 2 and meant[0].lower() in _SECTIONS.values() and meant[0].lower() != "providers"
    hint = f"; did you mean APPSERVER_{'__'.join(meant)}?" if flat else ""
    return (
        f"{name}: a part of its name is empty (four underscores in a row, or two at an end): the parts "
        f"after APPSERVER_ must be non-empty, as in APPSERVER_<SECTION>__<KEY>{hint}"
    )


def _would_be_read(name: str) -> bool:
    """`name` (in capitals) is a setting or a variable the server reads, or a typo of one: written
    with a lower-case prefix it is a mistake to refuse, any other `appserver_…` is somebody else's."""
    return "__" in name or name in OTHER_ENV or _stray_env_problem(name) is not None


def _refuse_aliases(environ: dict[str, str], env: dict[str, Any]) -> None:
    """APPSERVER_CRON_TICK_S and APPSERVER_DISABLE_CRON name what APPSERVER_CRON__TICK_S and
    APPSERVER_CRON__ENABLED do: given both, one was silently dropped; refused, naming both."""
    cron = env.get("cron")
    cron = cron if isinstance(cron, dict) else {}
    for alias, key, set_ in (
        ("APPSERVER_CRON_TICK_S", "tick_s", "APPSERVER_CRON_TICK_S" in environ),
        ("APPSERVER_DISABLE_CRON", "enabled", bool(environ.get("APPSERVER_DISABLE_CRON", "").strip())),
    ):
        if set_ and key in cron:
            other = next(n for n in sorted(environ) if n.upper() == _env_name("cron", key))
            raise ConfigError(f"{alias} and {other} both set [cron] {key}: unset one of them")


def _fold_env_providers(env_provs: dict[str, Any], known: list[str], path: Path) -> dict[str, Any]:
    """The environment's providers keyed by the names config.toml (or the built-ins) gives them:
    `APPSERVER_PROVIDERS__MYPROV__BASE_URL` overrides `[providers.MyProv]`; it was a second provider
    `myprov` beside it, and MyProv kept the file's value. A provider only in the environment is
    named in lower case. Two names in the file that differ only in case cannot be told apart."""
    out: dict[str, Any] = {}
    for env_name, table in env_provs.items():
        try:
            out[fold_name(env_name, known)] = table
        except AmbiguousName as exc:
            variables = ", ".join(_env_names(table, "providers", env_name)) if isinstance(table, dict) else ""
            raise ConfigError(
                f"{variables or _env_name('providers', env_name)}: {path} has the providers {exc}, which differ "
                "only in case, and an environment variable's name is not case-sensitive: rename one of them"
            ) from None
    return out


def _env_name(*parts: str) -> str:
    return "APPSERVER_" + "__".join(p.upper() for p in parts)


def _env_origin(*prefix: str) -> Callable[[str], str]:
    """Names the variable a key came from: `APPSERVER_LIMITS__QUEUE_MAX`."""
    return lambda key: _env_name(*prefix, key)


def _env_names(tree: dict[str, Any], *prefix: str) -> list[str]:
    out: list[str] = []
    for k, v in tree.items():
        out.extend(_env_names(v, *prefix, k) if isinstance(v, dict) else [_env_name(*prefix, k)])
    return out


def _origin_of(environ: dict[str, str], path: Path, section: str, key: str) -> str:
    """The variable that set `section.key` when one did, else the file."""
    name = _env_name(section, key)
    return next((n for n in sorted(environ) if n.upper() == name), str(path))


def builtin_providers() -> dict[str, ProviderConfig]:
    return {"openai": ProviderConfig(name="openai")}


# ── the file: never silently replaced by defaults ──────────────────────────────────────────────

_STAMP_RE = re.compile(r"\.corrupt-(\d{8}T\d{6})")


def set_aside_time(path: Path) -> float:
    """When `path` (a `<name>.corrupt-<stamp>` file) was set aside: its stamp (UTC), else its mtime."""
    m = _STAMP_RE.search(path.name)
    if m:
        try:
            return calendar.timegm(time.strptime(m.group(1), "%Y%m%dT%H%M%S"))
        except ValueError:
            pass
    return path.stat().st_mtime


def corrupt_copies(path: Path) -> list[Path]:
    """`<name>.corrupt-*` files set aside from `path`, oldest first."""
    if not path.parent.is_dir():
        return []
    return sorted(path.parent.glob(f"{path.name}.corrupt-*"), key=set_aside_time)


def _read_config_file(path: Path, create: bool) -> tuple[dict[str, Any], str]:
    """The parsed file and a line saying what was loaded. Refuses (never falls back to defaults)
    when the file is empty or unparseable, or when a set-aside copy is newer than it: a server
    configured with auth must not come back without it because its config was damaged."""
    asides = corrupt_copies(path)
    newest = asides[-1] if asides else None
    if not path.exists():
        if path.is_symlink():  # a link to a config that is not there (an unmounted volume): never defaults
            raise ConfigError(
                f"{path} is a symbolic link to {os.readlink(path)}, which does not exist: make the file it "
                f"points to available, or remove the link to start from defaults"
            )
        if newest is not None:
            raise ConfigError(
                f"{path} is missing and {newest.name} holds the config that was set aside as unreadable; "
                f"repair it and move it back (mv {newest} {path}), or delete it to start from defaults"
            )
        if create:
            # never over a config another process wrote since the check (`channels add` on a new home)
            if atomic_write_text(path, DEFAULT_CONFIG_TOML, exclusive=True):
                return {}, f"wrote a default {path} (every setting at its default)"
            return _read_config_file(path, create=False)
        return {}, f"no config file at {path}: every setting at its default"
    if newest is not None and set_aside_time(newest) > path.stat().st_mtime:
        raise ConfigError(
            f"{newest} was set aside as unreadable after {path} was last written, so {path.name} is "
            f"probably not the config you meant: repair the set-aside file and move it over {path.name}, "
            f"or delete it to use {path.name} as it is"
        )
    try:
        raw = read_state_bytes(path, CONFIG_MAX_BYTES)
    except StateFileTooLarge as exc:
        err = move_aside(path, exc.reason, quiet=True)
        raise ConfigError(
            f"{path} is {exc.reason} for a config; moved aside to {err.moved_to.name}: restore the config "
            f"from a backup, or delete the set-aside file to start from defaults"
        ) from None
    except StateFileRefused as exc:  # a FIFO, a device, a directory: never read, never moved
        raise ConfigError(str(exc)) from None
    if not raw.removeprefix(codecs.BOM_UTF8).strip():  # a byte-order mark alone is no config either
        raise ConfigError(
            f"{path} is empty ({len(raw)} bytes), which is not a valid config: restore it from a backup, "
            "or delete it to have a default one written (a file of comments only means all defaults)"
        )
    try:
        data = tomllib.loads(raw.decode("utf-8-sig"))  # a leading byte-order mark: Windows editors write one
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, RecursionError) as exc:
        # (RecursionError: arrays or inline tables nested thousands deep, which no config needs)
        why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        err = move_aside(path, f"invalid TOML: {why}", quiet=True)
        raise ConfigError(
            f"{path} is not valid TOML ({why}); moved aside to {err.moved_to.name}: repair it and move "
            f"it back (mv {err.moved_to} {path}), or delete it to start from defaults"
        ) from None
    return data, f"loaded {path}"


def load_config(home: Path | None = None, environ: dict[str, str] | None = None, *, create: bool = True) -> Config:
    """Read `home/config.toml` (written with commented defaults when the home has none) plus
    environment overrides, every value checked. `Config.source` says what was loaded."""
    given = expanded_home(home)
    dangling = dangling_home_link(given)  # before resolve(), which would turn the link into its target
    if dangling is not None:
        raise ConfigError(str(dangling))
    try:
        home = given.resolve()
    except (OSError, RuntimeError) as exc:  # a loop of links met meanwhile (pathlib says RuntimeError)
        raise ConfigError(f"the home {given} cannot be reached: {exc}") from None
    if home.exists() and not home.is_dir():
        raise ConfigError(
            f"the home {home} is not a directory: point APPSERVER_HOME (or --home) at a directory, "
            "or move the file away so that appserver can make one there"
        )
    environ = dict(os.environ) if environ is None else environ
    if create:
        ensure_private_dir(home)
    path = home / "config.toml"
    data, source = _read_config_file(path, create)
    env = _env_overrides(environ)
    _refuse_aliases(environ, env)
    overridden = _env_names(env)
    if overridden:
        source += f"; environment overrides: {', '.join(sorted(overridden))}"

    def in_file(key: str) -> str:
        return str(path)

    tick_origin: Callable[[str], str] = lambda key: "APPSERVER_CRON_TICK_S"  # noqa: E731
    cfg = Config(home=home, providers=builtin_providers(), source=source)
    sections = (
        ("server", cfg.server),
        ("limits", cfg.limits),
        ("auth", cfg.auth),
        ("cron", cfg.cron),
        ("store", cfg.store),
    )
    for section, target in sections:
        for raw, origin, from_env in (
            (data.pop(section, {}), in_file, False),
            (env.pop(section, {}), _env_origin(section), True),
        ):
            if not isinstance(raw, dict):
                where = str(path) if not from_env else f"APPSERVER_{section.upper()}"
                raise ConfigError(f"{where}: [{section}] must be a table")
            _apply_section(target, raw, section, origin, from_env=from_env)
    disable_cron = environ.get("APPSERVER_DISABLE_CRON", "")
    if disable_cron.strip():  # 1/true/yes/on or 0/false/no/off, as every boolean setting; else refused
        try:
            if convert(disable_cron, bool, None, from_env=True):
                cfg.cron.enabled = False
        except Invalid:
            raise ConfigError(
                f"APPSERVER_DISABLE_CRON={disable_cron!r}: must be 1, true, yes or on to turn cron off, "
                "or 0, false, no or off to leave it on"
            ) from None
    if "APPSERVER_CRON_TICK_S" in environ:
        _apply_section(cfg.cron, {"tick_s": environ["APPSERVER_CRON_TICK_S"]}, "cron", tick_origin, from_env=True)

    file_provs = data.pop("providers", {}) or {}
    env_provs = env.pop("providers", {}) or {}
    if not isinstance(file_provs, dict) or not isinstance(env_provs, dict):
        raise ConfigError(f"{path}: [providers] must be a table of [providers.NAME] tables")
    env_provs = _fold_env_providers(env_provs, [*file_provs, *cfg.providers], path)
    for name in [*file_provs, *(n for n in env_provs if n not in file_provs)]:
        raw_file, raw_env = file_provs.get(name, {}), env_provs.get(name, {})
        for raw, where in ((raw_file, str(path)), (raw_env, _env_name("providers", name))):
            if not isinstance(raw, dict):
                raise ConfigError(f"{where}: [providers.{name}] must be a table")
        if not name or ":" in name or any(c.isspace() or ord(c) < 0x20 or ord(c) == 0x7F for c in name):
            where = str(path) if name in file_provs else _env_name("providers", name)
            raise ConfigError(
                f"{where}: [providers.{name!r}]: a provider name must be non-empty, without ':' (a model is "
                "named PROVIDER:MODEL), spaces or control characters"
            )
        if name == "echo":
            raise ConfigError(
                f"{path if raw_file else _env_name('providers', name)}: "
                "[providers.echo] is built in and cannot be configured"
            )
        prov = cfg.providers.get(name) or ProviderConfig(name=name)
        if name not in cfg.providers:
            kind_variable = _env_name("providers", name, "kind")
            _refuse_extra_name_parts(raw_env.get("kind"), str, f"providers.{name}", "kind", kind_variable)
            kind_origin, kind = (
                (kind_variable, raw_env["kind"]) if "kind" in raw_env else (str(path), raw_file.get("kind", prov.kind))
            )
            if kind not in ("openai", "anthropic"):
                raise ConfigError(
                    f"{kind_origin}: [providers.{name}] kind must be one of 'openai', 'anthropic', got {kind!r}"
                )
            if kind == "anthropic":
                prov.base_url, prov.api_key_env = "https://api.anthropic.com", "ANTHROPIC_API_KEY"
            elif "base_url" in raw_file or "base_url" in raw_env:
                prov.api_key_env = None  # a local OpenAI-compatible server needs no key unless named
        _apply_section(prov, raw_file, f"providers.{name}", in_file, from_env=False)
        _apply_section(prov, raw_env, f"providers.{name}", _env_origin("providers", name), from_env=True)
        cfg.providers[name] = prov
    env_channels = env.get("channels")
    if isinstance(env_channels, dict):
        enabled = _env_name("channels", "enabled")
        _refuse_extra_name_parts(env_channels.get("enabled"), list[str], "channels", "enabled", enabled)
    try:
        cfg.channels = load_channels(data.pop("channels", {}), env.pop("channels", {}), str(path), _env_name)
    except ChannelConfigError as exc:
        raise ConfigError(str(exc)) from None
    if data:
        raise ConfigError(
            f"{path}: unknown section(s) {', '.join(sorted(data))}; "
            "known: server, limits, auth, cron, store, channels, providers.NAME"
        )
    if env:
        names = ", ".join(sorted(_env_names(env)))
        raise ConfigError(
            f"{names}: no such config section; known: server, limits, auth, cron, store, channels, providers"
        )
    if cfg.store.instance_timeout_s < 3 * cfg.store.heartbeat_s:
        raise ConfigError(
            f"{_origin_of(environ, path, 'store', 'instance_timeout_s')}: [store] instance_timeout_s "
            f"({cfg.store.instance_timeout_s:g}) must be at least 3 heartbeats (3 × heartbeat_s = "
            f"{3 * cfg.store.heartbeat_s:g}): a server is judged gone only after several missed heartbeats"
        )
    for section, key in FILE_KEYS:
        target = getattr(cfg, section)
        value = getattr(target, key)
        if value:
            try:
                setattr(target, key, str(home_file(home, value)))
            except NoSuchUser:  # `~name` of no user (pathlib cannot expand it)
                raise ConfigError(
                    f"{_origin_of(environ, path, section, key)}: [{section}] {key} = {value!r}: {NO_SUCH_USER}"
                ) from None
    if bool(cfg.server.tls_cert) != bool(cfg.server.tls_key):
        raise ConfigError(f"{path}: [server] tls_cert and tls_key go together (set both or neither)")
    for prov in cfg.providers.values():
        # The key is read from its variable at every model call (ProviderConfig.api_key); one that
        # cannot go into a header would fail every turn of every agent on this provider.
        if prov.api_key_env:
            problem = api_key_problem(environ.get(prov.api_key_env) or "", prov.name, prov.api_key_env)
            if problem is not None:
                raise ConfigError(problem)
    return cfg
