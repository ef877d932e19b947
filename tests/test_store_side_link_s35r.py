"""appserver.db's `-wal` (or `-shm`) that is a symbolic link to a regular file is refused before SQLite
opens the store, naming it: SQLite opens its side files with O_NOFOLLOW and said only "unable to
open database file" (found beside the same case of gateway.db, s35 o F4)."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest

from appserver.fsutil import StateFileRefused, check_sqlite_side_files


@pytest.mark.parametrize("suffix", ["-wal", "-shm"])
def test_a_side_file_that_is_a_link_to_a_regular_file_is_refused_by_name(tmp_path: Path, suffix: str) -> None:
    db = tmp_path / "appserver.db"
    conn = sqlite3.connect(db)
    conn.execute("CREATE TABLE t(x)")
    conn.close()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(b"")
    os.symlink(elsewhere, tmp_path / f"appserver.db{suffix}")
    with pytest.raises(StateFileRefused) as refused:
        check_sqlite_side_files(db)
    text = str(refused.value)
    assert f"appserver.db{suffix}" in text and "symbolic link" in text and str(elsewhere) in text, text
    assert (tmp_path / f"appserver.db{suffix}").is_symlink()  # left in place
