"""The `telegram` plugin in-process, with the real python-telegram-bot against the loopback fake Bot API
(tests/fakes/telegram_api.py): ledger-first offsets, mapping of updates, formatting, errors."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plugins.contract import Account, AccountError, Adapter, AdapterContext, DeliveryError, InboundMessage, Target
from plugins.loader import load_plugin
from plugins.telegram import TelegramAdapter, create_adapter, plain, to_html
from tests.fakes.telegram_api import EntityParseError, FakeTelegram, parse_html, utf16_len
from tests.support.net import free_port

pytestmark = pytest.mark.timeout(30)

# ---------------------------------------------------------------------- format.py


def shown(markdown: str) -> str:
    """What Telegram shows for our HTML (and it must accept it)."""
    return parse_html(to_html(markdown))


def test_text_is_escaped_outside_tags() -> None:
    assert to_html("a < b && c > d") == "a &lt; b &amp;&amp; c &gt; d"
    assert shown("<b>not bold</b> & <script>") == "<b>not bold</b> & <script>"
    assert to_html("5 > 3 & 2 < 4") == "5 &gt; 3 &amp; 2 &lt; 4"


def test_bold_italic_strike_and_inline_code() -> None:
    assert to_html("**bold** *it* _also_ ~~gone~~") == "<b>bold</b> <i>it</i> <i>also</i> <s>gone</s>"
    assert to_html("`a <b> & c`") == "<code>a &lt;b&gt; &amp; c</code>"
    assert to_html("keep snake_case_names and 2*3*4") == "keep snake_case_names and 2*3*4"
    assert to_html("**bold with `code` inside**") == "<b>bold with <code>code</code> inside</b>"


def test_crossing_markers_never_make_crossing_tags() -> None:
    for text in ("**a *b** c*", "*a **b* c**", "~~a **b~~ c**", "__a _b__ c_"):
        parse_html(to_html(text))  # accepted by Telegram's rules


def test_code_blocks_with_and_without_language() -> None:
    md = "Run:\n```python\nif a < b and c & d:\n    print('<x>')\n```\ndone"
    assert to_html(md) == (
        'Run:\n<pre><code class="language-python">if a &lt; b and c &amp; d:\n'
        "    print('&lt;x&gt;')</code></pre>\ndone"
    )
    assert to_html("```\n**not bold**\n```") == "<pre>**not bold**</pre>"
    assert shown("```\nnever closed <") == "never closed <"  # an open fence runs to the end


def test_links_headings_bullets_quotes() -> None:
    assert (
        to_html("see [the docs](https://x.org/a?b=1&c=2)") == 'see <a href="https://x.org/a?b=1&amp;c=2">the docs</a>'
    )
    assert to_html("[bad](javascript:alert(1))") == "[bad](javascript:alert(1))"
    assert to_html('[q"uote](https://x.org/")') == '<a href="https://x.org/&quot;">q&quot;uote</a>'
    assert to_html("# Title\n- one\n* two") == "<b>Title</b>\n• one\n• two"
    assert to_html("> quoted <x>\n> more\nafter") == "<blockquote>quoted &lt;x&gt;\nmore</blockquote>\nafter"


def test_plain_is_what_telegram_shows() -> None:
    for md in ("**a** < b", "```js\nx && y\n```", "[l](https://e.com/?a=1&b=2)", "plain & simple"):
        assert plain(to_html(md)) == parse_html(to_html(md))


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab *_~`[]()<>&#>-\n\"'/:.")) | st.characters(), max_size=200))
def test_hostile_text_always_parses(text: str) -> None:
    html = to_html(text)
    shown_text = parse_html(html)  # raises EntityParseError when Telegram would refuse it
    assert len(shown_text) <= len(text.replace("\x00", "")) + text.count("\n") + 2
    if text.strip() and text.replace("\x00", "").strip():
        assert shown_text.strip()  # never an empty message (Telegram refuses those)
    if "](" not in text:  # a link's URL is not shown; otherwise every < and & is (escaped, never eaten)
        for ch in "<&":
            assert shown_text.count(ch) == text.count(ch)


def test_the_fake_refuses_what_telegram_refuses() -> None:
    for bad in ("<b>open", "a < b", "x & y", "<b><i>x</b></i>", "<script>x</script>", "</b>"):
        with pytest.raises(EntityParseError):
            parse_html(bad)
    assert parse_html('<a href="https://e.com/?a=1&amp;b=2">x</a> &lt;&#33;') == "x <!"


def test_the_fakes_crash_hooks_run_at_their_step_before_the_client_sees_the_answer() -> None:
    """A crash test kills the bot at the step its hook names, never later: every hook has run before
    the answer it precedes is written, however long it takes (a hook run after the answer, in a worker
    thread, lagged 100 ms and more on a loaded machine, and the client went on meanwhile)."""
    seen: list[str] = []

    def slow(what: str) -> None:
        time.sleep(0.2)  # an answer written before the hook ended would be read first
        seen.append(what)

    with FakeTelegram() as tg:
        tg.on_request = lambda method, params: slow(f"request {method}")
        tg.on_delivery = lambda ids: slow(f"delivery of {len(ids)}")
        tg.on_answer = lambda call: slow(f"answer {call.method} {call.status}, {len(tg.messages(7))} in the chat")
        tg.dm("hi", user_id=7)
        base = f"{tg.url}/bot{tg.token}"
        with httpx.Client(timeout=10) as client:
            assert len(client.post(f"{base}/getUpdates", json={"timeout": 0}).json()["result"]) == 1
            seen.append("the client read the update")
            assert client.post(f"{base}/sendMessage", json={"chat_id": 7, "text": "hello"}).json()["ok"]
            seen.append("the client read the send")
    assert seen == [
        "request getUpdates",
        "delivery of 1",
        "answer getUpdates 200, 0 in the chat",
        "the client read the update",
        "request sendMessage",
        "answer sendMessage 200, 1 in the chat",  # performed: in the chat before its answer leaves
        "the client read the send",
    ]


# ---------------------------------------------------------------------- the adapter against the fake


@dataclass
class Gateway:
    """What the gateway would be: messages handed over (acked unless told otherwise), states reported."""

    tmp: Path
    messages: list[InboundMessage] = field(default_factory=list)
    states: list[tuple[str, str | None]] = field(default_factory=list)
    refuse: Callable[[InboundMessage], bool] = lambda m: False

    async def on_message(self, msg: InboundMessage) -> None:
        self.messages.append(msg)
        if self.refuse(msg):
            raise RuntimeError("ledger unavailable")
        assert msg.ack is not None
        await msg.ack()

    def context(self) -> AdapterContext:
        return AdapterContext(
            on_message=self.on_message,
            report=lambda state, reason: self.states.append((state, reason)),
            data_dir=self.tmp,
            log=logging.getLogger("test.telegram"),
        )

    def state(self) -> str | None:
        return self.states[-1][0] if self.states else None

    async def wait_message(self, pred: Callable[[InboundMessage], bool], timeout: float = 5.0) -> InboundMessage:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for m in self.messages:
                if pred(m):
                    return m
            await asyncio.sleep(0.01)
        raise AssertionError(f"no such message; got {[(m.message_id, m.text) for m in self.messages]}")

    async def wait_state(self, state: str, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.state() == state:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"state {state!r} not reached; states: {self.states}")


@pytest.fixture
def tg() -> Iterator[FakeTelegram]:
    with FakeTelegram() as fake:
        yield fake


@pytest.fixture
def gw(tmp_path: Path) -> Gateway:
    return Gateway(tmp_path)


Start = Callable[..., Awaitable[TelegramAdapter]]


@pytest.fixture
async def start(tg: FakeTelegram, gw: Gateway) -> AsyncIterator[Start]:
    adapters: list[TelegramAdapter] = []

    async def go(token: str | None = None, **settings: Any) -> TelegramAdapter:
        account = Account("telegram", "main", tg.settings(**settings), {"token": token or tg.token})
        adapter = create_adapter(account, gw.context())
        adapters.append(adapter)
        await adapter.start()
        return adapter

    yield go
    for adapter in adapters:
        await adapter.stop()


def test_plugin_loads_as_first_party(tmp_path: Path) -> None:
    create = load_plugin("telegram", tmp_path)
    adapter = create(Account("telegram", "main", {}, {"token": "1:x"}), Gateway(tmp_path).context())
    assert isinstance(adapter, Adapter)
    assert adapter.limits.max_length <= 4096 and adapter.limits.can_edit and adapter.limits.can_react


async def test_missing_token_and_bad_settings_are_account_errors(gw: Gateway) -> None:
    with pytest.raises(AccountError, match="token_env"):
        await create_adapter(Account("telegram", "main", {}, {}), gw.context()).start()
    for bad in ({"api_url": "ftp://x"}, {"poll_timeout": "soon"}, {"edited": "sometimes"}, {"mode": "webhook"}):
        with pytest.raises(AccountError):
            await create_adapter(Account("telegram", "main", bad, {"token": "1:x"}), gw.context()).start()


async def test_a_refused_token_is_an_account_error_naming_the_token(
    tg: FakeTelegram, gw: Gateway, start: Start
) -> None:
    with pytest.raises(AccountError, match=r"refused the bot token.*token_env or token_file"):
        await start(token="999:wrong")
    assert [c.method for c in tg.calls()] == ["getMe"]  # one call, no loop
    assert "999:wrong" not in str(gw.states)


async def test_a_dm_is_handed_over_then_acknowledged_by_offset(tg: FakeTelegram, gw: Gateway, start: Start) -> None:
    adapter = await start()
    assert adapter.username == tg.username and gw.state() == "running"
    assert [c.method for c in tg.calls()][:2] == ["getMe", "deleteWebhook"]
    sent = tg.dm("hello <there>", user_id=4242, first_name="Ann")
    msg = await gw.wait_message(lambda m: m.text == "hello <there>")
    assert (msg.channel, msg.account, msg.chat, msg.chat_type, msg.sender) == ("telegram", "main", "4242", "dm", "4242")
    assert msg.message_id == f"4242:{sent.message_id}" and msg.sender_name == "Ann" and msg.thread is None
    assert not msg.sender_is_bot and msg.ts is not None and abs(msg.ts - time.time()) < 60
    await tg.wait_for_async(lambda: tg.acked(sent), what="the offset to pass the update")
    assert tg.deliveries(sent) == 1


async def test_an_unacknowledged_update_is_redelivered_with_the_same_id(
    tg: FakeTelegram, gw: Gateway, start: Start
) -> None:
    refusals = {"left": 2}

    def refuse(m: InboundMessage) -> bool:
        if m.text == "second" and refusals["left"] > 0:
            refusals["left"] -= 1
            return True
        return False

    gw.refuse = refuse
    await start()
    first, second, third = tg.dm("first"), tg.dm("second"), tg.dm("third")
    await tg.wait_for_async(lambda: tg.acked(third), timeout=10, what="all acknowledged")
    ids = [m.message_id for m in gw.messages if m.text == "second"]
    assert len(ids) == 3 and len(set(ids)) == 1  # redelivered twice, same ledger key
    assert tg.deliveries(first) >= 1 and tg.deliveries(second) == 3
    # the offset never passed "second" before it was acknowledged
    acked_second_at = next(i for i, (offset, _, _) in enumerate(tg.polls()) if offset > second.update_id)
    assert all(second.update_id in ids for _, _, ids in tg.polls()[acked_second_at - 3 : acked_second_at])


async def test_groups_mentions_replies_and_forum_topics(tg: FakeTelegram, gw: Gateway, start: Start) -> None:
    await start()
    group = -1001
    tg.inject(group, "just chatting", kind="supergroup", sender=tg.user(7, "Bob", "bob"))
    tg.inject(group, f"hey @{tg.username} help", kind="supergroup", sender=tg.user(7, "Bob", "bob"))
    plain_msg = await gw.wait_message(lambda m: m.text == "just chatting")
    mention = await gw.wait_message(lambda m: "help" in m.text)
    assert plain_msg.chat_type == "group" and not plain_msg.mentions_bot
    assert mention.mentions_bot and mention.sender == "7" and mention.chat == str(group)


async def test_replies_to_the_bot_and_topics(tg: FakeTelegram, gw: Gateway, start: Start) -> None:
    adapter = await start()
    group = -1002
    tg.inject(group, "hello", kind="supergroup", thread=55)
    topic_msg = await gw.wait_message(lambda m: m.text == "hello")
    assert topic_msg.thread == "55" and topic_msg.reply_to is None
    [bot_id] = await adapter.send(Target(str(group), thread="55"), "answer in the topic")
    assert tg.message(group, int(bot_id)).thread == 55
    tg.inject(group, "thanks", kind="supergroup", thread=55, reply_to=int(bot_id))
    reply = await gw.wait_message(lambda m: m.text == "thanks")
    assert reply.mentions_bot and reply.reply_to == f"{group}:{bot_id}" and reply.thread == "55"
    # a reply in a group is threaded under the message it answers; in a DM it is not needed
    [second] = await adapter.send(Target(str(group), thread="55", reply_to=reply.message_id), "you're welcome")
    assert tg.message(group, int(second)).reply_to == int(reply.message_id.split(":")[1])


async def test_a_photo_reaches_the_gateway_as_an_image_and_a_document_as_a_file(
    tg: FakeTelegram, gw: Gateway, start: Start
) -> None:
    await start()
    picture = b"\xff\xd8\xff\xe0" + bytes(range(256)) * 40
    tg.dm(None, photo=picture, caption="what is this?", user_id=5)  # type: ignore[arg-type]
    tg.dm(None, document=("report.pdf", "application/pdf", b"%PDF-1.4 ..."), user_id=5)  # type: ignore[arg-type]
    photo = await gw.wait_message(lambda m: m.text == "what is this?")
    [image] = photo.attachments
    assert image.kind == "image" and image.mime == "image/jpeg" and image.data == picture and image.size == len(picture)
    assert [c.params["file_id"] for c in tg.calls("getFile")] == [tg_largest_file_id(photo)]
    doc = await gw.wait_message(lambda m: bool(m.attachments) and m.attachments[0].kind == "file")
    [file] = doc.attachments
    assert (file.name, file.mime, file.size, file.data) == ("report.pdf", "application/pdf", 12, None)


def tg_largest_file_id(msg: InboundMessage) -> str:
    sizes = msg.raw["message"]["photo"]
    return str(max(sizes, key=lambda p: p["file_size"])["file_id"])


async def test_edited_messages_are_ignored_or_new(tg: FakeTelegram, gw: Gateway, start: Start) -> None:
    await start(edited="new")
    sent = tg.dm("frist")
    first = await gw.wait_message(lambda m: m.text == "frist")
    edit = tg.edit_user_message(sent.chat_id, int(sent.message_id or 0), "first")
    again = await gw.wait_message(lambda m: m.text == "first")
    assert again.message_id == f"{first.message_id}:u{edit.update_id}"
    await tg.wait_for_async(lambda: tg.acked(edit))


async def test_two_edits_in_one_second_are_two_messages_each_with_a_stable_key(
    tg: FakeTelegram, gw: Gateway, start: Start
) -> None:
    """`edit_date` has whole seconds: keyed by it, the second of two quick edits was taken for a
    redelivery of the first and dropped. Keyed by the update id, each edit is its own message, and a
    redelivered edit keeps its key."""
    refused = {"left": 1}

    def refuse_once(m: InboundMessage) -> bool:
        if m.text == "third" and refused["left"]:
            refused["left"] -= 1
            return True
        return False

    gw.refuse = refuse_once
    await start(edited="new")
    sent = tg.dm("frist")
    first = await gw.wait_message(lambda m: m.text == "frist")
    while time.time() % 1 > 0.5:  # both edits well inside one second
        await asyncio.sleep(0.01)
    edits = [tg.edit_user_message(sent.chat_id, int(sent.message_id or 0), text) for text in ("first", "third")]
    await tg.wait_for_async(lambda: tg.acked(edits[1]), timeout=10, what="both edits acknowledged")
    one = await gw.wait_message(lambda m: m.text == "first")
    two = [m for m in gw.messages if m.text == "third"]
    assert one.raw["edited_message"]["edit_date"] == two[0].raw["edited_message"]["edit_date"]  # the same second
    assert len(two) == 2 and two[0].message_id == two[1].message_id  # redelivered under the same key
    assert len({first.message_id, one.message_id, two[0].message_id}) == 3


async def test_edits_are_ignored_by_default(tg: FakeTelegram, gw: Gateway, start: Start) -> None:
    await start()
    sent = tg.dm("frist")
    await gw.wait_message(lambda m: m.text == "frist")
    edit = tg.edit_user_message(sent.chat_id, int(sent.message_id or 0), "first")
    await tg.wait_for_async(lambda: tg.acked(edit))
    assert [m.text for m in gw.messages] == ["frist"]


async def test_send_edit_typing_react(tg: FakeTelegram, gw: Gateway, start: Start) -> None:
    adapter = await start()
    sent = tg.dm("hi", user_id=77)
    inbound = await gw.wait_message(lambda m: m.text == "hi")
    target = Target("77", reply_to=inbound.message_id)
    [mid] = await adapter.send(target, adapter.format("**Hello** <you> & co"))
    msg = tg.message(77, int(mid))
    assert msg.text == "Hello <you> & co" and msg.parse_mode == "HTML" and msg.reply_to is None  # DMs: no reply
    await adapter.edit(target, mid, adapter.format("**Hello** <you> & co, more"))
    await adapter.edit(target, mid, adapter.format("**Hello** <you> & co, more"))  # not modified: fine
    assert tg.message(77, int(mid)).history == ["Hello <you> & co", "Hello <you> & co, more"]
    await adapter.typing(target)
    assert tg.calls("sendChatAction")[-1].params["action"] == "typing"
    await adapter.react(target, inbound.message_id, "👀")
    assert tg.reactions(77, int(sent.message_id or 0)) == ["👀"]


async def test_refused_formatting_is_resent_as_the_plain_original(tg: FakeTelegram, gw: Gateway, start: Start) -> None:
    adapter = await start()
    tg.dm("x", user_id=88)
    await gw.wait_message(lambda m: m.text == "x")
    original = "**Total** < 5 & done"
    tg.fail_next("sendMessage", 400, description='Bad Request: can\'t parse entities: Unsupported start tag "x"')
    [mid] = await adapter.send(Target("88"), adapter.format(original))
    msg = tg.message(88, int(mid))
    assert msg.text == original and msg.parse_mode is None
    # HTML we did not produce (a plugin user's own): the text Telegram would have shown
    [mid2] = await adapter.send(Target("88"), "<b>broken")
    assert tg.message(88, int(mid2)).text == "broken"


async def _reply(adapter: TelegramAdapter, chat: str, text: str, *, stream: bool = False) -> list[str]:
    """`text` delivered to a DM as the gateway delivers a turn's reply (split, formatted, sent)."""
    from gateway.delivery import Outbox, ReplySink
    from gateway.ratelimit import ChatRateLimiter

    sink = ReplySink(Outbox(adapter, ChatRateLimiter(50.0, 50), asyncio.sleep), Target(chat), stream=stream)
    sink.interval = 0.0
    if stream:
        await sink.show(text[: len(text) // 2])
    return await sink.finish(text)


async def test_a_reply_is_split_by_what_telegram_shows_not_by_its_html(
    tg: FakeTelegram, gw: Gateway, start: Start
) -> None:
    """Telegram's 4,096 counts the text after entity parsing (`&amp;` is one character): 4,000 `&`
    are one message, not seven; and however the markup and the escapes fall, no part is longer than
    Telegram takes (the fake refuses those as Telegram does)."""
    adapter = await start()
    for chat in (71, 72):
        tg.dm("hi", user_id=chat)  # the bot may write to people who wrote to it
    await gw.wait_message(lambda m: m.chat == "72")
    assert adapter.measure(adapter.format("**a** & <b> 😀")) == utf16_len("a & <b> 😀") == 10
    [one] = await _reply(adapter, "71", "&" * 4000)
    assert tg.message(71, int(one)).text == "&" * 4000
    line = "x < y && **z** > `<w>` 😀😀 & [l](https://e.org/?a=1&b=2) <&>\n"
    text = line * 400  # 25,600 characters of Markdown, about twice as many of HTML
    ids = await _reply(adapter, "72", text, stream=True)
    shown = [tg.message(72, int(i)).text for i in ids]
    assert all(utf16_len(t) <= 4096 for t in shown)
    # no more parts than the Markdown itself makes at the split length (the HTML source made 12)
    assert len(ids) <= len(text) // adapter.limits.max_length + 1, (len(ids), [utf16_len(t) for t in shown])


async def test_a_refused_part_falls_back_to_text_that_fits(tg: FakeTelegram, gw: Gateway, start: Start) -> None:
    """A part is measured as Telegram shows it, so its Markdown (markup, link URLs) may be longer than
    Telegram takes: when Telegram refuses the HTML, the fallback is then the shown text, which fits."""
    adapter = await start()
    tg.dm("hi", user_id=73)
    await gw.wait_message(lambda m: m.chat == "73")
    text = "**😀😀** " * 560  # one part: 3,920 characters; shown 2,800 UTF-16 units, the Markdown 5,040
    assert utf16_len(parse_html(to_html(text))) < 4096 < utf16_len(text)
    tg.fail_next("sendMessage", 400, description="Bad Request: can't parse entities: Unsupported start tag")
    [mid] = await _reply(adapter, "73", text)
    msg = tg.message(73, int(mid))
    assert msg.parse_mode is None and msg.text == "😀😀 " * 560


async def test_errors_become_delivery_errors(tg: FakeTelegram, gw: Gateway, start: Start) -> None:
    adapter = await start()
    tg.dm("x", user_id=99)
    await gw.wait_message(lambda m: m.text == "x")
    tg.fail_next("sendMessage", 429, retry_after=3)
    with pytest.raises(DeliveryError) as limited:
        await adapter.send(Target("99"), "hi")
    assert limited.value.retry_after == 3 and not limited.value.permanent
    with pytest.raises(DeliveryError) as unknown:
        await adapter.send(Target("123456"), "hi")
    assert unknown.value.permanent and "chat not found" in unknown.value.reason.lower()
    tg.block(99, "Forbidden: bot was blocked by the user")
    with pytest.raises(DeliveryError) as blocked:
        await adapter.send(Target("99"), "hi")
    assert blocked.value.permanent and "blocked" in blocked.value.reason
    tg.fail_next("editMessageText", 502)
    with pytest.raises(DeliveryError) as flaky:
        await adapter.edit(Target("99"), "1", "x")
    assert not flaky.value.permanent and flaky.value.retry_after is None


async def test_conflict_is_reported_and_recovers(tg: FakeTelegram, gw: Gateway, start: Start) -> None:
    await start()
    await gw.wait_state("running")
    tg.other_poller(True)
    await gw.wait_state("conflict")
    assert "409" in (gw.states[-1][1] or "")
    tg.other_poller(False)
    await gw.wait_state("running", timeout=8)
    sent = tg.dm("after the conflict")
    await gw.wait_message(lambda m: m.text == "after the conflict")
    await tg.wait_for_async(lambda: tg.acked(sent))


async def test_network_errors_back_off_and_recover(gw: Gateway, tmp_path: Path) -> None:
    port = free_port()
    account = Account("telegram", "main", {"api_url": f"http://127.0.0.1:{port}", "poll_timeout": 1}, {"token": "1:x"})
    adapter = create_adapter(account, gw.context())
    await adapter.start()  # unreachable: not a configuration error; the loop retries
    try:
        assert adapter.is_running and gw.state() == "backoff"
        await asyncio.sleep(1.2)
        backoffs = [s for s in gw.states if s[0] == "backoff"]
        assert 2 <= len(backoffs) <= 4, backoffs  # backing off, not hot looping
        with FakeTelegram(token="1:x", port=port) as tg:  # the network is back
            await gw.wait_state("running", timeout=8)
            sent = tg.dm("back online")
            await gw.wait_message(lambda m: m.text == "back online")
            await tg.wait_for_async(lambda: tg.acked(sent))
            await adapter.stop()
    finally:
        await adapter.stop()


async def test_a_token_revoked_while_polling_stops_with_an_error(tg: FakeTelegram, gw: Gateway, start: Start) -> None:
    adapter = await start()
    tg.revoke_token()
    await gw.wait_state("error")
    assert "refused the bot token" in (gw.states[-1][1] or "")
    await asyncio.sleep(0.3)
    assert not adapter.is_running


async def test_approval_buttons_come_back_as_commands(tg: FakeTelegram, gw: Gateway, start: Start) -> None:
    adapter = await start()
    group = -1003
    tg.inject(group, "go", kind="supergroup", thread=9)
    await gw.wait_message(lambda m: m.text == "go")
    [prompt_id] = await adapter.prompt_approval(Target(str(group), "9"), "🔐 use **clock**?", "ab12cd34")
    prompt = tg.message(group, int(prompt_id))
    assert prompt.text == "🔐 use clock?" and prompt.thread == 9
    buttons = [b["callback_data"] for row in (prompt.reply_markup or {})["inline_keyboard"] for b in row]
    assert buttons == ["approve:ab12cd34", "deny:ab12cd34"]
    pressed = tg.press(group, int(prompt_id), "approve:ab12cd34", sender=tg.user(7, "Bob", "bob"))
    cmd = await gw.wait_message(lambda m: m.text.startswith("/approve"))
    assert cmd.text == "/approve ab12cd34" and cmd.sender == "7" and cmd.chat == str(group) and cmd.thread == "9"
    assert cmd.message_id == f"cb:{pressed.callback_id}"
    answered = await tg.wait_for_async(
        lambda: tg.callback_answer(pressed.callback_id or "") is not None, what="answerCallbackQuery"
    )
    assert answered and not (tg.callback_answer(pressed.callback_id or "") or {}).get("text")  # neutral: no toast
    # the gateway then edits the prompt to show the outcome; the buttons go with the edit
    await adapter.edit(Target(str(group), "9"), prompt_id, adapter.format("🔐 use clock?\n✅ Approved by Bob"))
    assert tg.message(group, int(prompt_id)).reply_markup is None


async def test_stop_confirms_the_last_offset(tg: FakeTelegram, gw: Gateway, start: Start) -> None:
    adapter = await start(poll_timeout=5)
    sent = tg.dm("last words")
    await gw.wait_message(lambda m: m.text == "last words")
    await asyncio.sleep(0.05)
    await adapter.stop()
    assert tg.acked(sent) and tg.pending() == []


async def test_privacy_mode_shows_the_bot_only_what_is_addressed_to_it(gw: Gateway, tmp_path: Path) -> None:
    with FakeTelegram(privacy_mode=True) as tg:
        account = Account("telegram", "main", tg.settings(), {"token": tg.token})
        adapter = create_adapter(account, gw.context())
        await adapter.start()
        try:
            tg.inject(-1004, "small talk", kind="group")
            tg.inject(-1004, f"@{tg.username} ping", kind="group")
            tg.inject(-1004, "/status@" + tg.username, kind="group")
            await gw.wait_message(lambda m: m.text.startswith("/status"))
            assert [(m.text, m.mentions_bot) for m in gw.messages] == [
                (f"@{tg.username} ping", True),
                (f"/status@{tg.username}", True),
            ]
        finally:
            await adapter.stop()


async def test_a_refused_token_names_the_variable_it_came_from(tg: FakeTelegram, gw: Gateway) -> None:
    account = Account(
        "telegram", "main", tg.settings(), {"token": "999:wrong"}, {"token": "environment variable TG_TOKEN"}
    )
    with pytest.raises(AccountError, match=r"refused the bot token \(from environment variable TG_TOKEN\)"):
        await create_adapter(account, gw.context()).start()


def test_a_code_span_inside_a_link_keeps_its_text_and_url() -> None:
    from plugins.telegram.format import to_html

    assert to_html("See [`config.toml`](https://example.org/docs)") == (
        'See <a href="https://example.org/docs">config.toml</a>'
    )
    assert to_html("[docs](https://example.org/a`b`c)") == '<a href="https://example.org/a`b`c">docs</a>'


async def test_an_update_the_library_cannot_parse_is_skipped_not_fatal(tg: FakeTelegram, gw: Gateway) -> None:
    """Bot API drift: one update this library version rejects must not stop every later one."""
    adapter = create_adapter(Account("telegram", "main", tg.settings(), {"token": tg.token}), gw.context())
    await adapter.start()
    try:
        chat = {"id": 42, "type": "private", "first_name": "A"}
        user = {"id": 42, "is_bot": False, "first_name": "A"}
        poll = {
            "id": "p",
            "question": "q?",
            "options": [{"text": "a", "voter_count": 0}],
            "total_voter_count": 0,
            "is_closed": False,
            "is_anonymous": True,
            "type": "regular",
            "allows_multiple_answers": False,
        }
        with tg._lock:
            for body in ({"poll": poll}, {"text": "a normal message after it"}):
                n = tg._next_update_id
                message = {"message_id": n, "chat": chat, "from": user, "date": int(time.time()), **body}
                tg._updates.append({"update_id": n, "message": message})
                tg._next_update_id += 1
        tg._notify()
        await gw.wait_message(lambda m: m.text == "a normal message after it", timeout=10)
        assert adapter.is_running
    finally:
        await adapter.stop()
