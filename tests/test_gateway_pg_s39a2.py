"""The gateway on a PostgreSQL store, one lost COMMIT at a time (s39 re-attacker RA, fixer A2).

A real `appserver serve` on a real PostgreSQL database through tests/fakes/pg_commit_cut.py, which
cuts one session right after it forwarded that session's COMMIT (PostgreSQL commits, the gateway
never hears so). Before: after `pairing approve`, the kept messages' batch write losing its COMMIT
left them `allowed` and never answered while the sender was told "approved"; `/new` whose
forgetting lost its COMMIT was answered "the gateway restarted while /new was being handled";
and a webhook id longer than 1,024 bytes recorded on SQLite was refused (400) when retried.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fakes.pg_commit_cut import CommitCutProxy
from tests.support.cli import cli_env, run_cli
from tests.support.gateway import WebhookReplies, start_channel_server, write_config
from tests.support.pg import temp_database
from tests.test_gateway_pg_s39a import (
    SECRET,
    _end,
    _free_port,
    _msg,
    _post,
    _state,
    _upstream,
    _wait,
    pytestmark,
)

BATCH = b"UPDATE gateway_ledger SET batch="
FORGET = b"DELETE FROM gateway_route_conversations"
__all__ = ["pytestmark"]


@pytest.fixture
def replies() -> Iterator[WebhookReplies]:
    receiver = WebhookReplies()
    yield receiver
    receiver.close()


def test_a_release_whose_batch_write_lost_its_commit_is_still_answered(tmp_path: Path, replies: WebhookReplies) -> None:
    with temp_database("gw_s39a2") as url:
        proxy = CommitCutProxy(_upstream(url))
        home = tmp_path / "home"
        open_port, pair_port = _free_port(), _free_port()
        common = {"secret_env": "WEBHOOK_SECRET", "reply_url": replies.url, "default_agent": "assistant"}
        accounts = {
            "main": {"listen": f"127.0.0.1:{open_port}", **common},
            "pair": {"listen": f"127.0.0.1:{pair_port}", "dm_policy": "pairing", **common},
        }
        write_config(home, {"webhook": accounts}, ["webhook"])
        cli = cli_env(home, APPSERVER_STORE__URL=url)
        node = start_channel_server(
            home, env=cli_env(home, APPSERVER_STORE__URL=proxy.url_for(url), WEBHOOK_SECRET=SECRET)
        )
        try:
            node.wait_channels_ready(timeout=60)
            # F1: two kept DMs, approved; the batch write of their release loses its COMMIT
            for mid in ("kept-1", "kept-2"):
                dm = _msg(mid, chat="dm-eve", sender="eve", chat_type="dm")
                assert _post(pair_port, dm).status_code == 202
            told = _wait(lambda: replies.texts_for("kept-1"), 30, "the stranger was never told a code")
            code = re.search(r"approve (\w{8})", "\n".join(told))
            assert code, told
            proxy.arm(BATCH)
            approved = run_cli(home, "pairing", "approve", code.group(1), env=cli)
            assert approved.code == 0, approved.err
            _wait(proxy.fired.is_set, 30, "the batch write's COMMIT was never cut")
            for mid in ("kept-1", "kept-2"):
                _wait(lambda m=mid: _state(url, m) == "delivered", 60, f"{mid}, released, was never answered")
            answers = [t for m in ("kept-1", "kept-2") for t in replies.texts_for(m) if t.startswith("echo:")]
            assert len(answers) == 1, answers  # one turn, answered once

        finally:
            _end(node)
            proxy.close()


def test_new_whose_forgetting_lost_its_commit_is_run_again_not_called_a_restart(
    tmp_path: Path, replies: WebhookReplies
) -> None:
    with temp_database("gw_s39a2_new") as url:
        proxy = CommitCutProxy(_upstream(url))
        home = tmp_path / "home"
        open_port = _free_port()
        common = {"secret_env": "WEBHOOK_SECRET", "reply_url": replies.url, "default_agent": "assistant"}
        write_config(home, {"webhook": {"main": {"listen": f"127.0.0.1:{open_port}", **common}}}, ["webhook"])
        node = start_channel_server(
            home, env=cli_env(home, APPSERVER_STORE__URL=proxy.url_for(url), WEBHOOK_SECRET=SECRET)
        )
        try:
            node.wait_channels_ready(timeout=60)
            # F2: `/new` whose forgetting of the chat's conversation loses its COMMIT
            assert _post(open_port, _msg("before-new")).status_code == 202
            _wait(lambda: _state(url, "before-new") == "delivered", 60, "the first message was never answered")
            proxy.arm(FORGET)
            assert _post(open_port, _msg("new-1", text="/new")).status_code == 202
            _wait(proxy.fired.is_set, 30, "the /new's COMMIT was never cut")
            answer = _wait(lambda: replies.texts_for("new-1"), 30, "/new was never answered")
            assert not any("restarted" in t for t in answer), answer
            assert any("new conversation" in t for t in answer), answer
        finally:
            _end(node)
            proxy.close()


def test_a_long_id_recorded_on_sqlite_is_still_a_duplicate(tmp_path: Path, replies: WebhookReplies) -> None:
    """F4: the byte cap is PostgreSQL's; a SQLite home takes such ids (and their retries) as ever."""
    home = tmp_path / "home"
    port = _free_port()
    common = {"secret_env": "WEBHOOK_SECRET", "reply_url": replies.url, "default_agent": "assistant"}
    write_config(home, {"webhook": {"main": {"listen": f"127.0.0.1:{port}", **common}}}, ["webhook"])
    node = start_channel_server(home, env=cli_env(home, WEBHOOK_SECRET=SECRET))
    try:
        node.wait_channels_ready(timeout=60)
        long_id = "".join(chr(0x4E00 + i) for i in range(500))  # 1,500 bytes in UTF-8
        long_sender = "".join(chr(0x4E00 + i) for i in range(400))
        first = _post(port, _msg(long_id, sender=long_sender))
        assert first.status_code == 202, first.text
        _wait(lambda: replies.reply_ids(long_id), 60, "the long id's message was never answered")
        again = _post(port, _msg(long_id, sender=long_sender))
        assert again.status_code == 200 and again.json().get("duplicate") is True, again.text
    finally:
        _end(node)
