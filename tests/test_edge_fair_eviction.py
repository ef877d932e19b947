"""Fair eviction at the connection cap (appserver/security/fair_slots.py, edge.py `connection_made`),
against a real `appserver serve` on loopback with raw sockets.

One address used to hold every slot with partial request heads (a line trickled before each head
timeout) while every other client got 503 server_busy. Now, at the cap, a newcomer takes the slot of
the oldest connection that has not completed a request head: at once when it comes from another
address (fairer slots), from the same address once that connection has waited the grace (1 s). A
connection that completed a request is never evicted, and below the cap nothing changes."""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import pytest

from appserver.security.fair_slots import SlotGate, client_group
from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, serving
from tests.support.state import token_home
from tests.support.wait import wait_for
from tests.support.ws import WS

pytestmark = pytest.mark.timeout(60)

T = 10.0  # the longest any single socket wait may take
CAP = 8
GRACE_S = 1.0  # fair_slots.EVICTION_GRACE_S (the head timeout here is 10 s: half of it is more)
HOLD = b"GET /healthz HTTP/1.1\r\n"  # a request line, and the head never finished
ASK = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
HEALTH = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
EVICTED_LOG = "that had not authenticated"


def _serve(tmp_path: Path, cap: int = CAP) -> AbstractContextManager[ServeProcess]:
    home = tmp_path / "home"
    env = cli_env(
        home,
        APPSERVER_LIMITS__MAX_CONNECTIONS=str(cap),
        APPSERVER_LIMITS__HEAD_TIMEOUT_S="10",
        APPSERVER_LIMITS__KEEPALIVE_TIMEOUT_S="30",  # idle connections stay for the whole test
    )
    return serving(home, env=env)


@pytest.fixture
def srv(tmp_path: Path) -> Iterator[ServeProcess]:
    with _serve(tmp_path) as sp:
        yield sp


def _address(srv: ServeProcess) -> tuple[str, int]:
    host, port = srv.url.split("//")[1].split("/")[0].rsplit(":", 1)
    return host, int(port)


def _connect(srv: ServeProcess, source: str = "127.0.0.1") -> socket.socket:
    s = socket.create_connection(_address(srv), timeout=T, source_address=(source, 0))
    s.settimeout(T)
    return s


def _hold(srv: ServeProcess, n: int, source: str = "127.0.0.1") -> list[socket.socket]:
    """`n` connections from `source`, each with a partial request head."""
    socks = []
    for _ in range(n):
        s = _connect(srv, source)
        s.sendall(HOLD)
        socks.append(s)
    return socks


def _response(s: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One Content-Length framed response; status 0 when the connection ended (EOF or reset)
    before a complete head (a 503 at accept may be cut by the reset our request causes)."""
    buf = b""
    try:
        while b"\r\n\r\n" not in buf:
            chunk = s.recv(65536)
            if not chunk:
                return 0, {}, buf
            buf += chunk
        head, _, rest = buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
        need = int(headers.get("content-length", "0"))
        while len(rest) < need:
            chunk = s.recv(65536)
            if not chunk:
                break
            rest += chunk
    except ConnectionResetError:
        return 0, {}, buf
    return int(lines[0].split()[1]), headers, rest[:need]


def _ask(srv: ServeProcess, source: str = "127.0.0.1", keep: list[socket.socket] | None = None) -> int:
    """GET /v1/models on a new connection from `source`: its status (0: cut without an answer).
    With `keep`, the connection stays open (kept alive, having completed a request) in it."""
    s = _connect(srv, source)
    try:
        s.sendall(ASK)
    except OSError:
        s.close()
        return 0
    status = _response(s)[0]
    if keep is not None and status == 200:
        keep.append(s)
    else:
        s.close()
    return status


def _untouched(s: socket.socket) -> bool:
    """Still open, and nothing was written to it."""
    s.setblocking(False)
    try:
        s.recv(1)  # b"": closed; bytes: answered
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        s.settimeout(T)
    return False


def _assert_evicted(s: socket.socket) -> None:
    """A 503 server_busy in the error shape of the edge, then the end of the connection."""
    status, headers, body = _response(s)
    assert status == 503, body
    assert headers["retry-after"] == "1"
    assert headers["connection"] == "close"
    error = json.loads(body)["error"]
    assert error["code"] == "server_busy"
    assert "had not authenticated" in error["message"]
    assert s.recv(1) == b""


def _close(socks: list[socket.socket]) -> None:
    for s in socks:
        s.close()


def _can_bind(address: str) -> bool:
    try:
        with socket.socket() as s:
            s.bind((address, 0))
    except OSError:
        return False
    return True


other_loopback = pytest.mark.skipif(not _can_bind("127.0.0.2"), reason="cannot bind 127.0.0.2 here")


# ── real sockets ─────────────────────────────────────────────────────────────────────────────────


@other_loopback
def test_a_newcomer_from_another_address_takes_the_oldest_slow_head_at_once(srv: ServeProcess) -> None:
    held = _hold(srv, CAP)
    extra: list[socket.socket] = []
    try:
        # One address holds every slot: no newcomer, from it or elsewhere, evicts a connection
        # younger than the grace (a client's request may be on its way).
        assert _ask(srv) in (0, 503)
        assert _ask(srv, "127.0.0.2") in (0, 503)
        time.sleep(GRACE_S + 0.1)
        assert _ask(srv, "127.0.0.2", keep=extra) == 200
        assert _ask(srv, "127.0.0.3", keep=extra) == 200
        _assert_evicted(held[0])  # the oldest two go, with a 503 each
        _assert_evicted(held[1])
        assert all(_untouched(s) for s in held[2:])
        wait_for(lambda: srv.proc.stderr.seen(EVICTED_LOG), T, "the eviction notice")  # type: ignore[union-attr]
    finally:
        _close(held + extra)


def test_a_newcomer_from_the_same_address_takes_a_slow_head_past_the_grace(srv: ServeProcess) -> None:
    held = _hold(srv, CAP)
    opened = time.monotonic()
    served: list[socket.socket] = []
    try:
        assert _ask(srv) in (0, 503)  # within the grace: a burst never evicts its own fresh connections
        for s in held:  # the attack: a header line now and then keeps each head alive
            s.sendall(b"X-Trickle: 1\r\n")
        time.sleep(max(0.0, opened + GRACE_S + 0.1 - time.monotonic()))
        # Three newcomers from the same address, each kept open after its request: each takes the
        # slot of the oldest slow head left, which gets a 503.
        for _ in range(3):
            assert _ask(srv, keep=served) == 200
        for s in held[:3]:
            _assert_evicted(s)
        assert all(_untouched(s) for s in held[3:])
        # The served connections completed a request: never evicted, and they go on working.
        for s in served:
            s.sendall(HEALTH)
            assert _response(s)[0] == 200
        wait_for(lambda: srv.proc.stderr.seen(EVICTED_LOG), T, "the eviction notice")  # type: ignore[union-attr]
        log = srv.proc.stderr.so_far()  # type: ignore[union-attr]
        assert log.count(EVICTED_LOG) == 1, log  # three evictions, one line per interval
        assert "Traceback" not in log
    finally:
        _close(held + served)


def test_a_connection_that_completed_a_request_is_never_evicted(srv: ServeProcess) -> None:
    proven: list[socket.socket] = []
    for _ in range(CAP - 1):
        assert _ask(srv, keep=proven) == 200
    assert len(proven) == CAP - 1
    proven[0].sendall(HOLD)  # a second head, left partial: still a connection that proved itself
    slow = _hold(srv, 1)
    time.sleep(GRACE_S + 0.1)  # every one of them is past the grace
    extra: list[socket.socket] = []
    sources = ["127.0.0.1", "127.0.0.2"] if _can_bind("127.0.0.2") else ["127.0.0.1"]
    try:
        assert _ask(srv, sources[-1], keep=extra) == 200  # takes the one slow first head's slot
        _assert_evicted(slow[0])
        for source in sources:  # nothing left to evict: refused, as at any full server
            assert _ask(srv, source) in (0, 503)
        assert _untouched(proven[0])
        proven[0].sendall(b"Host: 127.0.0.1\r\n\r\n")  # its head, completed late, is served
        assert _response(proven[0])[0] == 200
        for s in proven[1:]:
            s.sendall(HEALTH)
            assert _response(s)[0] == 200
    finally:
        _close(proven + slow + extra)


def test_below_the_cap_nothing_is_evicted(tmp_path: Path) -> None:
    """A burst of connects from one address, all past the grace: every one is served, and so are
    newcomers while there is room (the last slot); none is evicted."""
    cap = 48
    with _serve(tmp_path, cap=cap) as sp:
        burst = [_connect(sp) for _ in range(cap - 1)]
        try:
            for s in burst[::2]:
                s.sendall(HOLD)  # half begin a head, half send nothing yet
            time.sleep(GRACE_S + 0.1)
            assert _ask(sp) == 200  # the last slot, then (closed) the last slot again
            if _can_bind("127.0.0.2"):
                assert _ask(sp, "127.0.0.2") == 200
            assert all(_untouched(s) for s in burst)
            for i, s in enumerate(burst):
                s.sendall(b"Host: 127.0.0.1\r\n\r\n" if i % 2 == 0 else HEALTH)
            assert [_response(s)[0] for s in burst] == [200] * len(burst)
            assert EVICTED_LOG not in sp.proc.stderr.so_far()  # type: ignore[union-attr]
        finally:
            _close(burst)


def test_a_burst_over_the_cap_keeps_its_first_connections(srv: ServeProcess) -> None:
    """Connects from one address beyond the cap, all at once: the ones over it are refused (503),
    the first `CAP` are not evicted by them and are all served."""
    burst = [_connect(srv) for _ in range(CAP)]
    try:
        over = [_ask(srv) for _ in range(4)]
        assert all(status in (0, 503) for status in over), over
        for s in burst:
            s.sendall(HEALTH)
        assert [_response(s)[0] for s in burst] == [200] * CAP
    finally:
        _close(burst)


# ── the gate's rule, without sockets ─────────────────────────────────────────────────────────────


class _Conn:
    def __init__(self, name: str) -> None:
        self.name = name
        self.evicted: str | None = None

    def evict(self, reason: str) -> None:
        self.evicted = reason


def _gate(grace_s: float = 1.0, **groups: int) -> tuple[SlotGate, dict[str, list[_Conn]]]:
    gate = SlotGate(grace_s=grace_s)
    conns: dict[str, list[_Conn]] = {}
    for group, n in groups.items():
        for i in range(n):
            conn = _Conn(f"{group}{i}")
            gate.admitted(conn, group)
            conns.setdefault(group, []).append(conn)
    return gate, conns


def test_gate_evicts_the_oldest_of_the_heaviest_group_when_fairer() -> None:
    gate, conns = _gate(grace_s=0.0, a=5, b=2)
    eviction = gate.make_room("b", "why")  # b holds 2 < 5 - 1: fairer
    assert eviction is not None and eviction.victim_group == "a" and eviction.victim_group_unproven == 5
    assert conns["a"][0].evicted == "why"
    assert gate.leaving == 1
    gate.gone(conns["a"][0])
    assert gate.leaving == 0
    gate, conns = _gate(a=5, b=4)
    assert gate.make_room("b", "why") is None  # 4 is not fewer than 5 - 1: a swap, not fairer
    assert gate.make_room("a", "why") is None  # a's own, all younger than the grace
    assert not any(c.evicted for cs in conns.values() for c in cs)


def test_gate_evicts_nobody_younger_than_the_grace_whatever_the_groups() -> None:
    """A flood of connects from many addresses (each its own group) cannot make a newcomer evict
    a connection whose request may still be on its way."""
    gate, conns = _gate(grace_s=1.0, **{f"g{i}": 1 for i in range(8)})
    for newcomer in ("fresh", "g0", "g3"):
        assert gate.make_room(newcomer, "why") is None
    assert not any(c.evicted for cs in conns.values() for c in cs)
    gate, conns = _gate(grace_s=0.0, **{f"g{i}": 1 for i in range(8)})
    assert gate.make_room("fresh", "why") is not None and conns["g0"][0].evicted  # past it: the oldest


def test_gate_same_group_only_past_the_grace_and_never_a_proven_one() -> None:
    gate, conns = _gate(grace_s=0.0, a=3)
    gate.proven(conns["a"][0])  # completed a head: never a victim
    eviction = gate.make_room("a", "why")
    assert eviction is not None and conns["a"][1].evicted and not conns["a"][0].evicted
    gate, conns = _gate(grace_s=0.0, a=1)
    gate.proven(conns["a"][0])
    assert gate.make_room("a", "why") is None and gate.make_room("b", "why") is None


def test_client_group() -> None:
    assert client_group("127.0.0.1") == "127.0.0.1"
    assert client_group("::ffff:10.0.0.7") == "10.0.0.7"
    assert client_group("2001:db8::1") == client_group("2001:db8::ffff:1") == "2001:db8::/64"
    assert client_group("2001:db8:0:1::1") != client_group("2001:db8::1")
    assert client_group("fe80::1%eth0") == "fe80::/64"
    assert client_group(None) == client_group("") == "?"


class _SmallScan(SlotGate):
    SCAN = 2  # the path taken when thousands of groups hold the most


@pytest.mark.parametrize("gate_class", [SlotGate, _SmallScan])
def test_gate_matches_its_rule_under_random_churn(gate_class: type[SlotGate]) -> None:
    """Admissions, proofs and evictions at random, checked against the rule written plainly."""
    rng = random.Random(7)
    gate = gate_class(grace_s=0.0)
    live: dict[_Conn, str] = {}  # unproven, oldest first
    for step in range(3000):
        group = rng.choice("abcdef")
        action = rng.random()
        if action < 0.5 or not live:
            conn = _Conn(f"{group}{step}")
            gate.admitted(conn, group)
            live[conn] = group
        elif action < 0.75:
            conn = rng.choice(list(live))
            gate.proven(conn) if rng.random() < 0.5 else gate.gone(conn)
            del live[conn]
        else:
            counts = {g: list(live.values()).count(g) for g in set(live.values())}
            most = max(counts.values())
            mine = counts.get(group, 0)
            own = bool(mine) and mine >= most - 1
            if own:
                expected = next(c for c, g in live.items() if g == group)
            else:
                expected = next(c for c, g in live.items() if counts[g] == most)
            eviction = gate.make_room(group, "why")
            victims = [c for c in live if c.evicted]
            assert eviction is not None and len(victims) == 1, step
            victim = victims[0]
            assert eviction.victim_group == live[victim] and counts[live[victim]] == eviction.victim_group_unproven
            if own or gate_class is SlotGate or len({g for g, n in counts.items() if n == most}) <= gate.SCAN:
                assert victim is expected, step
            else:  # more groups hold the most than it looks at: one of them, its oldest
                assert counts[live[victim]] == most
                assert victim is next(c for c, g in live.items() if g == live[victim])
            del live[victim]
            gate.gone(victim)
        assert gate.leaving == 0
    assert not any(c.evicted for c in live)


# ── token mode: a connection proves itself by authenticating, not by finishing a head ───────────

UPGRADE = (
    b"GET /ws HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
)


@pytest.fixture
def token_srv(tmp_path: Path) -> Iterator[tuple[ServeProcess, str]]:
    home = tmp_path / "home"
    token_home(home)
    env = cli_env(
        home,
        APPSERVER_LIMITS__MAX_CONNECTIONS=str(CAP),
        APPSERVER_LIMITS__HEAD_TIMEOUT_S="10",
        APPSERVER_LIMITS__KEEPALIVE_TIMEOUT_S="30",
    )
    made = run_cli(home, "token", "create", "--name", "app", "--scopes", "openai,ws", "--json", env=env)
    assert made.code == 0, made.err
    with serving(home, "--auth", "token", env=env) as sp:
        yield sp, made.json()["token"]


def _ask_with(srv: ServeProcess, token: str | None, source: str = "127.0.0.1") -> tuple[int, socket.socket]:
    """GET /v1/models with `token` (or none) on a new connection, left open: (status, socket)."""
    s = _connect(srv, source)
    auth = f"Authorization: Bearer {token}\r\n".encode() if token else b""
    try:
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n" + auth + b"\r\n")
    except OSError:
        return 0, s
    return _response(s)[0], s


def _closed_by_server(s: socket.socket) -> bool:
    """The server ended the connection (EOF or reset), whatever it wrote before."""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def _upgraded(srv: ServeProcess) -> socket.socket:
    """A WebSocket upgraded without a credential (its `hello` never sent)."""
    s = _connect(srv)
    s.sendall(UPGRADE)
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(4096)
        assert chunk, buf
        buf += chunk
    assert buf.startswith(b"HTTP/1.1 101"), buf
    return s


@other_loopback
def test_refused_keep_alive_connections_do_not_hold_the_slots(token_srv: tuple[ServeProcess, str]) -> None:
    """One address opens every slot and sends a request without a credential on each (401, kept
    alive, re-sent before each keep-alive timeout): a client with a token from another address is
    still served, taking the oldest refused connection's slot; one that authenticated keeps its slot."""
    srv, token = token_srv
    refused: list[socket.socket] = []
    served: list[socket.socket] = []
    try:
        for _ in range(CAP):
            status, s = _ask_with(srv, None)
            assert status == 401
            refused.append(s)
        for s in refused:  # the attack keeps each alive with another refused request
            s.sendall(ASK)
            assert _response(s)[0] == 401
        time.sleep(GRACE_S + 0.1)  # no connection is evicted younger than this
        status, s = _ask_with(srv, token, "127.0.0.2")
        served.append(s)
        assert status == 200
        assert _closed_by_server(refused[0])
        status, s = _ask_with(srv, token, "127.0.0.3")
        served.append(s)
        assert status == 200
        assert _closed_by_server(refused[1])
        # the served connections authenticated: evicted for nobody, they go on working
        for _ in range(CAP - 2):
            status, s = _ask_with(srv, token, "127.0.0.2")
            served.append(s)
            assert status == 200
        status, s = _ask_with(srv, token, "127.0.0.3")
        s.close()
        assert status in (0, 503)  # every slot is held by an authenticated connection now
        for s in served:
            s.sendall(
                b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + token.encode() + b"\r\n\r\n"
            )
            assert _response(s)[0] == 200
        log = srv.proc.stderr.so_far()  # type: ignore[union-attr]
        assert "Traceback" not in log
    finally:
        _close(refused + served)


@other_loopback
def test_websockets_waiting_for_hello_do_not_hold_the_slots(token_srv: tuple[ServeProcess, str]) -> None:
    """Every slot held by WebSockets upgraded without a credential that never send `hello`: a client
    with a token from another address takes the oldest one's slot. A socket whose `hello`
    authenticated is never evicted."""
    srv, token = token_srv

    loop = asyncio.new_event_loop()
    greeted: list[WS] = []
    waiting: list[socket.socket] = []
    served: list[socket.socket] = []
    try:
        for _ in range(2):
            ws = loop.run_until_complete(WS.open(srv.url, hello=False))
            greeted.append(ws)
            hello = {"type": "hello", "protocol": 1, "client": "t", "token": token}
            welcome = loop.run_until_complete(ws.request(hello))
            assert welcome["type"] == "welcome", welcome
        # (the hello window is 5 s: what follows takes well under that)
        waiting = [_upgraded(srv) for _ in range(CAP - 2)]
        time.sleep(GRACE_S + 0.1)  # no connection is evicted younger than this
        status, s = _ask_with(srv, token, "127.0.0.2")
        served.append(s)
        assert status == 200
        assert _closed_by_server(waiting[0])
        assert all(_untouched(w) for w in waiting[1:])
        for ws in greeted:  # the greeted sockets were left alone and still answer
            reply = loop.run_until_complete(ws.request({"type": "list_agents"}))
            assert reply["type"] == "agents", reply
    finally:
        _close(waiting + served)
        for ws in greeted:
            loop.run_until_complete(ws.close())
        loop.close()


@other_loopback
def test_a_newcomer_is_not_evicted_by_a_flood_from_many_addresses_before_its_request(
    token_srv: tuple[ServeProcess, str],
) -> None:
    """Every slot but one held by idle connections from many addresses, past the grace; a client
    with a token takes the last one and is slow to send its request; a flood of newcomers from
    yet other addresses evicts the old idle ones, never the client's fresh connection, and once
    those are gone it is refused (503), not let in at the client's expense."""
    srv, token = token_srv
    idle = [_connect(srv, f"127.0.1.{i + 1}") for i in range(CAP - 1)]
    extra: list[socket.socket] = []
    try:
        time.sleep(GRACE_S + 0.1)
        mine = _connect(srv, "127.0.0.1")  # the last slot; its request comes late
        flood = [_connect(srv, f"127.0.2.{i + 1}") for i in range(CAP - 1)]  # each takes an old idle slot
        extra.extend(flood)
        late = _connect(srv, "127.0.3.1")  # nothing old is left: refused, never the client's slot
        extra.append(late)
        assert _response(late)[0] in (0, 503)
        for s in idle:
            assert _closed_by_server(s)
        mine.sendall(
            b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + token.encode() + b"\r\n\r\n"
        )
        assert _response(mine)[0] == 200
        extra.append(mine)
    finally:
        _close(idle + extra)


def test_a_flood_of_pipelined_requests_is_cut_at_the_pipeline_limit(srv: ServeProcess) -> None:
    """Thousands of requests sent ahead of their replies in one write: at most PIPELINE_MAX are
    queued, then a 429 (after the replies before it) and the connection ends; nothing piles up."""
    from appserver.security.edge import PIPELINE_MAX

    s = _connect(srv)
    try:
        s.sendall(HEALTH * 1000)
        got = b""
        while True:
            try:
                chunk = s.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not chunk:
                break
            got += chunk
    finally:
        s.close()
    answered = got.count(b"HTTP/1.1 200")
    assert got.count(b"HTTP/1.1 429") == 1 and b"too_many_pipelined_requests" in got, got[-500:]
    assert answered <= PIPELINE_MAX + 1, answered  # the one running, and the queued ones


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@other_loopback
def test_an_evicted_websocket_that_reads_nothing_frees_its_descriptor_at_once(
    token_srv: tuple[ServeProcess, str],
) -> None:
    """WebSockets waiting for `hello` that ping and never read their pongs: evicted at the cap,
    each is aborted (a close waited for the client to take what was unsent, up to the send
    timeout, while its slot was already given away: descriptors and buffers piled up past the cap)."""
    srv, token = token_srv
    pid = srv.proc.pid
    ping = bytes([0x89, 0x80 | 125]) + b"\0\0\0\0" + b"p" * 125  # a masked ping of 125 bytes
    waiting: list[socket.socket] = []
    served: list[socket.socket] = []
    try:
        before = _fds(pid)
        for _ in range(CAP):
            s = _upgraded(srv)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
            s.setblocking(False)
            try:
                for _ in range(4000):  # far more pongs than the client's buffer takes
                    s.send(ping)
            except BlockingIOError:
                pass
            waiting.append(s)
        time.sleep(GRACE_S + 0.2)
        for i in range(CAP):  # each newcomer evicts one of them
            status, s = _ask_with(srv, token, f"127.0.4.{i + 1}")
            served.append(s)
            assert status == 200
        time.sleep(0.5)
        assert _fds(pid) <= before + CAP + 2, (before, _fds(pid))  # the evicted ones' are free
    finally:
        _close(waiting + served)
