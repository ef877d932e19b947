"""`appserver conversations list|show|history`.

Titles and messages are other people's and the model's words: the plain-text output shows their
controls (appserver/cli/safetext.py) instead of handing them to the terminal; `--json` is exact."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import click

from appserver.cli.common import MAX_COUNT, Count, print_json, with_server
from appserver.cli.safetext import exact, visible
from appserver.errors import NotFound
from appserver.server import Server
from appserver.shown import shown


@click.group("conversations")
def conversations_group() -> None:
    """Inspect conversations."""


@conversations_group.command("list")
@click.option("--agent", default="assistant", show_default=True)
@click.option(
    "--limit", type=Count(), default=100, show_default=True, help=f"Most conversations to list, 1 to {MAX_COUNT}."
)
@click.option("--json", "as_json", is_flag=True)
def list_conversations(agent: str, limit: int, as_json: bool) -> None:
    """List an agent's conversations, most recently used first."""

    async def go(s: Server) -> list[Any]:
        rec = await s.kernel.resolve_agent(agent)
        return await s.store.list_conversations(rec.id, limit=limit)

    convs = with_server(go)
    if as_json:
        print_json([c.to_dict() for c in convs])
        return
    for c in convs:
        when = datetime.fromtimestamp(c.updated_at).strftime("%Y-%m-%d %H:%M")
        click.echo(f"{exact(c.id)}  {when}  {'default' if c.is_default else exact(c.title)}")


async def _conversation(s: Server, conversation_id: str):  # type: ignore[no-untyped-def]
    conv = await s.store.get_conversation(conversation_id)
    if conv is None:
        raise NotFound(f"unknown conversation {shown(conversation_id)}")
    return conv


@conversations_group.command("show")
@click.argument("conversation_id")
@click.option("--json", "as_json", is_flag=True)
def show_conversation(conversation_id: str, as_json: bool) -> None:
    """Show one conversation: its agent, title, owner and times."""
    conv = with_server(lambda s: _conversation(s, conversation_id))
    if as_json:
        print_json(conv.to_dict())
        return
    for k, v in conv.to_dict().items():
        click.echo(f"{k}: {visible(v)}")


@conversations_group.command("history")
@click.argument("conversation_id")
@click.option("--limit", type=Count(), default=None, help=f"Only the last N messages, 1 to {MAX_COUNT} (default: all).")
@click.option("--json", "as_json", is_flag=True)
def history(conversation_id: str, limit: int | None, as_json: bool) -> None:
    """Print a conversation's committed messages, oldest first."""

    async def go(s: Server) -> list[Any]:
        await _conversation(s, conversation_id)
        return await s.store.list_messages(conversation_id, limit=limit)

    messages = with_server(go)
    if as_json:
        print_json([m.to_dict() for m in messages])
        return
    for m in messages:
        marker = "" if m.completion_status == "completed" else f" [{m.completion_status}]"
        if m.role == "tool":
            click.echo(f"tool {exact(m.name)} ({exact(m.tool_call_id)}){visible(marker)}: {visible(m.text())}")
            continue
        calls = "".join(f"\n  -> {exact(c['name'])}({exact(c['arguments'])}) [{exact(c['id'])}]" for c in m.tool_calls)
        refused = " [refusal]" if isinstance(m.meta.get("refusal"), str) else ""
        # a kept system/developer message shows as what it is (never as a user or assistant message)
        role = "developer" if m.role == "system" and m.meta.get("role") == "developer" else m.role
        click.echo(f"{visible(role)}{visible(marker)}{refused}: {visible(m.text())}{calls}")
