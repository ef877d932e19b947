"""A keyed request whose first turn a crash interrupted runs again on its repeat; its second turn
completed, and a second crash lost the stored reply: the third repeat ran the request a third time
(the model called twice for one request, its tools twice). The second turn was accepted without the
kernel key, which still named the interrupted first one. Now the re-run takes the key
(`Idempotency.earlier`, `Store.forget_idempotency`), and a later repeat follows it.

Real parts: `appserver serve` on SQLite, killed with SIGKILL; the state the second kill leaves (the
turn completed, the reply not stored) is written into the database as that kill leaves it, as in
tests/test_store_claims_s30f.py."""

from __future__ import annotations

import signal
import sqlite3
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.serve import start_serve
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(120)

KEY = {"Idempotency-Key": "order-42"}
BODY = {"model": "assistant", "messages": [{"role": "user", "content": "/slow 40"}]}


def _rows(home: Path, sql: str) -> list[Any]:
    with sqlite3.connect(home / "appserver.db", timeout=10) as db:
        return db.execute(sql).fetchall()


def test_a_request_run_again_after_a_crash_is_followed_after_the_next(tmp_path: Path) -> None:
    home = tmp_path / "home"
    sp = start_serve(home)

    def first() -> None:
        try:
            httpx.post(f"{sp.url}/v1/chat/completions", json=BODY, headers=KEY, timeout=60)
        except httpx.HTTPError:
            pass  # the server is killed under it

    sender = threading.Thread(target=first, daemon=True)
    sender.start()
    wait_for(lambda: _rows(home, "SELECT 1 FROM turns WHERE status='running'"), 30, "the first turn running")
    sp.stop(signal.SIGKILL)
    sender.join(10)

    sp = start_serve(home)
    try:
        again = httpx.post(f"{sp.url}/v1/chat/completions", json=BODY, headers=KEY, timeout=60)
        assert again.status_code == 200, again.text
        answer = again.json()["choices"][0]["message"]["content"]
        assert [s for (s,) in _rows(home, "SELECT status FROM turns ORDER BY rowid")] == ["interrupted", "completed"]
    finally:
        sp.stop(signal.SIGKILL)
    # killed after the second turn completed, before its reply was stored
    with sqlite3.connect(home / "appserver.db") as db:
        db.execute(
            "UPDATE http_idempotency SET state='pending', status_code=NULL, content_type=NULL, body=NULL,"
            " conversation_id=NULL, owner='999999999:1'"
        )

    sp = start_serve(home)
    try:
        third = httpx.post(f"{sp.url}/v1/chat/completions", json=BODY, headers=KEY, timeout=60)
        assert third.status_code == 200, third.text
        assert third.json()["choices"][0]["message"]["content"] == answer
        statuses = [s for (s,) in _rows(home, "SELECT status FROM turns ORDER BY rowid")]
        assert statuses == ["interrupted", "completed"], statuses  # followed the second turn: no third
        replay = httpx.post(f"{sp.url}/v1/chat/completions", json=BODY, headers=KEY, timeout=60)
        assert replay.headers.get("idempotent-replayed") == "true"
    finally:
        sp.stop()
