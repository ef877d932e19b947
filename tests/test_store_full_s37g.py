"""What a client is told when the store cannot take writes, against a real `appserver serve`.

A full disk (a 3 MiB tmpfs mounted for the test; skipped where mounting is not permitted): a
request whose turn's accept had committed its input, and whose reply's commit then met the full
disk, was answered "nothing of this request was written"; a client believing it sent the input
again, and the conversation held it twice. Now such an answer says the input was saved, and a
retry with the same Idempotency-Key (once there is room, on the server that ran all along, or
after a restart) leaves every input in the conversation exactly once.

A file size limit (RLIMIT_FSIZE lowered on the running server, as `ulimit -f` would: a write past
it fails with EFBIG, which SQLite reports as a "disk I/O error") was a 500 `internal_error` with a
traceback per request: now a 503 `store_unavailable` naming the limit, one log line, and /readyz
not ready while it holds. A new store opened under the limit says so too.
"""

from __future__ import annotations

import contextlib
import os
import resource
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.cli import ROOT, cli_env
from tests.support.serve import ServeProcess
from tests.test_durability_attack import kill9, serve

pytestmark = [
    pytest.mark.timeout(150),
    pytest.mark.skipif(sys.platform != "linux", reason="tmpfs and RLIMIT_FSIZE as on Linux"),
]

NOTHING = "nothing of this request was written"
SAVED = "input was saved in conversation"  # its reply's commit met the full disk
AFTER = "what the turn saved stays in conversation"  # a write after the turn (its response) met it


@contextlib.contextmanager
def tmpfs(where: Path, size: str) -> Iterator[Path]:
    where.mkdir()
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True, timeout=10
        )
    except OSError:
        pytest.skip("no mount command")
    if done.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here: {done.stderr.decode(errors='replace').strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=10)


def user_copies(home: Path, texts: list[str]) -> dict[str, int]:
    db = sqlite3.connect(f"file:{home / 'appserver.db'}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT content FROM messages WHERE role='user'").fetchall()
    finally:
        db.close()
    stored = [str(r[0]) for r in rows]
    return {t[:12]: sum(1 for s in stored if t in s) for t in texts}


def answer_text(r: httpx.Response) -> str:
    body: dict[str, Any] = r.json()
    if r.status_code != 200:
        return str(body["error"]["message"])
    return str((body.get("error") or {}).get("message") or "")


def post(c: httpx.Client, route: str, text: str, key: str) -> httpx.Response:
    body: dict[str, Any] = (
        {"model": "assistant", "input": text}
        if route == "responses"
        else {"model": "assistant", "messages": [{"role": "user", "content": text}]}
    )
    return c.post(f"/v1/{route}", json=body, headers={"X-Conversation-Id": "pin", "Idempotency-Key": key})


def ok(r: httpx.Response) -> bool:
    return r.status_code == 200 and r.json().get("status", "completed") == "completed"


@pytest.mark.parametrize("route", ["responses", "chat/completions"])
def test_a_reply_lost_to_a_full_disk_says_the_input_was_saved_and_a_keyed_retry_keeps_it_once(
    tmp_path: Path, route: str
) -> None:
    with tmpfs(tmp_path / "mnt", "3m") as mnt:
        home, log = mnt / "home", tmp_path / "serve.log"
        sp = serve(home, log)
        sent: list[tuple[str, str, httpx.Response]] = []
        try:
            c = httpx.Client(base_url=sp.url, timeout=30)
            for i in range(300):
                text, key = f"n{i} " + "y" * 15000, f"key{i}"
                sent.append((text, key, post(c, route, text, key)))
                if sum(1 for *_, a in sent if not ok(a)) >= 4:
                    break
            refused = [(t, k, r) for t, k, r in sent if not ok(r)]
            assert refused, "the disk never filled: the attack did not land"
            said = {k: answer_text(r) for _, k, r in refused}
            # the reply's commit (input and reply: twice the accept's bytes) is the first write the disk refuses
            assert any(SAVED in s for s in said.values()), said
            for _, k, r in refused:
                assert r.status_code in (200, 503), (k, r.status_code, r.text)
                assert NOTHING in said[k] or SAVED in said[k] or AFTER in said[k], (k, said[k])
                if SAVED in said[k]:
                    assert "Idempotency-Key" in said[k] and r.headers.get("x-conversation-id") == "pin", (k, r.headers)
                if NOTHING not in said[k] and r.status_code == 503:  # an SDK must not send it again by itself
                    assert r.headers.get("x-should-retry") == "false", (k, r.headers)
            nothing = [t for t, k, _ in refused if NOTHING in said[k]]
            assert all(n == 0 for n in user_copies(home, nothing).values()), "'nothing written', but stored"
            # Room again, on the server that ran all along: each refused request is sent again with its key.
            subprocess.run(["mount", "-o", "remount,size=64m", str(mnt)], check=True, timeout=10)
            for text, key, _ in refused:
                again = post(c, route, text, key)
                assert ok(again), (key, again.text[:300])
            texts = [t for t, _, _ in sent]
            live = user_copies(home, texts)
            assert all(n == 1 for n in live.values()), {k: n for k, n in live.items() if n != 1}
        finally:
            with contextlib.suppress(Exception):
                kill9(sp)
            sp.kill()
        sp2 = serve(home, log)
        try:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                after = user_copies(home, texts)
                if all(n == 1 for n in after.values()):
                    break
                time.sleep(0.1)
            assert all(n == 1 for n in after.values()), {k: n for k, n in after.items() if n != 1}
        finally:
            sp2.stop()
            sp2.kill()


def _limit(sp: ServeProcess, soft: int) -> None:
    resource.prlimit(sp.proc.pid, resource.RLIMIT_FSIZE, (soft, resource.RLIM_INFINITY))


def test_a_file_size_limit_is_a_503_naming_it_without_tracebacks(tmp_path: Path) -> None:
    if not hasattr(resource, "prlimit"):
        pytest.skip("needs prlimit")
    home, log = tmp_path / "home", tmp_path / "serve.log"
    sp = serve(home, log)
    try:
        c = httpx.Client(base_url=sp.url, timeout=30)
        assert c.post("/v1/responses", json={"model": "assistant", "input": "warm"}).status_code == 200
        sizes = [p.stat().st_size for p in (home / "appserver.db", home / "appserver.db-wal") if p.exists()]
        _limit(sp, max(sizes) + 4096)
        failed: list[httpx.Response] = []
        for i in range(60):
            r = c.post("/v1/responses", json={"model": "assistant", "input": f"m{i} " + "z" * 30000})
            if r.status_code != 200:
                failed.append(r)
            if len(failed) >= 5:
                break
        assert failed, "no write went past the limit: the attack did not land"
        for r in failed:
            err = r.json()["error"]
            assert r.status_code == 503 and err["code"] == "store_unavailable", r.text[:300]
            assert "file size limit (ulimit -f)" in err["message"], err["message"]
        ready = c.get("/readyz")
        assert ready.status_code == 503 and "ulimit -f" in ready.text, ready.text[:400]
        _limit(sp, resource.RLIM_INFINITY)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            r = c.post("/v1/responses", json={"model": "assistant", "input": "x" * 30000})
            if r.status_code == 200:
                break
            time.sleep(0.1)
        assert r.status_code == 200, r.text[:300]
    finally:
        sp.stop()
        sp.kill()
    text = log.read_text()
    assert "Traceback" not in text, text[text.index("Traceback") - 300 :][:3000]


def test_a_new_store_under_a_file_size_limit_names_the_limit(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    env = cli_env(home)
    first = subprocess.run(
        [sys.executable, "-m", "appserver", "agents", "list"], env=env, cwd=ROOT, capture_output=True, timeout=60
    )
    assert first.returncode == 0, first.stderr
    for leftover in home.glob("appserver.db*"):
        leftover.unlink()

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.RLIM_INFINITY))

    done = subprocess.run(
        [sys.executable, "-m", "appserver", "agents", "list"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=small_files,  # noqa: PLW1509  (a child's own limit, set before it runs)
    )
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "file size limit (ulimit -f)" in done.stderr and "appserver.db" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert os.environ.get("APPSERVER_HOME") != str(home)
