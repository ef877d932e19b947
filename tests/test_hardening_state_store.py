"""Issue 11 (6, 17): a store is never silently truncated: a damaged or lost WAL after kill -9 and
a store behind its recorded position are refused loudly, clean stops and plain kill -9 never are.
Real `appserver serve` subprocesses, real SQLite files, kill -9. (11.5, 11.13 and 11.16, an
unreadable database, a full disk and state files set aside, are in test_hardening_state_disk.py:
two files, so that xdist runs them at once.)"""

from __future__ import annotations

import hashlib
import signal
import struct
from pathlib import Path

import pytest

from tests.support.cli import run_cli
from tests.support.serve import start_serve
from tests.support.state import chat, conversations, one_error_line, serve_refused, store_behind_symlink

# ── 11.6 a damaged WAL after kill -9 is refused loudly, the files kept ─────────────────────────


def _live_frames(wal: Path) -> list[int]:
    """Offsets of the frames of the WAL's current generation (their salt matches the header's)."""
    data = wal.read_bytes()
    page_size = struct.unpack(">I", data[8:12])[0]
    salt = data[16:24]
    frame = 24 + page_size
    return [
        32 + i * frame
        for i in range((len(data) - 32) // frame)
        if data[32 + i * frame + 8 : 32 + i * frame + 16] == salt
    ]


def test_damaged_wal_after_kill9_is_refused_and_kept(home: Path) -> None:
    sp = start_serve(home)
    for i in range(40):
        chat(sp, f"conversation {i} " + "x" * 2000)
    sp.stop(signal.SIGKILL)
    wal = home / "appserver.db-wal"
    frames = _live_frames(wal)
    assert len(frames) >= 4, "the commits should still be in the WAL right after kill -9"
    with open(wal, "r+b") as f:  # one bad byte in the page of a frame in the middle of the live log
        f.seek(frames[len(frames) // 2] + 24 + 100)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    damaged = hashlib.sha256(wal.read_bytes()).hexdigest()

    line = one_error_line(serve_refused(home))
    assert "write-ahead log" in line and "is damaged" in line and "committed transaction(s)" in line
    assert "--accept-data-loss" in line and "Nothing was changed" in line
    kept = list(home.glob("appserver.db.damaged-*"))
    assert len(kept) == 1 and str(kept[0]) in line
    assert hashlib.sha256((kept[0] / "appserver.db-wal").read_bytes()).hexdigest() == damaged
    assert hashlib.sha256(wal.read_bytes()).hexdigest() == damaged  # the live WAL untouched too
    # Every start refuses the same way (and reuses the copy); so does an in-process command.
    assert "is damaged" in one_error_line(serve_refused(home))
    assert "is damaged" in one_error_line(run_cli(home, "conversations", "list"))
    assert len(list(home.glob("appserver.db.damaged-*"))) == 1

    sp = start_serve(home, "--accept-data-loss")  # the operator's deliberate choice
    sp.stop()
    assert "accepted data loss" in sp.proc.stderr.read()
    sp = start_serve(home)  # accepted once: later starts are normal
    sp.stop()


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        ("torn-sector", "has a damaged header"),  # the first 512 bytes zeroed
        ("magic", "has a damaged header (not a WAL's magic number)"),
        ("salt", "has a damaged header (checksum)"),  # another salt, its checksum no longer fits
    ],
)
def test_a_wal_whose_header_was_damaged_after_kill9_is_refused(home: Path, damage: str, said: str) -> None:
    """SQLite drops a WAL with a bad header whole, and starts a new one: every commit in it was
    lost without a word (was: the server started, ready, with hundreds of acknowledged turns
    gone). The wal-index a crash leaves says frames are due: a header that cannot be theirs is
    refused, the files kept."""
    sp = start_serve(home)
    for i in range(30):
        chat(sp, f"conversation {i} " + "x" * 2000)
    sp.stop(signal.SIGKILL)
    wal = home / "appserver.db-wal"
    assert len(_live_frames(wal)) >= 4, "the commits should still be in the WAL right after kill -9"
    with open(wal, "r+b") as f:
        if damage == "torn-sector":
            f.write(bytes(512))
        elif damage == "magic":
            f.write(b"\x00\x00\x00\x00")
        else:
            f.seek(16)
            salt = f.read(4)
            f.seek(16)
            f.write(bytes(b ^ 0x5A for b in salt))
    line = one_error_line(serve_refused(home))
    assert "write-ahead log" in line and said in line and "not yet in the database" in line, line
    assert "--accept-data-loss" in line and len(list(home.glob("appserver.db.damaged-*"))) == 1
    sp = start_serve(home, "--accept-data-loss")
    sp.stop()
    assert "accepted data loss" in sp.proc.stderr.read()


def test_clean_stops_and_kill9_never_refuse(home: Path) -> None:
    """The checks must not cry wolf: SIGTERM and plain kill -9 leave a store that opens."""
    total = 0
    for stop in (signal.SIGTERM, signal.SIGKILL, signal.SIGKILL, signal.SIGTERM):
        sp = start_serve(home)
        for i in range(8):
            chat(sp, f"turn {total + i}")
        total += 8
        sp.stop(stop)
    sp = start_serve(home)
    sp.stop()
    assert "Traceback" not in sp.proc.stderr.read()
    assert conversations(home) == total
    assert not list(home.glob("appserver.db.damaged-*"))


def test_store_behind_its_recorded_position_is_refused(home: Path, tmp_path: Path) -> None:
    sp = start_serve(home)
    chat(sp, "first")
    sp.stop()
    old = (home / "appserver.db").read_bytes()  # clean stop: the whole store is in this file
    sp = start_serve(home)
    for i in range(3):
        chat(sp, f"later {i}")
    sp.stop()
    (home / "appserver.db").write_bytes(old)  # an older copy put back (or a WAL lost)
    line = one_error_line(serve_refused(home))
    assert "behind its last recorded position" in line and "--accept-data-loss" in line
    assert conversations(home) == 1  # nothing changed
    sp = start_serve(home, "--accept-data-loss")
    sp.stop()
    sp = start_serve(home)
    sp.stop()


def test_a_damaged_position_record_is_set_aside_loudly_not_ignored(home: Path) -> None:
    """The position record is what tells a store put back from an older copy: an unreadable one
    was ignored with a warning and then overwritten, so the evidence went. Now it is moved aside
    with an error, and /readyz warns while it lies there."""
    import httpx

    sp = start_serve(home)
    chat(sp, "first")
    sp.stop()
    position = home / "appserver.db.position"
    position.write_text('{"messages_seq": ')  # damaged
    sp = start_serve(home)
    try:
        aside = list(home.glob("appserver.db.position.corrupt-*"))
        assert len(aside) == 1 and aside[0].read_text() == '{"messages_seq": '
        ready = httpx.get(sp.url + "/readyz", timeout=5).json()
        files = next(c for c in ready["checks"] if c["name"] == "state_files")
        assert files["status"] == "warn" and "appserver.db.position.corrupt-" in files["detail"], files
        chat(sp, "second")
    finally:
        sp.stop()
    err = sp.proc.stderr.read() if sp.proc.stderr else ""
    assert "ERROR" in err and "appserver.db.position" in err and "cannot be checked" in err, err[-2000:]


@pytest.mark.parametrize("value", ["1e400", "true", '"5"', "1.9", "-3", "null"])
def test_a_position_record_of_the_wrong_kind_is_damage_not_a_position(tmp_path: Path, value: str) -> None:
    """`1e400` (infinity: the start died with a traceback), `true` (read as 1: a fresh store was
    refused as behind it), a string, a fraction: none is a message number."""
    from appserver.store.integrity import position_path, read_position

    db = tmp_path / "appserver.db"
    position_path(db).write_text('{"messages_seq": ' + value + "}")
    assert read_position(db) is None
    assert len(list(tmp_path.glob("appserver.db.position.corrupt-*"))) == 1


# ── damaged pages: found at the start, or by a write while the server runs ─────────────────────


def _garble_index(db: Path, name: str = "turns") -> None:
    """Overwrite the root page of one of `name`'s indexes with garbage, as a bad sector would."""
    import sqlite3

    conn = sqlite3.connect(db)
    page_size = conn.execute("PRAGMA page_size").fetchone()[0]
    root = conn.execute("SELECT rootpage FROM sqlite_master WHERE type = 'index' AND tbl_name = ?", (name,)).fetchone()[
        0
    ]
    conn.close()
    with open(db, "r+b") as f:
        f.seek((root - 1) * page_size)
        f.write(bytes((i * 37 + 11) % 256 for i in range(page_size)))


def test_a_store_with_damaged_pages_is_refused_at_the_start(home: Path) -> None:
    """SQLite finds a damaged page only when something reads it: the server started, /readyz said
    ready, and every request touching the page failed. Now the start checks every page."""
    sp = start_serve(home)
    for i in range(3):
        chat(sp, f"hello {i}")
    sp.stop()
    before = hashlib.sha256((home / "appserver.db").read_bytes()).hexdigest()
    _garble_index(home / "appserver.db")
    garbled = hashlib.sha256((home / "appserver.db").read_bytes()).hexdigest()
    assert garbled != before
    line = one_error_line(serve_refused(home))
    assert "is damaged" in line and "restore it from a backup" in line, line
    assert hashlib.sha256((home / "appserver.db").read_bytes()).hexdigest() == garbled  # left as it is
    assert "is damaged" in one_error_line(run_cli(home, "conversations", "list"))
    import sqlite3

    held = sqlite3.connect(home / "appserver.db")  # an operator's shell has it open: still checked
    try:
        held.execute("SELECT count(*) FROM sqlite_master").fetchone()
        assert "is damaged" in one_error_line(serve_refused(home))
    finally:
        held.close()


async def test_a_write_that_meets_a_damaged_page_fails_readiness(tmp_path: Path) -> None:
    """Damage that appears while the server runs: the first write that meets it marks the store
    damaged, said once in the log, and the store's readiness check fails from then on."""
    import sqlite3

    import pytest

    from appserver.store import SQLiteStore
    from appserver.store.base import StoreError
    from appserver.store.records import AgentRecord, ConversationRecord, TurnRecord

    store = SQLiteStore(tmp_path / "store.db")
    await store.open()
    try:
        await store.create_agent(AgentRecord(id="agt_1", name="a1"))
        await store.create_conversation(ConversationRecord(id="conv_1", agent_id="agt_1"))
        assert (await store.check_writable()).startswith("writable")
        _garble_index(tmp_path / "store.db")
        store.db.execute("PRAGMA shrink_memory")  # the writer reads the page again from the file
        with pytest.raises(sqlite3.DatabaseError):
            for i in range(50):
                await store.accept_turn(TurnRecord(id=f"turn_{i}", conversation_id="conv_1", agent_id="agt_1"))
        with pytest.raises(StoreError, match="is damaged"):
            await store.check_writable()
    finally:
        await store.close()


async def test_a_read_that_meets_a_damaged_page_fails_readiness_too(tmp_path: Path) -> None:
    """A turn of a conversation whose messages sit on a damaged page (its history read, its writes)
    fails, and the store is marked damaged: it stayed 'ready' while every turn of the conversation
    failed. (A failure only a front end sees, a read of `get_history` or of a route, reaches the
    store through `Store.note_failure` the same way.)"""
    import sqlite3

    import pytest

    from appserver.runtime import SubmitRequest
    from appserver.store.base import StoreError
    from tests.support.kernel import open_server

    server = await open_server(tmp_path / "h")
    try:
        first = await server.kernel.submit(SubmitRequest(agent="assistant", input="hello " * 200, conversation="new"))
        await first.wait(5)
        server.kernel.evict_idle(0)  # the next turn reads its history from the file
        server.store.db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()  # type: ignore[attr-defined]
        db = server.store.path  # type: ignore[attr-defined]
        conn = sqlite3.connect(db)
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
        root = conn.execute("SELECT rootpage FROM sqlite_master WHERE type = 'table' AND name = 'messages'").fetchone()[
            0
        ]
        conn.close()
        with open(db, "r+b") as f:
            f.seek((root - 1) * page_size)
            f.write(bytes((i * 37 + 11) % 256 for i in range(page_size)))
        server.store.db.execute("PRAGMA shrink_memory")  # type: ignore[attr-defined]
        again = await server.kernel.submit(
            SubmitRequest(agent="assistant", input="again", conversation=first.conversation_id)
        )
        snap = await again.wait(5)
        assert snap.status == "failed", snap
        with pytest.raises(StoreError, match="is damaged"):
            await server.store.check_writable()
    finally:
        await server.close()


def test_a_store_reached_through_a_symlink_is_checked_where_sqlite_keeps_its_log(home: Path, tmp_path: Path) -> None:
    """`appserver.db` a symbolic link to a file on another disk: SQLite keeps `-wal` and `-shm`
    beside the target, and the checks look there (was: they looked beside the link, found
    nothing, and a WAL damaged after kill -9 lost acknowledged turns with the server ready)."""
    assert run_cli(home, "agents", "list").code == 0
    data = store_behind_symlink(home, tmp_path / "data").parent
    sp = start_serve(home)
    for i in range(20):
        chat(sp, f"conversation {i} " + "x" * 2000)
    sp.stop(signal.SIGKILL)
    wal = data / "real.db-wal"
    assert len(_live_frames(wal)) >= 4, "the commits should still be in the WAL right after kill -9"
    with open(wal, "r+b") as f:
        f.seek(24)
        f.write(b"\xde\xad\xbe\xef")  # the header's checksum
    line = one_error_line(serve_refused(home))
    assert "has a damaged header (checksum)" in line and "real.db-shm" in line, line
