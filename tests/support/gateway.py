"""A real `appserver serve --channels fakechat` against the loopback fake chat platform.

The server's stderr (with the gateway child's relayed log) goes to a file the test can read, so a
chatty gateway never blocks on a full pipe.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from appserver.client import ProtocolClient
from tests.fakes.discord_api import FakeDiscord
from tests.fakes.fakechat import FakeChat
from tests.support.cli import ROOT, cli_env, run_cli
from tests.support.net import SSL
from tests.support.zygote_client import appserver_popen

PLUGIN = ROOT / "tests" / "fakes" / "fakechat_plugin"
# What the server logs when its gateway child is up (gateway/supervisor.py).
READY_LINE = "gateway: ready (pid"


def toml_value(value: Any) -> str:
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(str(value))


def write_config(home: Path, accounts: dict[str, dict[str, dict[str, Any]]], enabled: list[str]) -> None:
    lines = ["[channels]", f"enabled = {json.dumps(enabled)}", ""]
    for channel, by_name in accounts.items():
        for name, settings in by_name.items():
            lines.append(f"[channels.{channel}.accounts.{name}]")
            lines += [f"{k} = {toml_value(v)}" for k, v in settings.items()]
            lines.append("")
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text("\n".join(lines))


def install_fakechat(home: Path) -> None:
    target = home / "channels" / "fakechat"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(PLUGIN, target, ignore=shutil.ignore_patterns("__pycache__"))


def fakechat_settings(chat: FakeChat, **extra: Any) -> dict[str, Any]:
    """The account's settings; a setting given as None is left out (`default_agent=None`: none)."""
    made = {"base_url": chat.url, "poll_timeout": 0.5, "default_agent": "assistant", "dm_policy": "open", **extra}
    return {key: value for key, value in made.items() if value is not None}


@dataclass
class ChannelServer:
    proc: subprocess.Popen[bytes]
    home: Path
    url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def readyz(self) -> dict[str, Any]:
        body: dict[str, Any] = httpx.get(self.url + "/readyz", timeout=5, verify=SSL).json()
        return body

    def channels_check(self) -> dict[str, Any]:
        for check in self.readyz().get("checks", []):
            if check["name"] == "channels":
                return dict(check)
        raise AssertionError(f"no channels check in /readyz: {self.readyz()}")

    def wait_channels_ready(self, timeout: float = 30, restarts: int = 0) -> None:
        """The channels check of /readyz passing. While the gateway starts, the server's log is
        read for the gateway's ready line (its `restarts`+1-th) first: a file read per poll, not a
        /readyz request (and the server's answer) every few milliseconds. A line that never comes
        (another log format, no gateway) only leaves /readyz to decide, as before."""
        deadline = time.monotonic() + timeout
        while self.log().count(READY_LINE) <= restarts and self.proc.poll() is None:
            if time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        last: Any = None
        while True:
            try:
                last = self.channels_check()
                if last["status"] == "ok":
                    return
            except (httpx.HTTPError, AssertionError) as exc:
                last = exc
            if time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        raise AssertionError(f"channels not ready in {timeout} s: {last}\n{self.log()[-3000:]}")

    def gateway_pid(self, timeout: float = 30) -> int:
        """The pid of the gateway child (`python -m gateway` whose parent is this server)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for pid in gateway_children(self.proc.pid):
                return pid
            time.sleep(0.01)
        raise AssertionError("no gateway child process")

    def stop(self, timeout: float = 20) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def gateway_children(ppid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == ppid and b"gateway" in cmdline and b"-m" in cmdline:
            out.append(int(entry.name))
    return out


def start_channel_server(
    home: Path, *extra: str, env: dict[str, str] | None = None, timeout: float = 30
) -> ChannelServer:
    server_json = home / "server.json"
    server_json.unlink(missing_ok=True)
    log_path = home.parent / f"{home.name}-serve-{time.monotonic_ns()}.log"
    with open(log_path, "wb") as log_file:
        proc = appserver_popen(
            ["serve", "--listen", "127.0.0.1:0", *extra],
            env=env or cli_env(home),
            cwd=ROOT,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited with {proc.returncode}: {log_path.read_text()[-3000:]}")
        if server_json.exists():
            try:
                info = json.loads(server_json.read_text())
            except json.JSONDecodeError:
                info = None
            if info and info.get("pid") == proc.pid:
                _remember_instance(home, proc.pid, (env or {}).get("APPSERVER_STORE__URL", ""))
                return ChannelServer(proc, home, info["url"], log_path)
        time.sleep(0.005)  # a start takes a few tens of milliseconds (tests/support/zygote.py)
    proc.kill()
    raise RuntimeError("serve did not write server.json in time")


# home -> (database URL, cluster instance id) of a server started on PostgreSQL: its gateway keeps its
# ledger in the database (gateway/sqlstore.py), each row saying which instance's gateway recorded it.
_PG_HOMES: dict[Path, tuple[str, str]] = {}


def _remember_instance(home: Path, pid: int, store_url: str) -> None:
    if not store_url.strip():
        return
    import psycopg

    from tests.support.pg import url_for

    url = url_for(urlsplit(store_url).path.lstrip("/"))  # as the admin: the server's own role may be cut off
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT id FROM instances WHERE pid = %s ORDER BY started_at DESC", (pid,)).fetchone()
    if row is not None:
        _PG_HOMES[home] = (url, str(row[0]))


def ledger_column(home: Path, column: str) -> list[Any]:
    """`column` of every ledger row the gateway of `home`'s server recorded, oldest first: its
    gateway.db, or, for a server on PostgreSQL, the rows of the shared `gateway_ledger` that its
    instance's gateway recorded (`recorded_by`)."""
    import sqlite3

    from gateway.db import default_path

    if home in _PG_HOMES:
        import psycopg

        url, instance = _PG_HOMES[home]
        with psycopg.connect(url, autocommit=True) as conn:
            exists = conn.execute("SELECT to_regclass('gateway_ledger') IS NOT NULL").fetchone()
            if not (exists and exists[0]):
                return []
            rows = conn.execute(
                f"SELECT {column} FROM gateway_ledger WHERE recorded_by = %s ORDER BY id",
                (f"appserver gateway {instance}",),
            ).fetchall()
        return [r[0] for r in rows]
    if not default_path(home).exists():
        return []
    with sqlite3.connect(f"file:{default_path(home)}?mode=ro", uri=True) as conn:
        return [r[0] for r in conn.execute(f"SELECT {column} FROM ledger ORDER BY id").fetchall()]


@contextmanager
def channel_server(
    home: Path, *extra: str, env: dict[str, str] | None = None, ready: bool = True
) -> Iterator[ChannelServer]:
    srv = start_channel_server(home, *extra, env=env)
    try:
        if ready:
            srv.wait_channels_ready()
        yield srv
    finally:
        if srv.proc.poll() is None:
            try:
                srv.stop()
            except subprocess.TimeoutExpired:
                pass
        srv.kill()
        for pid in gateway_children(srv.proc.pid):  # never leave a child behind a failed test
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@contextmanager
def discord_server(
    home: Path,
    fake: FakeDiscord,
    channels: dict[str, str] | None = None,
    careful_in: str | None = None,
    token: str | None = None,
    ready: bool = True,
    **overrides: Any,
) -> Iterator[ChannelServer]:
    """A server on the `discord:main` account of `fake` (open DMs, the `assistant` agent) with the
    text `channels` (id: name) added; with `careful_in`, that channel is routed to a `careful` agent
    whose clock tool asks for approval. `token` replaces the fake's own; `overrides` the account's
    settings (`dm_policy="pairing"`)."""
    settings = {"api_url": fake.api_url, "gateway_url": fake.gateway_url, "token_env": "DISCORD_BOT_TOKEN",
                "dm_policy": "open", "default_agent": "assistant", **overrides}  # fmt: skip
    write_config(home, {"discord": {"main": settings}}, ["discord"])
    for channel, name in (channels or {}).items():
        fake.add_text_channel(channel, name)
    if careful_in is not None:
        created = run_cli(home, "agents", "create", "--name", "careful", "--tool", "clock=ask")
        assert created.code == 0, created.err
        routed = run_cli(home, "channels", "route", "add", f"discord:main:{careful_in}", "careful")
        assert routed.code == 0, routed.err
    env = cli_env(home, DISCORD_BOT_TOKEN=fake.token if token is None else token)
    with channel_server(home, "--channels", "discord", env=env, ready=ready) as server:
        yield server


def fakechat_home(home: Path, chat: FakeChat, **settings: Any) -> Path:
    """A home with one `fakechat:main` account on `chat` (open DMs, the `assistant` agent)."""
    write_config(home, {"fakechat": {"main": fakechat_settings(chat, **settings)}}, ["fakechat"])
    install_fakechat(home)
    return home


def store_turns(home: Path, text_fragment: str) -> int:
    """How many user messages in the store contain `text_fragment` (one per turn)."""
    import sqlite3

    conn = sqlite3.connect(f"file:{home / 'appserver.db'}?mode=ro", uri=True)
    try:
        rows = conn.execute("SELECT content FROM messages WHERE role='user'").fetchall()
    finally:
        conn.close()
    return sum(1 for (content,) in rows if text_fragment in _text(content))


def _text(content: str) -> str:
    try:
        value = json.loads(content)
    except ValueError:
        return content
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(str(p.get("text") or "") for p in value if isinstance(p, dict))
    return content


async def end_pending_turn(srv: ChannelServer, agent: str, how: str) -> None:
    """End the turn of `agent` that waits for an approval over the protocol, as a desktop app or the
    CLI does (`how`: "approve" its call, or "cancel" the turn), and wait until its conversation is
    idle again (the turn ended)."""
    client = await ProtocolClient.connect(srv.url, token="", client="desktop")
    try:
        deadline = time.monotonic() + 30
        found: tuple[str, str] | None = None
        while found is None:
            assert time.monotonic() < deadline, "no pending approval found"
            convs = await client.request({"type": "list_conversations", "agent": agent})
            for conv in convs["conversations"]:
                state = await client.request({"type": "subscribe", "conversation": conv["id"]})
                for pending in state.get("pending_approvals") or []:
                    found = (conv["id"], str(pending["call_id"]))
            if found is None:
                await asyncio.sleep(0.05)
        conversation, call_id = found
        if how == "approve":
            decisions = [{"call_id": call_id, "decision": "approve"}]
            ack = await client.request(
                {"type": "approval_response", "conversation": conversation, "decisions": decisions}
            )
            assert (ack.get("results") or [{}])[0].get("accepted") is True, ack
        else:
            ack = await client.request({"type": "cancel", "conversation": conversation})
            assert ack.get("type") != "error", ack
        while True:
            state = await client.request({"type": "subscribe", "conversation": conversation})
            if state.get("state") == "idle" and not state.get("active_turn"):
                return
            assert time.monotonic() < deadline, f"the turn did not end: {state}"
            await asyncio.sleep(0.05)
    finally:
        await client.close()


class WebhookReplies:
    """A receiver of the webhook channel's replies (`reply_url`), on an ephemeral port."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        lock = threading.Lock()
        bodies = self.bodies

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the http.server name
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                with lock:
                    bodies.append(json.loads(body))
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/r"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def texts_for(self, message_id: str) -> list[str]:
        return [str(b.get("text")) for b in list(self.bodies) if b.get("reply_to") == message_id]

    def reply_ids(self, message_id: str) -> set[str]:
        """The ids of the replies to `message_id` (a reply sent again keeps its id)."""
        return {str(b.get("id")) for b in list(self.bodies) if b.get("reply_to") == message_id}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
