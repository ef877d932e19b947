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

from tests.support.cli import run_cli
from tests.support.serve import start_serve
from tests.support.state import chat, conversations, one_error_line, serve_refused

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
