"""Fixes of the WebSocket / `appserver chat` review (s19), against real `appserver serve` processes,
raw WebSocket clients and the real `appserver chat` in a pseudo-terminal or with piped input:

* F1: idempotency keys belong to the credential, also for `admin` credentials (WS and HTTP);
* F2: `chat` shows how an approval it withdrew really ended (expired, cancelled), never "answered
  elsewhere" when nobody answered;
* F3: after kill -9, `chat` says which part of the reply it showed the server did not keep;
* F4: an input of blank text parts is empty (`invalid_request`), as "" is;
* F5: a queued turn taken out of the queue has no queue position (0) in acks and snapshots;
* piped `chat` shows each line after its `you> ` prompt, the first one too.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import sqlite3
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from appserver.auth import TokenStore
from appserver.client import ProtocolClient
from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, serving, start_serve
from tests.support.ws import WS
from tests.test_chat_terminal import Pty

pytestmark = pytest.mark.timeout(90)

T = 10.0


def _rows(home: Path, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    db = sqlite3.connect(f"file:{home / 'appserver.db'}?mode=ro", uri=True, timeout=5)
    try:
        return db.execute(sql, args).fetchall()
    finally:
        db.close()


def _user_texts(home: Path, conv: str) -> list[Any]:
    sql = "SELECT content FROM messages WHERE conversation_id=? AND role='user' ORDER BY id"
    return [json.loads(c) for (c,) in _rows(home, sql, conv)]


# ───────────────────────────────────────────────────────────── F1: keys per credential, admins too


@pytest.fixture(scope="module")
def admins(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeProcess, Path, str, str]]:
    home = tmp_path_factory.mktemp("s19_admins") / "home"
    tokens = TokenStore(home)
    ann = tokens.create(name="ann", scopes="openai,ws,admin")[1]
    bob = tokens.create(name="bob", scopes="openai,ws,admin")[1]
    with serving(home, "--auth", "token", env=cli_env(home)) as sp:
        yield sp, home, ann, bob


async def test_two_admin_tokens_with_one_ws_key_run_two_turns(admins: tuple[ServeProcess, Path, str, str]) -> None:
    """Admin credentials (which see every conversation) shared one key space: Bob's input with the
    key Ann used was acked as Ann's turn (`duplicate: true`) and never stored."""
    sp, home, ann_token, bob_token = admins
    ann = await WS.open(sp.url, headers={"Authorization": f"Bearer {ann_token}"}, open_timeout=T)
    bob = await WS.open(sp.url, headers={"Authorization": f"Bearer {bob_token}"}, open_timeout=T)
    try:
        key = f"order-1-{uuid.uuid4().hex[:8]}"
        submit = {"type": "submit_input", "agent": "assistant", "conversation": "default", "idempotency_key": key}
        a = await ann.request({**submit, "input": "ann's message"}, T)
        b = await bob.request({**submit, "input": "bob's different message"}, T)
        assert a["type"] == "ack" and b["type"] == "ack", (a, b)
        assert b["duplicate"] is False and b["turn_id"] != a["turn_id"], (a, b)
        assert a["conversation_id"] == b["conversation_id"]  # the agent's shared default
        assert (await ann.terminal(a["turn_id"], T))["status"] == "completed"
        assert (await bob.terminal(b["turn_id"], T))["status"] == "completed"
        users = _user_texts(home, a["conversation_id"])
        assert "ann's message" in users and "bob's different message" in users, users
        # each credential's own key still is one turn
        again = await ann.request({**submit, "input": "ann's message"}, T)
        assert again["duplicate"] is True and again["turn_id"] == a["turn_id"], again
        again = await bob.request({**submit, "input": "bob's different message"}, T)
        assert again["duplicate"] is True and again["turn_id"] == b["turn_id"], again
        # and to "new" (keyed by agent): two conversations, two turns
        new = {**submit, "conversation": "new", "idempotency_key": f"{key}-new"}
        a2 = await ann.request({**new, "input": "ann new"}, T)
        b2 = await bob.request({**new, "input": "bob new"}, T)
        assert b2["duplicate"] is False and b2["conversation_id"] != a2["conversation_id"], (a2, b2)
    finally:
        await ann.close()
        await bob.close()


async def test_two_admin_tokens_with_one_http_key_run_two_requests(
    admins: tuple[ServeProcess, Path, str, str],
) -> None:
    sp, home, ann_token, bob_token = admins
    key = f"http-{uuid.uuid4().hex[:8]}"
    async with httpx.AsyncClient(base_url=sp.url, timeout=T) as http:
        replies = []
        for token, text in ((ann_token, "ann over http"), (bob_token, "bob over http")):
            r = await http.post(
                "/v1/chat/completions",
                json={"model": "assistant", "messages": [{"role": "user", "content": text}]},
                headers={"Authorization": f"Bearer {token}", "Idempotency-Key": key, "X-Conversation-Id": "new"},
            )
            assert r.status_code == 200, r.text
            assert "idempotent-replayed" not in r.headers, r.headers
            replies.append(r.json()["choices"][0]["message"]["content"])
        assert replies == ["echo: ann over http", "echo: bob over http"], replies
        # the same body again, by its own credential: replayed
        r = await http.post(
            "/v1/chat/completions",
            json={"model": "assistant", "messages": [{"role": "user", "content": "bob over http"}]},
            headers={"Authorization": f"Bearer {bob_token}", "Idempotency-Key": key, "X-Conversation-Id": "new"},
        )
        assert r.status_code == 200 and r.headers.get("idempotent-replayed") == "true", (r.status_code, r.headers)
        for token, text in ((ann_token, "ann responses"), (bob_token, "bob responses")):
            r = await http.post(
                "/v1/responses",
                json={"model": "assistant", "input": text},
                headers={"Authorization": f"Bearer {token}", "Idempotency-Key": f"{key}-r"},
            )
            assert r.status_code == 200 and "idempotent-replayed" not in r.headers, (r.status_code, r.text)
            assert r.json()["output"][-1]["content"][0]["text"] == f"echo: {text}", r.text


# ───────────────────────────────────────────────────────────── a local server for the rest


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeProcess, Path, dict[str, str]]]:
    home = tmp_path_factory.mktemp("s19_local") / "home"
    env = cli_env(home, APPSERVER_LIMITS__APPROVAL_TIMEOUT_S="2")
    assert run_cli(home, "agents", "create", "--name", "careful", "--tool", "clock=ask", env=env).code == 0
    with serving(home, env=env) as sp:
        yield sp, home, env


# ───────────────────────────────────────────────────────────── F4: blank text parts are empty


@pytest.mark.parametrize(
    "parts",
    [
        [{"type": "text", "text": ""}],
        [{"type": "text", "text": ""}, {"type": "text", "text": ""}],
        [{"type": "text", "text": "  \n\t"}, {"type": "text", "text": " "}],
    ],
)
async def test_blank_text_parts_are_an_empty_input(
    local: tuple[ServeProcess, Path, dict[str, str]], parts: list[dict[str, str]]
) -> None:
    sp, home, _ = local
    ws = await WS.open(sp.url, open_timeout=T)
    try:
        conv = (await ws.request({"type": "create_conversation", "agent": "assistant"}, T))["conversation"]["id"]
        reply = await ws.request(
            {"type": "submit_input", "agent": "assistant", "conversation": conv, "input": parts}, T
        )
        assert reply["type"] == "error" and reply["code"] == "invalid_request", reply
        assert reply["param"] == "input" and "empty" in reply["message"], reply
        assert _rows(home, "SELECT count(*) FROM turns WHERE conversation_id=?", conv) == [(0,)]
        # a blank part beside a real one is fine
        ok = await ws.request(
            {
                "type": "submit_input",
                "agent": "assistant",
                "conversation": conv,
                "input": [*parts, {"type": "text", "text": "hi"}],
            },
            T,
        )
        assert ok["type"] == "ack", ok
        assert (await ws.terminal(ok["turn_id"], T))["status"] == "completed"
    finally:
        await ws.close()


# ───────────────────────────────────────────────────────────── F5: dequeued turns leave the queue


async def test_a_queued_turn_cancelled_by_id_has_no_queue_position(
    local: tuple[ServeProcess, Path, dict[str, str]],
) -> None:
    sp, _, _ = local
    a = await WS.open(sp.url, open_timeout=T)
    b = await WS.open(sp.url, open_timeout=T)
    c = await WS.open(sp.url, open_timeout=T)
    try:
        slow = await a.request(
            {"type": "submit_input", "agent": "assistant", "conversation": "new", "input": "/slow 400"}, T
        )
        conv = slow["conversation_id"]
        key = f"k-{uuid.uuid4().hex}"
        submit = {
            "type": "submit_input",
            "agent": "assistant",
            "conversation": conv,
            "input": "queued one",
            "idempotency_key": key,
        }
        queued = await a.request(submit, T)
        behind = await a.request({**submit, "input": "queued two", "idempotency_key": f"{key}-2"}, T)
        assert (queued["queue_position"], behind["queue_position"]) == (1, 2), (queued, behind)
        cancel = await b.request({"type": "cancel", "conversation": conv, "turn_id": queued["turn_id"]}, T)
        assert cancel["cancelled"] is True, cancel
        end = await a.terminal(queued["turn_id"], T)
        assert end["status"] == "cancelled" and end["queue_position"] == 0, end
        again = await c.request(submit, T)
        assert again["duplicate"] is True and again["turn_id"] == queued["turn_id"], again
        assert again["queue_position"] == 0, again
        assert (await c.terminal(queued["turn_id"], T))["queue_position"] == 0
        # the one behind it moved up (seen while the frames above were awaited, or still to come)
        if not any(snap["queue_position"] == 1 for snap in a.snapshots(behind["turn_id"])):
            await a.expect(
                lambda f: (
                    f["type"] == "turn_updated"
                    and f["snapshot"]["turn_id"] == behind["turn_id"]
                    and f["snapshot"]["queue_position"] == 1
                ),
                T,
            )
        await b.request({"type": "cancel", "conversation": conv}, T)
    finally:
        for ws in (a, b, c):
            await ws.close()


# ───────────────────────────────────────────────────────────── F2: chat says how an approval ended


async def _cancel_from_another_client(url: str, conv: str) -> bool:
    async with await ProtocolClient.connect(url, client="other-client") as other:
        ack = await other.request({"type": "cancel", "conversation": conv})
        return bool(ack.get("cancelled"))


def test_chat_shows_expired_and_cancelled_approvals_as_such(
    local: tuple[ServeProcess, Path, dict[str, str]],
) -> None:
    sp, home, env = local
    chat = Pty([sys.executable, "-m", "appserver", "chat", "--agent", "careful", "--conversation", "new"], env)
    try:
        banner = chat.expect("you> ")
        conv = re.search(r"conversation (conv_\w+)", banner).group(1)  # type: ignore[union-attr]
        chat.write("/call clock {}\n")
        asked = chat.expect("approve? [y/N] ")
        first = re.findall(r"\[(call_\w+)\]", asked)[-1]
        # nobody answers: it expires after 2 s
        chat.expect(f"[{first} expired]", timeout=15)
        chat.expect("you> ")

        chat.write("/call clock {}\n")
        asked = chat.expect("approve? [y/N] ")
        second = re.findall(r"\[(call_\w+)\]", asked)[-1]
        assert asyncio.run(_cancel_from_another_client(sp.url, conv))
        chat.expect(f"[{second} cancelled]", timeout=15)
        chat.settle()
        text = chat.text()
        assert "answered elsewhere" not in text, chat.screen()
        assert not any("approve? [y/N]" in line for line in chat.screen()), chat.screen()
        chat.write("/quit\n")
        assert chat.wait() == 0
    finally:
        chat.kill()
    statuses = dict(_rows(home, "SELECT call_id, status FROM pending_calls WHERE conversation_id=?", conv))
    assert statuses == {first: "expired", second: "cancelled"}, statuses


# ───────────────────────────────────────────────────────────── piped chat shows the lines it sends


def test_piped_chat_shows_every_line_after_its_prompt(local: tuple[ServeProcess, Path, dict[str, str]]) -> None:
    _, home, env = local
    out = run_cli(home, "chat", "--conversation", "new", env=env, stdin="first line\nsecond line\n")
    assert out.code == 0, out.err
    lines = out.out.splitlines()
    assert "you> first line" in lines and "you> second line" in lines, out.out
    assert "you> " not in lines and "you>" not in lines, out.out  # no bare prompt for a line that was sent


# ───────────────────────────────────────────────────────────── F3: chat after kill -9


def _draft(home: Path, conv: str) -> str | None:
    rows = _rows(home, "SELECT draft FROM turns WHERE conversation_id=? AND status='running'", conv)
    if not rows or rows[0][0] is None:
        return None
    draft = json.loads(rows[0][0])
    return str(draft.get("text") or "") if isinstance(draft, dict) else None


def test_chat_after_kill9_says_what_the_server_kept(tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = cli_env(home, APPSERVER_LIMITS__DRAFT_INTERVAL_S="2")
    sp = start_serve(home, env=env)
    chat: Pty | None = None
    try:
        chat = Pty([sys.executable, "-m", "appserver", "chat", "--conversation", "new"], env)
        banner = chat.expect("you> ")
        conv = re.search(r"conversation (conv_\w+)", banner).group(1)  # type: ignore[union-attr]
        chat.write("/slow 400\n")
        chat.expect("w3 ")
        # a checkpoint was stored, then a few more words were shown: those the server never kept
        deadline = time.monotonic() + 20
        draft = None
        while time.monotonic() < deadline and not (draft := _draft(home, conv)):
            time.sleep(0.05)
        assert draft, "no checkpoint of the running turn"
        last = int(re.findall(r"w(\d+)", draft)[-1])
        chat.expect(f"w{last + 4} ")
        assert _draft(home, conv) == draft  # no newer checkpoint meanwhile (2 s apart)
        sp.stop(signal.SIGKILL)
        sp = start_serve(home, env=env)
        chat.expect("[interrupted", timeout=40)
        chat.settle()
        screen = chat.screen()
        kept = [json.loads(c) for (c,) in _rows(home, "SELECT content FROM messages WHERE role='assistant'")]
        assert len(kept) == 1 and kept[0].startswith("w1 w2"), kept
        n = len(kept[0])
        tail = kept[0][-20:]
        cut = [line for line in screen if line.startswith("[the server kept only the first")]
        assert cut and f"first {n} characters" in cut[0] and tail in cut[0], screen
        assert "the rest shown above was lost" in cut[0], screen
        i = next(k for k, line in enumerate(screen) if line.startswith("[the server kept only"))
        assert screen[i + 1].startswith("[interrupted"), screen  # the cut is said before the outcome
        chat.write("/quit\n")
        chat.wait()
    finally:
        if chat is not None:
            chat.kill()
        sp.stop()
        sp.kill()


async def test_a_key_of_a_token_that_lost_admin_shows_no_conversation_it_cannot_see(
    admins: tuple[ServeProcess, Path, str, str],
) -> None:
    """A token rotated under its name keeps its keys; rotated without `admin`, the turn its key made
    in an ownerless conversation (only admins see those) is not handed back: an error on the key,
    never an ack, a subscription or a snapshot of that conversation."""
    sp, home, _, _ = admins
    tokens = TokenStore(home)
    first = tokens.create(name="rot", scopes="ws,admin")[1]
    key = f"rot-{uuid.uuid4().hex[:8]}"
    submit = {"type": "submit_input", "agent": "assistant", "conversation": "new", "idempotency_key": key}
    ws = await WS.open(sp.url, headers={"Authorization": f"Bearer {first}"}, open_timeout=T)
    try:
        made = await ws.request({**submit, "input": "secret-admin-text"}, T)
        assert made["type"] == "ack", made
        assert (await ws.terminal(made["turn_id"], T))["status"] == "completed"
    finally:
        await ws.close()
    tokens.revoke("rot")
    narrowed = tokens.create(name="rot", scopes="ws")[1]
    ws = await WS.open(sp.url, headers={"Authorization": f"Bearer {narrowed}"}, open_timeout=T)
    try:
        again = await ws.request({**submit, "input": "secret-admin-text"}, T)
        assert again["type"] == "error" and again["param"] == "idempotency_key", again
        assert made["conversation_id"] not in json.dumps(again), again
        with pytest.raises((TimeoutError, asyncio.TimeoutError)):
            seen = await ws.recv(1.0)  # nothing of that conversation follows
            assert "secret-admin-text" not in json.dumps(seen), seen
            raise TimeoutError
    finally:
        await ws.close()
