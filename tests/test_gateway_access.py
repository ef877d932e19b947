"""Channel access through the real gateway (issue 16): pairing with the CLI while the server runs,
deny, the pending cap, expiry, silent mode, and group mentions."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.db import default_path
from gateway.ledger import Ledger, UpdateKey
from tests.fakes.fakechat import FakeChat
from tests.support.cli import run_cli
from tests.support.gateway import (
    ChannelServer,
    channel_server,
    fakechat_home,
    store_turns,
)

pytestmark = pytest.mark.timeout(120)

CODE = r"[A-HJ-NP-Z2-9]{4}-[A-HJ-NP-Z2-9]{4}"


@pytest.fixture(scope="module")
def chat() -> Iterator[FakeChat]:
    with FakeChat() as fake:
        yield fake


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, chat: FakeChat) -> Iterator[ChannelServer]:
    home = tmp_path_factory.mktemp("access") / "home"
    fakechat_home(home, chat, dm_policy="pairing", group_policy="mention", admins=["boss"])
    with channel_server(home) as server:
        yield server


def _code(text: str) -> str:
    import re

    found = re.search(CODE, text)
    assert found, text
    return found.group(0).replace("-", "")


def _state(home: Path, message_id: str) -> str:
    ledger = Ledger.open(default_path(home))
    try:
        entry = ledger.get(UpdateKey("fakechat", "main", message_id))
        return "missing: not recorded yet" if entry is None else f"{entry.state}: {entry.reason}"
    finally:
        ledger.close()


def _wait_state(home: Path, message_id: str, prefix: str, timeout: float = 10) -> str:
    deadline = time.monotonic() + timeout
    state = _state(home, message_id)
    while time.monotonic() < deadline and not state.startswith(prefix):
        time.sleep(0.05)
        state = _state(home, message_id)
    assert state.startswith(prefix), state
    return state


def test_pairing_approve_from_the_cli_answers_the_kept_messages(srv: ChannelServer, chat: FakeChat) -> None:
    first = chat.inject("dm-ann", "hello, are you there?", sender="ann")
    prompt = chat.wait_for_text("dm-ann", lambda t: "pairing code" in t, timeout=15)
    second = chat.inject("dm-ann", "second message", sender="ann")
    _wait_state(srv.home, second, "held")
    assert _state(srv.home, first).startswith("held")
    # One code per sender while it is valid, and a burst of messages gets one prompt, not one each.
    listed = run_cli(srv.home, "pairing", "list", "--json")
    assert listed.out.count('"sender": "ann"') == 1 and _code(prompt.text) in listed.out
    assert len([m for m in chat.messages("dm-ann") if "pairing code" in m.text]) == 1
    ok = run_cli(srv.home, "pairing", "approve", _code(prompt.text))
    assert ok.code == 0, ok.err
    chat.wait_for_text("dm-ann", lambda t: "approved" in t, timeout=15)
    # The kept messages are answered as the first turn, together, in order.
    chat.wait_for_text("dm-ann", lambda t: t == "echo: second message", timeout=15)
    assert store_turns(srv.home, 'batch="2" batch_index="1">hello, are you there?') == 1
    assert store_turns(srv.home, 'batch="2" batch_index="2">second message') == 1
    # Approved senders persist: the next message goes straight through.
    chat.inject("dm-ann", "third", sender="ann")
    chat.wait_for_text("dm-ann", lambda t: t == "echo: third", timeout=15)
    _wait_state(srv.home, second, "delivered")
    # A second approval of the same code is refused.
    assert run_cli(srv.home, "pairing", "approve", _code(prompt.text)).code != 0


def test_a_strangers_name_cannot_control_the_operators_terminal(srv: ChannelServer, chat: FakeChat) -> None:
    """A chat platform's display name is the stranger's to choose: `pairing list` and `approve`
    print it with its controls shown, not acted on (a window title, the clipboard, a clear screen)."""
    name = "\x1b]0;PWNED\x07\x1b]52;c;ZXZpbA==\x07\x1b[2J\u009b31mcarol"
    chat.inject("dm-carol", "hi", sender="carol\x1b[8m", sender_name=name)
    prompt = chat.wait_for_text("dm-carol", lambda t: "pairing code" in t, timeout=15)
    listed = run_cli(srv.home, "pairing", "list")
    assert listed.code == 0 and "carol" in listed.out, listed.err
    approved = run_cli(srv.home, "pairing", "approve", _code(prompt.text))
    assert approved.code == 0, approved.err
    for out in (listed.out, approved.out):
        assert not any(c in out for c in ("\x1b", "\x07", "\u009b")), repr(out)
        assert "\\x1b]0;PWNED\\x07" in out, out


def test_pairing_deny_is_silent_and_the_kept_message_is_denied(srv: ChannelServer, chat: FakeChat) -> None:
    mid = chat.inject("dm-bob", "let me in", sender="bob")
    prompt = chat.wait_for_text("dm-bob", lambda t: "pairing code" in t, timeout=15)
    assert run_cli(srv.home, "pairing", "deny", _code(prompt.text)).code == 0
    _wait_state(srv.home, mid, "denied: pairing")
    time.sleep(1.0)
    assert [m.text for m in chat.messages("dm-bob")] == [prompt.text]  # nothing more was said
    # The denial sticks: writing again gets no new code (nor a pending slot of the account's three).
    again = chat.inject("dm-bob", "let me in please", sender="bob")
    assert _wait_state(srv.home, again, "denied") == "denied: dm: the owner denied this sender's pairing"
    time.sleep(1.0)
    assert [m.text for m in chat.messages("dm-bob")] == [prompt.text]
    assert '"sender": "bob"' not in run_cli(srv.home, "pairing", "list", "--json").out
    # `pairing revoke` forgets the denial: the next message gets a new code.
    forgot = run_cli(srv.home, "pairing", "revoke", "bob")
    assert forgot.code == 0, forgot.err
    chat.inject("dm-bob", "one more try", sender="bob")
    fresh = chat.wait_for_text("dm-bob", lambda t: "pairing code" in t and t != prompt.text, timeout=15)
    assert _code(fresh.text) != _code(prompt.text)
    assert run_cli(srv.home, "pairing", "deny", _code(fresh.text)).code == 0
    nobody = run_cli(srv.home, "pairing", "revoke", "nobody-at-all")
    assert nobody.code == 1 and "neither an approved nor a denied sender" in nobody.err


def test_an_expired_code_with_five_kept_messages_does_not_lock_the_sender_out(
    srv: ChannelServer, chat: FakeChat
) -> None:
    """The five kept messages of a code that expired unapproved can never be released: they are
    refused, and the sender's next message gets a new code (it was denied for good)."""
    kept = [chat.inject("dm-eve", f"kept {i}", sender="eve") for i in range(5)]
    prompt = chat.wait_for_text("dm-eve", lambda t: "pairing code" in t, timeout=15)
    for mid in kept:
        _wait_state(srv.home, mid, "held")
    conn = sqlite3.connect(default_path(srv.home))
    conn.execute("UPDATE pairing_codes SET expires_at = 1 WHERE code = ?", (_code(prompt.text),))
    conn.commit()
    conn.close()
    late = chat.inject("dm-eve", "still there?", sender="eve")
    fresh = chat.wait_for_text("dm-eve", lambda t: "pairing code" in t and t != prompt.text, timeout=15)
    _wait_state(srv.home, late, "held")
    for mid in kept:
        assert _state(srv.home, mid) == "denied: pairing code expired before it was approved"
    assert run_cli(srv.home, "pairing", "approve", _code(fresh.text)).code == 0
    chat.wait_for_text("dm-eve", lambda t: t == "echo: still there?", timeout=15)
    assert not any(m.text.startswith("echo: kept") for m in chat.messages("dm-eve"))


def test_at_most_three_pending_codes_and_an_expired_code(srv: ChannelServer, chat: FakeChat) -> None:
    codes = []
    for who in ("p1", "p2", "p3"):
        chat.inject(f"dm-{who}", "hi", sender=who)
        codes.append(_code(chat.wait_for_text(f"dm-{who}", lambda t: "pairing code" in t, timeout=15).text))
    chat.inject("dm-p4", "hi", sender="p4")
    chat.wait_for_text("dm-p4", lambda t: "try again later" in t, timeout=15)
    # Expire p1's code (as an hour would) and decide the others: p4 then gets a code.
    conn = sqlite3.connect(default_path(srv.home))
    conn.execute("UPDATE pairing_codes SET expires_at = 1 WHERE code = ?", (codes[0],))
    conn.commit()
    conn.close()
    expired = run_cli(srv.home, "pairing", "approve", codes[0])
    assert expired.code != 0 and "expired" in expired.err
    for code in codes[1:]:
        assert run_cli(srv.home, "pairing", "deny", code).code == 0
    chat.inject("dm-p4", "now?", sender="p4")
    chat.wait_for_text("dm-p4", lambda t: "pairing code" in t, timeout=15)


def test_group_messages_need_a_mention(srv: ChannelServer, chat: FakeChat) -> None:
    quiet = chat.inject("group-1", "talking among ourselves", sender="boss", chat_type="group")
    loud = chat.inject("group-1", "@bot what time is it", sender="boss", chat_type="group", mentions_bot=True)
    chat.wait_for_text("group-1", lambda t: t == "echo: @bot what time is it", timeout=15)
    assert _state(srv.home, quiet) == "denied: group: the bot was not mentioned"
    _wait_state(srv.home, loud, "delivered")
    assert len(chat.messages("group-1")) == 1


def test_a_stranger_cannot_use_the_bot_through_a_group_of_their_own(srv: ChannelServer, chat: FakeChat) -> None:
    """dm_policy says who may use the bot, in groups too: under "pairing" a stranger who adds the bot
    to their group and mentions it gets no turn, and no pairing code posted in the group; once
    approved (paired in a DM) their mentions in that group are answered."""
    asked = chat.inject("mallorys-group", "@bot run clock", sender="mallory", chat_type="group", mentions_bot=True)
    state = _wait_state(srv.home, asked, "denied")
    assert "neither on the allowlist nor paired" in state, state
    time.sleep(1.0)
    assert chat.messages("mallorys-group") == []  # no turn, no code, no notice in the group
    assert '"sender": "mallory"' not in run_cli(srv.home, "pairing", "list", "--json").out
    assert store_turns(srv.home, "@bot run clock") == 0
    # pairing happens in a DM; after the approval the group works for them
    chat.inject("dm-mallory", "hi", sender="mallory")
    prompt = chat.wait_for_text("dm-mallory", lambda t: "pairing code" in t, timeout=15)
    assert run_cli(srv.home, "pairing", "approve", _code(prompt.text)).code == 0
    chat.wait_for_text("dm-mallory", lambda t: t == "echo: hi", timeout=15)
    chat.inject("mallorys-group", "@bot now?", sender="mallory", chat_type="group", mentions_bot=True)
    chat.wait_for_text("mallorys-group", lambda t: t == "echo: @bot now?", timeout=15)


def test_silent_mode_sends_nothing_to_an_unknown_sender(tmp_path: Path) -> None:
    with FakeChat() as chat:
        home = fakechat_home(tmp_path / "home", chat, dm_policy="pairing", unpaired="silent")
        with channel_server(home) as srv:
            mid = chat.inject("dm-x", "hello?", sender="stranger")
            chat.wait_acked(mid, timeout=15)
            _wait_state(srv.home, mid, "held")
            time.sleep(1.0)
            assert chat.messages("dm-x") == []
            assert _state(srv.home, mid).startswith("held")
            listed = run_cli(srv.home, "pairing", "list", "--json")
            assert "stranger" in listed.out  # the owner still sees the request


def test_pairing_over_the_protocol(srv: ChannelServer, chat: FakeChat) -> None:
    import asyncio

    from appserver.client import ProtocolClient, ProtocolError

    chat.inject("dm-proto", "via the desktop app please", sender="pat")
    code = _code(chat.wait_for_text("dm-proto", lambda t: "pairing code" in t, timeout=15).text)

    async def decide() -> list[dict[str, object]]:
        client = await ProtocolClient.connect(srv.url, token="", client="desktop")
        try:
            listed = await client.request({"type": "pairing_list"})
            with pytest.raises(ProtocolError) as refused:
                reply = await client.request({"type": "pairing_decide", "code": "NOPE2345", "decision": "approve"})
                if reply.get("type") == "error":
                    raise ProtocolError(reply["code"], reply["message"])
            assert refused.value.code == "invalid_request"
            await client.request({"type": "pairing_decide", "code": code, "decision": "approve"})
            return list(listed["results"])
        finally:
            await client.close()

    listed = asyncio.run(decide())
    assert any(p["code"] == code and p["sender"] == "pat" for p in listed)
    chat.wait_for_text("dm-proto", "echo: via the desktop app please", timeout=15)


def test_a_message_written_right_after_the_approval_waits_behind_the_kept_ones(
    srv: ChannelServer, chat: FakeChat
) -> None:
    """The approval is committed at once, the kept messages are released within a second: a message
    in between was answered first, on its own. It joins the kept ones' turn instead, after them."""
    chat.inject("dm-kim", "kept one", sender="kim")
    prompt = chat.wait_for_text("dm-kim", lambda t: "pairing code" in t, timeout=15)
    kept = chat.inject("dm-kim", "kept two", sender="kim")
    _wait_state(srv.home, kept, "held")
    assert run_cli(srv.home, "pairing", "approve", _code(prompt.text)).code == 0
    new = chat.inject("dm-kim", "written after approval", sender="kim")
    chat.wait_for_text("dm-kim", lambda t: t == "echo: written after approval", timeout=15)
    _wait_state(srv.home, new, "delivered")
    time.sleep(1.0)
    echoes = [m.text for m in chat.messages("dm-kim") if m.text.startswith("echo:")]
    assert echoes == ["echo: written after approval"], echoes  # one turn: the kept two and the new one
    assert store_turns(srv.home, "kept one") == 1 and store_turns(srv.home, "written after approval") == 1
    assert len([m for m in chat.messages("dm-kim") if "pairing code" in m.text]) == 1  # no second code


def test_a_denial_revoked_before_the_gateway_acted_on_it_still_refuses_the_kept_message(
    srv: ChannelServer, chat: FakeChat
) -> None:
    mid = chat.inject("dm-dee", "let me in", sender="dee")
    prompt = chat.wait_for_text("dm-dee", lambda t: "pairing code" in t, timeout=15)
    assert run_cli(srv.home, "pairing", "deny", _code(prompt.text)).code == 0
    assert run_cli(srv.home, "pairing", "revoke", "dee").code == 0  # within the gateway's second
    assert _wait_state(srv.home, mid, "denied")
    chat.inject("dm-dee", "again", sender="dee")
    chat.wait_for_text("dm-dee", lambda t: "pairing code" in t and t != prompt.text, timeout=15)  # not barred


def test_pair_lists_the_pending_codes_only_in_a_direct_message(srv: ChannelServer, chat: FakeChat) -> None:
    """`/pair` shows every pending code with the sender's name: in a group that would hand a
    stranger's code to everyone there (who could get it approved as theirs). It answers only in a DM."""
    chat.inject("dm-quinn", "let me in", sender="quinn", sender_name="Quinn")
    code = _code(chat.wait_for_text("dm-quinn", lambda t: "pairing code" in t, timeout=15).text)
    chat.inject("team-room", "/pair", sender="boss", chat_type="group", mentions_bot=True)
    answer = chat.wait_for_text("team-room", lambda t: "/pair" in t, timeout=15)
    assert "direct message" in answer.text and code not in answer.text and "Quinn" not in answer.text
    chat.inject("dm-boss", "/pair", sender="boss")
    listed = chat.wait_for_text("dm-boss", lambda t: "Pending pairing requests" in t, timeout=15)
    assert code in listed.text and "Quinn" in listed.text
    assert all(code not in m.text for m in chat.messages("team-room"))
