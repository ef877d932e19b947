"""Access is asked again wherever a chat user's answer reaches the server, and channel secrets stay
out of the server's log (docs/channels.md, "Who may use the bot"; docs/security.md, "Secrets in logs").

* A starter whose access was taken away (`pairing revoke`, or out of `allow` and a restart) could
  still approve their own paused tool call in a group under `group_policy = "mention"` by typing
  `/approve ID` without a mention: the exception to the mention rule for answers never asked whether
  the sender was still let in. Their press is refused too, with the truth, not "Only the person who
  started this…". An allowed starter's unmentioned `/approve ID` still runs the tool.
* python-telegram-bot's `telegram.request` logger wrote a non-JSON Bot API answer as it came: an
  HTML error page echoing `/bot<TOKEN>/getMe` put the token in the server log, once per retry. The
  child masks every account secret on its log handlers, and the supervisor's relay masks them again.

Real parts: `appserver serve --channels telegram` with python-telegram-bot against the loopback fake
Bot API (or a loopback HTTP server answering HTML), the CLI, the supervisor with a real child process."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from gateway.db import default_path
from gateway.ledger import Ledger, UpdateKey
from gateway.supervisor import Credential, GatewaySupervisor
from tests.fakes.telegram_api import FakeTelegram
from tests.support.cli import cli_env, run_cli
from tests.support.gateway import ChannelServer, channel_server, write_config
from tests.support.wait import wait_for, wait_until

pytestmark = pytest.mark.timeout(60)

ALICE, BOB, ADMIN = 555, 556, 999
NOT_LET_IN_ANSWER = "You are no longer allowed to use this bot, so you cannot answer this request."
BOT = "@appserver_test_bot"


@pytest.fixture(scope="module")
def tg() -> Iterator[FakeTelegram]:
    with FakeTelegram() as fake:
        yield fake


def _home(tmp_path: Path, tg: FakeTelegram, **policy: Any) -> Path:
    home = tmp_path / "home"
    settings = {"api_url": tg.url, "poll_timeout": 1, "token_env": "TG_TOKEN", "dm_policy": "pairing",
                "group_policy": "mention", "admins": [str(ADMIN)], "default_agent": "careful", **policy}  # fmt: skip
    write_config(home, {"telegram": {"main": settings}}, ["telegram"])
    created = run_cli(home, "agents", "create", "--name", "careful", "--tool", "clock=ask")
    assert created.code == 0, created.err
    return home


def _serve(home: Path, tg: FakeTelegram) -> Any:
    return channel_server(home, "--channels", "telegram", env=cli_env(home, TG_TOKEN=tg.token))


def _paused_call(tg: FakeTelegram, group: int, user: dict[str, Any], hello: bool = True) -> tuple[int, str]:
    """`user` mentions the bot (unless already done), then replies to its answer with
    `/call clock {}`: the approval prompt's message id and short ID."""
    if hello:
        tg.inject(group, f"{BOT} hello", kind="supergroup", sender=user)
    first = tg.wait_for_text(group, lambda t: t.startswith("echo"), timeout=15)
    tg.inject(group, "/call clock {}", kind="supergroup", sender=user, reply_to=first.message_id)
    prompt = tg.wait_for_text(group, lambda t: t.startswith("🔐"), timeout=15)
    short = re.search(r"/approve (\w+)", prompt.text)
    assert short, prompt.text
    return prompt.message_id, short.group(1)


def _decided(home: Path, key: str) -> str:
    """The ledger state of message `key` of telegram:main once decided (waits for it)."""

    def state() -> str | None:
        ledger = Ledger.open(default_path(home))
        try:
            entry = ledger.get(UpdateKey("telegram", "main", key))
        finally:
            ledger.close()
        return entry.state if entry is not None and entry.state != "received" else None

    return str(wait_for(state, 15, f"the gateway to decide {key}"))


def _still_pending(tg: FakeTelegram, group: int, prompt_id: int) -> None:
    time.sleep(1.0)  # an approval that got through runs the tool within milliseconds
    texts = [m.text for m in tg.messages(group)]
    assert not any(t.startswith("clock -> ") for t in texts), texts
    assert "Approved" not in tg.message(group, prompt_id).text


def test_a_revoked_starter_neither_types_nor_presses_an_approval_through(tmp_path: Path, tg: FakeTelegram) -> None:
    group, other = -100851, -100852
    home = _home(tmp_path, tg, allow=[str(ALICE)])
    bob = tg.user(BOB, "Bob", "bob")
    with _serve(home, tg):
        alice = tg.user(ALICE, "Alice", "alice")  # on `allow`: her unmentioned answer is still an answer
        tg.inject(other, f"{BOT} hello", kind="supergroup", sender=alice)
        tg.dm("hi there", user_id=BOB, first_name="Bob")
        code = re.search(r"approve (\w{8})", tg.wait_for_text(BOB, lambda t: "pairing code" in t, timeout=15).text)
        assert code and run_cli(home, "pairing", "approve", code.group(1)).code == 0
        _, hers = _paused_call(tg, other, alice, hello=False)
        tg.wait_for_text(BOB, lambda t: "approved" in t, timeout=15)
        prompt_id, short = _paused_call(tg, group, bob)
        revoked = run_cli(home, "pairing", "revoke", str(BOB))
        assert revoked.code == 0, revoked.err

        tg.press(group, prompt_id, f"approve:{short}", sender=bob)  # the truth, not "only the person who…"
        typed = tg.inject(group, f"/approve {short}", kind="supergroup", sender=bob)  # no mention needed…
        tg.inject(other, f"/approve {hers}", kind="supergroup", sender=alice)
        tg.wait_for_text(group, lambda t: t == NOT_LET_IN_ANSWER, timeout=15)
        assert _decided(home, f"{group}:{typed.message_id}") == "denied"  # …but Bob is no longer let in
        tg.wait_for_text(other, lambda t: t.startswith("clock -> "), timeout=15)
        _still_pending(tg, group, prompt_id)


def test_a_starter_taken_off_allow_cannot_approve_after_the_restart(tmp_path: Path, tg: FakeTelegram) -> None:
    group = -100853
    home = _home(tmp_path, tg, dm_policy="allowlist", allow=[str(ALICE)])
    alice = tg.user(ALICE, "Alice", "alice")
    with _serve(home, tg):
        prompt_id, short = _paused_call(tg, group, alice)
    write_config(home, {"telegram": {"main": {"api_url": tg.url, "poll_timeout": 1, "token_env": "TG_TOKEN",
        "dm_policy": "allowlist", "group_policy": "mention", "allow": [], "admins": [str(ADMIN)],
        "default_agent": "careful"}}}, ["telegram"])  # fmt: skip
    with _serve(home, tg):
        typed = tg.inject(group, f"/approve {short}", kind="supergroup", sender=alice)
        assert _decided(home, f"{group}:{typed.message_id}") == "denied"
        tg.wait_for_text(group, lambda t: t == NOT_LET_IN_ANSWER, timeout=15)
        _still_pending(tg, group, prompt_id)


# ---------------------------------------------------------------- secrets in the log

TOKEN = "7777777:SECRETLEAK_s25_abcdefghijk"  # too short for the server's shape of a Telegram token


class _EchoingPage(BaseHTTPRequestHandler):
    """A Bot API behind a proxy that answers an HTML error page quoting the request path."""

    def log_message(self, *args: Any) -> None:
        pass

    def _answer(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        body = b"<html>bad gateway " + self.path.encode() + b"</html>"
        self.send_response(502)
        self.send_header("content-type", "text/html")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer


@pytest.fixture
def echoing_api() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _EchoingPage)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/proxy"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_bot_api_error_page_quoting_the_token_leaves_it_out_of_the_log(tmp_path: Path, echoing_api: str) -> None:
    home = tmp_path / "home"
    settings = {"api_url": echoing_api, "poll_timeout": 1, "token_env": "TG_TOKEN", "default_agent": "assistant"}
    write_config(home, {"telegram": {"main": settings}}, ["telegram"])
    with channel_server(home, "--channels", "telegram", env=cli_env(home, TG_TOKEN=TOKEN), ready=False) as srv:
        server: ChannelServer = srv
        wait_for(lambda: "telegram.request" in server.log(), 15, "the library's log line about the HTML answer")
    log = server.log()
    assert "/bot<token>/getMe" in log, log[-3000:]
    assert TOKEN not in log and TOKEN.split(":")[1] not in log, log[-3000:]


CHILD = r"""
import json, os, sys
start = json.loads(sys.stdin.readline())
token, signing = os.environ["S25_BOT"], open(os.path.join(os.environ["APPSERVER_HOME"], "signing")).read().strip()
sys.stderr.write(f"Traceback: GET /bot{token}/getMe failed; signature {signing}\n")
sys.stderr.flush()
def out(kind, payload):
    sys.stdout.write(f"GATEWAY_{kind} {json.dumps(payload)}\n")
    sys.stdout.flush()
out("EVENT", {"type": "gateway_error", "message": f"refused /bot{token}"})
out("EVENT", {"type": "account_state", "channel": "toy", "account": "main", "state": "error", "reason": f"bad {token}"})
sys.stdout.write("GATEWAY_READY\n")
sys.stdout.flush()
for line in sys.stdin:
    if json.loads(line).get("op") == "stop":
        sys.stdout.write("GATEWAY_RESPONSE " + json.dumps({"id": json.loads(line)["id"], "ok": True}) + "\n")
        sys.stdout.flush()
        break
"""


async def test_the_supervisor_masks_account_secrets_in_what_it_relays(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The second line of defence: what reaches the child's stderr past its log filter."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "signing").write_text("s25-signing-secret-value\n")
    script = tmp_path / "fake-python"
    script.write_text(f"#!{sys.executable}\n{CHILD}")
    script.chmod(0o755)
    accounts = [{"channel": "toy", "name": "main", "settings": {},
                 "secrets": {"token": {"env": "S25_BOT"}, "signing_secret": {"file": "signing"}}}]  # fmt: skip
    sup = GatewaySupervisor(
        home=home,
        url=lambda: "ws://127.0.0.1:9/ws",
        accounts=accounts,
        credential=lambda: Credential(None, lambda: None),
        python=str(script),
        env={"PATH": "/usr/bin:/bin", "S25_BOT": TOKEN},
        ready_timeout=5.0,
        stop_grace=2.0,
    )
    caplog.set_level(logging.INFO)
    await asyncio.wait_for(sup.start(), 10)
    try:
        await wait_until(lambda: "Traceback" in caplog.text and "refused" in caplog.text, 5, "the relayed lines")
    finally:
        await sup.stop()
    shown = caplog.text + json.dumps(sup.readiness())
    assert TOKEN not in shown and "s25-signing-secret-value" not in shown, shown
    assert "/bot<token>/getMe" in caplog.text and "signature <signing_secret>" in caplog.text, caplog.text
    assert "bad <token>" in json.dumps(sup.readiness())
