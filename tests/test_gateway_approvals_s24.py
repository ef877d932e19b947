"""A pressed approval prompt whose call no longer waits is edited to the decision, without buttons
(docs/channels.md, "Approvals in the chat"), also when the gateway never recorded that message as
the call's prompt: a post Telegram performed whose answer never reached the gateway (a crash in
flight, or a page instead of the Bot API's answer) stays in the chat with live buttons, and the
gateway edits only the prompt it recorded. A real `appserver serve --channels telegram` against
the loopback fake Bot API; the lost answer is the fake's `perform_then_page`."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.fakes.slack_api import FakeSlack
from tests.fakes.telegram_api import BotMessage, FakeTelegram
from tests.support.cli import cli_env, run_cli
from tests.support.gateway import ChannelServer, channel_server, write_config

pytestmark = pytest.mark.timeout(120)

ANN = 6001
ORPHAN_APPROVED, ORPHAN_PRESSED, UNKNOWN, FORGED_ON_ANSWER, FORGED_OTHER_CALL = 6101, 6102, 6103, 6104, 6105
CHATS = (ORPHAN_APPROVED, ORPHAN_PRESSED, UNKNOWN, FORGED_ON_ANSWER, FORGED_OTHER_CALL)
LEFT_AS_IT_IS = "no prompt of it: left as it is"
SLACK_CHANNEL = "C-orphan"


@pytest.fixture(scope="module")
def tg() -> Iterator[FakeTelegram]:
    with FakeTelegram() as fake:
        yield fake


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, tg: FakeTelegram) -> Iterator[ChannelServer]:
    home = tmp_path_factory.mktemp("tg-orphan-prompts") / "home"
    settings = {"api_url": tg.url, "poll_timeout": 1, "token_env": "TG_TOKEN", "dm_policy": "open"}
    write_config(home, {"telegram": {"main": settings}}, ["telegram"])
    created = run_cli(home, "agents", "create", "--name", "careful", "--tool", "clock=ask")
    assert created.code == 0, created.err
    for chat in CHATS:
        routed = run_cli(home, "channels", "route", "add", f"telegram:main:{chat}", "careful")
        assert routed.code == 0, routed.err
    with channel_server(home, "--channels", "telegram", env=cli_env(home, TG_TOKEN=tg.token)) as server:
        yield server


def _orphan_prompt(tg: FakeTelegram, chat: int) -> tuple[BotMessage, str]:
    """`/call clock {}` whose prompt Telegram posts but whose answer the gateway never reads: the
    prompt is in the chat with live buttons, and the gateway holds no message id for it."""
    tg.perform_then_page("sendMessage", 502)
    tg.dm("/call clock {}", user_id=chat, first_name="Ann")
    prompt = tg.wait_for(
        lambda: next((m for m in tg.messages(chat) if m.text.startswith("🔐") and m.reply_markup), None),
        timeout=20,
        what="the approval prompt with buttons",
    )
    short = re.search(r"/approve (\w+)", prompt.text)
    assert short, prompt.text
    return prompt, short.group(1)


def _ran(tg: FakeTelegram, chat: int) -> None:
    tg.wait_for(
        lambda: any(m.text.startswith("clock -> ") for m in tg.messages(chat)) or None, timeout=20, what="the call ran"
    )


def _settled(tg: FakeTelegram, chat: int, message_id: int) -> BotMessage:
    def without_buttons() -> BotMessage | None:
        message = tg.message(chat, message_id)
        return None if message.reply_markup else message

    return tg.wait_for(without_buttons, timeout=15, what=f"message {message_id} without buttons")


def test_a_press_on_an_unrecorded_prompt_of_a_decided_call_shows_the_decision(
    srv: ChannelServer, tg: FakeTelegram
) -> None:
    prompt, short = _orphan_prompt(tg, ORPHAN_APPROVED)
    tg.dm(f"/approve {short}", user_id=ORPHAN_APPROVED, first_name="Ann")
    _ran(tg, ORPHAN_APPROVED)
    assert tg.message(ORPHAN_APPROVED, prompt.message_id).reply_markup  # the gateway could not edit it

    # pressed twice before the first is handled: both find nothing waiting; one edit, same text
    ann = tg.user(ORPHAN_APPROVED, "Ann")
    first = tg.press(ORPHAN_APPROVED, prompt.message_id, f"deny:{short}", sender=ann)
    second = tg.press(ORPHAN_APPROVED, prompt.message_id, f"approve:{short}", sender=ann)
    edited = _settled(tg, ORPHAN_APPROVED, prompt.message_id)
    assert edited.text.startswith("🔐 The agent wants to use clock"), edited.text
    assert edited.text.endswith("✅ Approved by Ann"), edited.text
    assert "/approve" not in edited.text
    handled = f"a click on an answered approval prompt in {ORPHAN_APPROVED}"
    tg.wait_for(lambda: srv.log().count(handled) == 2 or None, timeout=15, what="both presses handled")
    assert all(tg.callback_answer(i.callback_id or "") is not None for i in (first, second))
    again = tg.message(ORPHAN_APPROVED, prompt.message_id)
    assert again.history == [prompt.text, edited.text] and not again.reply_markup, again.history
    assert "could not update the pressed approval prompt" not in srv.log()
    assert not [m for m in tg.messages(ORPHAN_APPROVED) if "No request waiting" in m.text]


def test_pressing_the_unrecorded_prompt_answers_the_call_and_edits_that_message(
    srv: ChannelServer, tg: FakeTelegram
) -> None:
    prompt, short = _orphan_prompt(tg, ORPHAN_PRESSED)
    tg.press(ORPHAN_PRESSED, prompt.message_id, f"approve:{short}", sender=tg.user(ORPHAN_PRESSED, "Ann"))
    _ran(tg, ORPHAN_PRESSED)
    edited = _settled(tg, ORPHAN_PRESSED, prompt.message_id)
    assert edited.text.endswith("✅ Approved by Ann"), edited.text


def test_a_press_on_a_prompt_this_gateway_knows_nothing_of_says_it_no_longer_waits(
    srv: ChannelServer, tg: FakeTelegram
) -> None:
    """A prompt of a call decided before this gateway started (its outcome unknown here): the bot's
    message with Approve / Deny buttons, posted straight through the Bot API."""
    buttons = [
        [
            {"text": "✅ Approve", "callback_data": "approve:0bad0c0d"},
            {"text": "❌ Deny", "callback_data": "deny:0bad0c0d"},
        ]
    ]
    body = {
        "chat_id": UNKNOWN,
        "text": "🔐 Reply /approve 0bad0c0d or /deny 0bad0c0d",
        "reply_markup": json.dumps({"inline_keyboard": buttons}),
    }
    tg.chat(UNKNOWN)
    posted = httpx.post(f"{tg.url}/bot{tg.token}/sendMessage", data=body, timeout=10).json()
    assert posted["ok"], posted
    message_id = posted["result"]["message_id"]
    tg.press(UNKNOWN, message_id, "deny:0bad0c0d", sender=tg.user(UNKNOWN, "Ann"))
    edited = _settled(tg, UNKNOWN, message_id)
    assert edited.text == "🔐 Approval request 0bad0c0d\n⏹ No longer waiting for an answer.", edited.text
    assert [m.message_id for m in tg.messages(UNKNOWN)] == [message_id]  # nothing posted


@pytest.fixture(scope="module")
def slack() -> Iterator[FakeSlack]:
    with FakeSlack(ack_timeout=1.0) as fake:
        yield fake


@pytest.fixture(scope="module")
def slack_srv(tmp_path_factory: pytest.TempPathFactory, slack: FakeSlack) -> Iterator[ChannelServer]:
    home = tmp_path_factory.mktemp("slack-orphan-prompts") / "home"
    settings = {"api_url": slack.url, "bot_token_env": "SLACK_BOT", "app_token_env": "SLACK_APP", "dm_policy": "open"}
    write_config(home, {"slack": {"main": settings}}, ["slack"])
    created = run_cli(home, "agents", "create", "--name", "careful", "--tool", "clock=ask")
    assert created.code == 0, created.err
    routed = run_cli(home, "channels", "route", "add", f"slack:main:{SLACK_CHANNEL}", "careful")
    assert routed.code == 0, routed.err
    env = cli_env(home, SLACK_BOT=slack.bot_token, SLACK_APP=slack.app_token)
    with channel_server(home, "--channels", "slack", env=env) as server:
        yield server


def test_on_slack_a_press_on_a_prompt_no_call_waits_for_loses_its_buttons(
    slack_srv: ChannelServer, slack: FakeSlack
) -> None:
    """Slack names the pressed message by `container.message_ts`: that message is updated (its
    blocks sent without the buttons), nothing is posted."""
    buttons = [
        {"type": "button", "action_id": verb, "value": f"{verb}:0bad0c0d", "text": {"type": "plain_text", "text": verb}}
        for verb in ("approve", "deny")
    ]
    blocks = [
        {"type": "section", "text": {"type": "mrkdwn", "text": "🔐 Reply /approve 0bad0c0d"}},
        {"type": "actions", "block_id": "approval-0bad0c0d", "elements": buttons},
    ]
    slack.add_channel(SLACK_CHANNEL)
    posted = httpx.post(
        f"{slack.url}/api/chat.postMessage",
        json={"channel": SLACK_CHANNEL, "text": "🔐 Reply /approve 0bad0c0d", "blocks": blocks},
        headers={"Authorization": f"Bearer {slack.bot_token}"},
        timeout=10,
    ).json()
    assert posted["ok"], posted
    slack.click("U2", SLACK_CHANNEL, posted["ts"], "deny:0bad0c0d", user_name="ann")
    edited = slack.wait_for(
        lambda: next((m for m in slack.messages(SLACK_CHANNEL) if m.ts == posted["ts"] and "waiting" in m.text), None),
        timeout=15,
        what="the pressed message updated",
    )
    assert "No longer waiting for an answer" in edited.text, edited.text
    assert not any(b.get("type") == "actions" for b in edited.blocks), edited.blocks
    assert [m.ts for m in slack.messages(SLACK_CHANNEL)] == [posted["ts"]]


def _forged_press(tg: FakeTelegram, chat: int, message_id: int, data: str, sender: dict[str, Any]) -> None:
    """A callback query a modified client sends: any data for any bot message (the fake's `press`
    refuses data no button of the message carries, as an honest client does). Telegram fills in
    the message as it reads, so the gateway sees what the pressed message really shows."""
    with tg._lock:
        found = tg._bot_messages[(chat, message_id)]
        update_id = tg._next_update_id
        tg._next_update_id += 1
        callback_id = f"{update_id}{message_id}66"
        tg._callbacks[callback_id] = None
        query = {"id": callback_id, "from": dict(sender), "message": tg._bot_message_json(found), "data": data}
        tg._updates.append({"update_id": update_id, "callback_query": query | {"chat_instance": f"ci{chat}"}})
    tg._notify()


def _press_handled(srv: ChannelServer, tg: FakeTelegram, chat: int, message_id: int, ref: str) -> BotMessage:
    """The message once the forged press naming `ref` was handled: left as it is (the gateway says
    so), or edited (the bug)."""
    said = f"a press naming approval {ref} on message {message_id}, {LEFT_AS_IT_IS}"

    def handled() -> BotMessage | None:
        message = tg.message(chat, message_id)
        return message if message.edits or said in srv.log() else None

    return tg.wait_for(handled, timeout=15, what=f"the forged press on message {message_id} handled")


def test_a_forged_press_on_the_bots_ordinary_answer_leaves_it_unchanged(srv: ChannelServer, tg: FakeTelegram) -> None:
    tg.dm("what time is it in words", user_id=FORGED_ON_ANSWER, first_name="Ann")
    answer = tg.wait_for(lambda: next(iter(tg.messages(FORGED_ON_ANSWER)), None), timeout=20, what="the answer")
    _forged_press(tg, FORGED_ON_ANSWER, answer.message_id, "deny:zzzzzzzz", tg.user(FORGED_ON_ANSWER, "Bob"))
    after = _press_handled(srv, tg, FORGED_ON_ANSWER, answer.message_id, "zzzzzzzz")
    assert after.history == [answer.text] and after.edits == 0, after.history
    assert [m.message_id for m in tg.messages(FORGED_ON_ANSWER)] == [answer.message_id]  # nothing posted


def test_a_forged_press_naming_another_call_leaves_a_prompt_unchanged(srv: ChannelServer, tg: FakeTelegram) -> None:
    """Call X's unrecorded copy (live buttons for X) and X's recorded prompt (decided), each pressed
    with the data of call Y, decided too: neither shows Y's decision."""
    chat, ann = FORGED_OTHER_CALL, tg.user(FORGED_OTHER_CALL, "Ann")
    orphan, x_id = _orphan_prompt(tg, chat)
    tg.dm(f"/approve {x_id}", user_id=chat, first_name="Ann")
    recorded = tg.wait_for(
        lambda: next(
            (m for m in tg.messages(chat) if m.message_id != orphan.message_id and "Approved" in m.text), None
        ),
        timeout=20,
        what="call X's recorded prompt decided",
    )
    tg.dm("/call clock {}", user_id=chat, first_name="Ann")
    y_prompt = tg.wait_for(
        lambda: next((m for m in tg.messages(chat) if m.reply_markup and m.message_id != orphan.message_id), None),
        timeout=20,
        what="call Y's prompt",
    )
    y_id = re.search(r"/approve (\w+)", y_prompt.text).group(1)  # type: ignore[union-attr]
    assert y_id != x_id
    tg.press(chat, y_prompt.message_id, f"deny:{y_id}", sender=ann)
    _settled(tg, chat, y_prompt.message_id)
    orphan_before, recorded_before = tg.message(chat, orphan.message_id), tg.message(chat, recorded.message_id)

    _forged_press(tg, chat, orphan.message_id, f"deny:{y_id}", ann)
    after = _press_handled(srv, tg, chat, orphan.message_id, y_id)
    assert after.history == orphan_before.history and after.reply_markup, after.history
    _forged_press(tg, chat, recorded.message_id, f"approve:{y_id}", ann)
    after = _press_handled(srv, tg, chat, recorded.message_id, y_id)
    assert after.history == recorded_before.history, after.history
    assert "Denied" not in after.text


def test_on_slack_a_forged_click_on_a_bot_message_without_buttons_leaves_it_unchanged(
    slack_srv: ChannelServer, slack: FakeSlack
) -> None:
    slack.add_channel(SLACK_CHANNEL)
    posted = httpx.post(
        f"{slack.url}/api/chat.postMessage",
        json={"channel": SLACK_CHANNEL, "text": "The quarterly numbers are 42."},
        headers={"Authorization": f"Bearer {slack.bot_token}"},
        timeout=10,
    ).json()
    assert posted["ok"], posted
    slack.click("U3", SLACK_CHANNEL, posted["ts"], "deny:zzzzzzzz", user_name="bob")
    said = f"a press naming approval zzzzzzzz on message {posted['ts']}, {LEFT_AS_IT_IS}"

    def updates() -> list[Any]:
        return [c for c in slack.calls("chat.update", channel=SLACK_CHANNEL) if c.params.get("ts") == posted["ts"]]

    slack.wait_for(lambda: said in slack_srv.log() or bool(updates()) or None, timeout=15, what="the click handled")
    assert not updates()
    shown = next(m for m in slack.messages(SLACK_CHANNEL) if m.ts == posted["ts"])
    assert shown.text == "The quarterly numbers are 42.", shown.text
