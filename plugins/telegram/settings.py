"""The account settings the Telegram plugin itself reads, checked with the standard library
and `plugins.contract` (itself standard library only).

`check_settings` is what the adapter applies when it starts (a bad value is an `AccountError`), and
what `appserver channels add` / `channels list` apply before a server runs: the CLI loads this file
by its path, without importing python-telegram-bot. The gateway's own settings (dm_policy,
debounce_ms, …) are the gateway's to check.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from plugins.contract import check_keys, number_setting, url_setting

DEFAULT_API_URL = "https://api.telegram.org"
DEFAULT_POLL_TIMEOUT = 30
MAX_POLL_TIMEOUT = 50  # Telegram holds a long poll at most this long

# The keys this plugin reads; with the gateway's (plugins.contract.GATEWAY_SETTINGS) the only ones
# an account may have, so a misspelt one is refused instead of silently ignored.
SETTINGS = frozenset({"api_url", "poll_timeout", "edited", "mode"})

# The secrets this plugin reads (the bot token): the only names an account may give
# by reference (`<name>_env`, `<name>_file`); any other such key is refused instead of ignored.
SECRETS = frozenset({"token"})

# The type of each setting that is not a string: an environment override (text) is read as it
# (appserver/channelconfig.py), as `APPSERVER_LIMITS__QUEUE_MAX=64` is.
SETTING_TYPES: dict[str, type] = {"poll_timeout": float}


def check_settings(settings: Mapping[str, Any], refs: Collection[str] = ()) -> None:
    """Raise ValueError (one line, naming the setting) when a setting cannot work or is unknown, or
    when one of `refs` (the account's `<name>_env` / `<name>_file` keys) names no secret it reads."""
    check_keys(settings, SETTINGS, secrets=SECRETS, refs=refs)
    url_setting(settings, "api_url", DEFAULT_API_URL, base=True)
    what = f"a number of seconds from 0 to {MAX_POLL_TIMEOUT}"
    number_setting(settings, "poll_timeout", DEFAULT_POLL_TIMEOUT, low=0, high=MAX_POLL_TIMEOUT, what=what)
    edited = settings.get("edited", "ignore")
    if edited not in ("ignore", "new"):
        raise ValueError(f'edited must be "ignore" or "new", got {edited!r}')
    mode = settings.get("mode", "polling")
    if mode != "polling":
        raise ValueError(f'mode must be "polling" (webhook mode is not supported yet), got {mode!r}')
