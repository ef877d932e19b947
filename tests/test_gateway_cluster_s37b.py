"""A cluster server's gateway takes no webhook message from the moment its server stops or loses
its database session (s37 attacker B, F1 and F2).

Real `appserver serve` processes on a real PostgreSQL database, the webhook channel with signed
POSTs and a reply receiver. The server holding the account's lease vouches for its gateway child's
intake a moment at a time. Its word lasted 2 s and was renewed every half second, so a gateway
whose server was SIGSTOPped answered 202 for up to 2 s, and one whose server had just lost its
database session until the next word (up to half a second): messages nobody submitted, stranded in
that home's ledger once the lease moved. Now the child checks that its server (its parent) is not
stopped before it acknowledges anything, and the server pauses its gateway the moment the cluster
notices the session is gone; a message refused meanwhile is answered, once, when sent again.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from plugins.webhook.signing import SIGNATURE_HEADER, TIMESTAMP_HEADER, sign
from tests.support.cli import cli_env
from tests.support.gateway import (
    ChannelServer,
    WebhookReplies,
    gateway_children,
    ledger_column,
    start_channel_server,
    write_config,
)
from tests.support.pg import ADMIN_URL, temp_database

pytestmark = pytest.mark.timeout(180)

SECRET = "s37b-webhook-secret-0123456789abcdef"
PAIR_PORTS = (22440, 22441)  # this file's port range: 22440-22449
CUT_PORT = 22442
STOP_PORT = 22443
# Fenced 4.5 s after its last heartbeat, taken over 5 s after it at the soonest.
STOP = {"APPSERVER_STORE__HEARTBEAT_S": "0.5", "APPSERVER_STORE__INSTANCE_TIMEOUT_S": "5"}
# Heartbeats of 2 s: a lost session's grace is 5 s, so a cut of half a second heals unnoticed by
# others, and the word was renewed every half second (not every heartbeat) before the fix.
SLOW = {"APPSERVER_STORE__HEARTBEAT_S": "2", "APPSERVER_STORE__INSTANCE_TIMEOUT_S": "30"}
# A POST sent this long after the holder's session was ended must be refused: the server notices
# within milliseconds (its session's socket closes) and pauses its gateway at once. Before the fix
# the pause waited for the next word, up to 0.5 s later.
NOTICED_WITHIN_S = 0.15
CUT_ROUNDS = 4


@contextmanager
def _own_role(url: str) -> Iterator[str]:
    """A login role of its own (fx_b_*: to cut one server off the database), dropped at the end."""
    role = f"fx_b_s37b_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(url, autocommit=True) as c:
        c.execute(f"CREATE ROLE {role} LOGIN")
        c.execute(f"GRANT ALL ON SCHEMA public TO {role}")
    try:
        yield role
    finally:
        with psycopg.connect(url, autocommit=True) as c:
            c.execute(f"REASSIGN OWNED BY {role} TO CURRENT_USER")
            c.execute(f"DROP OWNED BY {role}")
        with psycopg.connect(ADMIN_URL, autocommit=True) as c:
            c.execute(f"DROP ROLE IF EXISTS {role}")


def _post(port: int, message_id: str) -> httpx.Response:
    body = json.dumps({"id": message_id, "chat": f"c-{message_id}", "sender": "tester", "text": message_id}).encode()
    stamp = str(int(time.time()))
    headers = {"Content-Type": "application/json", TIMESTAMP_HEADER: stamp, SIGNATURE_HEADER: sign(SECRET, stamp, body)}
    return httpx.post(f"http://127.0.0.1:{port}/", content=body, headers=headers, timeout=10)


def _status(port: int, message_id: str) -> int | None:
    try:
        return _post(port, message_id).status_code
    except httpx.HTTPError:
        return None  # its listener is not up (the account is being taken over)


def _wait(check: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _accepted(port: int, message_id: str, timeout: float = 40) -> None:
    """Sent again until the listener at `port` accepts it."""
    _wait(lambda: _status(port, message_id) in (200, 202), timeout, f"{message_id} was never accepted")


def _answered_once(replies: WebhookReplies, ids: list[str], timeout: float = 90) -> None:
    _wait(lambda: all(replies.reply_ids(i) for i in ids), timeout, "not every accepted message was answered")
    time.sleep(1.0)  # a second answer would come soon after the first
    twice = {i: replies.reply_ids(i) for i in ids if len(replies.reply_ids(i)) != 1}
    assert not twice, f"answered under several reply ids: {twice}"


def _ledger_ids(home: Path) -> set[str]:
    return {str(k) for k in ledger_column(home, "message_id")}


def _holder_pid(url: str) -> int | None:
    with psycopg.connect(url, autocommit=True) as c:
        row = c.execute("SELECT i.pid FROM channel_owners o JOIN instances i ON i.id = o.instance_id").fetchone()
    return int(row[0]) if row else None


def _detail(node: ChannelServer) -> str:
    try:
        return str(node.channels_check().get("detail"))
    except (httpx.HTTPError, AssertionError):
        return ""


def _stop(pid: int) -> None:
    """SIGSTOP, returning once the process is seen stopped."""
    os.kill(pid, signal.SIGSTOP)
    _wait(lambda: Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T", 5, "not stopped")


def _webhook(port: int, replies: WebhookReplies) -> dict[str, Any]:
    return {
        "listen": f"127.0.0.1:{port}",
        "secret_env": "WEBHOOK_SECRET",
        "reply_url": replies.url,
        "default_agent": "assistant",
    }


def _server(home: Path, url: str, port: int, replies: WebhookReplies, timings: dict[str, str]) -> ChannelServer:
    write_config(home, {"webhook": {"main": _webhook(port, replies)}}, ["webhook"])
    env = cli_env(home, APPSERVER_STORE__URL=url, WEBHOOK_SECRET=SECRET, **timings)
    return start_channel_server(home, env=env)


def _end(nodes: list[ChannelServer]) -> None:
    for node in nodes:
        try:
            os.kill(node.proc.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        children = gateway_children(node.proc.pid)
        node.kill()
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def replies() -> Iterator[WebhookReplies]:
    receiver = WebhookReplies()
    yield receiver
    receiver.close()


def test_a_stopped_holders_gateway_refuses_from_the_first_moment_and_the_survivor_answers(
    tmp_path: Path, replies: WebhookReplies
) -> None:
    """SIGSTOP of the holder: every POST to its listener from then on is 503 with Retry-After
    (it was 202 for some 2 s, and those messages were never answered); sent again, the survivor
    takes each over and answers it once."""
    with temp_database("gw_s37b") as url:
        nodes: list[ChannelServer] = []
        try:
            for i, port in enumerate(PAIR_PORTS):
                nodes.append(_server(tmp_path / f"node{i}" / "home", url, port, replies, STOP))
                if i == 0:
                    nodes[0].wait_channels_ready(timeout=40)
            holder, survivor = nodes
            _wait(lambda: "runs in instance" in _detail(survivor), 40, "the second server never saw the holder")
            assert _holder_pid(url) == holder.proc.pid
            assert _status(PAIR_PORTS[0], "before") == 202
            _answered_once(replies, ["before"])

            _stop(holder.proc.pid)
            refused: list[str] = []
            began = time.monotonic()
            while time.monotonic() - began < 1.5:  # within the word's old 2 s
                mid = f"stop{len(refused)}"
                answer = _post(PAIR_PORTS[0], mid)
                assert answer.status_code == 503, (mid, round(time.monotonic() - began, 2), answer.text)
                assert answer.headers.get("Retry-After")
                refused.append(mid)
                time.sleep(0.1)
            assert gateway_children(holder.proc.pid)  # its gateway runs: it refused them
            assert not _ledger_ids(holder.home) & set(refused)

            for mid in refused:
                _accepted(PAIR_PORTS[1], mid)
            assert _holder_pid(url) == survivor.proc.pid
            _answered_once(replies, ["before", *refused])
            os.kill(holder.proc.pid, signal.SIGCONT)
            _wait(lambda: not gateway_children(holder.proc.pid), 30, "the fenced holder kept its gateway")
            _answered_once(replies, ["before", *refused], timeout=5)
            assert not _ledger_ids(holder.home) & set(refused)
        finally:
            _end(nodes)


def test_a_holder_pauses_its_gateway_the_moment_its_session_is_lost(tmp_path: Path, replies: WebhookReplies) -> None:
    """Its session ended (its role refused, its backends terminated), a holder's webhook is 503 with
    Retry-After from NOTICED_WITHIN_S on; the cut healed inside the grace, it takes messages again
    itself. Round after round (the word's old tick fell anywhere in its half second), and every
    message accepted, during the cut or sent again after it, is answered once."""
    with temp_database("gw_s37b") as url, _own_role(url) as role:
        nodes: list[ChannelServer] = []
        try:
            node = _server(tmp_path / "home", url.replace("postgres@", f"{role}@", 1), CUT_PORT, replies, SLOW)
            nodes.append(node)
            node.wait_channels_ready(timeout=40)
            assert _status(CUT_PORT, "first") == 202
            accepted, refused = ["first"], []
            for round_ in range(CUT_ROUNDS):
                with psycopg.connect(url, autocommit=True) as c:
                    c.execute(f"ALTER ROLE {role} CONNECTION LIMIT 0")
                    c.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (role,))
                cut_at = time.monotonic()
                late: list[tuple[str, float, int]] = []
                n = 0
                while time.monotonic() - cut_at < 0.5:
                    mid, sent = f"r{round_}m{n}", time.monotonic() - cut_at
                    n += 1
                    answer = _post(CUT_PORT, mid)
                    if answer.status_code == 202:
                        accepted.append(mid)
                        if sent >= NOTICED_WITHIN_S:
                            late.append((mid, round(sent, 3), answer.status_code))
                    else:
                        assert answer.status_code == 503 and answer.headers.get("Retry-After"), answer.text
                        refused.append(mid)
                    time.sleep(0.02)
                assert not late, f"round {round_}: acknowledged after the session was lost: {late}"
                with psycopg.connect(url, autocommit=True) as c:
                    c.execute(f"ALTER ROLE {role} CONNECTION LIMIT -1")
                _accepted(CUT_PORT, f"r{round_}back", timeout=30)  # intake resumed: the same holder
                accepted.append(f"r{round_}back")
            assert _holder_pid(url) == node.proc.pid  # nothing moved
            for mid in refused:
                _accepted(CUT_PORT, mid, timeout=10)
            _answered_once(replies, accepted + refused)
        finally:
            _end(nodes)


def test_a_short_stop_refuses_at_once_and_the_same_holder_answers_the_retry(
    tmp_path: Path, replies: WebhookReplies
) -> None:
    """A stop shorter than the fence: a POST during it is 503 at once (not a 202 its server could
    not submit meanwhile); once it runs again the same server takes the POST sent again and
    answers it, once."""
    with temp_database("gw_s37b") as url:
        nodes: list[ChannelServer] = []
        try:
            timings = {"APPSERVER_STORE__HEARTBEAT_S": "0.5", "APPSERVER_STORE__INSTANCE_TIMEOUT_S": "10"}
            node = _server(tmp_path / "home", url, STOP_PORT, replies, timings)
            nodes.append(node)
            node.wait_channels_ready(timeout=40)
            assert _status(STOP_PORT, "a") == 202
            _stop(node.proc.pid)
            try:
                answer = _post(STOP_PORT, "b")
                assert answer.status_code == 503, answer.text
                assert answer.headers.get("Retry-After")
                assert "b" not in _ledger_ids(node.home)
            finally:
                os.kill(node.proc.pid, signal.SIGCONT)
            _accepted(STOP_PORT, "b", timeout=20)
            assert _holder_pid(url) == node.proc.pid
            _answered_once(replies, ["a", "b"])
            assert "intake paused: the server's process" in node.log()
        finally:
            _end(nodes)
