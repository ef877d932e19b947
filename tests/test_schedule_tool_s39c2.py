"""A revoked sender's turn still running schedules nothing after `pairing revoke` returned (s39 C2).

`appserver pairing revoke bob` disabled bob's tasks at that moment, but a turn of bob's already
running (a slow model step) went on and called `schedule` afterwards: it made an ENABLED task with
origin sender bob, run every minute and posted to bob's chat. Now the revoke records itself with
the cron tasks (under their lock, in the write that disables bob's tasks), and the `schedule` tool's
`add` refuses, under the same lock, a task whose origin sender was revoked after the turn asking for
it began, telling the model why. A turn that begins after the revoke (bob approved again) schedules
as before, and another sender's turn is not touched.
Real parts: the tool bound to the home's real store (SQLite, and PostgreSQL when it runs), the
`appserver pairing revoke` CLI in a child process, gateway.db's real pairing tables.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import cron.store as cron_store
from appserver.agent.schedule_tool import schedule_tool
from appserver.agent.tools import ToolContext
from appserver.cli.channels import _gateway_db
from appserver.config import load_config
from appserver.store.records import AgentRecord, ConversationRecord, TurnRecord
from appserver.store.select import make_store
from cron.stores import cron_store_for
from gateway.pairing import Pairing
from tests.support.cli import run_cli
from tests.support.pg import temp_database, unavailable

pytestmark = pytest.mark.timeout(120)

AGENT = AgentRecord(
    id="agt_s39c2", name="s39c2", model="echo", system="", tools={}, params={}, created_at=0, updated_at=0
)


@pytest.fixture(params=["sqlite", "postgresql"])
def home(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    home = tmp_path / "home"
    home.mkdir()
    if request.param == "sqlite":
        yield home
        return
    if unavailable():
        pytest.skip(f"PostgreSQL: {unavailable()}")
    with temp_database("s39c2") as url:
        (home / "config.toml").write_text(f'[store]\nurl = "{url}"\n')
        yield home


def _approve(home: Path, sender: str) -> None:
    """`sender` asks on fakechat:main and the owner approves the code, in gateway.db's own tables."""
    config = load_config(home)
    with _gateway_db(home, create=True, store_url=config.store.url) as conn:
        assert conn is not None
        pairing = Pairing(conn)
        code, _ = pairing.code_for("fakechat", "main", sender, sender.title(), f"dm-{sender}")
        assert code is not None
        pairing.approve(code.code)


def _source(sender: str) -> dict[str, Any]:
    """A turn's source as the gateway submits a chat's message."""
    return {"kind": "channel", "channel": "fakechat", "account": "main", "chat": f"dm-{sender}", "sender": sender}


def _tasks(home: Path) -> dict[str, dict[str, Any]]:
    store = cron_store_for(home, load_config(home).store.url)
    try:
        return {t.name: t.to_dict() for t in store.read().tasks}
    finally:
        store.close()


async def _scenario(home: Path) -> None:
    config = load_config(home)
    store = make_store(config)
    await store.open()
    try:
        await store.create_agent(AGENT)
        for who in ("bob", "dee"):
            route = f"fakechat:main:dm-{who}:__root__"
            await store.create_conversation(
                ConversationRecord(id=f"conv_{who}", agent_id=AGENT.id, metadata={"channel_route": route})
            )
        tool = schedule_tool(store)

        async def schedule(turn: str, conv: str, name: str) -> tuple[str, bool]:
            call = {"action": "create", "name": name, "every": "1m", "prompt": f"NAG-{name}"}
            out = await tool.run(call, ToolContext(AGENT, conv, turn, config))
            return out.text, out.is_error

        # bob's turn and dee's begin (their messages let in), bob's first step schedules a task
        await store.accept_turn(
            TurnRecord(id="turn_bob1", conversation_id="conv_bob", agent_id=AGENT.id, source=_source("bob"))
        )
        await store.accept_turn(
            TurnRecord(id="turn_dee1", conversation_id="conv_dee", agent_id=AGENT.id, source=_source("dee"))
        )
        text, failed = await schedule("turn_bob1", "conv_bob", "early")
        assert not failed and text.startswith("created task early"), text
        assert _tasks(home)["early"]["origin"]["sender"] == "bob"

        # the owner revokes bob while his turn runs on (a slow model step): his task is disabled
        revoked = await asyncio.to_thread(run_cli, home, "pairing", "revoke", "bob")
        assert revoked.code == 0, revoked.err
        assert "Disabled 1 cron task bob scheduled from a chat" in revoked.out, revoked.out
        assert _tasks(home)["early"]["enabled"] is False

        # the turn's next step asks for another: refused, and the model is told why
        text, failed = await schedule("turn_bob1", "conv_bob", "late")
        assert "late" not in _tasks(home), f"a revoked sender's running turn scheduled a task: {_tasks(home)['late']}"
        assert failed and "schedule create failed" in text and "revoked" in text and "nothing was scheduled" in text, (
            text
        )
        enabled = [
            n for n, t in _tasks(home).items() if t["enabled"] and (t.get("origin") or {}).get("sender") == "bob"
        ]
        assert enabled == [], enabled

        # another sender's turn that began as early is not touched
        text, failed = await schedule("turn_dee1", "conv_dee", "dees")
        assert not failed and text.startswith("created task dees"), text

        # bob approved again: a turn that begins after the revoke schedules as before
        await asyncio.to_thread(_approve, home, "bob")
        await asyncio.sleep(getattr(cron_store, "REVOKE_CLOCK_MARGIN_S", 2.0) + 0.5)
        await store.accept_turn(
            TurnRecord(id="turn_bob2", conversation_id="conv_bob", agent_id=AGENT.id, source=_source("bob"))
        )
        text, failed = await schedule("turn_bob2", "conv_bob", "again")
        assert not failed and text.startswith("created task again"), text
        assert _tasks(home)["again"]["enabled"] is True
        # while the turn that began before the revoke still may not
        text, failed = await schedule("turn_bob1", "conv_bob", "still")
        assert failed and "revoked" in text and "still" not in _tasks(home), text
    finally:
        await store.close()


def test_a_revoked_senders_running_turn_schedules_nothing_after_the_revoke(home: Path) -> None:
    _approve(home, "bob")
    _approve(home, "dee")
    asyncio.run(_scenario(home))


def test_a_revoke_is_recorded_where_there_were_no_tasks_kept_bounded_and_without_the_id(tmp_path: Path) -> None:
    """A home without crons.json gets one holding the record (a running turn may make the first
    task); the records are few and small whatever the ids (a hash, not the id), and every writer
    (here the scheduler's kind of save) keeps them."""
    home = tmp_path / "home"
    home.mkdir()
    _approve(home, "eve")
    assert not (home / "crons.json").exists()
    revoked = run_cli(home, "pairing", "revoke", "eve")
    assert revoked.code == 0, revoked.err
    assert (home / "crons.json").exists(), "the revoke of a home without tasks recorded nothing"
    raw = json.loads((home / "crons.json").read_text())
    assert [(r["channel"], r["account"]) for r in raw.get("revoked", [])] == [("fakechat", "main")], raw
    store = cron_store.CronStore(home)
    long_id = "x" * 1000
    for i in range(300):
        store.revoke_sender([("webhook", "home")], f"{long_id}{i}")
    text = (home / "crons.json").read_text()
    assert long_id not in text
    kept = json.loads(text)["revoked"]
    assert len(kept) == cron_store.REVOCATIONS_MAX and len(text) < 40_000, (len(kept), len(text))
    assert kept[-1]["sender_sha256"] == cron_store.sender_digest(f"{long_id}299")  # the newest are kept
    with store.transaction() as state:  # a save of a loaded state keeps them
        state.scheduler_owner = None
    assert json.loads((home / "crons.json").read_text())["revoked"] == kept
