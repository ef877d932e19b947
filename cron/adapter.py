"""The one door from cron into the kernel: a fire becomes one typed `CronSubmission`, handed to one
function (`KernelAdapter.submit`) that turns it into a kernel `SubmitRequest`. Outcomes come back
from the turn's settled snapshot. Cron imports the kernel's public face and the store, never a
front end."""

from __future__ import annotations

from datetime import timedelta

from appserver.runtime import Kernel, SubmitRequest
from appserver.store.base import Store
from appserver.store.records import TurnRecord
from cron.runner import ClaimUnverifiable, CronSubmission, TurnOutcome
from cron.store import CronTask, Occurrence, utcnow

# How old a claim may be for "its idempotency key is not in the store" to still mean "it never
# reached the kernel". The kernel purges keys older than 48 h at every start; half of that leaves
# room for clock skew between the hosts of a cluster and for a turn accepted long after its claim.
# Past it, an unanswered claim is never resubmitted (tests/test_cron_refire.py pins it below the
# kernel's purge window).
CLAIM_VERIFIABLE_S = 24 * 3600.0


def task_run_of(turn: TurnRecord) -> str | None:
    """The id of the cron task `turn` is a run of (its `source`, as `CronSubmission.source` writes
    it), or None for any other turn."""
    source = turn.source
    if not isinstance(source, dict) or source.get("kind") != "cron_prompt":
        return None
    task_id = source.get("cron_task_id")
    return task_id if isinstance(task_id, str) and task_id else None


class KernelAdapter:
    """`fire` and `outcome` for the scheduler and "run now", backed by one kernel and its store."""

    def __init__(self, kernel: Kernel, store: Store) -> None:
        self.kernel = kernel
        self.store = store

    async def fire(self, task: CronTask, occurrence: Occurrence) -> str | None:
        """The scheduler's `fire`: name the agent the way its users do (the id when it is gone),
        build the submission, submit it."""
        agent = await self.store.get_agent(task.agent)
        return await self.submit(CronSubmission.of(task, occurrence, None if agent is None else agent.name))

    async def agent_names(self) -> dict[str, str]:
        """Agent id -> name: the scheduler's credential check judges a limit by name with them."""
        return {a.id: a.name for a in await self.store.list_agents()}

    async def submit(self, sub: CronSubmission) -> str | None:
        """Submit the `cron_prompt` turn of one occurrence; its turn id."""
        submission = await self.kernel.submit(
            SubmitRequest(
                agent=sub.agent,
                input=sub.input_text,
                conversation=sub.conversation,
                source=sub.source,
                idempotency_key=sub.idempotency_key,
            )
        )
        return submission.turn_id

    async def withdraw(self, turn_id: str, why: str) -> bool:
        """Drop a cron turn from its conversation's queue if it has not started (its task was
        removed or disabled): whether it was dropped. A turn that runs is left to finish. (The
        kernel words the dropped turn's error itself; the scheduler records `why`.)"""
        turn = await self.store.get_turn(turn_id)
        if turn is None or turn.status != "queued" or turn.started_at is not None:
            return False
        if self.kernel.active_turn(turn.conversation_id) == turn_id:
            return False
        return await self.kernel.cancel(turn.conversation_id, turn_id)

    async def claimed_turn(self, task: CronTask, occurrence: Occurrence) -> str | None:
        """The turn `occurrence` was submitted as (its idempotency key, in the scope the kernel
        keeps it), or None when it never reached the kernel. ClaimUnverifiable when the claim is
        older than the kernel is sure to keep that key: then "not found" proves nothing."""
        turn_id = await self._turn_by_key(task, occurrence)
        age = utcnow() - occurrence.fired_at
        if turn_id is None and age > timedelta(seconds=CLAIM_VERIFIABLE_S):
            raise ClaimUnverifiable(
                f"it was claimed {age.total_seconds() / 3600:.0f} h ago, longer than the kernel is sure "
                f"to keep the key that would show whether it was submitted ({CLAIM_VERIFIABLE_S / 3600:g} h)"
            )
        return turn_id

    async def _turn_by_key(self, task: CronTask, occurrence: Occurrence) -> str | None:
        sub = CronSubmission.of(task, occurrence)
        agent = await self.store.get_agent(sub.agent)
        if agent is None:
            found = await self.store.find_agents(sub.agent)
            agent = found[0] if len(found) == 1 else None
        if agent is None:
            return None
        if sub.conversation == "new":
            scope = f"new:{agent.id}"
        elif sub.conversation == "default":
            conv = await self.store.get_default_conversation(agent.id)
            if conv is None:
                return None
            scope = conv.id
        else:
            scope = sub.conversation
        turn = await self.store.lookup_idempotency(scope, sub.idempotency_key)
        for legacy in sub.legacy_idempotency_keys:
            if turn is None:
                turn = await self.store.lookup_idempotency(scope, legacy)
        return turn.id if turn is not None else None

    async def outcome(self, turn_id: str) -> TurnOutcome:
        """Wait for the turn to settle and say how it ended."""
        turn = await self.store.get_turn(turn_id)
        if turn is None:
            return TurnOutcome("unknown", f"turn {turn_id} not found")
        snap = await (await self.kernel.handle_for(turn)).wait_settled()
        error = (snap.error or {}).get("message") if snap.status != "completed" else None
        reply = snap.text().strip()
        return TurnOutcome(
            snap.status,
            error,
            {"stop_reason": snap.stop_reason, "conversation_id": snap.conversation_id},
            reply=reply or None,
        )
