"""Session 31 (p): bracketed paste on a slow link, Ctrl-C in a paste, and ids in another Unicode form.

* A paste marker split across two reads more than 50 ms apart (`...\\x1b`, then `[201~`) was
  abandoned as the Escape key: an end marker left the paste open for good (Enter a newline of it,
  nothing sent again), a start marker let each pasted line run as typed, a pasted `/new` as a command.
* Ctrl-C during a paste closed it: the rest of the paste ran as typed lines and commands.
* `josé` (NFC) and `jose` with a combining acute (NFD) were two approved senders printed as one.

`appserver chat` runs in a pseudo-terminal against a real `serve` (the echo model); pairing runs
the real CLI and gateway against the fake chat platform.
"""

from __future__ import annotations

import json
import re
import sqlite3
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.db import default_path
from tests.fakes.fakechat import FakeChat
from tests.support.cli import cli_env, run_cli
from tests.support.gateway import channel_server, fakechat_home
from tests.test_chat_terminal import Pty, rows

pytestmark = pytest.mark.timeout(60)

PASTE_START, PASTE_END = "\x1b[200~", "\x1b[201~"
APART = 0.2  # seconds between two writes: two reads, well beyond chat's 50 ms wait for an ESC's rest
QUIET = 1.0  # LineEditor.PASTE_QUIET
NFC, NFD = "jos\u00e9", "jose\u0301"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, str]]]:
    from tests.support.serve import serving

    home = tmp_path_factory.mktemp("chat31p") / "home"
    env = cli_env(home)
    with serving(home, env=env):
        yield home, env


def chat(env: dict[str, str]) -> tuple[Pty, str]:
    """A chat on a new conversation, at its prompt; and the conversation's id."""
    p = Pty([sys.executable, "-m", "appserver", "chat", "--conversation", "new"], env)
    banner = p.expect("you> ")
    found = re.search(r"conversation (conv_\w+)", banner)
    assert found is not None, banner
    return p, found.group(1)


def user_messages(home: Path, conv: str) -> list[str]:
    return [
        json.loads(c)
        for (c,) in rows(
            home, f"SELECT content FROM messages WHERE conversation_id='{conv}' AND role='user' ORDER BY id"
        )
    ]


def conversations(home: Path) -> int:
    return int(rows(home, "SELECT count(*) FROM conversations")[0][0])


def test_a_paste_end_marker_split_across_slow_reads_ends_the_paste(server: tuple[Path, dict[str, str]]) -> None:
    home, env = server
    p, conv = chat(env)
    try:
        # its ESC ends one read, `[201~` comes 200 ms later
        p.write(PASTE_START + "line one\rline two\x1b")
        time.sleep(APART)
        p.write("[201~")
        time.sleep(APART)
        p.write("\r")  # the Enter after the paste sends it
        p.expect("echo: line one", timeout=5)
        p.expect("you> ", timeout=5)
        p.write("typed after\r")  # and the editor is out of the paste
        p.expect("echo: typed after", timeout=5)
        p.expect("you> ", timeout=5)
        p.settle()
        assert "[201~" not in p.text(), p.text()
    finally:
        p.kill()
    assert user_messages(home, conv) == ["line one\nline two", "typed after"]


def test_a_paste_start_marker_split_across_slow_reads_starts_the_paste(server: tuple[Path, dict[str, str]]) -> None:
    home, env = server
    p, conv = chat(env)
    before = conversations(home)
    try:
        # `[200~` comes 200 ms after its ESC
        p.write("\x1b")
        time.sleep(APART)
        p.write("[200~first pasted\r/new\rsecond pasted" + PASTE_END)
        time.sleep(APART)
        p.write("\r")
        p.expect("echo: first pasted", timeout=5)
        p.expect("you> ", timeout=5)

        # the Escape key alone, then typed text beginning with `[`: typed, as before
        p.write("\x1b")
        time.sleep(APART)
        p.write("[note] hi\r")
        p.expect("echo: [note] hi", timeout=5)
        p.expect("you> ", timeout=5)
        p.settle()
        assert "new conversation" not in p.text() and conversations(home) == before, p.text()
        assert "[200~" not in p.text(), p.text()
    finally:
        p.kill()
    assert user_messages(home, conv) == ["first pasted\n/new\nsecond pasted", "[note] hi"]


def test_ctrl_c_during_a_paste_drops_the_rest_of_it(server: tuple[Path, dict[str, str]]) -> None:
    home, env = server
    p, conv = chat(env)
    before = conversations(home)
    try:
        p.write(PASTE_START + "pasted one\rpasted two\r")
        p.expect("pasted two", timeout=5)  # echoed: chat has read it
        p.write("\x03")  # Ctrl-C while the paste is still coming
        p.expect("^C", timeout=5)
        p.expect("you> ", timeout=5)
        p.write("pasted three\r/new\rpasted four\r" + PASTE_END)
        time.sleep(APART)
        p.write("typed after\r")
        p.expect("echo: typed after", timeout=5)
        p.expect("you> ", timeout=5)
        assert "new conversation" not in p.text() and "echo: pasted" not in p.text(), p.text()
        assert user_messages(home, conv) == ["typed after"]

        # Ctrl-C when only the start marker came (the line still empty): the paste is dropped, chat stays
        p.write(PASTE_START)
        time.sleep(APART)
        p.write("\x03")
        p.expect("^C", timeout=5)
        p.write("/quit\r" + PASTE_END)
        time.sleep(APART)
        p.write("still here\r")
        p.expect("echo: still here", timeout=5)
        p.expect("you> ", timeout=5)

        # a paste whose end marker never comes (the terminal dropped it at Ctrl-C): after a quiet
        # second what is typed is typed again
        p.write(PASTE_START + "lost end\r")
        p.expect("lost end", timeout=5)
        p.write("\x03")
        p.expect("^C", timeout=5)
        time.sleep(QUIET + 0.3)
        p.write("typed later\r")
        p.expect("echo: typed later", timeout=5)
        p.expect("you> ", timeout=5)
        p.settle()
        assert p.status is None
        assert "new conversation" not in p.text() and conversations(home) == before, p.text()
        p.write("\x03")  # at an empty prompt, with no paste open: Ctrl-C leaves
        assert p.wait() == 0
    finally:
        p.kill()
    assert user_messages(home, conv) == ["typed after", "still here", "typed later"]


def _approved(home: Path) -> list[str]:
    conn = sqlite3.connect(default_path(home))
    try:
        return sorted(s for (s,) in conn.execute("SELECT sender FROM approved_senders"))
    finally:
        conn.close()


def _code(text: str) -> str:
    found = re.search(r"[A-HJ-NP-Z2-9]{4}-[A-HJ-NP-Z2-9]{4}", text)
    assert found, text
    return found.group(0).replace("-", "")


def test_ids_differing_only_by_unicode_normalization_never_print_alike(tmp_path: Path) -> None:
    with FakeChat() as fake:
        home = fakechat_home(tmp_path / "home", fake, dm_policy="pairing", admins=["boss"])
        with channel_server(home):
            fake.inject("dm-nfc", "hola", sender=NFC, sender_name="Jose")
            fake.inject("dm-nfd", "hola", sender=NFD, sender_name="Jose")
            nfc_code = _code(fake.wait_for_text("dm-nfc", lambda t: "pairing code" in t, timeout=15).text)
            nfd_code = _code(fake.wait_for_text("dm-nfd", lambda t: "pairing code" in t, timeout=15).text)

            fake.inject("dm-boss", "/pair", sender="boss")
            listed = fake.wait_for_text("dm-boss", lambda t: "Pending pairing requests" in t, timeout=15).text
            lines = {line.split()[0]: line for line in listed.splitlines()[1:]}
            assert f"`{NFC}`" in lines[nfc_code], listed  # the NFC id as it is
            assert "`jose\\u0301`" in lines[nfd_code] and NFD not in listed, listed

            pending = run_cli(home, "pairing", "list")
            assert pending.code == 0, pending.err
            assert NFC in pending.out and "jose\\u0301" in pending.out and NFD not in pending.out, pending.out

            for code in (nfc_code, nfd_code):
                assert run_cli(home, "pairing", "approve", code).code == 0
        approved = run_cli(home, "pairing", "approved")
        assert approved.code == 0, approved.err
        shown = [line.split()[1] for line in approved.out.splitlines()]
        assert sorted(shown) == sorted([NFC, "jose\\u0301"]), approved.out  # two lines, never alike

        revoked = run_cli(home, "pairing", "revoke", "jose\\u0301")  # the shown form, typed back
        assert revoked.code == 0, revoked.err
        assert _approved(home) == [NFC]
        # the owner is told the look-alike is still in, and how to name it
        assert "Revoked jose\\u0301" in revoked.out and "Not revoked, differing from jose\\u0301" in revoked.out
        assert f"revoke '{NFC}'" in revoked.out, revoked.out

        again = run_cli(home, "pairing", "revoke", NFC)
        assert again.code == 0, again.err
        assert _approved(home) == [] and "Not revoked" not in again.out, again.out
