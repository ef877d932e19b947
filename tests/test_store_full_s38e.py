"""What a client is told when the store cannot take writes, against a real `appserver serve`.

A full disk (a 3 MiB tmpfs mounted for the test; skipped where mounting is not permitted): a
request whose turn's accept had saved its input, and whose reply's commit then met the full disk,
was answered "nothing of this request was written" (with `Retry-After`, so an SDK sent it again by
itself): a client believing it sent the input again, and the conversation held it twice. Now such
an answer says the input was saved and in which conversation, that a resend would store it again,
and carries `x-should-retry: false`; nothing more is written for it (the turn stays as the store
has it, and the next start settles it with its input kept once).

A file size limit (RLIMIT_FSIZE lowered on the running server, as `ulimit -f` would: a write past
it fails with EFBIG, which SQLite reports as a "disk I/O error") was a 500 `internal_error` with a
traceback per request: now a 503 `store_unavailable` naming the limit, one log line, and /readyz
not ready while it holds. A new store opened under the limit says so too.
"""

from __future__ import annotations

import contextlib
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
AFTER = "what it saved stays in conversation"  # a write after the turn (its response) met it
AGAIN = "Do not send the input again (it would be stored a second time)"


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


def read_store(home: Path, query: str) -> list[Any]:
    db = sqlite3.connect(f"file:{home / 'appserver.db'}?mode=ro", uri=True)
    try:
        return db.execute(query).fetchall()
    finally:
        db.close()


def user_copies(home: Path, texts: list[str]) -> dict[str, int]:
    """How many times each text is in the conversations' user messages."""
    stored = [str(r[0]) for r in read_store(home, "SELECT content FROM messages WHERE role='user'")]
    return {t[:12]: sum(1 for s in stored if t in s) for t in texts}


def answer_text(r: httpx.Response) -> str:
    body: dict[str, Any] = r.json()
    if r.status_code != 200:
        return str(body["error"]["message"])
    return str((body.get("error") or {}).get("message") or "")


def post(c: httpx.Client, route: str, text: str, key: str | None) -> httpx.Response:
    body: dict[str, Any] = (
        {"model": "assistant", "input": text}
        if route == "responses"
        else {"model": "assistant", "messages": [{"role": "user", "content": text}]}
    )
    headers = {"X-Conversation-Id": "pin"} | ({"Idempotency-Key": key} if key else {})
    return c.post(f"/v1/{route}", json=body, headers=headers)


def ok(r: httpx.Response) -> bool:
    return r.status_code == 200 and r.json().get("status", "completed") == "completed"


def fill_the_disk(c: httpx.Client, route: str, mnt: Path) -> tuple[list[str], list[tuple[str, httpx.Response]]]:
    """Big inputs into one conversation (every other one with an Idempotency-Key) until the disk
    refuses one, then small ones whose replies are big (`/recall`: every earlier input), the disk
    given 64 KiB more before each: their accept fits, their reply's commit does not. (Every text
    sent, the refused ones with their answers.)"""
    sent: list[str] = []
    refused: list[tuple[str, httpx.Response]] = []
    for i in range(300):
        text = f"n{i:03d} " + "y" * 15000
        sent.append(text)
        r = post(c, route, text, f"key{i}" if i % 2 else None)
        if not ok(r):
            refused.append((text, r))
            break
    for i in range(12):
        size = 3072 + 64 * (i + 1)
        subprocess.run(["mount", "-o", f"remount,size={size}k", str(mnt)], check=True, timeout=10)
        text = f"/recall r{i:03d}."
        sent.append(text)
        r = post(c, route, text, f"recall{i}" if i % 2 else None)
        if not ok(r):
            refused.append((text, r))
        if not ok(r) and NOTHING not in answer_text(r):
            break
    return sent, refused


@pytest.mark.parametrize("route", ["responses", "chat/completions"])
def test_a_reply_lost_to_a_full_disk_says_the_input_was_saved_and_a_resend_would_store_it_twice(
    tmp_path: Path, route: str
) -> None:
    with tmpfs(tmp_path / "mnt", "3m") as mnt:
        home, log = mnt / "home", tmp_path / "serve.log"
        sp = serve(home, log)
        try:
            c = httpx.Client(base_url=sp.url, timeout=30)
            sent, refused = fill_the_disk(c, route, mnt)
            assert refused, "the disk never filled: the attack did not land"
            said = {t[:12]: answer_text(r) for t, r in refused}
            # a reply's commit (after its accept saved its input) is refused, or (Responses) the response
            # object after it: said so, never a 200 `failed` Response
            assert any(SAVED in s or AFTER in s for s in said.values()), [
                (t[:12], r.status_code, said[t[:12]][:90]) for t, r in refused
            ]
            for text, r in refused:
                what = said[text[:12]]
                assert r.status_code in (200, 503), (text[:12], r.status_code, r.text[:300])
                assert (NOTHING in what) + (SAVED in what) + (AFTER in what) == 1, (text[:12], what)
                if NOTHING in what:
                    continue
                # an SDK must not send it again by itself; the client is told where and not to
                assert r.status_code == 503 and r.headers.get("x-should-retry") == "false", (text[:12], r.headers)
                assert r.json()["error"]["code"] == "store_unavailable", r.text[:300]
                assert r.headers.get("x-conversation-id") == "pin" and "conversation pin" in what, (r.headers, what)
                assert AGAIN in what and "is full" in what, what
            nothing = [t for t, _ in refused if NOTHING in said[t[:12]]]
            saved = [t for t, _ in refused if SAVED in said[t[:12]]]
            assert all(n == 0 for n in user_copies(home, nothing).values()), "'nothing written', but stored"
            # nothing more is written for a saved input: its turn is as the store has it, open, its input in its row
            open_inputs = [
                str(r[0]) for r in read_store(home, "SELECT input FROM turns WHERE status IN ('queued', 'running')")
            ]
            assert all(any(t in i for i in open_inputs) for t in saved), "a saved input is not in its turn's row"
            # Room again: the client goes on in the conversation as told, without sending the input again.
            subprocess.run(["mount", "-o", "remount,size=64m", str(mnt)], check=True, timeout=10)
            assert ok(post(c, route, "and then", None))
        finally:
            with contextlib.suppress(Exception):
                kill9(sp)
            sp.kill()
        sp2 = serve(home, log)
        try:
            # the next start settles the open turns, each input kept in the conversation once
            deadline = time.monotonic() + 10
            while read_store(home, "SELECT id FROM turns WHERE status IN ('queued', 'running')"):
                assert time.monotonic() < deadline, "the restart left turns open"
                time.sleep(0.1)
            copies = user_copies(home, [t for t in sent if t not in nothing])
            assert all(n == 1 for n in copies.values()), {k: n for k, n in copies.items() if n != 1}
            assert all(n == 0 for n in user_copies(home, nothing).values()), "'nothing written', but stored"
        finally:
            sp2.stop()
            sp2.kill()


def _limit(sp: ServeProcess, soft: int) -> None:
    resource.prlimit(sp.proc.pid, resource.RLIMIT_FSIZE, (soft, resource.RLIM_INFINITY))


@pytest.mark.skipif(not hasattr(resource, "prlimit"), reason="needs prlimit")
def test_a_file_size_limit_is_a_503_naming_it_without_tracebacks(tmp_path: Path) -> None:
    home, log = tmp_path / "home", tmp_path / "serve.log"
    sp = serve(home, log)
    try:
        c = httpx.Client(base_url=sp.url, timeout=30)
        assert c.post("/v1/responses", json={"model": "assistant", "input": "warm"}).status_code == 200
        sizes = [p.stat().st_size for p in (home / "appserver.db", home / "appserver.db-wal") if p.exists()]
        _limit(sp, max(sizes) + 4096)
        failed: list[httpx.Response] = []
        for i in range(60):
            r = c.post(
                "/v1/chat/completions",
                json={"model": "assistant", "messages": [{"role": "user", "content": f"m{i} " + "z" * 30000}]},
            )
            if r.status_code != 200:
                failed.append(r)
            if len(failed) >= 5:
                break
        assert failed, "no write went past the limit: the attack did not land"
        for r in failed:
            err = r.json()["error"]
            assert r.status_code == 503 and err["code"] == "store_unavailable", r.text[:300]
            assert "file size limit (ulimit -f)" in err["message"], err["message"]
            assert NOTHING in err["message"] or SAVED in err["message"] or AFTER in err["message"], err["message"]
        ready = c.get("/readyz")
        assert ready.status_code == 503 and "ulimit -f" in ready.text, ready.text[:400]
        _limit(sp, resource.RLIM_INFINITY)
        deadline = time.monotonic() + 10
        while True:
            r = c.post("/v1/responses", json={"model": "assistant", "input": "x" * 30000})
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert r.status_code == 200, r.text[:300]
        deadline = time.monotonic() + 10  # (its result is cached a moment)
        while (ready := c.get("/readyz")).status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ready.status_code == 200, ready.text[:600]
    finally:
        _limit(sp, resource.RLIM_INFINITY)
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
