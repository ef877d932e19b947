"""Channel settings that could never work, and an approval that promised what it could not keep
(session 36, tester E).

F1. `deny_notice = 5`, `true`, `["no"]` or `""` passed `channels add`, `channels list` and `serve`;
    a denied sender then heard nothing and nothing said why. Now the account's problem (`channels add`
    exits 2; at serve the account is in `error`), as a bad `unpaired` is.
F2. A code given under `dm_policy = "pairing"`, approved after the owner switched the account to
    `"disabled"`: `pairing approve` said nothing, the sender was told "Your messages are on their
    way", and the kept message failed as "access taken away". Now `approve` warns, the sender is told
    DMs are off, and the ledger says so.
F3. `APPSERVER_CHANNELS__<CH>__ACCOUNTS__<NAME>__TOOL_STATUS=false` took the whole server down
    blaming config.toml; `…__TOLERANCE_S=60` put the account in `error` ("got '60'"). Now read as the
    setting's type; a value that does not read so is the account's problem, naming the variable.
F4. A webhook `path` with a query or a %-escape (every POST 404), `tolerance_s` under 1 s (every
    request 401) and a `reply_url` with no host or cut short (each reply retried for a minute) were
    accepted, the account `running`. Now refused naming the setting; so is an `api_url` with no host.

Real CLI, a real `serve` with the webhook channel, real sockets, gateway.db on disk.
"""

from __future__ import annotations

import json
import re
import sqlite3
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from plugins.webhook import SIGNATURE_HEADER, TIMESTAMP_HEADER, sign
from tests.support.cli import cli_env, run_cli
from tests.support.gateway import ChannelServer, channel_server, write_config
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(180)

SECRET = "s36e-webhook-secret-0123456789"
CODE = re.compile(r"[A-HJ-NP-Z2-9]{4}-[A-HJ-NP-Z2-9]{4}")
VAR = "APPSERVER_CHANNELS__WEBHOOK__ACCOUNTS__"


class Receiver:
    """The integrator's app at `reply_url`: records every POST's JSON body, answers 200."""

    def __init__(self, port: int) -> None:
        self.posts: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's API
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                with outer._lock:
                    outer.posts.append(body)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{port}/replies"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def texts(self) -> list[str]:
        with self._lock:
            return [str(p.get("text")) for p in self.posts]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver(request: pytest.FixtureRequest) -> Iterator[Receiver]:
    r = Receiver(request.param)
    try:
        yield r
    finally:
        r.close()


def _post(port: int, payload: dict[str, Any], path: str = "/", body: bytes | None = None) -> httpx.Response:
    body = json.dumps(payload).encode() if body is None else body
    stamp = str(int(time.time()))
    headers = {"Content-Type": "application/json", TIMESTAMP_HEADER: stamp, SIGNATURE_HEADER: sign(SECRET, stamp, body)}
    return httpx.post(f"http://127.0.0.1:{port}{path}", content=body, headers=headers, timeout=10)


def _hook(port: int, **settings: Any) -> dict[str, Any]:
    return {"listen": f"127.0.0.1:{port}", "secret_env": "WH_SECRET", "default_agent": "assistant", **settings}


def _accounts(srv: ChannelServer, names: list[str], timeout: float = 30) -> dict[str, dict[str, Any]]:
    """The webhook accounts' live states from /readyz, once each of `names` is running or in error."""

    def settled() -> dict[str, dict[str, Any]] | None:
        try:
            accounts = (srv.channels_check().get("data") or {}).get("accounts", {})
        except (httpx.HTTPError, AssertionError):
            return None
        states = {ref.split(":", 1)[1]: a for ref, a in accounts.items()}
        return states if all(states.get(n, {}).get("state") in ("running", "error") for n in names) else None

    return wait_for(settled, timeout, "the accounts to settle")  # type: ignore[no-any-return]


def _ledger(home: Path, message_id: str) -> tuple[str, str | None] | None:
    conn = sqlite3.connect(f"file:{home / 'channels' / 'gateway.db'}?mode=ro", uri=True)
    try:
        row = conn.execute("SELECT state, reason FROM ledger WHERE message_id = ?", (message_id,)).fetchone()
        return None if row is None else (row[0], row[1])
    finally:
        conn.close()


# ----------------------------------------------------------------------------- F1 and F4: channels add


@pytest.mark.parametrize(
    ("channel", "setting", "says"),
    [
        ("webhook", "deny_notice=5", "deny_notice must be the text a denied sender is told"),
        ("webhook", "deny_notice=true", "deny_notice must be the text a denied sender is told"),
        ("webhook", 'deny_notice=["no"]', "deny_notice must be the text a denied sender is told"),
        ("webhook", 'deny_notice=""', "deny_notice must be the text a denied sender is told"),
        ("slack", 'deny_notice="   "', "deny_notice must be the text a denied sender is told"),
        ("discord", 'default_agent=""', "default_agent must name an agent"),
        ("webhook", "path=/hook?key=abc", "path must be a plain URL path"),
        ("webhook", "path=/caf%C3%A9", "path must be a plain URL path"),
        ("webhook", "path=/in/../out", "path must be a plain URL path"),
        ("webhook", "tolerance_s=0.001", "tolerance_s must be a positive number of seconds from 1"),
        ("webhook", "tolerance_s=0.5", "tolerance_s must be a positive number of seconds from 1"),
        ("webhook", "reply_url=http://[::1", "reply_url must be an http:// or https:// URL"),
        ("webhook", "reply_url=http://", "it names no host"),
        ("webhook", "reply_url=http://127.0.0.1:99999/r", "reply_url must be an http:// or https:// URL"),
        ("slack", "api_url=https://", "it names no host"),
        ("telegram", "api_url=http://[::1", "api_url must be an http:// or https:// URL"),
        ("discord", "gateway_url=wss://", "it names no host"),
        # a base URL the plugin appends its paths to (a re-attack): the paths went after the query
        ("telegram", "api_url=http://127.0.0.1:1/tg?x=1", "holds no ?query or #fragment"),
        ("slack", "api_url=https://proxy.example/slack#x", "holds no ?query or #fragment"),
        ("discord", "gateway_url=wss://gw.example/?v=10", "holds no ?query or #fragment"),
    ],
)
def test_channels_add_refuses_a_setting_that_could_never_work(
    tmp_path: Path, channel: str, setting: str, says: str
) -> None:
    home = tmp_path / "home"
    added = run_cli(home, "channels", "add", channel, "main", "--set", "dm_policy=pairing", "--set", setting)
    assert added.code == 2, (added.code, added.out, added.err)
    assert says in added.err and "[channels." in added.err and "nothing written" in added.err, added.err
    if "key=abc" in setting:
        assert "abc" not in added.err  # a token in the path's query is not printed back
    assert not (home / "config.toml").exists() or "accounts.main" not in (home / "config.toml").read_text()


def test_channels_list_names_a_deny_notice_written_by_hand_that_is_not_text(tmp_path: Path) -> None:
    home = tmp_path / "home"
    write_config(home, {"webhook": {"n": _hook(22401, deny_notice=5), "ok": _hook(22402, deny_notice="Ask Bob.")}}, [])
    listed = run_cli(home, "channels", "list", "--json")
    assert listed.code == 0, listed.err
    webhook = next(c for c in listed.json()["channels"] if c["id"] == "webhook")
    assert list(webhook["account_errors"]) == ["n"], webhook
    assert "deny_notice must be the text" in webhook["account_errors"]["n"], webhook


# ----------------------------------------------------------------------------- F1 and F4: at serve


def test_serve_puts_each_account_with_a_setting_that_could_never_work_in_error(tmp_path: Path) -> None:
    home = tmp_path / "home"
    accounts = {
        "good": _hook(22410, dm_policy="pairing", deny_notice="Sorry, ask the front desk.", path="/café"),
        "n": _hook(22411, deny_notice=True),
        "q": _hook(22412, path="/hook?key=abc"),
        "t": _hook(22413, tolerance_s=0.001),
        "u": _hook(22414, reply_url="http://"),
    }
    write_config(home, {"webhook": accounts}, ["webhook"])
    with channel_server(home, env=cli_env(home, WH_SECRET=SECRET), ready=False) as srv:
        states = _accounts(srv, list(accounts))
        assert states["good"]["state"] == "running", states
        for name, says in (
            ("n", "deny_notice must be the text"),
            ("q", "path must be a plain URL path"),
            ("t", "tolerance_s must be a positive number of seconds from 1"),
            ("u", "reply_url must be an http:// or https:// URL"),
        ):
            assert states[name]["state"] == "error", (name, states)
            assert says in str(states[name]["reason"]), (name, states)
        check = srv.channels_check()
        assert check["status"] == "fail" and "webhook:q" in check["detail"], check  # /readyz names it
        # a plain path of any letters is reached by the URL a client makes of it
        reached = _post(22410, {"id": "p1", "chat": "c1", "sender": "s1", "text": "hi"}, path="/caf%C3%A9")
        assert reached.status_code == 202, reached.text


# ----------------------------------------------------------------------------- F2


@pytest.mark.parametrize("receiver", [22421], indirect=True)
def test_approving_after_dms_were_disabled_warns_and_tells_the_sender_the_truth(
    tmp_path: Path, receiver: Receiver
) -> None:
    home = tmp_path / "home"
    env = cli_env(home, WH_SECRET=SECRET)
    settings = _hook(22420, reply_url=receiver.url, dm_policy="pairing")
    write_config(home, {"webhook": {"main": settings}}, ["webhook"])
    with channel_server(home, env=env):
        asked = _post(22420, {"id": "f2-1", "chat": "cx", "sender": "stranger", "text": "secret question"})
        assert asked.status_code == 202, asked.text
        prompt = wait_for(lambda: next((t for t in receiver.texts() if CODE.search(t)), None), 20, "the code")
    code = CODE.search(prompt).group(0).replace("-", "")  # type: ignore[union-attr]
    assert _ledger(home, "f2-1") == ("held", "dm: unknown sender, pairing required")

    write_config(home, {"webhook": {"main": {**settings, "dm_policy": "disabled"}}}, ["webhook"])
    approved = run_cli(home, "pairing", "approve", code, env=env)
    assert approved.code == 0, approved.err
    assert "Approved stranger on webhook:main." in approved.out, approved.out
    assert 'dm_policy = "disabled"' in approved.err and "not answered" in approved.err, approved.err

    with channel_server(home, env=env):
        told = wait_for(lambda: receiver.texts()[1:], 20, "the approval notice")
        row = wait_for(lambda: (r := _ledger(home, "f2-1")) and r[0] != "held" and r, 10, "the kept message")
        time.sleep(1.5)  # a released message would have been submitted by now (and failed)
        assert told == [told[0]] and "on their way" not in told[0], told
        assert "does not take direct messages" in told[0], told
        assert row == ("denied", f"pairing {code} approved, but dm: direct messages are disabled"), row
        assert _ledger(home, "f2-1") == row


# ----------------------------------------------------------------------------- F3


@pytest.mark.parametrize("receiver", [22432], indirect=True)
def test_numbers_and_booleans_from_the_environment_are_read_as_their_settings_type(
    tmp_path: Path, receiver: Receiver
) -> None:
    home = tmp_path / "home"
    write_config(home, {"webhook": {"main": _hook(22430, reply_url=receiver.url), "bad": _hook(22431)}}, ["webhook"])
    env = cli_env(
        home,
        WH_SECRET=SECRET,
        **{
            VAR + "MAIN__TOOL_STATUS": "false",
            VAR + "MAIN__STREAM": "false",
            VAR + "MAIN__CHAT_RATE": "2",
            VAR + "MAIN__DEBOUNCE_MS": "500",
            VAR + "MAIN__TOLERANCE_S": "60",
            VAR + "MAIN__MAX_BODY_BYTES": "4096",
            VAR + "BAD__TOLERANCE_S": "soon",
            VAR + "BAD__TOOL_STATUS": "maybe",
        },
    )
    listed = run_cli(home, "channels", "list", "--json", env=env)
    assert listed.code == 0, listed.err
    errors = next(c for c in listed.json()["channels"] if c["id"] == "webhook")["account_errors"]
    assert list(errors) == ["bad"], errors
    assert f"{VAR}BAD__TOLERANCE_S: tolerance_s must be a number, got 'soon'" in errors["bad"], errors
    assert f"{VAR}BAD__TOOL_STATUS: tool_status must be true or false" in errors["bad"], errors

    with channel_server(home, env=env, ready=False) as srv:
        states = _accounts(srv, ["main", "bad"])
        assert states["main"]["state"] == "running", states
        assert states["bad"]["state"] == "error" and f"{VAR}BAD__TOLERANCE_S" in str(states["bad"]["reason"]), states
        too_big = _post(
            22430, {}, body=json.dumps({"id": "x", "chat": "c", "sender": "s", "text": "y" * 5000}).encode()
        )
        assert too_big.status_code == 413, too_big.text  # max_body_bytes = 4096, from the environment
        sent = _post(22430, {"id": "f3-1", "chat": "c3", "sender": "s3", "text": "hello"})
        assert sent.status_code == 202, sent.text
        wait_for(lambda: any("hello" in t for t in receiver.texts()), 30, "the reply")


def test_a_reply_url_may_carry_a_query_where_an_api_url_may_not() -> None:
    """The webhook's `reply_url` is requested as it is (a query there is the receiver's own, e.g. a
    key); an `api_url` is a base the plugin appends paths to."""
    from plugins.telegram.settings import check_settings as telegram_settings
    from plugins.webhook.settings import check_settings as webhook_settings

    webhook_settings({"listen": "127.0.0.1:1", "reply_url": "https://r.example/in?key=abc#x"})
    telegram_settings({"api_url": "https://proxy.example/telegram/"})
    with pytest.raises(ValueError, match="holds no"):
        telegram_settings({"api_url": "https://proxy.example/telegram?token=1"})
