"""The `schedule` tool: an agent creates, lists and cancels its own cron tasks (crons.json)."""

from __future__ import annotations

import asyncio
from typing import Any

from appserver.agent.tools import Tool, ToolContext, ToolOutput
from cron.schedule import ScheduleError, ScheduleSpec, get_zone, normalize_cron
from cron.store import CronNotFound, CronStore, CronStoreError, make_task, utcnow

KINDS = ("cron", "every", "at", "in")


def _create(store: CronStore, args: dict[str, Any], ctx: ToolContext) -> str:
    given = [(k, args[k]) for k in KINDS if args.get(k)]
    if len(given) != 1:
        raise ScheduleError("give exactly one of cron, every, at, in")
    kind, expr = given[0]
    tz = str(args.get("tz") or "UTC")
    get_zone(tz)
    expr = normalize_cron(str(expr)) if kind == "cron" else str(expr).strip()
    task = make_task(
        name=str(args.get("name") or ""),
        agent=ctx.agent.id,
        schedule=ScheduleSpec(kind, expr, tz),
        prompt=str(args.get("prompt") or ""),
        now=utcnow(),
        conversation=str(args.get("conversation") or "new"),
        misfire=str(args.get("misfire") or "skip"),
    )
    store.add(task)
    when = task.next_fire_at.isoformat(timespec="minutes") if task.next_fire_at else "never"
    return f"created task {task.name} ({task.id}); next run {when}"


def _list(store: CronStore, ctx: ToolContext) -> str:
    tasks = store.list(ctx.agent.id)
    if not tasks:
        return "no scheduled tasks"
    return "\n".join(
        f"{t.name} ({t.id}): {t.schedule.kind} {t.schedule.expr} [{t.schedule.tz}] {t.state}; next {t.next_fire_at.isoformat(timespec='minutes') if t.next_fire_at else '-'}; prompt: {t.prompt}"
        for t in tasks
    )


async def _schedule(args: dict[str, Any], ctx: ToolContext) -> ToolOutput:
    store = CronStore(ctx.config.home)
    action = args.get("action")
    try:
        if action == "create":
            text = await asyncio.to_thread(_create, store, args, ctx)
        elif action == "list":
            text = await asyncio.to_thread(_list, store, ctx)
        elif action == "cancel":
            ref = str(args.get("name") or args.get("id") or "")
            task = await asyncio.to_thread(store.remove, ref, ctx.agent.id)
            text = f"cancelled task {task.name} ({task.id})"
        else:
            return ToolOutput("action must be create, list or cancel", is_error=True)
    except (ScheduleError, CronNotFound, CronStoreError, ValueError, LookupError) as exc:
        return ToolOutput(f"schedule {action} failed: {exc}", is_error=True)
    return ToolOutput(text)


SCHEDULE = Tool(
    name="schedule",
    description=(
        "Manage your own scheduled prompts. action=create with name, prompt and exactly one of "
        "cron (5-field, with tz), every (e.g. 30m), at ('YYYY-MM-DD HH:MM' in tz) or in (e.g. 2h); "
        "action=list; action=cancel with name."
    ),
    parameters={
        "type": "object",
        "properties": {
            "action": {"type": "string", "enum": ["create", "list", "cancel"]},
            "name": {"type": "string"},
            "prompt": {"type": "string"},
            "cron": {"type": "string"},
            "every": {"type": "string"},
            "at": {"type": "string"},
            "in": {"type": "string"},
            "tz": {"type": "string"},
            "conversation": {"type": "string"},
            "misfire": {"type": "string", "enum": ["skip", "run_once", "run_all"]},
        },
        "required": ["action"],
    },
    run=_schedule,
    read_only=False,
    resource_key=lambda args, ctx: "crons.json",
)
