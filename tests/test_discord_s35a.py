"""An approval prompt whose post a kill -9 cut short (the platform has it, with live buttons; the
gateway child died before noting its id) is edited to its decision by the restarted gateway when
the call was decided while the child was down (session 35, A). Before, `ChatOps.decided` saw no id
and posted a separate line ("`clock`: ✅ Approved"), and the prompt kept its live buttons for good.
The restarted gateway now finds the prompt it posted (gateway/delivery.py `Outbox.find_left`:
Discord's nonce repeat; Slack's lookup by message metadata) and edits it in place.

Also checked here, unchanged: a prompt cut short whose call still waits at the restart is reused
(not posted again), and a press on it decides it in place. Past Discord's nonce window (two minutes,
too long for an end-to-end test), the outbox looks for the prompt by its text instead of repeating
it (in memory, with the platform fakes of tests/test_gateway_send_once.py).

End to end: `appserver serve --channels discord` (and `--channels slack`) against the loopback fakes,
the gateway child killed -9 the moment the fake performed the prompt's post, before answering it;
the restarted child reaches the fake only once the test lets it (after deciding the call)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from starlette.requests import Request
from starlette.responses import Response

from plugins.contract import Target
from tests.fakes.discord_api import BotMessage, FakeDiscord
from tests.fakes.slack_api import Call, FakeSlack, SlackMessage
from tests.support.cli import cli_env, run_cli
from tests.support.gateway import (
    READY_LINE,
    ChannelServer,
    channel_server,
    discord_server,
    end_pending_turn,
    write_config,
)
from tests.support.wait import eventually
from tests.test_gateway_send_once import Clock, Deduping, outbox

pytestmark = pytest.mark.timeout(150)

APPROVALS = "300000000000000002"  # routed to `careful` (clock=ask)
SLACK_APPROVALS = "C-cutoff"  # the same on Slack
DECIDED_LINE = "`clock`: ✅ Approved"  # what the gateway posted beside a prompt it could not find
HELD_S = 30.0  # longest a restarted child is kept from the fake while the test decides the call


class Fake(FakeDiscord):
    """The fake, calling `on_prompt_post` with the message id as a post with buttons (an approval
    prompt) in APPROVALS is recorded, before it is answered."""

    def __init__(self) -> None:
        super().__init__()
        self.on_prompt_post: Callable[[str], None] | None = None

    def _handle(
        self, request: Request, method: str, parts: list[str], body: Any, kind: str
    ) -> tuple[int, Any, dict[str, str] | None, float]:
        answer = super()._handle(request, method, parts, body, kind)
        hook = self.on_prompt_post
        is_prompt = kind == "POST messages" and parts[1] == APPROVALS and bool((body or {}).get("components"))
        if hook is not None and is_prompt and answer[0] == 200:
            self.on_prompt_post = None
            hook(str(answer[1]["id"]))
        return answer


class GatedSlack(FakeSlack):
    """The fake, whose `auth.test` (a starting gateway child's first call) waits while held: the
    restarted child connects only once `release()` (at most HELD_S)."""

    def __init__(self) -> None:
        super().__init__(ack_timeout=1.0)
        self._let_in = threading.Event()
        self._let_in.set()

    def hold(self) -> None:
        self._let_in.clear()

    def release(self) -> None:
        self._let_in.set()

    async def _api(self, request: Request) -> Response:
        if request.path_params["method"] == "auth.test":
            await asyncio.to_thread(self._let_in.wait, HELD_S)
        return await super()._api(request)


@pytest.fixture(scope="module")
def fake() -> Iterator[Fake]:
    with Fake() as f:
        yield f


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, fake: Fake) -> Iterator[ChannelServer]:
    home = tmp_path_factory.mktemp("discord_s35a") / "home"
    with discord_server(home, fake, {APPROVALS: "approvals"}, careful_in=APPROVALS) as server:
        yield server


@pytest.fixture(scope="module")
def slack() -> Iterator[GatedSlack]:
    with GatedSlack() as f:
        yield f


@pytest.fixture(scope="module")
def slack_srv(tmp_path_factory: pytest.TempPathFactory, slack: GatedSlack) -> Iterator[ChannelServer]:
    home = tmp_path_factory.mktemp("slack_s35a") / "home"
    settings = {"api_url": slack.url, "bot_token_env": "SLACK_BOT", "app_token_env": "SLACK_APP",
                "dm_policy": "open", "default_agent": "assistant"}  # fmt: skip
    write_config(home, {"slack": {"main": settings}}, ["slack"])
    created = run_cli(home, "agents", "create", "--name", "careful", "--tool", "clock=ask")
    assert created.code == 0, created.err
    routed = run_cli(home, "channels", "route", "add", f"slack:main:{SLACK_APPROVALS}", "careful")
    assert routed.code == 0, routed.err
    env = cli_env(home, SLACK_BOT=slack.bot_token, SLACK_APP=slack.app_token)
    with channel_server(home, "--channels", "slack", env=env) as server:
        yield server


def _prompt_cut_short(srv: ChannelServer, fake: Fake) -> tuple[int, BotMessage]:
    """Ask for a call that needs approval and kill -9 the gateway child as Discord performs the
    prompt's post, before it answers; the restarted child connects only once `fake.release()`."""
    pid = srv.gateway_pid()
    posted: list[str] = []

    def kill(message_id: str) -> None:
        fake.hold()
        os.kill(pid, signal.SIGKILL)
        posted.append(message_id)

    fake.on_prompt_post = kill
    try:
        fake.inject_guild_message("821", "/call clock {}", channel=APPROVALS, mention=True)
        fake.wait_for(lambda: posted, 30, "the approval prompt's post")
    except BaseException:
        fake.on_prompt_post = None
        fake.release()
        raise
    prompt = _message(fake, posted[0])
    assert prompt.components and "/approve" in prompt.content, prompt
    return pid, prompt


def _message(fake: Fake, message_id: str) -> BotMessage:
    return next(m for m in fake.messages(APPROVALS) if m.id == message_id)


def _chat(fake: Fake) -> list[str]:
    return [f"{m.content!r}{' [buttons]' if m.components else ''}" for m in fake.messages(APPROVALS)]


def test_a_prompt_cut_short_by_a_kill_is_edited_to_the_decision_made_while_the_child_was_down(
    srv: ChannelServer, fake: Fake
) -> None:
    pid, prompt = _prompt_cut_short(srv, fake)
    try:
        asyncio.run(end_pending_turn(srv, "careful", "approve"))
    finally:
        fake.release()
    fake.wait_for(lambda: srv.gateway_pid() != pid or None, 20, "the restarted gateway child")
    fake.wait_for_text(APPROVALS, lambda t: t.startswith("clock -> "), timeout=30)
    decided = eventually(lambda: not _message(fake, prompt.id).components and _message(fake, prompt.id), 30)
    assert decided, f"the prompt {prompt.id} kept its live buttons; the chat reads {_chat(fake)}"
    assert "✅ Approved" in decided.content and "/approve" not in decided.content, decided.content
    assert not any(DECIDED_LINE in m.content for m in fake.messages(APPROVALS)), _chat(fake)  # no line beside it
    assert [m.id for m in fake.messages(APPROVALS) if "🔐" in m.content] == [prompt.id], _chat(fake)
    assert not [m for m in fake.messages(APPROVALS) if m.components], _chat(fake)


def test_a_prompt_cut_short_whose_call_still_waits_is_reused_and_decided_in_place(
    srv: ChannelServer, fake: Fake
) -> None:
    starts = srv.log().count(READY_LINE)
    srv.wait_channels_ready(30, restarts=starts - 1)
    before = {m.id for m in fake.messages(APPROVALS)}
    pid, prompt = _prompt_cut_short(srv, fake)
    fake.release()
    fake.wait_for(lambda: srv.gateway_pid() != pid or None, 20, "the restarted gateway child")
    srv.wait_channels_ready(30, restarts=starts)
    short = re.search(r"/approve (\w+)", prompt.content)
    assert short, prompt.content
    fake.click("821", APPROVALS, prompt.id, f"approve:{short.group(1)}", name="ann")
    decided = eventually(lambda: "Approved by" in _message(fake, prompt.id).content and _message(fake, prompt.id), 30)
    assert decided, f"the pressed prompt {prompt.id} was not decided; the chat reads {_chat(fake)}"
    assert not decided.components, decided
    fake.wait_for(
        lambda: [m for m in fake.messages(APPROVALS) if m.id not in before and m.content.startswith("clock -> ")],
        30,
        "the reply",
    )
    prompts = [m.id for m in fake.messages(APPROVALS) if m.id not in before and "🔐" in m.content]
    assert prompts == [prompt.id], _chat(fake)  # reused, never posted again
    assert not [m for m in fake.messages(APPROVALS) if m.id not in before and m.components], _chat(fake)


def _slack_message(slack: GatedSlack, ts: str) -> SlackMessage:
    return next(m for m in slack.messages(SLACK_APPROVALS) if m.ts == ts)


def _with_buttons(message: SlackMessage) -> bool:
    return any(b.get("type") == "actions" for b in message.blocks)


def _slack_chat(slack: GatedSlack) -> list[str]:
    return [f"{m.text!r}{' [buttons]' if _with_buttons(m) else ''}" for m in slack.messages(SLACK_APPROVALS)]


def test_on_slack_a_prompt_cut_short_by_a_kill_is_found_and_edited_to_the_decision(
    slack_srv: ChannelServer, slack: GatedSlack
) -> None:
    pid = slack_srv.gateway_pid()
    posted: list[Call] = []

    def kill(call: Call) -> None:
        is_prompt = call.method == "chat.postMessage" and call.channel == SLACK_APPROVALS and "blocks" in call.params
        if is_prompt and call.status == 200 and not posted:
            slack.hold()
            os.kill(pid, signal.SIGKILL)
            posted.append(call)

    slack.on_answer = kill
    try:
        slack.inject_mention("U2", "<@UBOT> /call clock {}", channel=SLACK_APPROVALS)
        slack.wait_for(lambda: posted, 30, "the approval prompt's post")
        asyncio.run(end_pending_turn(slack_srv, "careful", "approve"))
    finally:
        slack.on_answer = None
        slack.release()
    ts = str(posted[0].response["ts"])
    assert _with_buttons(_slack_message(slack, ts))
    slack.wait_for(lambda: slack_srv.gateway_pid() != pid or None, 20, "the restarted gateway child")
    slack.wait_for_text(SLACK_APPROVALS, lambda t: t.startswith(("clock -&gt; ", "clock -> ")), timeout=30)
    decided = eventually(lambda: not _with_buttons(_slack_message(slack, ts)) and _slack_message(slack, ts), 30)
    assert decided, f"the prompt {ts} kept its live buttons; the chat reads {_slack_chat(slack)}"
    assert "✅ Approved" in decided.text and "/approve" not in decided.text, decided.text
    assert not any(DECIDED_LINE in m.text for m in slack.messages(SLACK_APPROVALS)), _slack_chat(slack)
    assert [m.ts for m in slack.messages(SLACK_APPROVALS) if m.text.startswith("🔐")] == [ts], _slack_chat(slack)
    assert len(slack.calls("chat.postMessage", channel=SLACK_APPROVALS)) == len(slack.messages(SLACK_APPROVALS))


PROMPT_TEXT = (
    "🔐 The agent wants to use `clock` with these arguments:\n```\n{}\n```\nReply /approve 0abc1234 or /deny 0abc1234"
)


class PastWindow(Deduping):
    """Discord past its nonce window: a repeat would post anew, and the bot's messages can be
    looked for by their text (`find_posted`, as plugins/discord reads the channel's history)."""

    dedupe_window_s = 120.0

    def __init__(self, clock: Clock) -> None:
        super().__init__(clock)
        self.looked_for: list[str] = []

    async def find_posted(self, target: Target, since: float, text: str) -> list[str] | None:
        self.looked_for.append(text)
        return [i for i, (shown, _, at) in self.messages.items() if shown == text and at >= since] or None


async def test_past_the_nonce_window_a_prompt_cut_short_is_looked_for_by_its_text_not_posted_again() -> None:
    chat = PastWindow(Clock())
    target = Target("chat1", key="discord:main:approval:call_0abc1234")
    since = chat.clock()
    [posted] = await outbox(chat).send(target, PROMPT_TEXT)  # the post a kill -9 cut short
    await chat.clock.sleep(600)
    assert await outbox(chat).find_left(target, since, PROMPT_TEXT) == [posted]
    assert len(chat.sends) == 1 and chat.looked_for == [PROMPT_TEXT]


async def test_past_the_nonce_window_a_prompt_that_never_landed_is_not_posted_by_the_look() -> None:
    chat = PastWindow(Clock())
    since = chat.clock()
    await chat.clock.sleep(600)
    assert await outbox(chat).find_left(Target("chat1", key="k"), since, PROMPT_TEXT) is None
    assert chat.sends == [] and chat.looked_for == [PROMPT_TEXT]  # the decision goes out as a line
