"""`[channels]` in config.toml: which channels run, and each account's settings (DESIGN §8).

```toml
[channels]
enabled = ["webhook"]

[channels.webhook.accounts.main]
listen = "127.0.0.1:8788"
secret_env = "WEBHOOK_SECRET"          # secrets only by reference: NAME_env or NAME_file
reply_url = "http://127.0.0.1:9000/replies"
default_agent = "assistant"
```

An account's table is handed to its plugin as written, except that secret references are kept
apart: `token_env = "X"` / `token_file = "path"` are resolved in the gateway child, so a secret never
passes through the server's config or logs. A secret written inline is refused here, naming the key.
Only a secret is given by reference: one to a gateway setting (`dm_policy_env`, `allow_file`), like
an id list written as a string, is the account's `problem` (state `error`, never run with defaults);
a name the plugin reads no secret by is refused by its `check_settings` and by the gateway child.
Environment overrides work as for every key: `APPSERVER_CHANNELS__ENABLED=webhook,telegram`,
`APPSERVER_CHANNELS__WEBHOOK__ACCOUNTS__MAIN__REPLY_URL=…`, a value read as its setting's type
(`…__TOOL_STATUS=false`, `…__TOLERANCE_S=60`: `GATEWAY_TYPES`, a first-party plugin's `SETTING_TYPES`).
"""

from __future__ import annotations

import importlib.util
import os
import re
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from appserver.configcheck import (
    NO_SUCH_USER,
    AmbiguousName,
    Invalid,
    NoSuchUser,
    convert,
    expand_user,
    fold_name,
)
from appserver.shown import shown
from plugins.contract import GATEWAY_SETTINGS, is_secret_ref, secret_ref_problem
from plugins.loader import FIRST_PARTY

CHANNEL_ID = re.compile(r"[a-z0-9][a-z0-9_-]*")
ACCOUNT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Keys whose value is a credential: they must be given by reference (`<key>_env` / `<key>_file`).
SECRET_KEYS = frozenset({"token", "secret", "password", "api_key", "app_token", "bot_token", "signing_secret"})
SECRET_SUFFIXES = ("_token", "_secret", "_password", "_key")
# Settings the gateway itself reads (the plugin sees them too); checked here so a typo fails at load.
GATEWAY_KEYS: dict[str, type | tuple[type, ...]] = {
    "default_agent": str,
    "chat_rate": (int, float),  # sends and edits per second per chat (default: the plugin's)
    "tool_status": bool,  # one compact status line while tools run (default true)
    "stream": bool,  # grow replies by edits where the platform can (default true)
}
# The type of each of the gateway's settings that is not a string (a plugin's own: its
# `settings.py`'s SETTING_TYPES): an environment override holds text, read as that type
# (`…__TOOL_STATUS=false`, `…__DEBOUNCE_MS=500`), as `APPSERVER_LIMITS__QUEUE_MAX=64` is.
GATEWAY_TYPES: dict[str, type] = {
    "chat_rate": float,
    "tool_status": bool,
    "stream": bool,
    "debounce_ms": float,
    "max_wait_ms": float,
    "max_items": int,
}
# The gateway's settings that are lists of sender ids. TOML has lists, so a string there is refused
# (`allow = "U1 U2"` was one id); the environment has only strings, so an override's value is split
# at commas (`…__ALLOW=U1,U2`), as documented.
ID_LIST_KEYS = frozenset({"allow", "admins"})


class ChannelConfigError(ValueError):
    """A `[channels]` problem, naming the key and where it came from."""


@dataclass(frozen=True, slots=True)
class AccountConfig:
    channel: str
    name: str
    settings: dict[str, Any]  # the table minus secret references
    secret_refs: dict[str, dict[str, str]]  # secret name -> {"env": VAR} or {"file": path}
    # Why the gateway must not run this account, found at load (`account_problem`); it is then in
    # state `error` with this reason while the others run. None when nothing was found.
    problem: str | None = None

    @property
    def ref(self) -> str:
        return f"{self.channel}:{self.name}"

    @property
    def ref_keys(self) -> list[str]:
        """The secret references as written in the table (`token_env`, `secret_file`)."""
        return [f"{secret}_{kind}" for secret, ref in self.secret_refs.items() for kind in ref]

    def to_json(self) -> dict[str, Any]:
        """What the supervisor hands the gateway child (references, never secret values)."""
        return {"channel": self.channel, "name": self.name, "settings": self.settings, "secrets": self.secret_refs}


@dataclass(slots=True)
class ChannelsConfig:
    enabled: list[str] = field(default_factory=list)
    accounts: dict[str, dict[str, AccountConfig]] = field(default_factory=dict)  # channel -> name -> account

    def enabled_accounts(self) -> list[AccountConfig]:
        return [a for ch in self.enabled for a in self.accounts.get(ch, {}).values()]


def parse_enabled(value: Any, where: str, *, text: bool = True) -> list[str]:
    """The channel ids of `value`: a list of strings, or (`text`: from the environment or
    `--channels`) one comma-separated string. In config.toml a string is refused: TOML has lists."""
    if isinstance(value, str) and not text:
        raise ChannelConfigError(
            f"{where}: [channels] enabled must be a list of channel ids (enabled = [{shown(value)}]), "
            f"got the string {shown(value)}"
        )
    items = [v.strip() for v in value.split(",")] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
        raise ChannelConfigError(f"{where}: [channels] enabled must be a list of channel ids, got {shown(value)}")
    out: list[str] = []
    for v in items:
        if not v:
            continue
        if not CHANNEL_ID.fullmatch(v):
            raise ChannelConfigError(
                f"{where}: [channels] enabled: {shown(v)} is not a channel id ([a-z0-9][a-z0-9_-]*)"
            )
        if v not in out:
            out.append(v)
    return out


def load_channels(file_table: Any, env_table: Any, path: str, env_origin: Callable[..., str]) -> ChannelsConfig:
    """Build `ChannelsConfig` from the file's `[channels]` table and the environment's overrides."""
    for raw, where in ((file_table, path), (env_table, env_origin("channels"))):
        if not isinstance(raw, dict):
            raise ChannelConfigError(f"{where}: [channels] must be a table")
    cfg = ChannelsConfig()
    file_table, env_table = dict(file_table), dict(env_table)
    if "enabled" in env_table:
        cfg.enabled = parse_enabled(env_table.pop("enabled"), env_origin("channels", "enabled"))
        file_table.pop("enabled", None)
    elif "enabled" in file_table:
        cfg.enabled = parse_enabled(file_table.pop("enabled"), path, text=False)
    for channel in [*file_table, *(c for c in env_table if c not in file_table)]:
        where = path if channel in file_table else env_origin("channels", channel)
        if not CHANNEL_ID.fullmatch(channel):
            raise ChannelConfigError(f"{where}: [channels.{channel}]: not a channel id ([a-z0-9][a-z0-9_-]*)")
        tables = [
            (file_table.get(channel, {}), path, False),
            (env_table.get(channel, {}), env_origin("channels", channel), True),
        ]
        merged: dict[str, dict[str, Any]] = {}
        variables: dict[str, dict[str, str]] = {}  # account -> key -> the variable that set it
        refused: dict[str, list[str]] = {}  # account -> environment values not of their setting's type
        for table, origin, from_env in tables:
            if not isinstance(table, dict) or set(table) - {"accounts"}:
                raise ChannelConfigError(
                    f"{origin}: [channels.{channel}] holds only accounts: [channels.{channel}.accounts.NAME]"
                )
            accounts = table.get("accounts", {})
            if not isinstance(accounts, dict) or not all(isinstance(v, dict) for v in accounts.values()):
                raise ChannelConfigError(f"{origin}: [channels.{channel}.accounts.NAME] must be tables")
            if from_env:  # the environment's names and keys are lower-cased: the file's spelling
                accounts = _fold_env_accounts(channel, accounts, merged, origin, path)
                accounts = {name: _env_id_lists(settings) for name, settings in accounts.items()}
                for name, settings in accounts.items():
                    variables[name] = {key: f"{origin}__ACCOUNTS__{name.upper()}__{key.upper()}" for key in settings}
                    accounts[name], refused[name] = _env_typed(channel, settings, variables[name])
            for name, settings in accounts.items():
                merged.setdefault(name, {}).update(settings)
        cfg.accounts[channel] = {
            name: check_account(
                channel, name, settings, where, origins=variables.get(name), problems=refused.get(name, ())
            )
            for name, settings in merged.items()
        }
    return cfg


def _fold_env_accounts(
    channel: str, accounts: dict[str, Any], file_accounts: dict[str, dict[str, Any]], origin: str, path: str
) -> dict[str, dict[str, Any]]:
    """The environment's accounts of `channel` under the names and keys config.toml spells them
    (`…__ACCOUNTS__MAIN__CHATID` sets `[channels.telegram.accounts.Main] chatId`): a variable's
    name is not case-sensitive, and it was silently a second account or a second key. An account
    or key only in the environment is in lower case; two in the file that differ only in case
    cannot be told apart and are refused."""
    out: dict[str, dict[str, Any]] = {}
    for env_name, settings in accounts.items():
        name = _folded(env_name, file_accounts, f"{origin}__ACCOUNTS__{env_name.upper()}", f"{path}: accounts")
        known_keys = file_accounts.get(name, {})
        out[name] = {
            _folded(key, known_keys, f"{origin}__ACCOUNTS__{env_name.upper()}__{key.upper()}", f"{path}: keys"): value
            for key, value in settings.items()
        }
    return out


def _env_id_lists(settings: dict[str, Any]) -> dict[str, Any]:
    """An environment override's settings with each id list (`ID_LIST_KEYS`) as a list: a variable
    holds a string, and `…__ALLOW=U1,U2` is the documented way to give two ids there."""
    return {
        key: [v.strip() for v in value.split(",") if v.strip()]
        if key in ID_LIST_KEYS and isinstance(value, str)
        else value
        for key, value in settings.items()
    }


def _env_typed(
    channel: str, settings: dict[str, Any], variables: Mapping[str, str]
) -> tuple[dict[str, Any], list[str]]:
    """An environment override's settings with each value of a setting that is not a string read as
    its type (`GATEWAY_TYPES`, and a first-party plugin's `SETTING_TYPES`): `…__TOOL_STATUS=false`
    was the string 'false', which took the whole server down blaming config.toml, and
    `…__TOLERANCE_S=60` put the account in `error` with "got '60'". A value that does not read as
    its type is left out and said, naming its variable: the account does not run (never with the
    default in its place)."""
    kinds: dict[str, type] = dict(GATEWAY_TYPES)
    if any(isinstance(v, str) and k not in GATEWAY_SETTINGS for k, v in settings.items()):
        kinds.update(plugin_setting_types(channel))  # a plugin's own setting: its settings.py says
    typed: dict[str, Any] = {}
    problems: list[str] = []
    for key, value in settings.items():
        kind = kinds.get(key)
        if kind is None or not isinstance(value, str):
            typed[key] = value
            continue
        try:
            typed[key] = convert(value, kind, None, from_env=True)
        except Invalid as exc:
            words = " (1, true, yes, on or 0, false, no, off)" if kind is bool else ""
            problems.append(f"{variables[key]}: {key} must be {exc.expected}{words}, got {shown(value)}")
    return typed, problems


def plugin_setting_types(channel: str) -> dict[str, type]:
    """The types of a first-party plugin's settings that are not strings (its `SETTING_TYPES`);
    empty for a user plugin, whose settings are never imported here (it gets the variable's text)."""
    try:
        module = first_party_settings(channel)
    except Exception:  # noqa: BLE001 - a broken settings.py is its check's to report (`channels list`)
        return {}
    declared = getattr(module, "SETTING_TYPES", None) if module is not None else None
    return {str(k): v for k, v in declared.items() if v in (bool, int, float)} if isinstance(declared, dict) else {}


def first_party_settings(channel: str) -> types.ModuleType | None:
    """A first-party plugin's `settings.py` (standard library and plugins.contract only), loaded by
    its path: its package's `__init__` imports the platform library (slack_sdk, discord.py, …),
    which neither the server's config nor the CLI needs. None for any other channel, or a plugin
    without one."""
    module_name = FIRST_PARTY.get(channel)
    if module_name is None:
        return None  # a user plugin is never imported outside the gateway
    try:
        spec = importlib.util.find_spec(module_name)  # imports `plugins`, not the channel's package
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(folder) / "settings.py"
        if not path.is_file():
            continue
        file_spec = importlib.util.spec_from_file_location(f"appserver_channel_settings_{channel}", path)
        if file_spec is None or file_spec.loader is None:
            return None
        module = types.ModuleType(file_spec.name)
        module.__file__ = str(path)
        file_spec.loader.exec_module(module)
        return module
    return None


def _folded(env_name: str, known: Iterable[str], variable: str, what: str) -> str:
    try:
        return fold_name(env_name, known)
    except AmbiguousName as exc:
        raise ChannelConfigError(
            f"{variable}: {what} {exc} differ only in case, and an environment variable's name is not "
            "case-sensitive: rename one of them"
        ) from None


def check_account(
    channel: str,
    name: str,
    table: dict[str, Any],
    where: str,
    *,
    origins: Mapping[str, str] | None = None,
    problems: Sequence[str] = (),
) -> AccountConfig:
    """The account `table` checked, a mistake that stops the whole config raised as
    ChannelConfigError naming the file `where`, or the environment variable that set the key
    (`origins`: key -> variable). `problems`: what is already known to keep it from running."""
    head = f"{where}: [channels.{channel}.accounts.{name}]"
    if not ACCOUNT_NAME.fullmatch(name):
        raise ChannelConfigError(f"{head}: account name must be letters, digits, '_' or '-' (at most 64)")
    settings: dict[str, Any] = {}
    refs: dict[str, dict[str, str]] = {}
    for key, value in table.items():
        head = f"{(origins or {}).get(key, where)}: [channels.{channel}.accounts.{name}]"
        folded = key.lower().replace("-", "_")  # `Token`, `BOT-TOKEN` are secrets too
        if folded != key and (folded in SECRET_KEYS or folded.endswith(SECRET_SUFFIXES)):
            raise ChannelConfigError(
                f"{head} {key}: secrets are never written inline; "
                f'use {folded}_env = "VARIABLE" or {folded}_file = "path"'
            )
        if is_secret_ref(key):
            secret, kind = key.rsplit("_", 1)
            if not isinstance(value, str) or not value:
                raise ChannelConfigError(f"{head} {key} must be a non-empty string")
            if kind == "env" and not ENV_NAME.fullmatch(value):
                raise ChannelConfigError(f"{head} {key} must name an environment variable, got {shown(value)}")
            if kind == "file":
                try:
                    expand_user(value)
                except NoSuchUser:  # the gateway would never read it (and pathlib's error was a traceback)
                    raise ChannelConfigError(f"{head} {key} = {shown(value)}: {NO_SUCH_USER}") from None
            if secret in refs:
                raise ChannelConfigError(f"{head}: give {secret}_env or {secret}_file, not both")
            refs[secret] = {kind: value}
            continue
        if key in SECRET_KEYS or key.endswith(SECRET_SUFFIXES):
            raise ChannelConfigError(
                f'{head} {key}: secrets are never written inline; use {key}_env = "VARIABLE" or {key}_file = "path"'
            )
        expected = GATEWAY_KEYS.get(key)
        if expected is not None and (not isinstance(value, expected) or isinstance(value, bool) != (expected is bool)):
            raise ChannelConfigError(f"{head} {key} has the wrong type: {shown(value)}")
        if key == "chat_rate" and not value > 0:
            raise ChannelConfigError(f"{head} chat_rate must be positive, got {shown(value)}")
        settings[key] = value
    account = AccountConfig(channel=channel, name=name, settings=settings, secret_refs=refs)
    problem = "; ".join([*problems, *filter(None, [account_problem(account)])]) or None
    return account if problem is None else replace(account, problem=problem)


def account_problem(account: AccountConfig) -> str | None:
    """Why the gateway must not run `account`, as far as can be told without its plugin, in one line;
    None when nothing is wrong. A secret reference to a gateway setting (`dm_policy_env`,
    `allow_file`): a setting is never read from one, so the account ran with the default policy. An
    id list written as a string (`allow = "U1 U2"`): it was one id. A plugin's own settings and
    secrets are its `check_settings`'s (and the gateway's, at start) to check."""
    problems = [p for key in sorted(account.ref_keys) if (p := secret_ref_problem(key, (), None)) is not None]
    problems += _text_problems(account.settings)
    for key in sorted(ID_LIST_KEYS & account.settings.keys()):
        value = account.settings[key]
        if isinstance(value, str):
            problems.append(
                f'{key} must be a list of sender ids, such as {key} = ["U123", "U456"], got the string '
                f"{shown(value)}: a string is not split into ids"
            )
        elif isinstance(value, list) and (odd := next((i for i in value if _not_one_id(account.channel, i)), None)):
            problems.append(
                f"{key}: {shown(str(odd))} is not one sender id (it holds a bracket, a double quote or, on "
                f'{account.channel}, a space): write one id per list item, such as {key} = ["U123", "U456"] (in '
                f"an environment override, ids separated by commas: …__{key.upper()}=U123,U456)"
            )
    return "; ".join(problems) or None


def _text_problems(settings: Mapping[str, Any]) -> list[str]:
    """The gateway's text settings that can never do what they are there for. A `deny_notice` that
    is not text (`5`, `true`, `["no"]`) or is blank was never sent, without a word: a denied sender
    heard nothing while the owner thought they were told. A blank `default_agent` routed nothing."""
    problems = []
    if "deny_notice" in settings and not _is_text(notice := settings["deny_notice"]):
        problems.append(
            f"deny_notice must be the text a denied sender is told (a string, not blank), got {shown(notice)}: "
            "leave it out to tell them nothing"
        )
    if isinstance(agent := settings.get("default_agent"), str) and not agent.strip():
        problems.append(f"default_agent must name an agent, got {shown(agent)}: leave it out for none")
    return problems


def _is_text(value: Any) -> bool:
    return isinstance(value, str) and bool(value.strip())


# Characters no sender id of any channel holds: a list or a quoted id written where one id belongs
# (`…__ADMINS='["111","222"]'` in the environment was the two "ids" `["111"` and `"222"]`).
_NOT_IN_IDS = re.compile(r'[\[\]"]')
# The chat platforms' ids are single words (a webhook's are the integrator's own strings).
_WORD_IDS = frozenset({"telegram", "slack", "discord"})


def _not_one_id(channel: str, item: object) -> bool:
    """Whether a list item of `allow`/`admins` is evidently not one sender id (it never matched)."""
    text = str(item).strip()
    return bool(_NOT_IN_IDS.search(text)) or (channel in _WORD_IDS and any(c.isspace() for c in text))


def shared_secrets(accounts: Iterable[AccountConfig], home: Path) -> dict[str, tuple[str, str]]:
    """The accounts that reference the same token as an earlier account of their channel (the same
    `<name>_env` variable, or the same `<name>_file` path, relative ones under `home`): ref -> (that
    earlier account's name, why). One bot token polled by two accounts fought itself forever (Telegram:
    409 Conflict); the first account keeps the token, a later one is refused. Only tokens (`token`,
    `*_token`: a bot's identity) count: a shared signing secret or password is a choice, not a clash."""
    first: dict[tuple[str, str, str, str], str] = {}
    out: dict[str, tuple[str, str]] = {}
    for account in accounts:
        for secret, ref in sorted(account.secret_refs.items()):
            if not is_identity_secret(secret):
                continue
            kind, value = next(iter(ref.items()))
            if kind == "file":
                try:
                    path = expand_user(value)
                except NoSuchUser:  # check_account refuses it; an account made otherwise is compared as written
                    path = Path(value)
                value = os.path.normpath(path if path.is_absolute() else home / path)
            owner = first.setdefault((account.channel, secret, kind, value), account.name)
            if owner != account.name and account.ref not in out:
                what = f"environment variable {value}" if kind == "env" else f"file {value}"
                out[account.ref] = (
                    owner,
                    (
                        f"{secret}_{kind}: the same {what} as account {account.channel}:{owner}; two accounts of "
                        "one channel cannot share a token (two pollers of one bot token fight: 409 Conflict)"
                    ),
                )
    return out


def is_identity_secret(name: str) -> bool:
    """A secret that names one bot on its platform (`token`, `bot_token`, `app_token`, …)."""
    return name == "token" or name.endswith("_token")
