"""Cron's scheduler lease in a cluster whose servers' `[store]` timings differ, with real PostgreSQL
and real `serve` processes: the holder is judged by the heartbeat period and timeout its instance
row recorded, as the cluster judges it. A server with a short timeout (1.5 s) judged a healthy
holder that renews its heartbeat every 2.5 s by its own timeout and took the lease "from dead
owner" every few seconds; the holder then logged that it lost the lease.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import psycopg
import pytest

from tests.support.pg import temp_database
from tests.support.serve import killed_at_exit, log_so_far, serve_with_timings
from tests.support.wait import eventually

pytestmark = pytest.mark.timeout(90)


def _holder(url: str) -> str | None:
    with psycopg.connect(url, autocommit=True) as c:
        row = c.execute("SELECT doc FROM cron_state WHERE id = 1").fetchone()
    doc = json.loads(row[0]) if row and str(row[0]).strip() else {}
    return (doc.get("scheduler_owner") or {}).get("instance")


def _newest_instance(url: str) -> str:
    with psycopg.connect(url, autocommit=True) as c:
        row = c.execute("SELECT id FROM instances ORDER BY started_at DESC LIMIT 1").fetchone()
    assert row is not None
    return str(row[0])


def test_a_slow_healthy_holder_keeps_the_scheduler_lease_beside_a_quick_server(tmp_path: Path) -> None:
    with temp_database("cron_s33o_mixed") as url, killed_at_exit() as nodes:
        slow = serve_with_timings(tmp_path / "slow", url, 2.5, 10)  # its heartbeat is older than the other's timeout
        nodes.append(slow)
        slow_id = _newest_instance(url)
        assert eventually(lambda: _holder(url) == slow_id, 10), log_so_far(slow)
        quick = serve_with_timings(tmp_path / "quick", url, 0.3, 1.5)
        nodes.append(quick)
        # The quick server judges the holder every second, and the slow one's heartbeat is up to
        # 2.75 s old: four of the quick server's timeouts, several of the slow one's heartbeats.
        end = time.monotonic() + 6
        while time.monotonic() < end:
            assert _holder(url) == slow_id, log_so_far(quick)
            time.sleep(0.25)
        assert "taking over the scheduler lease" not in log_so_far(quick)
        assert "lost the scheduler lease" not in log_so_far(slow)
