"""An unknown key in a channel account's table is refused, naming it and the key it probably meant.

Was: `appserver channels add webhook w1 --set dm_polcy=disabled` exited 0 and wrote the misspelt
key; `serve` then ran the account with the default `dm_policy` (open for the webhook) and logged
nothing. Now `channels add` refuses it (exit 2, nothing written) and the gateway puts such an
account in state `error` while the others run. A user plugin's keys are refused only when the
plugin declares its own (`settings_keys` on the adapter): otherwise the gateway cannot tell a typo
from a key the plugin reads.
"""

from __future__ import annotations

import asyncio
import importlib.util
import re
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from appserver.channelconfig import GATEWAY_KEYS
from appserver.config import load_config
from gateway.accounts import AccountRunner, AccountSpec
from plugins.contract import GATEWAY_SETTINGS, InboundMessage
from tests.support.cli import ROOT, cli_env, run_cli
from tests.support.gateway import channel_server, write_config
from tests.support.net import free_port

SECRET = "abcdefabcdefabcdefabcdefabcdef12"
# One account of each first-party channel with its required secret, and a misspelt gateway key
FIRST_PARTY = {
    "webhook": ["--secret", "secret=env:WH_SECRET"],
    "telegram": ["--secret", "token=env:TG_TOKEN"],
    "slack": ["--secret", "bot_token=env:SB", "--secret", "app_token=env:SA"],
    "discord": ["--secret", "token=env:DC_TOKEN"],
}
# Keys each channel reads, with values it takes: none of them may be refused
KNOWN = {
    "webhook": ["listen=127.0.0.1:8788", "path=/in", "tolerance_s=60", "max_connections=8"],
    "telegram": ["poll_timeout=10", "edited=new", "api_url=http://127.0.0.1:9"],
    "slack": ["api_url=http://127.0.0.1:9"],
    "discord": ["api_url=http://127.0.0.1:9", "gateway_url=ws://127.0.0.1:9"],
}
GATEWAY = ["dm_policy=allowlist", 'allow=["1"]', 'admins=["2"]', "debounce_ms=100", "chat_rate=2", "stream=false"]


def _sets(items: list[str]) -> list[str]:
    return [a for item in items for a in ("--set", item)]


@pytest.mark.parametrize("channel", sorted(FIRST_PARTY))
def test_channels_add_refuses_a_misspelt_key_naming_the_one_meant(tmp_path: Path, channel: str) -> None:
    home = tmp_path / "home"
    args = ["channels", "add", channel, "main", *FIRST_PARTY[channel], "--set", "dm_polcy=disabled", "--enable"]
    res = run_cli(home, *args)
    assert res.code == 2, (res.out, res.err)
    assert res.err.startswith("error: ") and res.err.count("\n") == 1, res.err
    assert "unknown setting 'dm_polcy' (did you mean 'dm_policy'?)" in res.err, res.err
    assert not (home / "config.toml").exists() or "dm_polcy" not in (home / "config.toml").read_text()


def test_channels_add_refuses_a_key_nothing_reads(tmp_path: Path) -> None:
    home = tmp_path / "home"
    res = run_cli(home, "channels", "add", "webhook", "w1", *FIRST_PARTY["webhook"], "--set", "bogus=1")
    assert res.code == 2 and "unknown setting 'bogus'" in res.err and "did you mean" not in res.err, res.err
    assert not (home / "config.toml").exists() or "bogus" not in (home / "config.toml").read_text()


@pytest.mark.parametrize("channel", sorted(FIRST_PARTY))
def test_every_key_a_channel_reads_is_still_accepted(tmp_path: Path, channel: str) -> None:
    home = tmp_path / "home"
    res = run_cli(home, "channels", "add", channel, "main", *FIRST_PARTY[channel], *_sets(KNOWN[channel] + GATEWAY))
    assert res.code == 0, res.err
    account = load_config(home).channels.accounts[channel]["main"]
    assert {*account.settings} == {s.split("=")[0] for s in KNOWN[channel] + GATEWAY}


def test_serve_runs_the_other_accounts_and_the_misspelt_one_is_error(tmp_path: Path) -> None:
    """Through config.toml, `serve` and its gateway child: the typo'd account is `error` naming the
    key, the good one runs (its signed listener is up)."""
    home = tmp_path / "home"
    good, bad = free_port(), free_port()
    accounts: dict[str, dict[str, Any]] = {
        "w1": {"listen": f"127.0.0.1:{bad}", "secret_env": "WH_SECRET", "dm_polcy": "disabled"},
        "w2": {"listen": f"127.0.0.1:{good}", "secret_env": "WH_SECRET"},
    }
    write_config(home, {"webhook": accounts}, ["webhook"])
    env = cli_env(home, WH_SECRET=SECRET)
    with channel_server(home, env=env, ready=False) as srv:
        states = _wait_states(home, env, {"w1", "w2"})
        assert "dm_polcy" in srv.log()
    assert states["w2"]["state"] == "running", states
    assert states["w1"]["state"] == "error", states
    assert "unknown setting 'dm_polcy' (did you mean 'dm_policy'?)" in str(states["w1"]["reason"]), states


def _wait_states(home: Path, env: dict[str, str], names: set[str], timeout: float = 30) -> dict[str, dict[str, Any]]:
    """Each account's row of `channels status --json` once none of `names` is starting any more."""
    deadline = time.monotonic() + timeout
    rows: dict[str, dict[str, Any]] = {}
    while time.monotonic() < deadline:
        res = run_cli(home, "channels", "status", "--json", env=env)
        if res.code == 0:
            rows = {r["account"]: r for r in res.json()["accounts"]}
            if names <= rows.keys() and all(rows[n]["state"] in ("running", "error") for n in names):
                return rows
        time.sleep(0.1)
    raise AssertionError(f"accounts did not settle: {rows}")


# The ways the code reads an account's key: `settings.get("k"`, `s.get("k"`, `number_setting(settings, "k"`
READS = re.compile(r'(?:\bsettings|\bs)\.get\(\s*"([a-z_]+)"|(?:number_setting|_ms)\(\s*settings,\s*"([a-z_]+)"')


def _read_keys(folder: Path) -> set[str]:
    return {a or b for path in folder.glob("*.py") for a, b in READS.findall(path.read_text())}


def _settings_module(channel: str) -> Any:
    """plugins/<channel>/settings.py by its path, as `channels add` loads it (no platform library)."""
    spec = importlib.util.spec_from_file_location(f"s23_settings_{channel}", ROOT / "plugins" / channel / "settings.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_key_the_code_reads_is_declared() -> None:
    """A key the gateway or a first-party plugin reads but does not declare would be refused in
    every account that sets it: the declarations must keep up with the code."""
    gateway = _read_keys(ROOT / "gateway")
    assert {"dm_policy", "debounce_ms", "deny_notice", "stream"} <= gateway  # the scan finds them
    assert gateway | set(GATEWAY_KEYS) <= GATEWAY_SETTINGS
    for channel in FIRST_PARTY:
        declared = _settings_module(channel).SETTINGS
        assert _read_keys(ROOT / "plugins" / channel) <= declared | GATEWAY_SETTINGS, channel


# ── user plugins ────────────────────────────────────────────────────────────────────────────────

DECLARING_PLUGIN = """
from plugins.contract import Limits


class Adapter:
    limits = Limits(max_length=100)
    settings_keys = ("room",)

    def __init__(self, account, context):
        self.context = context
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


def _plugin_home(tmp_path: Path, accounts: dict[str, dict[str, dict[str, Any]]]) -> Path:
    home = tmp_path / "home"
    folder = home / "channels" / "keyed"
    folder.mkdir(parents=True)
    (folder / "channel.json").write_text('{"id": "keyed", "entry": "plugin.py"}')
    (folder / "plugin.py").write_text(DECLARING_PLUGIN)
    shutil.copytree(ROOT / "examples" / "plugins" / "echo_room", home / "channels" / "echo_room")
    write_config(home, accounts, sorted(accounts))
    return home


class Started:
    """An account as the config loads it and the gateway child starts it."""

    def __init__(self, runner: AccountRunner, task: asyncio.Task[None]) -> None:
        self.live = runner.live
        self._runner, self._task = runner, task

    async def stop(self) -> None:
        await self._runner.stop()
        await asyncio.wait_for(self._task, 10.0)


async def _start(home: Path, channel: str, name: str) -> Started:
    account = load_config(home).channels.accounts[channel][name]

    async def on_message(msg: InboundMessage) -> None:
        pass

    runner = AccountRunner(AccountSpec.from_json(account.to_json()), home, on_message, lambda r: None, {})
    task = asyncio.create_task(runner.run())
    await asyncio.wait_for(runner.ready.wait(), 10.0)
    return Started(runner, task)


async def test_a_plugin_that_declares_its_keys_has_unknown_ones_refused(tmp_path: Path) -> None:
    home = _plugin_home(
        tmp_path,
        {"keyed": {"typo": {"rooom": "x", "dm_policy": "open"}, "good": {"room": "x", "dm_policy": "open"}}},
    )
    bad = await _start(home, "keyed", "typo")
    good = await _start(home, "keyed", "good")
    try:
        assert bad.live.state == "error", bad.live
        assert bad.live.reason == "unknown setting 'rooom' (did you mean 'room'?)", bad.live
        assert good.live.state == "running", good.live
    finally:
        await bad.stop()
        await good.stop()


async def test_a_plugin_that_declares_no_keys_keeps_its_own(tmp_path: Path) -> None:
    """echo_room reads `inbox`, `outbox` and `poll_s` without declaring them: nothing is refused."""
    room = tmp_path / "room"
    home = _plugin_home(
        tmp_path, {"echo_room": {"main": {"inbox": str(room / "in.txt"), "poll_s": 0.05, "anything": 1}}}
    )
    runner = await _start(home, "echo_room", "main")
    try:
        assert runner.live.state == "running", runner.live
    finally:
        await runner.stop()
