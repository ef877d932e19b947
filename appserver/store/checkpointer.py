"""The WAL checkpointer: a thread of its own that copies the WAL back into the database, off the
event loop, and records the store position (integrity.py) once it is durable.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from pathlib import Path

from appserver.store.integrity import messages_seq, read_position, write_position

log = logging.getLogger("appserver.store")

CHECKPOINT_EVERY_COMMITS = 256  # wake the checkpointer after this many commits
# and at least this often while commits keep coming: the position record (integrity.py) is at most
# this far behind, which bounds what a WAL deleted with its index after a crash loses undetected
CHECKPOINT_IDLE_S = 1.0
WAL_BACKSTOP_PAGES = 10_000  # the writer's own automatic checkpoint (SQLite's default is 1,000)


class Checkpointer(threading.Thread):
    """Copies the WAL back into the database on its own connection and thread.

    SQLite's automatic checkpoint runs inside whichever COMMIT crosses its threshold, on the event
    loop: page copies and fsyncs that made about every 30th HTTP request several milliseconds
    slower (the p99). PASSIVE checkpoints here never block the writer. The WAL only restarts from
    its beginning when a checkpoint caught up with the writer, which a concurrent one rarely does:
    the writer's own automatic checkpoint, moved out to WAL_BACKSTOP_PAGES, does that, with little
    left to copy.
    """

    def __init__(self, path: Path) -> None:
        super().__init__(name="sqlite-checkpoint", daemon=True)
        self.path = path
        self.wake = threading.Event()
        self.stopping = False
        self.commits = 0  # bumped by the writer; a stale read here only delays a checkpoint
        self.recorded = read_position(path)  # the position sidecar's value (integrity.py)

    def committed(self) -> None:
        self.commits += 1
        if self.commits % CHECKPOINT_EVERY_COMMITS == 0:
            self.wake.set()

    def run(self) -> None:
        db = sqlite3.connect(str(self.path), isolation_level=None, timeout=10.0)
        try:
            done = 0
            while not self.stopping:
                self.wake.wait(CHECKPOINT_IDLE_S)
                self.wake.clear()
                if self.stopping or self.commits == done:
                    continue
                done = self.commits
                try:
                    seq = messages_seq(db)  # read first: the checkpoint then makes it durable
                    db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()  # all: ends the statement
                except sqlite3.Error:
                    log.exception("WAL checkpoint failed (the next one retries)")
                    continue
                self.record(seq)
        finally:
            db.close()

    def record(self, seq: int) -> None:
        """Write the position sidecar when it moved (off the hot path: this thread, or close)."""
        if seq == self.recorded:
            return
        try:
            write_position(self.path, seq)
            self.recorded = seq
        except OSError as exc:
            log.warning("could not record the store position in %s: %s", self.path, exc)

    def stop(self) -> None:
        self.stopping = True
        self.wake.set()
        self.join(10)
