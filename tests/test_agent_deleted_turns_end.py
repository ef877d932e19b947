"""`appserver agents delete` runs in a process of its own while the server holds turns of that agent:
one paused for an approval, one queued behind it, one running with one queued behind it. Every one
of them ends (failed, nothing written) within seconds, each watcher gets its final snapshot and the
approval request is resolved as cancelled, no traceback is logged, and other agents go on."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.support.cli import careful_home, cli_env, run_cli
from tests.support.serve import serving
from tests.support.ws import WS


def test_every_turn_of_a_deleted_agent_ends_and_its_approval_is_resolved(tmp_path: Path) -> None:
    home = careful_home(tmp_path)
    env = cli_env(home)
    assert run_cli(home, "agents", "create", "--name", "slowpoke", env=env).code == 0
    with serving(home, env=env) as sp:

        async def go() -> None:
            a, b = await WS.open(sp.url), await WS.open(sp.url)
            paused_conv = (await a.request({"type": "create_conversation", "agent": "careful"}))["conversation"]["id"]
            running_conv = (await b.request({"type": "create_conversation", "agent": "slowpoke"}))["conversation"]["id"]
            await a.request({"type": "subscribe", "conversation": paused_conv})
            await b.request({"type": "subscribe", "conversation": running_conv})
            paused = await a.request(
                {"type": "submit_input", "agent": "careful", "conversation": paused_conv, "input": "/call clock {}"}
            )
            request = await a.expect(lambda f: f["type"] == "approval_request")
            behind_paused = await a.request(
                {"type": "submit_input", "agent": "careful", "conversation": paused_conv, "input": "after the call"}
            )
            assert behind_paused["type"] == "ack" and behind_paused["queue_position"] == 1, behind_paused
            running = await b.request(
                {"type": "submit_input", "agent": "slowpoke", "conversation": running_conv, "input": "/slow 200"}
            )
            await b.expect(lambda f: f["type"] == "turn_updated" and f["snapshot"]["status"] == "running")
            behind_running = await b.request(
                {"type": "submit_input", "agent": "slowpoke", "conversation": running_conv, "input": "next"}
            )
            assert behind_running["queue_position"] == 1, behind_running

            for name in ("careful", "slowpoke"):
                deleted = await asyncio.to_thread(run_cli, home, "agents", "delete", name, env=env)
                assert deleted.code == 0, deleted.err

            for ws, ack in ((a, paused), (a, behind_paused), (b, running), (b, behind_running)):
                snap = await ws.terminal(ack["turn_id"], timeout=10)
                assert snap["status"] == "failed", snap
                assert "was deleted" in (snap.get("error") or {}).get("message", ""), snap
            resolved = [f for f in a.seen + await a.drain(0.3) if f["type"] == "approval_resolved"]
            assert len(resolved) == 1, resolved
            assert resolved[0]["call_id"] == request["call_id"] and resolved[0]["status"] == "cancelled", resolved
            assert resolved[0]["turn_id"] == paused["turn_id"]

            # the server goes on for every other agent
            other = (await a.request({"type": "create_conversation", "agent": "assistant"}))["conversation"]["id"]
            await a.request({"type": "subscribe", "conversation": other})
            ack = await a.request({"type": "submit_input", "agent": "assistant", "conversation": other, "input": "hi"})
            snap = await a.terminal(ack["turn_id"])
            assert snap["status"] == "completed" and snap["blocks"][-1]["text"] == "echo: hi"
            for ws in (a, b):
                await ws.close()

        asyncio.run(go())
        sp.stop()
        assert sp.proc.stderr is not None
        log = sp.proc.stderr.read()
        assert "Traceback" not in log and " ERROR " not in log, log
        assert log.count("was deleted; its turns end") == 2, log
