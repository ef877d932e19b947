"""Attacker C's cron and `schedule` tool findings (session 39, fixer C), through real servers.

1. Any token client made the bot post scheduled replies to any chat, and blamed any sender: the
   tool took a conversation for a chat's when its metadata held `channel_route`, which a client
   sets on its own conversation (OpenAI `metadata`, the WebSocket's `create_conversation`), and took
   the task's origin from the turn's `source`, which a WebSocket client writes. Now the marker and a
   `source` of kind `channel` are believed only in the gateway's own namespace (or, in auth mode
   `none`, an unowned conversation): such a client's task delivers nowhere and records no origin.
2. `cron run` of a disabled task was dropped ("not started: the task was disabled before this run
   began") when its run had to queue behind a running turn, though it runs at once when the
   conversation is idle. Now a run asked by hand after the task was disabled goes ahead; a disable
   after it was asked still drops it.
4. A webhook sender whose id is over 512 characters (the channel takes 1,024) could schedule
   nothing: the task's origin refused the id.

Real `appserver serve` (auth mode token with the webhook channel; mode none with the echo model's
`/slow`), the CLI, real HTTP and WebSocket clients, crons.json and run logs read from disk.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from plugins.webhook import SIGNATURE_HEADER, TIMESTAMP_HEADER, sign
from tests.support.cli import ROOT, cli_env, run_cli
from tests.support.gateway import ChannelServer, WebhookReplies, channel_server, write_config
from tests.support.net import SSL, free_port
from tests.support.serve import ServeProcess, start_serve
from tests.support.wait import wait_for
from tests.support.ws import WS
from tests.support.zygote_client import appserver_popen

pytestmark = pytest.mark.timeout(120)

T = 30.0
SECRET = "s3cret-for-s39c-webhook"
VICTIM = "webhook:home:victim:__root__"


def _tasks(home: Path) -> dict[str, dict[str, Any]]:
    path = home / "crons.json"
    return {t["name"]: t for t in json.loads(path.read_text())["tasks"]} if path.exists() else {}


def _run_log(home: Path, task_id: str) -> list[dict[str, Any]]:
    path = home / "cron-runs" / f"{task_id}.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _token(home: Path, name: str, scopes: str) -> str:
    made = run_cli(home, "token", "create", "--name", name, "--scopes", scopes, "--json")
    assert made.code == 0, made.err
    return str(made.json()["token"])


@pytest.fixture(scope="module")
def replies() -> Iterator[WebhookReplies]:
    r = WebhookReplies()
    yield r
    r.close()


@pytest.fixture(scope="module")
def webhook_srv(
    tmp_path_factory: pytest.TempPathFactory, replies: WebhookReplies
) -> Iterator[tuple[ChannelServer, int]]:
    home = tmp_path_factory.mktemp("s39c") / "home"
    port = free_port()
    settings = {"listen": f"127.0.0.1:{port}", "secret_env": "WH_SECRET", "reply_url": replies.url}
    write_config(home, {"webhook": {"home": {**settings, "default_agent": "assistant"}}}, ["webhook"])
    # (mode token from the command line, as an operator may start it: the tool reads the running mode)
    with channel_server(home, "--auth", "token", env=cli_env(home, WH_SECRET=SECRET)) as srv:
        yield srv, port


def _webhook(port: int, message_id: str, sender: str, text: str) -> None:
    body = json.dumps({"id": message_id, "chat": "c1", "sender": sender, "text": text}).encode()
    stamp = str(int(time.time()))
    headers = {"Content-Type": "application/json", TIMESTAMP_HEADER: stamp, SIGNATURE_HEADER: sign(SECRET, stamp, body)}
    answer = httpx.post(f"http://127.0.0.1:{port}/", content=body, headers=headers, timeout=10)
    assert answer.status_code == 202, answer.text


def test_a_token_client_cannot_make_a_chat_task_by_naming_a_chat(
    webhook_srv: tuple[ChannelServer, int], replies: WebhookReplies
) -> None:
    srv, _ = webhook_srv
    alice = _token(srv.home, "alice", "openai")
    call = {"action": "create", "name": "leak", "every": "1h", "prompt": "p"}
    r = httpx.post(
        srv.url + "/v1/chat/completions",
        headers={"Authorization": f"Bearer {alice}"},
        json={
            "model": "assistant",
            "metadata": {"channel_route": VICTIM},
            "messages": [{"role": "user", "content": f"/call schedule {json.dumps(call)}"}],
        },
        timeout=T,
        verify=SSL,
    )
    assert r.status_code == 200, r.text
    answer = r.json()["choices"][0]["message"]["content"]
    assert "created task leak" in answer and "posted" not in answer, answer
    leak = _tasks(srv.home)["leak"]
    # before: deliver webhook:home:victim, origin {chat: victim}: the bot posted alice's runs there
    assert leak["namespace"] == "token:token:alice"
    assert leak.get("deliver") is None and leak.get("origin") is None, leak

    # over the WebSocket the client writes the turn's `source` too: it names no chat nor sender
    mallory = _token(srv.home, "mallory", "ws")

    async def framed() -> str:
        ws = await WS.open(srv.url, hello=False)
        try:
            hello = await ws.request({"type": "hello", "protocol": 1, "client": "test", "token": mallory})
            assert hello["type"] == "welcome", hello
            made = await ws.request(
                {"type": "create_conversation", "agent": "assistant", "metadata": {"channel_route": VICTIM}}
            )
            conv = str(made["conversation"]["id"])
            call = {"action": "create", "name": "framed", "every": "1h", "prompt": "p"}
            source = {"kind": "channel", "channel": "webhook", "account": "home", "chat": "victim", "sender": "bob"}
            ack = await ws.request(
                {
                    "type": "submit_input",
                    "agent": "assistant",
                    "conversation": conv,
                    "input": f"/call schedule {json.dumps(call)}",
                    "source": source,
                }
            )
            assert ack["type"] == "ack", ack
            ended = await ws.expect(
                lambda f: f.get("type") == "turn_updated" and f["snapshot"]["status"] in ("completed", "failed"), T
            )
            return str(ended["snapshot"]["status"])
        finally:
            await ws.close()

    assert asyncio.run(framed()) == "completed"
    task = wait_for(lambda: _tasks(srv.home).get("framed"), T, "mallory's task")
    # before: origin {chat: victim, sender: bob}: `cron list` blamed bob, `pairing revoke bob` disabled it
    assert task["namespace"] == "token:token:mallory"
    assert task.get("deliver") is None and task.get("origin") is None, task
    assert not [b for b in replies.bodies if b.get("chat") == "victim"]


def test_a_chat_of_the_gateway_still_makes_chat_tasks_for_a_long_sender_id(
    webhook_srv: tuple[ChannelServer, int], replies: WebhookReplies
) -> None:
    srv, port = webhook_srv
    sender = "u" * 1000  # the webhook takes sender ids of up to 1,024 characters (before: 512 here)
    call = {"action": "create", "name": "long", "every": "1h", "prompt": "p"}
    _webhook(port, "m-long", sender, f"/call schedule {json.dumps(call)}")
    texts = wait_for(lambda: replies.texts_for("m-long") or None, T, "the schedule answer")
    assert "created task long" in texts[0] and "posted to webhook:home:c1" in texts[0], texts
    task = _tasks(srv.home)["long"]
    assert task["deliver"] == "webhook:home:c1"
    assert task["origin"] == {"channel": "webhook", "account": "home", "chat": "c1", "sender": sender}


@pytest.fixture
def served(home: Path) -> Iterator[tuple[ServeProcess, dict[str, str]]]:
    env = cli_env(home, APPSERVER_CRON__TICK_S="1")  # a tick each second: a drop happens at once
    sp = start_serve(home, env=env)
    try:
        yield sp, env
    finally:
        sp.kill()


async def _busy(sp: ServeProcess, conversation: str, words: int) -> str:
    """A `/slow` turn running in `conversation` (its socket closed: a disconnect cancels nothing)."""
    ws = await WS.open(sp.url)
    try:
        ack = await ws.request(
            {"type": "submit_input", "agent": "assistant", "conversation": conversation, "input": f"/slow {words}"}
        )
        assert ack["type"] == "ack", ack
        await ws.expect(lambda f: f.get("type") == "turn_updated" and f["snapshot"]["status"] == "running", 20)
    finally:
        await ws.close()
    return str(ack["conversation_id"])


def test_cron_run_of_a_disabled_task_runs_once_even_when_it_queues(
    home: Path, served: tuple[ServeProcess, dict[str, str]]
) -> None:
    sp, env = served
    conversation = asyncio.run(_busy(sp, "new", 120))  # the echo model's 120 words, 50 ms apart
    made = run_cli(
        home,
        "cron", "add", "--name", "t1", "--agent", "assistant", "--conversation", conversation,
        "--every", "1h", "--prompt", "MANUAL-S39C", "--json",
        env=env,
    )  # fmt: skip
    assert made.code == 0, made.err
    task_id = str(made.json()["id"])
    assert run_cli(home, "cron", "disable", "t1", env=env).code == 0
    ran = run_cli(home, "cron", "run", "t1", "--timeout", "60", env=env, timeout=90)
    # before: exit 1 within a tick, "cancelled … not started: the task was disabled before this run began"
    assert ran.code == 0, (ran.out, ran.err)
    outcome = next(r for r in _run_log(home, task_id) if r["event"] == "outcome" and r["occurrence"] == 1)
    assert outcome["status"] == "completed", outcome
    assert not _tasks(home)["t1"]["enabled"]  # still disabled: one run, by hand

    # a disable after the run was asked still drops it while it waits (as `cron disable` says)
    asyncio.run(_busy(sp, conversation, 400))
    with appserver_popen(
        ["cron", "run", "t1", "--timeout", "60"],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as second:
        wait_for(
            lambda: any(r["event"] == "submitted" and r["occurrence"] == 2 for r in _run_log(home, task_id)),
            T,
            "the second run to queue",
        )
        again = run_cli(home, "cron", "disable", "t1", env=env)
        assert again.code == 0 and "its queued run #2 was dropped" in again.out, (again.out, again.err)
        out, _ = second.communicate(timeout=T)
    assert second.returncode == 1, out
    dropped = next(r for r in _run_log(home, task_id) if r["event"] == "outcome" and r["occurrence"] == 2)
    assert dropped["status"] == "cancelled" and "disabled" in str(dropped["error"]), dropped


def test_a_run_asked_by_hand_of_a_disabled_task_still_runs_after_a_restart(home: Path) -> None:
    env = cli_env(home, APPSERVER_CRON__TICK_S="3600")  # no backstop tick: the restart alone decides
    servers = [start_serve(home, env=env)]
    try:
        conversation = asyncio.run(_busy(servers[0], "new", 2000))
        made = run_cli(
            home,
            "cron", "add", "--name", "t1", "--agent", "assistant", "--conversation", conversation,
            "--every", "1h", "--prompt", "MANUAL-S39C", "--json",
            env=env,
        )  # fmt: skip
        assert made.code == 0, made.err
        task_id = str(made.json()["id"])
        assert run_cli(home, "cron", "disable", "t1", env=env).code == 0
        with appserver_popen(
            ["cron", "run", "t1", "--timeout", "60", "--reconnect-wait", "0"],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        ) as asked:
            wait_for(lambda: any(r["event"] == "submitted" for r in _run_log(home, task_id)), T, "the run to queue")
            servers[0].kill()  # the run stays queued in the store; the next start takes it up
            asked.communicate(timeout=T)
        servers.append(start_serve(home, env=env))
        # before: held back at the start as "not started: the task was disabled before this run began"
        ended = wait_for(
            lambda: next((r for r in _run_log(home, task_id) if r["event"] == "outcome"), None), T, "its outcome"
        )
        assert ended["status"] == "completed", ended
    finally:
        for sp in servers:
            sp.kill()
