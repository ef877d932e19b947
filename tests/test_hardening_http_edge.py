"""HTTP edge hardening (issue 11, items 4, 9, 11) against a real `appserver serve` on loopback, with
raw sockets: request-head cap, head/body/idle timeouts, the connection cap at accept, the throttled
"accept out of resources" log, and X-Forwarded-For trusted only from configured proxies."""

from __future__ import annotations

import json
import re
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.support.cli import ROOT, cli_env, run_cli
from tests.support.net import SSL
from tests.support.wait import eventually
from tests.support.zygote_client import appserver_popen

T = 10.0  # the longest any single wait in this file may take


@dataclass
class Srv:
    proc: subprocess.Popen
    url: str
    host: str
    port: int
    log: Path
    home: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def start(home: Path, *args: str, nofile: int | None = None, **env: str) -> Srv:
    """`appserver serve` with its log in a file (a pipe nobody reads could block it)."""
    home.mkdir(parents=True, exist_ok=True)
    (home / "server.json").unlink(missing_ok=True)
    log = home.parent / f"{home.name}.log"

    def limit_fds() -> None:
        if nofile is not None:  # soft and hard, as `ulimit -n` does: serve raises a soft limit to the hard one
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    with open(log, "wb") as out:
        proc = appserver_popen(  # a new interpreter when it must start with a descriptor limit
            ["serve", "--listen", "127.0.0.1:0", *args],
            env=cli_env(home, **env),
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=None if nofile is None else limit_fds,
        )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            info = json.loads((home / "server.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            info = None
        if info and info.get("pid") == proc.pid:
            host, port = info["url"].rsplit("//", 1)[1].rsplit(":", 1)
            return Srv(proc, info["url"], host, int(port), log, home)
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("serve did not start")


def connect(srv: Srv) -> socket.socket:
    s = socket.create_connection((srv.host, srv.port), timeout=T)
    s.settimeout(T)
    return s


def read_response(s: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response (Content-Length framed) from a raw socket."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a response head; got {buf!r}")
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
    need = int(headers.get("content-length", "0"))
    while len(rest) < need:
        chunk = s.recv(65536)
        if not chunk:
            break
        rest += chunk
    return status, headers, rest[:need]


def closed_within(s: socket.socket, seconds: float) -> bool:
    """True when the server closes `s` (EOF or reset) within `seconds`."""
    s.settimeout(seconds)
    try:
        while s.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def stalled_post(srv: Srv, xff: str | None = None, token: str | None = None) -> socket.socket:
    """A POST whose body stops after 1 of its 100 bytes; it reaches the app (and holds a slot)."""
    s = connect(srv)
    extra = f"X-Forwarded-For: {xff}\r\n" if xff else ""
    extra += f"Authorization: Bearer {token}\r\n" if token else ""
    s.sendall(
        (
            "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: 100\r\n{extra}\r\n{{"
        ).encode()
    )
    return s


def models(srv: Srv, **headers: str) -> httpx.Response:
    return httpx.get(srv.url + "/v1/models", headers=headers, timeout=T, verify=SSL)


@pytest.fixture(scope="module")
def token_srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Srv, str]]:
    """Token auth, short edge timeouts, 4 slots per client address."""
    home = tmp_path_factory.mktemp("edge") / "home"
    home.mkdir()
    made = run_cli(home, "token", "create", "--name", "edge", "--json", env=cli_env(home))
    assert made.code == 0, made.err
    token = made.json()["token"]
    srv = start(
        home,
        "--auth",
        "token",
        APPSERVER_LIMITS__HEAD_TIMEOUT_S="1",
        APPSERVER_LIMITS__BODY_TIMEOUT_S="1",
        APPSERVER_LIMITS__KEEPALIVE_TIMEOUT_S="1",
        APPSERVER_LIMITS__CONNECTIONS_PER_CLIENT="4",
    )
    try:
        yield srv, token
    finally:
        srv.stop()


# ── 11.4: the request head is capped before any auth work ───────────────────────────────────


def test_oversized_header_block_is_431_before_auth(token_srv: tuple[Srv, str]) -> None:
    srv, _ = token_srv
    s = connect(srv)
    # No credentials and a head that never ends: the cap answers, not auth (401) and not silence.
    s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: " + b"a" * (100 * 1024))
    status, headers, body = read_response(s)
    assert status == 431
    assert headers["content-type"] == "application/json"
    assert headers["x-request-id"].startswith("req_")
    assert json.loads(body)["error"]["code"] == "request_header_fields_too_large"
    assert closed_within(s, T)
    s.close()


def test_many_header_lines_and_unfinished_heads_are_cut_off(token_srv: tuple[Srv, str]) -> None:
    srv, token = token_srv
    # Many small header lines add up like one big one.
    s = connect(srv)
    s.sendall(
        b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-A: bbbbbbbbbbbbbbbbbbbbbbbbbbbbbb\r\n" * 3000 + b"\r\n"
    )
    assert read_response(s)[0] == 431
    s.close()
    # Eight unfinished 2 MiB heads at once: each is cut off at the cap instead of being buffered.
    socks = [connect(srv) for _ in range(8)]
    for s in socks:
        s.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: ")
    sent = [0] * len(socks)
    for i, s in enumerate(socks):
        try:
            for _ in range(32):  # up to 2 MiB, 64 KiB at a time
                s.sendall(b"c" * 65536)
                sent[i] += 65536
        except (BrokenPipeError, ConnectionResetError):
            pass
    for s in socks:
        try:
            assert read_response(s)[0] == 431
        except ConnectionResetError:
            pass  # it wrote on past the linger window: reset is the other acceptable end
        s.close()
    assert min(sent) <= 2 * 1024 * 1024
    # A normal head of a few KiB still works, with credentials.
    r = models(srv, Authorization=f"Bearer {token}", **{"X-Fine": "d" * 8000})
    assert r.status_code == 200


# ── 11.9: slowloris, stalled bodies, idle connections ────────────────────────────────────────


def test_slow_head_gets_408(token_srv: tuple[Srv, str]) -> None:
    srv, _ = token_srv
    s = connect(srv)
    s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    start_t = time.monotonic()
    for _ in range(3):  # dribble: each byte arrives, the head never completes
        s.sendall(b"X")
        time.sleep(0.2)
    status, headers, body = read_response(s)
    assert status == 408
    assert json.loads(body)["error"]["code"] == "request_timeout"
    assert time.monotonic() - start_t < T
    s.close()


def test_idle_connection_is_closed(token_srv: tuple[Srv, str]) -> None:
    srv, _ = token_srv
    s = connect(srv)  # never sends a byte
    assert closed_within(s, 5.0)
    s.close()


def test_stalled_bodies_time_out_and_free_the_client_slots(token_srv: tuple[Srv, str]) -> None:
    srv, token = token_srv
    auth = {"Authorization": f"Bearer {token}"}
    stalled = []
    for _ in range(4):
        s = connect(srv)
        s.sendall(
            (
                "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{"
            ).encode()
        )
        stalled.append(s)
    # All four slots of this address are taken by bodies that will never arrive.
    assert eventually(lambda: models(srv, **auth).status_code == 429, 3.0)
    for s in stalled:
        status, _, body = read_response(s)
        assert status == 408
        assert "body_timeout_s" in json.loads(body)["error"]["message"]
        s.close()
    assert eventually(lambda: models(srv, **auth).status_code == 200, T)


def test_a_trickled_body_is_cut_off_by_the_minimum_rate(token_srv: tuple[Srv, str]) -> None:
    """One byte just before every body timeout never stalls, so only a minimum rate ends it."""
    srv, token = token_srv
    s = connect(srv)
    s.sendall(
        (
            "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n{{"
        ).encode()
    )
    started = time.monotonic()
    s.settimeout(0.6)
    got = b""
    while time.monotonic() - started < 8 and not got:
        try:
            got = s.recv(65536)
        except TimeoutError:
            s.sendall(b" ")  # a byte every 0.6 s: never quiet for the 1 s body timeout
    s.settimeout(T)
    assert got, "the trickle was never cut off"
    while b"\r\n\r\n" not in got or not got.rstrip().endswith(b"}"):
        more = s.recv(65536)
        if not more:
            break
        got += more
    s.close()
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.split()[1] == b"408"
    assert "body_min_rate_bytes_s" in json.loads(body)["error"]["message"]


# ── 11.9: a global connection cap at accept ──────────────────────────────────────────────────


def test_connection_cap_answers_503_at_accept(tmp_path: Path) -> None:
    srv = start(tmp_path / "home", APPSERVER_LIMITS__MAX_CONNECTIONS="6", APPSERVER_LIMITS__KEEPALIVE_TIMEOUT_S="30")
    try:
        held = [connect(srv) for _ in range(6)]
        time.sleep(0.2)  # let the server accept them all
        extra = connect(srv)
        status, headers, body = read_response(extra)
        assert status == 503
        assert headers["retry-after"] == "1"
        assert json.loads(body)["error"]["code"] == "server_busy"
        extra.close()
        for s in held:
            s.close()
        assert eventually(lambda: models(srv).status_code == 200, T)
    finally:
        srv.stop()
    assert "connection limit 6 reached" in srv.log.read_text()


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_accept_out_of_descriptors_logs_one_line_not_a_flood(tmp_path: Path, loop: str) -> None:
    # A cap above a tiny fd limit makes accept fail with EMFILE, which asyncio logs per attempt
    # (throttled to one line); uvloop (libuv) closes the connections it cannot take and logs nothing.
    srv = start(
        tmp_path / "home",
        nofile=96,
        APPSERVER_LIMITS__MAX_CONNECTIONS="5000",
        APPSERVER_LIMITS__KEEPALIVE_TIMEOUT_S="1",
        APPSERVER_SERVER__EVENT_LOOP=loop,
    )
    socks: list[socket.socket] = []
    try:
        for _ in range(200):
            try:
                socks.append(socket.create_connection((srv.host, srv.port), timeout=T))
            except OSError:
                break
        time.sleep(1.2)  # asyncio retries accept every second while descriptors are out
        text = srv.log.read_text(errors="replace")
        if loop == "asyncio":
            assert "out of system resource" in text  # the condition did happen
        assert text.count("socket.accept() out of system resource") <= 2
        # no flood of any kind: log records, not lines (a tick that met EMFILE once may log one
        # traceback, many lines long; that is one record, not a flood)
        records = [line for line in text.splitlines() if re.match(r"\d{4}-\d{2}-\d{2} ", line)]
        assert len(records) < 40, records[-10:]
        for s in socks:
            s.close()
        socks.clear()
        assert eventually(lambda: models(srv).status_code == 200, T)  # and the server recovers
    finally:
        for s in socks:
            s.close()
        srv.stop()


# ── 11.11: forwarding headers only from configured proxies ───────────────────────────────────


def test_x_forwarded_for_from_a_plain_client_does_not_escape_the_per_client_cap(tmp_path: Path) -> None:
    """With auth on (in mode `none` a forwarded request is refused outright: 403 forwarded_needs_auth)."""
    home = tmp_path / "home"
    home.mkdir()
    made = run_cli(home, "token", "create", "--name", "xff", "--json", env=cli_env(home))
    assert made.code == 0, made.err
    token = made.json()["token"]
    srv = start(
        home, "--auth", "token", APPSERVER_LIMITS__CONNECTIONS_PER_CLIENT="2", APPSERVER_LIMITS__BODY_TIMEOUT_S="20"
    )
    try:
        held = [stalled_post(srv, "127.0.0.2", token), stalled_post(srv, "127.0.0.3", token)]
        # A third address claimed in the header is still this one loopback client.
        claimed = {"X-Forwarded-For": "127.0.0.4", "Authorization": f"Bearer {token}"}
        assert eventually(lambda: models(srv, **claimed).status_code == 429, 3.0)
        for s in held:
            s.close()
    finally:
        srv.stop()


def test_trusted_proxy_may_name_the_client(tmp_path: Path) -> None:
    srv = start(
        tmp_path / "home",
        APPSERVER_SERVER__TRUSTED_PROXIES="127.0.0.1",
        APPSERVER_LIMITS__CONNECTIONS_PER_CLIENT="2",
        APPSERVER_LIMITS__BODY_TIMEOUT_S="20",
    )
    try:
        held = [stalled_post(srv, "127.0.0.2"), stalled_post(srv, "127.0.0.2")]
        time.sleep(0.3)
        # From the proxy, each forwarded address is its own client: .2 is full, .3 is not.
        assert models(srv, **{"X-Forwarded-For": "127.0.0.2"}).status_code == 429
        assert models(srv, **{"X-Forwarded-For": "127.0.0.3"}).status_code == 200
        for s in held:
            s.close()
    finally:
        srv.stop()


def test_trusted_proxies_wildcard_is_refused_at_start(tmp_path: Path) -> None:
    home = tmp_path / "home"
    r = run_cli(
        home, "serve", "--listen", "127.0.0.1:0", env=cli_env(home, APPSERVER_SERVER__TRUSTED_PROXIES="*"), timeout=30
    )
    assert r.code == 2
    assert "trusted_proxies" in r.err and "Traceback" not in r.err


def test_fd_accounting_helpers() -> None:
    from appserver.security.edge import connection_cap

    assert connection_cap(100) == 100
    assert connection_cap(0, nofile=1024) == 736
    assert connection_cap(0, nofile=16) == 8


def test_serve_raises_a_low_soft_fd_limit_to_the_hard_one(tmp_path: Path) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 512:
        pytest.skip(f"the hard limit here is {hard}")

    def low_soft() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))

    home = tmp_path / "home"
    proc = subprocess.Popen(
        [sys.executable, "-m", "appserver", "serve", "--listen", "127.0.0.1:0"],
        env=cli_env(home),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=low_soft,
    )
    try:
        assert eventually(lambda: (home / "server.json").exists(), T)
        limits = Path(f"/proc/{proc.pid}/limits").read_text()
        line = next(x for x in limits.splitlines() if x.startswith("Max open files"))
        assert line.split()[3] == (str(hard) if hard != resource.RLIM_INFINITY else str(1 << 20))
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=T)
    assert "open file limit raised from 256" in err
