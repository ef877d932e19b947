"""`appserver cron add|list|show|remove|enable|disable|run|logs|preview`: module-level commands.

Agents are resolved and named through an `AgentDirectory` found in the click context's `obj`; with
none (the real CLI) it is the store (`STORE_AGENTS`, imported lazily so these commands stay light).
`ANY_AGENT` accepts any name and shows ids as stored (tests, a home with no store). `run` needs the
kernel: its body lives in `cli/cron_run.py`, imported when it runs.

Readers (`list`, `show`, `logs`, `preview`) never move a corrupt crons.json aside: they say so and
exit 1; only commands that change tasks (and the scheduler) set it aside.
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, TypeVar

import click

from appserver.cli import safetext
from appserver.cli.common import MAX_COUNT, Count, echo_long, error_line, get_config, prepare_store_schema
from appserver.cli.safetext import exact, exact_id, visible
from appserver.config import Config, ConfigError
from appserver.fsutil import CorruptStateFile, StateFileRefused
from appserver.shown import shown
from cron.credentials import TokenCredentials
from cron.lease import LeaseHolder
from cron.runlog import ClaimsInHand, find_removed, open_runs, read_run_log
from cron.schedule import (
    ScheduleError,
    ScheduleSpec,
    due_time,
    get_zone,
    local_zone_name,
    next_occurrence,
    normalize_cron,
    parse_duration,
    shown_expr,
    upcoming,
)
from cron.store import (
    DEFAULT_MAX_LATENESS_S,
    CronFile,
    CronFileUnreadable,
    CronNotFound,
    CronRefused,
    CronStore,
    CronStoreError,
    CronTask,
    CronTaskInvalid,
    InvalidTask,
    OwnerRecord,
    make_task,
    plain_json,
    utcnow,
    validate_prompt,
)
from cron.stores import cron_store_for

F = TypeVar("F", bound=Callable[..., Any])

MAX_PREVIEW = 1000  # `preview --count`: each fire time is computed, not read

_USER_ERRORS = (
    CronStoreError,
    ScheduleError,
    CorruptStateFile,
    StateFileRefused,  # a FIFO, a device or a link to nothing where a state file should be
    ConfigError,
    LookupError,
    ValueError,
)


def _accept_any_agent(cfg: Config, agent: str) -> str:
    return agent


def _no_names(cfg: Config) -> dict[str, str]:
    return {}


def _accept_any_conversation(cfg: Config, agent_id: str, conversation: str) -> None:
    return None


@dataclass(frozen=True, slots=True)
class AgentDirectory:
    """How cron commands resolve `--agent` and name agents in their output. `resolve(config,
    agent)` returns the agent id to store or raises LookupError/ValueError with a user-facing
    message; `names(config)` maps agent ids to names; `conversation(config, agent_id, conv)`
    raises LookupError when `conv` (a conversation id, not new/default) is not that agent's."""

    resolve: Callable[[Config, str], str]
    names: Callable[[Config], dict[str, str]]
    conversation: Callable[[Config, str, str], None] = _accept_any_conversation


def _store_resolve(cfg: Config, agent: str) -> str:
    from appserver.cli.cron_run import validate_agent

    return validate_agent(cfg, agent)


def _store_names(cfg: Config) -> dict[str, str]:
    from appserver.cli.cron_run import agent_names

    return agent_names(cfg)


def _store_conversation(cfg: Config, agent_id: str, conversation: str) -> None:
    """A task whose conversation is gone or another agent's fails at every fire: refuse it now.
    Only the store is opened (the agent was resolved just before, so it exists)."""
    import asyncio

    from appserver.server import Server

    async def problem() -> str | None:
        store = Server(cfg).store
        await store.open()
        try:
            conv = await store.get_conversation(conversation)
            if conv is None:
                return f"unknown conversation {shown(conversation)}"
            if conv.agent_id == agent_id:
                return None
            owner, task_agent = await store.get_agent(conv.agent_id), await store.get_agent(agent_id)
            owner_name = owner.name if owner else conv.agent_id
            task_name = task_agent.name if task_agent else agent_id
            return f"conversation {shown(conversation)} belongs to agent {owner_name}, not to {task_name}"
        finally:
            await store.close()

    message = asyncio.run(problem())
    if message is not None:
        raise LookupError(message)


ANY_AGENT = AgentDirectory(_accept_any_agent, _no_names)
STORE_AGENTS = AgentDirectory(_store_resolve, _store_names, _store_conversation)


def _agents() -> AgentDirectory:
    return click.get_current_context().find_object(AgentDirectory) or STORE_AGENTS


def _check_agent(cfg: Config, agent: str) -> str:
    return _agents().resolve(cfg, agent)


def _is_agent(cfg: Config, agent: str) -> bool:
    try:
        _check_agent(cfg, agent)
    except (LookupError, ValueError):
        return False
    return True


def _names_of(cfg: Config) -> dict[str, str]:
    return _agents().names(cfg)


def _agent_filter(cfg: Config, agent: str | None) -> str | None:
    """`--agent` by name or id → the stored id (an agent since deleted: as given)."""
    if agent is None:
        return None
    try:
        return _check_agent(cfg, agent)
    except (LookupError, ValueError):
        return agent


MAX_RUN_TIMEOUT_S = 7 * 86400.0


class _OneLineError(click.ClickException):
    """`error: <one line>` and exit code 1, spelled like every other appserver command."""

    def show(self, file: Any = None) -> None:
        click.echo(error_line(self.format_message()), err=True)  # may quote crons.json or a server


class _NotFound(_OneLineError):
    """No task (or agent) by that id or name: exit code 2 in every cron command, as `agents show`
    and `conversations show` exit for an id they do not know."""

    exit_code = 2


class _UnknownTarget(_OneLineError):
    """A task aimed at something that does not exist (a conversation, a channel account): exit
    code 2, as for an unknown agent or conversation elsewhere in the CLI."""

    exit_code = 2


def _seconds(option: str, text: str, low: float, high: float) -> float:
    """A number of seconds given on the command line: `nan`, `inf`, `1e999` and values out of
    range are refused with one line (exit 1), never handed to a timer that overflows."""
    try:
        value = float(text)
    except ValueError:
        raise _OneLineError(f"{option} must be a number of seconds, got {shown(text)}") from None
    if not math.isfinite(value) or not low <= value <= high:
        raise _OneLineError(f"{option} must be a number of seconds from {low:g} to {high:g}, got {shown(text)}")
    return value


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _user_errors(fn: F) -> F:
    """Every known failure becomes `error: <one line>` and exit code 1 (2 for a task that does
    not exist), never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except CronNotFound as exc:
            raise _NotFound(_one_line(exc)) from None
        except _USER_ERRORS as exc:
            raise _OneLineError(_one_line(exc)) from None

    return wrapper  # type: ignore[return-value]


def _config() -> Config:
    return get_config()  # a config error: one line, exit 2, like every command


def _store(cfg: Config) -> CronStore:
    prepare_store_schema(cfg)  # a new PostgreSQL database: its tables first
    store = cron_store_for(cfg.home, cfg.store.url)
    for path in store.corrupt_files():
        click.echo(
            f"warning: {visible(str(path))} was set aside as unreadable; its tasks are not active "
            "(fix and move it back to crons.json, or delete it)",
            err=True,
        )
    return store


def _local(dt: datetime | None, tz: str) -> str:
    if dt is None:
        return "-"
    try:
        return dt.astimezone(get_zone(tz)).strftime("%Y-%m-%d %H:%M:%S %Z")
    except ScheduleError:
        return dt.isoformat()


def _schedule_text(t: CronTask) -> str:
    return _spec_text(t.schedule)


def _spec_text(s: ScheduleSpec) -> str:
    return f"{s.kind} {shown_expr(s.expr)}" + ("" if s.kind == "every" else f" [{s.tz}]")


def _owner(t: CronTask) -> str:
    """Who made the task, in words: the operator (`cron add`, no namespace), or the namespace of
    the conversation the `schedule` tool made it in (a credential's, or the tool's own marker)."""
    return "operator" if t.namespace is None else t.namespace


def _origin_chat(t: CronTask) -> str | None:
    """The chat a task the `schedule` tool made from a channel came from
    (`channel:account:chat[:thread]`, shown exactly), or None."""
    o = t.origin
    if o is None:
        return None
    return exact(":".join(o[k] for k in ("channel", "account", "chat", "thread") if k in o))


def _origin_sender(t: CronTask) -> str | None:
    """The sender who asked for the task in a chat, as `pairing approved` shows them (and `pairing
    revoke` takes them), or None when not known."""
    sender = (t.origin or {}).get("sender")
    return None if sender is None else exact_id(sender)


def _owner_cell(t: CronTask) -> str:
    """`cron list`'s OWNER: the namespace, and for a task made from a chat that chat and its sender
    (the gateway's one namespace or the tool's unowned marker alone names neither)."""
    chat = _origin_chat(t)
    if chat is None:
        return exact(_owner(t))
    sender = _origin_sender(t)
    return f"{exact(_owner(t))}, chat {chat}" + (f", sender {sender}" if sender is not None else "")


def task_problem(t: CronTask) -> str | None:
    """Why a task crons.json holds cannot run, else None. `add` and the `schedule` tool never
    make such a task (make_task refuses it), but a hand edit or another version can: an empty
    name, agent or prompt, a prompt that is no text, or a schedule the scheduler cannot compute
    (the check is its own: `next_occurrence`, which fails such a task when it comes due)."""
    for key in ("name", "agent", "prompt"):
        if not getattr(t, key).strip():
            return f"its {key} is empty"
    try:
        validate_prompt(t.prompt)
    except ScheduleError as exc:
        return str(exc)
    try:
        next_occurrence(t.schedule, utcnow(), t.created_at)
    except ScheduleError as exc:
        return f"invalid schedule: {exc}"
    return None


def _state(t: CronTask, problem: str | None) -> str:
    return "invalid" if problem is not None else t.state


def _named(t: CronTask) -> str:
    """A task in a line: its name (when it has one) and id, exactly."""
    return f"{exact(t.name)} ({exact(t.id)})" if t.name.strip() else exact(t.id)


def _refuse_invalid(t: CronTask, doing: str) -> None:
    """`run` and `enable` of a task that cannot run: one line naming it and why (exit 1), before
    anything is claimed or written, instead of a run that fails or a task enabled to fail."""
    problem = task_problem(t)
    if problem is not None:
        raise _OneLineError(
            f"cron task {_named(t)} is invalid and cannot {doing}: {problem}; "
            f"remove it (appserver cron remove {exact(t.id)}) and add it again"
        )


def _raw_text(value: Any) -> str:
    """A value of an invalid task as text: a string as it is, anything else as its JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, allow_nan=True)


def _raw_field(bad: InvalidTask, key: str) -> str:
    """A field of an invalid task, exactly (`-` when it has none)."""
    return exact(_raw_text(bad.raw[key])) if key in bad.raw else "-"


def _raw_schedule(bad: InvalidTask) -> str:
    """An invalid task's schedule as `list` shows a schedule, or exactly as stored."""
    sched = bad.raw.get("schedule")
    try:
        return (
            exact(_spec_text(ScheduleSpec.from_dict(sched))) if isinstance(sched, dict) else _raw_field(bad, "schedule")
        )
    except ValueError:
        return _raw_field(bad, "schedule")


def _raw_agent(bad: InvalidTask, names: dict[str, str]) -> str:
    agent = bad.raw.get("agent")
    return exact(names[agent]) if isinstance(agent, str) and agent in names else _raw_field(bad, "agent")


def _raw_owner(bad: InvalidTask) -> str:
    namespace = bad.raw.get("namespace")
    return "operator" if namespace is None else exact(_raw_text(namespace))


def _invalid_json(bad: InvalidTask, names: dict[str, str]) -> dict[str, Any]:
    """An invalid task as `--json` gives it: its fields as stored (NaN and the infinities as
    strings, which JSON has no other way to say), with `state` invalid and the `problem`."""
    out = {**plain_json(bad.raw), "state": "invalid", "problem": bad.reason}
    out.setdefault("namespace", None)
    out["owner"] = "operator" if bad.raw.get("namespace") is None else _raw_text(bad.raw["namespace"])
    agent = bad.raw.get("agent")
    if isinstance(agent, str) and agent in names:
        out["agent_name"] = names[agent]
    return out


def _invalid_row(bad: InvalidTask, names: dict[str, str]) -> list[str]:
    """An invalid task's line of `cron list`: what it holds, exactly, and why it cannot run."""
    return [
        exact(bad.id),
        _raw_field(bad, "name"),
        _raw_agent(bad, names),
        _raw_owner(bad),
        _raw_schedule(bad),
        "-",
        "invalid",
        _raw_field(bad, "occurrence") if "occurrence" in bad.raw else "0",
        exact(bad.reason[:60]),
    ]


def _show_invalid(bad: InvalidTask, names: dict[str, str], as_json: bool) -> None:
    """`cron show` of a task kept in crons.json that cannot be used: what it holds, and why."""
    if as_json:
        click.echo(json.dumps(_invalid_json(bad, names)))
        return
    fields = [
        ("id", exact(bad.id)),
        ("name", _raw_field(bad, "name")),
        ("agent", _raw_agent(bad, names)),
        ("owner", _raw_owner(bad)),
        ("schedule", _raw_schedule(bad)),
        ("state", "invalid"),
        ("problem", visible(bad.reason)),
        ("enabled", _raw_field(bad, "enabled")),
        ("runs", _raw_field(bad, "occurrence")),
        ("prompt", visible(_raw_text(bad.raw.get("prompt", "-")))),
    ]
    width = max(len(k) for k, _ in fields)
    for k, v in fields:
        click.echo(f"{k.ljust(width)}  {v}")
    click.echo(f"fix it in crons.json, or remove it: appserver cron remove {exact(bad.id)}")


def _task_json(t: CronTask, names: dict[str, str] | None = None) -> dict[str, Any]:
    problem = task_problem(t)
    out = {
        **t.to_dict(),
        "namespace": t.namespace,
        "origin": t.origin,
        "owner": _owner(t),
        "state": _state(t, problem),
    }
    if problem is not None:
        out["problem"] = problem
    if names and t.agent in names:
        out["agent_name"] = names[t.agent]
    return out


def _fire_line(due: datetime, nominal: datetime, tz: str) -> str:
    """A fire time as `add`, `list` and `preview` all show it: when it fires (jitter applied),
    with the nominal time it stands for when they differ."""
    text = _local(due, tz)
    jitter = (due - nominal).total_seconds()
    if jitter:
        text += f"  (scheduled for {_local(nominal, tz)}, jitter {jitter:+.1f} s)"
    return text


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def _spec_from_options(
    cron_expr: str | None, every: str | None, at: str | None, in_: str | None, tz: str | None
) -> ScheduleSpec:
    given = [(k, v) for k, v in (("cron", cron_expr), ("every", every), ("at", at), ("in", in_)) if v is not None]
    if len(given) != 1:
        raise click.UsageError("give exactly one of --cron, --every, --at, --in")
    kind, expr = given[0]
    zone = local_zone_name() if tz is None else tz  # `--tz ""` (an unset variable) is an error, not the default
    get_zone(zone)
    if kind == "cron":
        expr = normalize_cron(expr)
    return ScheduleSpec(kind, expr.strip(), zone)


@click.group("cron")
def cron_group() -> None:
    """Schedule agent prompts: cron expressions, intervals and one-shot reminders."""


@cron_group.command("add")
@click.option("--name", required=True, help="Task name, unique per agent.")
@click.option("--agent", required=True, help="Agent that runs the prompt.")
@click.option("--cron", "cron_expr", default=None, help="5-field cron expression, e.g. '0 8 * * 1-5'.")
@click.option(
    "--tz",
    default=None,
    help="IANA timezone for --cron/--at (default: this machine's, from TZ or /etc/localtime; a TZ that names "
    "no IANA zone, such as a POSIX rule, is refused: give --tz).",
)
@click.option("--every", default=None, help="Fixed interval, e.g. 30m, 2h, 1d.")
@click.option("--at", default=None, help="One-shot wall time 'YYYY-MM-DD HH:MM' in --tz.")
@click.option("--in", "in_", default=None, help="One-shot after a delay, e.g. 2h.")
@click.option("--prompt", required=True, help="What the agent is asked to do.")
@click.option(
    "--conversation",
    default="new",
    show_default=True,
    help="new, default, or the id of an existing conversation of the agent.",
)
@click.option(
    "--misfire",
    type=click.Choice(["skip", "run_once", "run_all"]),
    default="skip",
    show_default=True,
    help="What to do with occurrences missed while the server was down.",
)
@click.option(
    "--max-lateness",
    default=None,
    help=f"How late a run may start before it counts as missed (default {DEFAULT_MAX_LATENESS_S:g}s; "
    "a run started within 2s of its due time is on time, so 0s means never late).",
)
@click.option("--exact", is_flag=True, help="No jitter: fire exactly at the scheduled second.")
@click.option(
    "--deliver",
    default=None,
    help="Send the run's final reply to channel:account:chat[:thread] through the channel gateway "
    "(a configured channel account).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the new task as JSON.")
@_user_errors
def add_cmd(
    name: str,
    agent: str,
    cron_expr: str | None,
    tz: str | None,
    every: str | None,
    at: str | None,
    in_: str | None,
    prompt: str,
    conversation: str,
    misfire: str,
    max_lateness: str | None,
    exact: bool,
    deliver: str | None,
    as_json: bool,
) -> None:
    """Add a task. Everything is validated first; a refused task writes nothing."""
    spec = _spec_from_options(cron_expr, every, at, in_, tz)
    lateness = (
        DEFAULT_MAX_LATENESS_S
        if max_lateness is None
        else parse_duration(max_lateness, allow_zero=True).total_seconds()
    )
    cfg = _config()
    try:
        agent_id = _check_agent(cfg, agent)
    except LookupError as exc:  # an unknown (or ambiguous) agent: exit 2, as `agents show` says it
        raise _NotFound(_one_line(exc)) from None
    task = make_task(
        name=name,
        agent=agent_id,
        schedule=spec,
        prompt=prompt,
        now=utcnow(),
        conversation=conversation,
        misfire=misfire,
        max_lateness_s=lateness,
        exact=exact,
        deliver=deliver,
    )
    _check_targets(cfg, task)
    store = _store(cfg)
    try:
        store.add(task)
    except CronRefused:  # (without caps, `add` refuses only a name in use) said by the agent's name, not id
        # nothing read again: after a lock timeout that would wait for the lock a second time
        raise _OneLineError(f"agent {shown(agent)} already has a cron task named {shown(name)}") from None
    names = _names_of(cfg)
    if not cfg.cron.enabled:
        click.echo(
            "note: the scheduler is off here (APPSERVER_DISABLE_CRON=1 or [cron] enabled = false)",
            err=True,
        )
    if as_json:
        click.echo(json.dumps(_task_json(task, names)))
    else:
        nxt = (
            "-"
            if task.next_due_at is None or task.next_fire_at is None
            else _fire_line(task.next_due_at, task.next_fire_at, task.schedule.tz)
        )
        plain = safetext.exact  # `exact` is the --exact flag here
        agent_name = plain(names.get(task.agent, task.agent))
        click.echo(f"added cron task {plain(task.name)} ({plain(task.id)}) for agent {agent_name}; next run {nxt}")


def _check_targets(cfg: Config, task: CronTask) -> None:
    """What `make_task` cannot see: the conversation and the delivery account must exist now,
    else every fire would fail. Refused with exit code 2 before anything is written."""
    if task.conversation not in ("new", "default"):
        try:
            _agents().conversation(cfg, task.agent, task.conversation)
        except LookupError as exc:
            raise _UnknownTarget(f"--conversation: {_one_line(exc)}") from None
    if task.deliver is not None:
        _check_deliver(cfg, task.deliver)


def _check_deliver(cfg: Config, target: str) -> None:
    """The target's channel account must be configured ([channels.C.accounts.A]); one of a
    channel that is configured but not enabled is kept, with a note (it can be enabled later)."""
    channel, account, _ = target.split(":", 2)  # the format was checked by make_task
    accounts = cfg.channels.accounts.get(channel, {})
    if account not in accounts:
        known = ", ".join(f"{c}:{a}" for c, named in sorted(cfg.channels.accounts.items()) for a in sorted(named))
        raise _UnknownTarget(
            f"--deliver {shown(target)}: no channel account {channel}:{account} is configured "
            f"([channels.{channel}.accounts.{account}] in config.toml); "
            + (f"configured: {known}" if known else "none is configured")
        )
    if channel not in cfg.channels.enabled:
        click.echo(
            f"note: channel {channel!r} is not enabled, so deliveries fail until it is: "
            f"appserver channels enable {channel}",
            err=True,
        )


@cron_group.command("list")
@click.option("--agent", default=None, help="Only this agent's tasks.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array.")
@_user_errors
def list_cmd(agent: str | None, as_json: bool) -> None:
    """List tasks with their next run (jitter applied) and state."""
    cfg = _config()
    state = _store(cfg).read()
    agent_id = _agent_filter(cfg, agent)
    tasks = [t for t in state.tasks if agent_id is None or t.agent == agent_id]
    invalid = [bad for bad in state.invalid if bad.of_agent(agent_id)]
    if agent is not None and not tasks and not invalid and not _is_agent(cfg, agent):
        raise _NotFound(f"no agent {exact(agent)}, and no cron task of an agent by that id")  # a typo, not "none"
    for bad in invalid:
        click.echo(f"warning: cron task {exact(bad.id)} is invalid and not scheduled: {visible(bad.reason)}", err=True)
    problems = {t.id: task_problem(t) for t in tasks}
    for t in tasks:
        if problems[t.id] is not None:
            click.echo(
                f"warning: cron task {_named(t)} is invalid and cannot run: {visible(problems[t.id])}",
                err=True,
            )
    names = _names_of(cfg) if tasks or invalid else {}
    if as_json:
        echo_long(json.dumps([_task_json(t, names) for t in tasks] + [_invalid_json(bad, names) for bad in invalid]))
        return
    if not tasks and not invalid:
        click.echo("no cron tasks")
        return
    rows = [["ID", "NAME", "AGENT", "OWNER", "SCHEDULE", "NEXT RUN", "STATE", "RUNS", "LAST ERROR"]]
    now = utcnow()
    for t in tasks:  # each cell one line, exactly as stored (crons.json is the schedule tool's too)
        rows.append(
            [
                exact(t.id),
                exact(t.name),
                exact(names.get(t.agent, t.agent)),
                _owner_cell(t),
                exact(_schedule_text(t)),
                _next_run(t, now),
                _state(t, problems[t.id]),
                str(t.occurrence),
                exact((problems[t.id] or t.last_error or "")[:60]),
            ]
        )
    rows += [_invalid_row(bad, names) for bad in invalid]  # kept in crons.json, never scheduled
    click.echo(_table(rows))


def _next_run(task: CronTask, now: datetime) -> str:
    """The next run as `list` shows it; one already past came due while no scheduler ran (a
    running one fires on time), and `preview` says what the misfire policy will do with it."""
    if not task.enabled:
        return "-"
    text = _local(task.next_due_at, task.schedule.tz)
    overdue = task.next_due_at is not None and now - task.next_due_at > timedelta(seconds=OVERDUE_AFTER_S)
    return text + " (overdue)" if overdue else text


OVERDUE_AFTER_S = 2.0  # a running scheduler starts a run within this of its due time


@cron_group.command("show")
@click.argument("ref")
@click.option("--agent", default=None, help="Disambiguate a name used by several agents.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object.")
@_user_errors
def show_cmd(ref: str, agent: str | None, as_json: bool) -> None:
    """Show one task (by id or name)."""
    cfg = _config()
    try:
        task = _store(cfg).read().find(ref, _agent_filter(cfg, agent))
    except CronTaskInvalid as exc:
        _show_invalid(exc.entry, _names_of(cfg), as_json)
        return
    names = _names_of(cfg)
    if as_json:
        click.echo(json.dumps(_task_json(task, names)))
        return
    tz = task.schedule.tz
    problem = task_problem(task)
    agent_text = f"{names[task.agent]} ({task.agent})" if task.agent in names else task.agent
    # crons.json is also written by the agent's schedule tool: names, ids and targets are shown
    # exactly, the prompt and the error as text, and no value can act on the terminal.
    fields = [
        ("id", exact(task.id)),
        ("name", exact(task.name)),
        ("agent", exact(agent_text)),
        ("owner", exact(_owner(task))),
        *([("from chat", _origin_chat(task) or "-")] if task.origin is not None else []),
        *([("from sender", _origin_sender(task) or "- (not known)")] if task.origin is not None else []),
        ("schedule", exact(_schedule_text(task))),
        ("state", _state(task, problem)),
        *([("problem", visible(problem))] if problem is not None else []),
        ("next scheduled", _local(task.next_fire_at, tz)),
        ("next run (with jitter)", _next_run(task, utcnow()) if task.enabled else _local(task.next_due_at, tz)),
        ("conversation", exact(task.conversation)),
        ("misfire", f"{task.misfire} (max lateness {task.max_lateness_s:g}s)"),
        ("exact", "yes" if task.exact else "no"),
        ("deliver", exact(task.deliver or "-")),
        ("runs", str(task.occurrence)),
        ("last error", visible(task.last_error or "-")),
        ("created", _local(task.created_at, tz)),
        ("prompt", visible(task.prompt)),
    ]
    width = max(len(k) for k, _ in fields)
    for k, v in fields:
        click.echo(f"{k.ljust(width)}  {v}")


def _toggle(cfg: Config, store: CronStore, ref: str, agent: str | None, enabled: bool) -> CronTask:
    which = _agent_filter(cfg, agent)
    if enabled:
        task = _read_to_change(store).find(ref, which)
        _refuse_invalid(task, "be enabled")
        _check_task_agent(cfg, task)
    return store.set_enabled(ref, enabled, agent=which, scheduler_alive=_scheduler_alive(store))


def _scheduler_alive(store: CronStore) -> Callable[[OwnerRecord], bool]:
    """Whether the lease's holder may still run, judged as a scheduler judges it: `remove` and
    `disable` cancel the waiting runs of a scheduler that stopped, never those of a running one
    (it cancels them itself), and `logs` tells the runs it has in hand from the ones nobody has."""
    return LeaseHolder(store, started_at=utcnow()).alive


def _read_to_change(store: CronStore) -> CronFile:
    """The tasks, read by a command about to change them. `enable` checks the task's agent before
    it writes; that look must treat an unparseable crons.json as every command that changes tasks
    does (add, remove, disable): set it aside loudly (CorruptStateFile: exit 1, naming where it
    went), not leave it in place with a reader's message that promises the opposite."""
    try:
        return store.read()
    except CronFileUnreadable:
        with store.lock():
            return store.load()  # a writer's load: moves the file aside and raises CorruptStateFile


def _check_task_agent(cfg: Config, task: CronTask) -> None:
    """A task whose agent was deleted cannot run: refused (exit 2) before anything is claimed or
    enabled, rather than left to use up a run number and fail at the fire."""
    try:
        _check_agent(cfg, task.agent)
    except LookupError:
        raise _NotFound(
            f"task {task.name!r} ({task.id}) cannot run: its agent {task.agent} was deleted; remove the task "
            f"(appserver cron remove {task.id}) or add a new one for an existing agent"
        ) from None


@_user_errors
def _runnable(task: str, agent: str | None) -> None:
    """`cron run`'s checks before it runs anything (an unknown task, a deleted agent, the revoked
    token of a task the `schedule` tool made: exit 2)."""
    cfg = _config()
    found = _store(cfg).read().find(task, _agent_filter(cfg, agent))
    _refuse_invalid(found, "run")
    _check_task_agent(cfg, found)
    if found.namespace is not None:
        credentials = TokenCredentials.for_home(cfg.home, cfg.store.url)
        try:
            gone = credentials(found.namespace, found.agent, _names_of(cfg).get(found.agent))
        finally:
            credentials.close()
        if gone is not None:
            raise _NotFound(f"task {found.name!r} ({found.id}) cannot run: {gone}")


@cron_group.command("enable")
@click.argument("ref")
@click.option("--agent", default=None)
@_user_errors
def enable_cmd(ref: str, agent: str | None) -> None:
    """Enable a task; a recurring one resumes from now (no catch-up for the disabled period)."""
    cfg = _config()
    t = _toggle(cfg, _store(cfg), ref, agent, True)
    click.echo(f"enabled {exact(t.name)} ({exact(t.id)}); next run {_local(t.next_due_at, t.schedule.tz)}")


@cron_group.command("disable")
@click.argument("ref")
@click.option("--agent", default=None)
@_user_errors
def disable_cmd(ref: str, agent: str | None) -> None:
    """Disable a task without removing it (its queued run is dropped before this says done)."""
    cfg = _config()
    store = _store(cfg)
    t = _toggle(cfg, store, ref, agent, False)
    _say_done(cfg, store, f"disabled {exact(t.name)} ({exact(t.id)})", t.id)


@cron_group.command("remove")
@click.argument("ref")
@click.option("--agent", default=None)
@_user_errors
def remove_cmd(ref: str, agent: str | None) -> None:
    """Remove a task, an invalid one too (its run log stays in cron-runs/; its queued run is
    dropped before this says done)."""
    cfg = _config()
    store = _store(cfg)
    t = store.remove_any(ref, _agent_filter(cfg, agent), scheduler_alive=_scheduler_alive(store))
    if isinstance(t, InvalidTask):
        click.echo(f"removed the invalid task {_raw_field(t, 'name')} ({exact(t.id)})")
        return
    _say_done(
        cfg,
        store,
        f"removed {exact(t.name)} ({exact(t.id)}); its run log stays 30 days: appserver cron logs {exact(t.id)}",
        t.id,
    )


# How long `remove`/`disable` wait for the running scheduler to drop the task's queued run (it
# looks for changes of crons.json every 0.25 s and drops the run right away), and how often they look
DROP_WAIT_S = 15.0
DROP_POLL_S = 0.05


def _say_done(cfg: Config, store: CronStore, done: str, task_id: str) -> None:
    """Say `done` once the task's runs queued in a running server are dropped (or found started:
    a started run finishes): a reply answered right after the command, which lets the queue move
    on, must not start a run the command said it stopped. A run still queued after DROP_WAIT_S is
    an error (exit 1): the change is saved, but the run may still start."""
    runs = _runs_in_hand(store, task_id)
    dropped, started, queued = _await_drops(cfg, runs) if runs else ([], [], [])
    click.echo(done)
    for number in dropped:
        click.echo(f"its queued run #{number} was dropped: not started")
    for number in started:
        click.echo(f"its run #{number} had already started: it finishes")
    if queued:
        shown_runs = ", ".join(f"#{n} (turn {turn_id})" for n, turn_id in queued)
        raise _OneLineError(
            f"the server did not drop the queued run {shown_runs} within {DROP_WAIT_S:g} s: it may still start "
            f"(see appserver cron logs {task_id})"
        )


def disable_sender_tasks(cfg: Config, accounts: set[str], sender: str) -> tuple[list[CronTask], str | None]:
    """`pairing revoke`'s hold on the cron tasks: disable, in one write, every task the `schedule`
    tool made from a chat of `accounts` (`channel:account`) at `sender`'s request (its `origin`),
    as `cron disable` does (kept, so `cron enable` resumes one; a run waiting for a scheduler that
    stopped is cancelled), and record the revoke there (`CronStore.revoke_sender`), so a turn of
    theirs that began before it and runs on schedules nothing after it. (The tasks disabled; why
    they could not be, or None): a failure is said after the revoke, which stands, by
    `say_sender_tasks_disabled`."""
    try:
        store = cron_store_for(cfg.home, cfg.store.url)
        prepare_store_schema(cfg)
        wanted = [(channel, account) for channel, _, account in (a.partition(":") for a in sorted(accounts))]
        try:
            picked = store.revoke_sender(wanted, sender, scheduler_alive=_scheduler_alive(store))
        finally:
            store.close()
    except (CronStoreError, CorruptStateFile, StateFileRefused, OSError) as exc:
        return [], _one_line(exc)
    return picked, None


def say_sender_tasks_disabled(cfg: Config, tasks: list[CronTask], sender: str, problem: str | None) -> None:
    """Say which of `sender`'s tasks `disable_sender_tasks` disabled, each once its queued run is
    dropped (as `cron disable` says it: `_say_done`), then why the others could not be, if so
    (one line, exit 1: the sender's tasks then run until disabled by hand)."""
    if tasks:
        count = f"{len(tasks)} cron task{'s' if len(tasks) != 1 else ''}"
        kept = "kept: appserver cron enable ID runs one again"
        click.echo(f"Disabled {count} {exact_id(sender)} scheduled from a chat ({kept}):")
        store = cron_store_for(cfg.home, cfg.store.url)
        try:
            for t in tasks:
                _say_done(cfg, store, f"  disabled {_named(t)} from {_origin_chat(t)}", t.id)
        finally:
            store.close()
    if problem is not None:
        raise _OneLineError(
            f"the pairing is revoked, but the cron tasks {exact_id(sender)} scheduled from a chat could not be "
            f"disabled ({problem}): they still run; see appserver cron list, and disable them there"
        )


def _runs_in_hand(store: CronStore, task_id: str) -> list[tuple[int, str]]:
    """The task's submitted runs without an outcome, while a live scheduler holds the lease: it
    drops the queued ones as soon as it sees the change (`Scheduler._withdraw_runs`). None while
    no scheduler runs: the server that starts next drops them as it starts
    (`CronService.recover_outcomes`), before any queue moves."""
    try:
        owner = store.read().scheduler_owner
        if owner is None or not _scheduler_alive(store)(owner):
            return []
        return open_runs(store.runs_dir, task_id)
    except (CronStoreError, CorruptStateFile, OSError, ValueError):
        return []  # the change is saved; the scheduler drops the run as it reads the tasks


def _await_drops(cfg: Config, runs: list[tuple[int, str]]) -> tuple[list[int], list[int], list[tuple[int, str]]]:
    """Watch the runs' turns in the server's store until each is dropped or started, at most
    DROP_WAIT_S: (dropped, started, still queued)."""
    import asyncio

    from appserver.store.select import make_store

    async def watch() -> tuple[list[int], list[int], list[tuple[int, str]]]:
        store = make_store(cfg)
        await store.open()
        try:
            dropped: list[int] = []
            started: list[int] = []
            left = list(runs)
            deadline = time.monotonic() + DROP_WAIT_S
            while True:
                waiting = []
                for number, turn_id in left:
                    turn = await store.get_turn(turn_id)
                    if turn is not None and turn.status == "queued" and turn.started_at is None:
                        waiting.append((number, turn_id))
                    elif turn is not None and turn.started_at is not None:
                        started.append(number)
                    elif turn is not None:
                        dropped.append(number)
                left = waiting
                if not left or time.monotonic() >= deadline:
                    return dropped, started, left
                await asyncio.sleep(DROP_POLL_S)
        finally:
            await store.close()

    return asyncio.run(watch())


@cron_group.command("run")
@click.argument("task")
@click.option("--agent", default=None, help="Agent of the task, when names repeat across agents.")
@click.option("--timeout", default="600", show_default=True, help="Seconds to wait for the turn (up to 7 days).")
@click.option(
    "--reconnect-wait",
    default="30",
    show_default=True,
    help="Through a server: seconds to wait for it (or a standby taking over) after the connection drops (0: do "
    "not wait), as `appserver run` waits.",
)
@click.option("--json", "as_json", is_flag=True)
def run_cmd(task: str, agent: str | None, timeout: str, reconnect_wait: str, as_json: bool) -> None:
    """Run TASK now (works without the scheduler lease; through the server when one runs). Exit 0
    when its turn completed (or waits for an approval), else 1: also for `unknown`, a run that
    started but whose outcome was not seen (--timeout passed, or the server was lost for longer
    than --reconnect-wait); `cron logs` shows its outcome later, and running it again is a second run.
    A disabled task runs once too, also when its run has to wait in the queue (a `cron disable`
    after this, or a `cron remove`, drops the run while it waits)."""
    from appserver.cli.cron_run import run_now

    seconds = _seconds("--timeout", timeout, 0.001, MAX_RUN_TIMEOUT_S)
    reconnect_s = _seconds("--reconnect-wait", reconnect_wait, 0, MAX_RUN_TIMEOUT_S)
    _runnable(task, agent)
    run_now(task, agent, seconds, as_json, reconnect_s)


@cron_group.command("logs")
@click.argument("ref")
@click.option("--agent", default=None)
@click.option(
    "--limit", type=Count(), default=50, show_default=True, help=f"Only the last N records, 1 to {MAX_COUNT}."
)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array of run-log records.")
@_user_errors
def logs_cmd(ref: str, agent: str | None, limit: int, as_json: bool) -> None:
    """Show the run log: fires, submissions, outcomes, deliveries, misses and errors. A removed task's
    log is kept 30 days (cron-runs/<task id>.jsonl) and found by its id or name."""
    cfg = _config()
    store = _store(cfg)
    agent_id = _agent_filter(cfg, agent)
    state = store.read()  # (before the run log: a run claimed after this is not judged)
    found_task: CronTask | None = None
    try:
        found_task = task = state.find(ref, agent_id)
        task_id, name, tz = task.id, task.name, task.schedule.tz
    except CronTaskInvalid as exc:  # its log is still its history
        task_id, name, tz = exc.entry.id, _raw_text(exc.entry.raw.get("name", exc.entry.id)), "UTC"
    except CronNotFound:
        task_id, name, tz = _removed_task(store, ref, agent_id)
        click.echo(f"note: task {exact(name)} ({exact(task_id)}) was removed; its run log is kept 30 days", err=True)
    claims = _claims_in_hand(store, state, found_task)
    found = read_run_log(store.runs_dir, task_id, limit=limit, claims=claims)
    problem = found.problem()
    if found.unusable:  # a log nothing could be read from is an unknown history, never "no runs"
        raise _OneLineError(str(problem))
    if problem is not None:  # some lines lost: said once, the readable records still shown
        click.echo(f"warning: {visible(problem)}", err=True)
    if found.skipped:  # a log too large to read whole: its newest records are what is shown
        click.echo(
            f"note: {visible(str(found.path))} is large; its first {found.skipped} bytes were not read", err=True
        )
    records = found.records
    if as_json:
        echo_long(json.dumps(records))
        return
    if not records:
        click.echo(f"no runs yet for {exact(name)}")
        return
    for r in records:
        click.echo(_log_line(r, tz))


def _claims_in_hand(store: CronStore, state: CronFile, task: CronTask | None) -> ClaimsInHand:
    """What the tasks say of `task`'s claimed runs (None: a removed or invalid task, whose claims
    they no longer hold) and which scheduler runs now, judged as a scheduler judges the lease's
    holder: a run waiting for its turn in a live `run_all` catch-up is queued, not lost."""
    owner = state.scheduler_owner
    live = owner.token if owner is not None and _scheduler_alive(store)(owner) else None
    if task is None:
        return ClaimsInHand(live, {}, None)
    open_claims: dict[int, str | None] = {}
    for claim in task.claim_records():
        number, by = claim.get("occurrence"), claim.get("by")
        if isinstance(number, int) and not isinstance(number, bool) and claim.get("progress") != "done":
            open_claims[number] = by if isinstance(by, str) else None
    return ClaimsInHand(live, open_claims, task.occurrence)


@cron_group.command("preview")
@click.argument("ref")
@click.option("--agent", default=None)
@click.option(
    "--count", type=Count(MAX_PREVIEW), default=5, show_default=True, help=f"How many fire times, 1 to {MAX_PREVIEW}."
)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array.")
@_user_errors
def preview_cmd(ref: str, agent: str | None, count: int, as_json: bool) -> None:
    """The next fire times in the task's timezone: when each fires (jitter applied, as `add`
    and `list` show it) and, when different, the scheduled time it stands for. Times that came
    due while no scheduler ran are shown as the task's misfire policy will treat them: the ones
    that still run, marked overdue, and a count of those that will be recorded as missed."""
    cfg = _config()
    task = _store(cfg).read().find(ref, _agent_filter(cfg, agent))
    now = utcnow()
    start = min(now, task.next_fire_at) if task.next_fire_at else now
    overdue, scanned_all = _overdue(task, start, now)
    if not scanned_all:  # a dense schedule long overdue: the policy looks only at the recent end
        recent = max(overdue[-1], now - timedelta(seconds=max(task.max_lateness_s, RECENT_S)))
        tail, _ = _overdue(task, recent, now)
        overdue = overdue[:1] + tail  # the first for "since when"
    runs, missed = _misfired(task, overdue, now)
    after = overdue[-1] if overdue else start - _EPS
    times = runs + upcoming(task.schedule, after, task.created_at, count)
    fires = [(nominal, _due(task, nominal), nominal in runs) for nominal in times]
    if as_json:
        out = [{"scheduled_for": n.isoformat(), "fires_at": d.isoformat(), "overdue": o} for n, d, o in fires]
        click.echo(json.dumps(out))
        return
    if missed:
        more = "" if scanned_all else " or more"
        click.echo(
            f"{missed}{more} past fire time(s) since {_local(overdue[0], task.schedule.tz)} came due while no "
            f"scheduler ran: a server records them as missed (misfire={task.misfire})"
        )
    if not fires:
        click.echo(f"{exact(task.name)} has no upcoming runs")
    for nominal, due, late in fires:
        mark = "  (overdue: fires as soon as a server runs it)" if late else ""
        click.echo(_fire_line(due, nominal, task.schedule.tz) + mark)


OVERDUE_SCAN = 10_000  # past fire times `preview` counts (a 1 s task down for hours has more)
RECENT_S = 3600.0  # beyond that count, the last hour is what the misfire policy is shown for


def _due(task: CronTask, nominal: datetime) -> datetime:
    return due_time(task.schedule, nominal, task_id=task.id, created_at=task.created_at, exact=task.exact)


def _overdue(task: CronTask, start: datetime, now: datetime) -> tuple[list[datetime], bool]:
    """Nominal fire times from `start` whose due time has passed (oldest first), at most
    OVERDUE_SCAN of them; and whether that is all of them."""
    found: list[datetime] = []
    cur = start - _EPS
    while len(found) < OVERDUE_SCAN:
        nominal = next_occurrence(task.schedule, cur, task.created_at)
        if nominal is None or _due(task, nominal) > now:
            return found, True
        found.append(nominal)
        cur = nominal
    return found, False


def _misfired(task: CronTask, overdue: list[datetime], now: datetime) -> tuple[list[datetime], int]:
    """What the scheduler's misfire policy does with `overdue` when it next ticks: the nominal
    times it still runs, and how many it records as missed."""
    from cron.scheduler import apply_misfire  # the scheduler's own rule; imported only here

    pairs = [(nominal, _due(task, nominal)) for nominal in overdue]
    runs, missed = apply_misfire(task.misfire, pairs, now, timedelta(seconds=task.max_lateness_s))
    return [nominal for nominal, _, _ in runs], len(missed)


_EPS = timedelta(microseconds=1)


def _removed_task(store: CronStore, ref: str, agent: str | None) -> tuple[str, str, str]:
    """(id, name, timezone) of a removed task whose run log was kept, by id or name."""
    found = [t for t in find_removed(store.runs_dir, ref) if agent is None or t.get("agent") in (None, agent)]
    ids = sorted({str(t.get("id")) for t in found})
    if not found:
        raise CronNotFound(f"no cron task {shown(ref)}, and no run log of a removed task by that name")
    if len(ids) > 1:
        raise CronStoreError(f"several removed tasks were named {shown(ref)} ({', '.join(ids)}); give the task id")
    task = found[-1]
    schedule = task.get("schedule")
    tz = schedule.get("tz") if isinstance(schedule, dict) else None
    return ids[0], str(task.get("name", ref)), tz if isinstance(tz, str) else "UTC"


def _recovered(record: dict[str, Any]) -> str:
    return " (recovered: claimed by a scheduler that stopped)" if record.get("recovered") else ""


def _pending(record: dict[str, Any]) -> str:
    """What became of a claimed run no record settles yet (`ClaimsInHand.state`), else ""."""
    if record.get("lost"):
        return "  LOST: the process died before submitting it"
    if record.get("queued"):
        return "  queued: not submitted yet (the running scheduler submits it in turn)"
    if record.get("unresolved"):
        return "  not submitted yet: its scheduler stopped; the server that takes the scheduler over resolves it"
    return ""


def _log_line(r: dict[str, Any], tz: str) -> str:
    """One run-log record as a line. Its values come from the run log (the model's and the
    channels' error words among them): ids and targets shown exactly, errors as text. A field a
    record lacks (a run cancelled before it had a turn: `turn_id` null) is left out or shown as
    `-`, never as "None"."""

    def when(key: str) -> str:
        v = r.get(key)
        if not isinstance(v, str):
            return "-"
        try:  # a hand-edited or foreign record shows as written; it must not hide the rest of the log
            return _local(datetime.fromisoformat(v), tz)
        except (ValueError, OverflowError):
            return exact(v)

    def field(key: str) -> str:
        v = r.get(key)
        return "-" if v is None else exact(v)

    def text(key: str) -> str:
        v = r.get(key)
        return "" if v is None else visible(v)

    turn = f" turn {field('turn_id')}" if r.get("turn_id") is not None else ""
    ev = exact(r.get("event", "?"))
    n = field("occurrence")
    head = f"{when('at')}  {ev:<11}"
    if ev == "fired":
        kind = " (run now)" if r.get("manual") else " (catch-up)" if r.get("catch_up") else ""
        return f"{head} #{n} scheduled for {when('scheduled_for')}{kind}{_pending(r)}{_recovered(r)}"
    if ev == "submitted":
        return f"{head} #{n}{turn}{_recovered(r)}"
    if ev == "outcome":
        err = f": {visible(r['error'])}" if r.get("error") else ""
        return f"{head} #{n}{turn} {field('status')}{err}"
    if ev == "missed":
        return f"{head} scheduled for {when('scheduled_for')}: {text('reason')}"
    if ev == "fire_failed":
        return f"{head} #{n} {text('error')}"
    if ev == "delivered":
        ids = r.get("remote_ids")
        shown = ", ".join(exact(i) for i in ids) if isinstance(ids, list) and ids else "none reported"
        return f"{head} #{n}{turn} to {field('target')} (message ids: {shown})"
    if ev == "delivery_failed":
        return f"{head} #{n} to {field('target')}: {text('error')}"
    if ev == "removed":
        return f"{head} the task was removed"
    return f"{head} {text('error')}"
