"""Bearer JWT verification with the algorithms and keys pinned by config.

`import jwt` below is PyJWT (absolute imports), not this module.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import math
import os
import re
import time
from pathlib import Path
from typing import Any

from appserver.auth.errors import unauthorized
from appserver.auth.principal import SCOPES, Principal
from appserver.config import AuthConfig, ConfigError, home_file

log = logging.getLogger("appserver.auth")

HS_MIN_SECRET_BYTES = 32
MAX_JWT_LIFETIME_S = 36500 * 86400.0  # an `exp` further ahead is refused, as a token's lifetime is
EXP_CLAIM_MESSAGE = (
    f"JWT claim 'exp' must be a NumericDate (a number of seconds) at most {MAX_JWT_LIFETIME_S // 86400:.0f} days ahead"
)
NUMERIC_DATE_MESSAGE = "JWT claim {claim!r} must be a NumericDate (a finite number of seconds)"
SUB_CLAIM_MESSAGE = "JWT claim 'sub' must be a non-empty string of printable characters (at most 256)"
# Clock skew allowed on exp/nbf/iat. Synchronised clocks differ by well under a second, and 5 minutes
# is the customary ceiling (Kerberos' default, most identity providers'); every JWT stays valid this
# long past its `exp` (and a WebSocket opened with it stays open), so a larger one would turn expiry
# into a suggestion. config.py RULES holds the same bound for config.toml.
MAX_JWT_LEEWAY_S = 300.0
# A key the server holds that PyJWT refuses while verifying: logged (one line) at most this often.
KEY_PROBLEM_LOG_EVERY_S = 60.0
# Of a refused header's `alg`, the error message quotes this many characters of its repr: it is the
# client's text, of any length (an 11,500-character one went whole into each answer and log line).
ALG_SHOWN = 40
_HS_ALGS = frozenset({"HS256", "HS384", "HS512"})
_RSA_ALGS = frozenset({"RS256", "RS384", "RS512", "PS256", "PS384", "PS512"})
_EC_ALGS = frozenset({"ES256", "ES384", "ES512"})


def _claim_set(value: Any, claim: str) -> frozenset[str]:
    if isinstance(value, str):
        items = re.split(r"[,\s]+", value)
    elif isinstance(value, list) and all(isinstance(v, str) for v in value):
        items = value
    else:
        raise unauthorized("invalid_token", f"JWT claim {claim!r} must be a string or a list of strings")
    return frozenset(i.strip() for i in items if i.strip())


class JwtVerifier:
    """Verifies bearer JWTs with the algorithms pinned by config; keys are loaded once, eagerly.

    Pinning one key family (HMAC or RSA or EC) rules out algorithm confusion: a public RSA key can
    never be used as an HMAC secret, and `alg: none` is never in the list.
    """

    def __init__(self, cfg: AuthConfig, base_dir: Path | None = None) -> None:
        import jwt  # noqa: F401  - loaded with a JWT configuration, not on every start (see verify)

        self.issuer = cfg.jwt_issuer
        self.audience = cfg.jwt_audience
        self.leeway = float(cfg.jwt_leeway_s)
        if not 0 <= self.leeway <= MAX_JWT_LEEWAY_S:  # NaN fails too
            raise ConfigError(
                f"[auth] jwt_leeway_s must be between 0 and {MAX_JWT_LEEWAY_S:.0f} seconds; "
                f"got {cfg.jwt_leeway_s} (a larger leeway keeps every JWT valid that long past its exp)"
            )
        self._key_problem_logged_at = -math.inf
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
                raise ConfigError(f"[auth] jwt_secret_file needs HMAC algorithms (HS256); got {', '.join(bad)}")
            secret = self._read_file(cfg.jwt_secret_file, base_dir, "jwt_secret_file").rstrip(b"\r\n")
            if len(secret) < HS_MIN_SECRET_BYTES:
                raise ConfigError(
                    f"[auth] jwt_secret_file holds {len(secret)} bytes; HS256 needs a secret of at least "
                    f"{HS_MIN_SECRET_BYTES} bytes (e.g. `openssl rand -base64 48 > secret`)"
                )
            _refuse_key_as_secret(secret)
            self.key = secret
        elif cfg.jwt_public_key_file:
            from cryptography.hazmat.primitives.asymmetric import ec, rsa
            from cryptography.hazmat.primitives.serialization import load_pem_public_key

            pem = self._read_file(cfg.jwt_public_key_file, base_dir, "jwt_public_key_file")
            if b"PRIVATE KEY" in pem:
                raise ConfigError("[auth] jwt_public_key_file holds a private key; give the server only the public key")
            try:
                key = load_pem_public_key(pem)
            except ValueError as exc:
                raise ConfigError(f"[auth] jwt_public_key_file is not a PEM public key: {exc}") from None
            if isinstance(key, rsa.RSAPublicKey):
                family, default = _RSA_ALGS, "RS256"
                if key.key_size < 2048:
                    raise ConfigError("[auth] jwt_public_key_file: RSA keys must be at least 2048 bits")
            elif isinstance(key, ec.EllipticCurvePublicKey):
                family, default = (
                    _EC_ALGS,
                    {"secp256r1": "ES256", "secp384r1": "ES384", "secp521r1": "ES512"}.get(key.curve.name, "ES256"),
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
            raise ConfigError('[auth] mode = "jwt" needs jwt_secret_file (HS256) or jwt_public_key_file (RS256/ES256)')
        self.algorithms = algs

    @staticmethod
    def _read_file(name: str, base_dir: Path | None, key: str) -> bytes:
        # load_config already made a relative path the home's (config.home_file); an AuthConfig
        # made otherwise is resolved here the same way
        path = home_file(base_dir, name) if base_dir is not None else Path(name).expanduser()
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
        import jwt  # PyJWT and cryptography: ~70 ms of imports, paid only where JWTs are used

        try:
            header = jwt.get_unverified_header(token)
        except jwt.InvalidTokenError:  # malformed, or a header PyJWT refuses (`crit` extensions)
            raise unauthorized("invalid_token", "malformed JWT") from None
        alg = header.get("alg")
        if not isinstance(alg, str) or alg not in self.algorithms:
            raise unauthorized(
                "invalid_token",
                f"JWT algorithm {shown_alg(alg)} is not allowed (pinned: {', '.join(self.algorithms)})",
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
            # PyJWT reads `exp: true` as 1 (1970): no expiry, a claim of the wrong type.
            if not _numeric_date_within(_unverified_claim(token, "exp"), math.inf):
                raise unauthorized("invalid_token", EXP_CLAIM_MESSAGE) from None
            raise unauthorized("token_expired", "JWT has expired") from None
        except jwt.ImmatureSignatureError:
            raise unauthorized("invalid_token", "JWT is not valid yet (nbf/iat in the future)") from None
        except jwt.InvalidAudienceError:
            raise unauthorized("invalid_token", "JWT audience does not match") from None
        except jwt.InvalidIssuerError:
            raise unauthorized("invalid_token", "JWT issuer does not match") from None
        except jwt.MissingRequiredClaimError as exc:
            raise unauthorized("invalid_token", f"JWT lacks the required claim {exc.claim!r}") from None
        except jwt.InvalidSignatureError:
            raise unauthorized("invalid_token", "JWT signature is invalid") from None
        except jwt.InvalidKeyError as exc:  # refused at start (_refuse_key_as_secret); never a traceback per request
            self._log_key_problem(str(exc))
            raise unauthorized(
                "invalid_token", "the JWT could not be verified: the server's JWT key is unusable"
            ) from None
        except (jwt.InvalidTokenError, OverflowError, ValueError, TypeError) as exc:
            # PyJWT's class names (DecodeError, InvalidSubjectError) say nothing to a client: a reason
            raise unauthorized("invalid_token", refusal_reason(token, exc)) from None
        if self.audience is None and "aud" in claims:  # PyJWT lets an empty one through
            raise unauthorized("invalid_token", "JWT carries an audience and this server expects none")
        # PyJWT reads `true` as 1 and "1796…" as a number; and an exp centuries ahead never ends.
        if not _numeric_date_within(claims.get("exp"), time.time() + MAX_JWT_LIFETIME_S):
            raise unauthorized("invalid_token", EXP_CLAIM_MESSAGE)
        agents: frozenset[str] | None = None
        if "agents" in claims:
            agents = _claim_set(claims["agents"], "agents")
            if "*" in agents and len(agents) > 1:
                # as `token create --agents` refuses it: a claim built from group names that came to
                # hold a "*" would widen a credential for some agents to all of them
                raise unauthorized(
                    "invalid_token", "JWT claim 'agents' mixes '*' (all agents) with agent names: give one or the other"
                )
            if "*" in agents:
                agents = None
        scopes = frozenset(SCOPES)
        for key in ("scope", "scopes"):
            if key in claims:
                scopes = _claim_set(claims[key], key) & frozenset(SCOPES)
                break
        sub = claims.get("sub")
        if not isinstance(sub, str) or not sub.strip() or len(sub) > 256 or not sub.isprintable():
            raise unauthorized("invalid_token", SUB_CLAIM_MESSAGE)
        return Principal(
            subject=f"jwt:{sub}",
            kind="jwt",
            agents=agents,
            scopes=scopes,
            expires_at=float(claims["exp"]),
            claims=claims,
        )

    def _log_key_problem(self, detail: str) -> None:
        """One line, at most every KEY_PROBLEM_LOG_EVERY_S: any client can make every request hit it."""
        now = time.monotonic()
        if now - self._key_problem_logged_at < KEY_PROBLEM_LOG_EVERY_S:
            return
        self._key_problem_logged_at = now
        log.error(
            "every JWT is refused: the configured key cannot verify %s (%s); fix [auth] jwt_secret_file "
            "or jwt_public_key_file and restart (logged at most every %.0f s)",
            "/".join(self.algorithms),
            detail,
            KEY_PROBLEM_LOG_EVERY_S,
        )


def _refuse_key_as_secret(secret: bytes) -> None:
    """A PEM key or certificate (or an SSH key) given as the HMAC secret: PyJWT refuses it as one at
    every verification (algorithm confusion), so every JWT would fail; refuse it at start instead."""
    from jwt.algorithms import HMACAlgorithm
    from jwt.exceptions import InvalidKeyError

    try:
        HMACAlgorithm(HMACAlgorithm.SHA256).prepare_key(secret)
        pem = b"-----BEGIN " in secret
    except InvalidKeyError:
        pem = True
    if pem:
        raise ConfigError(
            "[auth] jwt_secret_file holds a PEM key or certificate (or an SSH key), not an HMAC secret: "
            "for HS256 give a random secret (`openssl rand -base64 48 > secret`); to verify RS256/ES256 "
            "JWTs, give the issuer's public key as jwt_public_key_file instead"
        )


def shown_alg(alg: object) -> str:
    """A header's `alg` as an error message quotes it: repr-escaped (no control character), its
    first ALG_SHOWN characters and its length when longer."""
    text = repr(alg)
    if len(text) <= ALG_SHOWN:
        return text
    return f"{text[:ALG_SHOWN]}… ({len(text)} characters)"


def refusal_reason(token: str, exc: Exception) -> str:
    """Why PyJWT refused a JWT, in words (it raises DecodeError for a payload that is no JSON object
    as for an `nbf` that is no number). Its signature was checked first unless the token is malformed."""
    from jwt.exceptions import InvalidJTIError, InvalidSubjectError

    if isinstance(exc, InvalidSubjectError):
        return SUB_CLAIM_MESSAGE
    if isinstance(exc, InvalidJTIError):
        return "JWT claim 'jti' must be a string"
    parts = token.split(".")
    if len(parts) != 3:
        return "malformed JWT: it must be three base64url parts joined by dots"
    try:
        _b64url(parts[2])
    except ValueError:
        return "malformed JWT: its signature is not base64url"
    try:
        payload = json.loads(_b64url(parts[1]))
    except (ValueError, RecursionError):  # binascii.Error and JSONDecodeError are ValueErrors
        return "malformed JWT: its payload is not base64url-encoded UTF-8 JSON, or is nested too deep"
    if not isinstance(payload, dict):
        return "JWT payload must be a JSON object of claims"
    for claim in ("iat", "nbf", "exp"):
        if claim in payload and not _numeric_date_within(payload[claim], math.inf):
            return EXP_CLAIM_MESSAGE if claim == "exp" else NUMERIC_DATE_MESSAGE.format(claim=claim)
    return "invalid JWT: its claims could not be checked"


def _b64url(segment: str) -> bytes:
    """A base64url segment of a JWT, unpadded as JWTs write it; ValueError when it is not one."""
    try:
        return base64.urlsafe_b64decode(segment + "=" * (-len(segment) % 4))
    except (binascii.Error, ValueError):
        raise ValueError("not base64url") from None


def _unverified_claim(token: str, claim: str) -> Any:
    """A claim of a JWT whose signature was checked already (PyJWT checks it before the claims)."""
    import jwt

    try:
        payload = jwt.decode(token, options={"verify_signature": False})
    except (jwt.InvalidTokenError, ValueError, TypeError, OverflowError):
        return None
    return payload.get(claim) if isinstance(payload, dict) else None


def _numeric_date_within(value: Any, latest: float) -> bool:
    """A JSON number (not a bool, not a string), finite, no later than `latest`. An int is
    compared as it is: one past a float's range would not convert (OverflowError)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return (isinstance(value, int) or math.isfinite(value)) and value <= latest
