"""`appserver serve --channels` with a channel name that does not exist (fix 17, item 6).

Was: the server started and logged only "channel nope is enabled but has no account". A typo in a
flag is refused before anything starts, as other bad `serve` flags are: exit 2, one line naming the
unknown channel and the known ones. A user plugin folder of the home is a known channel."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.cli import run_cli

pytestmark = pytest.mark.timeout(60)


def test_an_unknown_channel_is_refused_before_serve_starts(tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / "channels" / "mychan").mkdir(parents=True)  # a user plugin folder (its manifest is checked later)
    r = run_cli(home, "serve", "--listen", "127.0.0.1:0", "--channels", "webhook,nope", timeout=30)
    assert r.code == 2, (r.code, r.out, r.err[-2000:])
    lines = [line for line in r.err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: --channels: unknown channel 'nope'"), r.err
    for known in ("discord", "slack", "telegram", "webhook", "mychan"):
        assert known in lines[0], lines[0]
    assert not (home / "server.json").exists()  # nothing started
