"""A chat command acts at most once and its answer comes under one key, across a kill -9 (session 29, W1).

Found from outside: turn A waits for an approval, turn B is queued behind it, the receiver of the
webhook channel's replies hangs, the user sends `/cancel`, and the gateway child is killed -9 while
"⏹ Cancelled." is in flight. The restarted gateway ran `/cancel` again (its ledger row was still
`allowed`: the command ran, then its answer went out, then the row was marked) and cancelled turn
B, which had started after the first `/cancel`; the receiver got "⏹ Cancelled." twice, under two
random ids. Now the ledger notes the command taken before it acts and its answer before it is sent:
the restart sends that answer again under the same id (`cmd:<ledger key>`) and never runs it again.

Real `appserver serve --channels webhook` (the supervisor restarts its killed gateway child), the
echo model (`/call clock {}` on an agent that asks first pauses for an approval), a loopback
reply_url receiver that hangs while told to, gateway.db read with sqlite3.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from plugins.webhook import SIGNATURE_HEADER, TIMESTAMP_HEADER, sign
from tests.support.cli import careful_home, cli_env
from tests.support.gateway import ChannelServer, channel_server, write_config
from tests.support.net import free_port
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(150)

SECRET = "s3cret-for-s29w1-webhook"
CHAT = "kitchen"


class Receiver:
    """The app at reply_url: records every POST; while `hanging`, holds each one unanswered."""

    def __init__(self) -> None:
        self.posts: list[dict[str, Any]] = []
        self.hanging = threading.Event()
        self.refuse_prompts = False  # an approval prompt is answered 400 (it cannot be shown)
        self.closed = threading.Event()
        self._lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's API
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                with outer._lock:
                    outer.posts.append(body)
                if outer.hanging.is_set():
                    outer.closed.wait(60)
                refused = outer.refuse_prompts and "Reply /approve" in str(body.get("text"))
                try:
                    self.send_response(400 if refused else 200)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                except OSError:
                    pass

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/replies"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answers_to(self, message_id: str) -> list[dict[str, Any]]:
        with self._lock:
            return [p for p in self.posts if p.get("reply_to") == message_id]

    def close(self) -> None:
        self.closed.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


@pytest.fixture()
def served(tmp_path: Path, receiver: Receiver) -> Iterator[tuple[ChannelServer, int]]:
    home = careful_home(tmp_path)
    port = free_port()
    settings = {
        "listen": f"127.0.0.1:{port}",
        "secret_env": "WH_SECRET",
        "reply_url": receiver.url,
        "default_agent": "careful",
    }
    write_config(home, {"webhook": {"home": settings}}, ["webhook"])
    with channel_server(home, env=cli_env(home, WH_SECRET=SECRET)) as srv:
        yield srv, port


def _post(port: int, message_id: str, text: str, sender: str = "ann") -> None:
    body = json.dumps({"id": message_id, "chat": CHAT, "sender": sender, "text": text}).encode()
    stamp = str(int(time.time()))
    headers = {"Content-Type": "application/json", TIMESTAMP_HEADER: stamp, SIGNATURE_HEADER: sign(SECRET, stamp, body)}
    answer = httpx.post(f"http://127.0.0.1:{port}/", content=body, headers=headers, timeout=10)
    assert answer.status_code == 202, answer.text


def _state(home: Path, message_id: str) -> str | None:
    conn = sqlite3.connect(f"file:{home / 'channels' / 'gateway.db'}?mode=ro", uri=True)
    try:
        row = conn.execute("SELECT state FROM ledger WHERE message_id = ?", (message_id,)).fetchone()
    finally:
        conn.close()
    return str(row[0]) if row else None


def test_a_cancel_whose_answer_was_in_flight_at_kill9_is_not_run_again_and_answers_under_one_id(
    served: tuple[ChannelServer, int], receiver: Receiver
) -> None:
    srv, port = served
    _post(port, "A", "/call clock {}")
    wait_for(lambda: any("/approve" in p["text"] for p in receiver.answers_to("A")), 30, "turn A's approval prompt")
    # queued behind A in the chat's conversation; Bob's, so Ann's /cancel does not withdraw it
    _post(port, "B", "/call clock {}", sender="bob")
    wait_for(lambda: _state(srv.home, "B") == "submitted", 30, "turn B accepted (queued)")

    receiver.hanging.set()
    _post(port, "X", "/cancel")
    wait_for(lambda: receiver.answers_to("X") or None, 30, "the answer to /cancel in flight")
    killed = srv.gateway_pid()
    os.kill(killed, signal.SIGKILL)
    receiver.hanging.clear()
    receiver.closed.set()  # the held requests end (their sender is gone)

    wait_for(lambda: srv.gateway_pid() != killed or None, 60, "the supervisor's restart of the gateway")
    srv.wait_channels_ready(60)
    wait_for(lambda: _state(srv.home, "X") == "delivered", 60, "the /cancel row settled after the restart")
    wait_for(lambda: any("/approve" in p["text"] for p in receiver.answers_to("B")), 30, "turn B's approval prompt")

    # the effect once: turn B, started after the first /cancel, still waits for its approval
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        assert _state(srv.home, "B") == "submitted", [p["text"] for p in receiver.answers_to("B")]
        time.sleep(0.1)
    assert not any("ancel" in p["text"] for p in receiver.answers_to("B")), receiver.answers_to("B")

    # the answer at least once, and every copy of it under one id (a receiver dedupes by it)
    answers = receiver.answers_to("X")
    assert answers and all("Cancelled" in p["text"] for p in answers), answers
    assert len({p["id"] for p in answers}) == 1, answers
    assert answers[0]["id"].startswith("cmd:"), answers


def test_a_bare_approve_while_a_prompt_could_not_be_shown_names_it_and_how_to_answer(
    served: tuple[ChannelServer, int], receiver: Receiver
) -> None:
    srv, port = served
    receiver.refuse_prompts = True
    _post(port, "P", "/call clock {}")
    notice = wait_for(
        lambda: next((p for p in receiver.answers_to("P") if "could not be shown" in p["text"]), None),
        30,
        "the notice that the prompt could not be shown",
    )
    short = notice["text"].split("/deny ")[1].split(",")[0].split()[0]
    _post(port, "Q", "/approve")
    told = wait_for(lambda: receiver.answers_to("Q") or None, 30, "the answer to a bare /approve")[0]["text"]
    assert "No request waiting" not in told, told
    assert "could not be shown" in told and f"/approve {short}" in told and f"/deny {short}" in told, told
    assert _state(srv.home, "P") == "submitted"  # not approved by the bare /approve
