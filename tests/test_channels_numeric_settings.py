"""Numeric settings that TOML and `--set` accept but no channel can work with (`inf`, `nan`,
`1e308`, absurdly large numbers) are refused, naming the setting: by `appserver channels add` (exit
code 2, nothing written) and when the gateway starts the account (state `error`). Was: `debounce_ms
= inf` accepted and then no message ever answered, `nan` quietly turning the debounce off."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from click.testing import CliRunner

from appserver.cli.channels import channels_group
from gateway.accounts import AccountRunner, AccountSpec
from gateway.debounce import DebounceError, DebounceSettings
from plugins.contract import InboundMessage

BAD = ["inf", "-inf", "nan", "1e308", "100000000000000000000000000000000000"]
GATEWAY_NUMBERS = ["debounce_ms", "max_wait_ms", "max_items", "chat_rate"]
PLUGIN_NUMBERS = [("telegram", "poll_timeout"), ("webhook", "max_body_bytes"), ("webhook", "tolerance_s")]
CASES = [
    *((channel, key) for channel in ("slack", "telegram", "discord", "webhook") for key in GATEWAY_NUMBERS),
    *PLUGIN_NUMBERS,
]


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    h = tmp_path / "home"
    h.mkdir()
    monkeypatch.setenv("APPSERVER_HOME", str(h))
    monkeypatch.delenv("APPSERVER_CHANNELS__ENABLED", raising=False)
    (h / "config.toml").write_text('[server]\nlisten = "127.0.0.1:8770"\n')
    return h


@pytest.mark.parametrize("value", BAD)
@pytest.mark.parametrize(("channel", "key"), CASES)
def test_add_refuses_a_number_no_channel_can_work_with(home: Path, channel: str, key: str, value: str) -> None:
    before = (home / "config.toml").read_bytes()
    res = CliRunner().invoke(channels_group, ["add", channel, "main", "--set", f"{key}={value}"])
    assert res.exit_code == 2, (res.stdout, res.stderr)
    assert f"{key} must be" in res.stderr, res.stderr
    assert (home / "config.toml").read_bytes() == before


def test_sensible_numbers_are_still_accepted(home: Path) -> None:
    settings = ["debounce_ms=1500", "max_wait_ms=60000", "max_items=50", "chat_rate=2.5"]
    args = ["add", "slack", "main", *(a for s in settings for a in ("--set", s))]
    res = CliRunner().invoke(channels_group, args)
    assert res.exit_code == 0, res.stderr
    assert DebounceSettings.from_settings({"debounce_ms": 1500, "max_wait_ms": 60000}).debounce_s == 1.5


@pytest.mark.parametrize(
    "settings",
    [
        {"debounce_ms": float("inf")},
        {"debounce_ms": float("nan")},
        {"debounce_ms": 1e308},
        {"max_wait_ms": float("inf")},
        {"max_items": 10**40},
        {"chat_rate": float("inf")},
        {"chat_rate": -1},
    ],
)
def test_the_gateway_refuses_them_too(settings: dict[str, float]) -> None:
    with pytest.raises(DebounceError, match=f"{next(iter(settings))} must be"):
        DebounceSettings.from_settings(settings)


@pytest.mark.parametrize(
    ("channel", "settings", "says"),
    [
        ("slack", {"debounce_ms": float("inf")}, "debounce_ms must be"),
        ("discord", {"debounce_ms": float("nan")}, "debounce_ms must be"),
        ("telegram", {"chat_rate": 1e308}, "chat_rate must be"),
        ("webhook", {"tolerance_s": float("inf")}, "tolerance_s must be"),
        ("webhook", {"max_body_bytes": 10**40}, "max_body_bytes must be"),
    ],
)
async def test_an_account_with_such_a_number_does_not_start(
    tmp_path: Path, channel: str, settings: dict[str, float], says: str
) -> None:
    states: list[tuple[str, str | None]] = []

    async def on_message(msg: InboundMessage) -> None:
        pass

    spec = AccountSpec(channel, "main", dict(settings), {"secret": {"env": "NONE"}} if channel == "webhook" else {})
    runner = AccountRunner(
        spec,
        tmp_path,
        on_message,
        lambda r: states.append((r.live.state, r.live.reason)),
        {"NONE": "s3cret-numeric-settings"},
    )
    await asyncio.wait_for(runner.run(), 10.0)
    state, reason = states[-1]
    assert state == "error" and says in str(reason), states
    await runner.stop()
