"""A home and the server it names (found by an outside test), and error lines that echo an argument:

- a home copied while its server runs (`cp -a home home-copy`) carries the original's server.json,
  which names a live process whose URL answers: commands on the copy went to the ORIGINAL server
  (`run` wrote the original's store, an agent made in the copy was `unknown agent`), and `serve` on
  the copy was refused as "a server already runs on this home";
- an error line echoed a refused argument whole: 100,000 characters in, 100 KB on stderr; and
  `pairing revoke ""` said "error:  is neither…"."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
from pathlib import Path

import pytest

from appserver.procid import identity
from appserver.serverinfo import read_live_server
from tests.support.cli import ROOT, cli_env, run_cli
from tests.support.serve import serving
from tests.support.wait import wait_for
from tests.support.zygote_client import appserver_popen

pytestmark = pytest.mark.timeout(30)


def _conversations(home: Path) -> int:
    with sqlite3.connect(home / "appserver.db") as db:
        return int(db.execute("SELECT count(*) FROM conversations").fetchone()[0])


def _served_by(home: Path, pid: int) -> bool:
    try:
        return json.loads((home / "server.json").read_text()).get("pid") == pid
    except (OSError, ValueError):
        return False


def _copy_home(home: Path, copy: Path) -> None:
    """`cp -a home copy` while its server runs: a file it replaces meanwhile (an atomic write's
    temporary file) may be gone when it is reached, as cp says "vanished"."""

    def copy_file(src: str, dst: str) -> None:
        try:
            shutil.copy2(src, dst)
        except FileNotFoundError:
            pass

    shutil.copytree(home, copy, symlinks=True, copy_function=copy_file)


def _home(tmp_path: Path) -> Path:
    home = tmp_path / "home"
    made = run_cli(home, "agents", "list")
    assert made.code == 0, made.err
    return home


def test_commands_on_a_copied_home_act_on_the_copy(tmp_path: Path) -> None:
    """An agent made in the copy runs there, and the turn is in the copy's store, not the original's."""
    home = _home(tmp_path)
    copy = tmp_path / "home-copy"
    with serving(home):
        _copy_home(home, copy)
        assert json.loads((copy / "server.json").read_text())["home"] == str(home.resolve())  # the original's
        made = run_cli(copy, "agents", "create", "--name", "onlyincopy")
        assert made.code == 0, made.err
        ran = run_cli(copy, "run", "--agent", "onlyincopy", "--conversation", "new", "hi", timeout=30)
        assert ran.code == 0, ran.err
        assert "unknown agent" not in ran.err
        assert _conversations(copy) >= 1
        assert _conversations(home) == 0  # nothing of the copy's reached the original's server
        through = run_cli(home, "run", "--conversation", "new", "on the original")
        assert through.code == 0, through.err  # the original still finds its server
        assert _conversations(home) == 1


def test_serve_starts_on_a_copied_home_and_its_commands_go_there(tmp_path: Path) -> None:
    """`serve` on the copy (its copied server.json left in place) starts and rewrites server.json;
    a `run` on the copy then goes through the copy's server into the copy's store."""
    home = _home(tmp_path)
    copy = tmp_path / "home-copy"
    with serving(home) as original:
        _copy_home(home, copy)
        proc = appserver_popen(
            ["serve", "--listen", "127.0.0.1:0"],
            env=cli_env(copy),
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            wait_for(lambda: _served_by(copy, proc.pid) or proc.poll() is not None, 20, "serve on the copy")
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            url = json.loads((copy / "server.json").read_text())["url"]
            assert url != original.url
            ran = run_cli(copy, "run", "--conversation", "new", "via the copy's server", timeout=30)
            assert ran.code == 0, ran.err
            assert _conversations(copy) == 1 and _conversations(home) == 0
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        assert _served_by(home, original.proc.pid)  # the original's server.json was never touched


def test_a_home_through_a_symlink_is_the_same_home(tmp_path: Path) -> None:
    """The home reached through a symlink finds its server: `run` goes through it, `serve` is refused."""
    home = _home(tmp_path)
    link = tmp_path / "link"
    link.symlink_to(home, target_is_directory=True)
    with serving(home):
        ran = run_cli(link, "run", "--conversation", "new", "through the link", timeout=30)
        assert ran.code == 0, ran.err
        assert _conversations(home) == 1
        refused = run_cli(link, "serve", "--listen", "127.0.0.1:0", timeout=30)
        assert refused.code == 3 and "a server already runs on this home" in refused.err, refused.err


def test_a_server_json_without_home_id_is_judged_by_the_home_it_names(tmp_path: Path) -> None:
    """server.json of an older appserver (no `home_id`): this process, answering on loopback, is the
    server. Naming another home, it is stale here; naming this one (or no home), it is live."""
    home, other = tmp_path / "home", tmp_path / "other"
    home.mkdir()
    other.mkdir()
    with socket.create_server(("127.0.0.1", 0)) as answering:
        old = {
            "url": f"http://127.0.0.1:{answering.getsockname()[1]}",
            "pid": os.getpid(),
            "identity": identity(),
            "auth": "none",
        }
        server_json = home / "server.json"
        server_json.write_text(json.dumps({**old, "home": str(other)}))
        assert read_live_server(server_json) is None
        server_json.write_text(json.dumps({**old, "home": str(home)}))
        assert read_live_server(server_json) is not None
        server_json.write_text(json.dumps(old))
        assert read_live_server(server_json) is not None
        server_json.write_text(json.dumps({**old, "home": str(home), "home_id": {"dev": 0, "ino": 0}}))
        assert read_live_server(server_json) is None  # the directory's identity decides


HUGE = "x" * 100_000


@pytest.mark.parametrize(
    "args",
    [
        ("agents", "create", "--name", HUGE),
        ("agents", "create", f"--name={HUGE}"),
        ("agents", "show", HUGE),
        ("pairing", "deny", HUGE),
        ("conversations", "history", HUGE),
        ("cron", "show", HUGE),
    ],
)
def test_an_error_line_shortens_a_long_argument(tmp_path: Path, args: tuple[str, ...]) -> None:
    home = _home(tmp_path)
    refused = run_cli(home, *args)
    assert refused.code != 0
    size, line = len(refused.err), refused.err.strip()[:300]
    assert size < 400, line
    assert line.startswith("error: ") and "\n" not in line, line
    assert "…' (100000 characters)" in line, line


def test_an_empty_sender_is_shown_quoted(tmp_path: Path) -> None:
    home = _home(tmp_path)
    refused = run_cli(home, "pairing", "revoke", "")
    assert refused.code == 1
    assert refused.err == "error: '' is neither an approved nor a denied sender\n", refused.err
    short = run_cli(home, "agents", "show", "nobody")
    assert short.code == 2 and short.err == "error: unknown agent 'nobody'\n", short.err  # a short one as it was
