"""`appserver agents list|create|show|update|delete`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import click

from appserver.agent_admin import parse_params, parse_tool_policies
from appserver.cli.common import get_config, print_json, with_server
from appserver.cli.safetext import exact, visible
from appserver.config import Config
from appserver.errors import InvalidInput
from appserver.fsutil import CorruptStateFile
from appserver.server import Server
from appserver.store.records import AgentRecord
from cron.store import CronStoreError, CronTask, utcnow
from cron.stores import cron_store_for


def _tool_policies(specs: tuple[str, ...]) -> dict[str, str]:
    """The `--tool` options as policies; one tool given two different policies (`--tool
    shell=allow --tool shell=deny`) is refused (exit 2) rather than the last one silently winning."""
    policies = parse_tool_policies(specs)
    given: dict[str, str] = {}
    for spec in specs:
        name, _, policy = (part.strip() for part in spec.partition("="))
        if given.setdefault(name, policy) != policy:
            raise InvalidInput(
                f"conflicting --tool options for {name!r}: {given[name]} and {policy}; give one policy per tool",
                param="tool",
            )
    return policies


def _show(agent: AgentRecord) -> None:
    """Names, ids and settings as stored (any client of the server may have written them) are
    shown exactly. The system prompt keeps its lines and tabs, but its other controls are shown
    as escapes like every stored text: whoever wrote it, an ESC or OSC in it must not act on the
    terminal of the person who looks at the agent."""
    click.echo(f"{exact(agent.name)}  ({exact(agent.id)})")
    click.echo(f"  model:  {exact(agent.model)}")
    if agent.system:
        click.echo(f"  system: {visible(agent.system)}")
    if agent.tools:
        click.echo("  tools:  " + ", ".join(f"{exact(k)}={exact(v)}" for k, v in sorted(agent.tools.items())))
    if agent.params:
        click.echo("  params: " + ", ".join(f"{exact(k)}={exact(v)}" for k, v in sorted(agent.params.items())))


@click.group("agents")
def agents_group() -> None:
    """Manage agents."""


@agents_group.command("list")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def list_agents(as_json: bool) -> None:
    """List the agents: id, name and model."""
    agents = with_server(lambda s: s.store.list_agents())
    if as_json:
        print_json([a.to_dict() for a in agents])
        return
    for a in agents:
        click.echo(f"{exact(a.id)}  {exact(a.name):<20} {exact(a.model)}")


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
    """Create an agent: a model, a system prompt, tool policies and parameters."""

    async def go(s: Server) -> tuple[AgentRecord, list[AgentRecord]]:
        made = await s.agents.create(name, model, system, _tool_policies(tools), parse_params(params))
        return made, await _namesakes(s, made)

    agent, namesakes = with_server(go)
    _note_namesakes(agent, namesakes)
    print_json(agent.to_dict()) if as_json else _show(agent)


async def _namesakes(s: Server, agent: AgentRecord) -> list[AgentRecord]:
    return [a for a in await s.store.list_agents() if a.name == agent.name and a.id != agent.id]


def _note_namesakes(agent: AgentRecord, namesakes: list[AgentRecord]) -> None:
    """Allowed (DESIGN §5), but everything that named the agent by its name now gets an error: not
    only OpenAI clients (`model_ambiguous`) but this CLI too (`run`, `chat`, `cron add` and
    `conversations list` default to or take `--agent assistant`), so the warning names them."""
    if namesakes:
        ids = ", ".join(exact(a.id) for a in namesakes)
        name, agent_id = exact(agent.name), exact(agent.id)
        click.echo(
            f"warning: {ids} {'is' if len(namesakes) == 1 else 'are'} also named '{name}', so that name is "
            f"now ambiguous: --agent {name} (run, chat, cron, conversations) and the OpenAI model "
            f"'{name}' fail until you give an id instead ({agent_id} for this one) or rename one "
            f"(appserver agents update {agent_id} --name NEW)",
            err=True,
        )


@agents_group.command("show")
@click.argument("agent")
@click.option("--json", "as_json", is_flag=True)
def show_agent(agent: str, as_json: bool) -> None:
    """Show one agent (by id or name)."""
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
    """Change an agent; only the options given change (--tool and --param add to what it has)."""

    async def go(s: Server) -> tuple[AgentRecord, list[AgentRecord]]:
        rec = await s.agents.update(
            agent, name=name, model=model, system=system, tools=_tool_policies(tools), params=parse_params(params)
        )
        return rec, await _namesakes(s, rec) if name is not None else []

    rec, namesakes = with_server(go)
    _note_namesakes(rec, namesakes)
    print_json(rec.to_dict()) if as_json else _show(rec)


@dataclass(slots=True)
class _CronCleanup:
    """What deleting an agent did to its cron tasks: the ones disabled, or why they could not be
    checked (the agent stays deleted either way)."""

    disabled: list[CronTask] = field(default_factory=list)
    problem: str | None = None


def _disable_cron_tasks(config: Config, agent: AgentRecord) -> _CronCleanup:
    """Disable the deleted agent's tasks that would still fire (each fire would fail with "unknown
    agent" for ever, and an agent created again under the name gets a new id). They are kept, with
    the reason as their last error, so `cron show` still tells what they were. An unreadable
    crons.json is left in place (a reader's load): deleting an agent must not move it aside."""
    store = cron_store_for(config.home, config.store.url)
    try:
        with store.lock():
            state = store.load(readonly=True)
            now = utcnow()
            live = [t for t in state.tasks if t.agent == agent.id and t.enabled and t.next_fire_at is not None]
            for task in live:
                task.set_error(f"disabled: its agent {agent.name} ({agent.id}) was deleted", now)
                task.enabled = False
            if live:
                store.save(state)
            else:
                store.keep(state)
        return _CronCleanup(disabled=live)
    except (CronStoreError, CorruptStateFile, OSError) as exc:
        return _CronCleanup(problem=" ".join(str(exc).split()) or type(exc).__name__)
    finally:
        store.close()


def _cron_note(agent: AgentRecord, cleanup: _CronCleanup, *, as_json: bool) -> None:
    """One line naming the disabled tasks (stdout; --json carries them instead), or a warning
    (stderr) that they could not be checked."""
    if cleanup.problem is not None:
        click.echo(
            f"warning: the cron tasks of {exact(agent.name)} could not be checked ({visible(cleanup.problem)}); "
            "check them with appserver cron list: any left would fail with 'unknown agent'",
            err=True,
        )
    elif cleanup.disabled and not as_json:
        n = len(cleanup.disabled)
        names = ", ".join(f"{exact(t.name)} ({exact(t.id)})" for t in cleanup.disabled)  # crons.json's
        click.echo(f"disabled {n} cron task{'s' if n != 1 else ''} of {exact(agent.name)}: {names}")


@agents_group.command("delete")
@click.argument("agent")
@click.option("--json", "as_json", is_flag=True)
def delete_agent(agent: str, as_json: bool) -> None:
    """Delete an agent; its cron tasks are disabled (kept, with the reason) in the same command."""
    config = get_config()
    rec = with_server(lambda s: s.agents.delete(agent), config=config)
    cleanup = _disable_cron_tasks(config, rec)
    if as_json:
        out: dict[str, Any] = {
            "deleted": rec.id,
            "name": rec.name,
            "cron_tasks_disabled": [{"id": t.id, "name": t.name} for t in cleanup.disabled],
        }
        if cleanup.problem is not None:
            out["cron_tasks_unchecked"] = cleanup.problem
        print_json(out)
    else:
        click.echo(f"deleted {exact(rec.name)} ({exact(rec.id)})")
    _cron_note(rec, cleanup, as_json=as_json)
