"""The gateway's state lives in the cluster's PostgreSQL database: a takeover keeps it.

Two real `appserver serve` processes on one real PostgreSQL database, the webhook channel under
`dm_policy = "pairing"`, signed POSTs and a reply receiver (the setup of
tests/test_gateway_cluster_s37b.py). A stranger paired on server A, A killed -9 (its gateway child
too), server B takes the account over: the sender is still approved (no new pairing code), their
chat still goes to the same conversation, and a message A acknowledged (202) but had not answered
when it died is answered by B, exactly once. Before, each server's gateway kept these in its own
home's gateway.db, which the survivor never read.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from gateway.db import default_path
from plugins.webhook.signing import SIGNATURE_HEADER, TIMESTAMP_HEADER, sign
from tests.support.cli import cli_env, run_cli
from tests.support.gateway import ChannelServer, WebhookReplies, gateway_children, start_channel_server, write_config
from tests.support.pg import temp_database

pytestmark = pytest.mark.timeout(240)

SECRET = "pg-state-webhook-secret-0123456789abcdef"
PORTS = (19600, 19601)  # this file's port range: 19600-19609
# Judged gone 5 s after its last heartbeat: the survivor takes the account over soon after a kill.
TIMINGS = {"APPSERVER_STORE__HEARTBEAT_S": "0.5", "APPSERVER_STORE__INSTANCE_TIMEOUT_S": "5"}
CHAT, SENDER = "c-alice", "alice"


def _post(port: int, message_id: str, text: str) -> httpx.Response:
    body = json.dumps({"id": message_id, "chat": CHAT, "sender": SENDER, "text": text}).encode()
    stamp = str(int(time.time()))
    headers = {"Content-Type": "application/json", TIMESTAMP_HEADER: stamp, SIGNATURE_HEADER: sign(SECRET, stamp, body)}
    return httpx.post(f"http://127.0.0.1:{port}/", content=body, headers=headers, timeout=10)


def _accepted(port: int, message_id: str, text: str, timeout: float = 60) -> None:
    def sent() -> bool:
        try:
            return _post(port, message_id, text).status_code in (200, 202)
        except httpx.HTTPError:
            return False  # its listener is not up yet (the account is being taken over)

    _wait(sent, timeout, f"{message_id} was never accepted on port {port}")


def _wait(check: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _server(home: Path, url: str, port: int, replies: WebhookReplies) -> ChannelServer:
    settings = {
        "listen": f"127.0.0.1:{port}",
        "secret_env": "WEBHOOK_SECRET",
        "reply_url": replies.url,
        "default_agent": "assistant",
        "dm_policy": "pairing",
    }
    write_config(home, {"webhook": {"main": settings}}, ["webhook"])
    env = cli_env(home, APPSERVER_STORE__URL=url, WEBHOOK_SECRET=SECRET, **TIMINGS)
    return start_channel_server(home, env=env)


def _holder_pid(url: str) -> int | None:
    with psycopg.connect(url, autocommit=True) as c:
        row = c.execute("SELECT i.pid FROM channel_owners o JOIN instances i ON i.id = o.instance_id").fetchone()
    return int(row[0]) if row else None


def _one(url: str, sql: str, args: tuple[Any, ...] = ()) -> Any:
    with psycopg.connect(url, autocommit=True) as c:
        row = c.execute(sql, args).fetchone()
    return row[0] if row else None


def _detail(node: ChannelServer) -> str:
    try:
        return str(node.channels_check().get("detail"))
    except (httpx.HTTPError, AssertionError):
        return ""


def _kill9(node: ChannelServer) -> None:
    """kill -9 of the server and of its gateway child, as a machine's sudden death."""
    children = gateway_children(node.proc.pid)
    os.kill(node.proc.pid, signal.SIGKILL)
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    node.proc.wait(10)


def _end(nodes: list[ChannelServer]) -> None:
    for node in nodes:
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


def test_a_takeover_keeps_pairing_routes_and_answers_what_the_dead_holder_acknowledged(
    tmp_path: Path, replies: WebhookReplies
) -> None:
    with temp_database("gw_pgstate") as url:
        nodes: list[ChannelServer] = []
        try:
            for i, port in enumerate(PORTS):
                nodes.append(_server(tmp_path / f"node{i}" / "home", url, port, replies))
                if i == 0:
                    nodes[0].wait_channels_ready(timeout=60)
            holder, survivor = nodes
            _wait(lambda: "runs in instance" in _detail(survivor), 60, "the second server never saw the holder")
            assert _holder_pid(url) == holder.proc.pid

            # a stranger writes: held, and told a pairing code
            assert _post(PORTS[0], "p1", "hello").status_code == 202
            text = _wait(lambda: next((t for t in replies.texts_for("p1") if "pairing" in t), None), 30, "no code")
            found = re.search(r"approve (\w{8})", text)
            assert found, text
            # the owner approves it with the CLI of the holder's home (its config names the PG store)
            env = cli_env(holder.home, APPSERVER_STORE__URL=url)
            approved = run_cli(holder.home, "pairing", "approve", found.group(1), env=env)
            assert approved.code == 0, approved.err
            _wait(lambda: any("hello" in t for t in replies.texts_for("p1")), 30, "the held message was not answered")
            assert not default_path(holder.home).exists()  # nothing kept in the home's gateway.db
            key = f"webhook:main:{CHAT}:__root__"
            conversation = _one(url, "SELECT conversation FROM gateway_route_conversations WHERE key = %s", (key,))
            assert conversation, "the chat's conversation was not bound in PostgreSQL"
            assert _one(url, "SELECT count(*) FROM gateway_approved_senders WHERE sender = %s", (SENDER,)) == 1

            # acknowledged by the holder, whose turn runs for seconds: killed -9 before it answers
            assert _post(PORTS[0], "slow1", "/slow 80").status_code == 202
            _wait(
                lambda: _one(url, "SELECT state FROM gateway_ledger WHERE message_id = 'slow1'") == "submitted",
                20,
                "the slow message was never submitted",
            )
            assert not replies.texts_for("slow1")
            _kill9(holder)

            # the survivor takes the account over and answers what the dead holder acknowledged, once
            _wait(lambda: _holder_pid(url) == survivor.proc.pid, 60, "the survivor never took the account over")
            _wait(lambda: replies.reply_ids("slow1"), 60, "the acknowledged message was never answered")
            time.sleep(1.5)  # a second answer would come soon after the first
            assert len(replies.reply_ids("slow1")) == 1, replies.texts_for("slow1")

            # the sender is still approved (answered, no new code) and the chat keeps its conversation
            _accepted(PORTS[1], "m2", "still me")
            _wait(lambda: any("still me" in t for t in replies.texts_for("m2")), 30, "m2 was not answered")
            assert not any("pairing" in t for t in replies.texts_for("m2")), replies.texts_for("m2")
            assert (
                _one(url, "SELECT conversation_id FROM turns WHERE idempotency_key = %s", ("webhook:main:m2",))
                == conversation
            )
            # the reply is seen before the ledger records it delivered (`finished` for a moment)
            _wait(
                lambda: _one(url, "SELECT state FROM gateway_ledger WHERE message_id = 'm2'") == "delivered",
                30,
                "m2 was never recorded delivered",
            )
            assert not default_path(survivor.home).exists()
        finally:
            _end(nodes)
