"""Outcomes of turns that ended while the client was disconnected, rebuilt from stored history.

After a reconnect a followed turn may no longer be active (a standby settled it as interrupted, or
it finished meanwhile). Its outcome is what the server answers to `get_turn`; when the server
cannot answer (no record of the turn, or a server without `get_turn`), a caller waiting for it must
still get a truthful terminal snapshot, so the client rebuilds one from the committed messages and
claims only what they show.
"""

from __future__ import annotations

import time
from typing import Any

from appserver.client.frames import Block, Snapshot, TurnStatus

INTERRUPTED = {
    "kind": "interrupted",
    "message": "the server stopped while this turn was running",
    "retryable": False,
    "status": None,
}


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text") or "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return ""


def settled_from_history(
    turn_id: str, conversation_id: str, agent_id: str, messages: list[dict[str, Any]], revision: int
) -> Snapshot | None:
    """The terminal snapshot of a turn that is no longer active, rebuilt from its committed messages
    (a turn's messages are committed when it ends), or None when none are committed yet. It claims
    only what the store shows: `completed` needs a final reply marked completed; text kept from a stop
    is `interrupted`/`cancelled`; anything else is an honest "ended, outcome unknown"."""
    mine = [m for m in messages if m.get("turn_id") == turn_id]
    if not mine:
        return None
    results = {m.get("tool_call_id"): m for m in mine if m.get("role") == "tool"}
    blocks: list[Block] = []
    for m in mine:
        if m.get("role") != "assistant":
            continue
        if m.get("reasoning"):
            blocks.append({"type": "reasoning", "text": m["reasoning"]})
        if _text(m.get("content")):
            blocks.append({"type": "text", "text": _text(m.get("content"))})
        for c in m.get("tool_calls") or []:
            r = results.get(c.get("id"))
            failed = r is None or bool(r.get("is_error"))
            blocks.append(
                {
                    "type": "tool_call",
                    "call_id": c.get("id"),
                    "name": c.get("name"),
                    "arguments": c.get("arguments", ""),
                    "executor": "server",
                    "status": "failed" if failed else "completed",
                    "output": _text(r.get("content")) if r else None,
                    "is_error": failed,
                }
            )
    last = mine[-1]
    done = last.get("completion_status")
    status: TurnStatus = "failed"
    stop_reason, error = "error", None
    if last.get("role") == "assistant" and not last.get("tool_calls") and done == "completed":
        status, stop_reason = "completed", "end_turn"
    elif done == "interrupted":
        status, stop_reason, error = "cancelled", "cancelled", dict(INTERRUPTED)
    elif done == "cancelled":
        status, stop_reason = "cancelled", "cancelled"
    else:
        error = {
            "kind": "unknown",
            "message": (
                "the turn ended while the client was reconnecting; "
                "the server kept no final reply (it was interrupted, cancelled or failed)"
            ),
            "retryable": False,
            "status": None,
        }
    snap = _snapshot(turn_id, conversation_id, agent_id, revision, status, stop_reason, blocks, error)
    snap["resumed_from"] = "history"
    return snap


def lost_snapshot(turn_id: str, conversation_id: str, agent_id: str, revision: int) -> Snapshot:
    """The outcome of a followed turn the server after a reconnect has no record of."""
    error = {
        "kind": "lost",
        "message": "the server that answered after the reconnect has no record of this turn",
        "retryable": False,
        "status": None,
    }
    snap = _snapshot(turn_id, conversation_id, agent_id, revision, "failed", "error", [], error)
    snap["resumed_from"] = "history"
    return snap


def _snapshot(
    turn_id: str,
    conversation_id: str,
    agent_id: str,
    revision: int,
    status: TurnStatus,
    stop_reason: str,
    blocks: list[Block],
    error: dict[str, Any] | None,
) -> Snapshot:
    return {
        "turn_id": turn_id,
        "conversation_id": conversation_id,
        "agent_id": agent_id,
        "revision": max(revision, 0),
        "status": status,
        "phase": "finalizing",
        "stop_reason": stop_reason,
        "blocks": blocks,
        "pending": [],
        "usage": {},
        "error": error,
        "queue_position": 0,
        "attempt": 1,
        "updated_at": time.time(),
    }
