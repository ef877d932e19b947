"""Token lifetimes are bounded: `--expires 99999999999999w` stored a token whose expiry no clock can
print, and `token list` / `token revoke` then crashed on it forever (OverflowError); 400 nines
crashed `create` itself. A lifetime beyond MAX_TOKEN_LIFETIME_S is refused before anything is
stored, and an out-of-range expiry already stored (an older version, a hand edit) is shown, not a
crash, so the token can still be listed and revoked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from appserver.auth import TokenStore
from appserver.auth.tokens import MAX_TOKEN_LIFETIME_S
from tests.support.cli import run_cli


@pytest.mark.parametrize("expires", ["99999999999999w", f"{'9' * 400}s", "36501d", "5215w"])
def test_a_lifetime_beyond_the_maximum_is_refused_and_nothing_is_stored(tmp_path: Path, expires: str) -> None:
    home = tmp_path / "home"
    r = run_cli(home, "token", "create", "--name", "big", "--expires", expires)
    assert r.code == 2 and r.out == "", (r.code, r.out)
    assert r.err.count("\n") == 1 and "at most 36500d" in r.err and "Traceback" not in r.err, r.err
    assert not (home / "auth" / "tokens.json").exists()


def test_the_maximum_lifetime_itself_is_accepted(tmp_path: Path) -> None:
    store = TokenStore(tmp_path)
    rec, _ = store.create(name="long", expires="36500d")
    assert rec.expires_at is not None and abs(rec.expires_at - rec.created_at - MAX_TOKEN_LIFETIME_S) < 0.01
    for bad in (MAX_TOKEN_LIFETIME_S + 1, float("inf"), float("nan"), 0.0, -1.0):
        with pytest.raises(ValueError, match="expiry must be in the future and at most"):
            store.create(name="other", expires=bad)
    assert [r.name for r in store.list()] == ["long"]


@pytest.mark.parametrize(
    ("stored", "shown"),
    [(6.048e19, "out of range (far future)"), (-1e300, "out of range (far past)"), (1e308, "out of range")],
)
def test_an_out_of_range_expiry_already_stored_is_listed_and_revoked(tmp_path: Path, stored: float, shown: str) -> None:
    home = tmp_path / "home"
    assert run_cli(home, "token", "create", "--name", "big", "--expires", "1d").code == 0
    assert run_cli(home, "token", "create", "--name", "other", "--expires", "1d").code == 0
    path = home / "auth" / "tokens.json"
    data = json.loads(path.read_text())
    data["tokens"][0]["expires_at"] = stored  # what an older version stored for 99999999999999w
    path.write_text(json.dumps(data))
    listed = run_cli(home, "token", "list")
    assert listed.code == 0, listed.err
    row = next(line for line in listed.out.splitlines() if " big " in line)
    assert shown in row and ("(expired)" in row) == (stored < 0), row
    as_json = run_cli(home, "token", "list", "--json")
    assert as_json.code == 0 and [t["name"] for t in as_json.json()] == ["big", "other"], as_json.err
    revoked = run_cli(home, "token", "revoke", "big")
    assert revoked.code == 0 and shown in revoked.out, (revoked.out, revoked.err)
    assert [t["name"] for t in json.loads(path.read_text())["tokens"]] == ["other"]


def test_a_stored_expiry_that_is_no_number_counts_as_expired(tmp_path: Path) -> None:
    """`now >= NaN` is False: read naively, a NaN expiry (JSON NaN, a hand edit) never expires."""
    store = TokenStore(tmp_path)
    rec, token = store.create(name="t", expires="1d")
    assert store.verify(token) is not None
    data = json.loads(store.path.read_text())
    data["tokens"][0]["expires_at"] = float("nan")
    store.path.write_text(json.dumps(data))
    assert store.verify(token) is None
    assert store.list()[0].public()["expired"] is True
    listed = run_cli(tmp_path, "token", "list")
    assert listed.code == 0 and "invalid (expired)" in listed.out, (listed.out, listed.err)
