"""The words of a turn's state, defined once: snapshot status, stop reason, phase, terminal statuses.

`Literal`s rather than enums so they compare equal to the strings the store and the wire carry.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Literal

from appserver.agent.events import Phase  # the agent loop reports phases too: defined there, once

TerminalStatus = Literal["completed", "cancelled", "failed"]
SnapshotStatus = Literal["running", "awaiting", "completed", "cancelled", "failed"]
StopReason = Literal[
    "end_turn",
    "max_tokens",
    "requires_approval",
    "requires_client_tool",
    "cancelled",
    "error",
    "max_steps",
    "content_filter",  # the provider's content filter (or a model's refusal stop) ended the reply
]
LifecycleState = Literal["idle", "active", "awaiting", "cancelling"]

# A snapshot in one of these never changes again.
TERMINAL_STATUSES: frozenset[str] = frozenset({"completed", "cancelled", "failed"})
# The snapshot status of a turn the store records as settled (an interrupted turn shows cancelled).
SETTLED_SNAPSHOT_STATUS: Mapping[str, TerminalStatus] = MappingProxyType(
    {"completed": "completed", "cancelled": "cancelled", "failed": "failed", "interrupted": "cancelled"}
)


def max_steps_note(steps: int | None) -> str:
    """What a front end says of a turn the loop stopped at its step limit (`stop_reason`
    `max_steps`): the limit named when known (an agent's `max_steps` param overrides the server's)."""
    limit = f"its limit of {steps} steps" if steps else "its step limit"
    return (
        f"[stopped: the agent reached {limit} (max_steps) before finishing this reply; "
        "send another message to let it go on]"
    )


__all__ = [
    "max_steps_note",
    "SETTLED_SNAPSHOT_STATUS",
    "TERMINAL_STATUSES",
    "TerminalStatus",
    "LifecycleState",
    "Phase",
    "SnapshotStatus",
    "StopReason",
]
