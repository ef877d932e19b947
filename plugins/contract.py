"""The channel plugin contract: what the gateway hands a plugin and what a plugin gives back.

A plugin module exposes `create_adapter(account: Account, context: AdapterContext) -> Adapter`.
The gateway owns everything that does not depend on the platform (ledger, access, routing,
envelopes, splitting, rate limiting, retries); an adapter only turns platform traffic into
`InboundMessage`s and performs sends, edits and reactions. This module imports nothing but the
standard library (and `plugins.graphemes`, re-exported here: `shorten` and `is_grapheme_boundary`
for cutting text where a person sees a cut), so a plugin depends on it and on its platform library
only.
"""

from __future__ import annotations

import difflib
import logging
import math
import os
import re
import urllib.parse
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from plugins.graphemes import is_grapheme_boundary, shorten

__all__ = [
    "Account",
    "AccountError",
    "AccountState",
    "Adapter",
    "AdapterContext",
    "Attachment",
    "ChatType",
    "CreateAdapter",
    "DeliveryError",
    "GATEWAY_SETTINGS",
    "IMAGE_FRAME_RESERVE",
    "IMAGE_MAX_BYTES",
    "InboundMessage",
    "IntakePaused",
    "Limits",
    "MoveChat",
    "OnMessage",
    "ReportState",
    "RetryScope",
    "Target",
    "TokenRefusal",
    "check_keys",
    "check_secret_refs",
    "image_budget",
    "is_grapheme_boundary",
    "is_secret_ref",
    "number_setting",
    "secret_ref_problem",
    "shorten",
    "url_setting",
]

ChatType = Literal["dm", "group"]
# How far a platform's "wait" answer reaches (`DeliveryError.retry_scope`): the kind of call that got
# it, in that chat ("call"); every call to that chat ("chat"); every call of the account ("account").
RetryScope = Literal["call", "chat", "account"]
AccountState = Literal["starting", "running", "backoff", "conflict", "stopped", "error"]

# The keys of an account's table that the gateway reads for every channel (docs/channels.md): access,
# debounce, routing and delivery. A plugin's own keys come on top (`check_keys`).
GATEWAY_SETTINGS = frozenset(
    {
        "default_agent",
        "chat_rate",
        "stream",
        "tool_status",
        "dm_policy",
        "group_policy",
        "allow",
        "admins",
        "unpaired",
        "deny_notice",
        "debounce_ms",
        "max_wait_ms",
        "max_items",
    }
)

# How a secret is given in an account's table: by reference, `<name>_env` (an environment variable)
# or `<name>_file` (a file). Only the names a plugin declares as secrets may be given so.
SECRET_REF_SUFFIXES = ("_env", "_file")

# The longest chat or thread id a route key can name (gateway/routing.py): a plugin that takes ids
# from its callers (webhook) refuses longer ones rather than accept a chat no route can reach.
ROUTE_PART_MAX = 200
# The most the gateway passes on to the model per image, whatever the server's frame limit.
IMAGE_MAX_BYTES = 5 << 20
# What a turn's frame needs besides its images: the envelope with the text (a caption, a message),
# the agent's note, the `message_channel` tool and the JSON around them.
IMAGE_FRAME_RESERVE = 64 << 10
# The server's frame limit when nothing says otherwise (docs/protocol.md: 4 MiB).
DEFAULT_MAX_FRAME_BYTES = 4 << 20


def env_seconds(name: str, default: float) -> float:
    """A positive number of seconds from the environment (a test against a loopback fake shortens
    a wait); the default when unset or not one."""
    try:
        value = float(os.environ.get(name, ""))
    except ValueError:
        return default
    return value if 0 < value < math.inf else default


def image_budget(max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> int:
    """The biggest image, in bytes as fetched, that can reach the model in a turn when the server
    takes frames of at most `max_frame_bytes`: an image travels in the frame as base64 (4 bytes for
    every 3), beside the message's text (`IMAGE_FRAME_RESERVE`); never more than `IMAGE_MAX_BYTES`.
    With the default 4 MiB frame that is 3,096,576 bytes (about 2.95 MiB)."""
    return max(0, min(IMAGE_MAX_BYTES, (max_frame_bytes - IMAGE_FRAME_RESERVE) // 4 * 3))


def _default_image_budget() -> int:
    return image_budget()


@dataclass(frozen=True, slots=True)
class Attachment:
    """A file that came with a message. Images with `data` go to the model as images; every other
    attachment is named in the envelope with its type and size. An image left unfetched because it
    is bigger than `AdapterContext.max_image_bytes()` stays `kind="image"` with its `size` and no
    `data`: the gateway names it with a note that it was too big for the model."""

    kind: Literal["image", "file"]
    name: str
    mime: str
    size: int | None = None
    data: bytes | None = None  # fetched content (images), None when not fetched


@dataclass(frozen=True, slots=True)
class InboundMessage:
    """One platform message, as facts: the gateway decides what to do with it.

    `message_id` must be stable across redeliveries of the same platform update: it is the ledger
    key and the turn's idempotency key (`channel:account:message_id`). `ack`, when set, is called by
    the gateway after the ledger has committed the message, and only then (Telegram's offset,
    Slack's envelope ack); adapters without a platform ack may instead rely on `on_message`
    returning, which happens after the same commit."""

    channel: str
    account: str
    chat: str
    chat_type: ChatType
    sender: str
    message_id: str
    text: str
    thread: str | None = None
    sender_name: str | None = None
    mentions_bot: bool = False
    reply_to: str | None = None
    sender_is_bot: bool = False
    ts: float | None = None  # platform time, seconds since the epoch
    # A click on one of the bot's own buttons, handed over as the command it stands for: a click that
    # finds nothing to answer (a double click, a prompt decided meanwhile) is answered quietly.
    pressed: bool = False
    attachments: tuple[Attachment, ...] = ()
    raw: Mapping[str, Any] = field(default_factory=dict)
    ack: Callable[[], Awaitable[None]] | None = None


@dataclass(frozen=True, slots=True)
class Target:
    """Where a send goes: a chat, optionally a thread in it, optionally as a reply to a message."""

    chat: str
    thread: str | None = None
    reply_to: str | None = None
    # Stable across resends of the same message part (`channel:account:message_id:part`): a platform
    # with its own idempotency (Discord's nonce, a webhook receiver's dedupe) uses it so a resend
    # does not post twice, and one that can be searched (Slack's message metadata) tags the message
    # with it for `find_sent`. For a send outside a reply the gateway sets a fresh key that stays the
    # same over that send's retries.
    key: str | None = None


@dataclass(frozen=True, slots=True)
class Limits:
    max_length: int  # characters per message after `format`; the gateway splits longer replies
    can_edit: bool = False  # replies grow in place by edits when True, else the final text is sent
    can_react: bool = False
    edits_per_second: float = 1.0  # the per-chat budget for sends and edits


def number_setting(
    settings: Mapping[str, Any],
    key: str,
    default: float,
    *,
    low: float,
    high: float,
    what: str,
    integer: bool = False,
    error: type[ValueError] = ValueError,
) -> float:
    """`settings[key]` (else `default`), refused with `error` ("<key> must be <what>, got …") unless
    a number from `low` to `high` (a whole one with `integer`). TOML and `--set` take `inf`, `nan`
    and `1e308`: each would stall or quietly switch off what the setting paces, so the bounds are
    finite and `nan`, failing every comparison, is refused with them."""
    value = settings.get(key, default)
    kinds = int if integer else int | float
    if isinstance(value, bool) or not isinstance(value, kinds) or not low <= value <= high:
        shown = repr(value) if not isinstance(value, int) or abs(value) < 10**30 else "a number too large"
        raise error(f"{key} must be {what}, got {shown}")
    return float(value)


def url_setting(
    settings: Mapping[str, Any],
    key: str,
    default: str | None,
    *,
    schemes: tuple[str, ...] = ("http", "https"),
    error: type[ValueError] = ValueError,
    base: bool = False,
) -> str | None:
    """`settings[key]` (else `default`; None stays None), refused with `error` ("<key> must be an
    http:// or https:// URL, …") unless a URL of one of `schemes` that names a host and a valid
    port: `http://` (no host) or `http://[::1` (cut short) passed a prefix check, and every request
    to it then failed only when sent, each one after its whole retry budget. `base`: a URL the plugin
    appends its paths to (an `api_url`), which may hold no `?query` or `#fragment` (the paths went
    after them: every request failed as a bad token, and the token went into a proxy's query)."""
    value = settings.get(key, default)
    if value is None:
        return None
    kinds = " or ".join(f"{s}://" for s in schemes)
    what = f"{key} must be {'an' if schemes[0].startswith('http') else 'a'} {kinds} URL"  # "an http", "a ws"
    if not isinstance(value, str) or not value.startswith(tuple(f"{s}://" for s in schemes)):
        raise error(f"{what}, got {_masked(value)!r}")
    problem = _url_problem(value)
    if problem is None and base and ("?" in value or "#" in value):
        problem = "a base URL the plugin adds its paths to holds no ?query or #fragment"
    if problem is not None:
        raise error(f"{what}, got {_masked(value)!r}: {problem}")
    return value


def _masked(value: Any) -> Any:
    """`value` for an error message: a URL's credentials (`user:pw@`) and query (`?key=…`) as `…`."""
    if not isinstance(value, str):
        return value
    return re.sub(r"\?.*", "?…", re.sub(r"(://)[^/?#]*@", r"\1…@", value), count=1, flags=re.S)


def _url_problem(url: str) -> str | None:
    """Why `url` (its scheme checked) cannot be requested, or None."""
    if any(c.isspace() or not c.isprintable() for c in url):
        return "it holds a space or a control character (write a space in a path as %20)"
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as exc:  # `http://[::1` (Invalid IPv6 URL), `http://h:99999`, `http://h:x`
        return str(exc)
    if not parts.hostname:
        return "it names no host"
    if port == 0:
        return "port 0 cannot be connected to"
    return None


def check_keys(
    settings: Mapping[str, Any],
    own: Collection[str],
    *,
    secrets: Collection[str] | None = None,
    refs: Collection[str] = (),
    error: type[Exception] = ValueError,
) -> None:
    """Refuse with `error` every key of `settings` that is neither the gateway's (`GATEWAY_SETTINGS`)
    nor in `own` (the plugin's), naming it and the key it probably meant: a misspelt `dm_polcy`
    would otherwise leave the account running with the default policy its owner meant to change.
    Secret references, `refs` (the `<name>_env` / `<name>_file` keys the gateway took out of the
    table) and any such key still in `settings`, are checked by `check_secret_refs`."""
    check_secret_refs([*refs, *(str(k) for k in settings if is_secret_ref(str(k)))], own, secrets, error=error)
    known = GATEWAY_SETTINGS | frozenset(own)
    unknown = sorted(str(k) for k in settings if k not in known and not is_secret_ref(str(k)))
    if not unknown:
        return
    named = []
    for key in unknown:
        folded = key.lower().replace("-", "_")
        close = [folded] if folded in known else difflib.get_close_matches(folded, sorted(known), n=1)
        named.append(f"{key!r} (did you mean {close[0]!r}?)" if close else repr(key))
    raise error(f"unknown setting{'s' if len(named) > 1 else ''} {', '.join(named)}")


def is_secret_ref(key: str) -> bool:
    """`key` is written the way a secret is given: `<name>_env` or `<name>_file`."""
    return key.endswith(SECRET_REF_SUFFIXES)


def check_secret_refs(
    refs: Collection[str],
    own: Collection[str],
    secrets: Collection[str] | None,
    *,
    error: type[Exception] = ValueError,
) -> None:
    """Refuse with `error` each secret reference (`<name>_env`, `<name>_file`, as written) whose
    name is not a secret the plugin reads: one of `secrets`, its declared secrets (None: it declares
    none, so only a reference to a setting, the gateway's or one of `own`, is refused). The
    gateway reads a reference only as a secret: `dm_policy_env = "DMP"` or `allow_file = "…"` was
    accepted and the account ran with the default policy and an empty allowlist."""
    problems = [p for ref in sorted(set(refs)) if (p := secret_ref_problem(ref, own, secrets)) is not None]
    if problems:
        raise error("; ".join(problems))


def secret_ref_problem(ref: str, own: Collection[str], secrets: Collection[str] | None) -> str | None:
    """Why the reference `ref` names no secret (see `check_secret_refs`), in one line; None when it
    names one, or may (`secrets` None and not a setting)."""
    name, _, kind = ref.rpartition("_")
    if secrets is not None and name in secrets:
        return None
    source = "an environment variable" if kind == "env" else "a file"
    itself = f"write the value itself: {name} = …"
    if name in GATEWAY_SETTINGS or name in own:
        return f"{ref}: {name} is a setting, not a secret, and is never read from {source}; {itself}"
    if secrets is None:
        return None
    listed = ", ".join(sorted(secrets)) or "none"
    close = difflib.get_close_matches(name, sorted(secrets), n=1)
    hint = f" (did you mean {close[0]}_{kind}?)" if close else ""
    return f"{ref}: {name} is not a secret of this channel (its secrets: {listed}){hint}; if it is a setting, {itself}"


class DeliveryError(Exception):
    """A send, edit or reaction the platform refused.

    `retry_after` (seconds) means the platform asked to wait (HTTP 429 and the like): the gateway
    waits at least that long before the next call of that kind to that chat (sends and edits,
    reactions, lookups: platforms limit per method or route) and retries; `retry_scope` says when
    the answer holds more: "chat" (every call to that chat), "account" (every call of the account:
    Discord's global limit). `permanent` means a retry
    cannot help (chat not found, no permission): the delivery is recorded as failed with `reason`.
    `uncertain` means the platform may have performed the call although no answer came (a timeout,
    a connection lost after the request went out): a send is then repeated only where that cannot
    post twice (see `Adapter`)."""

    def __init__(
        self,
        reason: str,
        *,
        retry_after: float | None = None,
        permanent: bool = False,
        uncertain: bool = False,
        retry_scope: RetryScope = "call",
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after = retry_after
        self.permanent = permanent
        self.uncertain = uncertain
        self.retry_scope = retry_scope


class IntakePaused(Exception):
    """`on_message` refuses a message because the gateway takes none now: its server cannot vouch
    for it (a server of a cluster stalled, or cut off from the database: another server may run the
    account any moment). Nothing is recorded; the adapter acknowledges nothing, so the platform
    offers the message again, to whichever gateway runs the account by then."""


class AccountError(Exception):
    """The account cannot run as configured (bad or missing token, bad setting): state `error` with
    this message, and no restart until the configuration changes."""


@dataclass(frozen=True, slots=True)
class Account:
    """One configured account of a channel (`[channels.<channel>.accounts.<name>]`).

    `settings` holds the account's table as written, minus secret references; `secrets` holds each
    reference resolved (`token_env = "X"` or `token_file = "…"` becomes `secrets["token"]`)."""

    channel: str
    name: str
    settings: Mapping[str, Any]
    secrets: Mapping[str, str]
    # Where each secret came from, for error messages: {"token": "environment variable TG_TOKEN"}.
    secret_sources: Mapping[str, str] = field(default_factory=dict)


# Returns whether the message was recorded now (False: a repeat of an id recorded before, not
# processed again; None from an older gateway: not said). A plugin may tell its sender so.
OnMessage = Callable[[InboundMessage], Awaitable[bool | None]]
ReportState = Callable[[AccountState, str | None], None]
# (old chat id, new chat id): the platform moved a chat to a new id for good (a Telegram group
# upgraded to a supergroup). Idempotent: a move already made, or of a chat it keeps nothing for, is a no-op.
MoveChat = Callable[[str, str], Awaitable[None]]


async def _keep_chats(old: str, new: str) -> None:
    """The `move_chat` of a context built without a gateway (a plugin's own tests): nothing to move."""


def _always_open() -> bool:
    """The `intake_open` of a context built without a gateway: messages are always taken."""
    return True


async def _open_now() -> None:
    """The `intake_opened` of a context built without a gateway: open already."""


@dataclass(frozen=True, slots=True)
class AdapterContext:
    """What the gateway gives an adapter besides its account."""

    on_message: OnMessage  # returns after the ledger committed the message (then `ack` was called)
    report: ReportState  # e.g. report("backoff", "socket closed; retrying in 4 s")
    data_dir: Path  # a private directory for the adapter's own files
    log: logging.Logger
    # The biggest image (bytes as fetched) the gateway can pass on to the model now, from the
    # server's frame limit (`image_budget`): pick the largest size a platform offers within it (a
    # Telegram photo), and do not fetch a bigger one; the gateway names it as too big instead.
    max_image_bytes: Callable[[], int] = _default_image_budget
    # A chat got a new id on the platform: the gateway re-points what it keeps under the old one (the
    # conversation bound to it, routes, waiting approval prompts) to the new one, durably, in one
    # transaction; the ids it keeps of messages posted in the old chat become `<old>:<id>` (they stay
    # there). The adapter itself sends to the new id from then on. Returns once committed.
    move_chat: MoveChat = _keep_chats
    # Whether the gateway takes messages now. False while its server cannot vouch for them (a
    # server of a cluster stalled or cut off from the database): `on_message` then refuses
    # (`IntakePaused`) and an adapter acknowledges nothing, so the platform offers the messages
    # again, to whichever gateway runs the account by then. A poller waits for `intake_opened`
    # before polling again (Telegram: no getUpdates, so no offset is confirmed and the next
    # holder's poller meets no conflict); a listener answers "retry later" (the webhook's 503).
    intake_open: Callable[[], bool] = _always_open
    intake_opened: Callable[[], Awaitable[None]] = _open_now


class TokenRefusal:
    """While a platform refuses an account's token on its calls (revoked while the adapter runs):
    the account is `error`, naming the token, from the first refused call until one succeeds again.
    The same bookkeeping for every adapter whose token can be revoked under it (Slack, Telegram,
    Discord); each says what a refusal is and when its account runs."""

    def __init__(self, report: ReportState, log: logging.Logger, where: str, platform: str) -> None:
        self._report = report
        self._log = log
        self._where = where
        self._platform = platform
        self.reason: str | None = None

    def refused(self, reason: str) -> None:
        """A call was refused for the token: `error` with `reason` (logged once per reason)."""
        if self.reason != reason:
            self._log.error("%s", reason)
        self.reason = reason
        self._report("error", reason)

    def accepted(self) -> bool:
        """A call with the token succeeded: True when that ends a refusal (the caller then says
        `running`, if its account runs)."""
        if self.reason is None:
            return False
        self.reason = None
        self._log.info("%s: %s takes the token again", self._where, self._platform)
        return True

    def connected(self) -> tuple[AccountState, str | None]:
        """What an account whose connection is up is: `running`, or `error` while its token is refused."""
        return ("running", None) if self.reason is None else ("error", self.reason)


@runtime_checkable
class Adapter(Protocol):
    """Required part of an adapter. Optional attribute `authenticated_senders` (default False): True
    when every inbound message is authenticated by the integration itself (a signed webhook), so
    direct messages default to `dm_policy = "open"` instead of pairing. Optional attribute
    `settings_keys` (default None): the keys of an account's table the plugin reads, besides the
    gateway's (`GATEWAY_SETTINGS`) and its secret references; when given, an account with any other
    key does not start (state `error` naming the key, `check_keys`). Without it the gateway cannot
    tell a misspelt key from one the plugin reads, so it refuses none. Optional attribute
    `secret_keys` (default None): the names of the secrets it reads from `Account.secrets`; when
    given, an account that gives any other name by reference (`<name>_env`, `<name>_file`) does not
    start (`check_secret_refs`). A reference to a setting (`dm_policy_env`, or one of
    `settings_keys`) is refused either way: settings are never read from a reference. Optional
    methods, looked up with `getattr`:
    `edit(target, message_id, text) -> None` (when `limits.can_edit`),
    `react(target, message_id, emoji) -> None` (when `limits.can_react`),
    `measure(text) -> int` (how the platform counts `max_length`, when not in characters),
    `typing(target) -> None`, `format(text) -> str` (Markdown to the platform's markup; the
    identity when absent), `prompt_approval(target, text, short_id) -> list[str]` (an approval
    prompt with buttons that come back as `/approve <short_id>` / `/deny <short_id>`; `text` is
    Markdown, formatted by the adapter; tagged with `target.key` like a send) and
    `edit_prompt(target, message_id, text, short_id | None) -> None` (edit such a prompt, keeping its
    buttons for a pending `short_id` and removing them for None, also for a prompt posted by an
    earlier process), `shown(target, message_id) -> str | None` (the text the bot's message shows
    now, as formatted; None when it is not there; raises `DeliveryError` when it cannot tell: asked
    after a final edit whose outcome stayed unknown, so the text is posted anew only when the edit
    did not land). The gateway makes every one of these calls through its outbox: rate limited
    and retried like a send; a "wait" answer holds back only that kind of call in the chat
    (`DeliveryError.retry_scope`).

    A send whose outcome is unknown (`DeliveryError(uncertain=True)`, or a restart after a crash
    while it was in flight) is repeated only where that cannot post twice, which an adapter
    declares with one of: `dedupes_sends = True` (the platform itself drops a repeated send with the
    same `Target.key`: Discord's `nonce` with `enforce_nonce`, a webhook receiver deduping on `id`),
    or `find_sent(target, since) -> list[str] | None` (looks for the message sent with `target.key`
    at or after `since`, seconds since the epoch; its ids, None when there is none; raises
    `DeliveryError` when it cannot tell: Slack, by message metadata). Without either, an uncertain
    send is not repeated (the reply fails, loudly, rather than show twice); after a crash such a
    part is sent again, as nothing tells whether the request had left (docs/channels.md, "Exactly
    once")."""

    limits: Limits

    async def start(self) -> None:
        """Connect and begin receiving; returns once running. Raise `AccountError` for a
        configuration the platform refuses (the gateway does not hot-loop on it)."""
        ...

    async def stop(self) -> None: ...

    @property
    def is_running(self) -> bool: ...

    async def send(self, target: Target, text: str) -> list[str]:
        """Post `text` (already formatted and within `limits.max_length`); return the platform's
        message ids. Raise `DeliveryError` when refused."""
        ...


CreateAdapter = Callable[[Account, AdapterContext], Adapter]
