"""JWT verification (issue 4 check 3) with keys generated here by `cryptography`."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from pathlib import Path
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from appserver.auth import Authenticator, AuthError
from appserver.config import Config, ConfigError

ISS, AUD = "https://issuer.example", "appserver"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _pub_pem(key: Any) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def _cfg(tmp_path: Path, **auth: Any) -> Config:
    cfg = Config(home=tmp_path)
    cfg.auth.mode = "jwt"
    cfg.auth.jwt_issuer = ISS
    cfg.auth.jwt_audience = AUD
    for k, v in auth.items():
        setattr(cfg.auth, k, v)
    return cfg


@pytest.fixture(scope="module")
def rsa_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


@pytest.fixture
def rs256(tmp_path: Path, rsa_key: rsa.RSAPrivateKey) -> Authenticator:
    (tmp_path / "pub.pem").write_bytes(_pub_pem(rsa_key))
    return Authenticator(_cfg(tmp_path, jwt_algorithms=["RS256"], jwt_public_key_file="pub.pem"))


def _claims(**over: Any) -> dict[str, Any]:
    now = int(time.time())
    return {"sub": "alice", "iss": ISS, "aud": AUD, "iat": now, "exp": now + 300, **over}


def _reject(auth: Authenticator, token: str) -> AuthError:
    with pytest.raises(AuthError) as info:
        auth.authenticate(f"Bearer {token}")
    assert info.value.status == 401
    return info.value


def test_valid_rs256(rs256: Authenticator, rsa_key: rsa.RSAPrivateKey) -> None:
    claims = _claims()
    p = rs256.authenticate("Bearer " + jwt.encode(claims, rsa_key, algorithm="RS256"))
    assert p.kind == "jwt" and p.subject == "jwt:alice" and p.agents is None
    assert p.has_scope("openai") and p.has_scope("ws") and p.has_scope("admin")
    assert p.expires_at == claims["exp"]  # the token's own expiry, not a comparison with the real clock
    assert rs256.authenticate_hello(jwt.encode(_claims(), rsa_key, algorithm="RS256")).subject == "jwt:alice"


def test_leeway_accepts_small_skew(rs256: Authenticator, rsa_key: rsa.RSAPrivateKey) -> None:
    now = int(time.time())
    ok = jwt.encode(_claims(exp=now - 10, nbf=now + 10), rsa_key, algorithm="RS256")
    assert rs256.authenticate(f"Bearer {ok}").subject == "jwt:alice"


def test_rejections(rs256: Authenticator, rsa_key: rsa.RSAPrivateKey, tmp_path: Path) -> None:
    now = int(time.time())
    assert _reject(rs256, jwt.encode(_claims(exp=now - 120), rsa_key, algorithm="RS256")).code == "token_expired"
    _reject(rs256, jwt.encode(_claims(nbf=now + 120), rsa_key, algorithm="RS256"))
    _reject(rs256, jwt.encode(_claims(aud="other"), rsa_key, algorithm="RS256"))
    _reject(rs256, jwt.encode(_claims(iss="https://evil.example"), rsa_key, algorithm="RS256"))
    no_exp = _claims()
    del no_exp["exp"]
    _reject(rs256, jwt.encode(no_exp, rsa_key, algorithm="RS256"))
    no_aud = _claims()
    del no_aud["aud"]
    _reject(rs256, jwt.encode(no_aud, rsa_key, algorithm="RS256"))
    # alg: none
    unsigned = _b64(b'{"alg":"none","typ":"JWT"}') + "." + _b64(json.dumps(_claims()).encode()) + "."
    _reject(rs256, unsigned)
    # algorithm confusion: HS256 "signed" with the RSA public key as the HMAC secret
    signing_input = _b64(b'{"alg":"HS256","typ":"JWT"}') + "." + _b64(json.dumps(_claims()).encode())
    mac = hmac.new(_pub_pem(rsa_key), signing_input.encode(), hashlib.sha256).digest()
    assert "not allowed" in _reject(rs256, signing_input + "." + _b64(mac)).message
    # signature by another key
    other = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    _reject(rs256, jwt.encode(_claims(), other, algorithm="RS256"))
    # tampered payload
    good = jwt.encode(_claims(), rsa_key, algorithm="RS256")
    h, _, s = good.split(".")
    _reject(rs256, h + "." + _b64(json.dumps(_claims(sub="mallory")).encode()) + "." + s)
    _reject(rs256, "not-a-jwt")
    # ES256 token when RS256 is pinned
    ec_key = ec.generate_private_key(ec.SECP256R1())
    _reject(rs256, jwt.encode(_claims(), ec_key, algorithm="ES256"))
    # a `crit` header PyJWT refuses before any signature is checked: a 401, not a 500 and a traceback
    crit = _b64(b'{"alg":"RS256","typ":"JWT","crit":["x"],"x":1}') + "." + _b64(json.dumps(_claims()).encode())
    assert _reject(rs256, crit + "." + _b64(b"sig")).code == "invalid_token"
    # an exp that is no NumericDate, or so far ahead the token never ends
    _reject(rs256, jwt.encode(_claims(exp=True), rsa_key, algorithm="RS256"))  # PyJWT reads it as 1: expired
    for exp in (str(now + 600), 10**30, 10**400, 1e308, now + 200 * 365 * 86400):  # 10**400: no float holds it
        rejected = _reject(rs256, jwt.encode(_claims(exp=exp), rsa_key, algorithm="RS256"))
        assert rejected.code == "invalid_token", (exp, rejected.code)
    fractional = jwt.encode(_claims(exp=now + 3600.5), rsa_key, algorithm="RS256")  # a float exp is fine
    assert rs256.authenticate("Bearer " + fractional)


def test_scope_and_agent_claims(rs256: Authenticator, rsa_key: rsa.RSAPrivateKey) -> None:
    p = rs256.authenticate("Bearer " + jwt.encode(_claims(scope="openai profile", agents=["a"]), rsa_key, "RS256"))
    assert p.scopes == frozenset({"openai"}) and p.allows_agent("a") and not p.allows_agent("b")
    p = rs256.authenticate("Bearer " + jwt.encode(_claims(scopes=["ws", "admin"], agents="a,b"), rsa_key, "RS256"))
    assert p.scopes == frozenset({"ws", "admin"}) and p.agents == frozenset({"a", "b"})
    p = rs256.authenticate("Bearer " + jwt.encode(_claims(agents=["*"]), rsa_key, "RS256"))
    assert p.agents is None
    _reject(rs256, jwt.encode(_claims(agents=7), rsa_key, "RS256"))


def test_es256(tmp_path: Path, rsa_key: rsa.RSAPrivateKey) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    (tmp_path / "ec.pem").write_bytes(_pub_pem(key))
    auth = Authenticator(_cfg(tmp_path, jwt_public_key_file=str(tmp_path / "ec.pem")))  # ES256 inferred
    assert auth.jwt is not None and auth.jwt.algorithms == ["ES256"]
    assert auth.authenticate("Bearer " + jwt.encode(_claims(), key, algorithm="ES256")).subject == "jwt:alice"
    _reject(auth, jwt.encode(_claims(), rsa_key, algorithm="RS256"))
    _reject(auth, jwt.encode(_claims(), ec.generate_private_key(ec.SECP256R1()), algorithm="ES256"))


def test_hs256_secret_file(tmp_path: Path) -> None:
    short = tmp_path / "short"
    short.write_bytes(b"x" * 31 + b"\n")
    with pytest.raises(ConfigError, match="at least 32 bytes"):
        Authenticator(_cfg(tmp_path, jwt_secret_file=str(short)))
    secret = b"s" * 64
    good = tmp_path / "secret"
    good.write_bytes(secret + b"\n")
    good.chmod(0o600)
    auth = Authenticator(_cfg(tmp_path, jwt_algorithms=["HS256"], jwt_secret_file=str(good)))
    assert auth.authenticate("Bearer " + jwt.encode(_claims(), secret, algorithm="HS256")).kind == "jwt"
    _reject(auth, jwt.encode(_claims(), b"t" * 64, algorithm="HS256"))
    _reject(auth, jwt.encode(_claims(), secret, algorithm="HS512"))  # not pinned
    assert auth.secrets() == ["s" * 64]


def test_config_errors(tmp_path: Path, rsa_key: rsa.RSAPrivateKey) -> None:
    pub = tmp_path / "pub.pem"
    pub.write_bytes(_pub_pem(rsa_key))
    secret = tmp_path / "secret"
    secret.write_bytes(b"k" * 40)
    priv = tmp_path / "priv.pem"
    priv.write_bytes(
        rsa_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    bad: list[dict[str, Any]] = [
        {},
        {"jwt_secret_file": str(secret), "jwt_public_key_file": str(pub)},
        {"jwt_public_key_file": str(pub), "jwt_algorithms": ["none"]},
        {"jwt_public_key_file": str(pub), "jwt_algorithms": ["HS256"]},
        {"jwt_public_key_file": str(pub), "jwt_algorithms": ["ES256"]},
        {"jwt_secret_file": str(secret), "jwt_algorithms": ["RS256"]},
        {"jwt_public_key_file": str(priv)},
        {"jwt_public_key_file": str(secret)},
        {"jwt_public_key_file": str(tmp_path / "missing.pem")},
    ]
    for auth_cfg in bad:
        with pytest.raises(ConfigError):
            Authenticator(_cfg(tmp_path, **auth_cfg))
    cfg = Config(home=tmp_path)
    cfg.auth.mode = "oauth"
    with pytest.raises(ConfigError):
        Authenticator(cfg)


def test_sub_is_required_it_is_the_namespace(rs256: Authenticator, rsa_key: rsa.RSAPrivateKey) -> None:
    """Adversarial finding: JWTs without `sub` all had the subject `jwt`, so one conversation
    namespace (`jwt:jwt`): two such callers saw and steered each other's conversations. A JWT
    without a usable `sub` is refused; one with control characters (which could splice another
    namespace into an idempotency scope) too."""
    no_sub = _claims()
    del no_sub["sub"]
    assert "'sub'" in _reject(rs256, jwt.encode(no_sub, rsa_key, algorithm="RS256")).message
    # C1 controls, a bidi override, a line separator, only a zero-width space: not printable
    for bad in ("", "   ", "a\x1fb", "x" * 257, 7, "a\x85b", "a\u202eb", "a\u2028b", "\u200b", "\u00a0"):
        assert _reject(rs256, jwt.encode(_claims(sub=bad), rsa_key, algorithm="RS256")).code == "invalid_token"
    assert (
        rs256.authenticate("Bearer " + jwt.encode(_claims(sub="carol"), rsa_key, algorithm="RS256")).subject
        == "jwt:carol"
    )


def test_an_empty_audience_is_refused_when_none_is_expected(tmp_path: Path, rsa_key: rsa.RSAPrivateKey) -> None:
    """PyJWT skips an empty `aud` when no audience is configured; the docs say any `aud` is refused."""
    (tmp_path / "pub.pem").write_bytes(_pub_pem(rsa_key))
    auth = Authenticator(_cfg(tmp_path, jwt_algorithms=["RS256"], jwt_public_key_file="pub.pem", jwt_audience=None))
    for aud in ("", [], "someone"):
        assert _reject(auth, jwt.encode(_claims(aud=aud), rsa_key, algorithm="RS256")).code == "invalid_token", aud
    no_aud = _claims()
    del no_aud["aud"]
    assert auth.authenticate("Bearer " + jwt.encode(no_aud, rsa_key, algorithm="RS256")).subject == "jwt:alice"
