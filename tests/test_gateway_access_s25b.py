"""A queued turn asks access again as it starts, and a platform's error never saves a token
(docs/channels.md, "Who may use the bot"; docs/security.md, "Secrets in logs").

* A paired user's second message, queued on the server behind their own turn paused on an approval,
  still ran and was answered after `pairing revoke` (access was asked only before the submit). The
  queued turn is now cancelled as it leaves the queue, or at once while it still waits, its ledger
  row `failed` with the debounced batch's "no longer let in" reason, and nothing posted for it.
* A platform's error that echoes the bot token (Slack's `invalid_auth (Authorization: Bearer
  xoxb-…)` at `auth.test`, a Discord 400 or 403 quoting `Authorization: Bot …`) was saved unmasked
  in gateway.db (the account's backoff reason, a failed reply's reason) and printed by `appserver
  channels status`. gateway.db's reason columns are masked as they are written, and `channels
  status` masks what an older gateway saved.
* A webhook `secret` shorter than 16 characters (`hunter2`: guessable, and too short to be masked)
  is refused at account start, naming the account and `openssl rand -hex 16`.

Real parts: `appserver serve` with slack-bolt / discord.py against the loopback fakes
(tests/fakes/), the CLI, gateway.db read with sqlite3."""

from __future__ import annotations

import json
import re
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.db import default_path, open_db
from gateway.status import AccountStatus, StatusBoard
from tests.fakes.discord_api import FakeDiscord
from tests.fakes.slack_api import FakeSlack
from tests.support.cli import cli_env, run_cli
from tests.support.gateway import channel_server, write_config
from tests.support.net import free_port
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(60)

NO_LONGER_LET_IN = "the sender's access was taken away before the turn started"
SLACK_BOT = "xoxb-2837465019-4958372615043-Zq7LmNp2RsTuVwXy9AbCdEfG"
SLACK_APP = "xapp-1-A05B6C7D8E9-5829304857162-9f8e7d6c5b4a39281706f5e4d3c2b1a0"
DISCORD_TOKEN = "MTA4NzY1NDMyMTA5ODc2NTQzMg.GhIjKl.AbCdEfGhIjKlMnOpQrStUvWxYz0123456789abcd"
GUILD_CHANNEL = "300000000000000001"


def _careful(home: Path) -> None:
    created = run_cli(home, "agents", "create", "--name", "careful", "--tool", "clock=ask")
    assert created.code == 0, created.err


def _row(home: Path, message_id: str) -> tuple[str, str | None] | None:
    """(state, reason) of the ledger row whose message id ends with `message_id`."""
    if not default_path(home).exists():
        return None
    conn = sqlite3.connect(f"file:{default_path(home)}?mode=ro", uri=True)
    try:
        row = conn.execute("SELECT state, reason FROM ledger WHERE message_id LIKE ?", (f"%{message_id}",)).fetchone()
    finally:
        conn.close()
    return (str(row[0]), row[1]) if row else None


def _settled(home: Path, message_id: str) -> tuple[str, str | None]:
    """The row once it failed or was delivered (an answered turn is `delivered`)."""
    found = wait_for(
        lambda: (r := _row(home, message_id)) and r[0] in ("failed", "delivered") and r,
        20,
        f"message {message_id} to settle",
    )
    return tuple(found)  # type: ignore[return-value]


def _dump(home: Path) -> str:
    conn = sqlite3.connect(f"file:{default_path(home)}?mode=ro", uri=True)
    try:
        return "\n".join(conn.iterdump())
    finally:
        conn.close()


# ---------------------------------------------------------------- a queued turn of a revoked sender


@pytest.fixture
def slack() -> Iterator[FakeSlack]:
    with FakeSlack() as fake:
        yield fake


def test_a_revoked_senders_turn_queued_behind_their_paused_one_is_cancelled_as_it_starts(
    tmp_path: Path, slack: FakeSlack
) -> None:
    home = tmp_path / "home"
    settings = {"api_url": slack.url, "bot_token_env": "SLACK_BOT", "app_token_env": "SLACK_APP",
                "dm_policy": "pairing", "group_policy": "mention", "admins": ["UADM"],
                "default_agent": "careful"}  # fmt: skip
    write_config(home, {"slack": {"main": settings}}, ["slack"])
    _careful(home)
    env = cli_env(home, SLACK_BOT=slack.bot_token, SLACK_APP=slack.app_token)
    with channel_server(home, "--channels", "slack", env=env):
        slack.inject_dm("U2", "hi", channel="D2")
        code = re.search(r"approve (\w{8})", slack.wait_for_text("D2", lambda t: "pairing code" in t, 30).text)
        assert code and run_cli(home, "pairing", "approve", code.group(1)).code == 0
        slack.wait_for_text("D2", lambda t: "approved" in t, 30)
        ts = slack.inject_mention("U2", "<@UBOT> /call clock {}", channel="C1")
        prompt = slack.wait_for_text("C1", lambda t: t.startswith("🔐"), 15, thread_ts=ts)
        short = re.search(r"/approve (\w+)", prompt.text)
        assert short, prompt.text
        second = slack.inject_mention("U2", "<@UBOT> second from bob", channel="C1", thread_ts=ts)
        wait_for(lambda: (_row(home, second) or ("",))[0] == "submitted", 30, "the second message queued")

        assert run_cli(home, "pairing", "revoke", "U2").code == 0
        slack.click("UADM", "C1", prompt.ts, f"approve:{short.group(1)}", user_name="admin")  # the queue moves on

        slack.wait_for_text("C1", lambda t: t.startswith("clock -"), 15, thread_ts=ts)  # the admin's approval ran
        assert _settled(home, second) == ("failed", NO_LONGER_LET_IN)
        time.sleep(0.5)  # a reply would be on its way by now
        texts = [m.text for m in slack.messages("C1")]
        assert not any("second from bob" in t for t in texts), texts


@pytest.fixture
def discord() -> Iterator[FakeDiscord]:
    with FakeDiscord() as fake:
        yield fake


def test_a_turn_still_queued_when_its_sender_is_revoked_is_cancelled_within_a_second(
    tmp_path: Path, discord: FakeDiscord
) -> None:
    home = tmp_path / "home"
    settings = {"api_url": discord.api_url, "gateway_url": discord.gateway_url, "token_env": "DTOK",
                "dm_policy": "pairing", "group_policy": "mention", "admins": ["999"],
                "default_agent": "careful"}  # fmt: skip
    write_config(home, {"discord": {"main": settings}}, ["discord"])
    _careful(home)
    with channel_server(home, "--channels", "discord", env=cli_env(home, DTOK=discord.token)):
        discord.inject_dm("601", "hi")
        dm = discord.dm_channel("601")
        code = re.search(r"approve (\w{8})", discord.wait_for_text(dm, lambda t: "pairing code" in t, 30).content)
        assert code and run_cli(home, "pairing", "approve", code.group(1)).code == 0
        discord.wait_for_text(dm, lambda t: "approved" in t, 30)
        discord.inject_guild_message("601", "/call clock {}", channel=GUILD_CHANNEL, mention=True)
        prompt = discord.wait_for_text(GUILD_CHANNEL, lambda t: t.startswith("🔐"), 30)
        short = re.search(r"/approve (\w+)", prompt.content)
        assert short, prompt.content
        second = discord.inject_guild_message("601", "second from bob", channel=GUILD_CHANNEL, mention=True)
        wait_for(lambda: (_row(home, second) or ("",))[0] == "submitted", 30, "the second message queued")

        assert run_cli(home, "pairing", "revoke", "601").code == 0
        # nobody answers the paused call: the queued turn is cancelled while it still waits
        assert _settled(home, second) == ("failed", NO_LONGER_LET_IN)
        discord.click("999", GUILD_CHANNEL, prompt.id, f"approve:{short.group(1)}")
        discord.wait_for_text(GUILD_CHANNEL, lambda t: t.startswith("clock -> "), 30)
        time.sleep(0.5)
        texts = [m.content for m in discord.messages(GUILD_CHANNEL)]
        assert not any("second from bob" in t for t in texts), texts


# ---------------------------------------------------------------- a token echoed by a platform's error


def _status(home: Path, env: dict[str, str]) -> str:
    shown = run_cli(home, "channels", "status", env=env)
    as_json = run_cli(home, "channels", "status", "--json", env=env)
    assert shown.code == 0 and as_json.code == 0, shown.err + as_json.err
    json.loads(as_json.out)
    return shown.out + as_json.out


def _account_reason(home: Path, channel: str) -> str:
    if not default_path(home).exists():
        return ""
    conn = sqlite3.connect(f"file:{default_path(home)}?mode=ro", uri=True)
    try:
        row = conn.execute("SELECT reason FROM account_status WHERE channel=?", (channel,)).fetchone()
    except sqlite3.OperationalError:  # the gateway is creating it
        return ""
    finally:
        conn.close()
    return str(row[0]) if row and row[0] else ""


def _holding(text: str, part: str) -> str:
    return text if part in text else ""


def test_a_slack_error_quoting_the_bot_token_is_saved_and_shown_masked(tmp_path: Path) -> None:
    home = tmp_path / "home"
    with FakeSlack(bot_token=SLACK_BOT, app_token=SLACK_APP) as fake:
        settings = {"api_url": fake.url, "bot_token_env": "SLACK_BOT", "app_token_env": "SLACK_APP",
                    "dm_policy": "open", "default_agent": "assistant"}  # fmt: skip
        write_config(home, {"slack": {"main": settings}}, ["slack"])
        fake.fail_next("auth.test", f"invalid_auth (Authorization: Bearer {SLACK_BOT})", count=1000)
        env = cli_env(home, SLACK_BOT=SLACK_BOT, SLACK_APP=SLACK_APP)
        with channel_server(home, "--channels", "slack", env=env, ready=False):
            wait_for(lambda: "auth.test failed" in _account_reason(home, "slack"), 30, "the backoff reason saved")
            # each retry clears the reason for a moment: look until a dump holds it
            dump = wait_for(lambda: _holding(_dump(home), "Bearer <bot_token>"), 30, "the masked reason saved")
            shown = wait_for(lambda: _holding(_status(home, env), "Bearer <bot_token>"), 30, "the masked reason shown")
    assert SLACK_BOT not in dump and SLACK_BOT[:20] not in dump
    assert "Bearer <bot_token>" in shown and SLACK_BOT[:20] not in shown, shown


class _EchoingDiscord(FakeDiscord):
    """Discord behind something that quotes the request's Authorization header in its errors: the
    bot's identity at the first start (400), every post (403)."""

    refuse_identity = 1

    def _handle(
        self, request: Any, method: str, parts: list[str], body: Any, kind: str
    ) -> tuple[int, Any, dict[str, str] | None, float]:
        echo = f"Authorization: {request.headers.get('authorization')}"
        if parts == ["users", "@me"] and self.refuse_identity > 0:
            self.refuse_identity -= 1
            return 400, {"message": f"Invalid header {echo}", "code": 50001}, None, 0.0
        if parts[-1:] == ["messages"] and method == "POST":
            return 403, {"message": f"Missing Access ({echo})", "code": 50001}, None, 0.0
        return super()._handle(request, method, parts, body, kind)


def test_a_discord_error_quoting_the_token_never_reaches_gateway_db_or_status(tmp_path: Path) -> None:
    home = tmp_path / "home"
    with _EchoingDiscord(token=DISCORD_TOKEN) as fake:
        settings = {"api_url": fake.api_url, "gateway_url": fake.gateway_url, "token_env": "DTOK",
                    "dm_policy": "open", "default_agent": "assistant"}  # fmt: skip
        write_config(home, {"discord": {"main": settings}}, ["discord"])
        env = cli_env(home, DTOK=DISCORD_TOKEN)
        with channel_server(home, "--channels", "discord", env=env, ready=False) as srv:
            backoff = wait_for(lambda: "Invalid header" in (r := _account_reason(home, "discord")) and r, 30, "backoff")
            srv.wait_channels_ready(30)
            mid = fake.inject_dm("601", "hello there")
            state, reason = _settled(home, mid)
            dump, shown = _dump(home), _status(home, env)
    assert "Bot <token>" in backoff, backoff
    assert state == "failed" and reason and "Missing Access (Authorization: Bot <token>)" in reason, reason
    assert DISCORD_TOKEN not in dump and DISCORD_TOKEN.split(".")[0] not in dump
    assert DISCORD_TOKEN.split(".")[0] not in shown and "Bot <token>" in shown, shown


def test_channels_status_masks_a_token_an_older_gateway_saved(tmp_path: Path) -> None:
    home = tmp_path / "home"
    settings = {"api_url": "http://127.0.0.1:9", "bot_token_env": "SLACK_BOT", "app_token_env": "SLACK_APP"}
    write_config(home, {"slack": {"main": settings}}, ["slack"])
    reason = f"start failed: RuntimeError: auth.test failed: invalid_auth (Authorization: Bearer {SLACK_BOT})"
    conn = open_db(default_path(home))
    try:
        now = time.time()
        status = AccountStatus("slack", "main", "backoff", reason, None, None, 0, 0, 0, 1, now)
        StatusBoard(conn).note_failure(status, f"cron delivery to C1 failed: slack chat.postMessage: {reason}", now)
    finally:
        conn.close()
    shown = _status(home, cli_env(home, SLACK_BOT=SLACK_BOT, SLACK_APP=SLACK_APP))
    assert SLACK_BOT[:20] not in shown and "Bearer <bot_token>" in shown, shown


# ---------------------------------------------------------------- a short webhook secret


def test_a_webhook_secret_shorter_than_16_characters_is_refused_at_start(tmp_path: Path) -> None:
    home = tmp_path / "home"
    settings = {"listen": f"127.0.0.1:{free_port()}", "secret_env": "WH_SECRET", "default_agent": "assistant"}
    write_config(home, {"webhook": {"hooks": settings}}, ["webhook"])
    env = cli_env(home, WH_SECRET="hunter2")
    with channel_server(home, env=env, ready=False) as srv:
        check = wait_for(lambda: "webhook:hooks error" in (c := srv.channels_check())["detail"] and c, 30, "the error")
        shown = run_cli(home, "channels", "status", env=env).out
    assert "webhook account 'hooks'" in check["detail"] and "openssl rand -hex 16" in check["detail"], check
    assert "fewer than 16" in check["detail"], check
    assert "error" in shown and "webhook account 'hooks'" in shown, shown
