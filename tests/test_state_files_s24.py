"""State files (session 24): gateway.db as a symbolic link to nothing (an unmounted disk) is an error
naming the link and its target, never "does not exist yet" nor a new, empty ledger made where the
link points; the files SQLite keeps beside appserver.db and gateway.db (`-wal`, `-shm`, `-journal`)
that are directories or links to nothing are refused before SQLite opens the database read-only in
silence, with one line naming the file (no traceback, nothing moved); a gateway.db SQLite can only
read is refused at open, naming it, instead of failing the gateway's first write with a traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.cli import ROOT, cli_env, run_cli
from tests.support.serve import serving
from tests.support.wait import eventually

SECRET_ENV = {"WEBHOOK_SECRET": "s3cret"}
ROUTE = "webhook:main:chat-1"


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """A home with one enabled webhook account (the gateway child runs under `serve`)."""
    h = tmp_path / "home"
    args = ["channels", "add", "webhook", "main", "--set", "listen=127.0.0.1:0"]
    r = run_cli(h, *args, "--secret", "secret=env:WEBHOOK_SECRET", "--enable", env=cli_env(h, **SECRET_ENV))
    assert r.code == 0, r.err
    return h


def _gateway_db(home: Path) -> Path:
    return home / "channels" / "gateway.db"


def _link_to_unmounted_disk(home: Path, tmp_path: Path) -> Path:
    """gateway.db as a link to a file on a disk that is not mounted; returns the link's target."""
    target = tmp_path / "mnt" / "disk" / "gateway.db"
    link = _gateway_db(home)
    link.parent.mkdir(parents=True, exist_ok=True)
    link.unlink(missing_ok=True)
    link.symlink_to(target)
    return target


def _assert_one_line_naming(err: str, *names: object) -> None:
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err
    for name in names:
        assert str(name) in lines[0], err


# ── gateway.db as a symbolic link to nothing ────────────────────────────────────────────────────


def test_channels_status_names_a_dangling_gateway_db_link(home: Path, tmp_path: Path) -> None:
    target = _link_to_unmounted_disk(home, tmp_path)
    r = run_cli(home, "channels", "status")
    assert r.code != 0, r.out
    assert "does not exist yet" not in r.out + r.err
    _assert_one_line_naming(r.err, _gateway_db(home), target, "does not exist")
    assert not (tmp_path / "mnt").exists()
    assert _gateway_db(home).is_symlink()


def test_route_list_refuses_a_dangling_gateway_db_link(home: Path, tmp_path: Path) -> None:
    """Every command reading gateway.db (here: the routes) says so, never "No routes"."""
    target = _link_to_unmounted_disk(home, tmp_path)
    r = run_cli(home, "channels", "route", "list")
    assert r.code != 0 and "No routes" not in r.out, r.out
    _assert_one_line_naming(r.err, _gateway_db(home), target)
    assert not (tmp_path / "mnt").exists()


def test_serve_gateway_refuses_a_dangling_gateway_db_link_and_creates_nothing(home: Path, tmp_path: Path) -> None:
    target = _link_to_unmounted_disk(home, tmp_path)
    with serving(home, env=cli_env(home, **SECRET_ENV), graceful=False) as sp:
        assert sp.proc.stderr is not None
        refused = eventually(lambda: sp.proc.stderr.seen("the gateway does not start"), 20)  # type: ignore[union-attr]
        log = sp.proc.stderr.so_far()  # type: ignore[union-attr]
        assert refused, log[-3000:]
        ready = httpx.get(sp.url + "/readyz", timeout=5).json()
    channels = next(c for c in ready["checks"] if c["name"] == "channels")
    assert channels["status"] == "fail", ready
    line = next(line for line in log.splitlines() if "the gateway does not start" in line)
    assert str(_gateway_db(home)) in line and str(target) in line, line
    assert "Traceback" not in log, log[-3000:]
    assert not (tmp_path / "mnt").exists(), "a directory of the link's target was created"
    assert _gateway_db(home).is_symlink() and not target.exists()


def test_a_link_to_an_existing_ledger_is_still_used(home: Path, tmp_path: Path) -> None:
    """The link itself is fine: a ledger on another disk is opened where it is (only never made there)."""
    elsewhere = tmp_path / "disk" / "ledger.db"
    elsewhere.parent.mkdir()
    link = _gateway_db(home)
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(elsewhere)
    refused = run_cli(home, "channels", "route", "add", ROUTE, "assistant")  # nothing there yet: no new ledger
    assert refused.code != 0 and "symbolic link" in refused.err and not elsewhere.exists(), refused.err
    link.unlink()
    r = run_cli(home, "channels", "route", "add", ROUTE, "assistant")
    assert r.code == 0, r.err
    link.rename(elsewhere)
    link.symlink_to(elsewhere)
    r = run_cli(home, "channels", "route", "list")
    assert r.code == 0 and ROUTE in r.out, r.out + r.err


# ── SQLite's side files: directories and links to nothing ───────────────────────────────────────


def _start_gateway_child(home: Path) -> subprocess.CompletedProcess[str]:
    """The child `serve` runs, given its start envelope; it opens gateway.db before it connects."""
    start = {"op": "start", "url": "ws://127.0.0.1:9/ws", "token": None, "home": str(home), "accounts": []}
    return subprocess.run(
        [sys.executable, "-m", "gateway"],  # from this tree (cwd), not an installed copy
        input=json.dumps(start) + "\n",
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=cli_env(home),
        timeout=60,
    )


@pytest.fixture
def ledger(home: Path) -> Iterator[Path]:
    """A real gateway.db (made by a command, as a first `route add` makes it), side files removed."""
    r = run_cli(home, "channels", "route", "add", ROUTE, "assistant")
    assert r.code == 0, r.err
    db = _gateway_db(home)
    yield db
    for suffix in ("-wal", "-shm", "-journal"):
        side = db.with_name(db.name + suffix)
        if side.is_dir() and not side.is_symlink():
            shutil.rmtree(side)


def _damage(side: Path, how: str, tmp_path: Path) -> None:
    side.unlink(missing_ok=True)
    if how == "directory":
        side.mkdir()
    else:
        side.symlink_to(tmp_path / "gone" / side.name)


SIDE_CASES = [("-shm", "directory"), ("-wal", "directory"), ("-journal", "directory"), ("-wal", "dangling link")]


@pytest.mark.parametrize(("suffix", "how"), SIDE_CASES)
def test_gateway_child_names_a_damaged_side_file_of_gateway_db(
    ledger: Path, tmp_path: Path, suffix: str, how: str
) -> None:
    side = ledger.with_name(ledger.name + suffix)
    _damage(side, how, tmp_path)
    done = _start_gateway_child(ledger.parent.parent)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("ERROR")]
    assert len(errors) == 1 and str(side) in errors[0], done.stderr[-3000:]
    assert ("directory" if how == "directory" else "symbolic link") in errors[0]
    assert side.is_symlink() or side.is_dir()  # left in place
    assert not (tmp_path / "gone").exists()


@pytest.mark.parametrize(("suffix", "how"), SIDE_CASES)
def test_channels_status_names_a_damaged_side_file_of_gateway_db(
    ledger: Path, tmp_path: Path, suffix: str, how: str
) -> None:
    side = ledger.with_name(ledger.name + suffix)
    _damage(side, how, tmp_path)
    r = run_cli(ledger.parent.parent, "channels", "status")
    assert r.code != 0, r.out
    _assert_one_line_naming(r.err, side)
    assert not (tmp_path / "gone").exists()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Path]:
    """A home whose appserver.db exists (made by a first command), side files removed after."""
    h = tmp_path / "storehome"
    r = run_cli(h, "agents", "list")
    assert r.code == 0, r.err
    db = h / "appserver.db"
    assert db.is_file()
    yield db
    for suffix in ("-wal", "-shm", "-journal"):
        side = db.with_name(db.name + suffix)
        if side.is_dir() and not side.is_symlink():
            shutil.rmtree(side)


@pytest.mark.parametrize(("suffix", "how"), [*SIDE_CASES, ("-shm", "dangling link")])
def test_cli_names_a_damaged_side_file_of_appserver_db(store: Path, tmp_path: Path, suffix: str, how: str) -> None:
    side = store.with_name(store.name + suffix)
    _damage(side, how, tmp_path)
    r = run_cli(store.parent, "agents", "list")
    assert r.code == 2, r.out
    _assert_one_line_naming(r.err, side)
    assert "readonly" not in r.err
    assert side.is_symlink() or side.is_dir()
    assert not (tmp_path / "gone").exists()


def test_serve_names_a_directory_in_place_of_appserver_db_shm(store: Path) -> None:
    side = store.with_name(store.name + "-shm")
    side.unlink(missing_ok=True)
    side.mkdir()
    r = run_cli(store.parent, "serve", "--listen", "127.0.0.1:0")
    assert r.code == 2, r.err[-3000:]
    _assert_one_line_naming(r.err, side)


# ── a gateway.db SQLite can only read ───────────────────────────────────────────────────────────


def _immutable(path: Path, on: bool) -> bool:
    """chattr ±i (refused to root too); False where the file system or the process cannot."""
    chattr = shutil.which("chattr")
    if chattr is None:
        return False
    done = subprocess.run([chattr, "+i" if on else "-i", str(path)], capture_output=True, timeout=10)
    return done.returncode == 0


def test_a_ledger_sqlite_can_only_read_is_refused_at_open_naming_it(ledger: Path) -> None:
    """An -shm SQLite cannot write (immutable here; a foreign owner, a read-only mount elsewhere):
    SQLite opened the ledger read-only without a word and the gateway died at its first write with
    a traceback ("attempt to write a readonly database"), restarting into it again and again."""
    shm = ledger.with_name(ledger.name + "-shm")
    shm.write_bytes(b"")
    if not _immutable(shm, True):
        pytest.skip("chattr +i is not available here")
    try:
        done = _start_gateway_child(ledger.parent.parent)
    finally:
        _immutable(shm, False)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("ERROR")]
    assert len(errors) == 1 and str(ledger) in errors[0] and "readonly" in errors[0], done.stderr[-3000:]


def test_the_servers_pairing_list_over_a_link_to_nothing_is_an_error_not_empty(tmp_path: Path) -> None:
    """The `pairing_list` frame reads gateway.db directly: over a dangling link (its disk not
    mounted) it says so, naming the target, instead of answering "no codes wait"."""
    from appserver.channels import LedgerUnavailable, pairing_pending

    home = tmp_path / "home"
    (home / "channels").mkdir(parents=True)
    target = tmp_path / "unmounted" / "gateway.db"
    (home / "channels" / "gateway.db").symlink_to(target)
    with pytest.raises(LedgerUnavailable, match="does not exist") as info:
        pairing_pending(home)
    assert str(target) in str(info.value) and not target.parent.exists()
