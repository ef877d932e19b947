"""Rows and records, the same for both SQL stores (sqlite.py, postgres.py): JSON columns, the row →
record converters, and the statements both write alike. A row is anything indexed by column name
(`sqlite3.Row`, psycopg's dict rows)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from appserver import fastjson
from appserver.store.records import (
    AgentRecord,
    ConversationRecord,
    HttpIdempotency,
    MessageRecord,
    PendingCall,
    ResponseRecord,
    TurnRecord,
)

Row = Mapping[str, Any]


def dump_json(value: Any) -> str:
    if not value and type(value) in (dict, list):  # options, client tools, ...: mostly empty
        return "{}" if type(value) is dict else "[]"
    return fastjson.dumps(value)


def load_json(text: str | None, default: Any = None) -> Any:
    if text is None:
        return default
    return json.loads(text)  # exact: fastjson.loads_chunk would read a huge integer as a float


# Only a turn still open takes a draft: a checkpoint scheduled before the turn's commit but run
# after it must not put a draft back on a finished turn.
DRAFT_UPDATE = "UPDATE turns SET draft=%s WHERE id=%s AND status IN ('queued', 'running', 'awaiting')"


def agent_record(row: Row) -> AgentRecord:
    return AgentRecord(
        id=row["id"],
        name=row["name"],
        model=row["model"],
        system=row["system"],
        tools=load_json(row["tools"], {}),
        params=load_json(row["params"], {}),
        created_at=row["created_at"],
        updated_at=row["updated_at"],
    )


def conversation_record(row: Row) -> ConversationRecord:
    return ConversationRecord(
        id=row["id"],
        agent_id=row["agent_id"],
        is_default=bool(row["is_default"]),
        title=row["title"],
        user=row["user"],
        namespace=row["namespace"],
        forked_from=row["forked_from"],
        metadata=load_json(row["metadata"], {}),
        created_at=row["created_at"],
        updated_at=row["updated_at"],
    )


def stored_size(row: Row) -> int:
    """How many bytes a message row's text columns hold (UTF-8), for paging by size."""
    total = 0
    for k in ("content", "tool_calls", "reasoning"):
        text = row[k]
        if text is not None:
            total += len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
    return total


def message_record(row: Row) -> MessageRecord:
    return MessageRecord(
        id=row["id"],
        conversation_id=row["conversation_id"],
        turn_id=row["turn_id"],
        iteration=row["iteration"],
        role=row["role"],
        content=load_json(row["content"], ""),
        tool_calls=load_json(row["tool_calls"], []) or [],
        tool_call_id=row["tool_call_id"],
        name=row["name"],
        is_error=bool(row["is_error"]),
        reasoning=row["reasoning"],
        provider_state=load_json(row["provider_state"]),
        completion_status=row["completion_status"],
        source=load_json(row["source"]),
        created_at=row["created_at"],
        meta=load_json(row["meta"]) or {},
    )


def turn_record(row: Row) -> TurnRecord:
    return TurnRecord(
        id=row["id"],
        conversation_id=row["conversation_id"],
        agent_id=row["agent_id"],
        status=row["status"],
        stop_reason=row["stop_reason"],
        error=load_json(row["error"]),
        idempotency_key=row["idempotency_key"],
        source=load_json(row["source"]),
        input=load_json(row["input"], {}),
        input_committed=bool(row["input_committed"]),
        client_tools=load_json(row["client_tools"], []),
        options=load_json(row["options"], {}),
        owner=row["owner"],
        draft=load_json(row["draft"]),
        usage=load_json(row["usage"], {}),
        revision=row["revision"],
        iteration=row["iteration"],
        created_at=row["created_at"],
        started_at=row["started_at"],
        ended_at=row["ended_at"],
    )


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


def response_record(row: Row) -> ResponseRecord:
    return ResponseRecord(
        id=row["id"],
        agent_id=row["agent_id"],
        conversation_id=row["conversation_id"],
        body=load_json(row["body"], {}),
        turn_id=row["turn_id"],
        previous_response_id=row["previous_response_id"],
        namespace=row["namespace"],
        last_message_id=row["last_message_id"],
        input_items=load_json(row["input_items"], []),
        stored=bool(row["stored"]),
        created_at=row["created_at"],
    )


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
