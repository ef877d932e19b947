"""Who gets through to the agent: the access policy of one account, as a pure decision (DESIGN §8).

A bot token in a public workspace is an open door to an agent that may run tools. Per account:

- `dm_policy` decides WHO may use the bot, in DMs and groups alike: `open` (anyone); `allowlist`,
  `pairing` (the default) and `disabled` only `allow` ∪ `admins` ∪ approved pairings. In a DM an
  unknown sender is refused under `allowlist` and gets a code the owner approves under `pairing`;
  `disabled` refuses every DM (listed senders still reach the bot in groups).
- `group_policy` decides WHICH group messages count: `open` (every message), `mention` (the
  default: only messages that mention the bot or reply to it), `allowlist` (only listed senders).
  A group message also needs a sender `dm_policy` lets in: otherwise a stranger could add the bot to
  a group of their own and talk to it past pairing. Nobody gets a pairing code in a group (it would
  be posted to everyone there); a stranger pairs in a DM.
- `allow` / `admins`: sender ids; `"*"` in `allow` lets everyone through (in `admins` it is refused:
  it made nobody an admin). Both also accept a comma-separated string here; the config hands over
  lists (appserver/channelconfig.py refuses a string in config.toml and splits an environment
  override, `APPSERVER_CHANNELS__TELEGRAM__ACCOUNTS__MAIN__ALLOW=123,456`). Ids are stripped either way.
- `chat_type` is `dm` or `group` (plugins/contract.py); anything else a plugin sends is decided as a
  group, so a pairing code is never posted in a chat that is not known to be private.

Messages from bots (the bot's own included) never get through. A message posted as a chat (Telegram:
an anonymous group admin, who is the group acting, or a post sent as a channel) is no bot's: its
sender is `chat:<chat id>` (`CHAT_SENDER_PREFIX`), which `allow` and `admins` can name; such a sender
can never pair, and its refusal in a group has a reason of its own (`POSTED_AS_CHAT`), which the
gateway answers with a short notice. Every decision carries its reason, which the ledger records.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

DmPolicy = Literal["open", "allowlist", "pairing", "disabled"]
GroupPolicy = Literal["open", "allowlist", "mention"]
Verdict = Literal["allow", "deny", "pair"]

DM_POLICIES: tuple[DmPolicy, ...] = ("open", "allowlist", "pairing", "disabled")
GROUP_POLICIES: tuple[GroupPolicy, ...] = ("open", "allowlist", "mention")

NOT_MENTIONED = "group: the bot was not mentioned"
CHAT_SENDER_PREFIX = "chat:"  # a sender that is a chat posting as itself: `chat:<chat id>`
POSTED_AS_CHAT = (
    "group: posted as a chat (an anonymous admin or a channel), which is not on the allowlist and cannot pair"
)


class PolicyError(ValueError):
    """An account's access settings are wrong (the account does not start)."""


@dataclass(frozen=True, slots=True)
class AccessPolicy:
    dm: DmPolicy = "pairing"
    group: GroupPolicy = "mention"
    allow: frozenset[str] = frozenset()
    admins: frozenset[str] = frozenset()
    silent: bool = False  # `unpaired = "silent"`: an unknown sender gets no code, no answer at all

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any], *, default_dm: DmPolicy = "pairing") -> AccessPolicy:
        dm = settings.get("dm_policy", default_dm)
        group = settings.get("group_policy", "mention")
        if dm not in DM_POLICIES:
            raise PolicyError(f"dm_policy must be one of {', '.join(DM_POLICIES)}, got {dm!r}")
        if group not in GROUP_POLICIES:
            raise PolicyError(f"group_policy must be one of {', '.join(GROUP_POLICIES)}, got {group!r}")
        unpaired = settings.get("unpaired", "code")
        if unpaired not in ("code", "silent"):
            raise PolicyError(f"unpaired must be 'code' or 'silent', got {unpaired!r}")
        admins = _ids(settings.get("admins"), "admins")
        if "*" in admins:  # it made nobody an admin, without a word
            raise PolicyError(
                'admins takes sender ids only, got "*": the wildcard "*" means everyone in allow '
                '(allow = ["*"]), never in admins; name each admin by their id'
            )
        return cls(dm, group, _ids(settings.get("allow"), "allow"), admins, unpaired == "silent")

    def is_admin(self, sender: str) -> bool:
        return sender in self.admins

    def listed(self, sender: str, approved: bool) -> bool:
        return "*" in self.allow or sender in self.allow or sender in self.admins or approved

    def decide(
        self, *, chat_type: str, sender: str, sender_is_bot: bool, mentions_bot: bool, approved: bool
    ) -> tuple[Verdict, str]:
        """The verdict for one message and why (recorded in the ledger)."""
        if sender_is_bot:
            return "deny", "message from a bot"
        if chat_type != "dm":  # a group, or a kind a plugin made up ("channel"): never a DM, so never a code
            return self._decide_group(sender, mentions_bot, approved)
        if self.dm == "disabled":
            return "deny", "dm: direct messages are disabled"
        if self.dm == "open":
            return "allow", "dm: open"
        if self.listed(sender, approved):
            return "allow", "dm: approved sender" if approved else "dm: sender on the allowlist"
        if self.dm == "allowlist":
            return "deny", "dm: sender not on the allowlist"
        return "pair", "dm: unknown sender, pairing required"

    def _decide_group(self, sender: str, mentions_bot: bool, approved: bool) -> tuple[Verdict, str]:
        """Which messages count (`group_policy`), then who may use the bot at all (`dm_policy`)."""
        listed = self.listed(sender, approved)
        as_chat = sender.startswith(CHAT_SENDER_PREFIX)
        if self.group == "allowlist":
            if listed:
                return "allow", "group: sender on the allowlist"
            return "deny", POSTED_AS_CHAT if as_chat else "group: sender not on the allowlist"
        if self.group == "mention" and not mentions_bot:
            return "deny", NOT_MENTIONED
        counted = "open" if self.group == "open" else "the bot was mentioned"
        if self.dm == "open":
            return "allow", f"group: {counted}"
        if listed:
            return "allow", f"group: {counted}, " + ("approved sender" if approved else "sender on the allowlist")
        if as_chat:
            return "deny", POSTED_AS_CHAT
        return "deny", (
            f"group: sender is neither on the allowlist nor paired (dm_policy {self.dm}); "
            "a stranger pairs in a direct message, never in a group"
        )


def _ids(value: Any, key: str) -> frozenset[str]:
    if value is None:
        return frozenset()
    if isinstance(value, str):
        return frozenset(v.strip() for v in value.split(",") if v.strip())
    if isinstance(value, list | tuple) and all(isinstance(v, str | int) and not isinstance(v, bool) for v in value):
        return frozenset(str(v).strip() for v in value if str(v).strip())  # `" 123"` is the id 123 here too
    raise PolicyError(f"{key} must be a list of sender ids (or a comma-separated string), got {value!r}")
