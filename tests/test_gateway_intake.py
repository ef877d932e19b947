"""gateway/intake.py: receipts of one moment share one durable transaction (a group commit), on a
real ledger in a temporary gateway.db."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from gateway.db import open_db
from gateway.intake import Intake
from gateway.ledger import Entry, Ledger, Receipt, UpdateKey


class CountingLedger(Ledger):
    """The real ledger; only counts the transactions `record_many` runs and their sizes."""

    batches: list[int]

    def record_many(self, receipts: Sequence[Receipt]) -> list[tuple[Entry, bool]]:
        self.batches.append(len(receipts))
        return super().record_many(receipts)


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[CountingLedger]:
    lg = CountingLedger(open_db(tmp_path / "gateway.db"))
    lg.batches = []
    yield lg
    lg.close()


def receipt(message_id: str, chat: str = "c1") -> Receipt:
    return Receipt(UpdateKey("fake", "acc", message_id), chat, "alice", None, {"text": f"hi {message_id}"})


async def test_concurrent_records_share_one_transaction(ledger: CountingLedger) -> None:
    intake = Intake(ledger)
    before = ledger.connection.total_changes
    results = await asyncio.gather(*(intake.record(receipt(f"m{i}")) for i in range(10)))
    assert ledger.batches == [10]
    assert ledger.connection.total_changes - before == 10
    assert [e.key.message_id for e, _ in results] == [f"m{i}" for i in range(10)]
    assert all(created for _, created in results)
    assert all(e.state == "received" and e.payload == {"text": f"hi m{i}"} for i, (e, _) in enumerate(results))
    assert [e.seq for e, _ in results] == sorted(e.seq for e, _ in results)  # arrival order kept


async def test_records_of_later_moments_get_their_own_transaction(ledger: CountingLedger) -> None:
    intake = Intake(ledger)
    await intake.record(receipt("a"))
    await asyncio.gather(intake.record(receipt("b")), intake.record(receipt("c")))
    await intake.record(receipt("d"))
    assert ledger.batches == [1, 2, 1]
    assert ledger.counts() == {"received": 4}


async def test_duplicate_key_is_not_created_twice(ledger: CountingLedger) -> None:
    intake = Intake(ledger)
    first, created = await intake.record(receipt("m1"))
    assert created
    again, created = await intake.record(receipt("m1", chat="elsewhere"))
    assert not created
    assert again.seq == first.seq and again.chat == "c1"  # the first receipt stands
    # The same key twice in one batch: one row, the first is the new one.
    (a, new_a), (b, new_b) = await asyncio.gather(intake.record(receipt("m2")), intake.record(receipt("m2")))
    assert (new_a, new_b) == (True, False)
    assert a.seq == b.seq
    assert ledger.counts() == {"received": 2}


async def test_a_failing_commit_fails_every_waiter_and_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "gateway.db"
    ledger = Ledger(open_db(path))
    ledger.connection.execute("PRAGMA busy_timeout = 0")
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")  # another writer holds the lock: the commit cannot happen
    intake = Intake(ledger)
    try:
        results = await asyncio.gather(*(intake.record(receipt(f"m{i}")) for i in range(3)), return_exceptions=True)
        assert all(isinstance(r, sqlite3.OperationalError) for r in results), results
        assert all("locked" in str(r) for r in results)
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert ledger.counts() == {}
    # The intake is not wedged by the failure: the next receipt commits.
    entry, created = await intake.record(receipt("m0"))
    assert created and entry.key.message_id == "m0"
    ledger.close()


async def test_a_cancelled_waiter_does_not_break_the_batch(ledger: CountingLedger) -> None:
    intake = Intake(ledger)
    gone = asyncio.ensure_future(intake.record(receipt("gone")))
    kept = asyncio.ensure_future(intake.record(receipt("kept")))
    await asyncio.sleep(0)  # both are pending now
    gone.cancel()
    entry, created = await kept
    assert created and entry.key.message_id == "kept"
    assert ledger.batches == [2]  # the receipt was recorded anyway (a redelivery finds it)
    assert gone.cancelled()
