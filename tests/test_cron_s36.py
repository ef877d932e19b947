"""Cron zones from the tz database's variant trees (an outside finding, session 36).

`--tz right/Europe/Paris` (a leap-second copy of the zone, which zoneinfo reads with the summer
offset all winter) was accepted: `0 8 * * *` fired at 06:00 UTC in December, shown as "CEST", an
hour early without a word; `TZ=right/UTC` made `cron add` say "never fires". `right/…` and
`posix/…` name copies of zones, not zones: refused, naming the zone to give instead."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.cli import cli_env, run_cli


@pytest.mark.parametrize("tz", ["right/Europe/Paris", "posix/Europe/Paris"])
def test_cron_add_refuses_a_variant_tree_zone_naming_the_zone(home: Path, tz: str) -> None:
    env = cli_env(home)
    r = run_cli(home, "cron", "add", "--agent", "assistant", "--name", "p", "--cron", "0 8 * * *", "--exact",
                "--tz", tz, "--prompt", "hi", env=env)  # fmt: skip
    assert r.code != 0, f"--tz {tz} was taken: {r.out!r}"
    assert "'Europe/Paris'" in r.err, r.err
    listed = run_cli(home, "cron", "list", "--json", env=env)
    assert listed.code == 0 and listed.json() == [], listed.out


def test_cron_add_under_a_variant_tree_tz_asks_for_the_zone(home: Path) -> None:
    env = cli_env(home, TZ="right/UTC")
    r = run_cli(home, "cron", "add", "--agent", "assistant", "--name", "t", "--cron", "0 8 * * *",
                "--prompt", "hi", env=env)  # fmt: skip
    assert r.code != 0, r.out
    assert "never fires" not in r.err and "--tz UTC" in r.err, r.err
    # the zone itself, given with --tz, is what the task uses
    r = run_cli(home, "cron", "add", "--agent", "assistant", "--name", "t", "--cron", "0 8 * * *", "--exact",
                "--tz", "Europe/Paris", "--prompt", "hi", "--json", env=env)  # fmt: skip
    assert r.code == 0 and r.json()["schedule"]["tz"] == "Europe/Paris", r.err
