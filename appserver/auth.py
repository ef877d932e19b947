"""Who is calling: principals, capability tokens, JWT bearer verification, the Authenticator.

Nothing here knows about HTTP or WebSocket framing: the guard (`appserver.http.guard`) and the
protocol layer call `Authenticator.authenticate(header)` / `authenticate_hello(token)` and get a
`Principal` or a typed `AuthError` carrying the status and the OpenAI error code to answer with.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jwt
from filelock import FileLock, Timeout

from appserver.config import AuthConfig, Config, ConfigError
from appserver.fsutil import (
    CorruptStateFile,
    atomic_write_json,
    ensure_private_dir,
    move_aside,
    read_json_or_move_aside,
)

log = logging.getLogger("appserver.auth")

SCOPES: tuple[str, ...] = ("openai", "ws", "admin")
DEFAULT_TOKEN_SCOPES: tuple[str, ...] = ("openai", "ws")
TOKEN_PREFIX = "aps_"
HELLO_TIMEOUT_S = 5.0
LOCK_TIMEOUT_S = 10.0
HS_MIN_SECRET_BYTES = 32
REVOCATION_POLL_S = 0.5  # how often a live WebSocket's capability token is re-checked

_HS_ALGS = frozenset({"HS256", "HS384", "HS512"})
_RSA_ALGS = frozenset({"RS256", "RS384", "RS512", "PS256", "PS384", "PS512"})
_EC_ALGS = frozenset({"ES256", "ES384", "ES512"})
_TOKEN68 = re.compile(r"^[A-Za-z0-9\-._~+/]+=*$")
_CONTROL_CHARS = re.compile("[\x00-\x1f\x7f]")


def fingerprint(secret: str | bytes) -> str:
    """A short, stable, non-reversible tag for a secret, for logs and `token list`.

    For capability tokens it is a prefix of the stored sha256, so a log line can be matched to a
    token record without ever showing the token.
    """
    data = secret.encode("utf-8") if isinstance(secret, str) else secret
    return "sha256:" + hashlib.sha256(data).hexdigest()[:12]


def _token_hash(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


# ── principal ──────────────────────────────────────────────────────────────────────────────────


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated caller and what it may touch.

    `agents` None means every agent; otherwise a set of agent ids and/or names. `expires_at` is a
    Unix time (None: never); a live WebSocket is closed when it passes (for a JWT: when it plus
    the leeway passes, see `Authenticator.valid_until`).
    """

    subject: str
    kind: str  # none | token | jwt
    agents: frozenset[str] | None = None
    scopes: frozenset[str] = frozenset(SCOPES)
    expires_at: float | None = None
    token_id: str | None = None
    claims: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @classmethod
    def local(cls) -> Principal:
        """The principal of auth mode `none` (loopback only): every agent, every scope."""
        return cls(subject="local", kind="none")

    def allows_agent(self, agent_id: str, agent_name: str | None = None) -> bool:
        if self.agents is None:
            return True
        return agent_id in self.agents or (agent_name is not None and agent_name in self.agents)

    def has_scope(self, scope: str) -> bool:
        return scope in self.scopes

    def is_expired(self, now: float | None = None) -> bool:
        return (
            self.expires_at is not None
            and (now if now is not None else time.time()) >= self.expires_at
        )


# ── namespaces: the one conversation-ownership rule of every front end ─────────────────────────


def namespace_of(principal: Principal) -> str:
    """The caller's identity as stored with what it creates (conversations, idempotency scopes)."""
    return f"{principal.kind}:{principal.subject}"


def sees_all(principal: Principal) -> bool:
    """The local owner (auth mode none) and `admin` credentials see every conversation."""
    return principal.kind == "none" or principal.has_scope("admin")


def conversation_namespace(principal: Principal) -> str | None:
    """The namespace a caller's conversations are created in and looked up by; None means "sees
    every conversation", and what such a caller creates is unowned (namespace NULL), like the
    conversations of the CLI, of cron and an agent's shared default conversation."""
    return None if sees_all(principal) else namespace_of(principal)


def namespace_allows(caller: str | None, owner: str | None) -> bool:
    """THE rule, for HTTP, WebSocket and cron targets alike: a caller sees and uses a conversation
    only when it is in the caller's own namespace; `caller` None (admin, local) sees all, and an
    unowned conversation (`owner` None) is seen by nobody else. Refusals must look like "not
    found", so a credential learns nothing about conversations it may not use."""
    return caller is None or owner == caller


class AuthError(Exception):
    """Authentication or authorisation failed; `status` and `code` say how to answer."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


def _unauthorized(code: str, message: str) -> AuthError:
    return AuthError(401, code, message)


# ── durations ──────────────────────────────────────────────────────────────────────────────────

_DURATION_RE = re.compile(r"^\s*(\d+)\s*([smhdw])\s*$", re.IGNORECASE)
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> float | None:
    """`30d`, `12h`, `45m`, `2w`, `90s` → seconds; `never`/`none`/`0` → None (no expiry)."""
    t = text.strip().lower()
    if t in ("never", "none", "0", ""):
        return None
    m = _DURATION_RE.match(t)
    if not m or int(m.group(1)) <= 0:
        raise ValueError(f"invalid duration {text!r}: expected e.g. 30d, 12h, 45m, 2w or never")
    return float(int(m.group(1)) * _UNIT_S[m.group(2).lower()])


def parse_scopes(value: str | Iterable[str] | None) -> frozenset[str]:
    """Comma/space-separated or a list → a validated set of scopes (ValueError on unknown)."""
    if value is None:
        return frozenset(DEFAULT_TOKEN_SCOPES)
    items = re.split(r"[,\s]+", value) if isinstance(value, str) else list(value)
    out = {s.strip().lower() for s in items if s and s.strip()}
    unknown = out - set(SCOPES)
    if unknown:
        raise ValueError(
            f"unknown scope(s) {', '.join(sorted(unknown))}; expected {', '.join(SCOPES)}"
        )
    if not out:
        raise ValueError(f"at least one scope is needed: {', '.join(SCOPES)}")
    return frozenset(out)


def parse_agents(value: str | Iterable[str] | None) -> frozenset[str] | None:
    """Comma-separated or a list → set of agent ids/names; None/empty/`*` → all agents."""
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else list(value)
    out = {a.strip() for a in items if isinstance(a, str) and a.strip()}
    if not out or "*" in out:
        return None
    return frozenset(out)


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
        d["expired"] = self.expires_at is not None and time.time() >= self.expires_at
        return d

    @classmethod
    def from_json(cls, d: Any) -> TokenRecord:
        if not isinstance(d, dict):
            raise ValueError("token entry is not an object")
        h = d["hash"]
        if not isinstance(h, str) or not re.fullmatch(r"[0-9a-f]{64}", h):
            raise ValueError("token hash is not a sha256 hex digest")
        agents = d.get("agents")
        exp = d.get("expires_at")
        return cls(
            id=str(d["id"]),
            name=str(d["name"]),
            hash=h,
            agents=tuple(str(a) for a in agents) if agents is not None else None,
            scopes=tuple(sorted(parse_scopes(d.get("scopes") or []))),
            created_at=float(d.get("created_at") or 0.0),
            expires_at=float(exp) if exp is not None else None,
        )


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

    # reading
    def _parse(self, data: Any) -> list[TokenRecord]:
        if not isinstance(data, dict) or not isinstance(data.get("tokens"), list):
            raise ValueError("expected an object with a 'tokens' list")
        return [TokenRecord.from_json(t) for t in data["tokens"]]

    def _read(self) -> list[TokenRecord]:
        """Parse the file; unreadable → moved aside and CorruptStateFile raised (never emptied)."""
        data = read_json_or_move_aside(self.path)
        if data is None:
            return []
        try:
            return self._parse(data)
        except (KeyError, TypeError, ValueError) as exc:
            raise move_aside(self.path, f"invalid token file: {exc}") from None

    def _records(self) -> list[TokenRecord]:
        """Cached read keyed by (inode, size, mtime): cheap enough to call on every request."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            self._cache_key, self._cache = None, []
            return []
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        if key != self._cache_key:
            self._cache = self._read()
            self._cache_key = key
        return self._cache

    def _write(self, records: list[TokenRecord]) -> None:
        ensure_private_dir(self.dir)
        atomic_write_json(
            self.path, {"version": 1, "tokens": [r.to_json() for r in records]}, 0o600
        )
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
        if ttl is not None and ttl <= 0:
            raise ValueError("expiry must be in the future")
        plaintext = TOKEN_PREFIX + secrets.token_urlsafe(32)
        now = time.time()
        tid = "tok_" + secrets.token_hex(6)
        if name is not None:
            name = name.strip()
            if not name or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}", name):
                raise ValueError(
                    "token name must be 1-64 characters: letters, digits, '.', '_', '@', '-'"
                )
        try:
            with self._locked().acquire(timeout=LOCK_TIMEOUT_S):
                records = self._read()
                if name is None:
                    name = tid
                if any(r.name == name or r.id == name for r in records):
                    raise ValueError(
                        f"a token named {name!r} already exists; revoke it or pick another name"
                    )
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
            raise RuntimeError(
                f"could not lock {self.path} within {LOCK_TIMEOUT_S:.0f} s"
            ) from None
        log.info("created token %s (%s) %s", rec.id, rec.name, fingerprint(plaintext))
        return rec, plaintext

    def list(self) -> list[TokenRecord]:
        return list(self._read())

    def revoke(self, id_or_name: str) -> TokenRecord:
        """Delete a token by id or name; KeyError if there is none. Effective immediately."""
        try:
            with self._locked().acquire(timeout=LOCK_TIMEOUT_S):
                records = self._read()
                hit = [r for r in records if r.id == id_or_name] or [
                    r for r in records if r.name == id_or_name
                ]
                if not hit:
                    raise KeyError(id_or_name)
                self._write([r for r in records if r is not hit[0]])
        except Timeout:
            raise RuntimeError(
                f"could not lock {self.path} within {LOCK_TIMEOUT_S:.0f} s"
            ) from None
        log.info("revoked token %s (%s)", hit[0].id, hit[0].name)
        return hit[0]

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
            self._checked_at = now
        else:
            records = self._cache
        return any(r.id == token_id for r in records)

    def verify(self, token: str) -> Principal | None:
        """The principal for a valid, unexpired token, else None.

        Compares the presented token's hash with every stored hash via hmac.compare_digest and
        never stops early, so timing says nothing about which (or whether a) record matched.
        """
        try:
            records = self._records()
        except CorruptStateFile:
            return None  # already logged loudly and moved aside; deny rather than guess
        presented = _token_hash(token)
        found: TokenRecord | None = None
        for rec in records:
            if hmac.compare_digest(rec.hash, presented):
                found = rec
        if found is None:
            return None
        if found.expires_at is not None and time.time() >= found.expires_at:
            return None
        return Principal(
            subject=f"token:{found.name}",
            kind="token",
            agents=frozenset(found.agents) if found.agents is not None else None,
            scopes=frozenset(found.scopes),
            expires_at=found.expires_at,
            token_id=found.id,
        )


# ── JWT ────────────────────────────────────────────────────────────────────────────────────────


def _claim_set(value: Any, claim: str) -> frozenset[str]:
    if isinstance(value, str):
        items = re.split(r"[,\s]+", value)
    elif isinstance(value, list) and all(isinstance(v, str) for v in value):
        items = value
    else:
        raise _unauthorized(
            "invalid_token", f"JWT claim {claim!r} must be a string or a list of strings"
        )
    return frozenset(i.strip() for i in items if i.strip())


class JwtVerifier:
    """Verifies bearer JWTs with the algorithms pinned by config; keys are loaded once, eagerly.

    Pinning one key family (HMAC or RSA or EC) rules out algorithm confusion: a public RSA key can
    never be used as an HMAC secret, and `alg: none` is never in the list.
    """

    def __init__(self, cfg: AuthConfig, base_dir: Path | None = None) -> None:
        self.issuer = cfg.jwt_issuer
        self.audience = cfg.jwt_audience
        self.leeway = float(cfg.jwt_leeway_s)
        if self.leeway < 0:
            raise ConfigError("[auth] jwt_leeway_s must be ≥ 0")
        if cfg.jwt_secret_file and cfg.jwt_public_key_file:
            raise ConfigError(
                "[auth] set either jwt_secret_file (HS256) or jwt_public_key_file (RS256/ES256), not both"
            )
        algs = [a.strip().upper() for a in cfg.jwt_algorithms if a.strip()]
        if "NONE" in algs:
            raise ConfigError("[auth] jwt_algorithms must not contain 'none'")
        self.key: Any
        if cfg.jwt_secret_file:
            algs = algs or ["HS256"]
            bad = [a for a in algs if a not in _HS_ALGS]
            if bad:
                raise ConfigError(
                    f"[auth] jwt_secret_file needs HMAC algorithms (HS256); got {', '.join(bad)}"
                )
            secret = self._read_file(cfg.jwt_secret_file, base_dir, "jwt_secret_file").rstrip(
                b"\r\n"
            )
            if len(secret) < HS_MIN_SECRET_BYTES:
                raise ConfigError(
                    f"[auth] jwt_secret_file holds {len(secret)} bytes; HS256 needs a secret of at least "
                    f"{HS_MIN_SECRET_BYTES} bytes (e.g. `openssl rand -base64 48 > secret`)"
                )
            self.key = secret
        elif cfg.jwt_public_key_file:
            from cryptography.hazmat.primitives.asymmetric import ec, rsa
            from cryptography.hazmat.primitives.serialization import load_pem_public_key

            pem = self._read_file(cfg.jwt_public_key_file, base_dir, "jwt_public_key_file")
            if b"PRIVATE KEY" in pem:
                raise ConfigError(
                    "[auth] jwt_public_key_file holds a private key; give the server only the public key"
                )
            try:
                key = load_pem_public_key(pem)
            except ValueError as exc:
                raise ConfigError(
                    f"[auth] jwt_public_key_file is not a PEM public key: {exc}"
                ) from None
            if isinstance(key, rsa.RSAPublicKey):
                family, default = _RSA_ALGS, "RS256"
                if key.key_size < 2048:
                    raise ConfigError(
                        "[auth] jwt_public_key_file: RSA keys must be at least 2048 bits"
                    )
            elif isinstance(key, ec.EllipticCurvePublicKey):
                family, default = (
                    _EC_ALGS,
                    {"secp256r1": "ES256", "secp384r1": "ES384", "secp521r1": "ES512"}.get(
                        key.curve.name, "ES256"
                    ),
                )
            else:
                raise ConfigError("[auth] jwt_public_key_file must be an RSA or EC public key")
            algs = algs or [default]
            bad = [a for a in algs if a not in family]
            if bad:
                raise ConfigError(
                    f"[auth] jwt_algorithms {', '.join(bad)} do not match the {type(key).__name__} "
                    f"in jwt_public_key_file"
                )
            self.key = key
        else:
            raise ConfigError(
                '[auth] mode = "jwt" needs jwt_secret_file (HS256) or jwt_public_key_file (RS256/ES256)'
            )
        self.algorithms = algs

    @staticmethod
    def _read_file(name: str, base_dir: Path | None, key: str) -> bytes:
        path = Path(name).expanduser()
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ConfigError(f"[auth] {key}: cannot read {path}: {exc.strerror}") from None
        try:
            if key == "jwt_secret_file" and os.stat(path).st_mode & 0o077:
                log.warning("%s is readable by group/others; chmod 600 it", path)
        except OSError:
            pass
        return data

    def secrets(self) -> list[str]:
        """Secret material the log filter should redact (the HMAC secret, if any)."""
        if isinstance(self.key, bytes):
            try:
                return [self.key.decode("utf-8")]
            except UnicodeDecodeError:
                return []
        return []

    def verify(self, token: str) -> Principal:
        try:
            header = jwt.get_unverified_header(token)
        except jwt.DecodeError:
            raise _unauthorized("invalid_token", "malformed JWT") from None
        alg = header.get("alg")
        if not isinstance(alg, str) or alg not in self.algorithms:
            raise _unauthorized(
                "invalid_token",
                f"JWT algorithm {alg!r} is not allowed (pinned: {', '.join(self.algorithms)})",
            )
        # `sub` is the caller's identity: its conversation namespace (`jwt:jwt:SUB`). Without it
        # every such JWT would share one namespace, and so each other's conversations.
        required = ["exp", "sub"] + (["iss"] if self.issuer else []) + (["aud"] if self.audience else [])
        try:
            claims = jwt.decode(
                token,
                self.key,
                algorithms=self.algorithms,
                audience=self.audience,
                issuer=self.issuer,
                leeway=self.leeway,
                options={"require": required, "verify_signature": True},
            )
        except jwt.ExpiredSignatureError:
            raise _unauthorized("token_expired", "JWT has expired") from None
        except jwt.ImmatureSignatureError:
            raise _unauthorized(
                "invalid_token", "JWT is not valid yet (nbf/iat in the future)"
            ) from None
        except jwt.InvalidAudienceError:
            raise _unauthorized("invalid_token", "JWT audience does not match") from None
        except jwt.InvalidIssuerError:
            raise _unauthorized("invalid_token", "JWT issuer does not match") from None
        except jwt.MissingRequiredClaimError as exc:
            raise _unauthorized(
                "invalid_token", f"JWT lacks the required claim {exc.claim!r}"
            ) from None
        except jwt.InvalidSignatureError:
            raise _unauthorized("invalid_token", "JWT signature is invalid") from None
        except jwt.InvalidTokenError as exc:
            raise _unauthorized("invalid_token", f"invalid JWT: {type(exc).__name__}") from None
        agents: frozenset[str] | None = None
        if "agents" in claims:
            agents = _claim_set(claims["agents"], "agents")
            if "*" in agents:
                agents = None
        scopes = frozenset(SCOPES)
        for key in ("scope", "scopes"):
            if key in claims:
                scopes = _claim_set(claims[key], key) & frozenset(SCOPES)
                break
        sub = claims.get("sub")
        if not isinstance(sub, str) or not sub.strip() or len(sub) > 256 or _CONTROL_CHARS.search(sub):
            raise _unauthorized("invalid_token", "JWT claim 'sub' must be a non-empty string of printable characters (at most 256)")
        return Principal(
            subject=f"jwt:{sub}",
            kind="jwt",
            agents=agents,
            scopes=scopes,
            expires_at=float(claims["exp"]),
            claims=claims,
        )


# ── authenticator ──────────────────────────────────────────────────────────────────────────────


class Authenticator:
    """Turns credentials into a Principal for the configured mode (none | token | jwt).

    Built once at startup; key material is loaded here so a bad config fails `serve` early.
    """

    hello_timeout_s: float = HELLO_TIMEOUT_S

    def __init__(self, config: Config, token_store: TokenStore | None = None) -> None:
        self.mode = config.auth.mode
        if self.mode not in ("none", "token", "jwt"):
            raise ConfigError(f"[auth] mode must be none, token or jwt; got {self.mode!r}")
        self.tokens: TokenStore | None = None
        self.jwt: JwtVerifier | None = None
        if self.mode == "token":
            self.tokens = token_store or TokenStore(config.home)
        elif self.mode == "jwt":
            self.jwt = JwtVerifier(config.auth, base_dir=config.home)

    @property
    def required(self) -> bool:
        return self.mode != "none"

    def secrets(self) -> list[str]:
        """Configured secrets the log redactor should know about."""
        return self.jwt.secrets() if self.jwt else []

    def valid_until(self, principal: Principal) -> float | None:
        """When a live connection authenticated as `principal` must end (Unix time; None: never).

        A JWT stays valid for `jwt_leeway_s` past its `exp`: that is the instant a new request
        with the same JWT starts failing, so a socket closed any earlier could simply reconnect.
        A capability token's expiry is our own clock: no leeway.
        """
        if principal.expires_at is None:
            return None
        if principal.kind == "jwt" and self.jwt is not None:
            return principal.expires_at + self.jwt.leeway
        return principal.expires_at

    def revoked(self, principal: Principal, *, max_age_s: float = 0.0) -> bool:
        """Has the credential behind a live connection been revoked since it authenticated?

        Capability tokens only (`appserver token revoke`, from any process: the token file is
        re-read when it changes); a JWT cannot be revoked, it ends at its expiry.
        """
        if self.tokens is None or principal.kind != "token" or principal.token_id is None:
            return False
        return not self.tokens.live(principal.token_id, max_age_s=max_age_s)

    def authenticate(self, authorization: str | None) -> Principal:
        """From an `Authorization` header value (None if absent) → Principal, or AuthError."""
        if self.mode == "none":
            return Principal.local()
        if authorization is None or not authorization.strip():
            raise _unauthorized(
                "missing_api_key", "authentication required: send Authorization: Bearer <token>"
            )
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer":
            raise _unauthorized("invalid_api_key", "unsupported authorization scheme; use Bearer")
        return self.verify_token(token.strip())

    def authenticate_hello(self, token: str | None) -> Principal:
        """For the WebSocket `hello {token}` frame: the same check as a Bearer header."""
        if self.mode == "none":
            return Principal.local()
        if not isinstance(token, str) or not token.strip():
            raise _unauthorized("missing_api_key", "authentication required: send a token in hello")
        tok = token.strip()
        if tok[:7].lower() == "bearer ":
            tok = tok[7:].strip()
        return self.verify_token(tok)

    def verify_token(self, token: str) -> Principal:
        if not token or len(token) > 8192 or not _TOKEN68.match(token):
            raise _unauthorized("invalid_api_key", "malformed bearer token")
        if self.mode == "token":
            assert self.tokens is not None
            p = self.tokens.verify(token)
            if p is None:
                log.info("rejected capability token %s", fingerprint(token))
                raise _unauthorized("invalid_api_key", "invalid, expired or revoked token")
            return p
        if self.mode == "jwt":
            assert self.jwt is not None
            try:
                return self.jwt.verify(token)
            except AuthError as exc:
                log.info("rejected JWT %s: %s", fingerprint(token), exc.message)
                raise
        return Principal.local()
