"""How a turn (segment) ends, decided before anything is written: the typed outcome `TurnEnd`
and the messages a turn that stopped early keeps. Pure functions; `finish_turn`
(runtime/finish.py) is the one place that then commits, settles and publishes it."""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from typing import Any, cast

from appserver.agent.loop import LoopOutcome, TurnWork, resolution_text
from appserver.config import Config
from appserver.runtime.types import StopReason
from appserver.store.base import StoreUnavailable, TurnSettledElsewhere
from appserver.store.groupcommit import is_locked
from appserver.store.records import MessageRecord, PendingCall, TurnCommit, TurnRecord, TurnStatus
from appserver.values import value

CANCELLED_UNANSWERED = "The turn was cancelled before this call was answered; it was not executed."


@value
class TurnEnd:
    """A turn's tagged result. `commit` is what the store must write first; None when nothing may
    be written (the turn was never accepted, or its commit failed)."""

    status: TurnStatus
    stop_reason: StopReason
    error: dict[str, Any] | None = None
    commit: TurnCommit | None = None


# The system/developer messages a turn's input carries (`TurnRecord.input["system"]`, from a
# Responses request's input: [{"role": "system" | "developer", "text": …}]), written before its
# user message.
INPUT_SYSTEM_ROLES = ("system", "developer")


def input_messages(turn: TurnRecord) -> list[MessageRecord]:
    """The messages a turn's input writes into its conversation: the system/developer messages sent
    with it (a developer one is a `system` message with meta role `developer`), then its user
    message. The one place that makes them: the worker (run.py) and the crash settle (kernel.py)."""
    out: list[MessageRecord] = []
    system = turn.input.get("system")
    for s in system if isinstance(system, list) else ():
        if not isinstance(s, dict) or not isinstance(s.get("text"), str) or s.get("role") not in INPUT_SYSTEM_ROLES:
            continue
        meta = {"role": "developer"} if s["role"] == "developer" else {}
        out.append(MessageRecord(role="system", content=s["text"], turn_id=turn.id, source=turn.source, meta=meta))
    out.append(MessageRecord(role="user", content=turn.input.get("content", ""), turn_id=turn.id, source=turn.source))
    return out


def store_failure(reason: object) -> TurnEnd:
    """The turn could not be saved: it ends failed with nothing written. Error kind `taken_over`
    when another server of the cluster took its conversation over (HTTP says 503 for it);
    `store_unavailable` when the database could not take the write (it ended the connection, or
    another process holds the SQLite file locked): HTTP says 503 `store_unavailable`."""
    kind = (
        "taken_over"
        if isinstance(reason, TurnSettledElsewhere)
        else "store_unavailable"
        if isinstance(reason, StoreUnavailable) or (isinstance(reason, BaseException) and is_locked(reason))
        else "store"
    )
    return TurnEnd(
        "failed",
        "error",
        {"kind": kind, "message": f"the turn could not be saved: {reason}", "retryable": False, "status": None},
    )


def deleted(why: str) -> TurnEnd:
    """The turn's conversation is gone from the store (its agent was deleted, by another process):
    it ends failed with nothing written. Error kind `store`, as a commit that found the rows gone
    says (HTTP answers it as the model not existing)."""
    return TurnEnd(
        "failed",
        "error",
        {"kind": "store", "message": f"{why}; nothing of the turn was saved", "retryable": False, "status": None},
    )


# What each damaged column of a turn is to its reader (records.py TURN_RUN_COLUMNS)
DAMAGED_WORDS = {"input": "input", "client_tools": "client tools", "options": "request options"}


def damaged_text(record: TurnRecord, store: str) -> str:
    """Why a turn with damaged stored columns (`TurnRecord.damaged`) was not run, naming them and
    the turn's row, and what to do."""
    words = [DAMAGED_WORDS.get(c, c) for c in record.damaged]
    verb = "is" if words == ["input"] else "are"
    return (
        f"the turn was not run: its stored {' and '.join(words)} {verb} damaged (turns row {record.id!r}): "
        f"restore {store} from a backup"
    )


def _ended_damaged(name: str) -> str:
    return f"The turn ended before the call to {name} had a result: the turn's stored data is damaged."


def damaged(record: TurnRecord, history: list[MessageRecord], revision: int, store: str) -> TurnEnd:
    """A turn whose stored input, client tools or options are damaged never runs (the stand-ins it
    reads with would send a raw JSON text as the prompt, or run on the server a call meant for the
    client's tool of the same name): it ends failed, error kind `store`, writing nothing of them (a
    queued turn's input stays out of the history). A paused one's calls in `history` each get a
    result saying the turn ended, so the history stays valid for every provider."""
    error = {"kind": "store", "message": damaged_text(record, store), "retryable": False, "status": None}
    answered = {m.tool_call_id for m in history if m.role == "tool"}
    closing: list[MessageRecord] = []
    for m in history:
        if m.role == "assistant" and m.turn_id == record.id:
            closing.extend(close_unanswered(m, record.id, answered, _ended_damaged))
    commit = TurnCommit(
        record.id,
        "failed",
        "error",
        closing,
        error=error,
        usage=dict(record.usage),
        revision=revision,
        iteration=record.iteration,
        input_committed=record.input_committed,
    )
    return TurnEnd("failed", "error", error, commit)


def withdrawn(
    turn_id: str, revision: int, why: str, *, usage: dict[str, int] | None = None, iteration: int = 0
) -> TurnEnd:
    """An input dropped before it started or showed anything (its client went away): closed as
    cancelled, error kind `withdrawn`, nothing of it written to the history. `usage`, `iteration`:
    of a turn that began (its model call cut short)."""
    error = {"kind": "withdrawn", "message": f"{why}; it was dropped", "retryable": False, "status": None}
    commit = TurnCommit(
        turn_id,
        "cancelled",
        "cancelled",
        [],
        error=error,
        usage=dict(usage or {}),
        revision=revision,
        iteration=iteration,
        input_committed=False,
    )
    return TurnEnd("cancelled", "cancelled", error, commit)


# Why a running turn's input was withdrawn (`left_unseen`): the error of its end, and its log line.
LEFT_UNSEEN = "its client went away before the turn showed or did anything"


def left_unseen(work: TurnWork | None, blocks: Sequence[dict[str, Any]]) -> bool:
    """A running turn stopped because its HTTP client went away showed and did nothing yet: no
    text or reasoning published (`blocks`, its snapshot's, hold no text, no tool call and no
    compaction), no call begun, nothing of it checkpointed (its new messages are its input alone,
    and no message of it is in the history `work` read). Such a turn leaves nothing in the history
    (`withdrawn`), as an input withdrawn from the queue: its client never saw it taken in, and its
    retry adds the input again. `work` None: the loop never began."""
    if any(b.get("type") not in ("text", "reasoning") or b.get("text") for b in blocks):
        return False
    if work is None:
        return True
    if work.started_calls or any(m.turn_id == work.turn_id for m in work.history):
        return False
    return all(m.role in ("user", "system") and m.turn_id == work.turn_id for m in work.new_messages)


def acked_unseen(turn: TurnRecord, history: Sequence[MessageRecord]) -> bool:
    """A turn a dead server left running whose cancel it acknowledged as its client's leaving
    before the turn showed or did anything (`cancel_ack` `withdraw`, saved by `save_cancel` when
    `left_unseen`): nothing of it stored since (its input not committed, no draft text, no message
    of it in `history`), so the restart withdraws it as that server would have."""
    ack = turn.cancel_ack
    if not isinstance(ack, dict) or ack.get("withdraw") is not True or turn.input_committed:
        return False
    if (turn.draft or {}).get("text"):
        return False
    return not any(m.turn_id == turn.id for m in history)


def loop_end(turn_id: str, work: TurnWork, outcome: LoopOutcome, revision: int) -> TurnEnd:
    """The end of a segment the agent loop ran: its messages made valid for every provider, and
    a turn that streamed a tool call never ending with `end_turn`."""
    # The loop carries its stop reason as a plain `str` (it sits below the runtime's words); it
    # only ever returns one of `StopReason`.
    status, stop_reason, error = outcome.status, cast(StopReason, outcome.stop_reason), outcome.error
    messages = work.new_messages
    if status in ("cancelled", "interrupted", "failed"):
        messages = settle_messages(
            work, "interrupted" if status == "interrupted" else "cancelled" if status == "cancelled" else "incomplete"
        )
    if status == "failed" and (error or {}).get("kind") == "context_overflow":
        # Too long for the model: the conversation does not keep the system/developer messages of
        # its input (not yet kept: a turn checkpointed before a tool ran already keeps them). Kept,
        # they would make every later turn as long; its user message stays, as a failed turn's does.
        messages = [m for m in messages if not (m.role == "system" and m.turn_id == turn_id)]
    if stop_reason == "end_turn" and messages:
        last = next((m for m in reversed(messages) if m.role == "assistant"), None)
        if last is not None and last.tool_calls:
            status, stop_reason = "failed", "error"
            error = {
                "kind": "internal",
                "message": "the turn streamed a tool call but tried to end with end_turn",
                "retryable": False,
                "status": None,
            }
    commit = TurnCommit(
        turn_id=turn_id,
        status=status,  # type: ignore[arg-type]
        stop_reason=stop_reason,
        messages=messages,
        pending=work.pending if status == "awaiting" else [],
        error=error,
        usage=dict(work.usage),
        revision=revision,
        iteration=work.iteration,
    )
    return TurnEnd(commit.status, stop_reason, error, commit)


def server_stopped() -> dict[str, Any]:
    """The error of a turn the server's stop interrupted, whether it stopped gracefully (the turn
    cancelled on the way out) or died (the turn closed at the next start): every reader of the
    turn (a client, a cron run's log, `conversations history`) is told why it ended."""
    return {
        "kind": "interrupted",
        "message": "the server stopped while this turn was running",
        "retryable": False,
        "status": None,
    }


def halted(stopping: bool) -> LoopOutcome:
    """How a turn ends that was stopped from outside: interrupted when the server is stopping,
    else cancelled (a client asked)."""
    return (
        LoopOutcome("interrupted", "cancelled", server_stopped()) if stopping else LoopOutcome("cancelled", "cancelled")
    )


def cancel_wins(work: TurnWork) -> LoopOutcome:
    """The loop ended after a cancel was accepted (say a tool swallowed it): the turn ends
    cancelled as promised, and its last reply says so too."""
    work.pending = []
    for m in reversed(work.new_messages):
        if m.role == "assistant":
            if not m.tool_calls:
                m.completion_status = "cancelled"
            break
    return LoopOutcome("cancelled", "cancelled")


def stopped_text(name: str) -> str:
    return f"The call to {name} was stopped before it returned a result."


def not_run_text(name: str) -> str:
    return f"The call to {name} was not executed: the turn stopped before it ran."


def close_unanswered(
    assistant: MessageRecord,
    turn_id: str,
    answered: set[str | None],
    text: Callable[[str], str],
    started: Container[str] | None = None,
) -> list[MessageRecord]:
    """A synthetic error result for each call of `assistant` not in `answered` (which it extends),
    so the history stays valid for every provider; `text(name)` says why, or, when `started` (the
    calls whose tool began to run) is known, `not_run_text` for a call not in it."""
    out: list[MessageRecord] = []
    for c in assistant.tool_calls if assistant.role == "assistant" else ():
        if c["id"] in answered:
            continue
        answered.add(c["id"])
        why = not_run_text if started is not None and c["id"] not in started else text
        out.append(call_result(assistant, turn_id, c, why(c["name"]), is_error=True))
    return out


def call_result(
    assistant: MessageRecord, turn_id: str, call: dict[str, Any], content: str, *, is_error: bool
) -> MessageRecord:
    """The `tool` message answering `call` of `assistant` with `content`."""
    return MessageRecord(
        role="tool",
        content=content,
        turn_id=turn_id,
        iteration=assistant.iteration,
        tool_call_id=call["id"],
        name=call["name"],
        is_error=is_error,
    )


def settle_messages(work: TurnWork, completion_status: str) -> list[MessageRecord]:
    """Messages to keep from a turn that stopped early, valid for every provider.

    Visible assistant text is kept (marked with `completion_status`); reasoning-only output is not;
    every tool call without a result gets a synthetic error result.
    """
    messages = list(work.new_messages)
    partial = work.partial
    if partial is not None and partial.text:
        messages.append(
            MessageRecord(
                role="assistant",
                content=partial.text.text(),
                turn_id=work.turn_id,
                iteration=work.iteration,
                completion_status=completion_status,
            )
        )
    answered = {m.tool_call_id for m in messages if m.role == "tool"}
    answered |= {m.tool_call_id for m in work.history if m.role == "tool"}
    started = work.started_calls
    out: list[MessageRecord] = []
    for m in work.history:  # a resumed turn: calls committed at the pause, answered but never run
        if m.role == "assistant" and m.turn_id == work.turn_id:
            out.extend(close_unanswered(m, work.turn_id, answered, stopped_text, started))
    for m in messages:
        out.append(m)
        out.extend(close_unanswered(m, work.turn_id, answered, stopped_text, started))
    # Results that were produced for calls of this turn stay after their call, in order.
    return out


def cancel_ack(work: TurnWork | None) -> dict[str, Any]:
    """What a cancel acknowledged for a turn saves with it (`TurnRecord.cancel_ack`), taken as the
    cancel is accepted: the calls whose tool had begun to run in `work` (the running segment, None
    when none runs), and those of them that had returned a result not saved yet. A restart after a
    crash closes the turn's calls from it as this server would have (`cancelled_results`)."""
    if work is None:
        return {"started": [], "ran": []}
    returned = {m.tool_call_id for m in work.new_messages if m.role == "tool"}
    return {"started": sorted(work.started_calls - returned), "ran": sorted(work.started_calls & returned)}


def answered_result(p: PendingCall, config: Config) -> tuple[str, bool]:
    """The one result (text, is_error) of a paused turn's call when the turn was cancelled before
    the call ran: the answer it got (approved: that it never ran), or that it was cancelled."""
    if p.status == "approved":
        text = f"The call to {p.name} was approved, but the turn was cancelled before it ran; it was not executed."
        return text, True
    if p.status == "pending":
        return CANCELLED_UNANSWERED, True
    return resolution_text(p, config), p.status != "result" or p.is_error


def ran_unsaved_text(name: str) -> str:
    return (
        f"The call to {name} returned, but the turn was cancelled and the server stopped before its result was saved."
    )


def cancelled_results(
    assistant: MessageRecord,
    turn_id: str,
    answered: set[str | None],
    ack: dict[str, Any],
    pending: dict[str, PendingCall],
    config: Config,
) -> list[MessageRecord]:
    """A result for each call of `assistant` not in `answered` (which it extends), for a turn whose
    cancel was acknowledged (`ack`, its `TurnRecord.cancel_ack`) before its server died: what that
    server would have written. A call a person or the client answered, or that was never answered,
    says so (`pending`: the turn's pending calls by id); one whose tool began that it was stopped,
    or that it returned unsaved; any other that it was not executed. Never "outcome unknown": the
    cancel stopped the turn before the crash did."""
    started, ran = ack.get("started"), ack.get("ran")
    began: set[Any] | None = None  # a damaged ack no longer says which calls began: each may have
    returned: set[Any] = set()
    if isinstance(started, list) and isinstance(ran, list):
        began, returned = set(started), set(ran)
    out: list[MessageRecord] = []
    for c in assistant.tool_calls if assistant.role == "assistant" else ():
        call_id, name = c["id"], c["name"]
        if call_id in answered:
            continue
        answered.add(call_id)
        p = pending.get(call_id)
        if p is not None and p.status != "approved":
            text, is_error = answered_result(p, config)  # never run: denied, expired, answered by the client
        elif call_id in returned:
            text, is_error = ran_unsaved_text(name), True
        elif began is None or call_id in began:
            text, is_error = stopped_text(name), True
        elif p is not None:
            text, is_error = answered_result(p, config)
        else:
            text, is_error = not_run_text(name), True
        out.append(
            MessageRecord(
                role="tool",
                content=text,
                turn_id=turn_id,
                iteration=assistant.iteration,
                tool_call_id=call_id,
                name=name,
                is_error=is_error,
            )
        )
    return out
