"""Liveness of a PostgreSQL cluster, with real PostgreSQL and real `serve` processes.

- Servers whose `[store]` timings differ: each is judged by the heartbeat period and timeout it
  recorded in its row. A server with a short timeout (1.5 s) judged a healthy peer that renews its
  heartbeat every 2.5 s gone by its own timeout, and that peer was fenced (503) with its turns
  interrupted; a peer left at the defaults did the same to one with a long heartbeat.
- A killed server is judged gone within its timeout while the survivor's database session keeps
  being ended: each re-take of the session restarted the clock of how long the others had been
  silent, and the dead server was never taken over.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import psycopg
import pytest

from tests.support.pg import query, temp_database, url_for
from tests.support.serve import killed_at_exit, log_so_far, ready_status, serve_with_timings
from tests.support.wait import eventually

pytestmark = pytest.mark.timeout(90)


def test_each_server_is_judged_by_the_timings_it_recorded(tmp_path: Path) -> None:
    with temp_database("s33d_mixed") as url, killed_at_exit() as nodes:
        slow = serve_with_timings(tmp_path / "slow", url, 2.5, 10)  # its heartbeat is older than the other's timeout
        nodes.append(slow)
        quick = serve_with_timings(tmp_path / "quick", url, 0.3, 1.5)
        nodes.append(quick)
        # The quick server judges every second, and the slow one's heartbeat is up to 2.75 s old:
        # watched for two of the slow one's heartbeat periods (its first, before it counted the
        # quick one and renews more often beside it, among them).
        end = time.monotonic() + 5
        while time.monotonic() < end:
            assert ready_status(slow) == 200, log_so_far(slow)
            time.sleep(0.5)
        assert len(query(url, "SELECT id FROM instances")) == 2
        assert "judged gone" not in log_so_far(slow)
        rows = query(url, "SELECT heartbeat_s, instance_timeout_s FROM instances ORDER BY started_at")
        assert rows == [(2.5, 10.0), (0.3, 1.5)]

        # A row an older version wrote (no timings of its own) is judged by the judge's own: gone
        # for the quick server once its heartbeat is 1.5 s old (the slow one would wait 10 s).
        query(
            url,
            "INSERT INTO instances(id, host, pid, address, lock_key, started_at, heartbeat_at) "
            "VALUES ('inst_older', 'h', 1, '', 4242, extract(epoch from now()), extract(epoch from now()) - 2)",
        )
        assert eventually(lambda: not query(url, "SELECT 1 FROM instances WHERE id = 'inst_older'"), 6)


def test_a_killed_server_is_judged_gone_while_the_survivors_session_keeps_being_ended(tmp_path: Path) -> None:
    with temp_database("s33d_term") as url, killed_at_exit() as nodes:
        survivor = serve_with_timings(tmp_path / "survivor", url, 0.5, 4)
        nodes.append(survivor)
        doomed = serve_with_timings(tmp_path / "doomed", url, 0.5, 4)
        nodes.append(doomed)
        (dead,) = query(url, "SELECT id FROM instances ORDER BY started_at DESC LIMIT 1")[0]
        db = url.rsplit("/", 1)[1]
        stop = threading.Event()
        ended_once = threading.Event()

        def end_sessions() -> None:
            """Every 1.5 s (less than the few heartbeats the lock-free grace waits after a re-take),
            the survivor's cluster session is ended; it takes it again at once."""
            with psycopg.connect(url_for("postgres"), autocommit=True) as c:
                while not stop.wait(1.5):
                    c.execute(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                        "WHERE datname = %s AND application_name LIKE 'appserver serve inst_%%'",
                        (db,),
                    )
                    ended_once.set()

        ender = threading.Thread(target=end_sessions, daemon=True)
        ender.start()
        try:
            assert ended_once.wait(10), "the sessions were never ended"  # (1.5 s after the start)
            doomed.kill()
            # within its timeout (4 s) plus a sweep and a session re-take
            gone = eventually(lambda: not query(url, "SELECT 1 FROM instances WHERE id = %s", (dead,)), 8)
        finally:
            stop.set()
            ender.join(10)
        assert gone, log_so_far(survivor)
        assert eventually(lambda: ready_status(survivor) == 200, 10), log_so_far(survivor)
        assert "judged gone" not in log_so_far(survivor)


def test_a_peer_at_the_shortest_timings_is_judged_gone_when_killed(tmp_path: Path) -> None:
    """Beside a peer at the shortest timings `[store]` allows (0.1 s / 1 s), a default server renews
    its heartbeat within a third of that timeout: its beats landed on a 0.25 s listening grid, later
    than the half-timeout it trusts its own view for, so every renewal read as a return after a gap
    and the killed peer was never judged gone."""
    with temp_database("s33d_shortest") as url, killed_at_exit() as nodes:
        steady = serve_with_timings(tmp_path / "steady", url, 2, 30)
        nodes.append(steady)
        quick = serve_with_timings(tmp_path / "quick", url, 0.1, 1)
        nodes.append(quick)
        (dead,) = query(url, "SELECT id FROM instances ORDER BY started_at DESC LIMIT 1")[0]
        # the steady server has counted the quick one: it does so as it renews its heartbeat (every
        # 2 s), and then renews it again (within a third of the quick one's timeout, at once)
        _renewed_twice_since_joined(url, dead)
        quick.kill()
        gone = eventually(lambda: not query(url, "SELECT 1 FROM instances WHERE id = %s", (dead,)), 8)
        assert gone, log_so_far(steady)
        assert ready_status(steady) == 200


def _renewed_twice_since_joined(url: str, joined: str) -> None:
    """Wait until every other server renewed its heartbeat twice since `joined`'s row was written:
    the first renewal counts the peers (the new one among them), the second comes after that count."""
    seen: dict[str, set[float]] = {}
    deadline = time.monotonic() + 20
    with psycopg.connect(url, autocommit=True) as c:
        while True:
            rows = c.execute(
                "SELECT i.id, i.heartbeat_at FROM instances i, instances j "
                "WHERE j.id = %s AND i.id <> j.id AND i.heartbeat_at > j.started_at",
                (joined,),
            ).fetchall()
            for rid, beat in rows:
                seen.setdefault(rid, set()).add(beat)
            others = {r[0] for r in c.execute("SELECT id FROM instances WHERE id <> %s", (joined,)).fetchall()}
            if others and all(len(seen.get(o, ())) >= 2 for o in others):
                return
            assert time.monotonic() < deadline, f"the others did not renew their heartbeats twice: {seen}"
            time.sleep(0.05)
