"""Group commit for inbound updates: receipts that arrive together share one durable transaction.

The ledger's receipt is the one write whose loss would lose a message (the platform was told it
arrived), so it is fsynced; an adapter that hands over a batch of updates at once (Telegram's
`getUpdates`, a burst of webhook POSTs) pays one fsync for the batch instead of one per update.
"""

from __future__ import annotations

import asyncio

from gateway.ledger import Entry, Ledger, Receipt


class Intake:
    def __init__(self, ledger: Ledger) -> None:
        self._ledger = ledger
        self._pending: list[tuple[Receipt, asyncio.Future[tuple[Entry, bool]]]] = []

    async def record(self, receipt: Receipt) -> tuple[Entry, bool]:
        """Returns once the receipt is committed (with every other receipt of the same moment)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[tuple[Entry, bool]] = loop.create_future()
        if not self._pending:
            loop.call_soon(self._flush)
        self._pending.append((receipt, future))
        return await future

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        try:
            results = self._ledger.record_many([receipt for receipt, _ in batch])
        except Exception as exc:  # noqa: BLE001 - the waiters learn of the failure; none is acked
            if len(batch) == 1:
                if not batch[0][1].done():
                    batch[0][1].set_exception(exc)
                return
            # One bad receipt must not refuse the others it shared the commit with: one by one.
            for receipt, future in batch:
                try:
                    result = self._ledger.record_many([receipt])[0]
                except Exception as one:  # noqa: BLE001
                    if not future.done():
                        future.set_exception(one)
                else:
                    if not future.done():
                        future.set_result(result)
            return
        for (_, future), result in zip(batch, results, strict=True):
            if not future.done():
                future.set_result(result)
