"""`appserver agents list|create|show|update|delete`."""

from __future__ import annotations

import click

from appserver.agent_admin import parse_params, parse_tool_policies
from appserver.cli.common import print_json, with_server
from appserver.server import Server
from appserver.store.records import AgentRecord


def _show(agent: AgentRecord) -> None:
    click.echo(f"{agent.name}  ({agent.id})")
    click.echo(f"  model:  {agent.model}")
    if agent.system:
        click.echo(f"  system: {agent.system}")
    if agent.tools:
        click.echo("  tools:  " + ", ".join(f"{k}={v}" for k, v in sorted(agent.tools.items())))
    if agent.params:
        click.echo("  params: " + ", ".join(f"{k}={v}" for k, v in sorted(agent.params.items())))


@click.group("agents")
def agents_group() -> None:
    """Manage agents."""


@agents_group.command("list")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def list_agents(as_json: bool) -> None:
    agents = with_server(lambda s: s.store.list_agents())
    if as_json:
        print_json([a.to_dict() for a in agents])
        return
    for a in agents:
        click.echo(f"{a.id}  {a.name:<20} {a.model}")


@agents_group.command("create")
@click.option("--name", required=True)
@click.option("--model", default="echo", show_default=True, help="PROVIDER:MODEL or echo")
@click.option("--system", default="", help="System prompt.")
@click.option("--tool", "tools", multiple=True, help="NAME=allow|ask|deny (repeatable)")
@click.option(
    "--param",
    "params",
    multiple=True,
    help="KEY=VALUE provider/loop parameter, e.g. temperature=0.2, context_window=8192 (repeatable)",
)
@click.option("--json", "as_json", is_flag=True)
def create_agent(
    name: str, model: str, system: str, tools: tuple[str, ...], params: tuple[str, ...], as_json: bool
) -> None:
    async def go(s: Server) -> tuple[AgentRecord, list[AgentRecord]]:
        made = await s.agents.create(name, model, system, parse_tool_policies(tools), parse_params(params))
        return made, await _namesakes(s, made)

    agent, namesakes = with_server(go)
    _note_namesakes(agent, namesakes)
    print_json(agent.to_dict()) if as_json else _show(agent)


async def _namesakes(s: Server, agent: AgentRecord) -> list[AgentRecord]:
    return [a for a in await s.store.list_agents() if a.name == agent.name and a.id != agent.id]


def _note_namesakes(agent: AgentRecord, namesakes: list[AgentRecord]) -> None:
    """Allowed (DESIGN §5), but every client that named the agent by its name now gets an error."""
    if namesakes:
        click.echo(
            f"note: {', '.join(a.id for a in namesakes)} is also named {agent.name!r}: the name now names "
            f"several agents, so OpenAI clients must use the ids ({agent.id} for this one)",
            err=True,
        )


@agents_group.command("show")
@click.argument("agent")
@click.option("--json", "as_json", is_flag=True)
def show_agent(agent: str, as_json: bool) -> None:
    rec = with_server(lambda s: s.agents.get(agent))
    print_json(rec.to_dict()) if as_json else _show(rec)


@agents_group.command("update")
@click.argument("agent")
@click.option("--name")
@click.option("--model")
@click.option("--system")
@click.option("--tool", "tools", multiple=True, help="NAME=allow|ask|deny (repeatable)")
@click.option("--param", "params", multiple=True, help="KEY=VALUE (repeatable); KEY= removes it")
@click.option("--json", "as_json", is_flag=True)
def update_agent(
    agent: str,
    name: str | None,
    model: str | None,
    system: str | None,
    tools: tuple[str, ...],
    params: tuple[str, ...],
    as_json: bool,
) -> None:
    async def go(s: Server) -> tuple[AgentRecord, list[AgentRecord]]:
        rec = await s.agents.update(
            agent, name=name, model=model, system=system, tools=parse_tool_policies(tools), params=parse_params(params)
        )
        return rec, await _namesakes(s, rec) if name is not None else []

    rec, namesakes = with_server(go)
    _note_namesakes(rec, namesakes)
    print_json(rec.to_dict()) if as_json else _show(rec)


@agents_group.command("delete")
@click.argument("agent")
@click.option("--json", "as_json", is_flag=True)
def delete_agent(agent: str, as_json: bool) -> None:
    rec = with_server(lambda s: s.agents.delete(agent))
    print_json({"deleted": rec.id, "name": rec.name}) if as_json else click.echo(f"deleted {rec.name} ({rec.id})")
