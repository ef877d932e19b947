"""Session 20: a `base_url` with a query string, and provider secrets an upstream quotes base64-encoded.

* `base_url = "http://host/v1?api-key=…"` (gateways that take the key or an API version in the
  query) sends the model call to `/v1/chat/completions?api-key=…` (`/v1/messages?…` for the
  anthropic kind), on both transports: the endpoint path goes before the query, never after it.
* A provider secret echoed base64-encoded (standard or URL-safe, at any byte offset inside the
  encoded text, as in `Basic base64(user:secret)`) is redacted like its other forms.
"""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from appserver.config import ProviderConfig
from appserver.logredact import SecretRedactor
from appserver.providers.anthropic import AnthropicProvider
from appserver.providers.base import ChatMessage, ProviderRequest
from appserver.providers.openai_compat import OpenAICompatProvider
from appserver.providers.upstream import endpoint_url

pytestmark = pytest.mark.timeout(60)


class PathRecorder:
    """An upstream that records each request target and answers a one-word completion."""

    def __init__(self) -> None:
        seen: list[str] = []
        self.seen = seen

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("content-length") or 0))
                seen.append(self.path)
                if "/messages" in self.path:  # the anthropic kind always streams
                    events = [
                        (
                            "message_start",
                            {
                                "type": "message_start",
                                "message": {
                                    "id": "msg_1",
                                    "type": "message",
                                    "role": "assistant",
                                    "model": "m",
                                    "content": [],
                                    "usage": {"input_tokens": 1, "output_tokens": 0},
                                },
                            },
                        ),
                        (
                            "content_block_start",
                            {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                        ),
                        (
                            "content_block_delta",
                            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "ok"}},
                        ),
                        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
                        (
                            "message_delta",
                            {
                                "type": "message_delta",
                                "delta": {"stop_reason": "end_turn"},
                                "usage": {"output_tokens": 1},
                            },
                        ),
                        ("message_stop", {"type": "message_stop"}),
                    ]
                    data = "".join(f"event: {n}\ndata: {json.dumps(b)}\n\n" for n, b in events).encode()
                    ctype = "text/event-stream"
                else:
                    body = {
                        "id": "c1",
                        "object": "chat.completion",
                        "created": 0,
                        "model": "m",
                        "choices": [
                            {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
                        ],
                    }
                    data = json.dumps(body).encode()
                    ctype = "application/json"
                self.send_response(200)
                self.send_header("content-type", ctype)
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
def recorder() -> Iterator[PathRecorder]:
    up = PathRecorder()
    yield up
    up.close()


@pytest.mark.parametrize(
    ("base", "path", "unless", "expected"),
    [
        ("http://h/v1?api-key=X", "/chat/completions", "", "http://h/v1/chat/completions?api-key=X"),
        ("http://u:p@h/v1/?a=1&b=2", "/chat/completions", "", "http://u:p@h/v1/chat/completions?a=1&b=2"),
        ("http://h/v1#frag", "/chat/completions", "", "http://h/v1/chat/completions"),
        ("http://h", "/v1/messages", "/v1", "http://h/v1/messages"),
        ("http://h/v1/", "/v1/messages", "/v1", "http://h/v1/messages"),
        ("http://h/proxy/v1?k=1", "/v1/messages", "/v1", "http://h/proxy/v1/messages?k=1"),
        ("http://h/anthropic", "/v1/messages", "/v1", "http://h/anthropic/v1/messages"),
    ],
)
def test_endpoint_url_puts_the_path_before_the_query(base: str, path: str, unless: str, expected: str) -> None:
    assert endpoint_url(base, path, unless_ends=unless) == expected


@pytest.mark.parametrize("cls", [OpenAICompatProvider, AnthropicProvider])
@pytest.mark.parametrize("transport", ["lean", "httpx"])
async def test_a_query_in_base_url_stays_after_the_endpoint_path(
    recorder: PathRecorder, cls: type[OpenAICompatProvider] | type[AnthropicProvider], transport: str
) -> None:
    cfg = ProviderConfig(
        name="q",
        kind="openai" if cls is OpenAICompatProvider else "anthropic",
        base_url=f"http://127.0.0.1:{recorder.port}/v1?api-key=qk-123456789&api-version=2024-10-21",
        api_key_env=None,
        transport=transport,
        max_attempts=1,
    )
    provider = cls(cfg)
    try:
        events = [e async for e in provider.stream(ProviderRequest(model="m", messages=[ChatMessage("user", "hi")]))]
    finally:
        await provider.aclose()
    assert events, "the call answered nothing"
    endpoint = "/v1/chat/completions" if cls is OpenAICompatProvider else "/v1/messages"
    assert recorder.seen == [endpoint + "?api-key=qk-123456789&api-version=2024-10-21"], recorder.seen


SECRET = "sk-proj-SUPERsecretKEY123"


@pytest.mark.parametrize("prefix", ["", "a", "ab", "u:", "user:", "ab\u00e9"])
@pytest.mark.parametrize("encode", [base64.b64encode, base64.urlsafe_b64encode])
def test_a_secret_echoed_base64_encoded_is_redacted_at_any_offset(prefix: str, encode: Any) -> None:
    red = SecretRedactor(secrets=[SECRET])
    encoded = encode((prefix + SECRET + "!").encode()).decode()
    out = red.redact(f"upstream said: credentials={encoded} (rejected)")
    assert red.redact(SECRET) in out, out  # masked with the secret's own fingerprint
    # what is left of the encoded text cannot be decoded back into any long piece of the secret
    left = out.split("credentials=")[1].split(" (rejected)")[0]
    for piece in left.split(red.redact(SECRET)):
        assert len(piece) <= 4 + len(prefix) * 2, (piece, out)
    # the secret's other forms still work alongside
    assert SECRET not in red.redact(f"raw {SECRET} and {encoded}")


def test_base64_forms_do_not_touch_unrelated_base64() -> None:
    red = SecretRedactor(secrets=[SECRET])
    other = base64.b64encode(b"an unrelated payload of some length").decode()
    assert red.redact(f"data={other}") == f"data={other}"


def test_a_secret_url_encoded_twice_is_redacted() -> None:
    from urllib.parse import quote

    secret = "k3y/with&stuff-SECRET99"
    red = SecretRedactor(secrets=[secret])
    twice = quote(quote(secret, safe=""), safe="")
    out = red.redact(f"GET /cb?next=%2Fv1%3Fkey%3D{twice} failed")
    assert "SECRET99" not in out and red.redact(secret) in out, out


def test_a_bare_query_key_in_base_url_is_a_secret(tmp_path: Path) -> None:
    from appserver.config import load_config
    from appserver.logredact import provider_secrets

    home = tmp_path / "home"
    home.mkdir()
    (home / "config.toml").write_text(
        '[providers.q]\nkind = "openai"\n'
        'base_url = "http://127.0.0.1:9/v1?sk-bare-query-key-123456"\napi_key_env = ""\n'
    )
    found = provider_secrets(load_config(home=home, environ={}), environ={})
    assert "sk-bare-query-key-123456" in found, found
