"""A write the SQLite store could not make (found by an outside test of a full disk and a file
another process held locked):

1. A conversation made by `X-Conversation-Id` while the file was locked: the request got its 503,
   but the conversation's queued insert was lost while the server kept it in memory, so every later
   input to it was refused as "deleted while the input was accepted" (and `conversations show` said
   unknown) until something made it again. The next accept now writes it first.
2. A full disk (SQLITE_FULL) was a 500 `internal_error` ("the agent's turn failed") on HTTP and a
   bare `OperationalError` on the WebSocket: it is now StoreUnavailable (503 `store_unavailable`),
   saying the disk is full. Provoked with a real SQLite file whose page count is capped.
"""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import httpx
import pytest

from appserver.store.base import StoreUnavailable
from appserver.store.groupcommit import GroupCommit, StoreFull
from tests.support.cli import run_cli
from tests.support.serve import serving

pytestmark = pytest.mark.timeout(90)


def _chat(url: str, conversation: str, text: str) -> httpx.Response:
    body = {"model": "assistant", "messages": [{"role": "user", "content": text}]}
    return httpx.post(url + "/v1/chat/completions", json=body, headers={"X-Conversation-Id": conversation}, timeout=60)


def test_a_conversation_whose_insert_failed_is_written_by_its_next_input(tmp_path: Path) -> None:
    home = tmp_path / "home"
    with serving(home) as sp:
        assert _chat(sp.url, "warm", "hello").status_code == 200
        db = sqlite3.connect(home / "appserver.db", isolation_level=None)
        try:
            db.execute("BEGIN EXCLUSIVE")  # another process holds the file's write lock
            refused = _chat(sp.url, "ghost", "first")
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "store_unavailable", refused.text
        finally:
            db.execute("ROLLBACK")
            db.close()
        ran = run_cli(home, "run", "--conversation", "ghost", "second")
        assert ran.code == 0 and "echo: second" in ran.out, (ran.out, ran.err)
        shown = run_cli(home, "conversations", "show", "ghost")
        assert shown.code == 0 and "ghost" in shown.out, shown.err
        again = _chat(sp.url, "ghost", "third")
        assert again.status_code == 200 and "echo: third" in again.text, again.text
        history = run_cli(home, "conversations", "history", "ghost")
        assert history.code == 0 and "second" in history.out and "third" in history.out, history.out


def test_a_full_disk_is_store_unavailable_and_says_so(tmp_path: Path) -> None:
    path = tmp_path / "full.db"
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute("CREATE TABLE t (b BLOB)")
    pages = conn.execute("PRAGMA page_count").fetchone()[0]
    conn.execute(f"PRAGMA max_page_count = {pages + 4}")  # a few pages left: a disk almost full

    async def main() -> None:
        writes = GroupCommit(lambda: conn, lambda: None, name=f"the store {path}")
        small = writes.submit(lambda tx: tx.execute("INSERT INTO t VALUES (?)", (b"x" * 10,)))
        await small  # what fits is written
        big = writes.submit(lambda tx: tx.execute("INSERT INTO t VALUES (?)", (b"x" * 1_000_000,)))
        with pytest.raises(StoreFull) as full:
            await big
        assert isinstance(full.value, StoreUnavailable) and isinstance(full.value, sqlite3.OperationalError)
        assert "is full" in str(full.value) and str(path) in str(full.value)
        with pytest.raises(StoreUnavailable, match="is full"), writes.transaction() as tx:
            tx.execute("INSERT INTO t VALUES (?)", (b"y" * 1_000_000,))
        fits = writes.submit(lambda tx: tx.execute("INSERT INTO t VALUES (?)", (b"z",)))
        await fits  # the writer goes on
        assert conn.execute("SELECT count(*) FROM t").fetchone()[0] == 2

    asyncio.run(main())
    conn.close()
