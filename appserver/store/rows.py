"""Rows and records, the same for both SQL stores (sqlite.py, postgres.py): JSON columns, the row →
record converters, and the statements both write alike. A row is anything indexed by column name
(`sqlite3.Row`, psycopg's dict rows).

Every JSON cell is read through `decode_json`: a cell that is no JSON (a byte changed inside a page
that kept the text UTF-8, a hand edit) or JSON of another shape than the column holds is damage,
handled as stored text that is no UTF-8 is (sqlite.py `_rows`): the store is told (`on_damage`:
SQLite says so once and fails readiness, PostgreSQL logs each damaged cell once) and the cell reads
as its fallback, so the agent, conversation or history that holds it stays usable until the store is
restored. A converter given no `on_damage`
refuses the row instead (DamagedCell). A column missing from a table is refused (DamagedTable).

Two reads go further than the shape of the cell. An agent's params are checked key by key against
the table the command that sets them uses (agentparams.py): a wrong value is damage, and that key
reads as not set. A turn's input, client tools and options stand in only to be shown: the record
names them (`TurnRecord.damaged`), and the runtime ends such a turn failed instead of running it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from functools import wraps
from typing import Any, Concatenate, NoReturn, ParamSpec, TypeVar

from appserver import fastjson
from appserver.agentparams import param_problem
from appserver.store.base import StoreError
from appserver.store.records import (
    EVERY_TOOL,
    TURN_RUN_COLUMNS,
    AgentRecord,
    ConversationRecord,
    HttpIdempotency,
    MessageRecord,
    PendingCall,
    ResponseOwner,
    ResponseRecord,
    TurnRecord,
)

Row = Mapping[str, Any]
OnDamage = Callable[[str], None]  # told what is damaged ("column 'params' of agents row 'agt_…' …")

log = logging.getLogger("appserver.store")

P = ParamSpec("P")
R = TypeVar("R")

DAMAGE_LOG_MAX = 100  # damaged cells a DamageLog says, each once; more are the same news


class DamagedCell(StoreError):
    """A JSON cell that is no JSON, or not of its column's shape, read where nothing can stand in
    for it: one line naming the table, the row and the column, never the cell's text."""

    def __init__(self, problem: str) -> None:
        super().__init__(f"the store is damaged: {problem}; restore it from a backup")
        self.problem = problem


class DamagedTable(StoreError):
    """A table without a column this appserver reads (dropped by hand, or damage): every read of
    the table would fail, so it is refused by name rather than as a bare IndexError."""


def refuse(problem: str) -> NoReturn:
    """The `on_damage` of a read that must not go on with a stand-in (the default)."""
    raise DamagedCell(problem)


class DamageLog:
    """The `on_damage` of a store with no damage state of its own (PostgreSQL): each damaged cell
    said once (a row read on every turn would fill the log), the first DAMAGE_LOG_MAX of them."""

    def __init__(self, store: str) -> None:
        self.store = store
        self._said: set[str] = set()

    def __call__(self, problem: str) -> None:
        if problem in self._said or len(self._said) >= DAMAGE_LOG_MAX:
            return
        self._said.add(problem)
        log.error("%s is damaged (%s): restore it from a backup, or correct the cell", self.store, problem)


def _none(_text: str = "") -> None:
    return None


def _empty_dict(_text: str = "") -> dict[str, Any]:
    return {}


def _empty_list(_text: str = "") -> list[Any]:
    return []


def _dicts(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, dict) for v in value)


def _content(value: Any) -> bool:
    """A message's content: text, or a list of parts (objects)."""
    return isinstance(value, str) or _dicts(value)


def _policies(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(v, str) for v in value.values())


def _tool_calls(value: Any) -> bool:
    return value is None or (
        isinstance(value, list)
        and all(
            isinstance(c, dict)
            and isinstance(c.get("id"), str)
            and isinstance(c.get("name"), str)
            and isinstance(c.get("arguments", ""), str)
            for c in value
        )
    )


def _tool_specs(value: Any) -> bool:
    return _dicts(value) and all(isinstance(t.get("name"), str) for t in value)


def _turn_input(value: Any) -> bool:
    return isinstance(value, dict) and ("content" not in value or _content(value["content"]))


def _usage(value: Any) -> bool:
    return isinstance(value, dict) and all(type(v) in (int, float) for v in value.values())


@dataclass(frozen=True, slots=True)
class Shape:
    """What a JSON column holds. `fits`: the values it may hold; `null`: what SQL NULL reads as;
    `fallback`: what a damaged cell reads as, from its stored text (fresh each time: records are
    edited by their callers)."""

    name: str
    fits: Callable[[Any], bool]
    null: Callable[[], Any] = _none
    fallback: Callable[[str], Any] = _none


OBJECT = Shape("an object", lambda v: isinstance(v, dict), _empty_dict, _empty_dict)
OBJECT_OR_NULL = Shape("an object or null", lambda v: v is None or isinstance(v, dict))
# A damaged cancel acknowledgement still says a cancel was acknowledged (which calls had begun is
# then unknown): the turn ends cancelled all the same.
CANCEL_ACK = Shape("an object or null", lambda v: v is None or isinstance(v, dict), _none, _empty_dict)
# Damaged policies deny every tool: read as empty, each tool would get its default, and one the lost
# policies denied (a plugin's tool allowed by default) would run.
POLICIES = Shape("an object of tool policies", _policies, _empty_dict, lambda _text: {EVERY_TOOL: "deny"})
USAGE = Shape("an object of counts", _usage, _empty_dict, _empty_dict)
# A damaged message reads as its stored text: what is left of it stays readable (as U+FFFD does).
CONTENT = Shape("text or a list of parts", _content, str, str)
TOOL_CALLS = Shape("a list of tool calls", _tool_calls, _empty_list, _empty_list)
TOOL_SPECS = Shape("a list of tools", _tool_specs, _empty_list, _empty_list)
OBJECTS = Shape("a list of objects", _dicts, _empty_list, _empty_list)
TURN_INPUT = Shape("a turn's input", _turn_input, _empty_dict, lambda text: {"content": text})


def dump_json(value: Any) -> str:
    if not value and type(value) in (dict, list):  # options, client tools, ...: mostly empty
        return "{}" if type(value) is dict else "[]"
    return fastjson.dumps(value)


def load_json(text: str | None, default: Any = None) -> Any:
    if text is None:
        return default
    return json.loads(text)  # exact: fastjson.loads_chunk would read a huge integer as a float


def decode_json(text: Any, shape: Shape, on_damage: OnDamage, table: str, row_id: Any, column: str) -> Any:
    """The value of one JSON cell of `table`'s row `row_id`, of `shape`; a damaged one is said to
    `on_damage` (naming table, row and column, never the text) and reads as the shape's fallback."""
    if text is None:
        return shape.null()
    if isinstance(text, str):
        try:
            value = load_json(text)
        except json.JSONDecodeError as exc:
            problem = f"is no valid JSON ({exc.msg} at character {exc.pos})"
        except (ValueError, RecursionError):  # a number of too many digits; nested too deeply
            problem = "is no valid JSON"
        else:
            if shape.fits(value):
                return value
            problem = f"is JSON of the wrong shape (not {shape.name})"
    else:
        problem = f"is no text (a {type(text).__name__} value)"
    on_damage(f"column '{column}' of {table} row {row_id!r} {problem}")
    return shape.fallback(text if isinstance(text, str) else "")


def _reads(table: str, record: type) -> Callable[[Callable[Concatenate[Row, P], R]], Callable[Concatenate[Row, P], R]]:
    """A converter of `table`'s rows into `record`s (whose fields are the columns): a column
    missing from the row is DamagedTable, naming it (fields marked `column: False` are none)."""
    columns = tuple(f.name for f in fields(record) if f.metadata.get("column", True))

    def wrap(convert: Callable[Concatenate[Row, P], R]) -> Callable[Concatenate[Row, P], R]:
        @wraps(convert)
        def read(row: Row, /, *args: P.args, **kwargs: P.kwargs) -> R:
            try:
                return convert(row, *args, **kwargs)
            except (IndexError, KeyError):  # sqlite3.Row, psycopg's dict row
                missing = [c for c in columns if c not in row.keys()]
                if not missing:
                    raise
            raise DamagedTable(
                f"the store's {table} table has no column {', '.join(repr(c) for c in missing)} (dropped by hand, or "
                "the store is damaged): restore it from a backup"
            )

        return read

    return wrap


# Only a turn still open takes a draft: a checkpoint scheduled before the turn's commit but run
# after it must not put a draft back on a finished turn.
DRAFT_UPDATE = "UPDATE turns SET draft=%s WHERE id=%s AND status IN ('queued', 'running', 'awaiting')"


@_reads("agents", AgentRecord)
def agent_record(row: Row, on_damage: OnDamage = refuse) -> AgentRecord:
    rid = row["id"]
    return AgentRecord(
        id=rid,
        name=row["name"],
        model=row["model"],
        system=row["system"],
        tools=decode_json(row["tools"], POLICIES, on_damage, "agents", rid, "tools"),
        params=checked_params(decode_json(row["params"], OBJECT, on_damage, "agents", rid, "params"), on_damage, rid),
        created_at=row["created_at"],
        updated_at=row["updated_at"],
    )


def checked_params(params: dict[str, Any], on_damage: OnDamage, row_id: Any) -> dict[str, Any]:
    """An agent's params with each value the command would refuse (agentparams.py) said to
    `on_damage` and left out: that key reads as not set (the server's default applies, as before
    it was set), while the others keep what was set (a max_tokens or max_steps limit stays)."""
    kept: dict[str, Any] = {}
    for key, value in params.items():
        problem = param_problem(key, value)
        if problem is None:
            kept[key] = value
        else:
            on_damage(f"column 'params' of agents row {row_id!r} holds a wrong value for {key!r} ({problem})")
    return kept


@_reads("conversations", ConversationRecord)
def conversation_record(row: Row, on_damage: OnDamage = refuse) -> ConversationRecord:
    rid = row["id"]
    return ConversationRecord(
        id=rid,
        agent_id=row["agent_id"],
        is_default=bool(row["is_default"]),
        title=row["title"],
        user=row["user"],
        namespace=row["namespace"],
        forked_from=row["forked_from"],
        metadata=decode_json(row["metadata"], OBJECT, on_damage, "conversations", rid, "metadata"),
        created_at=row["created_at"],
        updated_at=row["updated_at"],
    )


# The columns of a message row that hold text of any size: a history page is as big as they are
# together (`source` is what the client gave, `meta` holds a refusal's text, `provider_state` is
# read with the row though never shown). Postgres sums the same columns (postgres.py history_page).
SIZED_MESSAGE_COLUMNS = ("content", "tool_calls", "reasoning", "source", "meta", "provider_state")


def stored_size(row: Row) -> int:
    """How many bytes a message row's text columns hold (UTF-8), for paging by size."""
    total = 0
    for k in SIZED_MESSAGE_COLUMNS:
        text = row[k]
        if isinstance(text, str):
            total += len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
        elif text is not None:  # a blob or a number where text belongs (damage): message_record says so
            total += len(text) if isinstance(text, bytes) else 8
    return total


@_reads("messages", MessageRecord)
def message_record(row: Row, on_damage: OnDamage = refuse) -> MessageRecord:
    rid = row["id"]
    return MessageRecord(
        id=rid,
        conversation_id=row["conversation_id"],
        turn_id=row["turn_id"],
        iteration=row["iteration"],
        role=row["role"],
        content=decode_json(row["content"], CONTENT, on_damage, "messages", rid, "content"),
        tool_calls=decode_json(row["tool_calls"], TOOL_CALLS, on_damage, "messages", rid, "tool_calls") or [],
        tool_call_id=row["tool_call_id"],
        name=row["name"],
        is_error=bool(row["is_error"]),
        reasoning=row["reasoning"],
        provider_state=decode_json(row["provider_state"], OBJECT_OR_NULL, on_damage, "messages", rid, "provider_state"),
        completion_status=row["completion_status"],
        source=decode_json(row["source"], OBJECT_OR_NULL, on_damage, "messages", rid, "source"),
        created_at=row["created_at"],
        meta=decode_json(row["meta"], OBJECT_OR_NULL, on_damage, "messages", rid, "meta") or {},
    )


@_reads("turns", TurnRecord)
def turn_record(row: Row, on_damage: OnDamage = refuse) -> TurnRecord:
    """A turn; `damaged` names its columns of TURN_RUN_COLUMNS that read as stand-ins."""
    rid = row["id"]
    damaged: list[str] = []

    def run_column(column: str, shape: Shape) -> Any:
        def told(problem: str) -> None:
            damaged.append(column)
            on_damage(problem)

        return decode_json(row[column], shape, told, "turns", rid, column)

    return TurnRecord(
        id=rid,
        conversation_id=row["conversation_id"],
        agent_id=row["agent_id"],
        status=row["status"],
        stop_reason=row["stop_reason"],
        error=decode_json(row["error"], OBJECT_OR_NULL, on_damage, "turns", rid, "error"),
        idempotency_key=row["idempotency_key"],
        source=decode_json(row["source"], OBJECT_OR_NULL, on_damage, "turns", rid, "source"),
        input=run_column("input", TURN_INPUT),
        input_committed=bool(row["input_committed"]),
        client_tools=run_column("client_tools", TOOL_SPECS),
        options=run_column("options", OBJECT),
        owner=row["owner"],
        draft=decode_json(row["draft"], OBJECT_OR_NULL, on_damage, "turns", rid, "draft"),
        usage=decode_json(row["usage"], USAGE, on_damage, "turns", rid, "usage"),
        revision=row["revision"],
        iteration=row["iteration"],
        created_at=row["created_at"],
        started_at=row["started_at"],
        ended_at=row["ended_at"],
        cancel_ack=decode_json(row["cancel_ack"], CANCEL_ACK, on_damage, "turns", rid, "cancel_ack"),
        damaged=tuple(c for c in TURN_RUN_COLUMNS if c in damaged),
    )


@_reads("pending_calls", PendingCall)
def pending_call(row: Row) -> PendingCall:
    return PendingCall(
        call_id=row["call_id"],
        conversation_id=row["conversation_id"],
        turn_id=row["turn_id"],
        name=row["name"],
        arguments=row["arguments"],
        kind=row["kind"],
        status=row["status"],
        output=row["output"],
        is_error=bool(row["is_error"]),
        reason=row["reason"],
        decided_by=row["decided_by"],
        created_at=row["created_at"],
        expires_at=row["expires_at"],
    )


@_reads("responses", ResponseRecord)
def response_record(row: Row, on_damage: OnDamage = refuse) -> ResponseRecord:
    rid = row["id"]
    return ResponseRecord(
        id=rid,
        agent_id=row["agent_id"],
        conversation_id=row["conversation_id"],
        body=decode_json(row["body"], OBJECT, on_damage, "responses", rid, "body"),
        turn_id=row["turn_id"],
        previous_response_id=row["previous_response_id"],
        namespace=row["namespace"],
        last_message_id=row["last_message_id"],
        input_items=decode_json(row["input_items"], OBJECTS, on_damage, "responses", rid, "input_items"),
        stored=bool(row["stored"]),
        created_at=row["created_at"],
    )


# The columns before `body` in the row: SQLite reads a later one through the body's overflow pages
RESPONSE_OWNER_COLUMNS = "id, agent_id, conversation_id, previous_response_id"


@_reads("responses", ResponseOwner)
def response_owner(row: Row) -> ResponseOwner:
    return ResponseOwner(
        id=row["id"],
        agent_id=row["agent_id"],
        conversation_id=row["conversation_id"],
        previous_response_id=row["previous_response_id"],
    )


@_reads("http_idempotency", HttpIdempotency)
def http_idempotency(row: Row) -> HttpIdempotency:
    return HttpIdempotency(
        scope=row["scope"],
        key=row["key"],
        body_hash=row["body_hash"],
        state=row["state"],
        status_code=row["status_code"],
        content_type=row["content_type"],
        body=row["body"],
        conversation_id=row["conversation_id"],
        created_at=row["created_at"],
        owner=row["owner"],
    )
