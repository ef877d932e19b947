"""The `schedule` tool keeps task names inside their owner: per agent and per credential namespace.
A caller can create a name another namespace or agent already uses (no "already has a task named"
that would betray it), lists only its own, and cancels its own by that name without touching the
other's. One real `serve --auth token`, tokens A and B (same agents, only the namespace differs),
an admin token, real WebSocket clients; the tasks are checked in crons.json itself."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from appserver.auth import TokenStore
from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, serving
from tests.support.ws import WS

pytestmark = pytest.mark.timeout(60)
T = 10.0


@dataclass
class Srv:
    sp: ServeProcess
    a: str
    b: str
    admin: str


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Srv]:
    home = tmp_path_factory.mktemp("names") / "home"
    env = cli_env(home)
    assert run_cli(home, "agents", "create", "--name", "other", env=env).code == 0
    store = TokenStore(home)
    a = store.create(name="tok-a")[1]
    b = store.create(name="tok-b")[1]
    admin = store.create(name="tok-admin", scopes="openai,ws,admin")[1]
    with serving(home, "--auth", "token", env=env) as sp:
        yield Srv(sp, a, b, admin)


async def ws_for(srv: Srv, token: str) -> WS:
    return await WS.open(srv.sp.url, headers={"Authorization": f"Bearer {token}"}, open_timeout=T)


async def call(ws: WS, conversation: str, args: dict[str, Any], agent: str = "assistant") -> tuple[str, str]:
    """(conversation id, the tool's answer) of one `/call schedule` turn."""
    frame = {"type": "submit_input", "agent": agent, "conversation": conversation,
             "input": f"/call schedule {json.dumps(args)}"}  # fmt: skip
    ack = await ws.request(frame, T)
    assert ack["type"] == "ack", ack
    snap = await ws.terminal(ack["turn_id"], T)
    assert snap["status"] == "completed", snap
    return ack["conversation_id"], snap["blocks"][-1]["text"]


def tasks(srv: Srv) -> list[dict[str, Any]]:
    return list(json.loads((srv.sp.home / "crons.json").read_text())["tasks"])


def create(name: str) -> dict[str, Any]:
    return {"action": "create", "name": name, "prompt": f"{name} prompt", "in": "2h"}


async def test_namespaces_neither_see_nor_collide_with_each_others_names(srv: Srv) -> None:
    a, b, admin = await ws_for(srv, srv.a), await ws_for(srv, srv.b), await ws_for(srv, srv.admin)
    try:
        conv_a, text = await call(a, "new", create("daily"))
        assert "created task daily" in text, text
        conv_b, text = await call(b, "new", create("daily"))  # same agent, same name, other namespace
        assert "created task daily" in text and "already" not in text, text
        _, text = await call(a, conv_a, create("daily"))  # a real duplicate in one's own namespace
        assert "failed" in text and "already" in text, text
        mine = [t for t in tasks(srv) if t["name"] == "daily"]
        assert sorted(t["conversation"] for t in mine) == sorted([conv_a, conv_b])

        _, text = await call(b, conv_b, {"action": "list"})
        assert text.count("daily (") == 1 and "prompt" in text
        a_id = next(t["id"] for t in mine if t["conversation"] == conv_a)
        assert a_id not in text  # B sees its own task only
        _, text = await call(b, conv_b, {"action": "cancel", "id": a_id})  # A's, by id: as if absent
        assert "failed" in text and f"no cron task {a_id!r}" in text, text
        _, text = await call(b, conv_b, {"action": "cancel", "name": "daily"})  # B's own
        assert "cancelled task daily" in text, text
        left = [t for t in tasks(srv) if t["name"] == "daily"]
        assert [t["id"] for t in left] == [a_id]  # A's is untouched

        _, text = await call(admin, "new", create("daily"))  # unowned: a third scope of its own
        assert "created task daily" in text, text
        _, text = await call(admin, "new", {"action": "cancel", "name": "daily"})  # sees two: asks for an id
        assert "failed" in text and "by its id" in text, text
    finally:
        for w in (a, b, admin):
            await w.close()


async def test_agents_neither_see_nor_collide_with_each_others_names(srv: Srv) -> None:
    admin = await ws_for(srv, srv.admin)
    try:
        _, text = await call(admin, "new", create("weekly"), agent="assistant")
        assert "created task weekly" in text, text
        conv_other, text = await call(admin, "new", create("weekly"), agent="other")
        assert "created task weekly" in text and "already" not in text, text
        _, text = await call(admin, conv_other, {"action": "list"}, agent="other")
        assert text.count("weekly (") == 1
        _, text = await call(admin, conv_other, {"action": "cancel", "name": "weekly"}, agent="other")
        assert "cancelled task weekly" in text, text
        assert [t["agent"] for t in tasks(srv) if t["name"] == "weekly"] != []  # assistant's stays
    finally:
        await admin.close()


async def test_list_cuts_long_prompts(srv: Srv) -> None:
    """A prompt may be up to 1 MiB and an agent may hold 100 tasks: `list` shows the first 500
    characters of each and its length, not a tool result of up to 100 MiB in the model's context."""
    a = await ws_for(srv, srv.a)
    try:
        long_prompt = "p" * 600 + "TAIL-NOT-SHOWN"
        conv, text = await call(a, "new", {"action": "create", "name": "wordy", "prompt": long_prompt, "in": "2h"})
        assert "created task wordy" in text, text
        _, text = await call(a, conv, {"action": "list"})
        # the task's line (the first line of a list alone also carries the tool's "schedule -> ")
        line = next((x for x in text.splitlines() if x.removeprefix("schedule -> ").startswith("wordy (")), None)
        assert line is not None, text
        assert "p" * 500 + "… (614 characters in all)" in line and "TAIL-NOT-SHOWN" not in line, line
        _, text = await call(a, conv, {"action": "cancel", "name": "wordy"})
        assert "cancelled task wordy" in text, text
    finally:
        await a.close()
