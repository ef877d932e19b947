"""The Telegram adapter: python-telegram-bot's `Bot` for the wire, long polling driven here.

Inbound is ledger-first: `getUpdates` is called by this adapter (never `Application.run_polling`, which
acknowledges on its own schedule), a batch of updates is handed to the gateway together (its ledger
records them in one group commit), and the offset moves only over the prefix of updates the gateway
acknowledged (`InboundMessage.ack`, called after the commit). An update that was not acknowledged is
redelivered by Telegram on the next poll, and so is everything after it; Telegram learns of an
acknowledgement through the next poll's offset (and at stop, through a last zero-timeout poll).
While the gateway's intake is paused (`AdapterContext.intake_open`: its server cannot vouch for
messages now) nothing is polled and no offset confirmed, not at stop either: the updates stay with
Telegram for whichever poller runs the account next (the next holder's meets no 409 from this one).
An album (updates sharing a `media_group_id`) is handed over as one message, acknowledged together;
photos are fetched within a time budget per message and per batch (the whole bot waits for them).

Outbound: text goes as Telegram HTML (`format` turns the reply's Markdown into it); when Telegram
refuses the entities anyway, the unformatted original is sent as plain text instead of losing it.
Replies grow by `editMessageText`; "message is not modified" is success. Errors become
`DeliveryError`s: 429 with its `retry_after`, refusals that a retry cannot fix (blocked, removed
from the group, chat not found) as permanent, network trouble as retryable, except that a failure
after the request may have reached Telegram (a read timeout, a dropped connection) is `uncertain`:
sendMessage has no idempotency key and a bot cannot read a chat back, so the gateway does not repeat
such a send (at most once), while an edit repeats harmlessly.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import re
import warnings
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import httpx
from telegram import (
    Bot,
    CallbackQuery,
    Chat,
    InlineKeyboardButton,
    InlineKeyboardMarkup,
    Message,
    MessageEntity,
    PhotoSize,
    ReplyParameters,
    Update,
    User,
)
from telegram.error import (
    BadRequest,
    ChatMigrated,
    Conflict,
    Forbidden,
    InvalidToken,
    NetworkError,
    RetryAfter,
    TelegramError,
    TimedOut,
)
from telegram.request import HTTPXRequest
from telegram.warnings import PTBDeprecationWarning

from plugins.contract import (
    Account,
    AccountError,
    AccountState,
    AdapterContext,
    Attachment,
    DeliveryError,
    InboundMessage,
    IntakePaused,
    Limits,
    Target,
    TokenRefusal,
    env_seconds,
)
from plugins.statefile import atomic_write_text, move_aside
from plugins.telegram.format import plain, to_html
from plugins.telegram.settings import DEFAULT_API_URL, DEFAULT_POLL_TIMEOUT, SECRETS, check_settings

T = TypeVar("T")

CHANNEL = "telegram"
TELEGRAM_MAX_TEXT = 4096  # Telegram's limit: UTF-16 units of the text it shows (after entity parsing)
MAX_LENGTH = TELEGRAM_MAX_TEXT - 96  # where replies are split (`measure`), a margin below Telegram's limit
BACKOFF_MIN_S = 0.5
# A Bot API call (not the long poll) without an answer by then fails (a send is then looked up).
# Tests against a loopback fake shorten it through the environment (a positive number of seconds).
API_TIMEOUT_S = 15.0
API_TIMEOUT_ENV = "APPSERVER_TELEGRAM_API_TIMEOUT_S"
BACKOFF_MAX_S = 30.0
ALLOWED_UPDATES = ["message", "edited_message", "callback_query", "my_chat_member"]
APPROVE_PREFIX = "approve:"
DENY_PREFIX = "deny:"
# The sender of a message posted as a chat (gateway/access.py CHAT_SENDER_PREFIX): `chat:<chat id>`
CHAT_SENDER_PREFIX = "chat:"
_REMEMBERED_FORMATS = 512
# Photos are downloaded while the poll loop waits, so every chat of the bot waits for them: a
# message's photos (an album's all together) get this long in all, and all the photos of one
# `getUpdates` batch this long together; a photo not fetched by then is named as a file.
FETCH_BUDGET_S = 5.0
BATCH_FETCH_BUDGET_S = 10.0
# An album (messages sharing `media_group_id`) arrives as one update per photo, usually in one
# batch: the loop waits this long after the last new part for more (polling every ALBUM_POLL_S, at
# most ALBUM_MAX_S in all) and hands the album over as one message.
ALBUM_WAIT_S = 1.0
ALBUM_POLL_S = 0.2
ALBUM_MAX_S = 3.0
ALBUMS_FILE = "albums.json"  # the album parts recorded under their first message (for redelivery)
_REMEMBERED_ALBUM_PARTS = 1024
MOVED_FILE = "moved_chats.json"  # groups upgraded to supergroups: old chat id -> new (kept across restarts)
_REMEMBERED_MOVES = 1024
GETUPDATES_LIMIT = 100  # the most updates one getUpdates answers
UNREAD_NOTE = "[an attachment of this message could not be read]"
# Telegram's ids are 64-bit integers, written in ASCII digits (int() also reads `٥`, `1_0` and `+5`,
# and refuses 5000 digits with its own ValueError); only a chat id may be negative (groups).
_CHAT_ID_RE = re.compile(r"-?[0-9]{1,19}")
_ID_RE = re.compile(r"[0-9]{1,19}")

# python-telegram-bot 22 warns, when it builds a RetryAfter, that `retry_after` will become a timedelta;
# `retry_seconds` reads either form, so the warning would only flood the log at each 429.
warnings.filterwarnings("ignore", message=r".*retry_after.*", category=PTBDeprecationWarning)


class TelegramAdapter:
    """One bot token: a long-polling loop for updates, a `Bot` for sends."""

    limits = Limits(max_length=MAX_LENGTH, can_edit=True, can_react=True, edits_per_second=1.0)
    secret_keys = SECRETS  # a reference to any other name is refused (plugins/contract.py)
    prompt_max_length = TELEGRAM_MAX_TEXT

    def __init__(self, account: Account, context: AdapterContext) -> None:
        self.account = account
        self.context = context
        self._log = context.log
        self._where = f"telegram account '{account.name}'"
        self._config_error: str | None = None
        s = account.settings
        try:
            check_settings(s)
        except ValueError as exc:  # refused at start, with the same words `channels add` uses
            self._config_error = f"{self._where}: {exc}"
            s = {}
        self.api_url = str(s.get("api_url", DEFAULT_API_URL)).rstrip("/")
        self.poll_timeout = int(s.get("poll_timeout", DEFAULT_POLL_TIMEOUT))
        self.edited: str = str(s.get("edited", "ignore"))
        self._bot: Bot | None = None
        self._requests: tuple[HTTPXRequest, ...] = ()
        self._token = ""
        self._me: User | None = None
        self._task: asyncio.Task[None] | None = None
        self._offset = 0  # the first update id not yet acknowledged by the gateway
        self._sent_offset = 0  # the offset Telegram is known to have received
        self._state: AccountState = "stopped"
        # the token refused on a send (state `error` until a call, a poll included, succeeds again)
        self._refusal = TokenRefusal(self._report, self._log, self._where, "Telegram")
        self._formatted: OrderedDict[str, str] = OrderedDict()  # HTML we produced -> its Markdown
        self._background: set[asyncio.Task[Any]] = set()
        # `<chat>:<message id>` of album parts recorded under their album's first message -> that one
        self._albums_path = Path(context.data_dir) / ALBUMS_FILE
        self._album_parts: OrderedDict[str, str] = self._load_album_parts()
        self._albums_lock = asyncio.Lock()
        # groups upgraded to supergroups, old chat id -> new: sends for the old id go to the new one,
        # and a message of the old id is the new one's (`_chat_now`), after a restart too (on disk)
        self._moved_path = Path(context.data_dir) / MOVED_FILE
        self._moved_chats: OrderedDict[int, int] = self._load_moves()

    # ------------------------------------------------------------------ lifecycle

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def username(self) -> str | None:
        return self._me.username if self._me is not None else None

    async def start(self) -> None:
        """Check the token with getMe (AccountError when Telegram refuses it) and start polling."""
        if self._config_error is not None:
            raise AccountError(self._config_error)
        if self.is_running:
            return
        token = self.account.secrets.get("token")
        if not token:
            raise AccountError(f"{self._where}: no bot token; set token_env (an environment variable) or token_file")
        self._token = token
        api_timeout = env_seconds(API_TIMEOUT_ENV, API_TIMEOUT_S)
        request = HTTPXRequest(
            connection_pool_size=16, read_timeout=api_timeout, write_timeout=api_timeout, connect_timeout=10.0
        )
        polling = HTTPXRequest(connection_pool_size=2, read_timeout=10.0, connect_timeout=10.0)
        self._requests = (request, polling)
        self._bot = Bot(
            token,
            base_url=f"{self.api_url}/bot",
            base_file_url=f"{self.api_url}/file/bot",
            request=request,
            get_updates_request=polling,
        )
        self._report("starting", None)
        try:
            await self._hello()
        except InvalidToken as exc:
            await self._close_bot()
            raise AccountError(self._token_refused(exc)) from None
        except TelegramError as exc:  # network trouble: the poll loop retries with backoff
            self._report("backoff", f"getMe failed: {_describe(exc)}; retrying")
        else:
            self._report("running", None)
        self._task = asyncio.create_task(self._poll_loop(), name=f"telegram-poll-{self.account.name}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for pending in list(self._background):
            pending.cancel()
        bot = self._bot
        if bot is not None and self._offset > self._sent_offset and self.context.intake_open():
            # Confirm what the gateway acknowledged, so a restart does not see it again (not while
            # intake is paused: the server this gateway serves may not be the one to answer it).
            with contextlib.suppress(Exception):
                await asyncio.wait_for(bot.get_updates(offset=self._offset, timeout=0, limit=1), 3.0)
        await self._close_bot()
        self._report("stopped", None)

    async def _close_bot(self) -> None:
        # The Bot was never `initialize()`d (its getMe would put the token into the error), so its
        # `shutdown()` would skip the HTTP clients: close them here.
        self._bot = None
        requests, self._requests = self._requests, ()
        for request in requests:
            with contextlib.suppress(Exception):
                await request.shutdown()

    async def _hello(self) -> None:
        """getMe (who we are: the @username mentions are matched against), then deleteWebhook so
        that getUpdates is allowed."""
        bot = self._require_bot()
        self._me = await bot.get_me()
        await bot.delete_webhook(drop_pending_updates=False)
        self._log.info("%s: polling as @%s", self._where, self._me.username)

    def _token_refused(self, exc: TelegramError) -> str:
        source = self.account.secret_sources.get("token") or "token_env or token_file"
        return (
            f"{self._where}: Telegram refused the bot token (from {source}): "
            f"{self._scrub(exc.message)}; check the token BotFather gave you"
        )

    def _scrub(self, text: str) -> str:
        """`text` without the bot token (it is part of every API URL, so an error may quote it)."""
        return text.replace(self._token, "<token>") if self._token else text

    def _report(self, state: AccountState, reason: str | None) -> None:
        self._state = state
        reason = self._scrub(reason) if reason else reason
        try:
            self.context.report(state, reason)
        except Exception:
            self._log.exception("%s: report(%s) failed", self._where, state)

    def _require_bot(self) -> Bot:
        if self._bot is None:
            raise DeliveryError(f"{self._where} is not running")
        return self._bot

    # ------------------------------------------------------------------ inbound

    async def _poll_loop(self) -> None:
        delay = BACKOFF_MIN_S
        redeliver = BACKOFF_MIN_S
        bot = self._require_bot()
        while True:
            if not self.context.intake_open():
                await self.context.intake_opened()  # paused: no getUpdates, nothing confirmed
            offset = self._offset
            try:
                if self._me is None:
                    await self._hello()
                updates: Sequence[Update] = await bot.get_updates(
                    offset=offset or None, timeout=self.poll_timeout, allowed_updates=ALLOWED_UPDATES
                )
            except InvalidToken as exc:
                self._report("error", self._token_refused(exc))
                return  # not running: the gateway restarts us once, and start() then stops on AccountError
            except Conflict as exc:
                if "webhook" in exc.message.lower():
                    with contextlib.suppress(TelegramError):
                        await bot.delete_webhook(drop_pending_updates=False)
                self._report(
                    "conflict",
                    "409 Conflict: another poller of this bot token (another account of this gateway, another "
                    f"process, or a webhook); retrying in {delay:g} s",
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, BACKOFF_MAX_S)
                continue
            except RetryAfter as exc:
                wait = max(delay, retry_seconds(exc))
                self._report("backoff", f"getUpdates: flood control; retrying in {wait:g} s")
                await asyncio.sleep(wait)
                continue
            except TelegramError as exc:  # NetworkError, TimedOut, BadRequest, 5xx
                self._report("backoff", f"getUpdates: {_describe(exc)}; retrying in {delay:g} s")
                await asyncio.sleep(delay)
                delay = min(delay * 2, BACKOFF_MAX_S)
                continue
            except (TypeError, ValueError, KeyError, AttributeError) as exc:
                # An update this library version cannot parse (the Bot API moved on): read the batch
                # raw and parse each update alone, so one bad update cannot stop every other one.
                self._log.error("%s: getUpdates returned an update this library cannot read: %r", self._where, exc)
                updates, unreadable = await self._updates_one_by_one(bot, offset)
            else:
                unreadable = set()
            self._sent_offset = max(self._sent_offset, offset)
            delay = BACKOFF_MIN_S
            # getUpdates is a call with the same token: Telegram's 401 is the token's (revoked in
            # BotFather), never one method's, so a poll that succeeds proves it works again (one
            # refused send left the account in `error` for as long as the bot was idle)
            self._refusal.accepted()
            if self._state != "running":
                self._report("running", None)
            if not updates and not unreadable:
                continue
            updates = await self._complete_albums(bot, offset, updates)
            if await self._hand_over(updates, unreadable):
                redeliver = BACKOFF_MIN_S
            elif self.context.intake_open():  # paused: the loop waits for intake instead
                await asyncio.sleep(redeliver)
                redeliver = min(redeliver * 2, BACKOFF_MAX_S)

    async def _updates_one_by_one(self, bot: Bot, offset: int) -> tuple[list[Update], set[int]]:
        """The pending updates parsed one at a time, and the ids of those that cannot be parsed:
        they are logged and acknowledged in order (skipped): nothing in them can be recorded."""
        unreadable: set[int] = set()
        try:
            with warnings.catch_warnings():  # PTB prefers get_updates, which is what cannot parse the batch
                warnings.simplefilter("ignore")
                raw = await bot.do_api_request("getUpdates", api_kwargs={"offset": offset or None, "timeout": 0})
        except TelegramError as exc:
            self._log.warning("%s: getUpdates (raw): %s", self._where, _describe(exc))
            return [], unreadable
        out: list[Update] = []
        for item in raw if isinstance(raw, list) else []:
            try:
                update = Update.de_json(item, bot)
            except Exception as exc:  # noqa: BLE001 - any parse failure: skip this one update
                update = None
                self._log.error("%s: skipping unreadable update %r: %r", self._where, str(item)[:200], exc)
            if update is not None:
                out.append(update)
            elif isinstance(item, dict) and isinstance(item.get("update_id"), int):
                unreadable.add(item["update_id"])
        return out, unreadable

    async def _complete_albums(self, bot: Bot, offset: int, updates: Sequence[Update]) -> Sequence[Update]:
        """The batch with the album parts that follow it: Telegram delivers an album's messages as
        updates of their own, usually in one batch, possibly split over two. While the batch holds
        an album's part, poll again (no long poll, the same offset: nothing is acknowledged) until
        no new part came for `ALBUM_WAIT_S`, at most `ALBUM_MAX_S` in all, so the album is handed
        over whole; the other chats wait that long (about a second) for it."""
        if not any(self._new_part(u) for u in updates if u.update_id >= self._offset):
            return updates
        if len(updates) >= GETUPDATES_LIMIT:
            # A full batch (a backlog): the album's other parts may lie beyond it, and polling again
            # at this offset answers the same batch. Hand over what precedes the album's first part;
            # the next poll then starts at the album, with room for all of it.
            first = next(i for i, u in enumerate(updates) if u.update_id >= self._offset and self._new_part(u))
            if first > 0:
                return updates[:first]
        loop = asyncio.get_running_loop()
        start = last_part = loop.time()
        merged = {u.update_id: u for u in updates}
        count = len(updates)
        while count < GETUPDATES_LIMIT:  # a full batch: what follows is not in the next answer either
            wait = min(last_part + ALBUM_WAIT_S, start + ALBUM_MAX_S) - loop.time()
            if wait <= 0:
                break
            await asyncio.sleep(min(ALBUM_POLL_S, wait))
            try:
                more = await bot.get_updates(offset=offset or None, timeout=0, allowed_updates=ALLOWED_UPDATES)
            except Exception as exc:  # noqa: BLE001 - the next poll meets it again; what is here goes on
                self._log.info("%s: getUpdates while waiting for an album: %s", self._where, _describe(exc))
                break
            count = len(more)
            for update in more:
                if update.update_id not in merged:
                    merged[update.update_id] = update
                    if self._new_part(update):
                        last_part = loop.time()
        return [merged[update_id] for update_id in sorted(merged)]

    async def _hand_over(self, updates: Sequence[Update], unreadable: set[int] | None = None) -> bool:
        """Give a batch to the gateway together, then move the offset over the acknowledged prefix.
        False when an update was not acknowledged (it and everything after it are redelivered). An
        album's parts go as one message, acknowledged together. An update that cannot be read as
        usual (an error nobody expected) is handed over as far as it can be read (`_salvage`): only
        one that holds no message for the gateway is passed over."""
        passed: set[int] = set(unreadable or ())  # acknowledged by the gateway, or nothing for the ledger
        handed: list[tuple[list[int], InboundMessage]] = []
        await self._follow_moves(updates)
        deadline = asyncio.get_running_loop().time() + BATCH_FETCH_BUDGET_S
        for parts in self._group([u for u in updates if u.update_id >= self._offset], passed):
            ids = [u.update_id for u in parts]
            try:
                inbound = await self._inbound(parts, passed, deadline)
            except Exception:
                self._log.exception("%s: could not read update %s; handing over what can be read", self._where, ids)
                try:
                    inbound = self._salvage(parts, passed)
                except Exception:
                    self._log.exception("%s: update %s cannot be read at all; skipping it", self._where, ids)
                    inbound = None
            if inbound is None:
                passed.update(ids)
            else:
                handed.append((ids, inbound))
        results = await asyncio.gather(*(self.context.on_message(m) for _, m in handed), return_exceptions=True)
        paused = [
            inbound.message_id for (_, inbound), r in zip(handed, results, strict=True) if isinstance(r, IntakePaused)
        ]
        if paused:
            self._log.info("%s: intake is paused; %s left with Telegram", self._where, ", ".join(paused))
        for (_, inbound), result in zip(handed, results, strict=True):
            if isinstance(result, asyncio.CancelledError):
                raise result
            if isinstance(result, IntakePaused):
                continue
            if isinstance(result, BaseException):
                self._log.error(
                    "%s: %s not recorded (%s); it will be redelivered", self._where, inbound.message_id, result
                )
        for update_id in sorted(passed | {i for ids, _ in handed for i in ids}):
            if update_id not in passed:
                if not paused:
                    self._log.warning(
                        "%s: update %d was not acknowledged; it will be redelivered", self._where, update_id
                    )
                return False
            self._offset = max(self._offset, update_id + 1)
        return True

    def _new_part(self, update: Update) -> bool:
        """Whether the update is a part of an album not recorded yet (under the album's first message)."""
        key = _album_key(update)
        return key is not None and f"{key[0]}:{_message_number(update.message)}" not in self._album_parts

    def _group(self, updates: Sequence[Update], passed: set[int]) -> list[list[Update]]:
        """The updates one by one, but an album's parts together (where its first one is). A part
        already recorded under its album's first message (acknowledged, and delivered again because
        an update before it was not) is passed over: the ledger has it."""
        out: list[list[Update]] = []
        albums: dict[tuple[int, str], list[Update]] = {}
        for update in updates:
            key = _album_key(update)
            if key is None:
                out.append([update])
                continue
            if not self._new_part(update):
                passed.add(update.update_id)
                continue
            parts = albums.get(key)
            if parts is None:
                parts = albums[key] = []
                out.append(parts)
            parts.append(update)
        return out

    async def _inbound(self, parts: Sequence[Update], passed: set[int], deadline: float) -> InboundMessage | None:
        """The update (or an album's parts) as an InboundMessage, or None when it carries nothing for
        the gateway. Photos are fetched by `deadline` (the batch's budget) and within `FETCH_BUDGET_S`."""
        update = parts[0]
        if update.callback_query is not None:
            return self._callback(update, update.callback_query, self._acker(parts, passed, None, []))
        if update.my_chat_member is not None:
            change = update.my_chat_member
            status = change.new_chat_member.status
            if status in ("left", "kicked"):
                self._log.info("%s: removed from chat %s (%s)", self._where, change.chat.id, status)
            return None
        parts, messages, suffix = self._messages_of(parts)
        if not messages:
            return None
        if await self._migration(messages[0]):
            return None
        loop = asyncio.get_running_loop()
        budget = min(deadline, loop.time() + FETCH_BUDGET_S)
        found = await asyncio.gather(*(self._attachments(m, budget) for m in messages), return_exceptions=True)
        attachments: list[Attachment] = []
        unread = False
        for message, result in zip(messages, found, strict=True):
            if isinstance(result, asyncio.CancelledError):
                raise result
            if isinstance(result, BaseException):
                self._log.error(
                    "%s: could not read the media of message %s: %r", self._where, message.message_id, result
                )
                unread = True
            else:
                attachments.extend(result)
        text = _joined(messages, unread)
        if not text and not attachments:
            return None  # a service message (joined, pinned, topic created, …), a sticker without an emoji
        mentions = any(self._mentions_me(m) for m in messages)
        return self._message(parts, passed, messages, suffix, text, attachments, mentions)

    async def _migration(self, message: Message) -> bool:
        """Whether `message` is the service message of a group upgraded to a supergroup: in the old
        chat it names the new id (`migrate_to_chat_id`), in the new one the old id
        (`migrate_from_chat_id`). Either one is enough to follow the chat there (`_chat_moved`)."""
        if message.migrate_to_chat_id:
            await self._chat_moved(message.chat.id, message.migrate_to_chat_id)
            return True
        if message.migrate_from_chat_id:
            await self._chat_moved(message.migrate_from_chat_id, message.chat.id)
            return True
        return False

    def _salvage(self, parts: Sequence[Update], passed: set[int]) -> InboundMessage | None:
        """What can be read of a message whose reading failed unexpectedly (`_inbound` raised): its
        text or caption, with a note when it carried media, and nothing that needs more reading (no
        download, no entities). None only when the update holds no message for the gateway."""
        parts, messages, suffix = self._messages_of(parts)
        if not messages:
            return None
        text = _joined(messages, any(_has_media(m) for m in messages))
        if not text:
            return None
        me = self._me
        handle = f"@{me.username}".lower() if me is not None and me.username else None
        return self._message(parts, passed, messages, suffix, text, [], bool(handle and handle in text.lower()))

    def _messages_of(self, parts: Sequence[Update]) -> tuple[list[Update], list[Message], str]:
        """The updates and their messages, an album's in the order they were sent (the first is the
        one that stands for them all), and the suffix of an edit's key (`edited = "new"`)."""
        if len(parts) == 1:
            update = parts[0]
            if update.message is not None:
                return [update], [update.message], ""
            if update.edited_message is not None and self.edited == "new":
                # The update's id: one per edit, the same when Telegram delivers it again (an edit's
                # `edit_date` has whole seconds, so two quick edits would share a key and one be lost).
                return [update], [update.edited_message], f":u{update.update_id}"
            return [update], [], ""
        ordered = sorted((u for u in parts if u.message is not None), key=lambda u: _message_number(u.message))
        return ordered, [u.message for u in ordered if u.message is not None], ""

    def _acker(
        self, parts: Sequence[Update], passed: set[int], first: str | None, others: list[str]
    ) -> Callable[[], Awaitable[None]]:
        """The `ack` for these updates: called after the ledger committed their message. An album's
        other parts are noted first as recorded under its first message (`first`)."""
        ids = [u.update_id for u in parts]

        async def ack() -> None:
            if first is not None and others:
                await self._remember_album(first, others)
            passed.update(ids)

        return ack

    def _message(
        self,
        parts: Sequence[Update],
        passed: set[int],
        messages: Sequence[Message],
        suffix: str,
        text: str,
        attachments: Sequence[Attachment],
        mentions: bool,
    ) -> InboundMessage:
        message = messages[0]  # an album's first: its id is the key, the others are noted under it
        sender = message.from_user
        chat = message.chat
        as_chat = message.sender_chat  # an anonymous admin (the group itself) or a channel posting
        thread = str(message.message_thread_id) if message.is_topic_message and message.message_thread_id else None
        reply = message.reply_to_message
        if reply is not None and thread is not None and reply.message_id == message.message_thread_id:
            reply = None  # in a forum topic every message "replies" to the topic's first message
        me = self._me
        replies_to_bot = (
            reply is not None and reply.from_user is not None and me is not None and reply.from_user.id == me.id
        )
        key = f"{chat.id}:{message.message_id}{suffix}"
        others = [f"{m.chat.id}:{m.message_id}" for m in messages[1:]]
        raw = parts[0].to_dict()
        if len(parts) > 1:
            raw["album"] = [u.to_dict() for u in parts[1:]]
        return InboundMessage(
            channel=CHANNEL,
            account=self.account.name,
            chat=self._chat_now(chat.id),
            chat_type="dm" if chat.type == "private" else "group",
            sender=_sender_id(sender, as_chat, chat),
            message_id=key,
            text=text,
            thread=thread,
            sender_name=as_chat.title if as_chat is not None else _name(sender) if sender is not None else chat.title,
            mentions_bot=replies_to_bot or mentions,
            reply_to=f"{chat.id}:{reply.message_id}" if reply is not None else None,
            # Posted as a chat, `from` is a placeholder bot (GroupAnonymousBot, Channel_Bot): not a bot's message
            sender_is_bot=bool(as_chat is None and sender is not None and sender.is_bot),
            ts=message.date.timestamp() if message.date else None,
            attachments=tuple(attachments),
            raw=raw,
            ack=self._acker(parts, passed, key, others),
        )

    def _load_album_parts(self) -> OrderedDict[str, str]:
        """The album parts recorded under their album's first message, as saved (`_remember_album`)."""
        value = self._read_map(self._albums_path, "album parts delivered again may be answered twice")
        if all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            return OrderedDict(value)
        return self._damaged(self._albums_path, "album parts delivered again may be answered twice")

    def _load_moves(self) -> OrderedDict[int, int]:
        """The groups upgraded to supergroups, as saved (`_chat_moved`): a message of the old group
        Telegram delivers after a restart is still the supergroup's (its route, agent, approvals)."""
        consequence = "a message of an upgraded group delivered late may be routed by its old id"
        value = self._read_map(self._moved_path, consequence)
        if all(_CHAT_ID_RE.fullmatch(k) and isinstance(v, str) and _CHAT_ID_RE.fullmatch(v) for k, v in value.items()):
            return OrderedDict((int(k), int(v)) for k, v in value.items())
        return self._damaged(self._moved_path, consequence)

    def _read_map(self, path: Path, consequence: str) -> dict[Any, Any]:
        """The JSON object saved at `path`; {} when there is none or it cannot be read. A damaged file
        is moved aside (`<name>.corrupt-<UTC time>`) with an error, never read as empty and
        overwritten unseen."""
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return {}
        except OSError as exc:
            self._log.error("%s: cannot read %s (%s); %s", self._where, path, exc, consequence)
            return {}
        try:
            value = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            value = None
        return value if isinstance(value, dict) else self._damaged(path, consequence)

    def _damaged(self, path: Path, consequence: str) -> OrderedDict[Any, Any]:
        try:
            where = f"moved aside to {move_aside(path)}"
        except OSError as exc:
            where = f"left as it is ({exc})"
        self._log.error("%s: %s is damaged: %s; %s", self._where, path, where, consequence)
        return OrderedDict()

    async def _remember_album(self, first: str, others: Sequence[str]) -> None:
        """Note an album's other parts as recorded under its first message (the ledger has just
        committed it), on disk before Telegram is told: a part delivered again, after a crash or
        because an update before it was not acknowledged, is then passed over instead of being
        answered as a message of its own."""
        async with self._albums_lock:
            for key in others:
                self._album_parts[key] = first
                self._album_parts.move_to_end(key)
            while len(self._album_parts) > _REMEMBERED_ALBUM_PARTS:
                self._album_parts.popitem(last=False)
            text = json.dumps(dict(self._album_parts))
            try:
                await asyncio.to_thread(atomic_write_text, self._albums_path, text)
            except OSError as exc:
                self._log.warning("%s: could not save %s: %s", self._where, self._albums_path, exc)

    def _mentions_me(self, message: Message) -> bool:
        me = self._me
        if me is None:
            return False
        handle = f"@{me.username}".lower() if me.username else None
        entities = message.parse_entities() if message.text else message.parse_caption_entities()
        for entity, fragment in entities.items():
            if entity.type == MessageEntity.MENTION and handle and fragment.lower() == handle:
                return True
            if entity.type == MessageEntity.TEXT_MENTION and entity.user is not None and entity.user.id == me.id:
                return True
            if entity.type == MessageEntity.BOT_COMMAND and handle and fragment.lower().endswith(handle):
                return True
        text = (message.text or message.caption or "").lower()
        return bool(handle and not entities and handle in text)

    def _callback(
        self, update: Update, query: CallbackQuery, ack: Callable[[], Awaitable[None]]
    ) -> InboundMessage | None:
        data = query.data or ""
        message = query.message
        command = None
        if data.startswith(APPROVE_PREFIX):
            command = f"/approve {data[len(APPROVE_PREFIX) :]}"
        elif data.startswith(DENY_PREFIX):
            command = f"/deny {data[len(DENY_PREFIX) :]}"
        if command is None or message is None:
            self._spawn(self._answer_callback(query.id, None))
            return None
        chat = message.chat
        thread = None
        if isinstance(message, Message) and message.is_topic_message and message.message_thread_id:
            thread = str(message.message_thread_id)

        async def ack_and_answer() -> None:
            # Neutral (the spinner stops, no toast): whether this person may answer is the gateway's
            # decision, made after this; it edits the prompt, or tells a refused presser in the chat.
            await ack()
            self._spawn(self._answer_callback(query.id, None))

        sender = query.from_user
        return InboundMessage(
            channel=CHANNEL,
            account=self.account.name,
            chat=self._chat_now(chat.id),
            chat_type="dm" if chat.type == "private" else "group",
            sender=str(sender.id),
            message_id=f"cb:{query.id}",
            text=command,
            thread=thread,
            sender_name=_name(sender),
            mentions_bot=True,
            reply_to=f"{chat.id}:{message.message_id}",
            sender_is_bot=sender.is_bot,
            pressed=True,
            raw=update.to_dict(),
            ack=ack_and_answer,
        )

    async def _answer_callback(self, query_id: str, text: str | None) -> None:
        """Stop the button's spinner. A query answered before a crash, or too old, is refused: fine."""
        bot = self._bot
        if bot is None:
            return
        try:
            await bot.answer_callback_query(query_id, text=text)
        except TelegramError as exc:
            self._log.info("%s: answerCallbackQuery %s: %s", self._where, query_id, _describe(exc))

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _photo(self, sizes: Sequence[PhotoSize], deadline: float) -> Attachment:
        """The largest size of a photo that can reach the model: Telegram offers several (a
        thumbnail up to the original), and an image travels to the server base64-encoded in the
        turn's frame, so the limit is the gateway's `max_image_bytes()` (about 2.95 MiB with the
        server's default 4 MiB frame), not the 5 MiB the gateway keeps at most. Sizes are ranked by
        their pixels (`file_size` is optional in the Bot API: one without it may be the largest). A
        size Telegram says is bigger is not fetched; one whose download turns out bigger, or that
        cannot be fetched for any reason (getFile "file is too big", a getFile answer without
        `file_path`, a failed download), is passed over for the next smaller one. The downloads end
        at `deadline` (the message's share of the download budget): a photo not fetched by then is
        not waited for. None fits: the photo is named as too big (an image without data) and the
        caption goes on; none could be fetched at all: it is named as a file."""
        limit = self.context.max_image_bytes()
        loop = asyncio.get_running_loop()
        by_size = sorted(sizes, key=lambda p: (p.width * p.height, p.file_size or 0), reverse=True)
        largest = by_size[0]
        name = f"photo_{largest.file_unique_id}.jpg"
        too_big = max((p.file_size or 0 for p in by_size), default=0)  # the biggest size seen
        for size in [p for p in by_size if (p.file_size or 0) <= limit]:
            left = deadline - loop.time()
            try:
                if left <= 0:
                    raise TimeoutError
                data = await asyncio.wait_for(self._download(size.file_id), left)
            except TimeoutError:
                self._log.warning("%s: photo %s not fetched within the download budget", self._where, name)
                break
            except Exception as exc:  # noqa: BLE001 - getFile without file_path (RuntimeError), refused, failed
                self._log.warning("%s: could not fetch photo %s: %r", self._where, size.file_id, exc)
                continue
            if 0 < len(data) <= limit:
                return Attachment(kind="image", name=name, mime="image/jpeg", size=len(data), data=data)
            too_big = max(too_big, len(data))
        if too_big <= limit:  # nothing was too big: what could not be fetched is named as a file
            return Attachment(kind="file", name=name, mime="image/jpeg", size=largest.file_size)
        self._log.info("%s: photo %s: no size Telegram offers fits in %d bytes", self._where, name, limit)
        return Attachment(kind="image", name=name, mime="image/jpeg", size=too_big)

    async def _download(self, file_id: str) -> bytes:
        file = await self._require_bot().get_file(file_id)
        return bytes(await file.download_as_bytearray())

    async def _attachments(self, message: Message, deadline: float) -> list[Attachment]:
        """The message's media: a photo fetched (by `deadline`), anything else named. A sticker is
        no attachment: it comes as its emoji, in the text (`_text_of`)."""
        out: list[Attachment] = []
        if message.photo:
            out.append(await self._photo(message.photo, deadline))
        if message.document is not None:
            doc = message.document
            out.append(
                Attachment(
                    kind="file",
                    name=doc.file_name or "document",
                    mime=doc.mime_type or "application/octet-stream",
                    size=doc.file_size,
                )
            )
        for kind, media, default_mime in (
            ("voice message", message.voice, "audio/ogg"),
            ("audio", message.audio, "audio/mpeg"),
            ("video", message.video, "video/mp4"),
            ("video message", message.video_note, "video/mp4"),
            ("animation", message.animation, "video/mp4"),
        ):
            if media is not None:
                mime = getattr(media, "mime_type", None) or default_mime
                name = getattr(media, "file_name", None) or kind
                out.append(Attachment(kind="file", name=name, mime=mime, size=media.file_size))
        return out

    # ------------------------------------------------------------------ outbound

    @staticmethod
    def measure(text: str) -> int:
        """The length of our HTML (`format`'s output) as Telegram counts it: the text it shows (tags
        not counted, `&amp;` one character), in UTF-16 code units (an emoji is two). Counting the
        HTML source would split a reply full of `&`, `<`, `>` into several times the messages."""
        return utf16_len(plain(text))

    @staticmethod
    def prompt_length(text: str) -> int:
        """An approval prompt's Markdown as Telegram counts it once formatted (`measure` of `to_html`):
        its escapes of hidden characters made a prompt longer than Telegram takes."""
        return utf16_len(plain(to_html(text)))

    def format(self, text: str) -> str:
        """The reply's Markdown as Telegram HTML (remembered, so a refused one can go out as plain text)."""
        html = to_html(text)
        self._formatted[html] = text
        self._formatted.move_to_end(html)
        while len(self._formatted) > _REMEMBERED_FORMATS:
            self._formatted.popitem(last=False)
        return html

    def _plain(self, html: str) -> str:
        """The fallback for HTML Telegram refused: the Markdown it came from, unless that is longer
        than Telegram takes (markup and link URLs count there; the part was measured as shown), else
        the text the HTML shows, which `measure` kept within the limit."""
        original = self._formatted.get(html)
        if original is not None and utf16_len(original) <= TELEGRAM_MAX_TEXT:
            return original
        return plain(html)

    async def send(self, target: Target, text: str) -> list[str]:
        message = await self._send(target, text)
        return [_sent_id(target, message)]

    async def prompt_approval(self, target: Target, text: str, short_id: str) -> list[str]:
        """The approval prompt with Approve / Deny buttons; a press comes back as /approve or /deny."""
        keyboard = InlineKeyboardMarkup(
            [
                [
                    InlineKeyboardButton("✅ Approve", callback_data=f"{APPROVE_PREFIX}{short_id}"),
                    InlineKeyboardButton("❌ Deny", callback_data=f"{DENY_PREFIX}{short_id}"),
                ]
            ]
        )
        message = await self._send(target, self.format(text), keyboard)
        return [_sent_id(target, message)]

    async def _send(self, target: Target, html: str, markup: InlineKeyboardMarkup | None = None) -> Message:
        bot = self._require_bot()
        chat_id = _chat_id(target.chat)
        thread = _int_or_none(target.thread)
        reply = None
        if target.reply_to and chat_id < 0:  # groups: thread the reply under its message; DMs need not
            reply_id = _message_id(target.reply_to)
            # a message of the group this supergroup was (`_chat_now`): its number means another one here
            if reply_id is not None and _message_chat(target.reply_to) in (None, chat_id):
                reply = ReplyParameters(message_id=reply_id, allow_sending_without_reply=True)

        async def go(text: str, parse_mode: str | None) -> Message:
            return await self._in_chat(
                chat_id,
                lambda chat: bot.send_message(
                    chat,
                    text,
                    parse_mode=parse_mode,
                    message_thread_id=thread,
                    reply_parameters=reply if chat == chat_id else None,  # its id is the old chat's
                    reply_markup=markup,
                ),
            )

        return await self._formatted_call(html, go)

    async def edit(self, target: Target, message_id: str, text: str) -> None:
        bot = self._require_bot()
        chat_id = _message_chat(message_id) or _chat_id(target.chat)  # where the message is
        mid = _message_id(message_id)
        if mid is None:
            raise DeliveryError(f"not a Telegram message id: {message_id!r}", permanent=True)

        async def go(body: str, parse_mode: str | None) -> Any:
            return await self._in_chat(
                chat_id,
                lambda chat: bot.edit_message_text(body, chat_id=chat, message_id=mid, parse_mode=parse_mode),
                follow=False,
            )

        try:
            await self._formatted_call(text, go)
        except _NotModified:
            return

    async def _formatted_call(self, html: str, go: Callable[[str, str | None], Awaitable[T]]) -> T:
        """`go(html, "HTML")`; when Telegram cannot parse the entities, `go(original, None)` instead."""
        try:
            return await self._delivered(go(html, "HTML"))
        except _EntitiesRefused as exc:
            self._log.warning("%s: Telegram refused the formatting (%s); sending plain text", self._where, exc)
            return await self._delivered(go(self._plain(html), None))

    async def _delivered(self, call: Awaitable[T]) -> T:
        """`_delivery(call)`, watching the token: a 401 (revoked in BotFather) puts the account in
        `error` naming the token at once, as the next poll would only when its long poll ends; a
        call that succeeds again ends that."""
        try:
            result = await _delivery(call)
        except _TokenRefused as exc:
            cause = exc.__cause__
            reason = (
                self._token_refused(cause)
                if isinstance(cause, TelegramError)
                else f"{self._where}: Telegram refused the bot token: {self._scrub(exc.reason)}"
            )
            self._refusal.refused(reason)
            raise
        if self._refusal.accepted() and self.is_running:
            self._report("running", None)
        return result

    async def typing(self, target: Target) -> None:
        bot = self._require_bot()
        thread = _int_or_none(target.thread)
        await self._delivered(
            self._in_chat(
                _chat_id(target.chat), lambda chat: bot.send_chat_action(chat, "typing", message_thread_id=thread)
            )
        )

    async def react(self, target: Target, message_id: str, emoji: str) -> None:
        bot = self._require_bot()
        mid = _message_id(message_id)
        if mid is None:
            raise DeliveryError(f"not a Telegram message id: {message_id!r}", permanent=True)
        await self._delivered(
            self._in_chat(
                _message_chat(message_id) or _chat_id(target.chat),
                lambda chat: bot.set_message_reaction(chat, mid, reaction=emoji),
                follow=False,  # the message is the old chat's: its id means another one in the new chat
            )
        )

    async def _in_chat(self, chat_id: int, call: Callable[[int], Awaitable[T]], *, follow: bool = True) -> T:
        """`call(chat id)`, for a chat whose group may have become a supergroup, with a new id: Telegram
        refuses a call for the old id (ChatMigrated, naming the new one; nothing was done) and the
        gateway is told (`_chat_moved`). With `follow` (a send: nothing in it is the old chat's) the
        call goes where the chat lives now, made again there once when refused; without it (about a
        message of the old chat, whose id means another message in the new one) the refusal stands."""
        if follow:
            chat_id = self._moved_chats.get(chat_id, chat_id)
        try:
            return await call(chat_id)
        except ChatMigrated as exc:
            new_id = int(exc.new_chat_id)
            if new_id == chat_id:
                raise
            await self._chat_moved(chat_id, new_id)
            if not follow:
                raise
            return await call(new_id)

    def _chat_now(self, chat_id: int) -> str:
        """The id the gateway knows chat `chat_id` by: the supergroup's for a message of a group that
        became one (`_chat_moved`), delivered late (after a restart too), held back by Telegram or
        in the upgrade's own batch (`_follow_moves`), so it is routed and answered as the chat is
        now. Its message id keeps the old chat's id: it names that message."""
        return str(self._moved_chats.get(chat_id, chat_id))

    async def _follow_moves(self, updates: Sequence[Update]) -> None:
        """Follow every group upgrade a batch announces (its service messages) before any message of
        it is read: a message of the old group that comes before them in the batch (a backlog) is
        then the supergroup's, like one that comes after, never recorded under the old id whose
        routes the move takes away."""
        for update in updates:
            message = update.message
            if update.update_id >= self._offset and message is not None:
                with contextlib.suppress(Exception):  # `_inbound` meets it again, and says what is wrong
                    await self._migration(message)

    async def _chat_moved(self, old: int, new: int) -> None:
        """Telegram said group `old` is now supergroup `new` (a refused call, or the service message in
        either chat, whichever came first): calls for `old` go to `new` from now on, and the gateway
        moves what it keeps under `old` (conversation, routes, waiting prompts) to `new`; then the
        move is saved (`MOVED_FILE`), so a message of `old` delivered after a restart follows it too
        (saved means moved: a restart does not move again). When the gateway could not, the next
        call for `old` tries again."""
        if old == new or self._moved_chats.get(old) == new:
            return
        self._moved_chats[old] = new
        self._log.info("%s: group %s became supergroup %s; following it there", self._where, old, new)
        try:
            await self.context.move_chat(str(old), str(new))
        except Exception:
            self._moved_chats.pop(old, None)
            self._log.exception("%s: the gateway could not move chat %s to %s", self._where, old, new)
            return
        await self._save_moves()

    async def _save_moves(self) -> None:
        """Write the upgraded groups to disk (the most recent `_REMEMBERED_MOVES`), before the
        service message that announced the last one is acknowledged (a crash first: it comes again)."""
        while len(self._moved_chats) > _REMEMBERED_MOVES:
            self._moved_chats.popitem(last=False)
        text = json.dumps({str(old): str(new) for old, new in self._moved_chats.items()})
        try:
            await asyncio.to_thread(atomic_write_text, self._moved_path, text)
        except OSError as exc:
            self._log.warning("%s: could not save %s: %s", self._where, self._moved_path, exc)


class _NotModified(DeliveryError):
    """An edit to the text the message already shows: success for the caller."""


class _TokenRefused(DeliveryError):
    """Telegram refused the bot token (401): revoked or wrong."""


class _EntitiesRefused(DeliveryError):
    """Telegram could not parse the HTML we sent."""


async def _delivery(call: Awaitable[T]) -> T:
    """Await a Bot call, its failures as DeliveryError."""
    try:
        return await call
    except RetryAfter as exc:
        raise DeliveryError(f"Telegram: {exc.message}", retry_after=retry_seconds(exc)) from exc
    except ChatMigrated as exc:
        raise DeliveryError(f"Telegram: the group became a supergroup ({exc.new_chat_id})", permanent=True) from exc
    except BadRequest as exc:
        text = exc.message.lower()
        if "message is not modified" in text:
            raise _NotModified(exc.message, permanent=True) from exc
        if "can't parse entities" in text or "can't find end" in text or "unsupported start tag" in text:
            raise _EntitiesRefused(exc.message, permanent=True) from exc
        raise DeliveryError(f"Telegram: {exc.message}", permanent=True) from exc
    except Forbidden as exc:  # blocked by the user, removed from the group: no retry storm
        raise DeliveryError(f"Telegram: {exc.message}", permanent=True) from exc
    except InvalidToken as exc:
        raise _TokenRefused(f"Telegram refused the bot token: {exc.message}", permanent=True) from exc
    except (TimedOut, NetworkError) as exc:
        if answered_with_error(exc):  # a 5xx in the Bot API's own JSON: it did not do the call
            raise DeliveryError(f"Telegram answered with an error: {_describe(exc)}") from exc
        raise DeliveryError(f"Telegram unreachable: {_describe(exc)}", uncertain=may_have_arrived(exc)) from exc
    except TelegramError as exc:
        # An answer that is no JSON at all (a proxy's or a maintenance page served with 200): the Bot
        # API may have done the call behind it, so it is as uncertain as a lost answer.
        raise DeliveryError(f"Telegram: {_describe(exc)}", uncertain=isinstance(exc.__cause__, ValueError)) from exc


def answered_with_error(exc: NetworkError) -> bool:
    """Whether the Bot API itself answered the call with an error (HTTP 5xx, `ok: false` in its
    JSON): the call was refused, not lost, so repeating it cannot post twice. python-telegram-bot
    raises such an answer without a cause; a transport failure comes from the httpx error, and an
    answer it could not parse (a proxy's 502 page, whose backend may have done the call) from that
    parse failure."""
    return exc.__cause__ is None and not isinstance(exc, TimedOut)


def may_have_arrived(exc: NetworkError) -> bool:
    """Whether Telegram may have performed a call that failed this way: yes unless the connection
    was never made (python-telegram-bot raises from the httpx error). sendMessage takes no
    idempotency key and a bot cannot read a chat back, so the gateway does not repeat such a send."""
    return not isinstance(exc.__cause__, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout)


def retry_seconds(exc: RetryAfter) -> float:
    """`RetryAfter.retry_after` in seconds, whichever representation the library is set to use."""
    value: Any = getattr(exc, "_retry_after", None)
    if value is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            value = exc.retry_after
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    return float(value)


def utf16_len(text: str) -> int:
    """Telegram counts lengths in UTF-16 code units (an emoji is two)."""
    return len(text.encode("utf-16-le", "surrogatepass")) // 2


def _describe(exc: BaseException) -> str:
    message = getattr(exc, "message", None) or str(exc)
    return f"{type(exc).__name__}: {message}"


def _album_key(update: Update) -> tuple[int, str] | None:
    """(chat id, media_group_id) of a new message that is part of an album, else None."""
    message = update.message
    if message is None or not message.media_group_id:
        return None
    return message.chat.id, message.media_group_id


def _message_number(message: Message | None) -> int:
    return message.message_id if message is not None else 0


def _text_of(message: Message) -> str:
    """What a person wrote: the text, a media's caption, or a sticker's emoji (a sticker is sent
    like a reaction; one without an emoji says nothing, and alone it is not handed over)."""
    text = message.text or message.caption
    if text:
        return text
    sticker = message.sticker
    if sticker is not None:
        return sticker.emoji or ""
    return _described(message)


def _sender_id(sender: User | None, as_chat: Chat | None, chat: Chat) -> str:
    """Who wrote it, as `allow` and `admins` name them: a user's id, or `chat:<id>` for a message
    posted as a chat (an anonymous group admin is the group acting, `chat:<the group's id>`; a post
    sent as a channel, or forwarded from a linked channel, is that channel)."""
    if as_chat is not None:
        return f"{CHAT_SENDER_PREFIX}{as_chat.id}"
    return str(sender.id) if sender is not None else str(chat.id)


def _described(message: Message) -> str:
    """A short text for a message that has no text but says something the agent can act on (a
    location, a venue, a contact, a die, a poll); "" for anything else. A contact's phone number is
    passed on: the person chose to send it to the bot."""
    venue, location, contact, dice, poll = message.venue, message.location, message.contact, message.dice, message.poll
    if venue is not None:  # a venue carries its location too: described once, as the venue
        where = venue.location
        return f"[venue: {venue.title}, {venue.address} ({where.latitude}, {where.longitude})]"
    if location is not None:
        return f"[location: {location.latitude}, {location.longitude}]"
    if contact is not None:
        name = " ".join(n for n in (contact.first_name, contact.last_name) if n)
        return f"[contact: {name}, {contact.phone_number}]"
    if dice is not None:
        return f"[dice {dice.emoji}: {dice.value}]"
    if poll is not None:
        options = " / ".join(o.text for o in poll.options)
        return f"[poll: {poll.question} ({options})]"
    return ""


def _has_media(message: Message) -> bool:
    return bool(
        message.photo
        or message.document
        or message.voice
        or message.audio
        or message.video
        or message.video_note
        or message.animation
    )


def _joined(messages: Sequence[Message], unread: bool) -> str:
    """The texts of the messages (an album's captions, in order), one per line; with a note when
    media of theirs could not be read."""
    texts = [t for t in (_text_of(m) for m in messages) if t]
    if unread:
        texts.append(UNREAD_NOTE)
    return "\n".join(texts)


def _name(user: User) -> str:
    return user.full_name or (f"@{user.username}" if user.username else str(user.id))


def _chat_id(chat: str) -> int:
    if not _CHAT_ID_RE.fullmatch(chat):
        raise DeliveryError(f"not a Telegram chat id: {_cut(chat)!r}", permanent=True)
    return int(chat)


def _int_or_none(value: str | None) -> int | None:
    if value is None or value == "":
        return None
    if not _ID_RE.fullmatch(value):
        raise DeliveryError(f"not a Telegram thread id: {_cut(value)!r}", permanent=True)
    return int(value)


def _message_id(value: str) -> int | None:
    """A message id as the gateway holds it: ours (`"42"`) or an inbound one (`"<chat>:42"`, `"<chat>:42:u…"`);
    None for a callback query's (`"cb:…"`) or anything else that is no message id."""
    parts = value.split(":")
    if parts[0] == "cb":
        return None
    number = parts[1] if len(parts) > 1 else parts[0]
    return int(number) if _ID_RE.fullmatch(number) else None


def _message_chat(value: str) -> int | None:
    """The chat of a message id that names it (`"<chat>:42"`: an inbound message's, or one we posted
    where its chat went, `_sent_id`); None for a bare id (the target's chat is the message's)."""
    parts = value.split(":")
    return int(parts[0]) if len(parts) > 1 and _CHAT_ID_RE.fullmatch(parts[0]) else None


def _sent_id(target: Target, message: Message) -> str:
    """The id the gateway keeps of a message we posted: bare in the target's chat; `"<chat>:<id>"`
    when it went to the supergroup the target's group became, so its edits go there and never to the
    old chat's message of the same number (`edit`)."""
    if str(message.chat_id) == target.chat:
        return str(message.message_id)
    return f"{message.chat_id}:{message.message_id}"


def _cut(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[:limit] + "…"


def create_adapter(account: Account, context: AdapterContext) -> TelegramAdapter:
    """The plugin entry point (see `plugins.contract`)."""
    return TelegramAdapter(account, context)
