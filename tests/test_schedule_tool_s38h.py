"""A task a chat schedules reaches the chat, and stops with its sender's pairing (session 38).

The `schedule` tool made a chat's task without a delivery target: "remind me at 5" was answered
"created task …", the run happened in the chat's conversation, and nothing was ever posted to the
chat. Now a task made from a chat posts each run's reply to that chat (`deliver`), unless the model
asks for `none`; it may name no other chat. The task records where it came from (`origin`: channel,
account, chat, sender), `cron list`/`show` name it (they showed only the gateway's namespace or
`schedule-tool:unowned`), and `pairing revoke` of the sender disables (keeps) that sender's tasks,
saying so, so a revoked sender's prompts no longer run as the agent.
Real `appserver serve` with the fakechat channel (echo model's `/call`), the CLI, crons.json read
from disk.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from cron.schedule import ScheduleSpec
from cron.store import CronFile, CronStore, CronTask, make_task, utcnow
from tests.fakes.fakechat import FakeChat
from tests.support.cli import run_cli
from tests.support.gateway import ChannelServer, channel_server, fakechat_home
from tests.support.net import SSL
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(180)

T = 30.0
CODE = r"[A-HJ-NP-Z2-9]{4}-[A-HJ-NP-Z2-9]{4}"


@pytest.fixture(scope="module")
def chat() -> Iterator[FakeChat]:
    with FakeChat() as fake:
        yield fake


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, chat: FakeChat) -> Iterator[ChannelServer]:
    home = fakechat_home(tmp_path_factory.mktemp("s38h") / "home", chat, stream=False, dm_policy="pairing")
    with channel_server(home) as server:
        yield server


def _pair(srv: ChannelServer, chat: FakeChat, chat_id: str, sender: str) -> None:
    """`sender` asks in `chat_id`, the owner approves the code, the kept message is answered."""
    chat.inject(chat_id, "hello", sender=sender)
    prompt = chat.wait_for_text(chat_id, lambda t: "pairing code" in t, timeout=T)
    found = re.search(CODE, prompt.text)
    assert found, prompt.text
    approved = run_cli(srv.home, "pairing", "approve", found.group(0).replace("-", ""))
    assert approved.code == 0, approved.err
    chat.wait_for_text(chat_id, lambda t: "approved" in t, timeout=T)


def _call(chat: FakeChat, chat_id: str, sender: str, call: dict[str, Any]) -> str:
    """`/call schedule …` from `sender` in `chat_id`: the bot's answer to it."""
    before = len(chat.messages(chat_id))
    chat.inject(chat_id, f"/call schedule {json.dumps(call)}", sender=sender)

    def answer() -> str | None:
        texts = [m.text for m in chat.messages(chat_id)[before:] if m.text.startswith("schedule ->")]
        return texts[0] if texts else None

    return str(chat.wait_for(answer, timeout=T, what=f"the schedule answer in {chat_id}"))


def _tasks(home: Path) -> dict[str, dict[str, Any]]:
    return {t["name"]: t for t in json.loads((home / "crons.json").read_text())["tasks"]}


def _fired(home: Path, task_id: str) -> list[str]:
    log = home / "cron-runs" / f"{task_id}.jsonl"
    if not log.exists():
        return []
    return [r["event"] for r in map(json.loads, log.read_text().splitlines()) if r.get("event") == "fired"]


def test_a_task_scheduled_from_a_chat_posts_its_reply_to_that_chat(srv: ChannelServer, chat: FakeChat) -> None:
    _pair(srv, chat, "dm-ann", "ann")
    made = _call(chat, "dm-ann", "ann", {"action": "create", "name": "tea", "in": "2s", "prompt": "REMIND-TEA-READY"})
    assert made.startswith("schedule -> created task tea") and "posted to fakechat:main:dm-ann" in made, made
    tea = _tasks(srv.home)["tea"]
    assert tea["deliver"] == "fakechat:main:dm-ann"
    assert tea["origin"] == {"channel": "fakechat", "account": "main", "chat": "dm-ann", "sender": "ann"}
    # the run's reply reaches the chat (before: it stayed in the conversation, the chat heard nothing)
    posted = chat.wait_for_text("dm-ann", lambda t: "REMIND-TEA-READY" in t and "schedule ->" not in t, timeout=T)
    assert posted.text
    logs = run_cli(srv.home, "cron", "logs", tea["id"])
    assert logs.code == 0 and "delivered" in logs.out, logs.out


def test_the_model_may_keep_a_chats_reply_in_the_conversation_but_post_to_no_other_chat(
    srv: ChannelServer, chat: FakeChat
) -> None:
    _pair(srv, chat, "dm-cy", "cy")
    quiet = _call(
        chat, "dm-cy", "cy", {"action": "create", "name": "quiet", "every": "1h", "prompt": "p", "deliver": "none"}
    )
    assert quiet.startswith("schedule -> created task quiet") and "posted" not in quiet, quiet
    task = _tasks(srv.home)["quiet"]
    assert task["deliver"] is None and task["origin"]["sender"] == "cy"  # still the sender's task
    other = {"action": "create", "name": "leak", "every": "1h", "prompt": "p", "deliver": "fakechat:main:dm-ann"}
    refused = _call(chat, "dm-cy", "cy", other)
    assert "schedule create failed" in refused and "not allowed" in refused, refused
    assert "leak" not in _tasks(srv.home)
    named = {**other, "name": "named", "deliver": "fakechat:main:dm-cy"}
    assert _call(chat, "dm-cy", "cy", named).startswith("schedule -> created task named")
    assert _tasks(srv.home)["named"]["deliver"] == "fakechat:main:dm-cy"
    # after `/new` the chat still lists and cancels what it made before (it still posts there)
    chat.inject("dm-cy", "/new", sender="cy")
    chat.wait_for_text("dm-cy", lambda t: "new conversation" in t, timeout=T)
    listed = _call(chat, "dm-cy", "cy", {"action": "list"})
    assert "quiet (" in listed and "named (" in listed and "posted to fakechat:main:dm-cy" in listed, listed
    assert "tea (" not in listed  # another chat's
    cancelled = _call(chat, "dm-cy", "cy", {"action": "cancel", "name": "named"})
    assert "cancelled task named" in cancelled, cancelled
    assert "named" not in _tasks(srv.home)

    # a conversation that is no chat's delivers nowhere, and may not name a chat
    def local(call: dict[str, Any]) -> str:
        r = httpx.post(
            srv.url + "/v1/chat/completions",
            json={
                "model": "assistant",
                "messages": [{"role": "user", "content": f"/call schedule {json.dumps(call)}"}],
            },
            timeout=T,
            verify=SSL,
        )
        assert r.status_code == 200, r.text
        return str(r.json()["choices"][0]["message"]["content"])

    aimed = local({**other, "name": "aimed", "deliver": "fakechat:main:dm-cy"})
    assert "schedule create failed" in aimed and "only a task made from a chat" in aimed, aimed
    plain = local({"action": "create", "name": "plain", "every": "1h", "prompt": "p"})
    assert "created task plain" in plain and "posted" not in plain, plain
    assert _tasks(srv.home)["plain"].get("deliver") is None and "origin" not in _tasks(srv.home)["plain"]


def test_revoking_a_senders_pairing_disables_the_tasks_they_scheduled(srv: ChannelServer, chat: FakeChat) -> None:
    _pair(srv, chat, "dm-bob", "bob")
    _pair(srv, chat, "dm-dee", "dee")
    assert "created task nag" in _call(
        chat, "dm-bob", "bob", {"action": "create", "name": "nag", "every": "1m", "prompt": "x"}
    )
    assert "created task dees" in _call(
        chat, "dm-dee", "dee", {"action": "create", "name": "dees", "every": "1h", "prompt": "y"}
    )
    tasks = _tasks(srv.home)

    # the operator can tell whose they are
    listed = run_cli(srv.home, "cron", "list")
    assert listed.code == 0, listed.err
    nag_line = next(line for line in listed.out.splitlines() if tasks["nag"]["id"] in line)
    assert "chat fakechat:main:dm-bob, sender bob" in nag_line, listed.out
    shown = run_cli(srv.home, "cron", "show", tasks["nag"]["id"])
    assert shown.code == 0 and re.search(r"from sender\s+bob", shown.out), shown.out
    assert re.search(r"from chat\s+fakechat:main:dm-bob", shown.out), shown.out

    # a prompt due soon, revoked right away (15 s: room for the command on a loaded machine)
    soon = {"action": "create", "name": "soon", "in": "15s", "prompt": "RUN-AFTER-REVOKE"}
    assert "created task soon" in _call(chat, "dm-bob", "bob", soon)
    tasks = _tasks(srv.home)
    revoked = run_cli(srv.home, "pairing", "revoke", "bob")
    assert revoked.code == 0, revoked.err
    assert "Revoked bob (1 account)." in revoked.out, revoked.out
    assert "Disabled 2 cron tasks bob scheduled from a chat" in revoked.out, revoked.out
    for name in ("nag", "soon"):
        assert f"disabled {name} ({tasks[name]['id']}) from fakechat:main:dm-bob" in revoked.out, revoked.out
    after = _tasks(srv.home)
    assert after["nag"]["enabled"] is False and after["soon"]["enabled"] is False  # kept, not deleted
    assert after["dees"]["enabled"] is True  # another sender's task runs on
    state = run_cli(srv.home, "cron", "list")
    assert re.search(rf"{tasks['nag']['id']}.*disabled", state.out), state.out

    # the prompt a revoked sender scheduled does not run once it comes due
    due = datetime.fromisoformat(after["soon"]["next_due_at"])
    wait_for(lambda: (utcnow() - due).total_seconds() > 3, 30, "the revoked sender's task to come due")
    assert _fired(srv.home, tasks["soon"]["id"]) == []
    time.sleep(0.5)
    assert not any("RUN-AFTER-REVOKE" in m.text for m in chat.messages("dm-bob") if "schedule ->" not in m.text)


def test_a_tasks_origin_is_kept_through_crons_json_and_checked_when_read(tmp_path: Path) -> None:
    origin = {"channel": "telegram", "account": "main", "chat": "-100", "thread": "7", "sender": "42"}
    task = make_task(
        name="t", agent="a", schedule=ScheduleSpec("every", "1h", "UTC"), prompt="p", now=utcnow(), origin=origin
    )
    again = CronTask.from_dict(json.loads(json.dumps(task.to_dict())))
    assert again.origin == origin and again.made_by("telegram", "main", "42")
    assert not again.made_by("telegram", "other", "42") and not again.made_by("telegram", "main", "43")
    store = CronStore(tmp_path)
    store.add(task)
    bad = {**task.to_dict(), "id": "cron_bad", "name": "bad", "origin": {"channel": "x", "chat": "c"}}
    raw = json.loads(store.path.read_text())
    raw["tasks"].append(bad)
    store.path.write_text(json.dumps(raw))
    state: CronFile = store.read()
    assert [t.id for t in state.tasks] == [task.id]
    assert [b.id for b in state.invalid] == ["cron_bad"] and "origin lacks account" in state.invalid[0].reason
    assert [t.id for t in store.disable_where(lambda t: t.made_by("telegram", "main", "42"))] == [task.id]
    assert store.disable_where(lambda t: t.made_by("telegram", "main", "42")) == []  # already disabled
    assert store.read().tasks[0].enabled is False
