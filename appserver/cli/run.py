"""`appserver run`: one turn, in-process (or refused while a server owns this home)."""

from __future__ import annotations

import sys
from typing import Any

import click

from appserver.cli.common import fail, get_config, print_json, with_server
from appserver.errors import InvalidInput, NotAwaiting
from appserver.runtime.conversation import Decision
from appserver.runtime.kernel import SubmitRequest
from appserver.runtime.snapshot import TurnSnapshot
from appserver.server import Server
from appserver.serverinfo import read_live_server


def render(snapshot: TurnSnapshot, conversation_id: str, as_json: bool) -> int:
    if as_json:
        print_json({**snapshot.to_dict(), "text": snapshot.text(), "conversation_id": conversation_id})
    else:
        for block in snapshot.blocks:
            if block["type"] == "tool_call" and block.get("output") is not None:
                click.echo(f"[{block['name']} {block['status']}] {block['output']}", err=True)
        text = snapshot.text()
        if text:
            click.echo(text)
        if snapshot.status == "awaiting":
            for p in snapshot.pending:
                verb = "approval" if p["kind"] == "approval" else "a client result"
                click.echo(f"awaiting {verb}: {p['call_id']} {p['name']}({p['arguments']})")
            click.echo(f"conversation: {conversation_id}  (answer with: appserver run --conversation {conversation_id} --approve CALL_ID | --deny CALL_ID --reason TEXT)")
        elif snapshot.status != "completed":
            detail = (snapshot.error or {}).get("message") or snapshot.stop_reason
            click.echo(f"turn {snapshot.status}: {detail}", err=True)
    return 0 if snapshot.status in ("completed", "awaiting") else 1


@click.command("run")
@click.option("--agent", default="assistant", show_default=True, help="Agent id or name.")
@click.option("--conversation", default="default", show_default=True, help="new, default or a conversation id.")
@click.option("--approve", "approve", multiple=True, help="Approve a pending call (repeatable).")
@click.option("--deny", "deny", multiple=True, help="Deny a pending call (repeatable).")
@click.option("--reason", default=None, help="Reason given with --deny.")
@click.option("--idempotency-key", default=None)
@click.option("--timeout", default=600.0, show_default=True, help="Seconds to wait for the turn.")
@click.option("--json", "as_json", is_flag=True)
@click.argument("text", required=False)
def run_command(agent: str, conversation: str, approve: tuple[str, ...], deny: tuple[str, ...], reason: str | None, idempotency_key: str | None, timeout: float, as_json: bool, text: str | None) -> None:
    """Run one turn of AGENT with TEXT and print the reply."""
    config = get_config()
    live = read_live_server(config.server_json)
    if live is not None:
        fail(
            f"a server is running on this home ({live.get('url')}, pid {live.get('pid')}); "
            "`appserver run` cannot run turns beside it yet. Use its HTTP API, or stop it first.",
            3,
        )
    answering = bool(approve or deny)
    if answering and text:
        fail("give either TEXT or --approve/--deny, not both", 2)
    if not answering and not text:
        fail("nothing to send: give TEXT (or --approve/--deny CALL_ID)", 2)

    async def go(s: Server) -> tuple[TurnSnapshot, str]:
        if answering:
            rec = await s.kernel.resolve_agent(agent)
            conv = await s.kernel.resolve_conversation(rec, conversation, create=False)
            rt = await s.kernel.runtime(conv.id)
            turn = rt.awaiting_turn
            if turn is None:
                raise NotAwaiting(f"conversation {conv.id} has no turn waiting for an answer")
            handle = rt.handles[turn.id]
            before = handle.controller.revision
            decisions = [Decision(c, "approve", decided_by="cli") for c in approve]
            decisions += [Decision(c, "deny", reason=reason, decided_by="cli") for c in deny]
            results = await s.kernel.respond(conv.id, decisions)
            refused = [r for r in results if not r["accepted"]]
            if refused:
                raise InvalidInput("; ".join(r["message"] for r in refused))
            snap = await handle.wait_settled(timeout, after_revision=before)
            return snap, conv.id
        assert text is not None
        sub = await s.kernel.submit(SubmitRequest(agent=agent, input=text, conversation=conversation, idempotency_key=idempotency_key, source={"client": "cli"}))
        snap = await sub.wait(timeout)
        return snap, sub.conversation_id

    try:
        snap, conversation_id = with_server(go, config=config)
    except TimeoutError:
        fail(f"the turn did not settle within {timeout:g} s", 1)
    sys.exit(render(snap, conversation_id, as_json))


def snapshot_summary(snapshot: TurnSnapshot) -> dict[str, Any]:
    return {"status": snapshot.status, "stop_reason": snapshot.stop_reason, "text": snapshot.text()}
