"""A pairing revoked after its approval but before the gateway released the kept messages: revoke
wins (docs/channels.md, "Pairing"). The owner's `pairing approve` then `pairing revoke` (while the
server is stopped, or inside the gateway's one-second look) must not let the stranger in once: their
kept messages are refused, no turn starts, and they are not told "You're approved"."""

from __future__ import annotations

import re
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.db import default_path, open_db
from gateway.ledger import Ledger, UpdateKey
from gateway.pairing import Pairing
from tests.fakes.fakechat import FakeChat
from tests.support.cli import run_cli
from tests.support.gateway import ChannelServer, channel_server, fakechat_home, store_turns
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(120)

CODE = r"[A-HJ-NP-Z2-9]{4}-[A-HJ-NP-Z2-9]{4}"


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


# ---------------------------------------------------------------- the database's side


@pytest.fixture
def db(tmp_path: Path) -> Iterator[sqlite3.Connection]:
    conn = open_db(tmp_path / "gateway.db")
    try:
        yield conn
    finally:
        conn.close()


def test_revoking_an_approval_not_yet_acted_on_ends_its_code(db: sqlite3.Connection) -> None:
    pairing, ledger = Pairing(db), Ledger(db)
    code, _ = pairing.code_for("fakechat", "main", "eve", "Eve", "dm-eve")
    assert code is not None
    kept, _ = ledger.record(UpdateKey("fakechat", "main", "m1"), chat="dm-eve", sender="eve")
    ledger.decide(kept.key, "pair", "dm: unknown sender, pairing required")
    pairing.approve(code.code)
    assert pairing.approval_pending_release("fakechat", "main", "eve")
    before = time.time()
    assert pairing.revoke("eve") == 1
    [decided] = pairing.decided_unhandled()
    assert (decided.code, decided.status) == (code.code, "revoked")
    assert before <= decided.expires_at <= time.time()  # it ended at the revoke, after the kept message
    held = ledger.get(kept.key)
    assert held is not None and held.updated_at <= decided.expires_at
    assert not pairing.is_approved("fakechat", "main", "eve")
    assert not pairing.approval_pending_release("fakechat", "main", "eve")  # new messages do not wait behind it


def test_a_release_asks_the_approval_again_in_its_own_transaction(db: sqlite3.Connection) -> None:
    pairing, ledger = Pairing(db), Ledger(db)
    kept, _ = ledger.record(UpdateKey("fakechat", "main", "m1"), chat="dm-eve", sender="eve")
    ledger.decide(kept.key, "pair", "dm: unknown sender, pairing required")

    def approved() -> bool:
        return pairing.is_approved("fakechat", "main", "eve")

    assert ledger.release_held("fakechat", "main", "eve", "pairing X approved", approved) is None
    assert [e.state for e in ledger.held("fakechat", "main", "eve")] == ["held"]
    code, _ = pairing.code_for("fakechat", "main", "eve", "Eve", "dm-eve")
    assert code is not None
    pairing.approve(code.code)
    released = ledger.release_held("fakechat", "main", "eve", f"pairing {code.code} approved", approved)
    assert released is not None and [(e.key, e.state) for e in released] == [(kept.key, "allowed")]


# ---------------------------------------------------------------- through the real gateway


@pytest.fixture(scope="module")
def chat() -> Iterator[FakeChat]:
    with FakeChat() as fake:
        yield fake


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, chat: FakeChat) -> Iterator[ChannelServer]:
    home = tmp_path_factory.mktemp("pairing-revoke") / "home"
    fakechat_home(home, chat, dm_policy="pairing", admins=["boss"])
    with channel_server(home) as server:
        yield server


def test_an_approval_revoked_while_the_server_was_stopped_lets_nobody_in(tmp_path: Path) -> None:
    with FakeChat() as chat:
        home = fakechat_home(tmp_path / "home", chat, dm_policy="pairing", admins=["boss"])
        with channel_server(home):
            mid = chat.inject("dm-eve", "kept while stopped", sender="eve")
            code = _code(chat.wait_for_text("dm-eve", lambda t: "pairing code" in t, timeout=15).text)
            wait_for(lambda: _state(home, mid)[0] == "held", 10, "kept")
        assert run_cli(home, "pairing", "approve", code).code == 0
        assert run_cli(home, "pairing", "revoke", "eve").code == 0
        with channel_server(home):
            wait_for(lambda: _state(home, mid)[0] == "denied", 15, "the kept message refused")
            time.sleep(1.5)  # a release would have come within the gateway's second
            assert _state(home, mid) == ("denied", "pairing revoked before its kept messages were released")
            assert [m.text for m in chat.messages("dm-eve")][1:] == []  # no "You're approved", nothing at all
            assert store_turns(home, "kept while stopped") == 0
            # revoked is not denied: writing again gets a new code, and its approval lets them in
            again = chat.inject("dm-eve", "second try", sender="eve")
            prompt = chat.wait_for_text("dm-eve", lambda t: "pairing code" in t and code not in _code(t), timeout=15)
            wait_for(lambda: _state(home, again)[0] == "held", 10, "kept for the new code")
            assert run_cli(home, "pairing", "approve", _code(prompt.text)).code == 0
            chat.wait_for_text("dm-eve", "echo: second try", timeout=15)
            assert store_turns(home, "kept while stopped") == 0


def test_an_approval_whose_sender_is_no_longer_approved_releases_nothing(srv: ChannelServer, chat: FakeChat) -> None:
    """Belt and braces: the gateway asks `approved_senders` again when it releases, so an approval row
    left behind by anything (an older revoke, a hand edit) never lets the stranger in."""
    mid = chat.inject("dm-ivy", "kept for an approval taken back", sender="ivy")
    code = _code(chat.wait_for_text("dm-ivy", lambda t: "pairing code" in t, timeout=15).text)
    wait_for(lambda: _state(srv.home, mid)[0] == "held", 10, "kept")
    conn = sqlite3.connect(default_path(srv.home), isolation_level=None)
    try:  # approved, and the sender not among the approved: in one write, so the gateway sees only that
        conn.execute("UPDATE pairing_codes SET status='approved', decided_at=? WHERE code=?", (time.time(), code))
    finally:
        conn.close()
    wait_for(lambda: _state(srv.home, mid)[0] == "denied", 15, "the kept message refused")
    time.sleep(1.0)
    assert [m.text for m in chat.messages("dm-ivy")][1:] == []
    assert store_turns(srv.home, "kept for an approval taken back") == 0
