"""OpenAI-route hardening (issue 11, items 10, 12, 18) against a real `appserver serve`: message-count
cap and big-body parsing off the event loop, JSON the encoders or the store would choke on refused
with 400 before anything is written, OpenAI error JSON for unknown routes and methods, and an
x-request-id on every response and in the log lines of its request (checked with the openai SDK)."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
from collections.abc import Iterator

import httpx
import openai
import pytest
import websockets

from tests.support.net import SSL
from tests.test_hardening_http_edge import Srv, T, connect, read_response, start

MAX_MESSAGES = 100


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Srv]:
    home = tmp_path_factory.mktemp("api") / "home"
    s = start(home, APPSERVER_LIMITS__MAX_MESSAGES=str(MAX_MESSAGES))
    try:
        yield s
    finally:
        s.stop()


def stored(srv: Srv) -> tuple[int, int]:
    """(conversations, messages) in the server's SQLite store."""
    db = sqlite3.connect(f"file:{srv.home / 'appserver.db'}?mode=ro", uri=True, timeout=T)
    try:
        return (
            db.execute("SELECT count(*) FROM conversations").fetchone()[0],
            db.execute("SELECT count(*) FROM messages").fetchone()[0],
        )
    finally:
        db.close()


def post(srv: Srv, path: str, body: bytes | dict, **headers: str) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        srv.url + path,
        content=content,
        headers={"content-type": "application/json", **headers},
        timeout=30,
        verify=SSL,
    )


def chat_body(content: str) -> bytes:
    # Raw text so escapes like \ud800 reach the server as sent.
    return b'{"model": "assistant", "messages": [{"role": "user", "content": "' + content.encode() + b'"}]}'


def responses_body(content: str) -> bytes:
    return b'{"model": "assistant", "input": "' + content.encode() + b'"}'


# ── 11.12: JSON the parser or a later encoder chokes on is a 400, and nothing is written ─────

BAD_JSON = {
    "lone surrogate": ("\\ud800 hello", "invalid_unicode"),
    "lone low surrogate": ("x \\udfff", "invalid_unicode"),
}


@pytest.mark.parametrize("route,make", [("/v1/chat/completions", chat_body), ("/v1/responses", responses_body)])
@pytest.mark.parametrize("case", sorted(BAD_JSON))
def test_lone_surrogate_is_400_and_writes_nothing(srv: Srv, route: str, make, case: str) -> None:  # type: ignore[no-untyped-def]
    text, code = BAD_JSON[case]
    before = stored(srv)
    r = post(srv, route, make(text))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == code
    assert "surrogate" in r.json()["error"]["message"]
    assert stored(srv) == before


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/responses"])
def test_deep_nesting_and_non_numbers_are_400(srv: Srv, route: str) -> None:
    before = stored(srv)
    deep = b'{"model": "assistant", "metadata": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = post(srv, route, deep)
    assert r.status_code == 400 and r.json()["error"]["code"] == "json_too_deep"
    moderate = b'{"model": "assistant", "metadata": ' + b"[" * 200 + b"]" * 200 + b"}"
    assert post(srv, route, moderate).json()["error"]["code"] == "json_too_deep"
    for number in (b"NaN", b"Infinity", b"1e400", b"123456789012345678901234567890"):
        body = (
            b'{"model": "assistant", "temperature": '
            + number
            + b', "messages": [{"role": "user", "content": "x"}], "input": "x"}'
        )
        r = post(srv, route, body)
        assert r.status_code == 400, (number, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
    assert stored(srv) == before


def test_surrogate_pairs_and_unicode_still_work(srv: Srv) -> None:
    r = post(srv, "/v1/chat/completions", chat_body("smile \\ud83d\\ude00 caf\\u00e9"))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "echo: smile \U0001f600 café"


def test_websocket_frame_with_lone_surrogate_is_an_error_frame_and_writes_nothing(srv: Srv) -> None:
    before = stored(srv)

    async def go() -> dict:
        async with websockets.connect(srv.url.replace("http", "ws", 1) + "/ws", open_timeout=T) as ws:
            await ws.send(json.dumps({"type": "hello", "protocol": 1, "client": "test"}))
            assert json.loads(await asyncio.wait_for(ws.recv(), T))["type"] == "welcome"
            await ws.send(
                '{"type": "submit_input", "agent": "assistant", "conversation": "new", '
                '"input": "\\ud800", "request_id": "r1"}'
            )
            return json.loads(await asyncio.wait_for(ws.recv(), T))

    frame = asyncio.run(go())
    assert frame["type"] == "error" and frame["code"] == "bad_json" and frame["request_id"] == "r1"
    assert "surrogate" in frame["message"]
    assert stored(srv) == before


# ── 11.10: message count cap; big bodies parsed off the event loop ───────────────────────────


def test_message_count_is_capped_on_both_routes(srv: Srv) -> None:
    msgs = [{"role": "user", "content": f"m{i}"} for i in range(MAX_MESSAGES)]
    assert post(srv, "/v1/chat/completions", {"model": "assistant", "messages": msgs}).status_code == 200
    before = stored(srv)
    r = post(
        srv,
        "/v1/chat/completions",
        {"model": "assistant", "messages": [*msgs, {"role": "user", "content": "one more"}]},
    )
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "array_above_max_length" and err["param"] == "messages"
    assert f"maximum length {MAX_MESSAGES}" in err["message"]
    items = [{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1)
    r = post(srv, "/v1/responses", {"model": "assistant", "input": items})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    assert stored(srv) == before


def test_huge_request_of_tiny_messages_is_refused_while_the_server_stays_responsive(srv: Srv) -> None:
    # ~19.5 MiB, 560k messages: used to hold the event loop for 13 s at ~15x its size in memory.
    one = b'{"role":"user","content":"xxxxxxx"},'
    body = b'{"model":"assistant","messages":[' + one * 560_000 + b'{"role":"user","content":"x"}]}'
    assert len(body) > 19 * 1024 * 1024
    health: list[int] = []

    def probe() -> None:
        with httpx.Client(timeout=5.0) as c:  # a 5 s stall of the loop fails this probe
            for _ in range(10):
                health.append(c.get(srv.url + "/healthz").status_code)

    results: list[httpx.Response] = []
    senders = [
        threading.Thread(target=lambda: results.append(post(srv, "/v1/chat/completions", body))) for _ in range(2)
    ]
    for t in senders:
        t.start()
    probe()
    for t in senders:
        t.join(60)
    assert health == [200] * 10
    assert len(results) == 2
    for r in results:
        assert r.status_code == 400
        assert r.json()["error"]["code"] in ("request_too_complex", "array_above_max_length")


def test_big_body_with_few_messages_is_parsed_and_answered(srv: Srv) -> None:
    text = "lorem ipsum " * 25_000  # 300 KB: over OFFLOOP_BYTES, so the worker-thread path
    r = post(srv, "/v1/chat/completions", {"model": "assistant", "messages": [{"role": "user", "content": text}]})
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"].startswith("echo: lorem ipsum")


# ── 11.18: OpenAI error JSON everywhere under /v1, x-request-id everywhere ──────────────────


def test_sdk_sees_request_ids_on_success_and_on_unknown_routes(srv: Srv) -> None:
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=T)
    model = client.models.retrieve("assistant")
    assert model._request_id and model._request_id.startswith("req_")
    done = client.chat.completions.create(model="assistant", messages=[{"role": "user", "content": "hi"}])
    assert done._request_id and done._request_id.startswith("req_") and done._request_id != model._request_id
    with pytest.raises(openai.NotFoundError) as info:
        client.get("/no/such/route", cast_to=httpx.Response)
    err = info.value
    assert err.request_id and err.request_id.startswith("req_")
    assert err.response.headers["content-type"] == "application/json"
    assert err.code == "unknown_url"
    assert "GET /v1/no/such/route" in err.message


def test_wrong_methods_and_options_answer_json_or_204_with_allow(srv: Srv) -> None:
    r = httpx.put(srv.url + "/v1/chat/completions", timeout=T)
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["error"]["code"] == "method_not_allowed"
    r = httpx.post(srv.url + "/healthz", timeout=T)
    assert r.status_code == 405 and "GET" in r.headers["allow"]
    assert r.headers["content-type"] == "application/json" and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.options(srv.url + "/v1/chat/completions", timeout=T)
    assert r.status_code == 204 and r.headers["allow"] == "POST, OPTIONS"
    r = httpx.options(srv.url + "/v1/responses/resp_x", timeout=T)
    assert r.status_code == 204 and r.headers["allow"] == "DELETE, GET, HEAD, OPTIONS"
    head = httpx.head(srv.url + "/v1/models", timeout=T)  # as GET, without the body (was: 405)
    get = httpx.get(srv.url + "/v1/models", timeout=T)
    assert head.status_code == 200 and head.content == b"" and head.headers["content-type"] == "application/json"
    assert head.headers["content-length"] == get.headers["content-length"]
    r = httpx.request("OPTIONS", srv.url + "/v1/nothing-here", timeout=T)
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_url"
    r = httpx.get(srv.url + "/", timeout=T)
    assert r.status_code == 404 and r.headers["content-type"] == "application/json"


def test_every_response_has_a_request_id_and_its_log_lines_carry_it(srv: Srv) -> None:
    answers = [
        httpx.get(srv.url + "/healthz", timeout=T),
        httpx.get(srv.url + "/v1/models", timeout=T),
        httpx.get(srv.url + "/v1/nope", timeout=T),
        httpx.get(srv.url + "/v1/models", headers={"Host": "evil.example"}, timeout=T),  # the guard: 421
        httpx.get(srv.url + "/v1/models", headers={"Origin": "https://evil.example"}, timeout=T),  # 403
    ]
    with httpx.stream(
        "POST",
        srv.url + "/v1/chat/completions",
        json={"model": "assistant", "stream": True, "messages": [{"role": "user", "content": "hi"}]},
        timeout=T,
    ) as sse:
        sse.read()
        answers.append(sse)
    ids = [a.headers.get("x-request-id") for a in answers]
    assert all(i and i.startswith("req_") for i in ids), ids
    assert len(set(ids)) == len(ids)
    assert [a.status_code for a in answers] == [200, 200, 404, 421, 403, 200]
    # The refusals were logged by the guard; each line names the id its answer carried.
    log = srv.log.read_text()
    for rid, status in ((ids[3], 421), (ids[4], 403)):
        line = next((ln for ln in log.splitlines() if rid in ln), "")
        assert f"[{rid}] refused http" in line and str(status) in line
    # The edge's own answers (no request reached the app) carry one too.
    s = connect(srv)
    s.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX: " + b"y" * 70_000 + b"\r\n\r\n")
    status, headers, _ = read_response(s)
    s.close()
    assert status == 431 and headers["x-request-id"].startswith("req_")


def test_an_absolute_form_target_is_judged_by_its_own_host(srv: Srv) -> None:
    """`GET http://host/path` (the form proxies get) names its host: the Host header is ignored
    (RFC 9112 §3.2.2), so the host check judges the target's (was: a loopback Host header let a
    request for evil.example through)."""
    here = f"{srv.host}:{srv.port}"
    for target, host, expected in (
        ("http://evil.example/v1/models", here, 421),
        (f"http://{here}/v1/models", "evil.example", 200),
        (f"http://{here}/v1/models", here, 200),
        ("/v1/models", "evil.example", 421),
    ):
        with connect(srv) as s:
            s.sendall(f"GET {target} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
            status, _, _ = read_response(s)
        assert status == expected, (target, host, status)


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/responses"])
def test_an_encoded_request_body_is_refused_by_its_encoding(srv: Srv, route: str) -> None:
    import gzip

    body = (
        {"model": "assistant", "messages": [{"role": "user", "content": "hi"}]}
        if route == "/v1/chat/completions"
        else {"model": "assistant", "input": "hi"}
    )
    raw = json.dumps(body).encode()
    for encoding, data in (("gzip", gzip.compress(raw)), ("deflate", raw), ("bogus", raw)):
        r = httpx.post(
            srv.url + route,
            content=data,
            headers={"Content-Type": "application/json", "Content-Encoding": encoding},
            timeout=T,
        )
        assert r.status_code == 415, (encoding, r.text)  # was: 400 "not valid UTF-8", or 200 ignoring the label
        assert r.json()["error"]["code"] == "unsupported_content_encoding" and encoding in r.json()["error"]["message"]
    r = httpx.post(srv.url + route, content=raw, headers={"Content-Encoding": "identity"}, timeout=T)
    assert r.status_code == 200, r.text
