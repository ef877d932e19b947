"""Group commit for inbound updates: receipts that arrive together share one durable transaction.

The ledger's receipt is the one write whose loss would lose a message (the platform was told it
arrived), so it is fsynced; an adapter that hands over a batch of updates at once (Telegram's
`getUpdates`, a burst of webhook POSTs) pays one fsync for the batch instead of one per update.

`IntakeGate`: whether the gateway takes messages at all. A server of a cluster vouches for its
gateway's intake for a short while at a time (`until`); past it, or told to pause, the gateway
acknowledges nothing, so a stalled or cut-off server's gateway never accepts a message that the
server holding the account's lease next should answer instead. Within its word too the gateway
takes nothing while its server's process is stopped (`ServerProcess`, read from /proc on Linux):
a SIGSTOP lets no message in at all, where the word alone let them in until it ran out.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable

from gateway.ledger import Entry, Ledger, Receipt

log = logging.getLogger("gateway.intake")


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


class ServerProcess:
    """The server process that vouches for the intake (the child's parent), as /proc shows it. Its
    word lasts a moment (`IntakeGate`); a server stopped meanwhile (SIGSTOP, a debugger) or gone
    (the child re-parented) vouches for nothing from that instant. One read of /proc/<pid>/stat per
    look (a few microseconds); None from `parent` where /proc does not show this process's parent
    (not Linux, another pid namespace): the word alone counts then."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._stat = f"/proc/{pid}/stat"

    @classmethod
    def parent(cls) -> ServerProcess | None:
        pid = os.getppid()
        me = _stat_fields("/proc/self/stat")
        if me is None or len(me) < 2 or me[1] != str(pid).encode() or _stat_fields(f"/proc/{pid}/stat") is None:
            return None
        return cls(pid)

    def stopped(self) -> bool:
        """Stopped (state T, or t: traced), or no longer this process's parent (it ended)."""
        if os.getppid() != self.pid:
            return True
        fields = _stat_fields(self._stat)
        return fields is not None and fields[0] in (b"T", b"t")


def _stat_fields(path: str) -> list[bytes] | None:
    """The fields of a /proc/<pid>/stat after the command name (state first, then the parent's
    pid), or None when it cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        data = os.read(fd, 1024)
    except OSError:
        return None
    finally:
        os.close(fd)
    return data.rpartition(b")")[2].split() or None


class IntakeGate:
    """Open for good (`until` None: a server alone on its store), or until the monotonic time the
    server's last word said (`vouch`; the start envelope's first) while the server's process is not
    stopped (`server`). The child and its server run on one host and read the same monotonic clock,
    so a word that lay in the pipe counts from when the server wrote it. A start longer than the
    first word lasts is no pause worth a log line: the server's words follow once the child is ready."""

    def __init__(
        self, until: float | None = None, server: ServerProcess | None = None, let_go: Callable[[], bool] | None = None
    ) -> None:
        self._until = until
        self._server = server
        # whether the server let go of this child (its stdin closed: stopping it), which it may do
        # before the child read a command, while it starts with the start envelope's word
        self._let_go = let_go
        self._changed = asyncio.Event()
        self._timer: asyncio.TimerHandle | None = None
        self._heard = False  # a word came from the running server (not only the start envelope's)
        self._paused_said = False

    def is_open(self) -> bool:
        if self._until is None:
            return True
        if not self._word_holds():
            return False
        if self._server is not None and self._server.stopped():
            # a stopped server's word still holds, but nothing it vouched for is submitted now
            self._closed(f"the server's process (pid {self._server.pid}) is stopped or gone")
            return False
        if self._let_go is not None and self._let_go():
            self._closed("the server is stopping this gateway (its stdin closed)")
            return False
        return True

    def _word_holds(self) -> bool:
        return self._until is None or time.monotonic() < self._until

    def vouch(self, until: float) -> None:
        """The server's word: messages may be taken until `until` (monotonic; 0: pause now)."""
        if self._until is None:
            return
        self._until = until
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._word_holds():
            self._closed("the server paused it (cut off from the database, fenced, or unsure it holds the lease)")
            return
        if self._paused_said:
            self._paused_said = False
            log.info("intake resumed: the server answers and holds the accounts' lease")
        self._heard = True
        self._changed.set()
        self._timer = asyncio.get_running_loop().call_later(until - time.monotonic(), self._expired)

    async def opened(self) -> None:
        """Return once the gate is open."""
        while not self.is_open():
            self._changed.clear()
            await self._changed.wait()

    def _expired(self) -> None:
        self._timer = None
        if not self._word_holds() and self._heard:
            self._closed("the server's last word ran out (it is stalled, cut off from the database, or fenced)")

    def _closed(self, why: str) -> None:
        if not self._paused_said:
            self._paused_said = True
            log.warning("intake paused: %s; no platform message is acknowledged until it vouches again", why)
