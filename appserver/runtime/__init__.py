"""The kernel's public face: every front end (HTTP, WebSocket, CLI, cron) imports from here only.

Everything else in this package is the kernel's inside and may change shape freely.
"""

from appserver.ids import new_id
from appserver.runtime.handle import Decision, TurnHandle
from appserver.runtime.kernel import Kernel, SettledListener, Submission, SubmitRequest
from appserver.runtime.latest import Quiet
from appserver.runtime.snapshot import DeltaTap, TurnController, TurnSnapshot
from appserver.runtime.types import (
    SETTLED_SNAPSHOT_STATUS,
    TERMINAL_STATUSES,
    LifecycleState,
    Phase,
    SnapshotStatus,
    StopReason,
    TerminalStatus,
    max_steps_note,
)
from appserver.runtime.watch import Watch

__all__ = [
    "SETTLED_SNAPSHOT_STATUS",
    "TERMINAL_STATUSES",
    "Decision",
    "DeltaTap",
    "Kernel",
    "LifecycleState",
    "Phase",
    "Quiet",
    "SettledListener",
    "SnapshotStatus",
    "StopReason",
    "Submission",
    "SubmitRequest",
    "TerminalStatus",
    "TurnController",
    "TurnHandle",
    "TurnSnapshot",
    "Watch",
    "max_steps_note",
    "new_id",
]
