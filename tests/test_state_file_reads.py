"""How state files are read (fix 18): never a FIFO, a device or a file of any size; never a link to
nothing taken for a missing file; never a newer token format rewritten as the old one.

Was: every state file was read whole with no limit (a link to /dev/zero grew memory without bound)
and a FIFO blocked its reader forever (`serve` hung with no output, `cron list` hung, a server
did not stop on SIGTERM); auth/tokens.json holding `null` or a link to nothing was "no tokens"
(every token refused without a word, /readyz ready); crons.json as a link to nothing was "no cron
tasks", and `cron add` replaced the link with a file holding only the new task; tokens.json of a
newer version was rewritten as version 1 without its unknown fields; a home that is a file said
"File exists". Now one reader (appserver/fsutil.py `read_state_bytes`) refuses all of that with
one line naming the file."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx
import pytest

from appserver.auth import TokenStore
from tests.support.cli import CLIResult, cli_env, run_cli
from tests.support.serve import start_serve
from tests.support.state import token_home, wait_ready

pytestmark = pytest.mark.timeout(120)


def one_error(r: CLIResult) -> str:
    """The single `error:` line of a refused command (any non-zero code), never a traceback."""
    assert r.code != 0, (r.code, r.out, r.err)
    assert "Traceback" not in r.err, r.err
    lines = [line for line in r.err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, r.err
    return lines[0]


def add_task(home: Path, name: str = "brief") -> str:
    r = run_cli(home, "cron", "add", "--name", name, "--agent", "assistant", "--every", "1h", "--prompt", "p", "--json")
    assert r.code == 0, r.err
    return str(r.json()["id"])


def test_a_fifo_config_is_one_error_line_not_a_hang(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    os.mkfifo(home / "config.toml")
    started = time.monotonic()
    r = run_cli(home, "cron", "list", timeout=20)
    line = one_error(r)
    assert "config.toml" in line and "FIFO" in line and "not a regular file" in line, line
    assert time.monotonic() - started < 15
    assert (home / "config.toml").is_fifo()  # left in place, never moved aside


def test_a_fifo_server_json_makes_serve_refuse_in_one_line(tmp_path: Path) -> None:
    home = tmp_path / "home"
    run_cli(home, "agents", "list")  # a home with its store
    os.mkfifo(home / "server.json")
    r = run_cli(home, "serve", "--listen", "127.0.0.1:0", timeout=20)
    line = one_error(r)
    assert "server.json" in line and "FIFO" in line, line


def test_tokens_json_holding_null_is_set_aside_loudly_by_the_server(tmp_path: Path) -> None:
    home = tmp_path / "home"
    token_home(home)
    _, secret = TokenStore(home).create(name="old")
    path = home / "auth" / "tokens.json"
    path.write_text("null\n")
    sp = start_serve(home)
    try:
        r = httpx.get(sp.url + "/v1/models", headers={"Authorization": f"Bearer {secret}"}, timeout=10)
        assert r.status_code == 401
        assert not path.exists()
        aside = list(path.parent.glob("tokens.json.corrupt-*"))
        assert len(aside) == 1 and aside[0].read_text() == "null\n"
        body = wait_ready(sp.url, 200)
        state = next(c for c in body["checks"] if c["name"] == "state_files")
        assert state["status"] == "warn" and "tokens.json" in state["detail"], body
    finally:
        sp.stop()
        sp.kill()
    assert sp.proc.stderr is not None
    assert "got null" in sp.proc.stderr.read(), "the move aside was not logged"


def test_a_dangling_tokens_json_refuses_serve_and_token_commands(tmp_path: Path) -> None:
    home = tmp_path / "home"
    token_home(home)
    TokenStore(home).create(name="old")
    path = home / "auth" / "tokens.json"
    target = tmp_path / "unmounted" / "tokens.json"
    path.unlink()
    path.symlink_to(target)
    for args in (("serve", "--listen", "127.0.0.1:0"), ("token", "list"), ("token", "create", "--name", "x")):
        line = one_error(run_cli(home, *args, timeout=30))
        assert str(path) in line and str(target) in line and "does not exist" in line, (args, line)
        assert path.is_symlink() and os.readlink(path) == str(target), args  # never replaced


def test_a_tokens_json_link_to_a_device_is_refused_not_moved_aside(tmp_path: Path) -> None:
    home = tmp_path / "home"
    token_home(home)
    path = home / "auth" / "tokens.json"
    path.parent.mkdir(parents=True)
    path.symlink_to("/dev/null")
    line = one_error(run_cli(home, "serve", "--listen", "127.0.0.1:0", timeout=30))
    assert "character device" in line and "tokens.json" in line, line
    assert path.is_symlink() and not list(path.parent.glob("tokens.json.corrupt-*"))


def test_an_oversized_tokens_json_is_refused_by_its_size(tmp_path: Path) -> None:
    home = tmp_path / "home"
    TokenStore(home).create(name="old")
    path = home / "auth" / "tokens.json"
    with path.open("a") as f:  # still valid JSON: trailing blanks, 17 MiB of them
        f.write(" " * (17 * 1024 * 1024))
    line = one_error(run_cli(home, "token", "list"))
    assert "more than the 16 MiB limit" in line, line


def test_a_newer_tokens_json_is_refused_and_left_as_it_is(tmp_path: Path) -> None:
    home = tmp_path / "home"
    token_home(home)
    TokenStore(home).create(name="old")
    path = home / "auth" / "tokens.json"
    data = json.loads(path.read_text())
    data["version"] = 2
    data["tokens"][0]["namespace"] = "team-a"
    path.write_text(json.dumps(data))
    before = path.read_text()
    for args in (("token", "create", "--name", "t2"), ("token", "create", "--name", "t3", "--start-new-file")):
        line = one_error(run_cli(home, *args))
        assert "format version 2" in line and "upgrade appserver" in line, line
    assert path.read_text() == before and not list(path.parent.glob("tokens.json.corrupt-*"))
    line = one_error(run_cli(home, "serve", "--listen", "127.0.0.1:0", timeout=30))
    assert "upgrade appserver" in line, line


def test_a_dangling_crons_json_is_an_error_and_cron_add_keeps_the_link(tmp_path: Path) -> None:
    home = tmp_path / "home"
    add_task(home)
    disk = tmp_path / "disk"
    disk.mkdir()
    (home / "crons.json").rename(disk / "crons.json")
    (home / "crons.json").symlink_to(disk / "crons.json")
    gone = tmp_path / "disk.unmounted"
    disk.rename(gone)  # "unmounted"
    line = one_error(run_cli(home, "cron", "list"))
    assert str(disk / "crons.json") in line and "does not exist" in line, line
    line = one_error(
        run_cli(home, "cron", "add", "--name", "new1", "--agent", "assistant", "--every", "1h", "--prompt", "x")
    )
    assert "does not exist" in line, line
    assert (home / "crons.json").is_symlink() and not (home / "crons.json").exists()
    gone.rename(disk)  # mounted again: the old task is there, and a write goes through the link
    add_task(home, "new2")
    assert (home / "crons.json").is_symlink()
    names = [t["name"] for t in json.loads((disk / "crons.json").read_text())["tasks"]]
    assert names == ["brief", "new2"], names


def test_a_fifo_crons_json_neither_hangs_cron_list_nor_stops_serve_from_stopping(tmp_path: Path) -> None:
    home = tmp_path / "home"
    run_cli(home, "agents", "list")
    os.mkfifo(home / "crons.json")
    line = one_error(run_cli(home, "cron", "list", timeout=20))
    assert "crons.json" in line and "FIFO" in line, line
    sp = start_serve(home, env=cli_env(home, APPSERVER_CRON_TICK_S="0.2"))
    try:
        time.sleep(1)  # a few ticks that meet the FIFO
        assert sp.stop(timeout=10) == 0
    finally:
        sp.kill()
    assert (home / "crons.json").is_fifo()


def test_a_fifo_run_log_is_one_error_line_for_cron_logs_and_serve_still_stops(tmp_path: Path) -> None:
    home = tmp_path / "home"
    task_id = add_task(home)
    log = home / "cron-runs" / f"{task_id}.jsonl"
    log.parent.mkdir(exist_ok=True)
    log.unlink(missing_ok=True)
    os.mkfifo(log)
    line = one_error(run_cli(home, "cron", "logs", "brief", timeout=20))
    assert "FIFO" in line and f"{task_id}.jsonl" in line, line
    sp = start_serve(home)
    try:
        time.sleep(1)
        assert sp.stop(timeout=10) == 0
    finally:
        sp.kill()


def test_a_run_log_too_large_to_read_whole_shows_its_newest_records(tmp_path: Path) -> None:
    home = tmp_path / "home"
    task_id = add_task(home)
    log = home / "cron-runs" / f"{task_id}.jsonl"
    log.parent.mkdir(exist_ok=True)
    old = json.dumps({"event": "error", "at": "2020-01-01T00:00:00+00:00", "task_id": task_id, "error": "x" * 900})
    new = {"event": "error", "at": "2026-01-01T00:00:00+00:00", "task_id": task_id, "error": "the newest"}
    with log.open("w") as f:
        for _ in range(20 * 1024):  # ~19 MiB
            f.write(old + "\n")
        f.write(json.dumps(new) + "\n")
    r = run_cli(home, "cron", "logs", "brief", "--limit", "1", "--json")
    assert r.code == 0, r.err
    assert r.json()[-1]["error"] == "the newest"
    assert "is large; its first" in r.err, r.err


def test_a_home_that_is_a_file_says_so(tmp_path: Path) -> None:
    home = tmp_path / "afile"
    home.write_text("x\n")
    line = one_error(run_cli(home, "cron", "list"))
    assert "is not a directory" in line and "File exists" not in line, line


def test_a_tokens_json_turned_fifo_under_a_running_server_refuses_tokens_and_says_so_once(tmp_path: Path) -> None:
    home = tmp_path / "home"
    token_home(home)
    _, secret = TokenStore(home).create(name="old")
    path = home / "auth" / "tokens.json"
    sp = start_serve(home)
    try:
        auth = {"Authorization": f"Bearer {secret}"}
        assert httpx.get(sp.url + "/v1/models", headers=auth, timeout=10).status_code == 200
        path.unlink()
        os.mkfifo(path)
        for _ in range(3):  # answered at once, never blocked on the FIFO
            assert httpx.get(sp.url + "/v1/models", headers=auth, timeout=10).status_code == 401
        assert path.is_fifo()  # left in place
        assert sp.stop(timeout=10) == 0
    finally:
        sp.kill()
    assert sp.proc.stderr is not None
    refusals = [line for line in sp.proc.stderr.read().splitlines() if "every token is refused" in line]
    assert len(refusals) == 1 and "FIFO" in refusals[0], refusals


def test_the_reader_refuses_devices_and_reads_no_more_than_its_limit(tmp_path: Path) -> None:
    from appserver.fsutil import StateFileRefused, StateFileTooLarge, read_state_bytes

    link = tmp_path / "state.json"
    link.symlink_to("/dev/zero")
    with pytest.raises(StateFileRefused, match="character device"):
        read_state_bytes(link, 1024)
    sparse = tmp_path / "sparse.json"
    with sparse.open("wb") as f:
        f.truncate(2 * 1024**3)  # 2 GiB, no blocks: read whole it was a MemoryError
    with pytest.raises(StateFileTooLarge) as caught:
        read_state_bytes(sparse, 1024)
    assert caught.value.size == 2 * 1024**3 and str(sparse) in str(caught.value)
    small = tmp_path / "small.json"
    small.write_bytes(b"{}")
    assert read_state_bytes(small, 2) == b"{}"
