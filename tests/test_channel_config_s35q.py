"""An id list that evidently is not a list of ids is the account's problem (state `error`), not a
list nobody matches (outside finding s35 l F3): an environment override holds a string split at its
commas, and `…__ADMINS='["111","222"]'` became the "ids" `["111"` and `"222"]`, `…__ADMINS='111 222'`
the one id `111 222`, with no problem shown, so the account ran with no admins."""

from __future__ import annotations

from pathlib import Path

import pytest

from appserver.config import load_config
from tests.support.gateway import write_config

TOKENS = {"bot_token_env": "SB", "app_token_env": "SA"}
VAR = "APPSERVER_CHANNELS__SLACK__ACCOUNTS__MAIN__"


def _account(tmp_path: Path, table: dict[str, object], **environ: str):  # type: ignore[no-untyped-def]
    home = tmp_path / "home"
    write_config(home, {"slack": {"main": {**TOKENS, **table}}}, ["slack"])
    return load_config(home, {"HOME": str(tmp_path), **environ}).channels.accounts["slack"]["main"]


@pytest.mark.parametrize(
    ("key", "value", "odd"),
    [
        ("ADMINS", '["111","222"]', '["111"'),
        ("ADMINS", "111 222", "111 222"),
        ("ALLOW", 'U1, "U2"', '"U2"'),
    ],
)
def test_an_environment_override_that_is_not_ids_separated_by_commas_is_the_accounts_problem(
    tmp_path: Path, key: str, value: str, odd: str
) -> None:
    account = _account(tmp_path, {}, **{VAR + key: value})
    assert account.problem is not None, account
    assert f"{key.lower()}: " in account.problem and "is not one sender id" in account.problem, account.problem
    assert odd.split()[0].strip('"') in account.problem, account.problem
    assert f"__{key}=U123,U456" in account.problem, account.problem  # how to write it there


def test_ids_in_config_toml_that_are_not_one_id_each_are_the_accounts_problem(tmp_path: Path) -> None:
    account = _account(tmp_path, {"allow": ["U1", "U2 U3"], "admins": ['"U9"']})
    assert account.problem is not None, account
    assert "admins: " in account.problem and "allow: " in account.problem, account.problem


def test_sound_ids_and_a_webhook_id_with_a_space_are_no_problem(tmp_path: Path) -> None:
    account = _account(tmp_path, {"allow": ["*", "U1"], "admins": ["chat:-1001"]}, **{VAR + "ADMINS": "U7, U8"})
    assert account.problem is None and account.settings["admins"] == ["U7", "U8"], account
    home = tmp_path / "hook"
    write_config(home, {"webhook": {"main": {"secret_env": "S", "allow": ["alice smith"]}}}, ["webhook"])
    hook = load_config(home, {"HOME": str(tmp_path)}).channels.accounts["webhook"]["main"]
    assert hook.problem is None, hook  # a webhook's sender ids are the integrator's own strings
