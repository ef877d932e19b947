"""gateway/ledger.py and gateway/db.py: the ledger on disk, its state machine, resume queries and
what happens to a corrupt file."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.db import MIGRATIONS, CorruptGatewayDB, LedgerFileRefused, SchemaTooNew, default_path, open_db
from gateway.ledger import Ledger, LedgerStateError, UpdateKey

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "home" / "channels" / "gateway.db"


def key(n: int | str) -> UpdateKey:
    return UpdateKey("telegram", "main", str(n))


def test_default_path_follows_appserver_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APPSERVER_HOME", str(tmp_path / "h"))
    assert default_path() == tmp_path / "h" / "channels" / "gateway.db"


def test_opens_in_wal_with_current_schema(db_path: Path) -> None:
    ledger = Ledger.open(db_path)
    try:
        conn = ledger.connection
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA user_version").fetchone()[0] == MIGRATIONS[-1][0]
        assert db_path.stat().st_mode & 0o777 == 0o600
    finally:
        ledger.close()
    # Reopening migrates nothing and keeps the rows.
    again = Ledger.open(db_path)
    again.record(key(1), chat="c", sender="s")
    again.close()
    third = Ledger.open(db_path)
    assert third.get(key(1)) is not None
    third.close()


def test_same_update_twice_is_one_row(db_path: Path) -> None:
    ledger = Ledger.open(db_path)
    first, created = ledger.record(key(7), chat="c1", sender="u1", payload={"text": "hi"})
    again, created_again = ledger.record(key(7), chat="other", sender="u2", payload={"text": "x"})
    assert created and not created_again
    assert again == first  # the redelivery changed nothing
    assert first.idempotency_key == "telegram:main:7"
    assert first.state == "received" and first.payload == {"text": "hi"}
    # Another account with the same platform message id is another update.
    _, created_other = ledger.record(UpdateKey("telegram", "second", "7"), chat="c1", sender="u1")
    assert created_other
    n = ledger.connection.execute("SELECT COUNT(*) FROM ledger").fetchone()[0]
    assert n == 2
    ledger.close()


def test_full_path_to_delivered(db_path: Path) -> None:
    ledger = Ledger.open(db_path)
    ledger.record(key(1), chat="c", sender="s", thread="t9")
    assert ledger.decide(key(1), "allow", "open dm policy").state == "allowed"
    assert ledger.mark_submitted(key(1), "turn_1").turn_id == "turn_1"
    assert ledger.mark_submitted(key(1), "turn_1").state == "submitted"  # repeat is a no-op
    assert ledger.mark_finished(key(1), "hello back").reply == "hello back"
    done = ledger.mark_delivered(key(1), ["m-1", 2])
    assert done.state == "delivered" and done.remote_ids == ("m-1", "2")
    assert done.decision == "allow" and done.reason == "open dm policy" and done.thread == "t9"
    assert ledger.counts() == {"delivered": 1}
    ledger.close()


def test_illegal_moves_are_refused_and_change_nothing(db_path: Path) -> None:
    ledger = Ledger.open(db_path)
    ledger.record(key(1), chat="c", sender="s")
    with pytest.raises(LedgerStateError):
        ledger.mark_submitted(key(1), "turn_1")  # no access decision yet
    ledger.decide(key(1), "deny", "not on the allowlist")
    with pytest.raises(LedgerStateError):
        ledger.decide(key(1), "allow", "second thoughts")
    with pytest.raises(LedgerStateError):
        ledger.mark_failed(key(1), "x")
    entry = ledger.get(key(1))
    assert entry is not None and entry.state == "denied" and entry.reason == "not on the allowlist"
    ledger.record(key(2), chat="c", sender="s")
    ledger.decide(key(2), "allow", "ok")
    ledger.mark_submitted(key(2), "turn_a")
    with pytest.raises(LedgerStateError):
        ledger.mark_submitted(key(2), "turn_b")  # a different turn for the same update
    with pytest.raises(LedgerStateError):
        ledger.mark_delivered(key(2), ["r"])  # nothing finished yet
    with pytest.raises(LedgerStateError):
        ledger.mark_finished(UpdateKey("telegram", "main", "nope"), "x")
    ledger.close()


def test_held_message_is_released_by_pairing(db_path: Path) -> None:
    ledger = Ledger.open(db_path)
    ledger.record(key(1), chat="dm1", sender="stranger")
    assert ledger.decide(key(1), "pair", "unknown sender: code sent").state == "held"
    assert ledger.to_submit() == []
    released = ledger.release(key(1), "pairing approved")
    assert released.state == "allowed" and released.decision == "allow"
    assert [e.key for e in ledger.to_submit()] == [key(1)]
    ledger.close()


def test_failure_records_the_reason(db_path: Path) -> None:
    ledger = Ledger.open(db_path)
    ledger.record(key(1), chat="c", sender="s")
    ledger.decide(key(1), "allow", "ok")
    ledger.mark_submitted(key(1), "t1")
    ledger.mark_finished(key(1), "reply")
    failed = ledger.mark_failed(key(1), "403 bot was blocked by the user")
    assert failed.state == "failed" and failed.reason == "403 bot was blocked by the user"
    assert failed.reply == "reply"  # what was not delivered stays readable
    ledger.close()


def test_resume_queries_after_a_restart(db_path: Path) -> None:
    """Each state a crash can leave a row in shows up in exactly one resume query, oldest first."""
    ledger = Ledger.open(db_path)
    for n in range(1, 9):
        ledger.record(key(n), chat=f"c{n % 2}", sender="s")
    for n in (2, 3, 4, 5, 6, 7, 8):
        ledger.decide(key(n), "allow", "ok")
    for n in (4, 5, 6, 7):
        ledger.mark_submitted(key(n), f"turn_{n}")
    for n in (6, 7):
        ledger.mark_finished(key(n), f"reply {n}")
    ledger.mark_delivered(key(7), ["r7"])
    ledger.close()  # the process dies; a new one opens the same file

    after = Ledger.open(db_path)
    assert [e.key.message_id for e in after.to_decide()] == ["1"]
    assert [e.key.message_id for e in after.to_submit()] == ["2", "3", "8"]
    assert [(e.key.message_id, e.turn_id) for e in after.in_flight()] == [
        ("4", "turn_4"),
        ("5", "turn_5"),
    ]
    undelivered = after.to_deliver()
    assert [(e.key.message_id, e.reply) for e in undelivered] == [("6", "reply 6")]
    after.close()


def test_record_is_durable_before_it_returns(db_path: Path) -> None:
    """A process killed right after `record` returned (where an adapter would ack) keeps the row."""
    code = (
        "import os, sys; from pathlib import Path; from gateway.ledger import Ledger, UpdateKey\n"
        f"l = Ledger.open(Path({str(db_path)!r}))\n"
        "l.record(UpdateKey('webhook', 'a', 'd-1'), chat='c', sender='s', payload={'text': 'x'})\n"
        "os._exit(0)\n"  # no close, no checkpoint, no atexit
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)
    ledger = Ledger.open(db_path)
    entry = ledger.get(UpdateKey("webhook", "a", "d-1"))
    assert entry is not None and entry.payload == {"text": "x"}
    ledger.close()


def test_corrupt_file_is_moved_aside_never_emptied(db_path: Path) -> None:
    db_path.parent.mkdir(parents=True)
    garbage = b"this is not a database, but it is somebody's data\n" * 200
    db_path.write_bytes(garbage)
    with pytest.raises(CorruptGatewayDB) as info:
        open_db(db_path)
    moved = info.value.moved_to
    assert moved.name.startswith("gateway.db.corrupt-")
    assert moved.read_bytes() == garbage
    assert not db_path.exists()
    assert str(moved) in str(info.value)
    # The next start gets a fresh, working ledger; the old bytes stay where they were put.
    ledger = Ledger.open(db_path)
    assert ledger.record(key(1), chat="c", sender="s")[1]
    ledger.close()
    assert moved.read_bytes() == garbage


def test_an_emptied_ledger_is_moved_aside_with_its_wal_not_opened_as_new(db_path: Path) -> None:
    ledger = Ledger.open(db_path)
    ledger.record(key(1), chat="c", sender="s", payload={"text": "x"})
    ledger.close()
    wal = db_path.with_name(db_path.name + "-wal")
    wal.write_bytes(b"what a truncated ledger left in its log")
    db_path.write_bytes(b"")  # truncated (a full disk, a bad copy)
    with pytest.raises(CorruptGatewayDB, match=r"empty \(0 bytes\)") as info:
        open_db(db_path)
    moved = info.value.moved_to
    assert moved.read_bytes() == b""
    assert moved.with_name(moved.name + "-wal").read_bytes() == b"what a truncated ledger left in its log"
    assert not db_path.exists() and not wal.exists()
    fresh = Ledger.open(db_path)  # what the gateway does next: a new ledger, loudly
    assert fresh.get(key(1)) is None
    fresh.close()


def test_a_locked_ledger_is_an_error_and_stays_in_place(db_path: Path) -> None:
    """Busy is not corrupt: a ledger another process holds locked past the busy timeout is refused
    with SQLite's error and never moved aside (that would split the gateway's state in two)."""
    ledger = Ledger.open(db_path)
    ledger.record(key(1), chat="c", sender="s", payload={"text": "x"})
    ledger.close()
    holder = sqlite3.connect(db_path, isolation_level=None)
    holder.execute("PRAGMA locking_mode = EXCLUSIVE")
    holder.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            open_db(db_path)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert not list(db_path.parent.glob("gateway.db.corrupt-*"))
    reopened = Ledger.open(db_path)
    assert reopened.get(key(1)) is not None
    reopened.close()


def test_a_symlinked_ledger_is_opened_where_the_link_points_and_a_link_to_nothing_refused(tmp_path: Path) -> None:
    """gateway.db may be a symlink to a ledger on another disk: several processes opening it at
    once all open that one file. A link to nothing (the disk not mounted) is refused, naming the
    link and its target, and nothing is created where it points."""
    channels = tmp_path / "channels"
    channels.mkdir()
    target = tmp_path / "elsewhere" / "ledger.db"
    target.parent.mkdir()
    link = channels / "gateway.db"
    link.symlink_to(target)
    with pytest.raises(LedgerFileRefused, match="does not exist") as info:
        open_db(link)
    assert str(target) in str(info.value) and not target.exists()
    open_db(target).close()  # the ledger, made where it will live (or moved there)
    code = "import sys; from gateway.db import open_db; open_db(__import__('pathlib').Path(sys.argv[1])).close()"
    for _ in range(3):
        procs = [subprocess.Popen([sys.executable, "-c", code, str(link)], cwd=REPO) for _ in range(6)]
        assert [p.wait(30) for p in procs] == [0] * 6
        assert link.is_symlink() and target.stat().st_size > 0
        assert not list(channels.glob("gateway.db*.corrupt-*")) and not list(target.parent.glob("*.corrupt-*"))


def test_temporaries_of_dead_creators_are_removed_and_live_ones_kept(db_path: Path) -> None:
    db_path.parent.mkdir(parents=True)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(30)
    stale = db_path.parent / f".gateway.db.new-{gone.pid}-0badf00d"
    live = db_path.parent / f".gateway.db.new-{os.getpid()}-0badf00d"
    for f in (stale, stale.with_name(stale.name + "-journal"), live):
        f.write_bytes(b"x")
    open_db(db_path).close()
    assert not stale.exists() and live.exists()


def test_damaged_pages_are_moved_aside(db_path: Path) -> None:
    ledger = Ledger.open(db_path)
    for n in range(300):
        ledger.record(key(n), chat="c", sender="s", payload={"text": "x" * 200})
    ledger.connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    ledger.close()
    data = bytearray(db_path.read_bytes())
    data[4096 * 2 : 4096 * 6] = b"\xff" * (4096 * 4)  # scribble over pages of the table
    db_path.write_bytes(bytes(data))
    with pytest.raises(CorruptGatewayDB) as info:
        open_db(db_path)
    assert info.value.moved_to.read_bytes() == bytes(data)


def test_newer_schema_is_refused_not_touched(db_path: Path) -> None:
    db_path.parent.mkdir(parents=True)
    conn = sqlite3.connect(db_path)
    conn.execute("PRAGMA user_version = 999")
    conn.close()
    with pytest.raises(SchemaTooNew):
        open_db(db_path)
    assert db_path.exists()
    conn = sqlite3.connect(db_path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 999
    conn.close()


def test_two_processes_opening_a_new_gateway_db_at_once_both_succeed(tmp_path: Path) -> None:
    """The CLI may open gateway.db while the gateway creates it: neither may see the other's half
    applied migration as corruption (it would move a healthy file aside)."""
    import subprocess
    import sys

    path = tmp_path / "channels" / "gateway.db"
    code = "import sys; from gateway.db import open_db; open_db(__import__('pathlib').Path(sys.argv[1])).close()"
    for _ in range(5):
        for f in tmp_path.glob("channels/gateway.db*"):
            f.unlink()
        procs = [subprocess.Popen([sys.executable, "-c", code, str(path)]) for _ in range(4)]
        assert [p.wait(30) for p in procs] == [0, 0, 0, 0]
        assert not list(tmp_path.glob("channels/gateway.db.corrupt-*"))
