"""Issue 11.7 and 11.8: what a `kill -9` of a real `appserver serve` leaves behind, and what the
next start does with it. Real server subprocess, real SQLite file, real shell processes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import time
from pathlib import Path

import httpx
import pytest

from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, start_serve
from tests.support.wait import eventually, wait_for
from tests.support.ws import WS


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _describe(procs: set[tuple[int, int]]) -> str:
    """What a process still runs as, its state, parent and signal masks (blocked, ignored, caught):
    enough to tell why a SIGTERM did not end it."""
    out = []
    for pid, _ in sorted(procs):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            status = dict(
                line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line
            )
        except OSError:
            continue
        fields = " ".join(f"{k}={status.get(k, '?').strip()}" for k in ("State", "PPid", "SigBlk", "SigIgn", "SigCgt"))
        out.append(f"[{pid} {cmd.strip()[:80]!r} {fields}]")
    return " ".join(out) or "(gone meanwhile)"


def _live_group(pgid: int) -> set[tuple[int, int]]:
    """Processes of process group `pgid` that still run (zombies do not), as (pid, start time):
    with pid_max 32,768 and thousands of processes per suite, a pid (and so a pgid) is soon reused
    by another test's process, which must not count as this group still running."""
    out = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            raw = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        fields = raw[raw.rfind(")") + 2 :].split()
        if fields[0] not in ("Z", "X") and int(fields[2]) == pgid:
            out.add((int(name), int(fields[19])))  # field 22 of stat: the start time
    return out


def _kill9(sp: ServeProcess) -> None:
    sp.proc.send_signal(signal.SIGKILL)
    sp.proc.wait(10)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc (Linux)")
def test_kill9_while_an_allow_tool_runs_keeps_the_call_and_kills_its_processes(tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = cli_env(home)
    assert run_cli(home, "agents", "create", "--name", "actor", "--tool", "shell=allow", env=env).code == 0
    pidfile, marker = tmp_path / "shell.pid", tmp_path / "marker"
    escaped = tmp_path / "escaped.pid"
    # the shell writes its pid, leaves a long child behind in its process group and one that
    # leaves the group (setsid), and would make its side effect a second later
    command = (
        f"echo $$ > {pidfile}; sleep 30 & setsid sh -c 'echo $$ > {escaped}; exec sleep 30' & "
        f"sleep 1; touch {marker}; wait"
    )
    sp = start_serve(home, env=env)
    try:

        async def submit() -> tuple[str, str]:
            ws = await WS.open(sp.url)
            ack = await ws.request(
                {
                    "type": "submit_input",
                    "agent": "actor",
                    "conversation": "new",
                    "input": "/call shell " + json.dumps({"command": command}),
                }
            )
            await ws.close()
            return ack["conversation_id"], ack["turn_id"]

        conv, turn_id = asyncio.run(submit())
        wait_for(
            lambda: (
                pidfile.exists() and pidfile.read_text().strip() and escaped.exists() and escaped.read_text().strip()
            ),
            15,
            "the shell to start",
        )
        shell = int(pidfile.read_text())
        group = os.getpgid(shell)
        loner = int(escaped.read_text())
        members = _live_group(group)
        assert len(members) >= 3  # the group leader, the shell, its sleep
        _kill9(sp)
        started = time.monotonic()
        # the tool's whole process group dies with the server (PR_SET_PDEATHSIG + the group
        # guard): before, what the shell had started in the background ran on until a restart
        if not eventually(lambda: not members & _live_group(group), 10):
            raise AssertionError(
                f"the tool's process group outlived the server by 10 s: {_describe(members & _live_group(group))}"
            )
        # ... and so does what left the group (setsid): the guard is a child subreaper, so it is
        # still the guard's descendant, killed with the rest (before: it ran on until a restart)
        if not eventually(lambda: not _alive(loner), 10):
            raise AssertionError("the setsid sleep outlived the server by 10 s")
    finally:
        if sp.proc.poll() is None:
            sp.proc.kill()
    sp = start_serve(home, env=env)
    try:
        wait_for(lambda: not _alive(loner), 5, "the next start to kill the orphan that left the group")
        time.sleep(max(0.0, 1.5 - (time.monotonic() - started)))
        assert not marker.exists(), "the command went on after the server died"

        async def after() -> tuple[list[dict], dict]:  # type: ignore[type-arg]
            ws = await WS.open(sp.url)
            messages = (await ws.request({"type": "get_history", "conversation": conv}))["messages"]
            # the conversation goes on from a valid history
            ack = await ws.request({"type": "submit_input", "agent": "actor", "conversation": conv, "input": "/recall"})
            snap = await ws.terminal(ack["turn_id"])
            await ws.close()
            return messages, snap

        messages, snap = asyncio.run(after())
        assert [m["role"] for m in messages] == ["user", "assistant", "tool"], messages
        call = messages[1]["tool_calls"][0]
        assert call["name"] == "shell" and json.loads(call["arguments"]) == {"command": command}
        result = messages[2]
        assert result["tool_call_id"] == call["id"] and result["is_error"] is True
        assert "interrupted" in result["content"] and "outcome is unknown" in result["content"]
        with sqlite3.connect(home / "appserver.db") as c:
            assert c.execute("SELECT status FROM turns WHERE id=?", (turn_id,)).fetchone()[0] == "interrupted"
        assert snap["status"] == "completed" and snap["blocks"][-1]["text"].startswith("/call shell"), snap
    finally:
        sp.stop()


def test_idempotency_key_of_a_request_killed_mid_turn_is_released_at_start(tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = cli_env(home)
    body = {"model": "assistant", "messages": [{"role": "user", "content": "/slow 30"}]}
    headers = {"Idempotency-Key": "retry-me-after-a-crash"}
    sp = start_serve(home, env=env)
    try:

        async def first() -> None:
            async with httpx.AsyncClient(base_url=sp.url, timeout=10) as client:
                request = asyncio.ensure_future(client.post("/v1/chat/completions", json=body, headers=headers))
                db = home / "appserver.db"

                def running() -> bool:
                    with sqlite3.connect(db) as c:
                        return c.execute("SELECT COUNT(*) FROM turns WHERE status='running'").fetchone()[0] == 1

                deadline = time.monotonic() + 10
                while not running():
                    assert time.monotonic() < deadline, "the turn never started"
                    await asyncio.sleep(0.02)
                _kill9(sp)  # mid-request: the key is claimed, no reply was sent
                with pytest.raises(httpx.HTTPError):
                    await request

        asyncio.run(first())
    finally:
        if sp.proc.poll() is None:
            sp.proc.kill()
    sp = start_serve(home, env=env)
    try:
        # the retry runs the turn (no 120 s wait, no 409 idempotency_key_in_progress) ...
        retry = httpx.post(f"{sp.url}/v1/chat/completions", json=body, headers=headers, timeout=10)
        assert retry.status_code == 200, retry.text
        assert retry.json()["choices"][0]["message"]["content"] == " ".join(f"w{i}" for i in range(1, 31))
        assert "Idempotent-Replayed" not in retry.headers
        # ... and a second retry replays it
        again = httpx.post(f"{sp.url}/v1/chat/completions", json=body, headers=headers, timeout=10)
        assert again.status_code == 200 and again.headers.get("Idempotent-Replayed") == "true"
        assert again.json() == retry.json()
    finally:
        sp.stop()


def test_an_idempotency_key_whose_turn_was_queued_at_kill9_gives_one_turn(tmp_path: Path) -> None:
    """The turn of a keyed request was accepted (queued behind a slow one) when the server was
    killed: its connection died with the process, so the restart drops it (nothing written) rather
    than answer nobody, and the client's retry with the same key runs the input once (found on
    PostgreSQL by an outside test; both stores)."""
    home = tmp_path / "home"
    env = cli_env(home)
    db = home / "appserver.db"
    content = "queued behind a slow one"
    key = {"Idempotency-Key": "queued-at-kill"}

    def turns(where: str = "") -> list[tuple[str, str]]:
        with sqlite3.connect(db) as c:
            return c.execute(
                "SELECT t.id, t.status FROM turns t JOIN messages m ON m.turn_id = t.id "
                "WHERE m.role = 'user' AND m.content = ?" + where,
                (json.dumps(content),),
            ).fetchall()

    def queued() -> bool:
        with sqlite3.connect(db) as c:
            return c.execute("SELECT COUNT(*) FROM turns WHERE status='queued'").fetchone()[0] == 1

    sp = start_serve(home, env=env)
    try:
        first = httpx.post(
            f"{sp.url}/v1/chat/completions",
            json={"model": "assistant", "messages": [{"role": "user", "content": "hi"}]},
            timeout=10,
        )
        conv = first.headers["x-conversation-id"]

        async def load() -> None:
            async with httpx.AsyncClient(base_url=sp.url, timeout=10, headers={"X-Conversation-Id": conv}) as client:
                slow = asyncio.ensure_future(
                    client.post(
                        "/v1/chat/completions",
                        json={"model": "assistant", "messages": [{"role": "user", "content": "/slow 200"}]},
                    )
                )
                await asyncio.sleep(0.3)
                keyed = asyncio.ensure_future(
                    client.post(
                        "/v1/chat/completions",
                        json={"model": "assistant", "messages": [{"role": "user", "content": content}]},
                        headers=key,
                    )
                )
                deadline = time.monotonic() + 10
                while not queued():
                    assert time.monotonic() < deadline, "the keyed turn was never queued"
                    await asyncio.sleep(0.02)
                _kill9(sp)
                for request in (slow, keyed):
                    with pytest.raises(httpx.HTTPError):
                        await request

        asyncio.run(load())
    finally:
        if sp.proc.poll() is None:
            sp.proc.kill()
    sp = start_serve(home, env=env)
    try:
        retry = httpx.post(
            f"{sp.url}/v1/chat/completions",
            json={"model": "assistant", "messages": [{"role": "user", "content": content}]},
            headers={"X-Conversation-Id": conv, **key},
            timeout=20,
        )
        assert retry.status_code == 200, retry.text
        assert retry.json()["choices"][0]["message"]["content"] == f"echo: {content}"
        assert [s for _, s in turns()] == ["completed"], turns()
    finally:
        sp.stop()


def test_http_inputs_queued_at_kill9_are_dropped_and_protocol_inputs_run(tmp_path: Path) -> None:
    """Chat and Responses inputs queued behind a slow turn when the server was killed: their only
    answer was the reply to a request that died with the process, so the restart drops them
    (cancelled, error kind `withdrawn`, nothing written) instead of running them for nobody while
    the client's retry runs them again. A WebSocket input queued beside them runs: its client
    follows it on reconnecting."""
    home = tmp_path / "home"
    env = cli_env(home)
    db = home / "appserver.db"

    def rows(sql: str, *args: object) -> list[tuple[object, ...]]:
        with sqlite3.connect(db) as c:
            return c.execute(sql, args).fetchall()

    sp = start_serve(home, env=env)
    try:

        async def load() -> str:
            ws = await WS.open(sp.url)
            ack = await ws.request(
                {"type": "submit_input", "agent": "assistant", "conversation": "new", "input": "/slow 300"}
            )
            conv = ack["conversation_id"]
            hdr = {"X-Conversation-Id": conv}
            async with httpx.AsyncClient(base_url=sp.url, timeout=10, headers=hdr) as client:
                chat = asyncio.ensure_future(
                    client.post(
                        "/v1/chat/completions",
                        json={"model": "assistant", "messages": [{"role": "user", "content": "chat-queued"}]},
                    )
                )
                resp = asyncio.ensure_future(
                    client.post("/v1/responses", json={"model": "assistant", "input": "responses-queued"})
                )
                queued = await ws.request(
                    {"type": "submit_input", "agent": "assistant", "conversation": conv, "input": "ws-queued"}
                )
                assert queued["queue_position"] >= 1
                deadline = time.monotonic() + 10
                while len(rows("SELECT id FROM turns WHERE status='queued'")) < 3:
                    assert time.monotonic() < deadline, "the three inputs were never all queued"
                    await asyncio.sleep(0.02)
                _kill9(sp)
                for request in (chat, resp):
                    with pytest.raises(httpx.HTTPError):
                        await request
            return conv

        conv = asyncio.run(load())
    finally:
        if sp.proc.poll() is None:
            sp.proc.kill()
    sp = start_serve(home, env=env)
    try:
        eventually(lambda: not rows("SELECT id FROM turns WHERE status IN ('queued', 'running')"), 15)
        users = [
            json.loads(r[0]) for r in rows("SELECT content FROM messages WHERE role='user' AND conversation_id=?", conv)
        ]
        assert users == ["/slow 300", "ws-queued"], users
        dropped = rows("SELECT status, error FROM turns WHERE conversation_id=? AND status='cancelled'", conv)
        assert len(dropped) == 2 and all(json.loads(str(e))["kind"] == "withdrawn" for _, e in dropped), dropped
        statuses = sorted(str(r[0]) for r in rows("SELECT status FROM turns WHERE conversation_id=?", conv))
        assert statuses == ["cancelled", "cancelled", "completed", "interrupted"], statuses
    finally:
        sp.stop()
