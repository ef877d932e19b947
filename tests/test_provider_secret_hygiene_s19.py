"""Session 19: provider header values and API keys that HTTP cannot carry, and provider secrets
that an upstream quotes JSON-escaped or URL-encoded.

* A header value or API key beyond ASCII (`Café`, a pasted non-breaking hyphen) or holding a control
  (C1 controls U+0080-U+009F too) is refused at config load (exit 2, one line naming the provider,
  the header or variable, the character as U+XXXX and its position; never the value), from
  config.toml, from APPSERVER_ overrides and from the variable a key is read from. A key read at turn
  time that turned bad after the load fails the turn with a clear provider error, never an
  internal error with a traceback.
* A provider secret holding `"`, `\\`, `/`, `&` is redacted from an upstream's error whatever form
  it is quoted in: raw, JSON-escaped (with and without ensure_ascii, `\\/`, twice), URL-encoded.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import sqlite3
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import quote, quote_plus

import httpx
import pytest

from appserver.config import ProviderConfig, load_config
from appserver.logredact import SecretRedactor, from_config
from appserver.providers.anthropic import AnthropicProvider
from appserver.providers.base import ChatMessage, ProviderError, ProviderRequest
from appserver.providers.openai_compat import OpenAICompatProvider
from appserver.runtime.kernel import SubmitRequest
from tests.support.cli import cli_env, run_cli
from tests.support.kernel import open_server
from tests.support.serve import serving
from tests.support.ws import WS

pytestmark = pytest.mark.timeout(120)

NBH_KEY = "sk-abcdefghij\u2011klmnop1234"  # a non-breaking hyphen pasted into a key (position 14)


def _home(tmp_path: Path, toml: str = "") -> Path:
    home = tmp_path / "home"
    home.mkdir(mode=0o700, parents=True)
    (home / "config.toml").write_text(toml or "# defaults\n")
    return home


def _refused_one_line(home: Path, *args: str, **env: str) -> str:
    r = run_cli(home, *(args or ("agents", "list")), env=cli_env(home, **env))
    assert r.code == 2, (r.code, r.out, r.err)
    assert "Traceback" not in r.err and "UnicodeEncodeError" not in r.err, r.err
    assert r.err.strip() and "\n" not in r.err.strip(), r.err  # one line
    return r.err


def _provider(kind: str = "openai", extra: str = "") -> str:
    return f'[providers.x]\nkind = "{kind}"\nbase_url = "http://127.0.0.1:9/v1"\n{extra}'


# ── header values beyond ASCII or with controls: refused at load ───────────────────────────────


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
@pytest.mark.parametrize(
    ("value", "char", "position"),
    [
        ("Café assistant", "U+00E9 (LATIN SMALL LETTER E WITH ACUTE)", 4),
        ("ab\\u0085cd", "U+0085 (NEL)", 3),  # a C1 control (NEL): a control, and not ASCII
        ("x\\u009bhidden", "U+009B", 2),  # C1 CSI
        ("see\\u00a0here", "U+00A0 (NO-BREAK SPACE)", 4),
        ("a\\u2011b", "U+2011 (NON-BREAKING HYPHEN)", 2),
        ("v\\u007f", "U+007F (DEL)", 2),
    ],
)
def test_a_header_value_http_cannot_carry_is_refused_at_load(
    tmp_path: Path, kind: str, value: str, char: str, position: int
) -> None:
    home = _home(tmp_path, _provider(kind, f'headers = {{ "X-Title" = "{value}" }}\n'))
    err = _refused_one_line(home)
    assert "config.toml: [providers.x] headers: the value of 'X-Title'" in err, err
    assert f"{char} at position {position}" in err, err
    assert "assistant" not in err and "hidden" not in err and "here" not in err, err  # the value is not echoed


def test_a_header_value_from_an_environment_override_is_refused(tmp_path: Path) -> None:
    home = _home(tmp_path, _provider())
    err = _refused_one_line(home, APPSERVER_PROVIDERS__X__HEADERS=json.dumps({"X-Title": "Caf\u00e9 bar"}))
    assert err.startswith("error: APPSERVER_PROVIDERS__X__HEADERS: [providers.x] headers: the value of 'X-Title'"), err
    assert "U+00E9" in err and "position 4" in err and "Caf" not in err, err
    # a provider only the environment names
    err = _refused_one_line(
        _home(tmp_path / "b"),
        APPSERVER_PROVIDERS__Y__BASE_URL="http://127.0.0.1:9/v1",
        APPSERVER_PROVIDERS__Y__HEADERS=json.dumps({"X-Key": "tok\u0085en-secret"}),
    )
    assert "[providers.y] headers: the value of 'X-Key'" in err and "U+0085" in err and "secret" not in err, err


def test_plain_ascii_header_values_still_load(tmp_path: Path) -> None:
    home = _home(tmp_path, _provider("openai", 'headers = { "X-Title" = "Cafe assistant", "X-T" = "a\\tb ~!" }\n'))
    assert run_cli(home, "agents", "list").code == 0


def test_a_non_ascii_host_is_refused_with_its_idna_form(tmp_path: Path) -> None:
    home = _home(tmp_path, '[providers.x]\nbase_url = "http://café.example/v1"\n')
    err = _refused_one_line(home)
    assert "[providers.x] base_url" in err and "xn--caf-dma.example" in err, err
    # non-ASCII in the path is fine: the client percent-encodes it
    ok = _home(tmp_path / "ok", '[providers.x]\nbase_url = "http://127.0.0.1:9/café/v1"\n')
    assert run_cli(ok, "agents", "list").code == 0


# ── API keys: checked at load where the variable is visible ────────────────────────────────────


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
def test_a_non_ascii_api_key_is_refused_at_load_naming_the_variable_never_the_key(tmp_path: Path, kind: str) -> None:
    home = _home(tmp_path, _provider(kind, 'api_key_env = "AZ_KEY"\n'))
    err = _refused_one_line(home, AZ_KEY=NBH_KEY)
    assert err.startswith("error: AZ_KEY: the API key of [providers.x]"), err
    assert "U+2011 (NON-BREAKING HYPHEN) at position 14" in err, err
    for part in ("abcdefghij", "klmnop1234", NBH_KEY):
        assert part not in err, err
    # `appserver run` too: one line, exit 2, no traceback
    _refused_one_line(home, "run", "--agent", "assistant", "hi", AZ_KEY=NBH_KEY)


@pytest.mark.parametrize(
    ("key", "needle"),
    [
        ("sk-abcdefghijklmnop1234\r", "U+000D (CR) at position 24"),
        ("sk-abcdefgh\nInjected: 1", "U+000A (LF) at position 12"),
        ("sk-abcdefgh\tijklmnop", "U+0009 (TAB) at position 12"),
        ("sk-\u00a0abcdefghijklmnop", "U+00A0 (NO-BREAK SPACE) at position 4"),
    ],
)
def test_an_api_key_with_a_control_or_non_ascii_character_is_refused(tmp_path: Path, key: str, needle: str) -> None:
    home = _home(tmp_path, _provider("openai", 'api_key_env = "AZ_KEY"\n'))
    err = _refused_one_line(home, AZ_KEY=key)
    assert "AZ_KEY" in err and needle in err and "abcdefgh" not in err, err


def test_the_key_variable_named_by_an_override_and_the_builtin_provider_are_checked(tmp_path: Path) -> None:
    home = _home(tmp_path, _provider())
    err = _refused_one_line(home, APPSERVER_PROVIDERS__X__API_KEY_ENV="OTHER_KEY", OTHER_KEY=NBH_KEY)
    assert err.startswith("error: OTHER_KEY: the API key of [providers.x]") and "U+2011" in err, err
    err = _refused_one_line(_home(tmp_path / "b"), OPENAI_API_KEY=NBH_KEY)
    assert err.startswith("error: OPENAI_API_KEY: the API key of [providers.openai]") and "U+2011" in err, err
    # an ordinary key loads
    assert run_cli(home, "agents", "list", env=cli_env(home, AZ_KEY="sk-abcdefghij-klmnop1234")).code == 0


def test_load_config_checks_the_environ_it_is_given(tmp_path: Path) -> None:
    from appserver.config import ConfigError

    home = _home(tmp_path, _provider("openai", 'api_key_env = "AZ_KEY"\n'))
    with pytest.raises(ConfigError, match=r"AZ_KEY: .* U\+2011"):
        load_config(home, environ={"AZ_KEY": NBH_KEY})
    assert load_config(home, environ={"AZ_KEY": "sk-fine-key-123456"}).providers["x"].api_key_env == "AZ_KEY"


# ── at turn time: a key that turned bad after the load, a header no check saw ──────────────────


def _request() -> ProviderRequest:
    return ProviderRequest(model="m", messages=[ChatMessage("user", "hi")])


async def _first_error(provider: OpenAICompatProvider | AnthropicProvider) -> ProviderError:
    try:
        with pytest.raises(ProviderError) as info:
            async for _ in provider.stream(_request()):
                pass
        return info.value
    finally:
        await provider.aclose()


@pytest.mark.parametrize("cls", [OpenAICompatProvider, AnthropicProvider])
@pytest.mark.parametrize("transport", ["lean", "httpx"])
async def test_a_bad_key_read_at_turn_time_is_a_provider_error(
    monkeypatch: pytest.MonkeyPatch, cls: type[OpenAICompatProvider] | type[AnthropicProvider], transport: str
) -> None:
    monkeypatch.setenv("S19_TURN_KEY", NBH_KEY)
    cfg = ProviderConfig(name="az", base_url="http://127.0.0.1:9/v1", api_key_env="S19_TURN_KEY", transport=transport)
    exc = await _first_error(cls(cfg))
    assert exc.kind == "auth", exc
    assert "S19_TURN_KEY" in exc.message and "[providers.az]" in exc.message, exc.message
    assert "U+2011 (NON-BREAKING HYPHEN) at position 14" in exc.message, exc.message
    assert "abcdefghij" not in exc.message and "klmnop" not in exc.message


@pytest.mark.parametrize("cls", [OpenAICompatProvider, AnthropicProvider])
@pytest.mark.parametrize("transport", ["lean", "httpx"])
async def test_an_unsendable_header_is_a_provider_error_even_unchecked(
    monkeypatch: pytest.MonkeyPatch, cls: type[OpenAICompatProvider] | type[AnthropicProvider], transport: str
) -> None:
    cfg = ProviderConfig(
        name="hx", base_url="http://127.0.0.1:9/v1", api_key_env=None, transport=transport, headers={"X-Title": "Café"}
    )
    exc = await _first_error(cls(cfg))
    assert exc.kind == "auth" and "[providers.hx] headers: the value of 'X-Title'" in exc.message, exc.message
    assert "U+00E9" in exc.message and "Café" not in exc.message
    # belt and braces: with the provider's own check gone, the HTTP client's encoding error is still
    # a ProviderError, never a UnicodeEncodeError out of the turn
    module = "appserver.providers." + ("openai_compat" if cls is OpenAICompatProvider else "anthropic")
    monkeypatch.setattr(module + ".check_extra_headers", lambda cfg: None)
    exc = await _first_error(cls(cfg))
    assert exc.kind == "auth" and "U+00E9" in exc.message and "[providers.hx]" in exc.message, exc.message


async def test_a_turn_whose_key_turned_bad_fails_with_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    home = tmp_path / "home"
    toml = '[providers.az]\nbase_url = "http://127.0.0.1:9/v1"\napi_key_env = "S19_LATE_KEY"\n'
    home.mkdir()
    (home / "config.toml").write_text(toml)
    r = run_cli(home, "agents", "create", "--name", "late", "--model", "az:m")
    assert r.code == 0, r.err
    server = await open_server(home)  # its environ has no S19_LATE_KEY: the load sees none
    try:
        monkeypatch.setenv("S19_LATE_KEY", NBH_KEY)  # set after the load: read by the turn
        with caplog.at_level(logging.DEBUG):
            sub = await server.kernel.submit(SubmitRequest(agent="late", input="hi", conversation="new"))
            snap = await sub.wait(10)
    finally:
        await server.close()
    assert (snap.status, snap.stop_reason) == ("failed", "error"), snap
    assert snap.error is not None and snap.error["kind"] == "auth", snap.error
    assert "S19_LATE_KEY" in snap.error["message"] and "U+2011" in snap.error["message"], snap.error
    assert "klmnop" not in json.dumps(snap.error)
    assert "Traceback" not in caplog.text and "UnicodeEncodeError" not in caplog.text, caplog.text
    assert not [rec for rec in caplog.records if rec.exc_info], caplog.text


# ── redaction: every form of a secret an upstream may quote ───────────────────────────────────

# ASCII (anything else is refused at load) but with everything JSON or a URL escapes.
API_KEY = 'k3y"With\\Quote/and<&>-backslash-KEYTAIL-123'
HDR_SECRET = 'Hdr"Secret\\Value/9988&x-HDRTAIL'
TAILS = ("KEYTAIL", "HDRTAIL")  # a fragment of each secret: a partial leak shows as one of these


def _forms(secret: str) -> set[str]:
    """What an upstream may write of `secret`, computed here (not by the code under test)."""
    once = {json.dumps(secret)[1:-1], json.dumps(secret, ensure_ascii=False)[1:-1]}
    once |= {f.replace("/", "\\/") for f in once}
    once.add(json.dumps(secret)[1:-1].replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026"))
    twice = {json.dumps(f)[1:-1] for f in once}
    url = {quote(secret, safe=""), quote(secret), quote_plus(secret)}
    return {secret, *once, *twice, *url}


class QuotingUpstream:
    """A 401 whose message quotes the request's headers in every form: as JSON (ensure_ascii on and
    off, `/` as `\\/`), JSON inside a JSON string, and URL-encoded; and its body echoes them as an
    object (raw strings once parsed)."""

    def __init__(self) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("content-length") or 0))
                hdrs = dict(self.headers.items())
                as_json = json.dumps(hdrs)
                said = (
                    f"Invalid key. headers={as_json} plain={json.dumps(hdrs, ensure_ascii=False)} "
                    f"php={as_json.replace('/', chr(92) + '/')} nested={json.dumps(as_json)} "
                    f"url=?auth={quote(hdrs.get('Authorization', ''), safe='')}"
                    f"&x={quote_plus(hdrs.get('X-Custom-Auth', ''))}&y={quote(hdrs.get('X-Custom-Auth', ''))}"
                    f"&z={quote(hdrs.get('Authorization', '').removeprefix('Bearer '), safe='')}"
                )
                data = json.dumps({"error": {"message": said, "type": "invalid_request_error", "echo": hdrs}}).encode()
                self.send_response(401)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def upstream() -> Iterator[QuotingUpstream]:
    up = QuotingUpstream()
    yield up
    up.close()


def _assert_clean(where: str, text: str) -> None:
    for secret in (API_KEY, HDR_SECRET):
        for form in _forms(secret):
            assert form not in text, (where, form, text)
    for tail in TAILS:
        assert tail not in text, (where, tail, text)


def test_secrets_with_quotes_and_backslashes_are_redacted_in_every_form(
    tmp_path: Path, upstream: QuotingUpstream
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    toml_header = json.dumps(HDR_SECRET)  # a TOML basic string is written as JSON writes it
    (home / "config.toml").write_text(
        f'[providers.evil]\nbase_url = "http://127.0.0.1:{upstream.port}/v1"\napi_key_env = "S19_EVIL_KEY"\n'
        f'headers = {{ "X-Custom-Auth" = {toml_header} }}\n'
    )
    env = cli_env(home, S19_EVIL_KEY=API_KEY)
    assert run_cli(home, "agents", "create", "--name", "ev", "--model", "evil:m", env=env).code == 0
    # the CLI's turn
    r = run_cli(home, "run", "--agent", "ev", "hello", env=env)
    assert r.code != 0 and "Invalid key" in r.err and "[redacted sha256:" in r.err, r.err
    assert "Traceback" not in r.err, r.err
    _assert_clean("run", r.out + r.err)
    with serving(home, env=env) as sp:
        resp = httpx.post(
            sp.url + "/v1/chat/completions",
            json={"model": "ev", "messages": [{"role": "user", "content": "hi"}]},
            timeout=30,
        )
        assert resp.status_code == 502, resp.text
        message = resp.json()["error"]["message"]
        assert "Invalid key" in message and "[redacted sha256:" in message, message
        _assert_clean("http body", resp.text)
        _assert_clean("http message", message)

        async def over_ws() -> dict[str, Any]:
            ws = await WS.open(sp.url, open_timeout=15)
            try:
                ack = await ws.request({"type": "submit_input", "agent": "ev", "input": "hi"})
                return await ws.terminal(ack["turn_id"], 30)
            finally:
                await ws.close()

        snap = asyncio.run(over_ws())
        assert snap["status"] == "failed", snap
        _assert_clean("ws snapshot", json.dumps(snap))
        _assert_clean("ws snapshot (raw)", json.dumps(snap, ensure_ascii=False))
        sp.stop()
        log = sp.proc.stderr.read() if sp.proc.stderr else ""
    _assert_clean("serve log", log)
    with sqlite3.connect(home / "appserver.db") as db:
        errors = [row[0] for row in db.execute("SELECT error FROM turns WHERE error IS NOT NULL")]
    assert len(errors) >= 3 and all("[redacted sha256:" in e for e in errors), errors
    for e in errors:
        _assert_clean("stored error", e)
        _assert_clean("stored error (decoded)", json.dumps(json.loads(e), ensure_ascii=False))


@pytest.mark.parametrize(
    "secret",
    [
        API_KEY,
        HDR_SECRET,
        "pass wörd/with space+plus",  # a base_url's user or query value may hold anything
        "\u00e9\u00e8\u00ea\u00eb\u2028\u00e0\u00e2-unicode",
        "back\\\\slashes\\\\only",
    ],
)
def test_the_redactor_masks_every_form_of_a_known_secret(secret: str) -> None:
    red = SecretRedactor(secrets=[secret])
    expected = red.redact(secret)
    assert expected.startswith("[redacted sha256:") and expected.endswith("]"), expected
    for form in _forms(secret):
        text = f'{{"Authorization": "Bearer {form}", "X": "{form}", "q": "?k={form}&n=1"}}'
        out = red.redact(text)
        assert form not in out, (form, out)
        assert expected in out, (form, out)  # masked with the fingerprint of the secret itself


def test_an_unknown_secret_field_is_masked_over_escaped_quotes() -> None:
    red = SecretRedactor()
    text = '{"Authorization": "Bearer unknown\\"Quote\\\\and-TAILSECRET", "next": "kept"}'
    out = red.redact(text)
    assert "TAILSECRET" not in out and '"next": "kept"' in out, out
    out = red.redact("{'password': 'it\\'s-a-TAILSECRET'}")
    assert "TAILSECRET" not in out, out
    # an already masked Bearer value is left as masked (one fingerprint, the key's own)
    known = SecretRedactor(secrets=["k3y-known-secret-1"])
    out = known.redact('{"authorization": "Bearer k3y-known-secret-1"}')
    assert out == '{"authorization": "Bearer ' + known.redact("k3y-known-secret-1") + '"}', out


def test_the_log_filter_masks_every_form_of_the_configured_secrets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = _home(
        tmp_path,
        '[providers.evil]\nbase_url = "http://127.0.0.1:9/v1"\napi_key_env = "S19_LOG_KEY"\n'
        f'headers = {{ "X-Custom-Auth" = {json.dumps(HDR_SECRET)} }}\n',
    )
    monkeypatch.setenv("S19_LOG_KEY", API_KEY)  # serve's redactor reads the key variables
    red = from_config(load_config(home))
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(red)
    logger = logging.getLogger("s19.redact")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        for secret in (API_KEY, HDR_SECRET):
            for form in _forms(secret):
                logger.warning('upstream said {"Authorization": "Bearer %s"}', form)
                logger.warning("upstream said headers=%s", form)
    finally:
        logger.removeHandler(handler)
    _assert_clean("log", stream.getvalue())
    assert stream.getvalue().count("[redacted sha256:") >= 2 * len(_forms(API_KEY)), stream.getvalue()


# ------------------------------------------------------------------ a password in base_url


def test_a_base_url_password_is_masked_in_config_errors_and_redacted_as_sent(tmp_path: Path) -> None:
    """A refused base_url is quoted with its password and query values masked; the password is
    redacted both as written (percent-encoded) and as the transports send it (decoded, in Basic)."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.toml").write_text(
        '[providers.x]\nkind = "openai"\nbase_url = "http://user:p%40ssw0rd-secret@host:99999/v1?api-key=qk-123456789"\n'
    )
    r = run_cli(home, "agents", "list", env=cli_env(home))
    assert r.code == 2 and "Port out of range" in r.err, (r.code, r.err)
    assert "p%40ssw0rd-secret" not in r.err and "qk-123456789" not in r.err and "user:***@" in r.err, r.err
    (home / "config.toml").write_text(
        '[providers.x]\nkind = "openai"\nbase_url = "http://user:p%40ssw0rd-secret@host/v1"\n'
    )
    redactor = from_config(load_config(home=home, environ={}))
    said = redactor.redact("upstream says: bad password p@ssw0rd-secret (p%40ssw0rd-secret)")
    assert "ssw0rd-secret" not in said, said
