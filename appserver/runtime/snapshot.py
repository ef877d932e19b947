"""TurnSnapshot (the presentation state of one turn) and TurnController (the reducer that owns it).

The controller reduces TurnEvents into ordered blocks; every change bumps `revision` and wakes
consumers through a latest-value cell. Consumers read `snapshot()` when they wake, so a slow one
skips revisions. Text blocks only grow while a turn runs: a delta is the new suffix.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from appserver.agent.events import (
    Compacted,
    PhaseChanged,
    ReasoningDelta,
    Retrying,
    StepStarted,
    StreamDiscarded,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallStarted,
    ToolCallStatus,
    TurnEvent,
    UsageUpdated,
)
from appserver.agent.tools import announced_arguments
from appserver.runtime.latest import Latest, Quiet
from appserver.runtime.types import TERMINAL_STATUSES, Phase, SnapshotStatus, StopReason, TerminalStatus
from appserver.store.records import MessageRecord, PendingCall
from appserver.textparts import TextParts
from appserver.values import value

log = logging.getLogger("appserver.runtime.snapshot")

# A consumer's synchronous hand for text deltas (`TurnController.next_snapshot_tapped`): called as
# (block index, block type, refusal, the delta's text) while the text is appended; True = shown.
DeltaTap = Callable[[int, str, bool, str], bool]


class _Tap:
    """One consumer waiting in `next_snapshot_tapped`: its hand, what wakes it, the revision it has
    shown, and its keepalive clock."""

    __slots__ = ("fn", "waiter", "seen", "quiet")

    def __init__(self, fn: DeltaTap, waiter: asyncio.Future[None], seen: int, quiet: Quiet) -> None:
        self.fn = fn
        self.waiter = waiter
        self.seen = seen
        self.quiet = quiet


@value
class TurnSnapshot:
    turn_id: str
    conversation_id: str
    agent_id: str
    revision: int
    status: SnapshotStatus
    phase: Phase
    stop_reason: StopReason | None
    blocks: tuple[dict[str, Any], ...]
    pending: tuple[dict[str, Any], ...]
    usage: dict[str, int]
    error: dict[str, Any] | None
    queue_position: int
    attempt: int
    updated_at: float

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES

    @property
    def settled(self) -> bool:
        """Nothing more will happen without new input (terminal, or paused awaiting an answer)."""
        return self.status != "running"

    def text(self) -> str:
        return "".join(b["text"] for b in self.blocks if b["type"] == "text")

    def reasoning(self) -> str:
        return "".join(b["text"] for b in self.blocks if b["type"] == "reasoning")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TurnSnapshot:
        """The snapshot `to_dict` described (as another server of the cluster published it)."""
        return cls(
            turn_id=str(data["turn_id"]),
            conversation_id=str(data["conversation_id"]),
            agent_id=str(data["agent_id"]),
            revision=int(data["revision"]),
            status=data["status"],
            phase=data["phase"],
            stop_reason=data.get("stop_reason"),
            blocks=tuple(data.get("blocks") or ()),
            pending=tuple(data.get("pending") or ()),
            usage=dict(data.get("usage") or {}),
            error=data.get("error"),
            queue_position=int(data.get("queue_position") or 0),
            attempt=int(data.get("attempt") or 1),
            updated_at=float(data.get("updated_at") or 0.0),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "turn_id": self.turn_id,
            "conversation_id": self.conversation_id,
            "agent_id": self.agent_id,
            "revision": self.revision,
            "status": self.status,
            "phase": self.phase,
            "stop_reason": self.stop_reason,
            "blocks": [dict(b) for b in self.blocks],
            "pending": [dict(p) for p in self.pending],
            "usage": dict(self.usage),
            "error": self.error,
            "queue_position": self.queue_position,
            "attempt": self.attempt,
            "updated_at": self.updated_at,
        }


@dataclass(slots=True)
class _Block:
    type: str  # reasoning | text | tool_call | compaction
    parts: TextParts = field(default_factory=TextParts)  # the text, or a tool call's arguments
    call_id: str | None = None
    name: str | None = None
    executor: str | None = None
    status: str | None = None
    output: str | None = None
    is_error: bool = False
    refusal: bool = False  # a text block holding the model's refusal

    def render(self) -> dict[str, Any]:
        if self.type == "tool_call":
            return {
                "type": "tool_call",
                "call_id": self.call_id,
                "name": self.name,
                "arguments": self.parts.text(),
                "executor": self.executor,
                "status": self.status,
                "output": self.output,
                "is_error": self.is_error,
            }
        if self.refusal:
            return {"type": self.type, "text": self.parts.text(), "refusal": True}
        return {"type": self.type, "text": self.parts.text()}


class TurnController:
    """The only writer of a turn's presentation state. Not thread-safe; lives on the event loop."""

    def __init__(
        self,
        turn_id: str,
        conversation_id: str,
        agent_id: str,
        *,
        revision: int = 0,
        phase: Phase = "queued",
        queue_position: int = 0,
    ) -> None:
        self.turn_id = turn_id
        self.conversation_id = conversation_id
        self.agent_id = agent_id
        self.revision = revision
        self.status: SnapshotStatus = "running"
        self.phase: Phase = phase
        self.stop_reason: StopReason | None = None
        self.error: dict[str, Any] | None = None
        self.usage: dict[str, int] = {}
        self.queue_position = queue_position
        self.attempt = 1
        self.pending: list[dict[str, Any]] = []
        self.last_message_id: int | None = None  # the newest message its commits stored (finish_turn)
        self._blocks: list[_Block] = []
        self._calls: dict[str, _Block] = {}
        self._cached: TurnSnapshot | None = None
        self._mirrored: TurnSnapshot | None = None  # see mirror()
        self._signal: Latest[int] = Latest(revision, revision)
        # Only the changes wait_settled cares about (paused with pending calls, finished): a
        # waiter for the outcome sleeps through every text delta.
        self._settle: Latest[int] = Latest(revision, revision)
        self._taps: list[_Tap] = []  # consumers waiting with a hand for text deltas (next_snapshot_tapped)

    # ------------------------------------------------------------ reduce

    def apply(self, event: TurnEvent) -> None:
        if self.status in TERMINAL_STATUSES:
            return
        if isinstance(event, TextDelta):
            # A delta that only continues the last block, in the same phase, is offered to the
            # tapped consumers (the usual streamed token): `_bump` with its block and text.
            same = self.phase == "responding"
            self.phase = "responding"
            if self._append("text", event.text, event.refusal) and same and self._taps:
                self._bump(len(self._blocks) - 1, event.text)
                return
        elif isinstance(event, ReasoningDelta):
            same = self.phase == "reasoning"
            self.phase = "reasoning"
            if self._append("reasoning", event.text) and same and self._taps:
                self._bump(len(self._blocks) - 1, event.text)
                return
        elif isinstance(event, ToolCallArgsDelta):
            block = self._calls.get(event.call_id)
            if block is None:
                return
            block.parts.add(event.delta)
        elif isinstance(event, ToolCallStarted):
            block = _Block(
                "tool_call", call_id=event.call_id, name=event.name, executor=event.executor, status="streaming"
            )
            self._blocks.append(block)
            self._calls[event.call_id] = block
            self.phase = "acting"
        elif isinstance(event, ToolCallStatus):
            block = self._calls.get(event.call_id)
            if block is None:
                return
            if block.status == "streaming" and block.executor == "server" and event.status in ANNOUNCED:
                _announce(block)
            block.status = event.status
            if event.output is not None:
                block.output = event.output
                block.is_error = event.is_error
        elif isinstance(event, PhaseChanged):
            if self.phase == event.phase:
                return
            self.phase = event.phase
        elif isinstance(event, UsageUpdated):
            self.usage = dict(event.usage)
        elif isinstance(event, Retrying):
            self.phase = "retrying"
            self.attempt = event.attempt + 1
            self.error = event.error
        elif isinstance(event, StepStarted):
            if self.phase in ("queued", "retrying"):
                self.phase = "reasoning" if self.phase == "queued" else self.phase
            if self.error is not None and self.phase != "retrying":
                self.error = None
        elif isinstance(event, StreamDiscarded):
            return
        elif isinstance(event, Compacted):
            self._blocks.append(_Block("compaction", TextParts(event.summary)))
            self.phase = "compacting"
        else:  # pragma: no cover - exhaustive over TurnEvent
            return
        self._bump()

    def _append(self, kind: str, text: str, refusal: bool = False) -> bool:
        """True when `text` continued the last block, False when it began a new one."""
        last = self._blocks[-1] if self._blocks else None
        if last is not None and last.type == kind and last.refusal == refusal:
            last.parts.add(text)
            return True
        self._blocks.append(_Block(kind, TextParts(text), refusal=refusal))
        return False

    def _bump(self, index: int = -1, text: str = "") -> None:
        """A new revision: consumers wake. `index` >= 0: the change is only `text` appended to that
        block, which a tapped consumer may show at once (and then sleeps on)."""
        self.revision += 1
        self._cached = None
        if self._taps:
            self._offer(index, text)
        self._signal.publish(self.revision, version=self.revision)

    def _offer(self, index: int, text: str) -> None:
        """Offer the change just made to each tapped consumer: one that was caught up (had shown
        the revision before) and shows the delta stays asleep; every other one wakes, and reads the
        snapshot as an untapped consumer would."""
        revision = self.revision
        block = self._blocks[index] if index >= 0 else None
        kept: list[_Tap] = []
        for tap in self._taps:
            waiter = tap.waiter
            if waiter.done():
                continue
            shown = False
            if block is not None and tap.seen == revision - 1:
                try:
                    shown = tap.fn(index, block.type, block.refusal, text)
                except Exception:  # the consumer's own failure: it wakes and goes the usual way
                    log.exception("a turn's delta tap failed")
            if shown:
                tap.seen = revision
                tap.quiet.activity()
                kept.append(tap)
            else:
                waiter.set_result(None)
        self._taps = kept

    def _wake_taps(self) -> None:
        taps, self._taps = self._taps, []
        for tap in taps:
            if not tap.waiter.done():
                tap.waiter.set_result(None)

    # ------------------------------------------------------------ lifecycle-driven changes

    def set_queue_position(self, position: int) -> None:
        if self.queue_position != position:
            self.queue_position = position
            self._bump()

    def set_pending(self, pending: list[PendingCall]) -> None:
        self.pending = [_announced_pending(p.to_dict()) for p in pending if p.status == "pending"]
        self._mark_answered_blocks(pending)
        self._bump()
        self._settle.publish(self.revision, version=self.revision)

    def pause(self, stop_reason: StopReason, pending: list[PendingCall]) -> None:
        self.status = "awaiting"
        self.phase = "awaiting"
        self.stop_reason = stop_reason
        self.set_pending(pending)

    def resume(self, phase: Phase = "acting") -> None:
        """Leave the pause: `acting` to run the answered calls, `finalizing` to close them (the
        paused turn was cancelled); either way no call is pending any more."""
        self.status = "running"
        self.phase = phase
        self.stop_reason = None
        self.pending = []
        self._bump()

    def finish(self, status: TerminalStatus, stop_reason: StopReason, error: dict[str, Any] | None = None) -> None:
        """Publish the terminal state. Called once, after the store commit."""
        self.status = status
        self.phase = "finalizing"
        self.stop_reason = stop_reason
        self.error = error
        self.pending = []
        self.queue_position = 0  # an ended turn waits in no queue (also one dropped before it started)
        self.revision += 1
        self._cached = None
        if self._taps:
            self._wake_taps()
        self._signal.publish(self.revision, version=self.revision, final=True)
        self._settle.publish(self.revision, version=self.revision, final=True)

    def mirror(self, snap: TurnSnapshot) -> bool:
        """Take a whole snapshot another server published for a turn it runs (the cluster): this
        controller then only follows, latest wins (an older revision is ignored). True if taken."""
        if self.status in TERMINAL_STATUSES:
            return False
        if snap.revision <= self.revision:
            # An older revision is ignored, unless it is the first one taken or the turn's end (a
            # survivor closing a killed server's turn numbers it from the store, below what the
            # runner published): never let the revision go back.
            if self._mirrored is not None and not snap.terminal:
                return False
            snap = _with_revision(snap, self.revision + 1)
        self.revision = snap.revision
        self.status = snap.status
        self.phase = snap.phase
        self.stop_reason = snap.stop_reason
        self.error = snap.error
        self.usage = dict(snap.usage)
        if snap.terminal and snap.queue_position:
            snap = replace(snap, queue_position=0)  # as finish(): an ended turn waits in no queue
        self.queue_position = snap.queue_position
        self.attempt = snap.attempt
        self.pending = [dict(p) for p in snap.pending]
        self._mirrored = self._cached = snap
        final = snap.terminal
        if self._taps:
            self._wake_taps()
        self._signal.publish(self.revision, version=self.revision, final=final)
        if snap.settled:
            self._settle.publish(self.revision, version=self.revision, final=final)
        return True

    # ------------------------------------------------------------ read

    def visible_text(self) -> str:
        if self._mirrored is not None:
            return self._mirrored.text()
        return "".join([b.parts.text() for b in self._blocks if b.type == "text"])

    def draft(self, skip: int = 0) -> dict[str, Any]:
        """The crash checkpoint: visible text past the first `skip` characters (those are stored)."""
        return {"text": self.visible_text()[skip:], "revision": self.revision}

    def snapshot(self) -> TurnSnapshot:
        if self._mirrored is not None:
            return self._mirrored
        snap = self._cached
        if snap is None or snap.revision != self.revision:
            snap = self._cached = TurnSnapshot(
                turn_id=self.turn_id,
                conversation_id=self.conversation_id,
                agent_id=self.agent_id,
                revision=self.revision,
                status=self.status,
                phase=self.phase,
                stop_reason=self.stop_reason,
                blocks=tuple([b.render() for b in self._blocks]),
                pending=tuple(self.pending),
                usage=dict(self.usage),
                error=self.error,
                queue_position=self.queue_position,
                attempt=self.attempt,
                updated_at=time.time(),
            )
        return snap

    async def next_snapshot(self, seen_revision: int, timeout: float | None = None) -> TurnSnapshot:
        """Wait for a revision newer than `seen_revision` and return the newest snapshot."""
        await self._signal.wait_newer(seen_revision, timeout)
        return self.snapshot()

    async def next_snapshot_or_quiet(self, seen_revision: int, quiet: Quiet) -> TurnSnapshot | None:
        """The newest snapshot once newer than `seen_revision`, or None when `quiet` fell due first."""
        if await self._signal.wait_newer_or_quiet(seen_revision, quiet):
            return self.snapshot()
        return None

    async def next_snapshot_tapped(
        self, seen_revision: int, quiet: Quiet, tap: DeltaTap
    ) -> tuple[TurnSnapshot | None, int]:
        """As `next_snapshot_or_quiet`, for a consumer that can show a text delta synchronously:
        while it waits caught up, each delta that only continues a block (the usual streamed token)
        is handed to `tap` as it is applied, and one `tap` shows (returns True) does not wake it.
        Any other change, a delta `tap` declines, or one it could not be offered (the consumer was
        behind) wakes it, and it gets the snapshot. Returns (the snapshot, or None when `quiet`
        fell due with nothing newer than shown, the revision shown so far)."""
        if self.revision > seen_revision or self._mirrored is not None or self._signal.closed:
            snap = await self.next_snapshot_or_quiet(seen_revision, quiet)
            return snap, seen_revision if snap is None else snap.revision
        if quiet.due:
            quiet.due = False
            return None, seen_revision
        waiter = quiet.waiter = asyncio.get_running_loop().create_future()
        entry = _Tap(tap, waiter, seen_revision, quiet)
        self._taps.append(entry)
        try:
            await waiter
        finally:
            quiet.waiter = None
            if entry in self._taps:  # woken by the clock, or cancelled: no hand left behind
                self._taps.remove(entry)
        if self.revision > entry.seen:
            quiet.activity()
            snap = self.snapshot()
            return snap, snap.revision
        quiet.due = False
        return None, entry.seen

    async def wait_settled(self, timeout: float | None = None, *, after_revision: int = -1) -> TurnSnapshot:
        """Wait until the turn is terminal or awaiting an answer (at a revision > after_revision)."""

        def waiting() -> bool:
            return (
                self.status == "running" or self.revision <= after_revision
            ) and self.status not in TERMINAL_STATUSES

        if waiting():
            if timeout is None:
                while waiting():
                    await self._settle.wait_newer(self._settle.version)
            else:
                async with asyncio.timeout(timeout):  # no extra task per wait, unlike wait_for
                    while waiting():
                        await self._settle.wait_newer(self._settle.version)
        return self.snapshot()

    # ------------------------------------------------------------ rebuild from the store

    def load_messages(self, messages: list[MessageRecord]) -> None:
        """Rebuild blocks from a turn's committed messages (after a restart, or for a finished turn)."""
        for m in messages:
            if m.role == "assistant":
                if m.reasoning:
                    self._append("reasoning", m.reasoning)
                text, refusal = m.text(), m.meta.get("refusal")
                if isinstance(refusal, str) and refusal and text.endswith(refusal):
                    text = text[: len(text) - len(refusal)]  # the answer before the refusal
                else:
                    refusal = ""
                if text:
                    self._append("text", text)
                if refusal:
                    self._append("text", refusal, True)
                for c in m.tool_calls:
                    block = _Block(
                        "tool_call",
                        TextParts(c.get("arguments", "")),
                        call_id=c["id"],
                        name=c["name"],
                        executor=c.get("executor", "server"),
                        status="streaming",
                    )
                    self._blocks.append(block)
                    self._calls[c["id"]] = block
            elif m.role == "tool" and m.tool_call_id in self._calls:
                block = self._calls[m.tool_call_id]
                block.status = "failed" if m.is_error else "completed"
                block.output = m.text()
                block.is_error = m.is_error
            elif m.role == "compaction":
                self._blocks.append(_Block("compaction", TextParts(m.text())))
        self._cached = None

    def share_texts(self, messages: list[MessageRecord]) -> None:
        """Keep the committed messages' own strings where a block holds an equal text (the reply,
        its reasoning, a call's arguments): a settled turn's text is then in memory once, in its
        history message, not also as the copy its snapshot joined from the streamed pieces."""
        if self._mirrored is not None:
            return
        texts: list[str] = []
        arguments: dict[str, str] = {}
        for m in messages:
            if m.role != "assistant":
                continue
            texts.extend(t for t in (m.content, m.reasoning) if isinstance(t, str) and t)
            for c in m.tool_calls:
                if isinstance(c.get("arguments"), str):
                    arguments[c["id"]] = c["arguments"]
        if not texts and not arguments:
            return
        for block in self._blocks:
            if block.type == "tool_call":
                candidates = [arguments[block.call_id]] if block.call_id in arguments else []
            elif block.type in ("text", "reasoning"):
                candidates = texts
            else:
                continue
            mine = block.parts.text() if candidates else ""
            for text in candidates:
                if text is not mine and len(text) == len(mine) and text == mine:
                    block.parts = TextParts(text)  # the next snapshot (the settled one) renders it
                    break

    def settle_calls(self, messages: list[MessageRecord]) -> None:
        """Give each tool-call block still without its outcome the result its turn committed (a
        call the end closed, e.g. approved and then cancelled before it ran): a settled snapshot
        never shows a call pending or running, and says what the history says."""
        for m in messages:
            if m.role != "tool" or m.tool_call_id is None:
                continue
            block = self._calls.get(m.tool_call_id)
            if block is None or block.output is not None:
                continue
            block.status = "failed" if m.is_error else "completed"
            block.output = m.text()
            block.is_error = m.is_error
            self._cached = None

    def mark_pending_blocks(self, pending: list[PendingCall]) -> None:
        for p in pending:
            block = self._calls.get(p.call_id)
            if block is not None and p.status == "pending":
                block.status = "pending_approval" if p.kind == "approval" else "awaiting_client"
                if p.kind == "approval":
                    _announce(block)
        self._cached = None

    def _mark_answered_blocks(self, pending: list[PendingCall]) -> None:
        """A call answered while its turn still waits for another one (answers come one at a time)
        leaves `pending`: its block says how it was answered at once, as `pending` does, not only
        once the turn resumes. An approval shows `approved`, `denied` or `expired` with no output
        yet (what it returns comes when the turn runs it, or closes it); a client call's result is
        its output already (`completed`, or `failed` for an error result), as the turn will
        commit it. A cancelled call is left to the cancel, which closes it with its result."""
        for p in pending:
            block = self._calls.get(p.call_id)
            if block is None or block.output is not None or block.status not in WAITING:
                continue
            if p.kind == "client" and p.status == "result":
                block.status = "failed" if p.is_error else "completed"
                block.output = p.output or ""
                block.is_error = p.is_error
            elif p.status in ANSWERED_STATUS:
                block.status = ANSWERED_STATUS[p.status]
                if p.kind == "approval":
                    _announce(block)
            else:
                continue
            self._cached = None


# The statuses of a call's block while it waits for its answer (`streaming`: as rebuilt from the
# store, before `mark_pending_blocks`).
WAITING = ("streaming", "pending_approval", "awaiting_client")
# A pending call's answer (store status) → its block's status until the turn resumes. "result" on
# an approval: approved in the conversation this one was forked from, its result reused there.
ANSWERED_STATUS = {"approved": "approved", "result": "approved", "denied": "denied", "expired": "expired"}


def answered_unrun(block: dict[str, Any]) -> bool:
    """A rendered tool_call block of a call that was answered but has not run or been closed yet
    (its turn waits for other answers, or is just resuming): `approved`, `denied` or `expired`
    with no output."""
    return block.get("status") in ("approved", "denied", "expired") and block.get("output") is None


# A server tool call's arguments are shown as the canonical form of what runs (agent/tools.py
# `canonical_arguments`, as the loop stores them) once the call is announced: asked for approval or
# run. While they stream they are the model's text; a call refused as invalid keeps that text.
ANNOUNCED = ("pending_approval", "running")


def _announce(block: _Block) -> None:
    text = block.parts.text()
    shown = announced_arguments(text)
    if shown is not None and shown != text:
        block.parts = TextParts(shown)


def _announced_pending(p: dict[str, Any]) -> dict[str, Any]:
    """A pending approval as announced: its arguments in canonical form (also of a call a server
    before this one stored as the model wrote it)."""
    if p.get("kind") == "approval" and isinstance(p.get("arguments"), str):
        shown = announced_arguments(p["arguments"])
        if shown is not None:
            p["arguments"] = shown
    return p


def _with_revision(snap: TurnSnapshot, revision: int) -> TurnSnapshot:
    return replace(snap, revision=revision)
