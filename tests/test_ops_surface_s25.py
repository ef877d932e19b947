"""What the server shows of itself to clients it refuses or does not know, through a real
`appserver serve --auth token` on loopback with real httpx clients and raw sockets:

* a refused request writes a bounded log line, and only the first few of an interval (the rest are
  counted, the count logged): 2,000 refusals with 30 KiB paths grew the log by ~64 MB before;
* `/readyz` gives its checks' details (the home's path, free bytes, file names) only to a
  credential with the scope `/metrics` needs (`admin`); anyone else gets names and statuses, with
  the same HTTP status; auth mode `none` (loopback only) shows them as before;
* `/metrics` counts the requests the security guard refuses on the OpenAI routes (401, 403, 413)
  under the route's fixed label, and nothing for a path no route takes.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from appserver.auth import TokenStore
from tests.support.cli import cli_env
from tests.support.serve import ServeProcess, serving
from tests.support.wait import eventually

pytestmark = pytest.mark.timeout(60)

T = 10.0
CHAT = "/v1/chat/completions"
BODY_MAX = 64 * 1024
ROUTE_LABELS = {
    "/v1/models",
    "/v1/models/{id}",
    CHAT,
    "/v1/responses",
    "/v1/responses/{id}",
    "/v1/responses/{id}/input_items",
    "/v1/responses/{id}/cancel",
}


@pytest.fixture
def token_server(tmp_path: Path) -> Iterator[tuple[ServeProcess, dict[str, str]]]:
    home = tmp_path / "home"
    home.mkdir()
    (home / "crons.json").write_text("{garbage")  # set aside at the start: /readyz names the files
    store = TokenStore(home)
    toks = {
        "openai": store.create(name="client", scopes="openai")[1],
        "admin": store.create(name="operator", scopes="admin")[1],
    }
    env = cli_env(home, APPSERVER_LIMITS__BODY_MAX_BYTES=str(BODY_MAX))
    with serving(home, "--auth", "token", env=env) as sp:
        yield sp, toks


def _metric(url: str, admin: str) -> dict[tuple[str, str, str], float]:
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {admin}"}, timeout=T).text
    pattern = r'^appserver_http_requests_total\{method="([^"]*)",route="([^"]*)",status="([^"]*)"\} (\S+)$'
    return {(m[2], m[1], m[3]): float(m[4]) for m in re.finditer(pattern, text, re.M)}


def _refuse(url: str, path: str, batches: int, per_batch: int = 20) -> None:
    """`batches` × `per_batch` GETs of `path` without a credential, pipelined on one connection (as
    an attacker sends them: httpx takes ~9 ms to build a request of a 30 KiB URL)."""
    host, port = url.split("//")[1].split(":")
    request = f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode()
    with socket.create_connection((host, int(port)), timeout=T) as s:
        for _ in range(batches):
            s.sendall(request * per_batch)
            got = b""
            while got.count(b"HTTP/1.1 ") < per_batch:
                chunk = s.recv(65536)
                assert chunk, got[-300:]
                got += chunk
            assert got.count(b"HTTP/1.1 401 ") == per_batch, got[:300]


def test_refusals_write_a_bounded_log_that_counts_what_it_left_out(
    token_server: tuple[ServeProcess, dict[str, str]],
) -> None:
    sp, _ = token_server
    assert sp.proc.stderr is not None
    before = len(sp.proc.stderr.so_far())  # type: ignore[attr-defined]
    path = "/v1/" + "A" * (30 * 1024)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda _: _refuse(sp.url, path, 25), range(4)))
    assert sp.stop() == 0  # the count not logged yet is logged at the stop
    log = sp.proc.stderr.read()  # the rest, to the end
    grown = len(sp.proc.stderr.so_far()) - before  # type: ignore[attr-defined]
    assert grown < 200_000, f"the log grew by {grown} characters for 2,000 refusals"
    lines = [line for line in log.splitlines() if "refused http" in line]
    assert lines and all(len(line) < 400 for line in lines), lines[:2]
    assert all("'/v1/AAAA" in line and f"({len(path)} characters)" in line for line in lines), lines[0]
    held = [int(m) for m in re.findall(r"(\d+) more refused request\(s\) were not logged", log)]
    assert held, log[-2000:]
    assert len(lines) + sum(held) == 2000, (len(lines), held)


def _address_off_loopback() -> str | None:
    """This machine's address on its first non-loopback interface (a UDP socket's connect sends
    nothing), or None when it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))
        except OSError:
            return None
        address = str(s.getsockname()[0])
    return None if address.startswith("127.") or address == "0.0.0.0" else address


def test_readyz_details_only_for_a_credential_that_may_see_them(tmp_path: Path) -> None:
    """A stranger on the network (a peer that is not loopback) gets each check's status only; a
    credential with the `admin` scope, and any peer on the server's own machine, the details."""
    address = _address_off_loopback()
    if address is None:
        pytest.skip("this machine has no address off loopback")
    home = tmp_path / "home"
    home.mkdir()
    (home / "crons.json").write_text("{garbage")  # set aside at the start: /readyz names the files
    store = TokenStore(home)
    client = store.create(name="client", scopes="openai")[1]
    admin = store.create(name="operator", scopes="admin")[1]
    with serving(home, "--auth", "token", "--listen", f"{address}:0") as sp:
        shown = str(home.resolve())
        for headers in ({}, {"Authorization": f"Bearer {client}"}, {"Authorization": "Bearer not-a-token"}):
            r = httpx.get(sp.url + "/readyz", headers=headers, timeout=T)
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["status"] == "ready"
            assert [set(c) for c in body["checks"]] == [{"name", "status"}] * len(body["checks"]), body
            assert {"store": "ok", "cron": "warn"}.items() <= {c["name"]: c["status"] for c in body["checks"]}.items()
            assert shown not in r.text and "corrupt" not in r.text and "bytes free" not in r.text, r.text
        full = httpx.get(sp.url + "/readyz", headers={"Authorization": f"Bearer {admin}"}, timeout=T)
        assert full.status_code == 200
        details = {c["name"]: c.get("detail", "") for c in full.json()["checks"]}
        assert "bytes free" in details["store"] and shown in details["cron"], details


def test_readyz_keeps_its_details_for_this_machine(token_server: tuple[ServeProcess, dict[str, str]]) -> None:
    """Token auth on loopback: a peer on the server's own machine (`appserver channels status`)
    reads the details without a credential, as it could read the home's files."""
    sp, _ = token_server
    r = httpx.get(sp.url + "/readyz", timeout=T)
    assert r.status_code == 200
    details = {c["name"]: c.get("detail", "") for c in r.json()["checks"]}
    assert "bytes free" in details["store"] and str(sp.home.resolve()) in details["cron"], details
    # a front end on this machine passing a stranger's request on says so: no details for it
    for header in ("X-Forwarded-For", "Forwarded", "X-Real-IP"):
        proxied = httpx.get(sp.url + "/readyz", headers={header: "for=192.0.2.9"}, timeout=T)
        assert proxied.status_code == 200 and "bytes free" not in proxied.text, proxied.text


def test_readyz_in_auth_mode_none_keeps_its_details(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "crons.json").write_text("{garbage")
    with serving(home) as sp:

        def details() -> dict[str, str]:
            r = httpx.get(sp.url + "/readyz", timeout=T)
            assert r.status_code == 200
            return {c["name"]: c.get("detail", "") for c in r.json()["checks"]}

        # the scheduler's first tick reads (and sets aside) the damaged crons.json; a loaded machine
        # can answer /readyz before that tick
        def cron_named_home() -> dict[str, str] | None:
            d = details()
            return d if str(home.resolve()) in d["cron"] else None

        seen = eventually(cron_named_home, 10) or details()
        assert "bytes free" in seen["store"] and str(home.resolve()) in seen["cron"], seen


def _too_large(url: str, token: str) -> int:
    host, port = url.split("//")[1].split(":")
    with socket.create_connection((host, int(port)), timeout=T) as s:
        s.sendall(
            f"POST {CHAT} HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {token}\r\n"
            "Content-Type: application/json\r\nContent-Length: 30000000\r\n\r\n".encode()
        )
        return int(s.recv(100).split()[1])


def _chunks(size: int) -> Iterator[bytes]:
    for _ in range(size // 4096):
        yield b"x" * 4096


def test_metrics_count_the_guards_refusals_on_the_openai_routes(
    token_server: tuple[ServeProcess, dict[str, str]],
) -> None:
    sp, toks = token_server
    before = _metric(sp.url, toks["admin"])
    body = {"model": "assistant", "messages": [{"role": "user", "content": "x"}]}
    with httpx.Client(base_url=sp.url, timeout=T) as client:
        for _ in range(2):
            assert client.post(CHAT, json=body).status_code == 401
            assert client.post(CHAT, json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert client.post(CHAT, json=body, headers={"Authorization": f"Bearer {toks['admin']}"}).status_code == 403
            assert _too_large(sp.url, toks["openai"]) == 413
            # a streamed body over the limit: the guard's 413 counts, not the app's answer it replaced
            r = client.post(CHAT, content=_chunks(2 * BODY_MAX), headers={"Authorization": f"Bearer {toks['openai']}"})
            assert r.status_code == 413, r.text
        assert client.get("/v1/responses/resp_x/input_items").status_code == 401
        assert client.patch("/v1/responses/resp_x/cancel").status_code == 401
        assert client.get("/v1/no/such/route/" + "Z" * 100).status_code == 401  # no route: not counted
    after = _metric(sp.url, toks["admin"])
    delta = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
    assert delta == {
        (CHAT, "POST", "401"): 4.0,
        (CHAT, "POST", "403"): 2.0,
        (CHAT, "POST", "413"): 4.0,
        ("/v1/responses/{id}/input_items", "GET", "401"): 1.0,
        ("/v1/responses/{id}/cancel", "PATCH", "401"): 1.0,
    }, delta
    assert {route for route, _, _ in after} <= ROUTE_LABELS


def test_a_refused_websocket_handshake_logs_its_key_quoted_and_bounded(
    token_server: tuple[ServeProcess, dict[str, str]],
) -> None:
    sp, _ = token_server
    host, port = sp.url.split("//")[1].split(":")
    key = b"[FAKE] 2026-12-06 ERROR injected " + b"K" * 2000
    with socket.create_connection((host, int(port)), timeout=T) as s:
        s.sendall(
            b"GET /ws HTTP/1.1\r\nHost: %s:%s\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: %s\r\n\r\n" % (host.encode(), port.encode(), key)
        )
        assert s.recv(100).split()[1] == b"400"
    assert sp.stop() == 0
    assert sp.proc.stderr is not None
    lines = [line for line in sp.proc.stderr.read().splitlines() if "websocket handshake from" in line]
    assert len(lines) == 1 and len(lines[0]) < 400, lines
    assert re.search(r"refused: 400 '[^']*\[FAKE\] 2026-12-06 ERROR injected K+'$", lines[0]), lines[0]
