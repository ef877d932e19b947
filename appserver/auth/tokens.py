"""Capability tokens: `tokens.json` (hashes only), their creation, revocation and verification.

Also the parsers of what a token grants (`--scopes`, `--agents`, `--expires`), shared by the CLI.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import re
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from appserver.auth.principal import DEFAULT_TOKEN_SCOPES, SCOPES, Principal
from appserver.fsutil import (
    TOKENS_MAX_BYTES,
    CorruptStateFile,
    StateFileRefused,
    StateFileTooLarge,
    atomic_write_json,
    ensure_private_dir,
    move_aside,
    read_json_or_move_aside,
    read_state_bytes,
    state_file_stat,
)
from appserver.shown import shown

log = logging.getLogger("appserver.auth")

TOKEN_PREFIX = "aps_"
LOCK_TIMEOUT_S = 10.0
FORMAT_VERSION = 1  # of tokens.json; a newer one is refused, never rewritten as this one

# The channel gateway's own credential (appserver/channels.py) is a token named `gateway` (or, on a
# database several servers share, `gateway@<host>-<hash>`), and its conversations are the namespace
# of that name. Those names are reserved: `token create` refuses them, and only a token minted for
# the gateway (`TokenStore.mint_gateway`) carries the mark that gives it that namespace: its id
# starts with GATEWAY_ID_PREFIX, which no other token id does (`create` always makes `tok_…`).
GATEWAY_TOKEN_NAME = "gateway"
GATEWAY_ID_PREFIX = "gwt_"
USER_ID_PREFIX = "tok_"


def is_reserved_name(name: str) -> bool:
    """A token name that belongs to the channel gateway: `gateway` and `gateway@…`."""
    return name == GATEWAY_TOKEN_NAME or name.startswith(GATEWAY_TOKEN_NAME + "@")


def reserved_name_error(name: str) -> str:
    return (
        f"the token name {name!r} is reserved for the channel gateway's own credential (so are "
        f"{GATEWAY_TOKEN_NAME!r} and every name starting with '{GATEWAY_TOKEN_NAME}@'): pick another name"
    )


class ReservedNameTaken(ValueError):
    """A token the gateway did not mint holds the gateway's reserved name (made by an older
    appserver, which did not reserve it): it is never revoked for the gateway without a word."""

    def __init__(self, record: TokenRecord) -> None:
        super().__init__(
            f"token {record.id} is named {record.name!r}, a name reserved for the channel gateway's credential, "
            "but it was not made for the gateway (an older appserver allowed the name). It keeps working, in a "
            f"namespace of its own; revoke it (`appserver token revoke {record.id}`) and create it again under "
            "another name, then restart the server, to run channels"
        )
        self.record = record


def fingerprint(secret: str | bytes) -> str:
    """A short, stable, non-reversible tag for a secret, for logs and `token list`.

    For capability tokens it is a prefix of the stored sha256, so a log line can be matched to a
    token record without ever showing the token.
    """
    data = secret.encode("utf-8") if isinstance(secret, str) else secret
    return "sha256:" + hashlib.sha256(data).hexdigest()[:12]


def _token_hash(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def match_token(records: Iterable[TokenRecord], token: str) -> TokenRecord | None:
    """The record whose hash is the presented token's, or None. Compares with every stored hash
    via hmac.compare_digest and never stops early, so timing says nothing about which (or
    whether a) record matched."""
    presented = _token_hash(token)
    found: TokenRecord | None = None
    for rec in records:
        if hmac.compare_digest(rec.hash, presented):
            found = rec
    return found


# ── durations ──────────────────────────────────────────────────────────────────────────────────

_DURATION_RE = re.compile(r"^\s*(\d+)\s*([smhdw])\s*$", re.IGNORECASE | re.ASCII)
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
# The longest lifetime a token may have: longer is not a lifetime anyone means, and an expiry far
# enough out stops being a date (`token list` could not print it; float() overflows on 400 digits).
MAX_TOKEN_LIFETIME_S = 36500 * 86400  # 100 years
_MAX_DIGITS = 12  # more digits than this is beyond MAX_TOKEN_LIFETIME_S in every unit


def parse_duration(text: str) -> float | None:
    """`30d`, `12h`, `45m`, `2w`, `90s` → seconds; `never`/`none` → None (no expiry).

    An empty value or a bare `0` is refused rather than read as "never": either could be a typo or
    an unset shell variable, and must not silently mint a token that never expires. A lifetime
    beyond MAX_TOKEN_LIFETIME_S is refused before anything is stored.
    """
    t = text.strip().lower()
    if t in ("never", "none"):
        return None
    if t in ("", "0"):
        raise ValueError(f"invalid duration {shown(text, 40)}: give e.g. 30d, 12h, 45m, 2w, or never for no expiry")
    m = _DURATION_RE.match(t)
    if not m:
        raise ValueError(f"invalid duration {shown(text, 40)}: expected e.g. 30d, 12h, 45m, 2w or never")
    digits = m.group(1).lstrip("0")
    if not digits:
        raise ValueError(f"invalid duration {shown(text, 40)}: expected e.g. 30d, 12h, 45m, 2w or never")
    seconds = int(digits) * _UNIT_S[m.group(2).lower()] if len(digits) <= _MAX_DIGITS else None
    if seconds is None or seconds > MAX_TOKEN_LIFETIME_S:
        raise ValueError(
            f"invalid duration {shown(text, 40)}: at most {MAX_TOKEN_LIFETIME_S // 86400}d (100 years), or never"
        )
    return float(seconds)


def parse_scopes(value: str | Iterable[str] | None) -> frozenset[str]:
    """Comma/space-separated or a list → a validated set of scopes (ValueError on unknown)."""
    if value is None:
        return frozenset(DEFAULT_TOKEN_SCOPES)
    items = re.split(r"[,\s]+", value) if isinstance(value, str) else list(value)
    out = {s.strip().lower() for s in items if s and s.strip()}
    unknown = out - set(SCOPES)
    if unknown:
        raise ValueError(f"unknown scope(s) {', '.join(sorted(unknown))}; expected {', '.join(SCOPES)}")
    if not out:
        raise ValueError(f"at least one scope is needed: {', '.join(SCOPES)}")
    return frozenset(out)


def parse_agents(value: str | Iterable[str] | None) -> frozenset[str] | None:
    """Comma-separated or a list → set of agent ids/names; None (not given) or `*` alone → all agents.

    Only those two spellings mean "all": a value that names no agent (`""`, `" , "`, an empty list,
    an unset shell variable) or mixes `*` with names is refused, since reading it as "all" would
    silently widen what the token grants.
    """
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else list(value)
    if not all(isinstance(a, str) for a in items):
        raise ValueError("agents must be strings (agent ids or names)")
    out = {a.strip() for a in items if a.strip()}
    if not out:
        raise ValueError("--agents names no agent: give agent ids or names (a,b), or '*' for all agents")
    if "*" in out:
        if len(out) > 1:
            raise ValueError("--agents: '*' (all agents) cannot be combined with agent ids or names")
        return None
    return frozenset(out)


def check_token_name(name: str) -> str:
    """A name `token create` may give (stripped), else ValueError: 1-64 of letters, digits and
    `._@-`, and none of the names reserved for the channel gateway."""
    name = name.strip()
    if not name or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}", name):
        raise ValueError("token name must be 1-64 characters: letters, digits, '.', '_', '@', '-'")
    if is_reserved_name(name):
        raise ValueError(reserved_name_error(name))
    return name


def _old_gateway_shape(r: TokenRecord) -> bool:
    """What the gateway's credential looked like before it was marked (scopes `ws` alone, every
    agent, no expiry): one left behind by an older server of this home that was killed."""
    return r.id.startswith(USER_ID_PREFIX) and r.scopes == ("ws",) and r.agents is None and r.expires_at is None


# ── capability tokens ──────────────────────────────────────────────────────────────────────────


@dataclass(frozen=True, slots=True)
class TokenRecord:
    """What `tokens.json` holds for one token: never the token, only its sha256."""

    id: str
    name: str
    hash: str
    agents: tuple[str, ...] | None
    scopes: tuple[str, ...]
    created_at: float
    expires_at: float | None

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "hash": self.hash,
            "agents": list(self.agents) if self.agents is not None else None,
            "scopes": list(self.scopes),
            "created_at": self.created_at,
            "expires_at": self.expires_at,
        }

    def public(self) -> dict[str, Any]:
        """For `token list --json`: everything but the hash, plus a fingerprint."""
        d = self.to_json()
        d.pop("hash")
        d["fingerprint"] = "sha256:" + self.hash[:12]
        d["expired"] = self.is_expired(time.time())
        return d

    def principal(self) -> Principal:
        """The caller a request presenting this token is: its subject, agents and scopes."""
        return Principal(
            subject=self.subject,
            kind="token",
            agents=frozenset(self.agents) if self.agents is not None else None,
            scopes=frozenset(self.scopes),
            expires_at=self.expires_at,
            token_id=self.id,
        )

    @property
    def is_gateway(self) -> bool:
        """Minted for the channel gateway (`TokenStore.mint_gateway`): its mark is its id."""
        return self.id.startswith(GATEWAY_ID_PREFIX) and is_reserved_name(self.name)

    @property
    def subject(self) -> str:
        """The subject of the principal this token authenticates as; its namespace is
        `token:<subject>` (appserver.auth.namespace_of). A token's namespace follows its name,
        except that a reserved name (`gateway`, `gateway@…`) gives the gateway's namespace only to
        the gateway's own credential: a token of that name made by an older appserver, which did
        not reserve it, gets a namespace of its own (`~` is in no token name, so it is nobody
        else's either)."""
        if is_reserved_name(self.name) and not self.is_gateway:
            return f"token:{self.name}~{self.id}"
        return f"token:{self.name}"

    def is_expired(self, now: float) -> bool:
        """Past its expiry. A stored expiry that is no number (NaN, hand-edited) counts as past:
        `now >= nan` is False, which would make the token live forever."""
        return self.expires_at is not None and not now < self.expires_at

    @classmethod
    def from_json(cls, d: Any) -> TokenRecord:
        """One entry of tokens.json (or a row of the tokens table), every field of its own type.
        Nothing is converted: read as text, `"id": null` became a token "None" that `revoke None`
        matched, `"agents": [5]` admitted an agent named "5" and `"expires_at": true` expired in
        1970. ValueError names the field; the caller names the entry and the file."""
        if not isinstance(d, dict):
            raise ValueError(f"not an object but {_json_kind(d)}")
        h = _field(d, "hash")
        if not re.fullmatch(r"[0-9a-f]{64}", h):
            raise ValueError("field 'hash' is not a sha256 hex digest")
        agents = d.get("agents")
        if agents is not None:
            agents = _strings(agents, "'agents' must be a list of agent ids or names, or null")
        scopes = _strings(d.get("scopes"), "'scopes' must be a list of scopes")
        try:
            scope_set = parse_scopes(scopes)
        except ValueError as exc:
            raise ValueError(f"field 'scopes': {exc}") from None
        return cls(
            id=_field(d, "id"),
            name=_field(d, "name"),
            hash=h,
            agents=tuple(agents) if agents is not None else None,
            scopes=tuple(sorted(scope_set)),
            # absent in files of older versions: the epoch, as it always was read
            created_at=_number(d, "created_at") or 0.0,
            expires_at=_number(d, "expires_at"),
        )


def _json_kind(value: Any) -> str:
    """What a JSON value is, in words, for an error that must not quote a whole damaged file."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    if isinstance(value, str):
        return f"the string {shown(value, 40)}"
    return "a list" if isinstance(value, list) else "an object"


def _strings(value: Any, rule: str) -> list[str]:
    """A list of strings, else ValueError saying `rule` and what is there instead."""
    if not isinstance(value, list):
        raise ValueError(f"field {rule}, not {_json_kind(value)}")
    for item in value:
        if not isinstance(item, str):
            raise ValueError(f"field {rule}, not a list holding {_json_kind(item)}")
    return value


def _field(d: dict[str, Any], key: str) -> str:
    """A required text field: present, a string and not empty."""
    if key not in d:
        raise ValueError(f"field {key!r} is missing")
    value = d[key]
    if not isinstance(value, str) or not value:
        raise ValueError(f"field {key!r} must be a non-empty string, not {_json_kind(value)}")
    return value


def _number(d: dict[str, Any], key: str) -> float | None:
    """An optional time: a JSON number (not true/false, which Python counts as 1 and 0) or null.
    NaN and an expiry no clock can show stay numbers (`is_expired` and `token list` deal with them)."""
    value = d.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"field {key!r} must be a number of seconds since the epoch or null, not {_json_kind(value)}")
    try:
        return float(value)
    except OverflowError:  # an integer too large for a float: no time
        raise ValueError(f"field {key!r} is out of range: {shown(str(value), 40)}") from None


def _parse_entries(entries: list[Any]) -> list[TokenRecord]:
    """Every entry, or ValueError naming the first bad one (its place and, when it has one, its
    id) and its field. Two entries with one id are damage too (ids are random: one was copied):
    `revoke ID` removes the first, and the copy would go on admitting the token it revoked."""
    records: list[TokenRecord] = []
    ids: set[str] = set()
    for n, entry in enumerate(entries):
        try:
            rec = TokenRecord.from_json(entry)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{_entry_name(n, entry)}: {exc}") from None
        if rec.id in ids:
            raise ValueError(f"{_entry_name(n, entry)}: an earlier token has the same id")
        ids.add(rec.id)
        records.append(rec)
    return records


def _entry_name(n: int, entry: Any) -> str:
    tid = entry.get("id") if isinstance(entry, dict) else None
    return f"token #{n + 1}" + (f" ({shown(tid, 70)})" if isinstance(tid, str) and tid else "")


class TokenStore:
    """Capability tokens in `$APPSERVER_HOME/auth/tokens.json` (0600, atomic, under a file lock).

    Only sha256 hashes are stored: a leaked file does not leak working tokens (they are 256-bit
    random, so an unsalted hash cannot be brute-forced). The file is re-read when it changes, so a
    `token revoke` in another process takes effect in a running server at the next request.
    """

    def __init__(self, home: Path) -> None:
        self.dir = Path(home) / "auth"
        self.path = self.dir / "tokens.json"
        self._lock = FileLock(str(self.dir / "tokens.json.lock"))
        self._cache_key: tuple[int, int, int] | None = None
        self._cache: list[TokenRecord] = []
        self._checked_at = 0.0  # monotonic time of the last stat by `live`
        self._refused: str | None = None  # the last refusal `verify`/`live` logged, logged once

    # reading
    def _parse(self, data: Any) -> list[TokenRecord]:
        self._check_version(data)
        if not isinstance(data, dict) or not isinstance(data.get("tokens"), list):
            raise ValueError("expected an object with a 'tokens' list")
        return _parse_entries(data["tokens"])

    def _check_version(self, data: Any) -> None:
        """A newer format is refused and left alone: read as version 1, its unknown fields would be
        dropped by the next write, and a field that limits a token would be ignored."""
        version = data.get("version") if isinstance(data, dict) else None
        if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION:
            raise StateFileRefused(
                self.path,
                f"format version {version}, newer than this appserver understands ({FORMAT_VERSION}); "
                "upgrade appserver (the file was left as it is)",
            )

    def _read(self) -> list[TokenRecord]:
        """Parse the file; unreadable → moved aside and CorruptStateFile raised (never emptied).
        Not a regular file, a link to nothing or a newer format: StateFileRefused, left in place."""
        data = read_json_or_move_aside(self.path, TOKENS_MAX_BYTES)
        if data is None:
            return []
        try:
            return self._parse(data)
        except (KeyError, TypeError, ValueError) as exc:
            raise move_aside(self.path, f"invalid token file: {exc}") from None

    def _records(self) -> list[TokenRecord]:
        """Cached read keyed by (inode, size, mtime): cheap enough to call on every request."""
        st = state_file_stat(self.path)  # a link to nothing: StateFileRefused, never "no tokens"
        if st is None:
            self._cache_key, self._cache = None, []
            return []
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        if key != self._cache_key:
            self._cache = self._read()
            self._cache_key = key
        return self._cache

    def _write(self, records: list[TokenRecord]) -> None:
        ensure_private_dir(self.dir)
        atomic_write_json(self.path, {"version": FORMAT_VERSION, "tokens": [r.to_json() for r in records]}, 0o600)
        self._cache_key = None

    def _locked(self) -> FileLock:
        ensure_private_dir(self.dir)
        return self._lock

    # public API
    def create(
        self,
        name: str | None = None,
        agents: Iterable[str] | str | None = None,
        scopes: Iterable[str] | str | None = None,
        expires: float | str | None = None,
    ) -> tuple[TokenRecord, str]:
        """Mint a token; returns (record, plaintext). The plaintext is never stored or logged.

        `expires` is seconds from now, a duration string (`30d`) or None (never).
        """
        scope_set = parse_scopes(scopes)
        agent_set = parse_agents(agents)
        ttl = parse_duration(expires) if isinstance(expires, str) else expires
        if ttl is not None and not 0 < ttl <= MAX_TOKEN_LIFETIME_S:  # also refuses NaN
            raise ValueError(f"expiry must be in the future and at most {MAX_TOKEN_LIFETIME_S // 86400}d away")
        if name is not None:
            name = check_token_name(name)
        rec, plaintext, _ = self._mint(name, agent_set, scope_set, ttl, gateway=False)
        return rec, plaintext

    def mint_gateway(
        self, name: str, scopes: Iterable[str] | str = "ws"
    ) -> tuple[TokenRecord, str, TokenRecord | None]:
        """The channel gateway's credential, named `name` (a reserved name), replacing the one a
        server of this home left behind (killed before it could revoke it). Returns (record,
        plaintext, the replaced record or None). A token of that name the gateway did not mint
        (made by an older appserver, which did not reserve the name) is replaced only when it
        has exactly the shape the gateway's credential had then (scopes `ws`, every agent, no
        expiry) and the caller is told (it logs it); any other raises ReservedNameTaken and
        nothing is changed."""
        if not is_reserved_name(name):
            raise ValueError(f"{name!r} is not a name of the channel gateway's credential")
        rec, plaintext, replaced = self._mint(name, None, parse_scopes(scopes), None, gateway=True)
        return rec, plaintext, replaced

    def _mint(
        self,
        name: str | None,
        agent_set: frozenset[str] | None,
        scope_set: frozenset[str],
        ttl: float | None,
        *,
        gateway: bool,
    ) -> tuple[TokenRecord, str, TokenRecord | None]:
        plaintext = TOKEN_PREFIX + secrets.token_urlsafe(32)
        now = time.time()
        tid = (GATEWAY_ID_PREFIX if gateway else USER_ID_PREFIX) + secrets.token_hex(6)
        replaced: TokenRecord | None = None
        try:
            with self._locked().acquire(timeout=LOCK_TIMEOUT_S):
                records = self._read()
                if name is None:
                    name = tid
                if gateway:
                    for r in records:
                        if r.name != name:
                            continue
                        if not (r.is_gateway or _old_gateway_shape(r)):
                            raise ReservedNameTaken(r)
                        replaced = r
                    records = [r for r in records if r is not replaced]
                if any(r.name == name or r.id == name for r in records):
                    raise ValueError(f"a token named {name!r} already exists; revoke it or pick another name")
                rec = TokenRecord(
                    id=tid,
                    name=name,
                    hash=_token_hash(plaintext),
                    agents=tuple(sorted(agent_set)) if agent_set is not None else None,
                    scopes=tuple(sorted(scope_set)),
                    created_at=now,
                    expires_at=now + ttl if ttl is not None else None,
                )
                self._write([*records, rec])
        except Timeout:
            raise RuntimeError(f"could not lock {self.path} within {LOCK_TIMEOUT_S:.0f} s") from None
        if replaced is not None:
            log.info("revoked token %s (%s)", replaced.id, replaced.name)
        log.info("created token %s (%s) %s", rec.id, rec.name, fingerprint(plaintext))
        return rec, plaintext, replaced

    def reserved_name_holders(self) -> list[TokenRecord]:
        """Tokens that carry a name reserved for the gateway without being its credential (made
        by an older appserver): each has a namespace of its own, not the gateway's."""
        return [r for r in self._records() if is_reserved_name(r.name) and not r.is_gateway]

    def close(self) -> None:
        """Let go of what the store holds open (a database connection; the file store: nothing)."""

    def list(self) -> list[TokenRecord]:
        return list(self._read())

    def unreadable(self) -> str | None:
        """Why tokens.json cannot be used, without moving it (a reader's look: `token list`, and
        the checks `token create` and `revoke` make before they write); None when it is fine or
        missing. A database-backed store has no file: always None. What is never moved aside (not a
        regular file, a link to nothing, a newer format) raises StateFileRefused instead."""
        if self.path != self.dir / "tokens.json":  # PgTokenStore: rows in a table
            return None
        try:
            raw = read_state_bytes(self.path, TOKENS_MAX_BYTES)
        except FileNotFoundError:
            return None
        except StateFileTooLarge as exc:
            return exc.reason
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            return "invalid JSON: nested too deeply" if isinstance(exc, RecursionError) else f"invalid JSON: {exc}"
        if not isinstance(data, dict):
            return "expected a JSON object with a 'tokens' list"
        try:
            self._parse(data)
        except (KeyError, TypeError, ValueError) as exc:
            return f"invalid token file: {exc}"
        return None

    def set_aside_unreadable(self) -> CorruptStateFile | None:
        """Move an unusable tokens.json aside so that a new file can start (`token create
        --start-new-file`, the operator's explicit choice); None when there was nothing to move.
        Quiet: the caller tells the operator where it went."""
        try:
            with self._locked().acquire(timeout=LOCK_TIMEOUT_S):
                reason = self.unreadable()
                return None if reason is None else move_aside(self.path, reason, quiet=True)
        except Timeout:
            raise RuntimeError(f"could not lock {self.path} within {LOCK_TIMEOUT_S:.0f} s") from None

    def revoke(self, id_or_name: str) -> TokenRecord:
        """Delete a token by id or name; KeyError if there is none. Effective immediately."""
        try:
            with self._locked().acquire(timeout=LOCK_TIMEOUT_S):
                records = self._read()
                hit = [r for r in records if r.id == id_or_name] or [r for r in records if r.name == id_or_name]
                if not hit:
                    raise KeyError(id_or_name)
                self._write([r for r in records if r is not hit[0]])
        except Timeout:
            raise RuntimeError(f"could not lock {self.path} within {LOCK_TIMEOUT_S:.0f} s") from None
        log.info("revoked token %s (%s)", hit[0].id, hit[0].name)
        return hit[0]

    def check(self) -> None:
        """Read the file once at start: a damaged one is moved aside with a loud error then, and
        shown by /readyz, not found by the first request that presents a token. One that is never
        moved aside (StateFileRefused: not a regular file, a link to nothing, a newer format) ends
        the start: a server that refused every token without a word would look healthy."""
        with contextlib.suppress(CorruptStateFile):
            self._warn_reserved()

    def _warn_reserved(self) -> None:
        """Say at start which tokens hold a name reserved for the gateway without being its own."""
        for r in self.reserved_name_holders():
            log.warning(
                "token %s is named %r, a name reserved for the channel gateway's credential since this "
                "version: it no longer sees the gateway's conversations (its namespace is token:%s); revoke "
                "it and create it again under another name%s",
                r.id,
                r.name,
                r.subject,
                " (or, if it is the credential an older server's gateway left behind, the next start with "
                "channels replaces it)"
                if _old_gateway_shape(r)
                else "",
            )

    def _note_refused(self, exc: StateFileRefused) -> None:
        """Log a refusal of the token file (every token is then refused) once, not at every request."""
        text = str(exc)
        if text != self._refused:
            log.error("every token is refused: %s", text)
            self._refused = text

    def live(self, token_id: str, *, max_age_s: float = 0.0) -> bool:
        """Is the token with this id still in the file (not revoked)? Re-checks the file when the
        last check is older than `max_age_s`, so many sockets polling cost one `stat` per period.
        A token file set aside as corrupt revokes everything, as `verify` denies everything."""
        now = time.monotonic()
        if self._cache_key is None or now - self._checked_at >= max_age_s:
            try:
                records = self._records()
            except CorruptStateFile:
                return False
            except StateFileRefused as exc:
                self._note_refused(exc)
                return False
            self._refused = None
            self._checked_at = now
        else:
            records = self._cache
        return any(r.id == token_id for r in records)

    def verify(self, token: str, *, since: float | None = None) -> Principal | None:
        """The principal for a valid, unexpired token, else None (`match_token`: in constant time).

        `since`: for a store that holds its records in memory (auth/pgtokens.py), which may raise
        `TokensStale` instead of answering; this file is read whenever it changed, never stale.
        """
        try:
            records = self._records()
        except CorruptStateFile:
            return None  # already logged loudly and moved aside; deny rather than guess
        except StateFileRefused as exc:
            self._note_refused(exc)
            return None  # left in place (a FIFO, a link to an unmounted disk, a newer format): deny
        self._refused = None
        found = match_token(records, token)
        if found is None:
            return None
        if found.is_expired(time.time()):
            return None
        return found.principal()
