"""Pairing seen exactly, and "try again later" settled (session 31, fix j).

A stranger's sender id is theirs to choose (a webhook's `sender`): `alice` and `alice` with a
zero-width space were two senders shown as one by `appserver pairing list|approved` and `/pair`,
and `pairing revoke alice` left the look-alike approved without a word. And a fourth stranger,
told "try again later" (every pairing slot taken), had the message kept `held` with no code to
release it: refused later as "pairing code expired before it was approved", or never settled.
"""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

import pytest

from gateway.db import default_path
from gateway.ledger import Ledger, UpdateKey
from tests.fakes.fakechat import FakeChat
from tests.support.cli import run_cli
from tests.support.gateway import channel_server, fakechat_home
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(120)

CODE = r"[A-HJ-NP-Z2-9]{4}-[A-HJ-NP-Z2-9]{4}"
ZWSP = "\u200b"


def _code(text: str) -> str:
    found = re.search(CODE, text)
    assert found, text
    return found.group(0).replace("-", "")


def _state(home: Path, message_id: str) -> tuple[str, str | None]:
    ledger = Ledger.open(default_path(home))
    try:
        entry = ledger.get(UpdateKey("fakechat", "main", message_id))
        return ("missing", None) if entry is None else (entry.state, entry.reason)
    finally:
        ledger.close()


def _approved(home: Path) -> list[str]:
    conn = sqlite3.connect(default_path(home))
    try:
        return sorted(s for (s,) in conn.execute("SELECT sender FROM approved_senders"))
    finally:
        conn.close()


# ---------------------------------------------------------------- what does not show, shown


@pytest.mark.parametrize(
    ("char", "escape"),
    [
        ("\u200b", "\\u200b"),  # zero-width space
        ("\u200c", "\\u200c"),
        ("\u200d", "\\u200d"),
        ("\u2060", "\\u2060"),  # word joiner
        ("\ufeff", "\\ufeff"),  # BOM
        ("\u00ad", "\\xad"),  # soft hyphen
        ("\u202a", "\\u202a"),
        ("\u202e", "\\u202e"),
        ("\u2066", "\\u2066"),
        ("\u2069", "\\u2069"),
        ("\u2028", "\\u2028"),  # line separator
        ("\u2029", "\\u2029"),
        ("\u00a0", "\\xa0"),  # no-break space
        ("\u2003", "\\u2003"),  # em space
        ("\u3000", "\\u3000"),  # ideographic space
        ("\u3164", "\\u3164"),  # Hangul filler
        ("\ufe0f", "\\ufe0f"),  # variation selector
        ("\U000e0041", "\\U000e0041"),  # tag character
    ],
)
def test_exact_escapes_every_character_that_shows_as_nothing(char: str, escape: str) -> None:
    from appserver.cli.safetext import exact, exact_id  # (imported here: the tests below run on older code)
    from gateway.pairing import shown_id

    assert exact(f"alice{char}") == f"alice{escape}"
    assert shown_id(f"alice{char}") == exact_id(f"alice{char}") == f"alice{escape}"


def test_a_shown_id_reads_back_to_that_id_alone() -> None:
    from appserver.cli.safetext import exact, exact_id, typed_id, unseen

    ids = ["alice", f"alice{ZWSP}", "alice\\u200b", "a\\b", "a\\\\b", "C:\\Users\\xavier", "x\u00a0y", "é ok"]
    shown = [exact_id(i) for i in ids]
    assert len(set(shown)) == len(ids), shown  # never two ids printed alike
    assert [typed_id(s) for s in shown] == ids
    assert exact("plain text, é and ü, 中文") == "plain text, é and ü, 中文"  # what shows stays as it is
    assert unseen(f"ali{ZWSP}ce\u00a0x") == unseen("alice x")


# ---------------------------------------------------------------- through the real gateway and CLI


def test_a_look_alike_sender_is_shown_and_can_be_revoked(tmp_path: Path) -> None:
    look_alike = f"alice{ZWSP}"
    with FakeChat() as chat:
        home = fakechat_home(tmp_path / "home", chat, dm_policy="pairing", admins=["boss"])
        with channel_server(home):
            chat.inject("dm-alice", "hi, it's alice", sender="alice", sender_name="Alice")
            chat.inject("dm-x", "hi, it's alice too", sender=look_alike, sender_name="Alice")
            real = _code(chat.wait_for_text("dm-alice", lambda t: "pairing code" in t, timeout=15).text)
            fake = _code(chat.wait_for_text("dm-x", lambda t: "pairing code" in t, timeout=15).text)

            chat.inject("dm-boss", "/pair", sender="boss")
            listed = chat.wait_for_text("dm-boss", lambda t: "Pending pairing requests" in t, timeout=15).text
            lines = {line.split()[0]: line for line in listed.splitlines()[1:]}
            assert "`alice`" in lines[real] and "\\u200b" not in lines[real], listed
            assert "`alice\\u200b`" in lines[fake], listed
            assert ZWSP not in listed

            pending = run_cli(home, "pairing", "list")
            assert pending.code == 0, pending.err
            assert "alice\\u200b" in pending.out and ZWSP not in pending.out, pending.out

            for code in (real, fake):
                assert run_cli(home, "pairing", "approve", code).code == 0
            approved = run_cli(home, "pairing", "approved").out
            assert "alice\\u200b" in approved and ZWSP not in approved, approved

            revoked = run_cli(home, "pairing", "revoke", "alice")
            assert revoked.code == 0, revoked.err
            assert _approved(home) == [look_alike]
            # the owner is told the look-alike is still in, and how to name it
            assert "only by invisible characters" in revoked.out and "alice\\u200b" in revoked.out, revoked.out

            # the form shown is the form typed
            again = run_cli(home, "pairing", "revoke", "alice\\u200b")
            assert again.code == 0, again.err
            assert _approved(home) == []
            assert "Revoked alice\\u200b" in again.out, again.out


def test_try_again_later_settles_the_message_at_once(tmp_path: Path) -> None:
    with FakeChat() as chat:
        home = fakechat_home(tmp_path / "home", chat, dm_policy="pairing")
        with channel_server(home):
            codes = []
            for who in ("s1", "s2", "s3"):
                chat.inject(f"dm-{who}", f"hello {who}", sender=who)
                codes.append(_code(chat.wait_for_text(f"dm-{who}", lambda t: "pairing code" in t, timeout=15).text))
            first = chat.inject("dm-s4", "hello s4", sender="s4")
            chat.wait_for_text("dm-s4", lambda t: "try again later" in t, timeout=15)
            wait_for(lambda: _state(home, first)[0] not in ("missing", "received"), 10, "the access decision")
            assert _state(home, first) == ("denied", "dm: too many pending pairings (3); told to try again later")

            second = chat.inject("dm-s4", "second message", sender="s4")
            wait_for(lambda: _state(home, second)[0] not in ("missing", "received"), 10, "the access decision")
            assert _state(home, second)[0] == "denied"
            assert _state(home, first)[1] == _state(home, second)[1]  # not "pairing code expired…"

            # a slot freed: s4 writing again gets a code, and this message is kept for it
            assert run_cli(home, "pairing", "deny", codes[0]).code == 0
            third = chat.inject("dm-s4", "third message", sender="s4")
            prompt = chat.wait_for_text("dm-s4", lambda t: "pairing code" in t, timeout=15)
            wait_for(lambda: _state(home, third)[0] == "held", 10, "kept for the new code")
            assert run_cli(home, "pairing", "approve", _code(prompt.text)).code == 0
            chat.wait_for_text("dm-s4", "echo: third message", timeout=15)
            assert not any(m.text.startswith("echo: hello s4") for m in chat.messages("dm-s4"))
            assert _state(home, first)[0] == "denied"
