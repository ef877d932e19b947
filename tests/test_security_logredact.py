"""The log filter replaces secrets with fingerprints (issue 4 check 10)."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import pytest

from appserver.auth import fingerprint
from appserver.config import Config, ProviderConfig
from appserver.logredact import SecretRedactor, from_config, install, redact_value

JWT = "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJhbGljZSJ9.c2lnbmF0dXJlLXBhcnQ"
TOKEN = "aps_Q2hlY2tUaGlzSXNBVG9rZW5fMTIzNDU2Nzg5MA"


@pytest.fixture
def captured() -> Iterator[tuple[logging.Logger, io.StringIO, SecretRedactor]]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(name)s %(message)s"))
    parent = logging.getLogger("redact-test")
    parent.addHandler(handler)
    parent.setLevel(logging.DEBUG)
    parent.propagate = False
    redactor = SecretRedactor(
        secrets=["my-hs256-secret-value"],
        env_names=["FAKE_KEY"],
        environ={"FAKE_KEY": "k-123456789"},
    )
    handler.addFilter(redactor)
    try:
        yield (
            parent.getChild("child"),
            stream,
            redactor,
        )  # a child logger: the handler filter still applies
    finally:
        parent.removeHandler(handler)


def test_redacts_patterns_and_known_secrets(
    captured: tuple[logging.Logger, io.StringIO, SecretRedactor],
) -> None:
    log, stream, redactor = captured
    log.info("Authorization: Bearer %s", "opaque-token-value-123")
    log.info("jwt %s and token %s", JWT, TOKEN)
    log.info('127.0.0.1 - "GET /v1/models?access_token=%s&x=1 HTTP/1.1" 401', "abcdef123456")
    log.info('127.0.0.1 - "GET /v1/models?x=1;token=%s;y=2 HTTP/1.1" 401', "semicolon-sep-value")
    log.info("secret %s key %s", "my-hs256-secret-value", "k-123456789")
    log.info("payload %s", {"api_key": "sk-proj-abcdefghijklmnopqrstuvwxyz"})
    redactor.add_secret("late-registered-token")
    log.warning("saw late-registered-token twice: late-registered-token")
    out = stream.getvalue()
    for secret in (
        "opaque-token-value-123",
        JWT,
        TOKEN,
        "abcdef123456",
        "semicolon-sep-value",
        "my-hs256-secret-value",
        "k-123456789",
        "sk-proj-abcdefghijklmnopqrstuvwxyz",
        "late-registered-token",
    ):
        assert secret not in out, secret
        assert fingerprint(secret) in out, secret
    assert "x=1" in out and ";y=2" in out and "GET /v1/models" in out  # the rest of the line survives


def test_redacts_tracebacks(captured: tuple[logging.Logger, io.StringIO, SecretRedactor]) -> None:
    log, stream, _ = captured
    try:
        raise RuntimeError(f"upstream refused Bearer {TOKEN}")
    except RuntimeError:
        log.exception("failed")
    out = stream.getvalue()
    assert TOKEN not in out and "RuntimeError" in out


def test_leaves_ordinary_text_alone() -> None:
    r = SecretRedactor()
    for text in (
        "turn completed in 1.2 s",
        "send a bearer token",
        "GET /healthz 200",
        "echo: hello world",
        "the token rejected by the server",
        "authorization failed for this request",
        "shell pwd=/work/main token=None",
    ):
        assert r.redact(text) == text


@pytest.mark.parametrize(
    ("text", "secret"),
    [
        ("Authorization: Token abcdef123456", "abcdef123456"),
        ("authorization: rawkey-123456789", "rawkey-123456789"),
        ("Proxy-Authorization: Key zyxwvut98765", "zyxwvut98765"),
        ("headers={'Authorization': 'Token q1w2e3r4t5y6'}", "q1w2e3r4t5y6"),
        ("connect password=hunter2222 user=bob", "hunter2222"),
        ("export CLIENT_SECRET=verylongsecretvalue", "verylongsecretvalue"),
        ("refresh_token=rt-0123456789abcdef&scope=x", "rt-0123456789abcdef"),
    ],
)
def test_redacts_any_authorization_scheme_and_secret_pairs(text: str, secret: str) -> None:
    out = SecretRedactor().redact(text)
    assert secret not in out and "[redacted sha256:" in out, out
    assert SecretRedactor().redact(out) == out  # masking twice changes nothing


def test_from_config_and_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_PROVIDER_KEY", "provider-secret-1234")
    cfg = Config(home=__import__("pathlib").Path("/nonexistent"))
    cfg.providers["mine"] = ProviderConfig(name="mine", api_key_env="MY_PROVIDER_KEY")
    r = from_config(cfg, extra_secrets=["extra-secret-9876"])
    assert "provider-secret-1234" not in r.redact("key=provider-secret-1234 extra-secret-9876")
    assert "extra-secret-9876" not in r.redact("extra-secret-9876")
    assert redact_value({"a": [TOKEN]}, r) == {"a": [f"[redacted {fingerprint(TOKEN)}]"]}
    handler = logging.StreamHandler(io.StringIO())
    logger = logging.getLogger("install-test")
    logger.addHandler(handler)
    try:
        assert handler in install(r, ["install-test"])
        assert r in handler.filters
        install(r, ["install-test"])
        assert handler.filters.count(r) == 1
    finally:
        logger.removeHandler(handler)
