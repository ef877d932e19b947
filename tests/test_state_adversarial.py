"""Adversarial state-file cases found after issue 11 landed (config, store, crash safety): each
through a real `appserver serve` subprocess on a fresh home."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest

from appserver.agent.tools import SHELL, ToolContext
from appserver.config import Config
from appserver.store.integrity import wal_index_claim
from appserver.store.records import AgentRecord
from tests.support.cli import ROOT, CLIResult, cli_env, run_cli
from tests.support.serve import start_serve
from tests.support.state import chat, check, one_error_line, serve_refused, token_home, wait_ready


def test_dangling_config_symlink_is_refused_not_replaced_by_defaults(home: Path, tmp_path: Path) -> None:
    # config.toml links to a file on a volume that is not mounted yet: before the fix the start
    # replaced the link with a default config and served with auth off.
    real = tmp_path / "etc" / "config.toml"
    real.parent.mkdir()
    token_home(home)
    (home / "config.toml").unlink()
    os.symlink(real, home / "config.toml")
    line = one_error_line(serve_refused(home))
    assert "symbolic link" in line and str(real) in line
    assert (home / "config.toml").is_symlink() and not real.exists()
    assert one_error_line(run_cli(home, "agents", "list")) == line  # every command, not only serve


@pytest.mark.parametrize("damage", ["delete", "truncate"])
def test_wal_deleted_or_truncated_after_kill9_is_refused_not_silently_lost(home: Path, damage: str) -> None:
    # Before the fix, the commits made since the last checkpoint (up to 5 s of them) vanished
    # without a word: the position sidecar had not recorded them yet.
    sp = start_serve(home)
    try:
        for i in range(10):
            chat(sp, f"conversation {i}")
    finally:
        sp.stop(signal.SIGKILL)
    db = home / "appserver.db"
    assert wal_index_claim(db) is not None, "the commits should still be in the WAL right after kill -9"
    wal = home / "appserver.db-wal"
    if damage == "delete":
        wal.unlink()
    else:
        os.truncate(wal, wal.stat().st_size // 2)
    line = one_error_line(serve_refused(home))
    assert "write-ahead log" in line and ("missing" if damage == "delete" else "shorter") in line
    assert "--accept-data-loss" in line and "Nothing was changed" in line
    assert len(list(home.glob("appserver.db.damaged-*"))) == 1
    if damage == "truncate":
        return
    sp = start_serve(home, "--accept-data-loss")  # the operator's deliberate choice
    sp.stop()
    assert "accepted data loss" in sp.proc.stderr.read()
    sp = start_serve(home)  # accepted once: later starts are normal (what the WAL held is gone)
    try:
        assert httpx.get(sp.url + "/readyz", timeout=5).status_code == 200
    finally:
        assert sp.stop() == 0


@pytest.mark.parametrize("bad", [float("nan"), -5, "abc", True, float("inf")])
def test_shell_refuses_a_bad_timeout_before_running_anything(tmp_path: Path, bad: object) -> None:
    # A NaN or negative `timeout_s` from the model started the command and killed it at once
    # ("timed out after nan s"): a side effect may have begun. Now nothing runs.
    cfg = Config(home=tmp_path)
    agent = AgentRecord(id="a", name="a", model="echo", system="", tools={}, params={}, created_at=0, updated_at=0)
    ctx = ToolContext(agent, "c", "t", cfg)
    out = asyncio.run(SHELL.run({"command": "touch ran", "timeout_s": bad}, ctx))
    assert out.is_error and "timeout_s" in out.text
    assert not (cfg.workspace("a") / "ran").exists()
    ok = asyncio.run(SHELL.run({"command": "echo hi; exit 3", "timeout_s": 5}, ctx))
    assert ok.is_error and ok.text == "exit code 3\nhi\n"


def _without_root_file_rights(argv: list[str]) -> list[str]:
    """argv run without root's right to ignore file modes (root may write any file). Dropping the
    capabilities keeps the user, so the checkout and the venv stay readable wherever they are."""
    drop = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner", "--inh-caps", "-all"]
    return [*drop, *argv] if os.geteuid() == 0 else argv


@pytest.mark.skipif(os.geteuid() == 0 and not shutil.which("setpriv"), reason="root without setpriv")
def test_read_only_database_is_one_line_naming_it(tmp_path: Path) -> None:
    # SQLite opened a 0400 store read-only in silence; the start then failed with "store error:
    # attempt to write a readonly database" (no file named), and the store was chmod'ed 0600.
    home = Path(tempfile.mkdtemp(prefix="appserver-ro-"))
    try:
        assert run_cli(home, "agents", "list").code == 0
        db = home / "appserver.db"
        db.chmod(0o400)
        argv = _without_root_file_rights([sys.executable, "-m", "appserver", "serve", "--listen", "127.0.0.1:0"])
        r = subprocess.run(argv, capture_output=True, text=True, timeout=30, env=cli_env(home), cwd=ROOT)
        line = one_error_line(CLIResult(r.returncode, r.stdout, r.stderr))
        assert "cannot write" in line and str(db) in line
        assert stat.S_IMODE(db.stat().st_mode) == 0o400  # left as the operator set it
    finally:
        shutil.rmtree(home, ignore_errors=True)


def test_readyz_fails_when_the_store_file_is_deleted_under_the_server(home: Path) -> None:
    # Before: /readyz said ready and every turn "succeeded" into the unlinked file, lost at exit.
    sp = start_serve(home)
    try:
        chat(sp, "before")
        assert wait_ready(sp.url, 200)["status"] == "ready"
        os.rename(home / "appserver.db", home / "moved.db")
        body = wait_ready(sp.url, 503)
        assert "deleted or replaced" in check(body, "store")["detail"]
        os.rename(home / "moved.db", home / "appserver.db")  # put back: ready again
        wait_ready(sp.url, 200)
    finally:
        sp.stop()
