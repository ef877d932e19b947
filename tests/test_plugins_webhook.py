"""The first-party webhook channel over real loopback sockets: signed deliveries in (401 before any
parsing when the signature or its time is wrong), signed replies out, errors mapped for the gateway."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from plugins.contract import Account, AccountError, Adapter, AdapterContext, DeliveryError, InboundMessage, Target
from plugins.loader import load_plugin
from plugins.webhook import SIGNATURE_HEADER, TIMESTAMP_HEADER, WebhookAdapter, create_adapter, sign, verify
from tests.fakes.loopback import QuickServer
from tests.support.net import free_port, listening

SECRET = "s3cret-for-tests"


@dataclass
class Gateway:
    """What the gateway would be: messages handed over, states reported, and an optional failure."""

    tmp: Path
    messages: list[InboundMessage] = field(default_factory=list)
    states: list[tuple[str, str | None]] = field(default_factory=list)
    fail: Exception | None = None

    async def on_message(self, msg: InboundMessage) -> None:
        if self.fail is not None:
            raise self.fail
        self.messages.append(msg)

    def context(self) -> AdapterContext:
        return AdapterContext(
            on_message=self.on_message,
            report=lambda state, reason: self.states.append((state, reason)),
            data_dir=self.tmp,
            log=logging.getLogger("test.webhook"),
        )


def make_account(secret: str | None = SECRET, **settings: Any) -> Account:
    settings.setdefault("listen", "127.0.0.1:0")
    return Account("webhook", "hooks", settings, {"secret": secret} if secret is not None else {})


Start = Callable[..., Awaitable[WebhookAdapter]]


@pytest.fixture
def gateway(tmp_path: Path) -> Gateway:
    return Gateway(tmp_path)


@pytest.fixture
async def start(gateway: Gateway) -> AsyncIterator[Start]:
    started: list[WebhookAdapter] = []

    async def _start(**settings: Any) -> WebhookAdapter:
        adapter = create_adapter(make_account(**settings), gateway.context())
        await adapter.start()
        started.append(adapter)
        return adapter

    yield _start
    for adapter in started:
        await adapter.stop()


def message(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"id": "d-1", "chat": "kitchen", "sender": "ha", "text": "lights off?"}
    body.update(overrides)
    return body


async def post(
    adapter: WebhookAdapter,
    body: bytes | dict[str, Any],
    *,
    secret: str = SECRET,
    timestamp: str | None = None,
    signature: str | None = None,
    path: str = "/",
    headers: dict[str, str] | None = None,
) -> httpx.Response:
    raw = json.dumps(body).encode() if isinstance(body, dict) else body
    ts = timestamp if timestamp is not None else str(int(time.time()))
    sent = {
        TIMESTAMP_HEADER: ts,
        SIGNATURE_HEADER: signature or sign(secret, ts, raw),
        "Content-Type": "application/json",
    }
    sent.update(headers or {})
    async with httpx.AsyncClient(timeout=5) as client:
        return await client.post(f"http://127.0.0.1:{adapter.bound_port}{path}", content=raw, headers=sent)


# inbound


async def test_a_signed_delivery_reaches_the_gateway_and_gets_202(start: Start, gateway: Gateway) -> None:
    adapter = await start()
    assert adapter.bound_port and adapter.is_running and ("running", None) in gateway.states
    assert isinstance(adapter, Adapter)
    body = message(sender_name="Home Assistant", thread="t1", chat_type="group", reply_to="d-0")
    response = await post(adapter, body)
    assert response.status_code == 202 and response.json() == {"accepted": True, "id": "d-1"}
    [msg] = gateway.messages
    assert (msg.channel, msg.account, msg.message_id, msg.chat, msg.sender, msg.text) == (
        "webhook",
        "hooks",
        "d-1",
        "kitchen",
        "ha",
        "lights off?",
    )
    assert (msg.thread, msg.chat_type, msg.sender_name, msg.reply_to, msg.mentions_bot) == (
        "t1",
        "group",
        "Home Assistant",
        "d-0",
        True,
    )
    assert msg.ts is not None and abs(msg.ts - time.time()) < 5 and msg.raw == body


async def test_defaults_and_a_repeated_id_is_handed_over_for_the_ledger(start: Start, gateway: Gateway) -> None:
    adapter = await start(path="/hooks/agent")
    for _ in range(2):
        assert (await post(adapter, message(), path="/hooks/agent")).status_code == 202
    assert [m.message_id for m in gateway.messages] == ["d-1", "d-1"]  # the gateway's ledger dedupes
    msg = gateway.messages[0]
    assert msg.chat_type == "dm" and msg.thread is None and msg.sender_name is None and msg.mentions_bot


@pytest.mark.parametrize(
    "tamper",
    [
        {"signature": "sha256=" + "0" * 64},
        {"secret": "not-the-secret"},
        {"signature": "garbage"},
        {"headers": {SIGNATURE_HEADER: ""}},
        {"headers": {TIMESTAMP_HEADER: ""}},
        {"timestamp": "12.5"},
    ],
)
async def test_a_bad_signature_is_401_and_reaches_nothing(start: Start, gateway: Gateway, tamper: Any) -> None:
    adapter = await start()
    response = await post(adapter, message(), **tamper)
    assert response.status_code == 401 and response.json()["accepted"] is False
    assert gateway.messages == []


async def test_a_body_changed_after_signing_is_401(start: Start, gateway: Gateway) -> None:
    adapter = await start()
    ts = str(int(time.time()))
    signature = sign(SECRET, ts, json.dumps(message()).encode())
    response = await post(adapter, message(text="rm -rf"), timestamp=ts, signature=signature)
    assert response.status_code == 401 and gateway.messages == []


@pytest.mark.parametrize("skew", [-305, 305, -10_000])  # a few seconds past ±300: a loaded machine is slow
async def test_a_stale_or_future_timestamp_is_401(start: Start, gateway: Gateway, skew: int) -> None:
    adapter = await start()
    response = await post(adapter, message(), timestamp=str(int(time.time()) + skew))  # correctly signed
    assert response.status_code == 401 and "timestamp" in response.json()["error"]
    assert gateway.messages == []
    adapter2 = await start(tolerance_s=20_000)
    assert (await post(adapter2, message(), timestamp=str(int(time.time()) + skew))).status_code == 202


async def test_an_oversized_body_is_413(start: Start, gateway: Gateway) -> None:
    adapter = await start(max_body_bytes=1024)
    response = await post(adapter, message(text="x" * 4096))
    assert response.status_code == 413 and gateway.messages == []
    assert (await post(adapter, message(text="x" * 500))).status_code == 202


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (b"{not json", "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        (message(id=None), "id must be"),
        (message(chat=""), "chat must be"),
        (message(sender=7), "sender must be"),
        (message(text=""), "text must be"),
        (message(chat_type="channel"), "chat_type"),
        (message(mentions_bot="yes"), "mentions_bot"),
        (message(thread=5), "thread must be"),
        (message(chat="a:b"), "must not contain ':'"),
        (message(chat="room\n2"), "chat must not contain control characters"),
        (message(thread="t\x00"), "thread must not contain control characters"),
        (message(id="x" * 2000), "longer than"),
    ],
)
async def test_malformed_signed_bodies_are_400(
    start: Start, gateway: Gateway, body: bytes | dict[str, Any], error: str
) -> None:
    adapter = await start()
    response = await post(adapter, body)
    assert response.status_code == 400 and error in response.json()["error"]
    assert gateway.messages == []


async def test_when_the_gateway_cannot_record_the_sender_gets_503(start: Start, gateway: Gateway) -> None:
    adapter = await start()
    gateway.fail = RuntimeError("ledger is locked")
    response = await post(adapter, message())
    assert response.status_code == 503 and response.headers["retry-after"]
    gateway.fail = None
    assert (await post(adapter, message())).status_code == 202


async def test_other_methods_and_paths(start: Start) -> None:
    adapter = await start(path="/in")
    async with httpx.AsyncClient(timeout=5) as client:
        get = await client.get(f"http://127.0.0.1:{adapter.bound_port}/in")
        assert get.status_code == 405 and get.headers["allow"] == "POST"
    assert (await post(adapter, message(), path="/elsewhere")).status_code == 404


# lifecycle and settings


def test_a_missing_secret_is_an_account_error(gateway: Gateway) -> None:
    for secret in (None, ""):
        with pytest.raises(AccountError) as info:
            create_adapter(make_account(secret=secret), gateway.context())
        assert "secret_env" in str(info.value) and "secret_file" in str(info.value)


@pytest.mark.parametrize(
    "settings",
    [
        {"listen": "8788"},
        {"listen": "127.0.0.1:port"},
        {"listen": "127.0.0.1:70000"},
        {"path": "hooks"},
        {"reply_url": "ftp://x"},
        {"max_body_bytes": 0},
        {"tolerance_s": "soon"},
    ],
)
def test_bad_settings_are_account_errors(gateway: Gateway, settings: dict[str, Any]) -> None:
    with pytest.raises(AccountError):
        create_adapter(make_account(**settings), gateway.context())


async def test_a_port_in_use_is_an_account_error(gateway: Gateway) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        adapter = create_adapter(make_account(listen=f"127.0.0.1:{port}"), gateway.context())
        with pytest.raises(AccountError, match="cannot listen"):
            await adapter.start()
        assert not adapter.is_running


async def test_start_and_stop_on_a_named_port(gateway: Gateway, caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()
    adapter = create_adapter(make_account(listen=f"127.0.0.1:{port}"), gateway.context())
    caplog.set_level(logging.INFO, logger="test.webhook")
    await adapter.start()
    assert adapter.bound_port == port and listening(port)
    assert f"listening on http://127.0.0.1:{port}/" in caplog.text
    began = time.monotonic()
    await adapter.stop()
    assert time.monotonic() - began < 5
    assert not adapter.is_running and not listening(port) and gateway.states[-1] == ("stopped", None)
    await adapter.start()  # a stopped adapter starts again on the same port
    assert listening(port)
    await adapter.stop()


async def test_stop_is_bounded_while_the_gateway_hangs(tmp_path: Path) -> None:
    entered = asyncio.Event()

    async def hang(msg: InboundMessage) -> None:
        entered.set()
        await asyncio.Event().wait()

    context = AdapterContext(hang, lambda state, reason: None, tmp_path, logging.getLogger("test.webhook"))
    adapter = create_adapter(make_account(), context)
    await adapter.start()
    pending = asyncio.create_task(post(adapter, message()))
    await asyncio.wait_for(entered.wait(), 5)
    began = time.monotonic()
    await adapter.stop()
    assert time.monotonic() - began < 5 and not adapter.is_running
    try:  # never a 2xx: the sender retries, and the ledger dedupes
        assert (await pending).status_code >= 500
    except httpx.HTTPError:
        pass


async def test_the_loader_gives_the_webhook_adapter(tmp_path: Path, gateway: Gateway) -> None:
    create = load_plugin("webhook", tmp_path)
    adapter = create(make_account(), gateway.context())
    assert isinstance(adapter, WebhookAdapter) and adapter.limits.max_length == 100_000 and not adapter.limits.can_edit


# outbound


@dataclass
class Receiver:
    """A loopback HTTP endpoint standing in for the user's app: records requests, answers as told."""

    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    body: str = ""
    requests: list[tuple[dict[str, str], bytes]] = field(default_factory=list)
    port: int = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        self.requests.append((dict(request.headers), await request.body()))
        await Response(self.body, status_code=self.status, headers=self.headers)(scope, receive, send)


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    recv = Receiver()
    sock = socket.create_server(("127.0.0.1", 0))
    recv.port = sock.getsockname()[1]
    server = _QuietServer(uvicorn.Config(recv, interface="asgi3", lifespan="off", log_level="warning"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    yield recv
    server.should_exit = True
    await task


class _QuietServer(QuickServer):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # leave pytest's signal handlers alone
        yield


async def test_send_posts_a_signed_reply(receiver: Receiver, gateway: Gateway) -> None:
    adapter = create_adapter(make_account(reply_url=f"http://127.0.0.1:{receiver.port}/reply"), gateway.context())
    try:
        ids = await adapter.send(Target(chat="kitchen", thread="t1", reply_to="d-1"), "Done. ✓")
    finally:
        await adapter.stop()
    [(headers, body)] = receiver.requests
    ts = headers[TIMESTAMP_HEADER.lower()]
    assert verify(SECRET, ts, body, headers[SIGNATURE_HEADER.lower()])
    assert abs(int(ts) - time.time()) < 5 and headers["content-type"] == "application/json"
    payload = json.loads(body)
    assert payload == {
        "id": ids[0],
        "chat": "kitchen",
        "thread": "t1",
        "reply_to": "d-1",
        "text": "Done. ✓",
        "account": "hooks",
    }
    assert len(ids) == 1 and len(ids[0]) == 36


@pytest.mark.parametrize(
    ("status", "headers", "retry_after", "permanent"),
    [
        (429, {"Retry-After": "7"}, 7.0, False),
        (503, {"Retry-After": "2"}, 2.0, False),
        (429, {}, None, False),
        (500, {}, None, False),
        (502, {}, None, False),
        (404, {}, None, True),
        (401, {}, None, True),
    ],
)
async def test_send_maps_refusals(
    receiver: Receiver,
    gateway: Gateway,
    status: int,
    headers: dict[str, str],
    retry_after: float | None,
    permanent: bool,
) -> None:
    receiver.status, receiver.headers, receiver.body = status, headers, "no such chat " * 40
    adapter = create_adapter(make_account(reply_url=f"http://127.0.0.1:{receiver.port}/"), gateway.context())
    with pytest.raises(DeliveryError) as info:
        await adapter.send(Target(chat="c"), "hi")
    await adapter.stop()
    err = info.value
    assert (err.retry_after, err.permanent) == (retry_after, permanent)
    assert str(status) in err.reason and "no such chat" in err.reason and len(err.reason) < 300


async def test_send_without_reply_url_or_to_a_closed_port(gateway: Gateway) -> None:
    adapter = create_adapter(make_account(), gateway.context())
    with pytest.raises(DeliveryError) as info:
        await adapter.send(Target(chat="c"), "hi")
    assert info.value.permanent and info.value.reason == "no reply_url configured"
    adapter = create_adapter(make_account(reply_url=f"http://127.0.0.1:{free_port()}/"), gateway.context())
    with pytest.raises(DeliveryError) as info:
        await adapter.send(Target(chat="c"), "hi")
    await adapter.stop()
    assert not info.value.permanent and "unreachable" in info.value.reason


def test_sign_is_the_documented_scheme() -> None:
    import hashlib
    import hmac

    expected = hmac.new(b"k", b"1700000000." + b'{"a":1}', hashlib.sha256).hexdigest()
    assert sign("k", "1700000000", b'{"a":1}') == f"sha256={expected}"
    assert verify("k", "1700000000", b'{"a":1}', f"sha256={expected}")
    assert not verify("k", "1700000001", b'{"a":1}', f"sha256={expected}")
