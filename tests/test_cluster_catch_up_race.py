"""A pull (another server of the cluster announced a turn it accepted: `Kernel.catch_up`) that
lands while this server accepts an input of its own must not queue that input a second time, nor
settle it as interrupted: the input is this server's, and its queue is about to hold it. Found as a
flaky three-server test: one of nine turns ended `failed` (`taken_over`), because it ran from the
pull's queue entry and its own entry, refused a second start, said failed to its client."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from appserver.config import load_config
from appserver.runtime import SubmitRequest
from appserver.server import Server
from tests.support.pg import require_postgres, temp_database

pytestmark = pytest.mark.timeout(90)

FAST = {"APPSERVER_STORE__HEARTBEAT_S": "0.2", "APPSERVER_STORE__INSTANCE_TIMEOUT_S": "10"}


async def _serve(home: Path, url: str) -> Server:
    server = Server(load_config(home, environ={"APPSERVER_STORE__URL": url, **FAST}))
    await server.open(serve=True)  # joins the database's cluster of servers
    return server


async def test_a_pull_during_an_accept_here_runs_the_input_once(tmp_path: Path) -> None:
    require_postgres()
    with temp_database("catchup") as url:
        a = await _serve(tmp_path / "a", url)
        b = await _serve(tmp_path / "b", url)
        try:
            warm = await a.kernel.submit(SubmitRequest(agent="assistant", input="hi", conversation="new"))
            assert (await warm.wait(10)).status == "completed"
            conv = warm.conversation_id
            subs = []

            async def pull(after: float) -> None:
                await asyncio.sleep(after)
                await a.kernel.catch_up(conv)

            for i in range(30):
                # B's input is accepted first and announced to A (a pull); A accepts one of its
                # own meanwhile, which names B's as queued before it
                there = await b.kernel.submit(SubmitRequest(agent="assistant", input=f"b{i}", conversation=conv))
                pulls = [asyncio.ensure_future(pull(k * 0.0005)) for k in range(8)]
                here = await a.kernel.submit(SubmitRequest(agent="assistant", input=f"a{i}", conversation=conv))
                await asyncio.gather(*pulls)
                subs += [there, here]
                if i % 3 == 2:  # now and then an idle conversation: A's input is accepted running
                    await here.wait(15)
            ends = [await s.wait(30) for s in subs]
            assert [(e.status, e.error) for e in ends] == [("completed", None)] * len(subs)
            turns = await a.store.list_turns(conv)
            assert [t.status for t in turns] == ["completed"] * (len(subs) + 1)
        finally:
            await b.close()
            await a.close()


async def test_inputs_accepted_at_once_on_two_servers_run_in_acceptance_order(tmp_path: Path) -> None:
    """The holder's own input, committed first but queued here after a pull queued one another
    server accepted later, still runs first; each ack's `queue_position` says where it runs."""
    require_postgres()
    with temp_database("catchup_order") as url:
        a = await _serve(tmp_path / "a", url)
        b = await _serve(tmp_path / "b", url)
        try:
            # long enough that no turn leaves the queue while the inputs arrive (a position is the
            # count of turns ahead at the ack: one ending meanwhile lowered a later ack's position)
            warm = await a.kernel.submit(SubmitRequest(agent="assistant", input="/slow 60", conversation="new"))
            conv = warm.conversation_id
            subs = [warm]

            async def pull(after: float) -> None:
                await asyncio.sleep(after)
                await a.kernel.catch_up(conv)

            for i in range(12):
                pulls = [asyncio.ensure_future(pull(k * 0.0005)) for k in range(8)]
                pair = await asyncio.gather(
                    a.kernel.submit(SubmitRequest(agent="assistant", input=f"a{i}", conversation=conv)),
                    b.kernel.submit(SubmitRequest(agent="assistant", input=f"b{i}", conversation=conv)),
                )
                await asyncio.gather(*pulls)
                subs += pair
            ends = [await s.wait(60) for s in subs]
            assert [e.status for e in ends] == ["completed"] * len(subs)
            turns = await a.store.list_turns(conv)
            accepted = sorted(turns, key=lambda t: t.created_at)
            started = sorted(turns, key=lambda t: t.started_at or 0)
            assert [t.id for t in started] == [t.id for t in accepted]
            # the holder's acks: their positions grow with acceptance order
            order = {t.id: i for i, t in enumerate(accepted)}
            ranked = sorted(subs[1::2], key=lambda s: order[s.turn_id])
            assert [s.queue_position for s in ranked] == sorted(s.queue_position for s in ranked)
        finally:
            await b.close()
            await a.close()
