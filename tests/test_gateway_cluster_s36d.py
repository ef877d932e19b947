"""A channel account's gateway acknowledges no platform message its server cannot vouch for (F3).

Two real `appserver serve` processes on one real PostgreSQL database, both configured with the same
account; the first started holds its lease (`channel_owners`) and runs it in its gateway child. When
that server is stopped (SIGSTOP: a GC, VM or swap stall) or cut off from the database, its gateway
child, a process of its own, used to go on taking the account's messages and acknowledging them
(Telegram's offset confirmed, the webhook's 202) while the server could no longer submit them; once
fenced it stopped its gateway and those messages were never answered. Now its intake pauses within
a couple of seconds: Telegram's updates stay with Telegram, a webhook POST is 503 with Retry-After;
the server that takes the lease over answers them. Real python-telegram-bot against the loopback fake
Bot API (tests/fakes/telegram_api.py); the webhook channel with signed POSTs and a reply receiver.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from plugins.webhook.signing import SIGNATURE_HEADER, TIMESTAMP_HEADER, sign
from tests.fakes.telegram_api import FakeTelegram
from tests.support.cli import cli_env
from tests.support.gateway import (
    ChannelServer,
    WebhookReplies,
    gateway_children,
    ledger_column,
    start_channel_server,
    write_config,
)
from tests.support.pg import require_postgres, temp_database

pytestmark = pytest.mark.timeout(150)

# Short cluster timings: the holder is fenced 2.8 s after its last heartbeat, taken over after 3 s.
FAST = {"APPSERVER_STORE__HEARTBEAT_S": "0.2", "APPSERVER_STORE__INSTANCE_TIMEOUT_S": "3"}
# Fenced 4.5 s after its last heartbeat, taken over 5 s after it at the soonest: a message sent 3 s
# into a stop reaches the stopped holder's gateway alone (which took it before the fix).
STOP = {"APPSERVER_STORE__HEARTBEAT_S": "0.5", "APPSERVER_STORE__INSTANCE_TIMEOUT_S": "5"}
# appserver/channels.py VOUCH_FOR_S (1 s; a stopped server is seen at once by the gateway): a gateway whose server
# went silent takes nothing after that. Messages are sent later than this after the stall began.
PAUSED_AFTER_S = 3.0
SECRET = "s36d-webhook-secret-0123456789abcdef"
LISTEN_PORTS = (22310, 22311)  # the webhook listeners of the two servers (this file's port range)
GRACE_PORTS = (22312, 22313)


def _pids(url: str) -> tuple[str | None, dict[str, int]]:
    """The instance holding the one account's lease, and every instance's pid."""
    with psycopg.connect(url, autocommit=True) as c:
        row = c.execute("SELECT instance_id FROM channel_owners").fetchone()
        pids = {str(i): int(p) for i, p in c.execute("SELECT id, pid FROM instances").fetchall()}
    return (str(row[0]) if row else None), pids


def _holder_pid(url: str) -> int | None:
    holder, pids = _pids(url)
    return pids.get(holder) if holder is not None else None


def _wait(check: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def _ledger_texts(home: Path) -> list[str]:
    """The texts of every message a server's gateway recorded in its ledger (`ledger_column`)."""
    return [str(json.loads(payload).get("text") or "") for payload in ledger_column(home, "payload")]


def _check(node: ChannelServer) -> str:
    try:
        check = node.channels_check()
    except (httpx.HTTPError, AssertionError):
        return ""
    return str(check["detail"]) if check["status"] == "ok" else ""


def _stop_all(nodes: list[ChannelServer]) -> None:
    for sp in nodes:
        try:
            os.kill(sp.proc.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        children = gateway_children(sp.proc.pid)
        sp.kill()
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _start_pair(
    urls: list[str],
    tmp: Path,
    accounts: list[dict[str, Any]],
    channel: str,
    env: dict[str, str],
    timings: dict[str, str],
) -> list[ChannelServer]:
    """Two servers of one cluster, each on its database URL (`urls[i]`) with its own account table
    (`accounts[i]`); the first is ready (holding the lease) before the second starts."""
    nodes: list[ChannelServer] = []
    for i, (url, settings) in enumerate(zip(urls, accounts, strict=True)):
        home = tmp / f"node{i}" / "home"
        write_config(home, {channel: {"main": settings}}, [channel])
        node = start_channel_server(home, env=cli_env(home, APPSERVER_STORE__URL=url, **timings, **env))
        nodes.append(node)
        if i == 0:
            node.wait_channels_ready(timeout=40)
        else:  # its gateway never starts (`wait_channels_ready` would wait for one): the check says who runs it
            _wait(
                lambda n=node: "runs in instance" in _check(n), 40, "the second server never saw the account's holder"
            )
    assert _holder_pid(urls[1]) == nodes[0].proc.pid
    assert gateway_children(nodes[0].proc.pid) and not gateway_children(nodes[1].proc.pid)
    return nodes


def test_a_stopped_holder_leaves_telegram_updates_to_the_server_taking_over(tmp_path: Path) -> None:
    """SIGSTOP of the holder: a DM sent during the stop is not taken by its gateway (not in its
    ledger, its update not confirmed), and is answered, once, by the survivor's gateway."""
    require_postgres()
    with temp_database("gw_s36d_tg") as url, FakeTelegram() as tg:
        settings = {
            "api_url": tg.url,
            "poll_timeout": 1,
            "token_env": "TG_TOKEN",
            "dm_policy": "open",
            "default_agent": "assistant",
        }
        nodes: list[ChannelServer] = []
        try:
            nodes = _start_pair([url, url], tmp_path, [settings, settings], "telegram", {"TG_TOKEN": tg.token}, STOP)
            holder, survivor = nodes
            tg.dm("before the stop", user_id=7101)
            tg.wait_for_text(7101, "echo: before the stop", timeout=30)

            os.kill(holder.proc.pid, signal.SIGSTOP)
            try:
                time.sleep(PAUSED_AFTER_S)
                during = tg.dm("during the stop", user_id=7101)
                time.sleep(1.0)  # no other server can run the account yet: its gateway polls alone
                assert "during the stop" not in _ledger_texts(holder.home)
                tg.wait_for_text(7101, "echo: during the stop", timeout=40)
                assert _holder_pid(url) == survivor.proc.pid
                assert tg.acked(during)
                # the holder's gateway never took it (it may have exited since: its writes are fenced
                # once the survivor took the account over, gateway/sqlstore.py)
                assert "during the stop" not in _ledger_texts(holder.home)
            finally:
                os.kill(holder.proc.pid, signal.SIGCONT)
            # back, the old holder is fenced and stops its gateway; the survivor answers what follows once
            _wait(lambda: not gateway_children(holder.proc.pid), 30, "the fenced holder kept its gateway")
            tg.dm("after the stop", user_id=7101)
            tg.wait_for_text(7101, "echo: after the stop", timeout=30)
            time.sleep(1.0)
            assert [m.text for m in tg.messages(7101)] == [
                "echo: before the stop",
                "echo: during the stop",
                "echo: after the stop",
            ]
            assert "during the stop" not in _ledger_texts(holder.home)
        finally:
            _stop_all(nodes)


def test_a_short_stop_pauses_intake_and_the_holder_answers_after_it(tmp_path: Path) -> None:
    """A stop shorter than the timeout (one server of a cluster): during it the gateway takes the
    DM sent meanwhile neither into its ledger nor off Telegram; once the server answers again, still
    holding the lease, intake resumes and the same server answers it, once."""
    require_postgres()
    with temp_database("gw_s36d_short") as url, FakeTelegram() as tg:
        home = tmp_path / "home"
        settings = {"api_url": tg.url, "poll_timeout": 1, "token_env": "TG_TOKEN", "dm_policy": "open"}
        write_config(home, {"telegram": {"main": {**settings, "default_agent": "assistant"}}}, ["telegram"])
        env = cli_env(
            home,
            APPSERVER_STORE__URL=url,
            APPSERVER_STORE__HEARTBEAT_S="0.5",
            APPSERVER_STORE__INSTANCE_TIMEOUT_S="10",  # fenced 9.5 s after its last heartbeat
            TG_TOKEN=tg.token,
        )
        node = start_channel_server(home, env=env)
        try:
            node.wait_channels_ready(timeout=40)
            tg.dm("before the stop", user_id=7201)
            tg.wait_for_text(7201, "echo: before the stop", timeout=30)
            os.kill(node.proc.pid, signal.SIGSTOP)
            try:
                time.sleep(PAUSED_AFTER_S)
                during = tg.dm("during the stop", user_id=7201)
                time.sleep(1.5)  # a poll's answer, recorded and confirmed at the next poll, before
                assert "during the stop" not in _ledger_texts(home)
                assert not tg.acked(during)
            finally:
                os.kill(node.proc.pid, signal.SIGCONT)
            tg.wait_for_text(7201, "echo: during the stop", timeout=30)
            assert tg.acked(during) and _holder_pid(url) == node.proc.pid
            assert _ledger_texts(home).count("during the stop") == 1
            time.sleep(1.0)
            assert [m.text for m in tg.messages(7201)] == ["echo: before the stop", "echo: during the stop"]
        finally:
            _stop_all([node])


def _post(port: int, message_id: str, text: str) -> httpx.Response:
    body = json.dumps({"id": message_id, "chat": "kitchen", "sender": "tester", "text": text}).encode()
    stamp = str(int(time.time()))
    headers = {
        "Content-Type": "application/json",
        TIMESTAMP_HEADER: stamp,
        SIGNATURE_HEADER: sign(SECRET, stamp, body),
    }
    return httpx.post(f"http://127.0.0.1:{port}/", content=body, headers=headers, timeout=10)


@contextmanager
def _own_role(url: str) -> Iterator[str]:
    """A login role of its own (to cut one server off the database), dropped at the end."""
    role = f"s36d_{os.getpid()}_{time.monotonic_ns() % 100000}"
    with psycopg.connect(url, autocommit=True) as c:
        c.execute(f"CREATE ROLE {role} LOGIN")
        c.execute(f"GRANT ALL ON SCHEMA public TO {role}")
    try:
        yield role
    finally:
        with psycopg.connect(url, autocommit=True) as c:
            c.execute(f"ALTER ROLE {role} CONNECTION LIMIT -1")


def _drop_role(role: str) -> None:
    from tests.support.pg import ADMIN_URL

    with psycopg.connect(ADMIN_URL, autocommit=True) as c:
        c.execute(f"DROP ROLE IF EXISTS {role}")


def test_a_cut_off_holders_webhook_answers_503_and_the_survivor_answers_the_retry(tmp_path: Path) -> None:
    """The holder cut off from the database (its role refused, its sessions ended): a POST to its
    listener is 503 with Retry-After, never a 202 nobody answers; the same POST sent again to the
    survivor's listener, once it took the account over, is accepted and answered."""
    require_postgres()
    replies = WebhookReplies()
    role = ""
    try:
        with temp_database("gw_s36d_wh") as url, _own_role(url) as role:
            accounts = [
                {
                    "listen": f"127.0.0.1:{port}",
                    "secret_env": "WEBHOOK_SECRET",
                    "reply_url": replies.url,
                    "default_agent": "assistant",
                }
                for port in LISTEN_PORTS
            ]
            nodes: list[ChannelServer] = []
            try:
                own_url = url.replace("postgres@", f"{role}@", 1)
                nodes = _start_pair([own_url, url], tmp_path, accounts, "webhook", {"WEBHOOK_SECRET": SECRET}, FAST)
                holder, _survivor = nodes
                assert _post(LISTEN_PORTS[0], "c1", "before the cut").status_code == 202
                _wait(lambda: replies.texts_for("c1"), 30, "c1 was not answered")

                with psycopg.connect(url, autocommit=True) as c:
                    c.execute(f"ALTER ROLE {role} CONNECTION LIMIT 0")
                    c.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (role,))
                time.sleep(PAUSED_AFTER_S)
                refused = _post(LISTEN_PORTS[0], "c2", "during the cut")
                assert refused.status_code == 503, refused.text
                assert refused.headers.get("Retry-After")
                assert "during the cut" not in _ledger_texts(holder.home)

                def accepted_by_survivor() -> bool:
                    try:
                        return _post(LISTEN_PORTS[1], "c2", "during the cut").status_code == 202
                    except httpx.HTTPError:
                        return False  # its listener is not up yet: the account is being taken over

                _wait(accepted_by_survivor, 40, "the survivor never accepted the retried c2")
                texts = _wait(lambda: replies.texts_for("c2"), 30, "c2 was not answered")
                assert texts == ["echo: during the cut"]
                assert "during the cut" not in _ledger_texts(holder.home)
            finally:
                _stop_all(nodes)
    finally:
        replies.close()
        if role:
            _drop_role(role)


# Heartbeats of 2 s (the default): a grace of 5 s before the others may judge a lost session's
# server gone. The gateway paused only at that point, so a message taken 2 s into a cut could not
# be submitted and, once the account moved, stayed in this gateway's ledger.
SLOW_GRACE = {"APPSERVER_STORE__HEARTBEAT_S": "2", "APPSERVER_STORE__INSTANCE_TIMEOUT_S": "30"}


def test_a_holder_whose_session_is_lost_pauses_at_once_and_takes_messages_again_once_back(tmp_path: Path) -> None:
    """Cut off for 3 s, inside its grace: its listener is 503 (not a 202 it could not submit) from
    soon after the cut, and once its session is back and the lease checked it takes and answers
    messages again itself (nobody took the account over)."""
    require_postgres()
    replies = WebhookReplies()
    role = ""
    try:
        with temp_database("gw_s36_grace") as url, _own_role(url) as role:
            accounts = [
                {
                    "listen": f"127.0.0.1:{port}",
                    "secret_env": "WEBHOOK_SECRET",
                    "reply_url": replies.url,
                    "default_agent": "assistant",
                }
                for port in GRACE_PORTS
            ]
            nodes: list[ChannelServer] = []
            try:
                own_url = url.replace("postgres@", f"{role}@", 1)
                nodes = _start_pair(
                    [own_url, url], tmp_path, accounts, "webhook", {"WEBHOOK_SECRET": SECRET}, SLOW_GRACE
                )
                holder = nodes[0]
                assert _post(GRACE_PORTS[0], "g1", "before the cut").status_code == 202
                _wait(lambda: replies.texts_for("g1"), 30, "g1 was not answered")
                with psycopg.connect(url, autocommit=True) as c:
                    c.execute(f"ALTER ROLE {role} CONNECTION LIMIT 0")
                    c.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (role,))
                time.sleep(2.0)
                refused = _post(GRACE_PORTS[0], "g2", "during the cut")
                assert refused.status_code == 503, refused.text
                assert "during the cut" not in _ledger_texts(holder.home)
                time.sleep(1.0)
                with psycopg.connect(url, autocommit=True) as c:
                    c.execute(f"ALTER ROLE {role} CONNECTION LIMIT -1")
                _wait(lambda: _post(GRACE_PORTS[0], "g2", "during the cut").status_code == 202, 30, "never took g2")
                assert _wait(lambda: replies.texts_for("g2"), 30, "g2 was not answered") == ["echo: during the cut"]
                assert _holder_pid(url) == holder.proc.pid  # still the holder: nothing moved
            finally:
                _stop_all(nodes)
    finally:
        replies.close()
        if role:
            _drop_role(role)
