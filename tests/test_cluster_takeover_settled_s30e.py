"""A take-over that loses the race to the gone server's own commit publishes the stored end.

Found with two servers: A (the holder) was stopped (SIGSTOP) in the middle of the transaction
that commits a turn's end, B judged it gone and took the conversation over, and A's transaction
committed once A went on, after B had read the turn `running` and before B's settle. B's settle
was refused (`TurnSettledElsewhere`) and B published the turn `failed` (`taken_over`) while the
database held it `completed` with its reply; the cluster sweep failed with a traceback and the
turn queued behind it was not taken up. docs/scale-out.md promises the clients of a taken-over
server the end the turn really had, so nobody sends again an input that did run.

Here the race is made without timing luck: the test plays A with a connection of its own. A
holds the conversation (a live `instances` row and the lease), its turn is `running`; the test
opens A's end transaction (the turn `completed`, its messages written: the row stays locked until
it commits), then deletes A's row (judged gone) and lets B take the conversation over. B reads
the turn `running` and its settle waits on A's row lock; the test commits A's transaction then,
as A did when it was continued.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import psycopg
import pytest

from appserver.config import load_config
from appserver.ids import new_id
from appserver.runtime import SubmitRequest
from appserver.runtime.snapshot import TurnSnapshot
from appserver.server import Server
from appserver.store.records import TurnRecord
from tests.support.pg import require_postgres, temp_database

pytestmark = pytest.mark.timeout(120)

FAST = {"APPSERVER_STORE__HEARTBEAT_S": "0.2", "APPSERVER_STORE__INSTANCE_TIMEOUT_S": "10"}
REPLY = "the answer A committed"


async def _serve(home: Path, url: str) -> Server:
    server = Server(load_config(home, environ={"APPSERVER_STORE__URL": url, **FAST}))
    await server.open(serve=True)  # joins the database's cluster of servers
    return server


async def _until(check: Callable[[], Awaitable[bool]], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


class Ends:
    """Every snapshot server B settles and publishes (the kernel's settle listeners: its
    subscribers and the other servers hear these)."""

    def __init__(self, server: Server) -> None:
        self.snapshots: list[TurnSnapshot] = []
        server.kernel.on_settled(self._heard)

    def _heard(self, record: TurnRecord, snapshot: TurnSnapshot) -> None:
        self.snapshots.append(snapshot)

    def of(self, turn_id: str) -> list[TurnSnapshot]:
        return [s for s in self.snapshots if s.turn_id == turn_id]

    async def ended(self, turn_id: str) -> TurnSnapshot:
        async def seen() -> bool:
            return any(s.terminal for s in self.of(turn_id))

        await _until(seen, f"the end of {turn_id}")
        return [s for s in self.of(turn_id) if s.terminal][-1]


async def _conversation_of_b(b: Server) -> tuple[str, str]:
    """A conversation and its agent, made through B, then let go (so A can hold it)."""
    warm = await b.kernel.submit(SubmitRequest(agent="assistant", input="hi", conversation="new"))
    assert (await warm.wait(15)).status == "completed"
    conv = warm.conversation_id
    turn = await b.store.get_turn(warm.turn_id)
    assert turn is not None
    assert b.kernel.evict_idle(0) >= 1
    return conv, turn.agent_id


async def _a_holds(side: psycopg.AsyncConnection, instance: str, conv: str) -> None:
    """Server A, live (its heartbeat ahead, so no sweep of B judges it meanwhile), holds `conv`."""
    await side.execute(
        "INSERT INTO instances(id, host, pid, address, lock_key, started_at, heartbeat_at) "
        "VALUES (%s, 'a-host', 1, '', 4242, extract(epoch from now()), extract(epoch from now()) + 3600)",
        (instance,),
    )

    async def lease_let_go() -> bool:  # B's release of its own lease runs in the background
        cur = await side.execute("SELECT 1 FROM conversation_owners WHERE conversation_id = %s", (conv,))
        return await cur.fetchone() is None

    await _until(lease_let_go, "B to let go of the conversation")
    await side.execute(
        "INSERT INTO conversation_owners(conversation_id, instance_id, token, since) "
        "VALUES (%s, %s, 'a-token', extract(epoch from now()))",
        (conv, instance),
    )


async def _turn(
    side: psycopg.AsyncConnection, conv: str, agent_id: str, status: str, text: str, owner: str | None
) -> str:
    turn_id = new_id("turn")
    now = time.time()
    await side.execute(
        "INSERT INTO turns(id, conversation_id, agent_id, status, input, owner, revision, created_at, started_at) "
        "VALUES (%s, %s, %s, %s, %s, %s, 7, %s, %s)",
        (turn_id, conv, agent_id, status, json.dumps({"content": text}), owner, now, now if owner else None),
    )
    return turn_id


async def _take_over_racing(
    b: Server, side: psycopg.AsyncConnection, a_end: psycopg.AsyncConnection, instance: str, conv: str
) -> None:
    """A is judged gone (its row deleted, as a survivor's sweep does) while its transaction
    `a_end` is open; B takes the conversation over (as its sweep does, which may come first);
    once one of B's writes waits on A's row lock, A goes on and its transaction commits."""
    await side.execute("DELETE FROM instances WHERE id = %s", (instance,))
    take_over = asyncio.ensure_future(b.kernel.catch_up(conv))

    async def b_waits_on_a() -> bool:
        cur = await side.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        row = await cur.fetchone()
        return bool(row and row[0])

    try:
        await _until(b_waits_on_a, "a write of B to wait on A's transaction")
    except BaseException:
        take_over.cancel()
        raise
    await a_end.commit()
    await asyncio.wait_for(take_over, 20)  # it goes on (was: TurnSettledElsewhere, the sweep failed)


async def test_a_running_turn_whose_end_commits_during_the_take_over_ends_as_stored(tmp_path: Path) -> None:
    require_postgres()
    with temp_database("takeover_settled") as url:
        b = await _serve(tmp_path / "b", url)
        try:
            ends = Ends(b)
            conv, agent_id = await _conversation_of_b(b)
            instance = new_id("inst")
            async with await psycopg.AsyncConnection.connect(url, autocommit=True) as side:
                await _a_holds(side, instance, conv)
                running = await _turn(side, conv, agent_id, "running", "question", instance)
                queued = await _turn(side, conv, agent_id, "queued", "next", None)  # accepted on B, behind it
                async with await psycopg.AsyncConnection.connect(url) as a_end:
                    # A's end of its turn, in flight: the row is locked until it commits
                    await a_end.execute(
                        "UPDATE turns SET status='completed', stop_reason='end_turn', revision=12, "
                        "input_committed=TRUE, draft=NULL, ended_at=extract(epoch from now()) WHERE id=%s",
                        (running,),
                    )
                    for role, content in (("user", "question"), ("assistant", REPLY)):
                        await a_end.execute(
                            "INSERT INTO messages(conversation_id, turn_id, iteration, role, content, created_at) "
                            "VALUES (%s, %s, 1, %s, %s, extract(epoch from now()))",
                            (conv, running, role, json.dumps(content)),
                        )
                    await _take_over_racing(b, side, a_end, instance, conv)

            end = await ends.ended(running)
            assert (end.status, end.stop_reason, end.error) == ("completed", "end_turn", None)
            assert end.text() == REPLY
            # never a failure of the turn that ran (was: failed, taken_over)
            assert [s.status for s in ends.of(running)] == ["completed"]
            # the turn queued behind it is taken up and runs here
            after = await ends.ended(queued)
            assert after.status == "completed", after.error
            turns = {t.id: t.status for t in await b.store.list_turns(conv)}
            assert (turns[running], turns[queued]) == ("completed", "completed")
            # a client asking B afterwards is told the same end
            assert (await b.kernel.turn_snapshot(running)).text() == REPLY
        finally:
            await b.close()


async def test_a_queued_turn_withdrawn_on_the_gone_server_during_the_take_over_ends_as_stored(
    tmp_path: Path,
) -> None:
    """The queued case: B takes up a queued turn that A's in-flight transaction withdrew (its
    client left); B's start of it is refused, and B publishes the stored end, not a failure."""
    require_postgres()
    with temp_database("takeover_withdrawn") as url:
        b = await _serve(tmp_path / "b", url)
        try:
            ends = Ends(b)
            conv, agent_id = await _conversation_of_b(b)
            instance = new_id("inst")
            withdrawn = {"kind": "withdrawn", "message": "its client went away; it was dropped", "retryable": False}
            async with await psycopg.AsyncConnection.connect(url, autocommit=True) as side:
                await _a_holds(side, instance, conv)
                queued = await _turn(side, conv, agent_id, "queued", "never run", None)
                async with await psycopg.AsyncConnection.connect(url) as a_end:
                    await a_end.execute(
                        "UPDATE turns SET status='cancelled', stop_reason='cancelled', error=%s, revision=9, "
                        "ended_at=extract(epoch from now()) WHERE id=%s",
                        (json.dumps({**withdrawn, "status": None}), queued),
                    )
                    await _take_over_racing(b, side, a_end, instance, conv)

            end = await ends.ended(queued)
            assert (end.status, (end.error or {}).get("kind")) == ("cancelled", "withdrawn")  # was: failed, taken_over
            assert [s.status for s in ends.of(queued) if s.terminal] == ["cancelled"]
            stored = await b.store.get_turn(queued)
            assert stored is not None and stored.status == "cancelled"
            # the conversation goes on here
            nxt = await b.kernel.submit(SubmitRequest(agent="assistant", input="after", conversation=conv))
            assert (await nxt.wait(15)).status == "completed"
        finally:
            await b.close()
