"""Request bodies of many tiny JSON arrays or values (an outside finding on /ws, session 36).

A valid 4 MB body of a million `[]` (or two million numbers) was parsed whole: in a worker
thread, but holding the GIL, so the event loop, and every other client, waited most of a second
for each such body. Objects were already counted; arrays and values are now counted too, before
the parse, on both OpenAI routes (as on the WebSocket), and such a body is a 400 at once."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest

from tests.support.net import SSL
from tests.test_hardening_http_edge import Srv, start


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Srv]:
    s = start(tmp_path_factory.mktemp("bodies") / "home")
    try:
        yield s
    finally:
        s.stop()


def _post(srv: Srv, path: str, body: bytes) -> httpx.Response:
    return httpx.post(
        srv.url + path, content=body, headers={"content-type": "application/json"}, timeout=30, verify=SSL
    )


@pytest.mark.parametrize(
    ("path", "items", "what"),
    [
        ("/v1/chat/completions", b"[]", "arrays"),
        ("/v1/responses", b"[]", "arrays"),
        ("/v1/chat/completions", b"0", "values"),
        ("/v1/responses", b"1.5", "values"),
    ],
)
def test_a_body_of_many_tiny_items_is_refused_before_it_is_parsed(srv: Srv, path: str, items: bytes, what: str) -> None:
    first = b'{"model":"assistant","input":"hi","messages":[{"role":"user","content":"hi"}],"metadata_x":['
    body = first + b",".join([items] * 1_300_000) + b"]}"
    r = _post(srv, path, body)
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["code"] == "request_too_complex" and f"JSON {what}" in error["message"], error


def test_the_server_answers_others_while_such_bodies_come(srv: Srv) -> None:
    body = b'{"model":"assistant","messages":[{"role":"user","content":"hi"}],"x":[' + b",".join([b"[]"] * 1_300_000)
    body += b"]}"
    statuses: list[int] = []
    senders = [
        threading.Thread(target=lambda: statuses.append(_post(srv, "/v1/chat/completions", body).status_code))
        for _ in range(3)
    ]
    for t in senders:
        t.start()
    for t in senders:
        t.join(60)
    assert statuses == [400, 400, 400]
    # a body of legitimate size and shape still goes through the same path (over 256 KiB)
    text = "[1, 2], " * 40_000
    r = httpx.post(
        srv.url + "/v1/chat/completions",
        json={"model": "assistant", "messages": [{"role": "user", "content": text}]},
        timeout=30,
        verify=SSL,
    )
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"].startswith("echo: [1, 2]")
