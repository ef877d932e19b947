"""appserver/fsutil.py: an atomic write that fails names the file being written and leaves no temporary."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from appserver.fsutil import atomic_write_text


def test_a_refused_atomic_write_names_its_file_not_the_temporary(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    target.mkdir()
    (target / "inside").write_text("x")  # a non-empty directory: the final rename fails
    with pytest.raises(OSError) as caught:
        atomic_write_text(target, "{}\n")
    assert caught.value.filename == str(target), caught.value
    assert caught.value.errno in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST), caught.value  # kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]  # the temporary is gone


def test_an_atomic_write_replaces_the_whole_file(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    target.write_text("old and longer\n")
    atomic_write_text(target, "new\n")
    assert target.read_text() == "new\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]
