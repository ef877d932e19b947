"""Drive the gateway with a steady stream of messages through the fake chat platform and check what
came back: no loss, no duplicate, per-chat order kept; and measure inbound→submit latency.

Used by tests/test_gateway_load.py (the acceptance run) and bench/gateway_ingress.py (the numbers).
"""

from __future__ import annotations

import sqlite3
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from tests.fakes.fakechat import FakeChat


@dataclass
class LoadResult:
    sent: int
    replies: int
    lost: list[str]
    duplicated: list[str]
    out_of_order: list[str]
    inject_s: float
    drain_s: float
    submit_ms: list[float]  # per message: ledger received → server accepted (user message stored)

    @property
    def p50_ms(self) -> float:
        return statistics.median(self.submit_ms) if self.submit_ms else float("nan")

    @property
    def p99_ms(self) -> float:
        if not self.submit_ms:
            return float("nan")
        ordered = sorted(self.submit_ms)
        return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]

    @property
    def messages_per_s(self) -> float:
        return self.replies / max(self.inject_s + self.drain_s, 1e-9)


def run_load(
    chat: FakeChat, home: Path, *, rate: float, seconds: float, chats: int, drain_timeout: float = 120
) -> LoadResult:
    """Inject `rate` messages/s spread over `chats` chats for `seconds`; wait for every reply."""
    total = int(rate * seconds)
    expected: dict[str, list[str]] = {f"load{c}": [] for c in range(chats)}
    start = time.monotonic()
    for i in range(total):
        target = start + i / rate
        delay = target - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        name = f"load{i % chats}"
        text = f"n{i:06d}"
        chat.inject(name, text, sender=f"u{i % chats}")
        expected[name].append(f"echo: {text}")
    inject_s = time.monotonic() - start
    drain_start = time.monotonic()
    deadline = drain_start + drain_timeout
    while time.monotonic() < deadline:
        if sum(len(chat.messages(name)) for name in expected) >= total:
            break
        time.sleep(0.1)
    time.sleep(0.5)  # late duplicates would show up now
    drain_s = time.monotonic() - drain_start
    lost: list[str] = []
    duplicated: list[str] = []
    out_of_order: list[str] = []
    replies = 0
    for name, want in expected.items():
        got = [m.text for m in chat.messages(name)]
        replies += len(got)
        lost += [t for t in want if t not in got]
        duplicated += sorted({t for t in got if got.count(t) > 1})
        seen = [t for t in got if t in want]
        if seen != [t for t in want if t in seen]:
            out_of_order.append(name)
    return LoadResult(total, replies, lost, duplicated, out_of_order, inject_s, drain_s, submit_latencies(home))


def submit_latencies(home: Path) -> list[float]:
    """For every ledger row: the time from the ledger's receipt to the server storing the turn's
    user message (the server has accepted and committed it), in ms."""
    gateway = sqlite3.connect(f"file:{home / 'channels' / 'gateway.db'}?mode=ro", uri=True)
    store = sqlite3.connect(f"file:{home / 'appserver.db'}?mode=ro", uri=True)
    try:
        received = dict(gateway.execute("SELECT turn_id, received_at FROM ledger WHERE turn_id IS NOT NULL"))
        stored = dict(store.execute("SELECT turn_id, MIN(created_at) FROM messages WHERE role='user' GROUP BY turn_id"))
    finally:
        gateway.close()
        store.close()
    return [(stored[t] - r) * 1000.0 for t, r in received.items() if t in stored]
