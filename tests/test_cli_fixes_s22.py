"""`appserver run --idempotency-key` with no server running (found by an outside test): the help
says "up to 256 characters", and through a server a longer key is refused, but in-process any
length was accepted and stored (a 100,000-character key went into the store). Now both paths
refuse it the same way, before anything runs."""

from __future__ import annotations

from pathlib import Path

from tests.support.cli import run_cli


def test_run_refuses_an_idempotency_key_the_protocol_would(tmp_path: Path) -> None:
    home = tmp_path / "home"
    for key, why in (("k" * 257, "1 to 256 characters"), ("", "1 to 256 characters"), ("a\tb", "control")):
        done = run_cli(home, "run", "--idempotency-key", key, "hi")
        assert done.code == 2 and why in done.err, (key[:10], done.err)
    assert not (home / "appserver.db").exists() or "k" * 257 not in (home / "appserver.db").read_bytes().decode(
        "latin-1"
    )
    first = run_cli(home, "run", "--idempotency-key", "k" * 256, "hi")
    assert first.code == 0 and "echo: hi" in first.out, first.err
    again = run_cli(home, "run", "--idempotency-key", "k" * 256, "hi")
    assert again.code == 0 and "echo: hi" in again.out, again.err
