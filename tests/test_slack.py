"""The Slack plugin (issue 18) in-process: the real slack_sdk clients (AsyncWebClient, the aiohttp
SocketModeClient) against the loopback fake of the Web API and Socket Mode (tests/fakes/slack_api.py),
with a stand-in for the gateway's `on_message` that commits, then acks, like the real one. The
end-to-end tests through `appserver serve --channels slack` are in tests/test_slack_e2e.py."""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plugins.contract import Account, AccountError, AdapterContext, DeliveryError, InboundMessage, Target
from plugins.slack import MAX_LENGTH, SlackAdapter, create_adapter, to_mrkdwn
from tests.fakes.slack_api import FakeSlack

pytestmark = pytest.mark.timeout(60)

PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 64


# ---------------------------------------------------------------------- format


@pytest.mark.parametrize(
    ("markdown", "mrkdwn"),
    [
        ("**bold** and __also__", "*bold* and *also*"),
        ("*italic* and _this_", "_italic_ and _this_"),
        ("~~gone~~", "~gone~"),
        ("snake_case_name and 2*3*4", "snake_case_name and 2*3*4"),
        ("see [the docs](https://x.test/a?b=1&c=2)", "see <https://x.test/a?b=1&amp;c=2|the docs>"),
        ("# Title", "*Title*"),
        ("- one\n* two", "• one\n• two"),
        ("`a < b && **c**`", "`a &lt; b &amp;&amp; **c**`"),
        ("> quoted", "&gt; quoted"),
        ("x < y > z & w", "x &lt; y &gt; z &amp; w"),
    ],
)
def test_markdown_becomes_mrkdwn(markdown: str, mrkdwn: str) -> None:
    assert to_mrkdwn(markdown) == mrkdwn


def test_code_blocks_are_kept_escaped_and_an_open_fence_is_closed() -> None:
    text = "Run:\n```python\nif a < b and **x**:\n    print('&')\n```\nthen\n```\nopen <fence>"
    out = to_mrkdwn(text)
    assert out == "Run:\n```\nif a &lt; b and **x**:\n    print('&amp;')\n```\nthen\n```\nopen &lt;fence&gt;\n```"


@pytest.mark.parametrize(
    "hostile",
    [
        "<!channel> everyone look",
        "<@U123> hi <#C1> <!subteam^S1>",
        "[click](javascript:alert(1))",
        "[a|b>c](https://evil.test/|x>y)",
        "&lt;!here&gt; already escaped",
        "\x00\x01<!everyone>\x00",
        "```\n<!channel>\n```",
        "`<!here>`",
    ],
)
def test_hostile_text_cannot_mention_ping_or_forge_links(hostile: str) -> None:
    out = to_mrkdwn(hostile)
    # The only `<…>` Slack would parse are links emitted by the formatter: http(s)/mailto, no raw `|`
    # in the URL, none of `<!…>`, `<@…>`, `<#…>`.
    for token in re.findall(r"<([^>]*)>", out):
        assert re.match(r"(https?://|mailto:)", token), (hostile, out)
    assert "<!" not in out and "<@" not in out and "<#" not in out
    assert "\x00" not in out and "\x01" not in out
    # Every `&` is the start of an entity.
    assert not re.search(r"&(?!amp;|lt;|gt;)", out), out


_EMITTED_LINK = re.compile(r"<(?:https?://|mailto:)[^<>|\s]*(?:\|[^<>|]*)?>")


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from([*"<>&|[]()*_`~!@#:/ \nabc", "https://", "&amp;", "```", "<!here>", "]("])).map("".join)
)
def test_generated_text_never_leaves_a_raw_control_character(text: str) -> None:
    out = to_mrkdwn(text)
    bare = _EMITTED_LINK.sub("", out)
    assert "<" not in bare and ">" not in bare, (text, out)
    assert not re.search(r"&(?!amp;|lt;|gt;)", out), (text, out)


def test_a_link_label_and_url_cannot_break_out() -> None:
    out = to_mrkdwn("[a|b>c](https://evil.test/|x>y)")
    assert out == "<https://evil.test/%7Cx&gt;y|a¦b&gt;c>"


# ---------------------------------------------------------------------- the adapter in-process


class StandIn:
    """The gateway's side of the contract: `on_message` commits (a set of ids), then calls `ack`."""

    def __init__(self) -> None:
        self.calls: list[InboundMessage] = []
        self.ledger: dict[str, InboundMessage] = {}
        self.committed: dict[str, float] = {}
        self.states: list[tuple[str, str | None]] = []
        self.fail = 0  # the next n calls raise before committing (the ledger was unavailable)
        self.delay = 0.0

    async def on_message(self, msg: InboundMessage) -> None:
        self.calls.append(msg)
        if self.fail > 0:
            self.fail -= 1
            raise RuntimeError("ledger unavailable")
        await asyncio.sleep(self.delay)
        self.ledger.setdefault(msg.message_id, msg)
        self.committed.setdefault(msg.message_id, time.monotonic())
        if msg.ack is not None:
            await msg.ack()

    def report(self, state: Any, reason: str | None) -> None:
        self.states.append((state, reason))


@pytest.fixture(scope="module")
def slack() -> Iterator[FakeSlack]:
    with FakeSlack(ack_timeout=0.6) as fake:
        yield fake


def _adapter(slack: FakeSlack, gw: StandIn, tmp_path: Path, **secrets: str) -> SlackAdapter:
    ctx = AdapterContext(gw.on_message, gw.report, tmp_path, logging.getLogger("test.slack"))
    tokens = {"bot_token": slack.bot_token, "app_token": slack.app_token} | secrets
    account = Account("slack", "main", {"api_url": slack.url}, {k: v for k, v in tokens.items() if v})
    adapter = create_adapter(account, ctx)
    assert isinstance(adapter, SlackAdapter)
    return adapter


@pytest.fixture
async def running(slack: FakeSlack, tmp_path: Path) -> AsyncIterator[tuple[SlackAdapter, StandIn]]:
    gw = StandIn()
    adapter = _adapter(slack, gw, tmp_path)
    await adapter.start()
    try:
        yield adapter, gw
    finally:
        await adapter.stop()


async def test_a_dm_is_acked_only_after_the_commit_and_maps_to_a_dm(
    slack: FakeSlack, running: tuple[SlackAdapter, StandIn]
) -> None:
    adapter, gw = running
    gw.delay = 0.3  # a slow commit: the ack must still wait for it
    ts = slack.inject_dm("U1", "hi &lt;b&gt; &amp; <https://x.test|x>", channel="D-ack",
                         user_profile={"display_name": "Ann"})  # fmt: skip
    event_id = slack.event_id_of(ts)
    await slack.wait_for_async(lambda: slack.acked(event_id), 5, "the ack")
    msg = gw.ledger[f"D-ack:{ts}"]
    assert (msg.chat, msg.chat_type, msg.sender, msg.sender_name) == ("D-ack", "dm", "U1", "Ann")
    assert msg.text == "hi <b> & x (https://x.test)" and msg.thread is None and not msg.sender_is_bot
    [(_, acked_event, acked_at)] = [a for a in slack.acks() if a[1] == event_id]
    assert acked_at >= gw.committed[msg.message_id]
    assert adapter.is_running and gw.states[-1] == ("running", None)


async def test_an_envelope_not_taken_is_redelivered_as_the_same_message(
    slack: FakeSlack, running: tuple[SlackAdapter, StandIn]
) -> None:
    _, gw = running
    gw.fail = 1
    ts = slack.inject_dm("U1", "retry me", channel="D-retry")
    event_id = slack.event_id_of(ts)
    await slack.wait_for_async(lambda: slack.acked(event_id), 5, "the ack of the redelivery")
    attempts = [d.retry_attempt for d in slack.deliveries(event_id)]
    assert attempts == [0, 1], attempts
    ids = [m.message_id for m in gw.calls if m.chat == "D-retry"]
    assert ids == [f"D-retry:{ts}"] * 2  # the same ledger key: no second turn
    assert len([k for k in gw.ledger if k.startswith("D-retry:")]) == 1


async def test_mentions_threads_bots_and_subtypes(slack: FakeSlack, running: tuple[SlackAdapter, StandIn]) -> None:
    _, gw = running
    mention = slack.inject_mention("U2", "<@UBOT> /status please", channel="C-map")
    in_thread = slack.inject_mention("U2", "<@UBOT> more", channel="C-map", thread_ts=mention)
    plain = slack.inject_channel_message("U3", "chatter", channel="C-map")
    twin = slack.inject_event(  # the message.channels twin of the first mention: the same message id
        {"type": "message", "channel": "C-map", "user": "U2", "text": "<@UBOT> /status please", "ts": mention,
         "channel_type": "channel"}
    )  # fmt: skip
    by_bot = slack.inject_channel_message("U9", "beep", channel="C-map", bot_id="B9", subtype="bot_message")
    own = slack.inject_dm("UBOT", "my own reply", channel="D-map", bot_id="BBOT")
    edited = slack.inject_event({"type": "message", "subtype": "message_changed", "channel": "C-map", "ts": "1.1",
                                 "message": {"text": "edit"}})  # fmt: skip
    joined = slack.inject_channel_message("U4", "has joined", channel="C-map", subtype="channel_join")
    for event_id in [slack.event_id_of(t) for t in (mention, in_thread, plain, by_bot, own, joined)] + [twin, edited]:
        await slack.wait_for_async(functools.partial(slack.acked, event_id), 5, f"ack of {event_id}")
    first = gw.ledger[f"C-map:{mention}"]
    assert (first.chat_type, first.mentions_bot, first.thread, first.text) == ("group", True, mention, "/status please")
    reply = gw.ledger[f"C-map:{in_thread}"]
    assert reply.thread == mention and reply.reply_to == f"C-map:{mention}"
    assert gw.ledger[f"C-map:{plain}"].mentions_bot is False and gw.ledger[f"C-map:{plain}"].thread is None
    assert gw.ledger[f"C-map:{by_bot}"].sender_is_bot and f"D-map:{own}" not in gw.ledger  # own: ignored
    assert [m.message_id for m in gw.calls].count(f"C-map:{mention}") == 2  # twin: same key
    assert not [m for m in gw.calls if m.text in ("edit", "has joined", "my own reply")]  # acked, not handed over


async def test_the_named_mention_form_is_the_bots_mention_too(
    slack: FakeSlack, running: tuple[SlackAdapter, StandIn]
) -> None:
    """`<@UBOT|appserver>` (older clients, text posted through the API) is the bot's mention: dropped
    from the text, and counts as a mention in a plain channel message; other users' stay."""
    _, gw = running
    named = slack.inject_mention("U2", "<@UBOT|appserver> /status", channel="C-named")
    plain = slack.inject_channel_message("U3", "hey <@UBOT|appserver> and <@U7|bob>", channel="C-named")
    other = slack.inject_channel_message("U3", "ask <@U7|bob> not <@UBOTX>", channel="C-named")
    for ts in (named, plain, other):
        await slack.wait_for_async(lambda ts=ts: f"C-named:{ts}" in gw.ledger, 5, "the message")
    first = gw.ledger[f"C-named:{named}"]
    assert (first.mentions_bot, first.text) == (True, "/status"), first
    second = gw.ledger[f"C-named:{plain}"]
    assert second.mentions_bot and "UBOT" not in second.text and "<@U7|bob>" in second.text, second
    third = gw.ledger[f"C-named:{other}"]
    assert not third.mentions_bot and third.text == "ask <@U7|bob> not <@UBOTX>", third


async def test_an_image_is_fetched_with_the_bot_token(slack: FakeSlack, running: tuple[SlackAdapter, StandIn]) -> None:
    _, gw = running
    image = slack.add_file("cat.png", PNG)
    doc = slack.add_file("notes.pdf", b"%PDF-1.4", mimetype="application/pdf")
    ts = slack.inject_dm("U1", "look", channel="D-file", files=[image, doc])
    await slack.wait_for_async(lambda: f"D-file:{ts}" in gw.ledger, 5, "the message")
    first, second = gw.ledger[f"D-file:{ts}"].attachments
    assert (first.kind, first.name, first.mime, first.data) == ("image", "cat.png", "image/png", PNG)
    assert (second.kind, second.name, second.data) == ("file", "notes.pdf", None)
    assert (image["id"], slack.bot_token) in slack.file_gets()


async def test_send_edit_react_and_thread(slack: FakeSlack, running: tuple[SlackAdapter, StandIn]) -> None:
    adapter, _ = running
    slack.add_channel("C-out")
    assert adapter.limits.max_length == MAX_LENGTH and adapter.limits.can_edit and adapter.limits.can_react
    [ts] = await adapter.send(Target("C-out", thread="111.222"), adapter.format("**hi** <@U1>"))
    await adapter.edit(Target("C-out", thread="111.222"), ts, adapter.format("**hi**, done"))
    [msg] = slack.messages("C-out")
    assert (msg.thread_ts, msg.text, msg.history) == ("111.222", "*hi*, done", ["*hi* &lt;@U1&gt;", "*hi*, done"])
    await adapter.react(Target("C-out"), f"C-out:{ts}", "👀")
    await adapter.react(Target("C-out"), f"C-out:{ts}", "👀")  # already_reacted is no failure
    assert slack.reactions("C-out", ts) == ["eyes"]


async def test_errors_become_delivery_errors(slack: FakeSlack, running: tuple[SlackAdapter, StandIn]) -> None:
    adapter, _ = running
    slack.add_channel("C-err")
    slack.fail_next("chat.postMessage", "ratelimited", retry_after=2)
    with pytest.raises(DeliveryError) as limited:
        await adapter.send(Target("C-err"), "x")
    assert limited.value.retry_after == 2.0 and not limited.value.permanent
    assert [c.status for c in slack.calls("chat.postMessage", channel="C-err")] == [429]
    with pytest.raises(DeliveryError) as missing:
        await adapter.send(Target("C-nowhere"), "x")
    assert missing.value.permanent and "channel_not_found" in missing.value.reason
    slack.set_not_in_channel("C-kicked")
    with pytest.raises(DeliveryError) as kicked:
        await adapter.send(Target("C-kicked"), "x")
    assert kicked.value.permanent and "not_in_channel" in kicked.value.reason
    slack.fail_next("chat.update", "internal_error")
    with pytest.raises(DeliveryError) as transient:
        await adapter.edit(Target("C-err"), "1.2", "x")
    assert not transient.value.permanent and transient.value.retry_after is None


async def test_approval_buttons_come_back_as_commands(slack: FakeSlack, running: tuple[SlackAdapter, StandIn]) -> None:
    adapter, gw = running
    slack.add_channel("C-ok")
    text = "🔐 The agent wants to use clock with {}\nReply /approve ab12cd34 or /deny ab12cd34"
    [ts] = await adapter.prompt_approval(Target("C-ok", thread="5.5"), text, "ab12cd34")
    [prompt] = slack.messages("C-ok")
    values = [e["value"] for b in prompt.blocks if b["type"] == "actions" for e in b["elements"]]
    assert values == ["approve:ab12cd34", "deny:ab12cd34"] and prompt.thread_ts == "5.5"
    action_ts = slack.click("U7", "C-ok", ts, "approve:ab12cd34", user_name="ann")
    await slack.wait_for_async(lambda: f"C-ok:action:{action_ts}" in gw.ledger, 5, "the click")
    click = gw.ledger[f"C-ok:action:{action_ts}"]
    assert (click.text, click.sender, click.sender_name, click.thread) == ("/approve ab12cd34", "U7", "ann", "5.5")
    assert click.mentions_bot and click.chat_type == "group"
    await slack.wait_for_async(lambda: slack.acked(f"act-{action_ts}"), 5, "the click's ack")
    # The gateway edits the prompt to show the decision: the buttons go.
    await adapter.edit(Target("C-ok", thread="5.5"), ts, adapter.format(text.split("\n")[0] + "\n✅ Approved by ann"))
    [prompt] = slack.messages("C-ok")
    assert [b["type"] for b in prompt.blocks] == ["section"] and "Approved by ann" in prompt.text


async def test_disconnect_and_drop_reconnect_to_one_socket_nothing_lost_or_doubled(
    slack: FakeSlack, running: tuple[SlackAdapter, StandIn]
) -> None:
    adapter, gw = running
    gw.delay = 0.05
    assert slack.wait_connected()
    before = slack.connections
    sent = [slack.inject_dm("U1", f"burst {i}", channel="D-burst") for i in range(10)]
    assert slack.disconnect()  # mid-burst: Slack asks for a refresh
    sent += [slack.inject_dm("U1", f"burst {i}", channel="D-burst") for i in range(10, 20)]
    await slack.wait_for_async(lambda: not [t for t in sent if not slack.acked(slack.event_id_of(t))], 10, "acks")
    assert slack.connections == before + 1 and slack.open_sockets == 1
    assert slack.drop()  # the network: the watchdog reports backoff and reconnects
    await slack.wait_for_async(lambda: slack.connections == before + 2 and slack.connected or None, 10, "reconnect")
    sent += [slack.inject_dm("U1", "after the drop", channel="D-burst")]
    await slack.wait_for_async(lambda: slack.acked(slack.event_id_of(sent[-1])), 5, "ack after the drop")
    assert sorted(k for k in gw.ledger if k.startswith("D-burst:")) == sorted(f"D-burst:{t}" for t in sent)
    await slack.wait_for_async(lambda: gw.states[-1] == ("running", None), 5, "running again")
    assert "backoff" in [s for s, _ in gw.states]
    await asyncio.sleep(0.5)
    assert slack.open_sockets == 1 and slack.connections == before + 2 and adapter.is_running


@pytest.mark.parametrize("which", ["bot_token", "app_token"])
async def test_a_refused_token_is_an_account_error_naming_it(slack: FakeSlack, tmp_path: Path, which: str) -> None:
    gw = StandIn()
    prefix = "xoxb-" if which == "bot_token" else "xapp-"
    adapter = _adapter(slack, gw, tmp_path, **{which: prefix + "wrong"})
    calls = len(slack.calls())
    with pytest.raises(AccountError, match=rf"{which}_env.*invalid_auth"):
        await adapter.start()
    assert len(slack.calls()) - calls <= 2  # no retry loop
    assert not adapter.is_running


async def test_a_missing_token_is_an_account_error(slack: FakeSlack, tmp_path: Path) -> None:
    adapter = _adapter(slack, StandIn(), tmp_path, app_token="")
    with pytest.raises(AccountError, match="app_token"):
        await adapter.start()


async def test_a_token_revoked_while_reconnecting_is_an_error_not_a_loop(slack: FakeSlack, tmp_path: Path) -> None:
    gw = StandIn()
    adapter = _adapter(slack, gw, tmp_path)
    await adapter.start()
    try:
        slack.app_token = "xapp-rotated"  # the old app-level token was revoked
        assert slack.drop()
        await slack.wait_for_async(lambda: not adapter.is_running, 10, "the adapter to give up")
        state, reason = gw.states[-1]
        assert state == "error" and reason is not None and "app_token_env" in reason and "invalid_auth" in reason
        opens = len(slack.calls("apps.connections.open"))
        await asyncio.sleep(1.0)
        assert len(slack.calls("apps.connections.open")) == opens  # no hot loop
    finally:
        slack.app_token = "xapp-fake-app"
        await adapter.stop()
