"""A paused turn cancelled by one client: every other subscriber that saw the approval request is
told it was resolved (status cancelled), and no snapshot shows a call both pending and settled."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.support.cli import cli_env, run_cli
from tests.support.serve import start_serve
from tests.support.ws import WS


def test_cancel_of_a_paused_turn_resolves_the_approval_for_every_subscriber(tmp_path: Path) -> None:
    home = tmp_path / "home"
    assert run_cli(home, "agents", "create", "--name", "careful", "--tool", "clock=ask", env=cli_env(home)).code == 0
    sp = start_serve(home, env=cli_env(home))

    async def go() -> None:
        a, b = await WS.open(sp.url), await WS.open(sp.url)
        conv = (await a.request({"type": "create_conversation", "agent": "careful"}))["conversation"]["id"]
        await a.request({"type": "subscribe", "conversation": conv})
        await b.request({"type": "subscribe", "conversation": conv})
        ack = await a.request(
            {"type": "submit_input", "agent": "careful", "conversation": conv, "input": "/call clock {}"}
        )
        call_id = (await b.expect(lambda f: f["type"] == "approval_request"))["call_id"]
        await a.expect(lambda f: f["type"] == "approval_request")
        cancelled = await a.request({"type": "cancel", "conversation": conv})
        assert cancelled["cancelled"] is True
        resolved = await b.expect(lambda f: f["type"] == "approval_resolved", timeout=5)
        assert resolved["call_id"] == call_id and resolved["status"] == "cancelled"
        snap = await b.terminal(ack["turn_id"])
        assert snap["status"] == "cancelled"
        for s in b.snapshots(ack["turn_id"]):
            open_calls = {p["call_id"] for p in s["pending"]} if s["status"] == "awaiting" else set()
            settled = {
                blk.get("call_id")
                for blk in s["blocks"]
                if blk.get("type") == "tool_call"
                and blk.get("status") not in ("pending_approval", "awaiting_client", "running", None)
            }
            assert not open_calls & settled, [
                (
                    x["revision"],
                    x["status"],
                    x["phase"],
                    [p["call_id"][-4:] for p in x["pending"]],
                    [(blk.get("type"), blk.get("status")) for blk in x["blocks"]],
                )
                for x in b.snapshots(ack["turn_id"])
            ]
        await a.close()
        await b.close()

    try:
        asyncio.run(go())
    finally:
        sp.stop()
