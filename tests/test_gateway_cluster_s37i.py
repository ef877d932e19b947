"""A cluster server stopped gracefully pauses its gateway's intake first (s37 attacker I, F1).

Two real `appserver serve` processes on a real PostgreSQL database, the webhook channel with signed
POSTs and a reply receiver (the setup of tests/test_gateway_cluster_s37b.py). SIGTERM to the
holder of the account's lease: its gateway kept answering 202 for some 0.3-0.4 s while the server
drained; those messages stayed in its home's ledger unsubmitted, the lease moved to the other
server, and nobody answered them. Now the stopping server pauses its gateway's intake before
anything else: a POST is either refused (503 with Retry-After, sent again to the other server) or
acknowledged and answered, exactly once.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.gateway import ChannelServer, WebhookReplies
from tests.support.pg import temp_database
from tests.test_gateway_cluster_s37b import (
    STOP,
    _accepted,
    _answered_once,
    _detail,
    _end,
    _holder_pid,
    _post,
    _server,
    _wait,
)

pytestmark = pytest.mark.timeout(180)

PAIR_PORTS = (22470, 22471)  # this file's port range: 22470-22479
POST_FOR_S = 2.0  # POSTs to the stopping holder's listener for this long after the SIGTERM


@pytest.fixture
def replies() -> Iterator[WebhookReplies]:
    receiver = WebhookReplies()
    yield receiver
    receiver.close()


def test_a_holder_stopped_with_sigterm_acknowledges_only_what_gets_answered(
    tmp_path: Path, replies: WebhookReplies
) -> None:
    """SIGTERM to the holder while POSTing to its listener: every 202 is answered exactly once (by
    either server), every refusal is a 503 with Retry-After (or the listener is gone), and the
    refused ones, sent again to the other server, are answered once too."""
    with temp_database("gw_s37i") as url:
        nodes: list[ChannelServer] = []
        try:
            for i, port in enumerate(PAIR_PORTS):
                nodes.append(_server(tmp_path / f"node{i}" / "home", url, port, replies, STOP))
                if i == 0:
                    nodes[0].wait_channels_ready(timeout=40)
            holder, survivor = nodes
            _wait(lambda: "runs in instance" in _detail(survivor), 40, "the second server never saw the holder")
            assert _holder_pid(url) == holder.proc.pid
            assert _post(PAIR_PORTS[0], "before").status_code == 202
            _answered_once(replies, ["before"])

            os.kill(holder.proc.pid, signal.SIGTERM)
            began = time.monotonic()
            accepted: list[tuple[str, float]] = []
            refused: list[str] = []
            n = 0
            while time.monotonic() - began < POST_FOR_S:
                mid = f"t{n}"
                n += 1
                try:
                    answer = _post(PAIR_PORTS[0], mid)
                except httpx.HTTPError:
                    refused.append(mid)  # the listener is closed: the sender retries elsewhere
                else:
                    if answer.status_code == 202:
                        accepted.append((mid, round(time.monotonic() - began, 3)))
                    else:
                        assert answer.status_code == 503, (mid, answer.status_code, answer.text)
                        assert answer.headers.get("Retry-After"), answer.headers
                        refused.append(mid)
                time.sleep(0.01)
            assert refused, "the stopping holder's listener took every message"
            holder.proc.wait(30)

            for mid in refused:
                _accepted(PAIR_PORTS[1], mid)
            assert _holder_pid(url) == survivor.proc.pid
            ids = ["before", *(m for m, _ in accepted), *refused]
            try:
                _answered_once(replies, ids, timeout=30)
            except AssertionError:
                missing = [m for m in ids if not replies.reply_ids(m)]
                said = f"acknowledged (202) after the SIGTERM, never answered: {missing}; {accepted}"
                raise AssertionError(said) from None
            assert "the gateway's intake is paused" in holder.log()
        finally:
            _end(nodes)
