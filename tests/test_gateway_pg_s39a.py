"""The gateway on a PostgreSQL store: a COMMIT whose answer was lost, ids too long for an index, a
NUL in a display name, and what `channels status` names (s39 attacker A).

A real `appserver serve` on a real PostgreSQL database, through a TCP proxy that cuts one session
right after it forwarded that session's COMMIT (tests/fakes/pg_commit_cut.py): PostgreSQL commits,
the gateway never hears so, and runs the step again. Before, the step run again was refused
("cannot move from allowed to allowed", "from finished to finished") or a receipt was taken for a
repeat never to process: an acknowledged message was never answered. `pairing approve` exited 1
although the approval was made. The webhook took a 1,000-character CJK id (3,000 bytes), which no
PostgreSQL index row holds (2,704 bytes): 503 "retry later" for ever. A NUL in `sender_name`
(PostgreSQL's text holds none) kept a stranger from ever getting a pairing code. `channels status`
described gateway.db, which such a home never uses.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import psycopg
import pytest

from gateway.pairing import Pairing
from gateway.sqlstore import open_pg
from plugins.webhook.signing import SIGNATURE_HEADER, TIMESTAMP_HEADER, sign
from tests.fakes.pg_commit_cut import CommitCutProxy
from tests.support.cli import cli_env, run_cli
from tests.support.gateway import ChannelServer, WebhookReplies, gateway_children, start_channel_server, write_config
from tests.support.pg import temp_database

pytestmark = pytest.mark.timeout(180)

SECRET = "s39a-webhook-secret-0123456789abcdef"
DECIDE = b"UPDATE gateway_ledger SET state=$1, updated_at=$2, decision=$3, reason=$4 WHERE"
FINISH = b"UPDATE gateway_ledger SET state=$1, updated_at=$2, reply=$3 WHERE"
APPROVE = b"INSERT INTO gateway_approved_senders"
RELEASE = b"UPDATE gateway_ledger SET state='allowed', decision='allow'"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(port: int, data: dict[str, Any]) -> httpx.Response:
    body = json.dumps(data).encode()
    stamp = str(int(time.time()))
    headers = {"Content-Type": "application/json", TIMESTAMP_HEADER: stamp, SIGNATURE_HEADER: sign(SECRET, stamp, body)}
    return httpx.post(f"http://127.0.0.1:{port}/", content=body, headers=headers, timeout=30)


def _msg(mid: str, **extra: Any) -> dict[str, Any]:
    return {"id": mid, "chat": "c1", "sender": "tester", "text": "hello there"} | extra


def _wait(check: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _state(url: str, mid: str) -> str | None:
    with psycopg.connect(url, autocommit=True) as c:
        row = c.execute("SELECT state FROM gateway_ledger WHERE message_id = %s", (mid,)).fetchone()
    return str(row[0]) if row else None


def _upstream(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 5432


@pytest.fixture
def replies() -> Iterator[WebhookReplies]:
    receiver = WebhookReplies()
    yield receiver
    receiver.close()


def _end(node: ChannelServer) -> None:
    children = gateway_children(node.proc.pid)
    node.kill()
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_step_whose_commit_answer_was_lost_is_run_again_and_the_message_answered(
    tmp_path: Path, replies: WebhookReplies
) -> None:
    """F1 (receipt, access decision, final reply, release of a paired sender's messages) and F2/F3/F4."""
    with temp_database("gw_s39a") as url:
        proxy = CommitCutProxy(_upstream(url))
        home = tmp_path / "home"
        open_port, pair_port = _free_port(), _free_port()
        common = {"secret_env": "WEBHOOK_SECRET", "reply_url": replies.url, "default_agent": "assistant"}
        accounts = {
            "main": {"listen": f"127.0.0.1:{open_port}", **common},
            "pair": {"listen": f"127.0.0.1:{pair_port}", "dm_policy": "pairing", **common},
        }
        write_config(home, {"webhook": accounts}, ["webhook"])
        via = proxy.url_for(url)
        cli = cli_env(home, APPSERVER_STORE__URL=url)
        node = start_channel_server(home, env=cli_env(home, APPSERVER_STORE__URL=via, WEBHOOK_SECRET=SECRET))
        try:
            node.wait_channels_ready(timeout=60)
            assert _post(open_port, _msg("warm-1")).status_code == 202
            _wait(lambda: replies.reply_ids("warm-1"), 60, "the first message was never answered")

            # F1a: the receipt's COMMIT cut: 503, the sender retries, and the message is answered
            proxy.arm(b"cut-receipt-1")
            first = _post(open_port, _msg("cut-receipt-1"))
            assert proxy.fired.is_set()
            assert first.status_code == 503, first.text
            again = _wait(
                lambda: (r := _post(open_port, _msg("cut-receipt-1"))).status_code in (200, 202) and r, 30, "503"
            )
            assert again.status_code == 202, again.text  # taken in now: the first record was never taken in
            _wait(lambda: replies.reply_ids("cut-receipt-1"), 30, "the cut receipt's message was never answered")

            # F1b: the access decision's COMMIT cut (received -> allowed made, not heard)
            proxy.arm(DECIDE)
            assert _post(open_port, _msg("cut-decide-1")).status_code == 202
            _wait(proxy.fired.is_set, 20, "the decision's COMMIT was never cut")
            _wait(lambda: replies.reply_ids("cut-decide-1"), 30, "the cut decision's message was never answered")

            # F1c: the final reply's COMMIT cut (submitted -> finished made, not heard)
            proxy.arm(FINISH)
            assert _post(open_port, _msg("cut-finish-1")).status_code == 202
            _wait(proxy.fired.is_set, 30, "the final reply's COMMIT was never cut")
            _wait(lambda: replies.reply_ids("cut-finish-1"), 30, "the cut reply was never delivered")
            for mid in ("cut-receipt-1", "cut-decide-1", "cut-finish-1"):
                _wait(lambda m=mid: _state(url, m) == "delivered", 20, f"{mid} never recorded delivered")
                assert len(replies.reply_ids(mid)) == 1, replies.texts_for(mid)
            assert "cannot move from" not in node.log()

            # F2: an id of 1,000 CJK characters (3,000 bytes): a clear 400, not 503 for ever
            long_id = "".join(chr(0x4E00 + i) for i in range(1000))
            refused = _post(open_port, _msg(long_id))
            assert refused.status_code == 400 and "bytes" in refused.text, refused.text

            # F3: a NUL in a stranger's display name: they are still told their pairing code
            nul = _msg("nul-1", chat="dm-eve", sender="eve", sender_name="Eve\u0000X", chat_type="dm")
            assert _post(pair_port, nul).status_code == 202
            told = _wait(lambda: replies.texts_for("nul-1"), 30, "the stranger with a NUL in the name heard nothing")
            assert any("pairing" in t.lower() for t in told), told

            # F1d: the release of what the approval kept, its COMMIT cut (held -> allowed made, not
            # heard): the look at the pairings runs again, finds nothing held, and still submits it
            code = re.search(r"approve (\w{8})", "\n".join(told))
            assert code, told
            proxy.arm(RELEASE)
            approved = run_cli(home, "pairing", "approve", code.group(1), env=cli)
            assert approved.code == 0, approved.err
            _wait(proxy.fired.is_set, 20, "the release's COMMIT was never cut")
            _wait(lambda: _state(url, "nul-1") == "delivered", 40, "the released message was never answered")

            # F4: status names the database (password masked), not gateway.db
            status = run_cli(home, "channels", "status", env=cli)
            assert status.code == 0, status.err
            assert "gateway.db" not in status.out and "gateway_* in the store's PostgreSQL database" in status.out
            data = json.loads(run_cli(home, "channels", "status", "--json", env=cli).out)
            assert data["gateway_db_exists"] is True and data["gateway_store"] == "postgresql"
        finally:
            _end(node)
            proxy.close()


def test_pairing_approve_whose_commit_answer_was_lost_says_approved(tmp_path: Path) -> None:
    """F1 (the CLI) and F2 (SQLSTATE class 54 is a permanent, clear error)."""
    with temp_database("gw_s39a_cli") as url:
        proxy = CommitCutProxy(_upstream(url))
        home = tmp_path / "home"
        home.mkdir()
        cli = cli_env(home, APPSERVER_STORE__URL=url)
        # F4: before a gateway (or a command that writes) made them, status says the database has no gateway tables
        before = run_cli(home, "channels", "status", env=cli)
        assert before.code == 0, before.err
        assert "gateway.db" not in before.out and "none yet in the store's PostgreSQL database" in before.out
        conn = open_pg(url)
        try:
            code, _ = Pairing(conn).code_for("webhook", "main", "stranger", "S", "dm-s")  # type: ignore[arg-type]
            long_sender = "".join(chr(0x4E00 + i) for i in range(1000))
            big, _ = Pairing(conn).code_for("webhook", "main", long_sender, "L", "dm-l")  # type: ignore[arg-type]
        finally:
            conn.close()
        assert code is not None and big is not None
        proxy.arm(APPROVE)
        try:
            approved = run_cli(
                home, "pairing", "approve", code.code, env=cli_env(home, APPSERVER_STORE__URL=proxy.url_for(url))
            )
        finally:
            proxy.close()
        assert proxy.fired.is_set()
        assert approved.code == 0, approved.err
        assert "Approved stranger" in approved.out
        with psycopg.connect(url, autocommit=True) as c:
            assert c.execute("SELECT count(*) FROM gateway_approved_senders WHERE sender='stranger'").fetchone() == (1,)
        # the revoke's COMMIT cut: revoked all the same (exit 0), not "neither approved nor denied"
        proxy = CommitCutProxy(_upstream(url))
        proxy.arm(b"DELETE FROM gateway_approved_senders")
        try:
            revoked = run_cli(
                home, "pairing", "revoke", "stranger", env=cli_env(home, APPSERVER_STORE__URL=proxy.url_for(url))
            )
        finally:
            proxy.close()
        assert proxy.fired.is_set()
        assert revoked.code == 0 and "Revoked stranger" in revoked.out, revoked.err
        # an index row too big for PostgreSQL: one clear line at once, not "busy" (it never passes)
        started = time.monotonic()
        too_big = run_cli(home, "pairing", "approve", big.code, env=cli_env(home, APPSERVER_STORE__URL=url))
        assert too_big.code == 1 and "too large for PostgreSQL" in too_big.err, too_big.err
        assert "gateway.db" not in too_big.err and time.monotonic() - started < 30
