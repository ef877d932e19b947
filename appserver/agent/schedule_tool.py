"""The `schedule` tool: an agent creates, lists and cancels its own cron tasks (crons.json).

Cron targets obey the credential namespace rule (`appserver.auth.namespace_allows`, docs/security.md):
the caller is whoever owns the conversation the tool runs in. A turn in a credential's namespaced
conversation may only schedule into conversations of that namespace (by default: this very
conversation), and lists and cancels only such tasks; "new" and "default" (unowned conversations,
seen by admin and local callers only) are refused there. Turns of unowned conversations (local,
admin, CLI, cron) may target any existing conversation of the agent (or new/default). Either way
an omitted `conversation` is the one the tool runs in, and a target that does not exist or is
another agent's is refused when the task is made (as `cron add` does), not left to fail every run.

The channel gateway's credential is one namespace for every chat of every channel and account
(`gateway`, `gateway@…`: names only the gateway's own token carries), so there the owner is the
conversation itself, as the per-chat routing keeps chats apart: a turn in a gateway conversation
schedules only into that conversation, lists and cancels only its tasks, and its names and caps are
the conversation's (`CronStore.add(per_conversation=True)`), so one chat neither reads, cancels nor
crowds out another's. Without credentials (auth mode `none`) the gateway is unowned like every
caller, and a chat's conversation is the one it opened for a route (`channel_route` metadata).
That marker and a turn's `source` of kind `channel` are written by clients too (OpenAI `metadata`,
the WebSocket), so they are believed only there and in the gateway's namespace: a token's or an
`admin` credential's conversation that names a chat by them is no chat's.

A task made from a chat posts each run's final reply to that chat (its `deliver` target, as
`cron add --deliver` does: the gateway sends it), since whoever asked "remind me at 5" there waits
for it there; the model may ask for `deliver: "none"` (the reply only stays in the conversation),
and for no other chat. The task also records where it came from (`origin`: channel, account, chat,
thread, and the sender who asked), read from the turn's `source` as the gateway submitted it (a run
of a chat's task passes its own task's origin on), or, with no sender, from the route the gateway
opened the conversation for: `appserver cron list`/`show` name it, and `appserver pairing revoke`
of that sender disables the sender's tasks, and refuses any a turn of theirs that began before the
revoke asks for after it (`CronStore.add`'s `asked_at`: the turn, still running, was let in before).
Elsewhere a task delivers nowhere: a channel target is the operator's to set (`cron add --deliver`).
A chat lists and cancels, besides its conversation's tasks, those made from that very chat (and
thread) in a conversation it left with `/new`: they still post to it.

Task names are scoped the same way: a task remembers the namespace it was created in, names are
unique per agent and namespace (`CronStore.add`), and cancel finds a name only among the caller's
visible tasks, so a caller can neither see nor collide with another agent's or namespace's names.

A task made in a conversation no credential owns is stored under `UNOWNED_TOOL_NAMESPACE`, so the
tool can tell it from the operator's `cron add` tasks (no namespace), which it never shows or
cancels, whoever's conversation it runs in. A credential's turn lists and cancels only its own
namespace's tasks; an unowned one (admin, local), which sees every conversation, sees every task
the tool made. A model cannot flood the scheduler either:
at most MAX_TASKS_PER_NAMESPACE tasks per namespace, and a recurring one at most once a minute.
Nor fill crons.json, which every namespace and the operator share (and which every run rewrites):
a prompt holds at most TOOL_PROMPT_MAX_BYTES, a namespace's tasks at most NAMESPACE_MAX_BYTES of
the file, and all the tool's tasks together at most TOOL_TASKS_MAX_BYTES, a quarter of what the
file is read with, so the operator's `cron add` keeps the rest. A refusal names only the caller's
own tasks; a fault of the file itself (too large, locked, unreadable) is told without its path,
which the server log has.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime
from typing import Any

from appserver.agent.tools import Tool, ToolContext, ToolOutput, shown_zone, zone_named
from appserver.auth import is_gateway_namespace, namespace_allows
from appserver.fsutil import CRONS_MAX_BYTES, CorruptStateFile
from appserver.shown import shown
from appserver.store.base import Store
from cron.lease import LeaseHolder
from cron.schedule import ScheduleError, ScheduleSpec, get_zone, normalize_cron, parse_duration, shown_expr
from cron.store import (
    ORIGIN_KEYS,
    UNOWNED_TOOL_NAMESPACE,
    CronNotFound,
    CronRefused,
    CronStore,
    CronStoreError,
    CronTask,
    CronTaskInvalid,
    CronTasksTooLarge,
    make_task,
    utcnow,
    validate_deliver,
    validate_origin,
)
from cron.stores import cron_store_for

KINDS = ("cron", "every", "at", "in")
_UNKNOWN = "\x00unknown"  # the caller's namespace when it cannot be read: only this conversation
MAX_TASKS_PER_NAMESPACE = 100  # per namespace (the gateway's: per conversation) through the tool; the CLI: no cap
MIN_EVERY_S = 60  # the shortest `every` the tool accepts (a cron expression fires once a minute at most)
# A scheduled prompt is an instruction, not a document (`cron add` takes up to 1 MiB).
TOOL_PROMPT_MAX_BYTES = 16 * 1024
# What one namespace's tasks may take of crons.json through the tool, and all the tool's tasks
# together, each task counted with the bookkeeping room kept for it (cron.store.charged_bytes).
NAMESPACE_MAX_BYTES = 512 * 1024
TOOL_TASKS_MAX_BYTES = CRONS_MAX_BYTES // 4

log = logging.getLogger("appserver.cron")


def _stored_namespace(ns: str | None) -> str | None:
    """The namespace the caller's tasks are stored under: its credential's; the tool's own marker
    in an unowned conversation (so they are told apart from the operator's CLI tasks); None when
    the caller's namespace cannot be read (such a task is the operator's to manage)."""
    if ns is None:
        return UNOWNED_TOOL_NAMESPACE
    return None if ns == _UNKNOWN else ns


# The metadata key the gateway opens a chat's conversation with (gateway/app.py): the route it is for.
CHAT_ROUTE_KEY = "channel_route"


async def _caller(store: Store, ctx: ToolContext) -> tuple[str | None, bool]:
    """The namespace of the conversation this tool runs in (None: unowned, sees all), and whether
    it is a chat's: the gateway's credential's, or, where there are no credentials (auth mode
    `none`: the gateway is unowned like every caller), one the gateway opened for a route. A chat
    is kept to its own conversation either way; in mode `none` a marker set by hand on another
    conversation only narrows what the tool does there, and where credentials are in use a
    credential's marker makes no chat of its conversation (`_gateway_unowned`)."""
    conv = await store.get_conversation(ctx.conversation_id)
    if conv is None:
        return _UNKNOWN, False
    if is_gateway_namespace(conv.namespace):
        return conv.namespace, True
    return conv.namespace, _gateway_unowned(conv.namespace, ctx) and CHAT_ROUTE_KEY in conv.metadata


def _gateway_unowned(ns: str | None, ctx: ToolContext) -> bool:
    """Whether a conversation of namespace `ns` may be the gateway's although it is not of the
    gateway's credential: an unowned one while no credentials are in use (auth mode `none`, where
    the gateway connects as the local owner, as every caller does). Only then, and in the gateway's
    own namespace, are a conversation's `channel_route` marker and a turn's `source` of kind
    `channel` believed: any client may write them (OpenAI `metadata`, the WebSocket's
    `create_conversation` and `source`), and a token's or an `admin` credential's conversation that
    names a chat by them is no chat's (its tasks deliver nowhere and record no origin)."""
    return ns is None and ctx.config.auth.mode == "none"


# A route key's thread part for a chat's main line (gateway/routing.py `ROOT`): no thread.
_ROUTE_ROOT = "__root__"
# The `deliver` words the tool takes besides a target: the default (the chat asked from), none.
DELIVER_TO_CHAT = "chat"
DELIVER_NOWHERE = "none"


async def _chat_origin(store: Store, crons: CronStore, ctx: ToolContext) -> dict[str, str] | None:
    """The chat (and sender) a task made in a chat's conversation comes from: the turn's `source`
    as the gateway submitted it (kind `channel`); in a run of a task made from a chat, that task's
    origin (a task it makes is its sender's too); else the route the gateway opened the
    conversation for (`channel_route`: the chat, no sender). None when none says. A gateway
    source whose ids cannot be recorded refuses the task (ScheduleError): made without its
    sender, a `pairing revoke` of that sender would not stop it. Only in a conversation of the
    gateway's (`_caller`: a client's own `source` or marker names no chat): None elsewhere."""
    conv = await store.get_conversation(ctx.conversation_id)
    if conv is None or not (is_gateway_namespace(conv.namespace) or _gateway_unowned(conv.namespace, ctx)):
        return None
    turn = await store.get_turn(ctx.turn_id)
    source = turn.source if turn is not None and isinstance(turn.source, dict) else {}
    if source.get("kind") == "channel":
        found = {k: source[k] for k in ORIGIN_KEYS if isinstance(source.get(k), str) and source[k]}
        try:
            return validate_origin(found)
        except ScheduleError as exc:
            raise ScheduleError(f"this chat cannot be recorded as the task's origin: {exc}") from None
    if source.get("kind") == "cron_prompt":
        parent_id = source.get("cron_task_id")
        tasks = await asyncio.to_thread(crons.list, ctx.agent.id)
        parent = next((t for t in tasks if t.id == parent_id and t.conversation == ctx.conversation_id), None)
        if parent is not None and parent.origin is not None:
            return dict(parent.origin)
    return _route_origin(conv.metadata.get(CHAT_ROUTE_KEY))


async def _turn_began(store: Store, ctx: ToolContext) -> datetime | None:
    """When the turn the tool runs in was accepted: a task it makes for a sender revoked since
    (`appserver pairing revoke`, while the turn ran on) is refused (`CronStore.add`, SenderRevoked)."""
    turn = await store.get_turn(ctx.turn_id)
    if turn is None:
        return None
    return datetime.fromtimestamp(max(0.0, turn.created_at), UTC)


def _route_origin(route: Any) -> dict[str, str] | None:
    """The chat a `channel_route` (`channel:account:chat:thread`) names, or None."""
    parts = route.split(":") if isinstance(route, str) else []
    if len(parts) != 4:
        return None
    found = dict(zip(("channel", "account", "chat"), parts[:3], strict=True))
    if parts[3] != _ROUTE_ROOT:
        found["thread"] = parts[3]
    try:
        return validate_origin(found)
    except ScheduleError:
        return None


def _chat_target(origin: dict[str, str] | None, *, thread: bool = True) -> str | None:
    """The deliver target of the chat `origin` names (in its thread, or its main line), or None
    when it names none the gateway could deliver to."""
    if origin is None:
        return None
    where = f"{origin['channel']}:{origin['account']}:{origin['chat']}"
    if thread and origin.get("thread"):
        where += f":{origin['thread']}"
    try:
        return validate_deliver(where)
    except ScheduleError:
        return None


def _chosen_deliver(asked: Any, origin: dict[str, str] | None) -> str | None:
    """Where the task's runs post their reply: the chat it was made from by default, nowhere on
    `none`; a target the model names only when it is that chat (its thread or its main line), as
    a task may post to no other chat (ScheduleError)."""
    text = str(asked or "").strip()
    here = _chat_target(origin)
    if text in ("", DELIVER_TO_CHAT) and (here is not None or not text):
        return here
    if text == DELIVER_NOWHERE:
        return None
    if text and text in {here, _chat_target(origin, thread=False)} - {None}:
        return text
    if here is None:
        raise ScheduleError(
            f"deliver {shown(text)} is not possible here: only a task made from a chat posts its reply, to that "
            f"chat; omit deliver (or say {DELIVER_NOWHERE!r})"
        )
    raise ScheduleError(
        f"deliver {shown(text)} is not allowed: a task made here posts its reply to this chat ({here}) or nowhere "
        f"({DELIVER_NOWHERE!r})"
    )


async def _target_allowed(store: Store, ctx: ToolContext, ns: str | None, target: str, chat: bool) -> bool:
    if target == ctx.conversation_id:
        return True
    if chat:  # a chat's turn: only its own conversation
        return False
    if ns is None:
        return True
    if target in ("new", "default"):
        return False  # unowned conversations: outside every credential's namespace
    conv = await store.get_conversation(target)
    return conv is not None and conv.agent_id == ctx.agent.id and namespace_allows(ns, conv.namespace)


async def _create_target_problem(store: Store, ctx: ToolContext, ns: str | None, target: str, chat: bool) -> str | None:
    """Why a new task may not run in `target`, or None. Checked when the task is made, as `cron
    add` does: a conversation that is missing or another agent's would fail at every run."""
    if ns is not None or chat:
        if await _target_allowed(store, ctx, ns, target, chat):
            return None
        return f"conversation {shown(target)} is not one this conversation's owner may use"
    if target in ("new", "default") or target == ctx.conversation_id:
        return None
    conv = await store.get_conversation(target)
    if conv is None:
        return f"unknown conversation {shown(target)}"
    if conv.agent_id != ctx.agent.id:
        return f"conversation {shown(target)} belongs to another agent"
    return None


def _visible_tasks(
    ns: str | None, tasks: list[CronTask], conversation: str, chat: bool, here: dict[str, str] | None = None
) -> list[CronTask]:
    """The tasks this caller may list and cancel: a credential's own namespace only (whatever
    conversation they run in), except a chat (`chat`), which sees only the tasks it made in its
    own `conversation`, or made from the very chat (and thread) it is, `here` (before a `/new`:
    they still post to it, so it must be able to stop them); an unowned caller (admin, local),
    which sees every namespace as it sees every conversation, every task the tool made; nobody
    the operator's CLI tasks."""
    if ns is None and not chat:
        return [t for t in tasks if t.namespace is not None]
    own = _stored_namespace(ns)
    mine = [t for t in tasks if own is not None and t.namespace == own]
    if not chat:
        return mine
    return [t for t in mine if t.conversation == conversation or _same_chat(t.origin, here)]


def _same_chat(origin: dict[str, str] | None, here: dict[str, str] | None) -> bool:
    """Whether a task's `origin` is the chat (and thread) `here` is."""
    keys = ("channel", "account", "chat", "thread")
    return origin is not None and here is not None and all(origin.get(k) == here.get(k) for k in keys)


async def _chat_here(conversations: Store, crons: CronStore, ctx: ToolContext, chat: bool) -> dict[str, str] | None:
    """The chat a list or cancel is asked from (`_chat_origin`), None when not a chat's or not known."""
    if not chat:
        return None
    try:
        return await _chat_origin(conversations, crons, ctx)
    except ScheduleError:
        return None


def _create(
    store: CronStore,
    args: dict[str, Any],
    ctx: ToolContext,
    conversation: str,
    ns: str | None,
    chat: bool,
    origin: dict[str, str] | None,
    asked_at: datetime | None = None,
) -> str:
    given = [(k, args[k]) for k in KINDS if args.get(k)]
    if len(given) != 1:
        raise ScheduleError("give exactly one of cron, every, at, in")
    kind, expr = given[0]
    tz = str(args.get("tz") or "UTC")
    if zone_named(tz) is None:  # checked before the zone database is read: no path, no huge name
        raise ScheduleError(f"unknown timezone {shown_zone(tz)}: use an IANA name such as Europe/Paris")
    get_zone(tz)
    expr = normalize_cron(str(expr)) if kind == "cron" else str(expr).strip()
    if kind == "every" and parse_duration(expr).total_seconds() < MIN_EVERY_S:
        raise ScheduleError(
            f"every {shown(expr)} is too often: a task made by this tool repeats at most once a minute "
            "(every 60s or more)"
        )
    prompt = str(args.get("prompt") or "")
    size = len(prompt.encode("utf-8", "surrogatepass"))
    if size > TOOL_PROMPT_MAX_BYTES:
        raise ScheduleError(
            f"prompt too long: {size} bytes in UTF-8, at most {TOOL_PROMPT_MAX_BYTES} "
            f"({TOOL_PROMPT_MAX_BYTES // 1024} KiB) for a task made by this tool"
        )
    deliver = _chosen_deliver(args.get("deliver"), origin)
    task = make_task(
        name=str(args.get("name") or ""),
        agent=ctx.agent.id,
        schedule=ScheduleSpec(kind, expr, tz),
        prompt=prompt,
        now=utcnow(),
        conversation=conversation,
        misfire=str(args.get("misfire") or "skip"),
        namespace=_stored_namespace(ns),
        deliver=deliver,
        origin=origin,
    )
    store.add(
        task,
        max_in_namespace=MAX_TASKS_PER_NAMESPACE,
        max_namespace_bytes=NAMESPACE_MAX_BYTES,
        max_tool_bytes=TOOL_TASKS_MAX_BYTES,
        per_conversation=chat,
        asked_at=asked_at,
    )
    when = task.next_fire_at.isoformat(timespec="minutes") if task.next_fire_at else "never"
    posted = f"; each run's reply is posted to {deliver}" if deliver else ""
    return f"created task {task.name} ({task.id}); next run {when}{posted}"


LISTED_PROMPT_CHARS = 500  # a prompt may be 16 KiB (1 MiB, made before): a list of many would flood the context


def _listed_prompt(prompt: str) -> str:
    if len(prompt) <= LISTED_PROMPT_CHARS:
        return prompt
    return f"{prompt[:LISTED_PROMPT_CHARS]}… ({len(prompt):,} characters in all)"


def _list(tasks: list[CronTask]) -> str:
    if not tasks:
        return "no scheduled tasks"
    return "\n".join(
        f"{t.name} ({t.id}): {t.schedule.kind} {shown_expr(t.schedule.expr)} [{t.schedule.tz}] {t.state}; "
        f"next {t.next_fire_at.isoformat(timespec='minutes') if t.next_fire_at else '-'}; "
        f"{f'posted to {t.deliver}; ' if t.deliver else ''}"
        f"prompt: {_listed_prompt(t.prompt)}"
        for t in tasks
    )


async def _schedule(conversations: Store, args: dict[str, Any], ctx: ToolContext) -> ToolOutput:
    store = cron_store_for(ctx.config.home, ctx.config.store.url)
    action = args.get("action")
    try:
        ns, chat = await _caller(conversations, ctx)
        if action == "create":
            # Omitted: this very conversation, as the parameter's description tells the model.
            conversation = str(args.get("conversation") or "").strip() or ctx.conversation_id
            problem = await _create_target_problem(conversations, ctx, ns, conversation, chat)
            if problem is not None:
                return ToolOutput(
                    f"schedule create failed: {problem}; omit `conversation` to schedule into this conversation",
                    is_error=True,
                )
            origin = await _chat_origin(conversations, store, ctx) if chat else None
            asked_at = await _turn_began(conversations, ctx) if origin is not None else None
            text = await asyncio.to_thread(_create, store, args, ctx, conversation, ns, chat, origin, asked_at)
        elif action == "list":
            listed = await asyncio.to_thread(store.list, ctx.agent.id)
            here = await _chat_here(conversations, store, ctx, chat)
            text = _list(_visible_tasks(ns, listed, ctx.conversation_id, chat, here))
        elif action == "cancel":
            ref = str(args.get("name") or args.get("id") or "")
            here = await _chat_here(conversations, store, ctx, chat)
            listed = await asyncio.to_thread(store.list, ctx.agent.id)
            mine = _visible_tasks(ns, listed, ctx.conversation_id, chat, here)
            found = [t for t in mine if t.id == ref] or [t for t in mine if t.name == ref]
            if not found:
                raise CronNotFound(f"no cron task {shown(ref)}")  # another's is as if it did not exist
            if len(found) > 1:
                ids = ", ".join(t.id for t in found)
                raise CronRefused(f"several of your tasks are named {shown(ref)} ({ids}); cancel one by its id")
            # (a run of it left waiting by a scheduler that stopped is cancelled, as `cron remove` does)
            alive = LeaseHolder(store, started_at=utcnow()).alive
            task = await asyncio.to_thread(store.remove, found[0].id, ctx.agent.id, scheduler_alive=alive)
            text = f"cancelled task {task.name} ({task.id})"
        else:
            return ToolOutput("action must be create, list or cancel", is_error=True)
    except (ScheduleError, CronNotFound, CronRefused, CronTaskInvalid, ValueError, LookupError) as exc:
        return ToolOutput(f"schedule {action} failed: {exc}", is_error=True)
    except (CronStoreError, CorruptStateFile) as exc:
        return ToolOutput(f"schedule {action} failed: {_store_fault(exc)}", is_error=True)
    finally:
        await asyncio.to_thread(store.close)
    return ToolOutput(text)


def _store_fault(exc: Exception) -> str:
    """What the model (and the client) are told of a fault of crons.json itself: whether anything
    was written, never the file's path nor how much other namespaces' tasks take (the server log
    has the whole message, as the operator's `cron` commands show it)."""
    log.warning("schedule tool: %s", exc)
    if isinstance(exc, CronTasksTooLarge):
        return "the server's scheduled tasks leave no room for this one now; nothing was written"
    return "the server's scheduled tasks cannot be read or written now (see the server log); nothing was written"


def schedule_tool(conversations: Store) -> Tool:
    """The tool bound to the server's store, which it reads to apply the namespace rule."""

    async def run(args: dict[str, Any], ctx: ToolContext) -> ToolOutput:
        return await _schedule(conversations, args, ctx)

    return Tool(
        name="schedule",
        description=(
            "Manage your own scheduled prompts. action=create with name, prompt and exactly one of "
            "cron (5-field, with tz), every (e.g. 30m), at ('YYYY-MM-DD HH:MM' in tz) or in (e.g. 2h); "
            "action=list; action=cancel with name. A task made from a chat posts each run's reply to "
            "that chat (deliver='none': only kept in the conversation)."
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
                "conversation": {
                    "type": "string",
                    "description": (
                        "Where the prompt runs: omit for this conversation "
                        "(or 'new' for a fresh one each time, where allowed)."
                    ),
                },
                "misfire": {"type": "string", "enum": ["skip", "run_once", "run_all"]},
                "deliver": {
                    "type": "string",
                    "description": (
                        "Where each run's final reply is posted: omit (or 'chat') for the chat this "
                        "conversation is, 'none' to only keep it in the conversation."
                    ),
                },
            },
            "required": ["action"],
        },
        run=run,
        read_only=False,
        resource_key=lambda args, ctx: "crons.json",
    )
