"""Session 23 security findings on JWTs and log redaction:

- a PEM key or certificate given as `jwt_secret_file` was accepted at start; every JWT then failed
  and each request logged an ERROR with a full traceback (any unauthenticated client could fill
  the log);
- some refusals named a PyJWT class (`invalid JWT: InvalidSubjectError`, `DecodeError`) instead
  of a reason;
- `jwt_leeway_s = 1e9` was accepted, which turns expiry off;
- `GET /v1/models;token=aps_…` was redacted twice into a garbled `[redacted …] sha256:…]`.
"""

from __future__ import annotations

import base64
import json
import logging
import time
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa

from appserver.auth import Authenticator, AuthError, fingerprint
from appserver.config import Config, ConfigError, load_config
from appserver.logredact import SecretRedactor
from tests.support.certs import self_signed


@pytest.fixture(scope="module")
def rsa_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _jwt_config(home: Path, **auth: Any) -> Config:
    cfg = Config(home=home)
    cfg.auth.mode = "jwt"
    for key, value in auth.items():
        setattr(cfg.auth, key, value)
    return cfg


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _signed(key: rsa.RSAPrivateKey, payload: bytes, header: bytes = b'{"alg":"RS256","typ":"JWT"}') -> str:
    """An RS256 JWT over exactly these payload bytes (PyJWT's encoder would refuse most of them)."""
    signing_input = f"{_b64(header)}.{_b64(payload)}"
    return signing_input + "." + _b64(key.sign(signing_input.encode(), padding.PKCS1v15(), hashes.SHA256()))


# ── a PEM as the HMAC secret ─────────────────────────────────────────────────────────────────────


def test_a_pem_key_or_certificate_as_the_hmac_secret_is_refused_at_start(
    tmp_path: Path, rsa_key: rsa.RSAPrivateKey
) -> None:
    public = rsa_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    cert_path, _ = self_signed(tmp_path)
    ssh = rsa_key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    for name, content in (("pub.pem", public), ("cert.pem", cert_path.read_bytes()), ("id_rsa.pub", ssh)):
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ConfigError, match="holds a PEM key or certificate .*not an HMAC secret"):
            Authenticator(_jwt_config(tmp_path, jwt_secret_file=name))
    (tmp_path / "secret").write_bytes(b"x" * 48 + b"\n")  # an ordinary secret still starts
    Authenticator(_jwt_config(tmp_path, jwt_secret_file="secret"))


def test_a_key_problem_while_verifying_is_one_throttled_line_never_a_traceback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Defence in depth: a key PyJWT refuses at verification (as the PEM secret above did before it
    was refused at start) is a 401 per request and one log line, not a traceback per request."""
    (tmp_path / "secret").write_bytes(b"s" * 48)
    auth = Authenticator(_jwt_config(tmp_path, jwt_secret_file="secret"))
    assert auth.jwt is not None
    auth.jwt.key = b"-----BEGIN PUBLIC KEY-----\nMFkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAE\n-----END PUBLIC KEY-----\n"
    header = _b64(b'{"alg":"HS256","typ":"JWT"}')
    payload = _b64(json.dumps({"sub": "u", "exp": int(time.time()) + 60}).encode())
    token = f"{header}.{payload}.{_b64(b'x' * 32)}"
    with caplog.at_level(logging.INFO, logger="appserver.auth"):
        for _ in range(3):
            with pytest.raises(AuthError) as info:
                auth.authenticate(f"Bearer {token}")
            assert (info.value.status, info.value.code) == (401, "invalid_token")
            assert "key is unusable" in info.value.message
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in errors]
    assert "jwt_secret_file" in errors[0].getMessage()
    assert all(r.exc_info is None for r in caplog.records)


# ── refusals say why ─────────────────────────────────────────────────────────────────────────────


def test_every_refusal_gives_a_reason_not_a_pyjwt_class_name(tmp_path: Path, rsa_key: rsa.RSAPrivateKey) -> None:
    (tmp_path / "pub.pem").write_bytes(
        rsa_key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    auth = Authenticator(_jwt_config(tmp_path, jwt_public_key_file="pub.pem"))
    exp = int(time.time()) + 60
    cases = {
        b'{"sub":5,"exp":%d}' % exp: "claim 'sub' must be a non-empty string",
        b'{"sub":["a"],"exp":%d}' % exp: "claim 'sub' must be a non-empty string",
        b'{"sub":"a","exp":%d,"iat":"x"}' % exp: "claim 'iat' must be a NumericDate",
        b'{"sub":"a","exp":%d,"iat":1e400}' % exp: "claim 'iat' must be a NumericDate",
        b'{"sub":"a","exp":%d,"nbf":"x"}' % exp: "claim 'nbf' must be a NumericDate",
        b'{"sub":"a","exp":%d,"nbf":NaN}' % exp: "claim 'nbf' must be a NumericDate",
        b'{"sub":"a","exp":1e400}': "claim 'exp' must be a NumericDate",
        b'{"sub":"a","exp":NaN}': "claim 'exp' must be a NumericDate",
        b'{"sub":"a","exp":"soon"}': "claim 'exp' must be a NumericDate",
        b'{"sub":"a","exp":%d,"jti":5}' % exp: "claim 'jti' must be a string",
        b"[1,2]": "payload must be a JSON object",
        b'"x"': "payload must be a JSON object",
        b"{nope": "payload is not base64url-encoded UTF-8 JSON",
        b'{"sub":"\xff","exp":%d}' % exp: "payload is not base64url-encoded UTF-8 JSON",
        b'{"x":' + b"[" * 5000 + b"]" * 5000 + b"}": "nested too deep",
    }
    for payload, reason in cases.items():
        with pytest.raises(AuthError) as info:
            auth.authenticate("Bearer " + _signed(rsa_key, payload))
        err = info.value
        assert (err.status, err.code) == (401, "invalid_token"), payload
        assert reason in err.message, (payload, err.message)
        assert "Error" not in err.message, (payload, err.message)  # no DecodeError, InvalidSubjectError…


# ── jwt_leeway_s is bounded ──────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize("leeway", ["1e9", "301", "-1"])
def test_a_leeway_that_would_turn_expiry_off_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, leeway: str
) -> None:
    (tmp_path / "config.toml").write_text(f"[auth]\njwt_leeway_s = {leeway}\n")
    monkeypatch.setenv("APPSERVER_HOME", str(tmp_path))
    with pytest.raises(ConfigError, match=r"jwt_leeway_s must be a number >= 0 and <= 300"):
        load_config()
    (tmp_path / "secret").write_bytes(b"s" * 48)
    with pytest.raises(ConfigError, match=r"jwt_leeway_s must be between 0 and 300 seconds"):
        Authenticator(_jwt_config(tmp_path, jwt_secret_file="secret", jwt_leeway_s=float(leeway)))


def test_the_largest_leeway_is_taken(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "config.toml").write_text("[auth]\njwt_leeway_s = 300\n")
    monkeypatch.setenv("APPSERVER_HOME", str(tmp_path))
    assert load_config().auth.jwt_leeway_s == 300


# ── redaction is idempotent ──────────────────────────────────────────────────────────────────────

TOKEN = "aps_Q2hlY2tUaGlzSXNBVG9rZW5fMTIzNDU2Nzg5MA"
JWT = "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJhbGljZSJ9.c2lnbmF0dXJlLXBhcnQ"


@pytest.mark.parametrize("sep", [";", "?", "&"])
@pytest.mark.parametrize("name", ["token", "key", "jwt", "api_key", "access_token"])
@pytest.mark.parametrize("secret", [TOKEN, JWT, "sk-abcdefghijklmnopqrstuvwx"])
def test_a_credential_in_a_url_is_masked_once(sep: str, name: str, secret: str) -> None:
    redactor = SecretRedactor()
    line = f'127.0.0.1:5000 - "GET /v1/models{sep}{name}={secret} HTTP/1.1" 401'
    once = redactor.redact(line)
    assert once == f'127.0.0.1:5000 - "GET /v1/models{sep}{name}=[redacted {fingerprint(secret)}] HTTP/1.1" 401'
    assert redactor.redact(once) == once


def test_redacting_redacted_text_changes_nothing() -> None:
    redactor = SecretRedactor(secrets=["my-hs256-secret-value"])
    lines = [
        f"Authorization: Bearer {TOKEN}",
        f'{{"token": "{TOKEN}", "password": "hunter2hunter2"}}',
        f"password=hunter2hunter2 api_key={JWT}",
        "GET /x?key=my-hs256-secret-value&jwt=" + JWT,
        f"Proxy-Authorization: Token {TOKEN}",
    ]
    for line in lines:
        once = redactor.redact(line)
        assert redactor.redact(once) == once, line
