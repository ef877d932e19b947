"""A cron run's reply is delivered once across a failover of the scheduler lease.

Real `serve` processes on one PostgreSQL database, each with a home (and a run log) of its own,
the real webhook channel and a loopback receiver of its replies. A `--deliver` task fires every 2 s;
the server holding the scheduler lease (and the channel account) is killed with SIGKILL right
after it delivered a reply. The server that takes the lease over must not deliver that run again
(before the fix it did, after every failover: its own run log did not know the run was done), and
delivers the later runs once each. Across all homes, no run is `submitted`, `outcome`d or
`delivered` twice. Done twice: the second time a third server (started after the first kill)
takes over from the first survivor.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.support.cli import cli_env, run_cli
from tests.support.gateway import ChannelServer, gateway_children, start_channel_server, write_config
from tests.support.net import free_port
from tests.support.pg import require_postgres, temp_database

pytestmark = pytest.mark.timeout(300)

SECRET = "s3cr3t-for-the-webhook"
ACCOUNT = "webhook:home"
TARGET = f"{ACCOUNT}:kitchen"
FAST = {"APPSERVER_STORE__HEARTBEAT_S": "0.2", "APPSERVER_STORE__INSTANCE_TIMEOUT_S": "5"}


class Receiver:
    """The app receiving the webhook channel's replies: every POST body, with when it came."""

    def __init__(self) -> None:
        self.posts: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's API
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with outer.lock:
                    outer.posts.append(json.loads(body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/replies"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def count(self) -> int:
        with self.lock:
            return len(self.posts)

    def texts(self) -> list[str]:
        with self.lock:
            return [str(p.get("text")) for p in self.posts]


@pytest.fixture()
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.server.shutdown()


def _env(home: Path, url: str) -> dict[str, str]:
    return cli_env(home, APPSERVER_STORE__URL=url, WH_SECRET=SECRET, **FAST)


def _home(tmp_path: Path, name: str, receiver: Receiver) -> Path:
    home = tmp_path / name
    settings = {
        "listen": f"127.0.0.1:{free_port()}",
        "secret_env": "WH_SECRET",
        "reply_url": receiver.url,
        "default_agent": "assistant",
    }
    write_config(home, {"webhook": {"home": settings}}, ["webhook"])
    return home


def _query(url: str, sql: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as c:
        return list(c.execute(sql).fetchall())


def _cron_holder(url: str) -> str | None:
    rows = _query(url, "SELECT doc FROM cron_state WHERE id = 1")
    doc = json.loads(rows[0][0]) if rows and rows[0][0].strip() else {}
    return (doc.get("scheduler_owner") or {}).get("instance")


def _channel_holder(url: str) -> str | None:
    rows = _query(url, f"SELECT instance_id FROM channel_owners WHERE account = '{ACCOUNT}'")
    return str(rows[0][0]) if rows and rows[0][0] else None


def _instance_of(url: str, srv: ChannelServer) -> str | None:
    for iid, pid in _query(url, "SELECT id, pid FROM instances"):
        if int(pid) == srv.proc.pid:
            return str(iid)
    return None


def _records(homes: list[Path], task_id: str) -> list[dict[str, Any]]:
    out = []
    for home in homes:
        path = home / "cron-runs" / f"{task_id}.jsonl"
        if path.exists():
            for line in path.read_text().splitlines():
                if line.strip():
                    out.append({**json.loads(line), "home": home.name})
    return out


def _events(homes: list[Path], task_id: str, event: str) -> list[dict[str, Any]]:
    return [r for r in _records(homes, task_id) if r.get("event") == event]


def _logs(nodes: list[ChannelServer]) -> str:
    return "".join(f"--- {sp.home.name}\n{sp.log()[-4000:]}" for sp in nodes)


def _wait(what: str, until: Callable[[], Any], timeout: float, nodes: list[ChannelServer]) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = until()
        if got:
            return got
        if time.monotonic() > deadline:
            pytest.fail(f"{what} (after {timeout:g} s)\n{_logs(nodes)}", pytrace=False)
        time.sleep(0.02)


def _kill(srv: ChannelServer) -> None:
    children = gateway_children(srv.proc.pid)
    srv.proc.send_signal(signal.SIGKILL)
    srv.proc.wait(10)
    for pid in children:  # the gateway child, orphaned: it would go on holding its port
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _kill_holder_right_after_a_delivery(
    url: str, receiver: Receiver, holder: ChannelServer, homes: list[Path], task_id: str, nodes: list[ChannelServer]
) -> int:
    """SIGKILL `holder` as soon as it has delivered a reply (and recorded it); the run number."""
    seen = len(_events([holder.home], task_id, "delivered"))
    delivered = _wait(
        "the holder delivered no reply",
        lambda: _events([holder.home], task_id, "delivered")[seen:],
        30,
        nodes,
    )
    _kill(holder)
    return int(delivered[-1]["occurrence"])


def _survivor_delivers(
    url: str, receiver: Receiver, survivor: ChannelServer, task_id: str, nodes: list[ChannelServer], runs: int
) -> None:
    iid = _wait("the survivor has no instance row", lambda: _instance_of(url, survivor), 20, nodes)
    _wait("the survivor did not take the scheduler lease", lambda: _cron_holder(url) == iid, 30, nodes)
    _wait("the survivor did not take the channel account", lambda: _channel_holder(url) == iid, 30, nodes)
    _wait(
        f"the survivor did not deliver {runs} runs",
        lambda: len(_events([survivor.home], task_id, "delivered")) >= runs,
        60,
        nodes,
    )


def test_a_delivered_reply_is_not_delivered_again_after_the_holder_is_killed(
    tmp_path: Path, receiver: Receiver
) -> None:
    require_postgres()
    with temp_database("cron_deliver_failover") as url:
        homes = [_home(tmp_path, f"node{i}", receiver) for i in range(3)]
        nodes: list[ChannelServer] = []
        try:
            # the first server holds both the scheduler lease and the channel account
            a = start_channel_server(homes[0], env=_env(homes[0], url))
            nodes.append(a)
            a.wait_channels_ready()
            a_id = _wait("A has no instance row", lambda: _instance_of(url, a), 20, nodes)
            _wait("A did not take the scheduler lease", lambda: _cron_holder(url) == a_id, 30, nodes)
            _wait("A did not take the channel account", lambda: _channel_holder(url) == a_id, 30, nodes)
            b = start_channel_server(homes[1], env=_env(homes[1], url))
            nodes.append(b)

            add = run_cli(homes[0], "cron", "add", "--name", "dl", "--agent", "assistant", "--every", "2s", "--exact",
                          "--prompt", "say dl", "--deliver", TARGET, "--json", env=_env(homes[0], url))  # fmt: skip
            assert add.code == 0, add.err
            task_id = str(add.json()["id"])

            _wait("A delivered fewer than 2 runs", lambda: len(_events([a.home], task_id, "delivered")) >= 2, 30, nodes)
            first = _kill_holder_and_check(url, receiver, a, b, homes, task_id, nodes)

            # a third server joins; the first survivor is killed the same way: C takes over from B
            c = start_channel_server(homes[2], env=_env(homes[2], url))
            nodes.append(c)
            _wait("C has no instance row", lambda: _instance_of(url, c), 20, nodes)
            second = _kill_holder_and_check(url, receiver, b, c, homes, task_id, nodes)
            assert second > first
        finally:
            for sp in nodes:
                with contextlib.suppress(Exception):
                    if sp.proc.poll() is None:
                        _kill(sp)

        # across every home: each run submitted, recorded and delivered at most once
        # (a `fired` record may be in two homes: a claim the holder died before submitting is
        # logged again where it is submitted)
        for event in ("submitted", "outcome", "delivered"):
            numbers = Counter(int(r["occurrence"]) for r in _events(homes, task_id, event))
            twice = {
                n: [r for r in _records(homes, task_id) if r.get("occurrence") == n]
                for n, k in numbers.items()
                if k > 1
            }
            assert twice == {}, f"runs with more than one {event!r} record: {twice}"
        texts = receiver.texts()
        assert len(texts) == len(set(texts)), f"a reply was delivered twice: {Counter(texts).most_common(3)}"
        delivered = _events(homes, task_id, "delivered")
        assert len(texts) == len(delivered), (len(texts), len(delivered))  # every post is a recorded delivery


def _kill_holder_and_check(
    url: str,
    receiver: Receiver,
    holder: ChannelServer,
    survivor: ChannelServer,
    homes: list[Path],
    task_id: str,
    nodes: list[ChannelServer],
) -> int:
    """Kill `holder` right after a delivery; `survivor` takes over and delivers later runs, never
    the one delivered just before the kill. Returns that run's number."""
    last = _kill_holder_right_after_a_delivery(url, receiver, holder, homes, task_id, nodes)
    _survivor_delivers(url, receiver, survivor, task_id, nodes, 3)
    again = [r for r in _records([survivor.home], task_id) if r.get("occurrence") == last]
    assert again == [], f"the survivor took up run #{last}, which the dead holder had delivered: {again}"
    later = sorted(int(r["occurrence"]) for r in _events([survivor.home], task_id, "delivered"))
    assert later and min(later) > last, (last, later)
    return last
