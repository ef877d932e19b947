"""A channel account's setting written the way a secret is given (`<key>_env`, `<key>_file`) is
refused unless the key is a secret its plugin reads; an id list written as a string, and `"*"` in
`admins`, are refused too.

Was (attack e, F3): `dm_policy_env = "DMP"`, `allow_env = "ALLOWED"`, `group_policy_env`, `admins_file`
and `appserver channels add … --secret allow=env:X` were accepted without a word and ignored:
`channels list`, `channels status`, `/readyz` and the log said nothing, and the account ran with the
default policy and an empty allowlist (on the webhook, whose default dm_policy is `open`: open).
`allow = "U1 U2"` was read as one id and `admins = ["*"]` made nobody an admin, silently. Now
`channels add` refuses each (exit 2, nothing written), and a hand-edited config.toml puts the
account in state `error` saying why (status, /readyz, the log) while the others run.
"""

from __future__ import annotations

import asyncio
import importlib.util
import re
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest

from appserver.channels import ChannelService
from appserver.config import load_config
from appserver.readiness import Readiness
from gateway.accounts import AccountRunner, AccountSpec
from plugins.contract import InboundMessage
from tests.support.cli import ROOT, CLIResult, cli_env, run_cli
from tests.support.gateway import channel_server, write_config
from tests.support.net import free_port
from tests.support.wait import wait_for, wait_until

SECRET = "abcdefabcdefabcdefabcdefabcdef12"
# Each first-party channel with the secrets it reads, given by reference
REQUIRED = {
    "webhook": ["--secret", "secret=env:WH_SECRET"],
    "telegram": ["--secret", "token=env:TG_TOKEN"],
    "slack": ["--secret", "bot_token=env:SB", "--secret", "app_token=file:secrets/slack-app"],
    "discord": ["--secret", "token=file:secrets/discord"],
}
CHANNELS = sorted(REQUIRED)
# A gateway setting given as a secret is, with the key it writes and the setting it names
AS_SECRET = [
    (["--set", "dm_policy_env=DMP"], "dm_policy_env", "dm_policy"),
    (["--secret", "allow=env:ALLOWED"], "allow_env", "allow"),
    (["--secret", "admins=file:admins.txt"], "admins_file", "admins"),
    (["--set", "group_policy_env=GP"], "group_policy_env", "group_policy"),
]
# Per channel: one of its own settings given as a secret is, and a name it reads no secret by
OWN_SETTING = {"webhook": "reply_url_env", "telegram": "poll_timeout_file", "slack": "api_url_env"}
OWN_SETTING["discord"] = "gateway_url_env"
NOT_ITS_SECRET = {"webhook": "token_env", "telegram": "secret_env", "slack": "signing_secret_env"}
NOT_ITS_SECRET["discord"] = "bot_token_env"
SECRETS = {"webhook": "secret", "telegram": "token", "slack": "app_token, bot_token", "discord": "token"}


def add(home: Path, channel: str, *args: str, env: dict[str, str] | None = None) -> CLIResult:
    return run_cli(home, "channels", "add", channel, "main", *REQUIRED[channel], *args, env=env)


def assert_refused(home: Path, res: CLIResult, *says: str) -> None:
    """Exit 2, one error line saying each of `says`, and no account written."""
    assert res.code == 2, (res.code, res.out, res.err)
    assert res.err.startswith("error: ") and res.err.count("\n") == 1, res.err
    assert "nothing written" in res.err, res.err
    for words in says:
        assert words in res.err, (words, res.err)
    config = home / "config.toml"
    assert not config.exists() or "[channels." not in config.read_text(), config.read_text()


# ── channels add ────────────────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize("channel", CHANNELS)
@pytest.mark.parametrize(("given", "key", "name"), AS_SECRET, ids=[key for _, key, _ in AS_SECRET])
def test_channels_add_refuses_a_gateway_setting_given_as_a_secret(
    tmp_path: Path, channel: str, given: list[str], key: str, name: str
) -> None:
    home = tmp_path / "home"
    assert_refused(
        home,
        add(home, channel, *given),
        f"[channels.{channel}.accounts.main] {key}: {name} is a setting, not a secret",
        f"write the value itself: {name} = …",
    )


@pytest.mark.parametrize("channel", CHANNELS)
def test_channels_add_refuses_a_reference_to_anything_but_the_plugins_secrets(tmp_path: Path, channel: str) -> None:
    home = tmp_path / "home"
    own = OWN_SETTING[channel]
    assert_refused(
        home,
        add(home, channel, "--set", f"{own}=X"),
        f"{own}: {own.rpartition('_')[0]} is a setting, not a secret",
    )
    other = NOT_ITS_SECRET[channel]
    assert_refused(
        home,
        add(home, channel, "--set", f"{other}=X"),
        f"{other}: {other.rpartition('_')[0]} is not a secret of this channel (its secrets: {SECRETS[channel]})",
    )


def test_a_misspelt_secret_is_refused_naming_the_one_meant(tmp_path: Path) -> None:
    home = tmp_path / "home"
    res = run_cli(
        home, "channels", "add", "slack", "main", "--secret", "bot_tokn=env:SB", "--secret", "app_token=env:SA"
    )
    assert_refused(home, res, "bot_tokn_env: bot_tokn is not a secret", "(did you mean bot_token_env?)")


@pytest.mark.parametrize("channel", CHANNELS)
def test_each_declared_secret_is_still_taken_from_a_variable_or_a_file(tmp_path: Path, channel: str) -> None:
    home = tmp_path / "home"
    res = add(home, channel, "--set", 'allow=["*"]', "--set", 'admins=["U1", 2]')
    assert res.code == 0, res.err
    account = load_config(home).channels.accounts[channel]["main"]
    given = {a.split("=")[0] for a in REQUIRED[channel] if "=" in a}
    assert set(account.secret_refs) == given and account.problem is None, account
    assert account.settings == {"allow": ["*"], "admins": ["U1", 2]}


# The ways a first-party adapter reads a secret: `secrets.get("name")`
READS_SECRET = re.compile(r'secrets\.get\(\s*"([a-z_]+)"')


@pytest.mark.parametrize("channel", CHANNELS)
def test_the_secrets_a_plugin_declares_are_the_ones_it_reads(channel: str) -> None:
    """A secret read but not declared would be refused in every account that gives it."""
    spec = importlib.util.spec_from_file_location(f"s35g_{channel}", ROOT / "plugins" / channel / "settings.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    read = {n for path in (ROOT / "plugins" / channel).glob("*.py") for n in READS_SECRET.findall(path.read_text())}
    assert read and read == set(module.SECRETS), (channel, read, module.SECRETS)


@pytest.mark.parametrize(
    ("setting", "says"),
    [
        ("allow=U1", "allow must be a list of sender ids, such as allow = ["),
        ('allow="U1 U2"', "got the string 'U1 U2': a string is not split into ids"),
        ("admins=U9", "admins must be a list of sender ids"),
        ('admins=["U1", "*"]', 'admins takes sender ids only, got "*": the wildcard "*" means everyone in allow'),
    ],
)
def test_channels_add_refuses_an_id_list_that_is_no_list_and_a_wildcard_admin(
    tmp_path: Path, setting: str, says: str
) -> None:
    home = tmp_path / "home"
    assert_refused(home, add(home, "slack", "--set", setting), says)


def test_an_environment_override_still_gives_ids_split_at_its_commas(tmp_path: Path) -> None:
    """A variable holds a string: `…__ALLOW=U1,U2` is the documented way to give two ids there."""
    home = tmp_path / "home"
    write_config(home, {"slack": {"main": {"bot_token_env": "SB", "app_token_env": "SA"}}}, ["slack"])
    environ = {"APPSERVER_CHANNELS__SLACK__ACCOUNTS__MAIN__ALLOW": "U1, U2", "HOME": str(tmp_path)}
    account = load_config(home, environ).channels.accounts["slack"]["main"]
    assert account.settings["allow"] == ["U1", "U2"] and account.problem is None, account
    res = run_cli(home, "channels", "list", "--json", env=cli_env(home, **environ))
    assert res.code == 0, res.err
    rows = {r["id"]: r for r in res.json()["channels"]}
    assert rows["slack"]["account_errors"] == {}, rows["slack"]


# ── a config.toml edited by hand ────────────────────────────────────────────────────────────────

HAND_EDITED: dict[str, dict[str, dict[str, Any]]] = {
    "slack": {
        "main": {
            "bot_token_env": "SB",
            "app_token_env": "SA",
            "dm_policy_env": "DMP",
            "allow_env": "ALLOWED",
            "admins_file": "admins.txt",
        },
        "spaced": {"bot_token_env": "SB2", "app_token_env": "SA2", "allow": "U1 U2"},
        "good": {"bot_token_env": "SB3", "app_token_env": "SA3", "allow": ["U1"]},
    },
    "webhook": {"w1": {"secret_env": "WH_SECRET", "group_policy_env": "GP"}},
}


def test_the_server_refuses_hand_edited_accounts_at_start_and_the_cli_says_why(tmp_path: Path) -> None:
    """What `serve` hands its gateway child: the bad accounts with their reason (state `error`)."""
    home = tmp_path / "home"
    write_config(home, HAND_EDITED, ["slack", "webhook"])
    refused = ChannelService(load_config(home), Readiness()).refused
    assert set(refused) == {"slack:main", "slack:spaced", "webhook:w1"}, refused
    assert refused["slack:main"].startswith(
        "admins_file: admins is a setting, not a secret, and is never read from a file; write the value itself"
    ), refused
    assert "allow_env: allow is a setting" in refused["slack:main"], refused
    assert "dm_policy_env: dm_policy is a setting" in refused["slack:main"], refused
    assert "allow must be a list of sender ids" in refused["slack:spaced"], refused
    assert refused["webhook:w1"].startswith("group_policy_env: group_policy is a setting, not a secret"), refused

    res = run_cli(home, "channels", "list")
    assert res.code == 0, res.err
    assert "bad settings: main, spaced (below)" in res.out and "bad settings: w1 (below)" in res.out, res.out
    assert "slack:main: [channels.slack.accounts.main] admins_file: admins is a setting" in res.out, res.out
    res = run_cli(home, "channels", "status", "--json")
    assert res.code == 0, res.err
    errors = {r["account"]: r["settings_error"] for r in res.json()["accounts"]}
    assert errors["good"] is None and "dm_policy_env" in errors["main"] and "allow must be" in errors["spaced"]


async def _settled(spec: AccountSpec, home: Path, environ: dict[str, str]) -> tuple[str, str]:
    """The account's state and reason once the gateway's runner has started it, refused it, or
    backs off after a failed start."""

    async def on_message(msg: InboundMessage) -> None:
        pass

    runner = AccountRunner(spec, home, on_message, lambda r: None, environ)
    task = asyncio.create_task(runner.run())
    try:
        await wait_until(lambda: runner.live.state in ("running", "error", "backoff"), 15.0, "the account to settle")
        return runner.live.state, str(runner.live.reason)
    finally:
        await runner.stop()
        await asyncio.wait_for(task, 10.0)


async def test_the_gateway_refuses_a_reference_the_plugin_reads_no_secret_by(tmp_path: Path) -> None:
    """Known only to the plugin (its settings.py `SECRETS`, the adapter's `secret_keys`): refused by
    the gateway child before the adapter starts, however the account reached it."""
    home = tmp_path / "home"
    main = {"api_url": "http://127.0.0.1:9", "bot_token_env": "SB", "app_token_env": "SA", "signing_secret_env": "SS"}
    accounts = {"slack": {"main": main}}  # a start that was let through reaches nothing (port 9)
    write_config(home, accounts, ["slack"])
    account = load_config(home).channels.accounts["slack"]["main"]
    environ = {"SB": "xoxb-1", "SA": "xapp-1", "SS": "s3cr3t-s3cr3t-s3cr3t"}
    state, reason = await _settled(AccountSpec.from_json(account.to_json()), home, environ)
    assert state == "error", (state, reason)
    assert reason.startswith(
        "signing_secret_env: signing_secret is not a secret of this channel (its secrets: app_token, bot_token)"
    ), reason


USER_PLUGIN = """
from plugins.contract import Limits


class Adapter:
    limits = Limits(max_length=100)
    settings_keys = ("room",)
    secret_keys = ("token",)

    def __init__(self, account, context):
        self.running = False

    @property
    def is_running(self):
        return self.running

    async def start(self):
        self.running = True

    async def stop(self):
        self.running = False

    async def send(self, target, text):
        return []


def create_adapter(account, context):
    return Adapter(account, context)
"""


@pytest.mark.parametrize(
    ("given", "state", "says"),
    [
        ({"token_env": "T"}, "running", None),
        ({"token_env": "T", "room_env": "T"}, "error", "room_env: room is a setting, not a secret"),
        (
            {"token_env": "T", "key_file": "k"},
            "error",
            "key_file: key is not a secret of this channel (its secrets: token)",
        ),
    ],
)
async def test_a_user_plugin_that_declares_its_secrets_has_other_references_refused(
    tmp_path: Path, given: dict[str, str], state: str, says: str | None
) -> None:
    home = tmp_path / "home"
    folder = home / "channels" / "roomy"
    folder.mkdir(parents=True)
    (folder / "channel.json").write_text('{"id": "roomy", "entry": "plugin.py"}')
    (folder / "plugin.py").write_text(USER_PLUGIN)
    (home / "k").write_text("a-key\n")
    write_config(home, {"roomy": {"main": given}}, ["roomy"])
    account = load_config(home).channels.accounts["roomy"]["main"]
    got, reason = await _settled(AccountSpec.from_json(account.to_json()), home, {"T": "a-token"})
    assert got == state, (got, reason)
    assert says is None or reason.startswith(says), reason


def _accounts(srv: Any) -> dict[str, dict[str, Any]]:
    """The channels check of /readyz once no account is starting, else {}."""
    try:
        data = srv.channels_check().get("data") or {}
    except (httpx.HTTPError, AssertionError):  # the check is not registered yet
        return {}
    accounts: dict[str, dict[str, Any]] = data.get("accounts") or {}
    settled = len(accounts) == 2 and all(a["state"] in ("running", "error") for a in accounts.values())
    return accounts if settled else {}


def test_serve_keeps_a_webhook_with_its_policy_given_as_a_secret_shut_and_says_why(tmp_path: Path) -> None:
    """End to end: `serve` and its gateway child. The webhook's default dm_policy is `open`, so the
    account that meant `allowlist` would have let every signed sender in: it does not run at all,
    /readyz and the log say why, and the other account runs."""
    home = tmp_path / "home"
    bad, good = free_port(), free_port()
    accounts = {
        "w1": {"listen": f"127.0.0.1:{bad}", "secret_env": "WH_SECRET", "dm_policy_env": "DMP", "allow_env": "ONE"},
        "w2": {"listen": f"127.0.0.1:{good}", "secret_env": "WH_SECRET", "dm_policy": "allowlist", "allow": ["U1"]},
    }
    write_config(home, {"webhook": accounts}, ["webhook"])
    env = cli_env(home, WH_SECRET=SECRET, DMP="allowlist", ONE="U1")
    with channel_server(home, env=env, ready=False) as srv:
        states = wait_for(lambda: _accounts(srv), 30, "both webhook accounts to settle")
        assert states["webhook:w2"]["state"] == "running", states
        assert states["webhook:w1"]["state"] == "error", states
        reason = str(states["webhook:w1"]["reason"])
        assert "allow_env: allow is a setting, not a secret" in reason, reason
        assert "dm_policy_env: dm_policy is a setting, not a secret" in reason, reason
        assert srv.channels_check()["status"] == "fail"
        assert "webhook:w1 is not started: allow_env: allow is a setting" in srv.log(), srv.log()[-3000:]
        with pytest.raises(httpx.ConnectError):  # nothing listens for w1: no signed sender reaches an agent
            httpx.post(f"http://127.0.0.1:{bad}/", content=b"{}", timeout=5)
        with socket.create_connection(("127.0.0.1", good), timeout=5):  # w2's listener is up
            pass
