"""After an outage of the whole database, a server whose session comes back well after another's
(a loaded host: its reconnect starved for a second or two) is not judged gone by the first one
back: each server judges by the timeout alone for its own `instance_timeout_s` after its session
returns. It judged by the 2.5-heartbeat lock-free grace from 0.7 s on (at 0.2 s heartbeats), and
fenced a live peer that came back 2 s later: a cluster that answers nothing until restarted."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import psycopg
import pytest

from appserver.store.cluster import INSTANCE_LOCK_CLASS
from tests.support.pg import require_postgres, temp_database, url_for
from tests.test_cluster_outage_s19 import _chat, _logs, _query, _start

pytestmark = pytest.mark.timeout(90)


def _ready(url: str) -> httpx.Response:
    return httpx.get(url + "/readyz", timeout=10)


def test_a_peer_whose_session_comes_back_late_after_an_outage_is_not_judged_gone(tmp_path: Path) -> None:
    require_postgres()
    with temp_database("cluster_late_back") as url:
        db = url.rsplit("/", 1)[1]
        nodes = _start(tmp_path, url, 2, heartbeat_s=0.2, instance_timeout_s=6)
        try:
            late = nodes[1]
            (key,) = _query(url, "SELECT lock_key FROM instances WHERE pid = %s", (late.proc.pid,))[0]
            with psycopg.connect(url, autocommit=True) as holder:
                holder.execute("SET lock_timeout = '20s'")
                with psycopg.connect(url_for("postgres"), autocommit=True) as admin:
                    admin.execute(f'ALTER DATABASE "{db}" ALLOW_CONNECTIONS false')
                    try:
                        end = time.monotonic() + 1.0
                        while time.monotonic() < end:
                            admin.execute(
                                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                "WHERE datname = %s AND pid <> %s",
                                (db, holder.info.backend_pid),
                            )
                            time.sleep(0.1)
                        # the late server's session cannot come back while the test holds its lock
                        holder.execute("SELECT pg_advisory_lock(%s, %s)", (INSTANCE_LOCK_CLASS, key))
                    finally:
                        admin.execute(f'ALTER DATABASE "{db}" ALLOW_CONNECTIONS true')
                deadline = time.monotonic() + 20
                while _ready(nodes[0].url).status_code != 200:
                    assert time.monotonic() < deadline, _logs(nodes)
                    time.sleep(0.1)
                time.sleep(2.0)  # the first one back judges for 2 s while the late one's session is away
                holder.execute("SELECT pg_advisory_unlock(%s, %s)", (INSTANCE_LOCK_CLASS, key))
            deadline = time.monotonic() + 20
            while True:
                ready = [_ready(sp.url) for sp in nodes]
                assert not any("judged gone" in r.text for r in ready), (
                    [(r.status_code, r.text[:300]) for r in ready],
                    _logs(nodes),
                )
                if all(r.status_code == 200 for r in ready):
                    break
                assert time.monotonic() < deadline, [(r.status_code, r.text[:300]) for r in ready]
                time.sleep(0.1)
            assert len(_query(url, "SELECT id FROM instances")) == 2
            for sp in nodes:
                reply = _chat(sp, "after")
                assert reply.status_code == 200, reply.text
        finally:
            for sp in nodes:
                sp.kill()
