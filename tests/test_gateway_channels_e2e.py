"""The first-party webhook channel, a hostile user plugin and damaged state files, through a real
`appserver serve --channels …` (issue 15)."""

from __future__ import annotations

import asyncio
import functools
import json
import socket
import sqlite3
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from plugins.webhook import SIGNATURE_HEADER, TIMESTAMP_HEADER, sign, verify
from tests.support.cli import cli_env
from tests.support.concurrent import run_concurrently
from tests.support.gateway import ChannelServer, channel_server, store_turns, write_config
from tests.support.net import free_port
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(120)

SECRET = "s3cret-for-tests"


SPOOF_PLUGIN = """
import asyncio, os, sys
from plugins.contract import Limits

FORGED = '{"type":"account_state","channel":"webhook","account":"broken","state":"running","reason":null}'


class Spoofer:
    limits = Limits(max_length=1000)

    def __init__(self) -> None:
        self.running = False

    async def start(self) -> None:
        self.running = True
        self.task = asyncio.ensure_future(self.forge())

    async def forge(self) -> None:
        # Every way a plugin could try to speak on the control channel, over and over.
        while self.running:
            print("GATEWAY_EVENT " + FORGED)
            print("GATEWAY_READY")
            sys.stdout.flush()
            os.write(1, ("GATEWAY_EVENT " + FORGED + "\\n").encode())
            sys.__stdout__.write("GATEWAY_EVENT " + FORGED + "\\n")
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        self.running = False

    @property
    def is_running(self) -> bool:
        return self.running

    async def send(self, target, text):
        return []


def create_adapter(account, context):
    return Spoofer()
"""


class Receiver:
    """The app that receives the webhook channel's replies."""

    def __init__(self) -> None:
        self.posts: list[tuple[dict[str, str], bytes]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's API
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                outer.posts.append(({k: v for k, v in self.headers.items()}, body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/replies"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


@pytest.fixture()
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def _post(port: int, payload: dict[str, Any], secret: str = SECRET, ts: int | None = None) -> httpx.Response:
    body = json.dumps(payload).encode()
    stamp = str(ts if ts is not None else int(time.time()))
    headers = {"Content-Type": "application/json", TIMESTAMP_HEADER: stamp, SIGNATURE_HEADER: sign(secret, stamp, body)}
    return httpx.post(f"http://127.0.0.1:{port}/", content=body, headers=headers, timeout=10)


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except OSError:
        return False
    return True


def _check_showing(srv: ChannelServer, fragment: str, timeout: float = 30) -> dict[str, Any]:
    """The `channels` readiness check, once its detail shows `fragment`."""
    deadline = time.monotonic() + timeout
    check: dict[str, Any] = {}
    while time.monotonic() < deadline:
        try:
            check = srv.channels_check()
        except (AssertionError, httpx.HTTPError):
            check = {}
        if fragment in str(check.get("detail", "")):
            return check
        time.sleep(0.1)
    raise AssertionError(f"the channels check never showed {fragment!r}: {check}\n{srv.log()[-3000:]}")


def _ledger_rows(home: Path) -> int:
    conn = sqlite3.connect(home / "channels" / "gateway.db")
    try:
        return int(conn.execute("SELECT COUNT(*) FROM ledger").fetchone()[0])
    finally:
        conn.close()


def test_webhook_spoofing_damaged_state_and_the_gateway_token_each_through_a_server(
    tmp_path: Path, receiver: Receiver
) -> None:
    """Four scenarios, each with a server and home of its own, side by side: they spend their time
    waiting on the gateway, so the file waits once instead of four times. Every check is each one's."""
    run_concurrently(
        functools.partial(_webhook_signed_in_signed_out_once_per_delivery_id, tmp_path / "webhook", receiver),
        functools.partial(
            _a_plugin_cannot_spoof_control_lines_and_a_missing_secret_is_one_accounts_error, tmp_path / "spoof"
        ),
        functools.partial(_corrupt_gateway_db_and_channel_json_are_set_aside_loudly, tmp_path / "corrupt"),
        functools.partial(
            _the_gateway_gets_its_own_token_revoked_at_stop_and_no_child_without_channels, tmp_path / "token"
        ),
    )


def _webhook_signed_in_signed_out_once_per_delivery_id(tmp_path: Path, receiver: Receiver) -> None:
    home = tmp_path / "home"
    port = free_port()
    settings = {
        "listen": f"127.0.0.1:{port}",
        "secret_env": "WH_SECRET",
        "reply_url": receiver.url,
        "default_agent": "assistant",
    }
    write_config(home, {"webhook": {"main": settings}}, ["webhook"])
    with channel_server(home, env=cli_env(home, WH_SECRET=SECRET)) as srv:
        message = {"id": "evt-1", "chat": "kitchen", "sender": "ha", "text": "are the lights off?"}
        # A bad signature and a stale one: 401, nothing recorded.
        assert _post(port, message, secret="wrong").status_code == 401
        assert _post(port, message, ts=int(time.time()) - 3600).status_code == 401
        assert _ledger_rows(home) == 0
        # A good one: one turn, the reply POSTed and signed.
        assert _post(port, message).status_code == 202
        wait_for(lambda: receiver.posts, timeout=20, what="the reply POST")
        headers, body = receiver.posts[0]
        assert verify(SECRET, headers[TIMESTAMP_HEADER], body, headers[SIGNATURE_HEADER])
        reply = json.loads(body)
        assert reply["chat"] == "kitchen" and reply["text"] == "echo: are the lights off?", reply
        assert reply["reply_to"] == "evt-1"
        assert reply["id"] == "webhook:main:evt-1:0"  # stable across resends: the receiver can dedupe
        # The same delivery id again (the sender retried): accepted as a duplicate (200), no second
        # turn, no second reply.
        assert _post(port, message).status_code == 200
        time.sleep(1.0)
        assert store_turns(srv.home, 'message_id="evt-1"') == 1
        assert len(receiver.posts) == 1


def _a_plugin_cannot_spoof_control_lines_and_a_missing_secret_is_one_accounts_error(tmp_path: Path) -> None:
    home = tmp_path / "home"
    spoof = home / "channels" / "spoof"
    spoof.mkdir(parents=True)
    (spoof / "channel.json").write_text(json.dumps({"id": "spoof", "entry": "plugin.py"}))
    (spoof / "plugin.py").write_text(SPOOF_PLUGIN)
    broken = {"listen": f"127.0.0.1:{free_port()}", "secret_env": "NOT_SET_ANYWHERE", "default_agent": "assistant"}
    write_config(home, {"spoof": {"main": {}}, "webhook": {"broken": broken}}, ["spoof", "webhook"])
    env = cli_env(home)
    env.pop("NOT_SET_ANYWHERE", None)
    with channel_server(home, env=env, ready=False) as srv:
        _check_showing(srv, "gateway running")
        check = _check_showing(srv, "webhook:broken error")
        # The plugin's forged "running" events for webhook:broken never reached the supervisor: the
        # account shows the error the gateway reported, and the server is not ready.
        assert check["status"] == "fail"
        assert "webhook:broken error (secret_env: environment variable NOT_SET_ANYWHERE is not set)" in check["detail"]
        assert "spoof:main running" in check["detail"]
        for _ in range(10):  # while the plugin keeps forging
            time.sleep(0.1)
            assert "webhook:broken error" in srv.channels_check()["detail"]
        log = srv.log()
        assert "gateway| GATEWAY_EVENT" in log  # relayed as the plugin's noise, into the log


def _corrupt_gateway_db_and_channel_json_are_set_aside_loudly(tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / "channels" / "badplugin").mkdir(parents=True)
    (home / "channels" / "badplugin" / "channel.json").write_text('{"id": "badplugin", ')
    db = home / "channels" / "gateway.db"
    db.write_bytes(b"this is not a database, it is " + b"\x00garbage" * 100)
    port = free_port()
    accounts = {
        "webhook": {"main": {"listen": f"127.0.0.1:{port}", "secret_env": "WH_SECRET", "default_agent": "assistant"}},
        "badplugin": {"main": {}},
    }
    write_config(home, accounts, ["webhook", "badplugin"])
    with channel_server(home, env=cli_env(home, WH_SECRET=SECRET), ready=False) as srv:
        check = _check_showing(srv, "webhook:main running")
        assert "badplugin:main error" in check["detail"] and "channel.json" in check["detail"], check
        aside = list((home / "channels").glob("gateway.db.corrupt-*"))
        assert aside and aside[0].read_bytes().startswith(b"this is not a database"), aside
        assert list((home / "channels" / "badplugin").glob("channel.json.corrupt-*"))
        log = srv.log()
        assert "moved aside" in log
        # The gateway still works on its fresh database.
        assert _post(port, {"id": "e1", "chat": "c", "sender": "s", "text": "hi"}).status_code == 202
        wait_for(lambda: store_turns(home, 'message_id="e1"') == 1, timeout=20, what="the turn")


def _the_gateway_gets_its_own_token_revoked_at_stop_and_no_child_without_channels(tmp_path: Path) -> None:
    from tests.support.gateway import gateway_children

    home = tmp_path / "home"
    port = free_port()
    settings = {"listen": f"127.0.0.1:{port}", "secret_env": "WH_SECRET", "default_agent": "assistant"}
    write_config(home, {"webhook": {"main": settings}}, ["webhook"])
    env = cli_env(home, WH_SECRET=SECRET)
    with channel_server(home, "--channels", "", env=env, ready=False) as plain:
        time.sleep(1.0)
        assert gateway_children(plain.proc.pid) == []
        assert all(c["name"] != "channels" for c in plain.readyz()["checks"])
    with channel_server(home, "--auth", "token", env=env) as srv:
        tokens = json.loads((home / "auth" / "tokens.json").read_text())
        records = tokens["tokens"] if isinstance(tokens, dict) else tokens
        mine = [t for t in records if t["name"] == "gateway"]
        assert len(mine) == 1 and mine[0]["scopes"] == ["ws"], mine
        # The gateway reaches the server with it: a message becomes a turn.
        assert _post(port, {"id": "t1", "chat": "c", "sender": "s", "text": "hi"}).status_code == 202
        wait_for(lambda: store_turns(home, 'message_id="t1"') == 1, timeout=20, what="the turn")
        srv.stop()
    tokens = json.loads((home / "auth" / "tokens.json").read_text())
    records = tokens["tokens"] if isinstance(tokens, dict) else tokens
    assert [t for t in records if t["name"] == "gateway"] == []


def test_a_command_leaves_a_corrupt_ledger_the_running_gateway_holds_in_place(tmp_path: Path) -> None:
    """gateway.db damaged on disk while the gateway serves (found by an outside test): `channels
    status` moved the live file aside, so the gateway went on in the renamed file while `pairing
    approve` and every later command worked on a new, empty one the gateway never read (a pending
    code could not be approved; after a restart it was gone). Commands now refuse and leave the file
    where it is; the gateway moves it aside itself when it next starts, and goes on working."""
    import os
    import signal

    from tests.support.cli import run_cli

    home = tmp_path / "home"
    port = free_port()
    settings = {"listen": f"127.0.0.1:{port}", "secret_env": "WH_SECRET", "default_agent": "assistant"}
    write_config(home, {"webhook": {"main": settings}}, ["webhook"])
    env = cli_env(home, WH_SECRET=SECRET)
    with channel_server(home, env=env, ready=False) as srv:
        _check_showing(srv, "webhook:main running")
        assert _post(port, {"id": "a1", "chat": "c", "sender": "s", "text": "hi"}).status_code == 202
        wait_for(lambda: store_turns(home, 'message_id="a1"') == 1, timeout=20, what="the first turn")
        channels = home / "channels"
        for name in ("gateway.db", "gateway.db-wal"):
            path = channels / name
            if path.exists():
                with open(path, "r+b") as f:
                    f.write(b"\xa5" * max(path.stat().st_size, 8192))
        for command in (("channels", "status"), ("pairing", "list"), ("pairing", "approve", "ABCDEFGH")):
            done = run_cli(home, *command, env=env)
            assert done.code != 0 and "holds it" in done.err and "left in place" in done.err, (command, done)
            assert not list(channels.glob("gateway.db.corrupt-*")), (command, sorted(os.listdir(channels)))
        assert asyncio.run(_ws_pairing_list(srv.url)) == {"code": "ledger_unavailable", "held": True}
        os.kill(srv.gateway_pid(), signal.SIGKILL)  # the next gateway moves it aside, loudly
        wait_for(lambda: bool(list(channels.glob("gateway.db.corrupt-*"))), timeout=60, what="the ledger moved aside")
        # /readyz caches its checks for half a second: "running" may still be the killed child's
        _check_showing(srv, "webhook:main running", timeout=60)
        wait_for(lambda: _listening(port), timeout=60, what="the next gateway's webhook listener")
        assert _post(port, {"id": "a2", "chat": "c", "sender": "s", "text": "again"}).status_code == 202
        wait_for(lambda: store_turns(home, 'message_id="a2"') == 1, timeout=30, what="a turn on the new ledger")
        assert run_cli(home, "pairing", "list", env=env).code == 0


async def _ws_pairing_list(http_url: str) -> dict[str, Any]:
    import websockets

    from tests.support.ws import ws_url

    async with websockets.connect(ws_url(http_url), open_timeout=20) as ws:
        await ws.send(json.dumps({"type": "hello", "protocol": 1, "request_id": "h"}))
        assert json.loads(await asyncio.wait_for(ws.recv(), 20))["type"] == "welcome"
        await ws.send(json.dumps({"type": "pairing_list", "request_id": "p"}))
        answer = json.loads(await asyncio.wait_for(ws.recv(), 20))
        return {"code": answer.get("code"), "held": "holds it" in str(answer.get("message"))}


def test_the_gateway_child_imports_nothing_from_the_working_directory(tmp_path: Path) -> None:
    """`serve` started from a directory holding `concurrent.py` (found by an outside test): the
    gateway child, started as `python -m gateway`, had that directory first on sys.path, so the
    file ran inside it (the process that reads the gateway's credential) and the child crash-looped
    (`concurrent.futures` not found). It now imports only the server's own code and the standard
    library: the file never runs, and the channel works."""
    import os
    import subprocess
    import sys

    from tests.support.serve import ROOT

    cwd = tmp_path / "cwd"
    cwd.mkdir()
    marker = tmp_path / "ran"
    planted = f"open({str(marker)!r}, 'a').write('ran in ' + __import__('sys').argv[0] + '\\n')\n"
    for name in ("concurrent.py", "gateway.py", "plugins.py", "json.py"):
        (cwd / name).write_text(planted)
    home = tmp_path / "home"
    port = free_port()
    settings = {"listen": f"127.0.0.1:{port}", "secret_env": "WH_SECRET", "default_agent": "assistant"}
    write_config(home, {"webhook": {"main": settings}}, ["webhook"])
    env = cli_env(home, WH_SECRET=SECRET, PYTHONPATH=str(ROOT))  # this tree's code, run from elsewhere
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-P", "-m", "appserver", "serve", "--listen", "127.0.0.1:0"],
            cwd=cwd,
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_for(lambda: (home / "server.json").exists(), timeout=30, what="server.json")
        url = json.loads((home / "server.json").read_text())["url"]
        srv = ChannelServer(proc, home, url, log_path)
        _check_showing(srv, "webhook:main running", timeout=60)
        assert _post(port, {"id": "w1", "chat": "c", "sender": "s", "text": "hi"}).status_code == 202
        wait_for(lambda: store_turns(home, 'message_id="w1"') == 1, timeout=30, what="the turn")
        assert not marker.exists(), marker.read_text()
        assert "ModuleNotFoundError" not in log_path.read_text()
    finally:
        from tests.support.gateway import gateway_children

        children = gateway_children(proc.pid)
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        for pid in children:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
