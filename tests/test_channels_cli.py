"""`appserver channels …` (issue 15, "Accounts and configuration" and "Routing"): config.toml edited
as text (comments kept, the result loadable), refusals that write nothing, routes and status in
gateway.db, broken plugins shown. The commands run through click's CliRunner on a temporary home;
one test runs the real CLI in a subprocess for the registration and exit codes."""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from appserver.cli.agents import agents_group
from appserver.cli.channels import channels_group
from appserver.config import load_config
from appserver.serverinfo import write_server_json
from gateway.db import default_path, open_db
from gateway.ledger import Ledger, UpdateKey
from gateway.routing import RouteKey, Router
from gateway.status import AccountStatus, StatusBoard
from tests.support.cli import ROOT, run_cli

BASE = """\
# my appserver config
[server]
listen = "127.0.0.1:8770"   # keep this port

# limits tuned by hand
[limits]
queue_max = 8
"""


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    h = tmp_path / "home"
    h.mkdir()
    monkeypatch.setenv("APPSERVER_HOME", str(h))
    for name in ("APPSERVER_CHANNELS__ENABLED",):
        monkeypatch.delenv(name, raising=False)
    (h / "config.toml").write_text(BASE)
    return h


def ch(*args: str) -> tuple[int, str, str]:
    res = CliRunner().invoke(channels_group, list(args), catch_exceptions=False)
    return res.exit_code, res.stdout, res.stderr


def config_text(home: Path) -> str:
    return (home / "config.toml").read_bytes().decode()


def refused(home: Path, code: int, *args: str) -> str:
    """Run a command that must fail with `code`, one line on stderr, and config.toml untouched."""
    before = config_text(home)
    got, out, err = ch(*args)
    assert got == code, (got, out, err)
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert config_text(home) == before
    return err


# ── add / remove / enable / disable ─────────────────────────────────────────────────────────────


def test_add_then_remove_round_trip_keeps_the_file(home: Path) -> None:
    code, out, err = ch(
        "add",
        "webhook",
        "main",
        "--set",
        "listen=127.0.0.1:8788",
        "--set",
        "reply_url=http://127.0.0.1:9000/replies",
        "--set",
        "default_agent=assistant",
        "--set",
        "chat_rate=2.5",
        "--set",
        "stream=false",
        "--set",
        "max_body_bytes=4000",
        "--set",
        'deny_notice="12345"',
        "--set",
        'admins=["a", "b"]',
        "--secret",
        "secret=file:secrets/webhook.key",
    )
    assert code == 0, err
    assert "Added account webhook:main" in out and "not enabled" in out
    text = config_text(home)
    assert text.startswith(BASE)  # everything before is byte for byte what it was
    assert "\n[channels.webhook.accounts.main]\n" in text
    account = load_config(home).channels.accounts["webhook"]["main"]
    assert account.settings == {
        "listen": "127.0.0.1:8788",
        "reply_url": "http://127.0.0.1:9000/replies",
        "default_agent": "assistant",
        "chat_rate": 2.5,
        "stream": False,
        "max_body_bytes": 4000,
        "deny_notice": "12345",
        "admins": ["a", "b"],
    }
    assert account.secret_refs == {"secret": {"file": "secrets/webhook.key"}}

    code, out, err = ch("remove", "webhook", "main")
    assert code == 0, err
    assert config_text(home) == BASE
    assert load_config(home).channels.accounts == {}
    refused(home, 1, "remove", "webhook", "main")


def test_add_with_enable_and_enable_disable_round_trip(home: Path) -> None:
    assert ch("add", "webhook", "main", "--set", "listen=127.0.0.1:8788", "--enable")[0] == 0
    cfg = load_config(home)
    assert cfg.channels.enabled == ["webhook"]
    text = config_text(home)
    assert text.index('[channels]\nenabled = ["webhook"]\n') < text.index("[channels.webhook.accounts.main]")

    code, out, _ = ch("enable", "webhook")
    assert code == 0 and "already enabled" in out

    code, out, _ = ch("disable", "webhook")
    assert code == 0 and "disabled" in out and "next `appserver serve`" in out
    assert load_config(home).channels.enabled == []
    assert "enabled = []\n" in config_text(home)
    code, out, _ = ch("disable", "webhook")
    assert code == 0 and "already disabled" in out

    assert ch("enable", "webhook")[0] == 0
    assert load_config(home).channels.enabled == ["webhook"]
    assert config_text(home).startswith(BASE)


def test_enable_edits_a_hand_written_enabled_and_keeps_its_comments(home: Path) -> None:
    (home / "config.toml").write_text(
        BASE
        + "\n[channels]\n"
        + "# which channels run\n"
        + "enabled = [\n"
        + '  "webhook",  # the first [one]\n'
        + "]\n"
        + "\n"
        + "# the main hook\n"
        + "[channels.webhook.accounts.main]\n"
        + 'listen = "127.0.0.1:8788"  # loopback\n'
    )
    code, _, err = ch("enable", "telegram")
    assert code == 0
    text = config_text(home)
    assert 'enabled = ["webhook", "telegram"]\n' in text
    assert "# which channels run\n" in text and "# the main hook\n" in text and "# loopback" in text
    assert load_config(home).channels.enabled == ["webhook", "telegram"]
    if not (Path(__file__).resolve().parents[1] / "plugins" / "discord").exists():
        code, _, err = ch("enable", "discord")  # first-party, not built yet: a warning, not a refusal
        assert code == 0 and "not built yet" in err

    (home / "config.toml").write_text(BASE + '\n[channels]\nenabled = ["webhook", "telegram"]  # both\n')
    assert ch("disable", "telegram")[0] == 0
    assert config_text(home) == BASE + '\n[channels]\nenabled = ["webhook"]  # both\n'


def test_enable_creates_channels_table_before_its_subtables(home: Path) -> None:
    hook = '\n# the main hook\n[channels.webhook.accounts.main]\nlisten = "127.0.0.1:9999"\n'
    (home / "config.toml").write_text(BASE + hook)
    assert ch("enable", "webhook")[0] == 0
    assert config_text(home) == (BASE + '\n[channels]\nenabled = ["webhook"]\n' + hook)
    assert load_config(home).channels.enabled == ["webhook"]


def test_remove_cuts_only_its_table(home: Path) -> None:
    rest = (
        '\n[channels]\nenabled = ["webhook"]\n'
        "\n# first account\n"
        "[channels.webhook.accounts.one]\n"
        'listen = "127.0.0.1:8001"\n'
        "# chat_rate = 2\n"
        "\n# second account, with a string that looks like a header\n"
        "[channels.webhook.accounts.two]\n"
        'listen = "127.0.0.1:8002"\n'
        'greeting = """\n[channels.webhook.accounts.one]\nnot a table\n"""\n'
        "allow = [\n  [1, 2],\n]\n"
        "[channels.webhook.accounts.two.extra]\n"
        "k = 1\n"
        "\n[cron]\ntick_s = 30.0\n"
    )
    (home / "config.toml").write_text(BASE + rest)
    assert ch("remove", "webhook", "one")[0] == 0
    text = config_text(home)
    assert "[channels.webhook.accounts.one]\nlisten" not in text and "# first account" not in text
    assert "# chat_rate = 2" not in text
    assert "# second account, with a string that looks like a header\n[channels.webhook.accounts.two]" in text
    cfg = load_config(home)
    assert list(cfg.channels.accounts["webhook"]) == ["two"]
    assert (
        cfg.channels.accounts["webhook"]["two"].settings["greeting"] == "[channels.webhook.accounts.one]\nnot a table\n"
    )

    assert ch("remove", "webhook", "two")[0] == 0  # with its subtable, and nothing after it
    assert config_text(home) == BASE + '\n[channels]\nenabled = ["webhook"]\n\n[cron]\ntick_s = 30.0\n'
    cfg = load_config(home)
    assert cfg.channels.accounts == {} and cfg.cron.tick_s == 30.0


def test_remove_refuses_an_account_defined_another_way(home: Path) -> None:
    (home / "config.toml").write_text(BASE + '\n[channels.webhook]\naccounts.main.listen = "127.0.0.1:8788"\n')
    err = refused(home, 1, "remove", "webhook", "main")
    assert "edit it by hand" in err
    (home / "config.toml").write_text(BASE + '\n[channels.webhook.accounts]\nmain = { listen = "127.0.0.1:9999" }\n')
    refused(home, 1, "remove", "webhook", "main")


def test_enabled_defined_another_way_is_refused(home: Path) -> None:
    (home / "config.toml").write_text('channels.enabled = ["webhook"]\n' + BASE)
    assert "edit it by hand" in refused(home, 1, "enable", "telegram")
    (home / "config.toml").write_text('channels = { enabled = ["webhook"] }\n' + BASE)
    assert "edit it by hand" in refused(home, 1, "disable", "webhook")
    assert "edit it by hand" in refused(home, 1, "add", "webhook", "main", "--set", "listen=127.0.0.1:9999")


def test_crlf_file_round_trip(home: Path) -> None:
    original = BASE.replace("\n", "\r\n").encode()
    (home / "config.toml").write_bytes(original)
    assert ch("add", "webhook", "main", "--set", "listen=127.0.0.1:9999", "--enable")[0] == 0
    text = (home / "config.toml").read_bytes()
    assert b'\r\n[channels.webhook.accounts.main]\r\nlisten = "127.0.0.1:9999"\r\n' in text
    assert b"\n" not in text.replace(b"\r\n", b"")
    assert load_config(home).channels.enabled == ["webhook"]
    assert ch("remove", "webhook", "main")[0] == 0
    assert ch("disable", "webhook")[0] == 0
    assert (home / "config.toml").read_bytes() == original + b"\r\n[channels]\r\nenabled = []\r\n"


def test_remove_fixes_a_config_that_does_not_load(home: Path) -> None:
    (home / "config.toml").write_text(BASE + '\n[channels.webhook.accounts.bad]\ntoken = "inline!"\n')
    code, _, err = ch("remove", "webhook", "bad")
    assert code == 0, err
    assert config_text(home) == BASE
    load_config(home)


def test_add_refusals_write_nothing(home: Path) -> None:
    assert "inline" in refused(home, 2, "add", "webhook", "main", "--set", "token=abc123")
    assert "bot_token" in refused(home, 2, "add", "webhook", "main", "--set", "bot_token=abc")
    assert "not a channel id" in refused(home, 2, "add", "Web!", "main")
    assert "not an account name" in refused(home, 2, "add", "webhook", "no way")
    assert "not an account name" in refused(home, 2, "add", "webhook", "a" * 65)
    err = refused(home, 2, "add", "nosuch", "main")
    assert "unknown channel 'nosuch'" in err and "webhook" in err and "telegram" in err
    assert "KEY=VALUE" in refused(home, 2, "add", "webhook", "main", "--set", "novalue")
    assert "NAME=env:VARIABLE" in refused(home, 2, "add", "webhook", "main", "--secret", "token=abc")
    assert "twice" in refused(home, 2, "add", "webhook", "main", "--set", "a=1", "--set", "a=2")
    assert "letters" in refused(home, 2, "add", "webhook", "main", "--set", "a.b=1")
    assert "environment variable" in refused(home, 2, "add", "webhook", "main", "--secret", "token=env:1BAD")
    assert "wrong type" in refused(home, 2, "add", "webhook", "main", "--set", "stream=yes")

    assert ch("add", "webhook", "main", "--set", "listen=127.0.0.1:9999")[0] == 0
    assert "already exists" in refused(home, 1, "add", "webhook", "main", "--set", "listen=127.0.0.1:9998")


@pytest.mark.parametrize(
    ("channel", "setting", "says"),
    [
        ("slack", "dm_policy=bogus", "dm_policy must be one of open, allowlist, pairing, disabled, got 'bogus'"),
        ("webhook", "group_policy=everyone", "group_policy must be one of"),
        ("discord", "unpaired=loud", "unpaired must be 'code' or 'silent'"),
        ("telegram", "allow=5", "allow"),
        (
            "slack",
            "debounce_ms=-5",
            "debounce_ms must be a number of milliseconds ≥ 0 and at most 600000 (10 min), got -5",
        ),
        ("slack", "debounce_ms=fast", "debounce_ms must be a number"),
        ("webhook", "max_items=0", "max_items must be a positive integer"),
        ("slack", "api_url=ftp://x", "api_url must be an http:// or https:// URL"),
        ("discord", "gateway_url=https://x", "gateway_url must be a ws:// or wss:// URL"),
        ("telegram", "poll_timeout=999", "poll_timeout must be a number of seconds from 0 to 50, got 999"),
        ("telegram", "api_url=ftp://x", "api_url must be an http:// or https:// URL"),
        ("telegram", "edited=maybe", 'edited must be "ignore" or "new", got \'maybe\''),
        ("telegram", "mode=webhook", 'mode must be "polling"'),
        ("webhook", "listen=notanaddr", "listen must be host:port"),
        ("webhook", "reply_url=ftp://x", "reply_url must be an http:// or https:// URL"),
        ("webhook", "tolerance_s=-5", "tolerance_s must be a positive number of seconds"),
        ("webhook", "max_body_bytes=hello", "max_body_bytes must be a positive integer"),
        ("webhook", "path=nope", "path must be a string starting with '/'"),
    ],
)
def test_add_refuses_settings_the_gateway_would_refuse(home: Path, channel: str, setting: str, says: str) -> None:
    """Checked by the gateway's own code (access policy, debounce, the plugin's check_settings)
    before anything is written, not only once `serve` starts the account."""
    err = refused(home, 2, "add", channel, "main2", "--set", setting)
    assert says in err and f"[channels.{channel}.accounts.main2]" in err and "nothing written" in err
    refused(home, 2, "add", "slack", "main2", "--set", "debounce_ms=3000", "--set", "max_wait_ms=1000")
    code, _, err = ch("add", "slack", "main2", "--set", "dm_policy=allowlist", "--set", "debounce_ms=1500")
    assert code == 0, err


def test_list_and_status_flag_an_account_with_bad_settings(home: Path) -> None:
    """Written by hand (or by an older version): the CLI says so before a server refuses it."""
    (home / "config.toml").write_text(
        BASE
        + '[channels]\nenabled = ["slack"]\n'
        + '[channels.slack.accounts.main]\ndm_policy = "bogus"\n'
        + '[channels.slack.accounts.good]\ndm_policy = "open"\n'
        + "[channels.discord.accounts.d]\ndebounce_ms = -5\n"
        + '[channels.discord.accounts.e]\napi_url = "discord.example"\n'
    )
    code, out, err = ch("list")
    assert code == 0, err
    rows = {line.split()[0]: line for line in out.splitlines() if line.split()[:1] in (["slack"], ["discord"])}
    assert rows["slack"].endswith("bad settings: main (below)")
    assert "bad settings: d, e (below)" in rows["discord"]
    assert "slack:main: [channels.slack.accounts.main] dm_policy must be one of" in out
    assert "discord:d: [channels.discord.accounts.d] debounce_ms must be a number" in out
    assert "discord:e: [channels.discord.accounts.e] api_url must be an http:// or https:// URL" in out
    assert "does not start" in out and "Traceback" not in out + err

    code, out, _ = ch("list", "--json")
    by_id = {r["id"]: r for r in json.loads(out)["channels"]}
    assert list(by_id["slack"]["account_errors"]) == ["main"]
    assert sorted(by_id["discord"]["account_errors"]) == ["d", "e"]
    assert by_id["webhook"]["account_errors"] == {}

    code, out, _ = ch("status")
    line = next(x for x in out.splitlines() if x.startswith("slack") and " main " in x)
    assert "bad settings: dm_policy must be one of" in line
    accounts = {a["account"]: a for a in json.loads(ch("status", "--json")[1])["accounts"]}
    assert accounts["good"]["settings_error"] is None and "debounce_ms" in accounts["d"]["settings_error"]


def test_enable_refuses_unknown_and_bad_ids(home: Path) -> None:
    assert "unknown channel" in refused(home, 2, "enable", "nosuch")
    assert "not a channel id" in refused(home, 2, "enable", "Bad")
    assert "not a channel id" in refused(home, 2, "disable", "Bad")


def test_user_plugin_is_a_known_channel(home: Path) -> None:
    shutil.copytree(ROOT / "examples" / "plugins" / "echo_room", home / "channels" / "echo_room")
    code, _, err = ch("add", "echo_room", "lobby", "--set", "room=hall", "--enable")
    assert code == 0, err
    cfg = load_config(home)
    assert cfg.channels.enabled == ["echo_room"] and cfg.channels.accounts["echo_room"]["lobby"].settings == {
        "room": "hall"
    }


# ── list ────────────────────────────────────────────────────────────────────────────────────────


def test_list_shows_broken_manifests(home: Path) -> None:
    shutil.copytree(ROOT / "examples" / "plugins" / "echo_room", home / "channels" / "echo_room")
    wrong = home / "channels" / "wrongid"
    wrong.mkdir(parents=True)
    (wrong / "channel.json").write_text('{"id": "other", "entry": "plugin.py"}')
    garbled = home / "channels" / "garbled"
    garbled.mkdir()
    (garbled / "channel.json").write_text("{not json")
    assert ch("add", "webhook", "main", "--set", "listen=127.0.0.1:9999", "--enable")[0] == 0

    code, out, err = ch("list")
    assert code == 0, err
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert "first-party" in lines["webhook"] and "yes" in lines["webhook"] and "main" in lines["webhook"]
    assert "plugin" in lines["echo_room"] and "broken" not in lines["echo_room"]
    assert "broken" in lines["wrongid"] and "broken" in lines["garbled"]
    assert "must equal the folder name" in out
    assert "not valid JSON" in out and "moved aside to channel.json.corrupt-" in out

    code, out, _ = ch("list", "--json")
    rows = {r["id"]: r for r in json.loads(out)["channels"]}
    assert rows["webhook"]["enabled"] and rows["webhook"]["accounts"] == ["main"] and rows["webhook"]["error"] is None
    assert rows["echo_room"]["kind"] == "plugin" and rows["echo_room"]["error"] is None
    assert "must equal the folder name" in rows["wrongid"]["error"]
    assert rows["garbled"]["error"]  # moved aside by the first look, still shown as an error
    assert rows["telegram"]["kind"] == "first-party"


# ── routes ──────────────────────────────────────────────────────────────────────────────────────


def create_agents(*names: str) -> None:
    for name in names:
        res = CliRunner().invoke(agents_group, ["create", "--name", name], catch_exceptions=False)
        assert res.exit_code == 0, res.output


def helper_conversation() -> str:
    """A conversation of agent `helper` (a pin must name one of the route agent's)."""
    from appserver.cli.common import with_server
    from appserver.store.records import ConversationRecord

    async def go(s: Any) -> str:
        agent = await s.kernel.resolve_agent("helper")
        return (await s.store.create_conversation(ConversationRecord(id="conv_1", agent_id=agent.id))).id

    return with_server(go)


def test_route_add_list_remove(home: Path) -> None:
    create_agents("helper", "other")
    code, out, err = ch("route", "add", "webhook:main:chat1", "assistant")
    assert code == 0, out
    assert "webhook:main:chat1:__root__ -> assistant" in out
    assert "no account webhook:main" in err  # a warning, the route is kept
    conv_1 = helper_conversation()
    assert ch("route", "add", "webhook:main:chat1:t9", "helper", "--conversation", conv_1)[0] == 0
    assert ch("route", "add", "webhook:other:chat2", "assistant")[0] == 0
    code, out, _ = ch("route", "add", "webhook:main:chat1", "other")
    assert code == 0 and "replaced the route to assistant" in out

    conn = open_db(default_path(home))
    try:
        routes = Router(conn).routes("webhook", "main")
    finally:
        conn.close()
    assert [(str(r.key), r.agent, r.conversation) for r in routes] == [
        ("webhook:main:chat1:__root__", "other", None),
        ("webhook:main:chat1:t9", "helper", conv_1),
    ]

    code, out, _ = ch("route", "list", "webhook", "main", "--json")
    assert [(r["key"], r["agent"], r["thread"]) for r in json.loads(out)] == [
        ("webhook:main:chat1:__root__", "other", "__root__"),
        ("webhook:main:chat1:t9", "helper", "t9"),
    ]
    code, out, _ = ch("route", "list")
    assert code == 0 and "webhook:other:chat2:__root__" in out and conv_1 in out

    assert ch("route", "remove", "webhook:main:chat1:__root__")[0] == 0
    code, _, err = ch("route", "remove", "webhook:main:chat1")
    assert code == 1 and err == "error: no route at webhook:main:chat1:__root__\n"
    code, out, _ = ch("route", "list", "webhook", "main")
    assert "chat1:t9" in out and "__root__" not in out


@pytest.mark.parametrize(
    "key",
    [
        "nocolons",
        "a:b",
        "a:b:c:d:e",
        "webhook::chat",
        "webhook:main:chat:",
        "Web:main:chat",
        "webhook:a b:c",
        "telegram:main:1\n2",  # a newline would split the route's line in `route list`
        "webhook:main:chat:t\x00",
        "slack:main:C01 23",  # a platform id has no space inside: such a route would never match
        "slack:main:" + "C" * 201,
    ],
)
def test_bad_route_key_is_exit_2(home: Path, key: str) -> None:
    code, _, err = ch("route", "add", key, "assistant")
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert not default_path(home).exists()  # nothing written, not even an empty database


def test_spaces_around_route_key_parts_are_refused(home: Path) -> None:
    """`'slack:main:C0123ABCD '` was kept with its space and never matched a message; then (session
    29) stripping it routed a webhook chat `" kit "` to `kit`'s agent: refused, as the webhook does."""
    assert ch("route", "add", " slack:main:C0123ABCD ", "assistant")[0] == 2
    assert ch("route", "add", "slack: main :C9\t: 17.5 ", "assistant")[0] == 2
    assert ch("route", "add", "slack:main:C0123ABCD", "assistant")[0] == 0
    assert ch("route", "add", "slack:main:C9:17.5", "assistant")[0] == 0
    conn = open_db(default_path(home))
    try:
        Router(conn).add(RouteKey.parse("slack:main:C7 "), "assistant", None)  # as an older version kept it
        keys = [str(r.key) for r in Router(conn).routes("slack", "main")]
    finally:
        conn.close()
    assert keys == ["slack:main:C0123ABCD:__root__", "slack:main:C7 :__root__", "slack:main:C9:17.5"]
    code, out, _ = ch("route", "remove", "slack:main:C7 :__root__")  # as `route list` shows it
    assert code == 0 and out == "Removed the route at slack:main:C7 :__root__.\n", out
    assert ch("route", "remove", "slack:main:C0123ABCD  ")[0] != 0  # no route with those spaces
    assert ch("route", "remove", "slack:main:C0123ABCD")[0] == 0


def test_route_add_refuses_an_agent_that_does_not_exist(home: Path) -> None:
    code, _, err = ch("route", "add", "slack:main:C1", "nosuchagent")
    assert code == 2 and err.startswith("error: unknown agent 'nosuchagent'") and err.count("\n") == 1, err
    assert "appserver agents create" in err and "nothing written" in err
    assert not default_path(home).exists()  # no route table written
    create_agents("helper")
    assert ch("route", "add", "slack:main:C1", "helper")[0] == 0
    agents = json.loads(CliRunner().invoke(agents_group, ["list", "--json"], catch_exceptions=False).stdout)
    helper_id = next(a["id"] for a in agents if a["name"] == "helper")
    assert ch("route", "add", "slack:main:C2", helper_id)[0] == 0  # by id, as the server resolves it
    conn = open_db(default_path(home))
    try:
        assert [(str(r.key), r.agent) for r in Router(conn).routes("slack", "main")] == [
            ("slack:main:C1:__root__", "helper"),
            ("slack:main:C2:__root__", helper_id),
        ]
    finally:
        conn.close()


def test_route_list_without_gateway_db(home: Path) -> None:
    code, out, _ = ch("route", "list")
    assert code == 0 and "No routes" in out and "does not exist yet" in out
    assert not default_path(home).exists()


# ── status ──────────────────────────────────────────────────────────────────────────────────────


def _seed_status(home: Path) -> None:
    now = time.time()
    conn = open_db(default_path(home))
    try:
        StatusBoard(conn).save(
            [
                AccountStatus("webhook", "main", "running", None, now - 12, now - 300, 5, 4, 4, 0, now),
                AccountStatus("webhook", "old", "stopped", "not configured", None, None, 1, 1, 0, 1, now),
            ]
        )
        ledger = Ledger(conn)
        for i in range(3):
            ledger.record(UpdateKey("webhook", "main", f"m{i}"), chat="c", sender="s")
        ledger.decide(UpdateKey("webhook", "main", "m0"), "deny", "not allowed")
    finally:
        conn.close()


def test_status_without_gateway_db(home: Path) -> None:
    assert ch("add", "webhook", "main", "--set", "listen=127.0.0.1:9999", "--enable")[0] == 0
    code, out, err = ch("status")
    assert code == 0, err
    assert "does not exist yet" in out
    assert "never started" in out
    assert "Server: not running" in out
    assert not default_path(home).exists()


def test_status_from_gateway_db(home: Path) -> None:
    assert ch("add", "webhook", "main", "--set", "listen=127.0.0.1:9999", "--enable")[0] == 0
    assert ch("add", "webhook", "spare", "--set", "listen=127.0.0.1:9998")[0] == 0
    _seed_status(home)
    code, out, err = ch("status")
    assert code == 0, err
    rows = {line.split()[1]: line for line in out.splitlines() if line.startswith("webhook")}
    assert rows["main"].split()[2:11] == ["running", "12s", "ago", "5m", "ago", "5", "4", "4", "0"]
    assert "never started" in rows["spare"]
    assert "stopped" in rows["old"] and "not configured" in rows["old"]
    assert "Ledger: 2 received, 1 denied" in out

    code, out, _ = ch("status", "--json")
    body = json.loads(out)
    accounts = {a["account"]: a for a in body["accounts"]}
    assert accounts["main"]["state"] == "running" and accounts["main"]["messages_in"] == 5
    assert accounts["spare"]["started"] is False and accounts["spare"]["state"] is None
    assert accounts["old"]["configured"] is False
    assert body["ledger"]["received"] == 2 and body["ledger"]["denied"] == 1 and body["ledger"]["delivered"] == 0
    assert body["server"] is None


def test_corrupt_gateway_db_is_loud(home: Path) -> None:
    db = default_path(home)
    db.parent.mkdir(parents=True)
    db.write_bytes(b"this is not a database" * 100)
    code, out, err = ch("status")
    assert code == 1 and "corrupt" in err and "moved aside" in err and err.count("\n") == 1
    assert not db.exists()
    assert [p.name.startswith("gateway.db.corrupt-") for p in db.parent.iterdir()] == [True]


class _Readyz(BaseHTTPRequestHandler):
    body: dict[str, Any] = {}

    def do_GET(self) -> None:
        data = json.dumps(self.body).encode()
        self.send_response(200 if self.path == "/readyz" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def readyz() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Readyz)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_status_shows_the_live_check_and_an_unreachable_server(home: Path, readyz: str) -> None:
    assert ch("add", "webhook", "main", "--set", "listen=127.0.0.1:9999", "--enable")[0] == 0
    _seed_status(home)
    _Readyz.body = {
        "status": "not_ready",
        "checks": [{"name": "channels", "status": "fail", "detail": "gateway running; webhook:main backoff (boom)"}],
    }
    write_server_json(home / "server.json", readyz, "none")  # this process: a live server's identity
    code, out, err = ch("status")
    assert code == 0, err
    assert f"running at {readyz}; live channels check fail: gateway running; webhook:main backoff (boom)" in out
    assert "running" in out.splitlines()[2]  # the recorded rows are shown too
    body = json.loads(ch("status", "--json")[1])
    assert body["server"]["reachable"] and body["server"]["channels"]["status"] == "fail"

    code, out, _ = ch("enable", "webhook")
    assert "already enabled" in out
    code, out, _ = ch("disable", "webhook")
    assert code == 0 and f"A server is running at {readyz}" in out and "restarted" in out

    # a server that holds the home but does not answer (stuck): nothing listens at its URL
    from appserver.serverinfo import HomeLock, home_lock_path

    write_server_json(home / "server.json", "http://127.0.0.1:9", "none")
    lock = HomeLock(home_lock_path(home / "server.json"))
    assert lock.try_acquire(holder="appserver serve")
    try:
        code, out, err = ch("status")
    finally:
        lock.release()
    assert code == 0, err
    assert "could not be read" in out and "last recorded" in out
    assert "webhook  main" in out


# ── the real command line ───────────────────────────────────────────────────────────────────────


def test_real_cli_exit_codes(tmp_path: Path) -> None:
    home = tmp_path / "home"
    r = run_cli(home, "channels", "add", "webhook", "main", "--set", "listen=127.0.0.1:8788", "--enable")
    assert r.code == 0, r.err
    r = run_cli(home, "channels", "add", "webhook", "main", "--set", "token=x")
    assert r.code == 2 and r.err.startswith("error: ") and "inline" in r.err
    r = run_cli(home, "channels", "route", "add", "webhook:main", "assistant")
    assert r.code == 2 and "channel:account:chat" in r.err
    r = run_cli(home, "channels", "route", "add", "webhook:main:c1", "nosuchagent")
    assert r.code == 2 and r.err.startswith("error: unknown agent") and "Traceback" not in r.err, r.err
    r = run_cli(home, "channels", "add", "webhook", "main2", "--set", "dm_policy=bogus")
    assert r.code == 2 and r.err.startswith("error: ") and "dm_policy" in r.err and "Traceback" not in r.err
    r = run_cli(home, "channels", "status", "--json")
    assert r.code == 0, r.err
    assert [a["account"] for a in r.json()["accounts"]] == ["main"]
