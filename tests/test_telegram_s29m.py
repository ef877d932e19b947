"""A Telegram group upgraded to a supergroup while the bot is in use (it gets a new chat id for good):
the gateway follows it there. A real `appserver serve --channels telegram` against the loopback fake
Bot API, extended here so that a group can be upgraded: calls for the old id are then refused with
400 and `migrate_to_chat_id`, as Telegram does, and the service messages of the upgrade
(`migrate_to_chat_id` in the old chat, `migrate_from_chat_id` in the new one) can be delivered.

* The reply of a turn in flight when the group is upgraded arrives in the supergroup (was failed:
  "the group became a supergroup").
* The supergroup goes on with the group's conversation (its history) and its operator route.
* An approval prompt waiting when the group was upgraded is answered from the supergroup (was "No
  request waiting", and the turn stayed stuck).
* A prompt whose post was in flight when the gateway learned of the upgrade keeps naming its message
  in the old chat (its decided edit went to the supergroup's message of the same number).
"""

from __future__ import annotations

import asyncio
import re
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.requests import Request
from starlette.responses import Response

from gateway.approvals import ApprovalBoard, Prompt
from gateway.ledger import Ledger
from gateway.routing import RouteKey, Router
from plugins.contract import Target
from tests.fakes.telegram_api import BotMessage, FakeTelegram
from tests.support.cli import cli_env, run_cli
from tests.support.gateway import ChannelServer, channel_server, write_config

pytestmark = pytest.mark.timeout(120)

ANN = 500
GROUP, SUPERGROUP = -555, -100555  # a conversation with its history, upgraded while a reply runs
ASKING, ASKING_SUPER = -556, -100556  # an approval prompt waits when the group is upgraded
RACING, RACING_SUPER = -557, -100557  # upgraded while the prompt's post is in flight
MIGRATED_CALLS = ("sendMessage", "editMessageText", "sendChatAction", "setMessageReaction")


class UpgradingTelegram(FakeTelegram):
    """The fake Bot API with groups that can be upgraded to supergroups (`upgrade`)."""

    def __init__(self) -> None:
        super().__init__()
        self.upgraded: dict[int, int] = {}  # old chat id -> the supergroup's
        # (chat, until): the next prompt post to `chat` waits until `until()` (polled on the fake's
        # loop, which serves getUpdates meanwhile), is then performed there, and the chat upgraded
        self.hold_prompt: tuple[int, Callable[[], bool]] | None = None

    def upgrade(self, old: int, new: int) -> None:
        """From now on calls for `old` are refused, naming `new` (Telegram's ChatMigrated)."""
        with self._lock:
            self.upgraded[old] = new
            self._ensure_chat(new, "supergroup", "Team", False)

    def service_messages(self, old: int, new: int, sender: dict[str, Any]) -> int:
        """The two service messages Telegram delivers for an upgrade, in the old chat then the new one;
        the update id of the last."""
        self._service(old, "group", sender, migrate_to_chat_id=new)
        return self._service(new, "supergroup", sender, migrate_from_chat_id=old)

    def _service(self, chat_id: int, kind: str, sender: dict[str, Any], **fields: Any) -> int:
        with self._lock:
            chat = self._ensure_chat(chat_id, kind, "Team", False)
            message_id = chat.next_message_id
            chat.next_message_id += 1
            msg = {"message_id": message_id, "from": dict(sender), "chat": self._chat_json(chat)}
            msg.update(date=int(time.time()), **fields)
            self._user_messages[(chat_id, message_id)] = msg
            update_id = self._next_update_id
            self._updates.append({"update_id": update_id, "message": msg})
            self._next_update_id += 1
        self._notify()
        return update_id

    async def _handle(self, request: Request) -> Response:
        held = self.hold_prompt
        if held is None or request.path_params["method"] != "sendMessage":
            return await super()._handle(request)
        params = await self._params(request)
        if str(params.get("chat_id")) != str(held[0]) or not params.get("reply_markup"):
            return await super()._handle(request)
        self.hold_prompt = None
        deadline = time.monotonic() + 20
        while not held[1]() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # getUpdates goes on meanwhile
        answer = await super()._handle(request)
        self.upgrade(held[0], RACING_SUPER)
        return answer

    def _dispatch(self, method: str, p: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        try:
            chat = int(p.get("chat_id"))  # type: ignore[arg-type]
        except (TypeError, ValueError):
            chat = None
        with self._lock:
            new = self.upgraded.get(chat) if chat is not None else None
        if new is not None and method in MIGRATED_CALLS:
            description = "Bad Request: group chat was upgraded to a supergroup chat"
            return 400, {
                "ok": False,
                "error_code": 400,
                "description": description,
                "parameters": {"migrate_to_chat_id": new},
            }
        return super()._dispatch(method, p)


@pytest.fixture(scope="module")
def tg() -> Iterator[UpgradingTelegram]:
    with UpgradingTelegram() as fake:
        yield fake


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, tg: UpgradingTelegram) -> Iterator[ChannelServer]:
    home = tmp_path_factory.mktemp("tg-upgrade") / "home"
    settings = {"api_url": tg.url, "poll_timeout": 1, "token_env": "TG_TOKEN", "dm_policy": "open",
                "group_policy": "open", "default_agent": "assistant"}  # fmt: skip
    write_config(home, {"telegram": {"main": settings}}, ["telegram"])
    created = run_cli(home, "agents", "create", "--name", "careful", "--tool", "clock=ask")
    assert created.code == 0, created.err
    for chat, agent in ((GROUP, "assistant"), (ASKING, "careful"), (RACING, "careful")):
        routed = run_cli(home, "channels", "route", "add", f"telegram:main:{chat}", agent)
        assert routed.code == 0, routed.err
    with channel_server(home, "--channels", "telegram", env=cli_env(home, TG_TOKEN=tg.token)) as server:
        yield server


def _route_keys(home: Path) -> list[str]:
    conn = sqlite3.connect(str(home / "channels" / "gateway.db"))
    try:
        return sorted(k for (k,) in conn.execute("SELECT key FROM routes"))
    finally:
        conn.close()


def _texts(tg: FakeTelegram, chat: int) -> list[str]:
    return [m.text for m in tg.messages(chat)]


def test_the_reply_in_flight_and_the_history_follow_the_group_into_its_supergroup(
    srv: ChannelServer, tg: UpgradingTelegram
) -> None:
    ann = tg.user(ANN, "Ann", "ann")
    tg.inject(GROUP, "remember: banana", kind="group", sender=ann)
    tg.wait_for(lambda: tg.messages(GROUP) or None, timeout=20, what="the first reply")

    def upgrade_at_the_reply(method: str, params: dict[str, Any]) -> None:
        if method in ("sendChatAction", "sendMessage") and str(params.get("chat_id")) == str(GROUP):
            tg.on_request = None
            tg.upgrade(GROUP, SUPERGROUP)  # this very call is refused, naming the supergroup

    tg.on_request = upgrade_at_the_reply
    tg.inject(GROUP, "/slow 6", kind="group", sender=ann)
    words = " ".join(f"w{i}" for i in range(1, 7))
    tg.wait_for_text(SUPERGROUP, words, timeout=30)  # the reply in flight arrives where the group went

    tg.service_messages(GROUP, SUPERGROUP, ann)  # after the refused call told it already: changes nothing
    tg.inject(SUPERGROUP, "/recall", kind="supergroup", sender=ann)
    recalled = tg.wait_for_text(SUPERGROUP, lambda t: "banana" in t or "(nothing)" in t, timeout=30)
    assert "remember: banana" in recalled.text, _texts(tg, SUPERGROUP)  # the same conversation
    keys = _route_keys(srv.home)
    assert f"telegram:main:{SUPERGROUP}:__root__" in keys and f"telegram:main:{GROUP}:__root__" not in keys, keys
    assert "became supergroup" in srv.log() and "is now" in srv.log()


def test_a_waiting_approval_prompt_is_answered_from_the_supergroup(srv: ChannelServer, tg: UpgradingTelegram) -> None:
    ann = tg.user(ANN, "Ann", "ann")
    tg.inject(ASKING, "/call clock {}", kind="group", sender=ann)
    prompt: BotMessage = tg.wait_for(
        lambda: next((m for m in tg.messages(ASKING) if m.reply_markup), None), timeout=25, what="the prompt"
    )
    found = re.search(r"/approve (\w+)", prompt.text)
    assert found, prompt.text
    tg.upgrade(ASKING, ASKING_SUPER)
    last = tg.service_messages(ASKING, ASKING_SUPER, ann)  # how the gateway learns of it this time
    tg.wait_for(lambda: tg.acked_offset > last or None, 20, "the service messages handled")

    tg.inject(ASKING_SUPER, "/status", kind="supergroup", sender=ann)
    status = tg.wait_for(lambda: tg.messages(ASKING_SUPER) or None, timeout=20, what="the status")[0]
    assert "No conversation yet" not in status.text, status.text
    tg.inject(ASKING_SUPER, f"/approve {found.group(1)}", kind="supergroup", sender=ann)
    tg.wait_for_text(ASKING_SUPER, lambda t: t.startswith("clock -> "), timeout=30)  # the turn went on
    assert not any(t.startswith("No request waiting") for t in _texts(tg, ASKING_SUPER)), _texts(tg, ASKING_SUPER)
    # The prompt stays in the old chat: its decided edit never goes to the supergroup's message that
    # happens to have the same number (there a user's).
    tg.wait_for(lambda: tg.calls("editMessageText", chat_id=ASKING) or None, 20, "the prompt's decided edit")
    ours = {m.message_id for m in tg.messages(ASKING_SUPER)}
    edited = {int(c.params["message_id"]) for c in tg.calls("editMessageText", chat_id=ASKING_SUPER)}
    assert edited <= ours, (edited, ours)


def test_a_prompt_posted_while_the_group_is_upgraded_keeps_its_message_in_the_old_chat(
    srv: ChannelServer, tg: UpgradingTelegram
) -> None:
    ann = tg.user(ANN, "Ann", "ann")
    moved = f"chat {RACING} is now {RACING_SUPER}"
    told: list[int] = []

    def learned_the_upgrade() -> bool:
        if not told:  # Telegram tells while the post is in flight
            told.append(tg.service_messages(RACING, RACING_SUPER, ann))
        return moved in srv.log()

    tg.hold_prompt = (RACING, learned_the_upgrade)
    tg.inject(RACING, "/call clock {}", kind="group", sender=ann)
    prompt: BotMessage = tg.wait_for(
        lambda: next((m for m in tg.messages(RACING) if m.reply_markup), None), timeout=25, what="the prompt"
    )
    assert learned_the_upgrade(), "the gateway never heard of the upgrade while the prompt was posted"
    found = re.search(r"/approve (\w+)", prompt.text)
    assert found, prompt.text
    tg.inject(RACING_SUPER, f"/approve {found.group(1)}", kind="supergroup", sender=ann)
    tg.wait_for_text(RACING_SUPER, lambda t: t.startswith("clock -> "), timeout=30)
    edits = tg.wait_for(lambda: tg.calls("editMessageText", chat_id=RACING) or None, 20, "the prompt's decided edit")
    assert [int(c.params["message_id"]) for c in edits] == [prompt.message_id]
    elsewhere = [c.params for c in tg.calls("editMessageText", chat_id=RACING_SUPER)]
    assert not elsewhere, f"the prompt's edit went to the supergroup: {elsewhere}"


def test_moving_a_chat_in_gateway_db_keeps_threads_and_the_new_ids_own_keys(tmp_path: Path) -> None:
    """`Ledger.move_chat`: the chat's routes and bound conversations (root and threads) take the new
    id, a key the new id already has stays, its prompts' posts are named in the old chat, and moving
    again changes nothing."""
    ledger = Ledger.open(tmp_path / "channels" / "gateway.db")
    router = Router(ledger.connection)
    board = ApprovalBoard(ledger.connection)
    router.add(RouteKey("telegram", "main", "-7"), "coder")
    router.bind(RouteKey("telegram", "main", "-7"), "conv_old")
    router.bind(RouteKey("telegram", "main", "-7", "42"), "conv_topic")
    router.add(RouteKey("telegram", "main", "-1007", "9"), "writer")  # set for the new id already
    router.add(RouteKey("telegram", "main", "-7", "9"), "stale")
    router.bind(RouteKey("telegram", "other", "-7"), "conv_other_account")
    prompt = Prompt("call_abcdef123456", "conv_old", "turn_1", "telegram:main", Target("-7"), "500", "clock", "{}")
    board.note_attempt(prompt, "part", 1.0)
    board.note_shown(prompt.call_id, ["12"])

    moved = ledger.move_chat("telegram", "main", "-7", "-1007")
    assert (moved.routes, moved.conversations, moved.prompts) == (1, 2, 1)
    root = router.resolve(RouteKey("telegram", "main", "-1007"))
    topic = router.resolve(RouteKey("telegram", "main", "-1007", "42"))
    kept = router.get(RouteKey("telegram", "main", "-1007", "9"))
    assert root is not None and (root.agent, root.conversation) == ("coder", "conv_old")
    assert topic is not None and topic.conversation == "conv_topic"
    assert kept is not None and kept.agent == "writer"
    assert [str(r.key) for r in router.routes("telegram", "main")] == [
        "telegram:main:-1007:9",
        "telegram:main:-1007:__root__",
    ]
    assert router.resolve(RouteKey("telegram", "other", "-7"), "x").conversation == "conv_other_account"  # type: ignore[union-attr]
    left = board.leftovers()
    assert [(p.target.chat, p.message_ids) for p in left] == [("-1007", ["-7:12"])]
    assert not ledger.move_chat("telegram", "main", "-7", "-1007")  # once
