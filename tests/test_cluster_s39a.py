"""After an outage of the whole database, a server whose session comes back well after another's
(a loaded host: its reconnect starved for a second or two) is not judged gone by the first one
back: each server judges by the timeout alone for its own `instance_timeout_s` after its session
returns. It judged by the 2.5-heartbeat lock-free grace from 0.7 s on (at 0.2 s heartbeats), and
fenced a live peer that came back 2 s later: a cluster that answers nothing until restarted."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from tests.support.pg import require_postgres, temp_database
from tests.test_cluster_outage_s19 import _chat, _logs, _query, _sessions_kept_away, _start

pytestmark = pytest.mark.timeout(90)


def _ready(url: str) -> httpx.Response:
    return httpx.get(url + "/readyz", timeout=10)


def test_a_peer_whose_session_comes_back_late_after_an_outage_is_not_judged_gone(tmp_path: Path) -> None:
    require_postgres()
    with temp_database("cluster_late_back") as url:
        nodes = _start(tmp_path, url, 2, heartbeat_s=0.2, instance_timeout_s=6)
        try:
            with _sessions_kept_away(url, pids=(nodes[1].proc.pid,)):  # the late one's session
                deadline = time.monotonic() + 20
                while _ready(nodes[0].url).status_code != 200:
                    assert time.monotonic() < deadline, _logs(nodes)
                    time.sleep(0.1)
                time.sleep(2.0)  # the first one back judges for 2 s while the late one's session is away
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
