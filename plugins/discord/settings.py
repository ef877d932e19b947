"""The account settings the Discord plugin itself reads, checked with the standard library only.

`check_settings` is what the adapter applies when it starts (a bad value is an `AccountError`), and
what `appserver channels add` / `channels list` apply before a server runs: the CLI loads this file
by its path, without importing discord.py. The gateway's own settings (dm_policy, debounce_ms, …)
are the gateway's to check.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from plugins.contract import check_keys, url_setting

DEFAULT_API_URL = "https://discord.com/api/v10"
DEFAULT_GATEWAY_URL = "wss://gateway.discord.gg/"

# The keys this plugin reads; with the gateway's (plugins.contract.GATEWAY_SETTINGS) the only ones
# an account may have, so a misspelt one is refused instead of silently ignored.
SETTINGS = frozenset({"api_url", "gateway_url"})

# The secrets this plugin reads (the bot token): the only names an account may give
# by reference (`<name>_env`, `<name>_file`); any other such key is refused instead of ignored.
SECRETS = frozenset({"token"})


def check_settings(settings: Mapping[str, Any], refs: Collection[str] = ()) -> None:
    """Raise ValueError (one line, naming the setting) when a setting cannot work or is unknown, or
    when one of `refs` (the account's `<name>_env` / `<name>_file` keys) names no secret it reads."""
    check_keys(settings, SETTINGS, secrets=SECRETS, refs=refs)
    url_setting(settings, "api_url", DEFAULT_API_URL, base=True)
    url_setting(settings, "gateway_url", DEFAULT_GATEWAY_URL, schemes=("ws", "wss"), base=True)
