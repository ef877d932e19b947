"""The Slack adapter: Socket Mode in (slack_sdk's aiohttp `SocketModeClient`), the Web API out
(`AsyncWebClient`). No public URL is needed.

Inbound, ledger-first: each `events_api` envelope becomes an `InboundMessage` whose `ack` sends the
envelope's acknowledgement; the gateway calls it once its ledger committed the message, so an
envelope is acknowledged only after the commit (well within Slack's 3 s). An envelope the gateway
could not take stays unacknowledged and Slack redelivers it (`retry_attempt` + 1, same event): the
message id is `<channel>:<ts>`, independent of the envelope and the event id, so a redelivery (or
the `message.channels` twin of an `app_mention`) is the same ledger key and never a second turn.
Events that are not messages for the agent (edits, joins, deletions, …) are acknowledged at once.
slack_sdk runs each envelope in its own task; a per-chat ticket (`plugins.inorder`) taken as the
envelope arrives hands a chat's messages to the gateway in arrival order, so a message whose image is
still downloading is not overtaken by the next one (a later message waits for it at most
`FETCH_TIMEOUT_S + ORDER_MARGIN_S` from its own arrival, which keeps its ack within Slack's 3 s).

Threads: a DM's main line is its conversation; in a channel every top-level mention starts a
thread (the reply is posted in the thread of the mention: `thread` is the mention's ts), and
messages in a thread carry its `thread_ts`. So a Slack thread is one conversation. (A channel
message without a mention, which only `group_policy = "open"` lets through, belongs to the
channel's main line and is answered there.)

The socket: the library reconnects by itself when Slack asks (`disconnect` frames); a watchdog
notices a dropped socket, reports `backoff`, reconnects with a growing pause (0.5 s → 30 s) and
reports `running` again. A token Slack refuses (`invalid_auth`, …) is an `AccountError` at start,
and a refusal while reconnecting puts the account in `error` (no hot loop).

Outbound, once per part: every `chat.postMessage` of a reply part carries message metadata
(`event_type` `appserver_reply`, `event_payload.key` = the part's `Target.key`). When a post's
outcome is unknown (no answer within the timeout, the connection lost after the request went out,
an answer that does not say Slack refused it: `internal_error`, `fatal_error`, `service_unavailable`,
a 5xx, an HTML page; or a restart after a crash while it was in flight), the gateway calls `find_sent`, which reads the
messages since that post began (`conversations.history`, or `conversations.replies` in a thread,
with `include_all_metadata`) and returns the one carrying the key, so the reply continues in it
instead of posting it twice. slack_sdk's own retry after a dropped connection is kept for every
method but `chat.postMessage`, for the same reason. A reply's final `chat.update` whose outcome stays
unknown is looked up the same way (`shown`: the message's text now), so the gateway posts the final
text anew when the edit did not land. `ratelimited` holds back only that kind of call in the channel
(Slack limits per API method): a rate limit on `reactions.add` never holds a reply's posts and edits.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from typing import Any

import aiohttp
import httpx
from aiohttp import ClientWebSocketResponse, WSMsgType
from slack_sdk.errors import SlackApiError
from slack_sdk.http_retry.builtin_async_handlers import AsyncConnectionErrorRetryHandler
from slack_sdk.http_retry.request import HttpRequest as RetryRequest
from slack_sdk.http_retry.response import HttpResponse as RetryResponse
from slack_sdk.http_retry.state import RetryState
from slack_sdk.socket_mode.aiohttp import SocketModeClient
from slack_sdk.socket_mode.async_client import AsyncBaseSocketModeClient
from slack_sdk.socket_mode.request import SocketModeRequest
from slack_sdk.socket_mode.response import SocketModeResponse
from slack_sdk.web.async_client import AsyncWebClient

from plugins.contract import (
    Account,
    AccountError,
    AccountState,
    AdapterContext,
    Attachment,
    DeliveryError,
    InboundMessage,
    Limits,
    Target,
    TokenRefusal,
    env_seconds,
    shorten,
)
from plugins.inorder import ChatOrder
from plugins.slack.format import escape, to_mrkdwn
from plugins.slack.settings import DEFAULT_API_URL, SECRETS, check_settings

CHANNEL = "slack"
# Slack truncates a message's text at 40,000 characters but recommends at most 4,000 (longer texts
# render badly and are cut in notifications). 3,900 after formatting leaves room for the escapes
# and the status line the gateway may add, and one screenful stays one message.
MAX_LENGTH = 3900
SECTION_MAX = 3000  # Block Kit: a section's text
FETCH_TIMEOUT_S = 2.0  # files are fetched before the ack, which Slack wants within 3 s
# Slack serves private files from its own hosts (files.slack.com, files-edu.slack.com,
# <org>.enterprise.slack.com, …): the bot token goes to https on these, and to the api_url's origin.
SLACK_FILE_DOMAIN = "slack.com"
ORDER_MARGIN_S = 0.5  # how much longer than a download a later message of the chat waits for it
CONNECT_TIMEOUT_S = 15.0
API_TIMEOUT_S = 15.0  # a Web API call without an answer by then fails (a post is then looked up)
API_TIMEOUT_ENV = "APPSERVER_SLACK_API_TIMEOUT_S"  # tests against a loopback fake shorten it
REPLY_EVENT = "appserver_reply"  # the metadata event type that tags a reply part with its key
LOOKUP_PAGE = 200  # messages per history page when looking a post up
LOOKUP_PAGES = 5  # pages read at most; more messages than that since the post: cannot tell
CLOCK_SKEW_S = 60.0  # the lookup starts this much before the post began (our clock against Slack's)
WATCH_S = 0.2
REFRESH_GRACE_S = 5.0
# After a refresh the old socket is read until Slack closes it, at most this long (Slack closes it
# within seconds of its `disconnect`; what it still carries is handled, not thrown away).
DRAIN_S = 10.0  # a refresh asked for by Slack that takes longer than this shows as backoff
BACKOFF_MIN_S = 0.5
BACKOFF_MAX_S = 30.0
MAX_RETRY_AFTER_S = 300.0
AUTH_ERRORS = {"invalid_auth", "not_authed", "account_inactive", "token_revoked", "token_expired",
               "not_allowed_token_type", "no_permission", "missing_scope"}  # fmt: skip
PERMANENT_ERRORS = AUTH_ERRORS | {
    "channel_not_found", "not_in_channel", "is_archived", "msg_too_long", "no_text", "invalid_blocks",
    "restricted_action", "message_not_found", "cant_update_message", "edit_window_closed", "invalid_name",
    "too_many_reactions", "invalid_arguments", "team_access_not_granted", "ekm_access_denied",
    "thread_not_found", "invalid_ts_oldest", "invalid_cursor",
}  # fmt: skip
# A Web API answer that says the bot token itself no longer works (revoked, expired, the workspace
# or the bot user deactivated): every later call fails the same way, so the account is in `error`.
TOKEN_ERRORS = {"invalid_auth", "not_authed", "account_inactive", "token_revoked", "token_expired"}
# Errors Slack documents as "some aspect of the operation may have succeeded": not a refusal.
UNCERTAIN_ERRORS = {"internal_error", "fatal_error", "service_unavailable"}
ACCEPTED_SUBTYPES = (None, "file_share", "thread_broadcast", "bot_message", "me_message")
EMOJI_NAMES = {
    "👀": "eyes", "👍": "+1", "👎": "-1", "✅": "white_check_mark", "❌": "x", "⏳": "hourglass_flowing_sand",
    "🔥": "fire", "🎉": "tada", "❤️": "heart", "❤": "heart", "😂": "joy", "🙏": "pray", "👌": "ok_hand",
    "🤔": "thinking_face", "⚠️": "warning", "⚠": "warning", "🚀": "rocket", "💯": "100", "😊": "blush",
}  # fmt: skip
# Neither runs past a `<` (Slack sends a typed one as `&lt;`): a raw `<http://` repeated without a
# `>` (a bot's message) made each search run to the end of the text again, quadratic in its length.
_SLACK_LINK_RE = re.compile(r"<((?:https?://|mailto:)[^|<>]+)(?:\|([^<>]*))?>")
_MENTION_RE = re.compile(r"<@([A-Z0-9]+)(?:\|[^<>]*)?>")  # a user mention, with or without its `|name`


class _RetryDroppedConnections(AsyncConnectionErrorRetryHandler):
    """slack_sdk's one retry after a dropped connection, but never for `chat.postMessage`: a post
    whose connection dropped may have been performed, and a blind retry would post it twice (the
    gateway retries it after looking it up)."""

    async def _can_retry_async(
        self,
        *,
        state: RetryState,
        request: RetryRequest,
        response: RetryResponse | None = None,
        error: Exception | None = None,
    ) -> bool:
        if request.url.rstrip("/").endswith("/chat.postMessage"):
            return False
        return await super()._can_retry_async(state=state, request=request, response=response, error=error)


class _RefreshingSocketModeClient(SocketModeClient):
    """slack_sdk's aiohttp Socket Mode client, except that a refresh (a `disconnect` frame: Slack
    asks for a new socket) opens the new socket before letting go of the old one, and reads what
    the old one still carries until Slack closes it (at most `DRAIN_S`). slack_sdk closed the old
    socket first, and aiohttp's close discards the frames that arrive meanwhile: an envelope Slack
    sent on the old socket just after its `disconnect` was dropped unacknowledged, and redelivered
    only after Slack's ack timeout, behind the person's later messages (answered out of order).
    A drained envelope is acknowledged on the socket it came on while that one is open."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._drains: set[asyncio.Task[None]] = set()
        self._came_on: dict[str, ClientWebSocketResponse] = {}  # envelope id -> the old socket it came on

    async def connect(self) -> None:
        old = self.current_session
        if old is None or old.closed or self.closed:
            await super().connect()  # type: ignore[no-untyped-call]
            return
        receiver, self.message_receiver = self.message_receiver, None
        if receiver is not None:  # stop reading the old socket here: `_drain` reads it from now on
            receiver.cancel()
            await asyncio.gather(receiver, return_exceptions=True)
        self.current_session = None  # so super().connect() does not close it first
        try:
            await super().connect()  # type: ignore[no-untyped-call]
        finally:
            drain = asyncio.ensure_future(self._drain(old))
            self._drains.add(drain)
            drain.add_done_callback(self._drains.discard)

    async def _drain(self, session: ClientWebSocketResponse) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DRAIN_S
        try:
            while not session.closed and not self.closed:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    message = await session.receive(timeout=remaining)
                except TimeoutError:
                    break
                if message.type == WSMsgType.TEXT and isinstance(message.data, str):
                    envelope_id = _envelope_id(message.data)
                    if envelope_id is None:
                        continue  # `hello`, another `disconnect`: not for the old socket any more
                    self._came_on[envelope_id] = session
                    await self.enqueue_message(message.data)
                elif message.type == WSMsgType.PING:
                    await session.pong(message.data)
                elif message.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED, WSMsgType.ERROR):
                    break
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the old socket failing is its end
            self.logger.info("the refreshed socket ended: %s: %s", type(exc).__name__, exc)
        finally:
            with contextlib.suppress(Exception):
                await session.close()
            for envelope_id in [e for e, s in self._came_on.items() if s is session]:
                del self._came_on[envelope_id]

    async def send_socket_mode_response(self, response: dict[str, Any] | SocketModeResponse) -> None:
        body = response.to_dict() if isinstance(response, SocketModeResponse) else response
        session = self._came_on.pop(str(body.get("envelope_id") or ""), None)
        if session is not None and not session.closed:
            try:
                await session.send_str(json.dumps(body))
                return
            except Exception:  # noqa: BLE001 - closed meanwhile: the current socket takes it
                pass
        await super().send_socket_mode_response(response)

    async def close(self) -> None:
        for drain in list(self._drains):
            drain.cancel()
        await asyncio.gather(*self._drains, return_exceptions=True)
        await super().close()  # type: ignore[no-untyped-call]


def _envelope_id(raw: str) -> str | None:
    try:
        frame = json.loads(raw)
    except ValueError:
        return None
    envelope_id = frame.get("envelope_id") if isinstance(frame, dict) else None
    return envelope_id if isinstance(envelope_id, str) and envelope_id else None


def api_timeout() -> float:
    """`API_TIMEOUT_S`, or a positive number of seconds from `APPSERVER_SLACK_API_TIMEOUT_S`."""
    return env_seconds(API_TIMEOUT_ENV, API_TIMEOUT_S)


class SlackAdapter:
    """One Slack app (bot token + app-level token) in Socket Mode."""

    limits = Limits(max_length=MAX_LENGTH, can_edit=True, can_react=True, edits_per_second=1.0)
    secret_keys = SECRETS  # a reference to any other name is refused (plugins/contract.py)
    prompt_max_length = SECTION_MAX  # an approval prompt is one section (`_prompt_blocks`)

    def __init__(self, account: Account, context: AdapterContext) -> None:
        self.account = account
        self.context = context
        self._log = context.log
        self._where = f"slack account '{account.name}'"
        self._config_error: str | None = None
        try:
            check_settings(account.settings)
        except ValueError as exc:
            self._config_error = f"{self._where}: {exc}"
        api_url = account.settings.get("api_url", DEFAULT_API_URL)
        if not isinstance(api_url, str) or not api_url.startswith(("http://", "https://")):
            api_url = DEFAULT_API_URL  # refused at start (the error above)
        self._api_url = api_url.rstrip("/")
        # files there get the bot token too: a self-hosted Slack, the loopback fake in tests
        self._api_origin = _origin_of(self._api_url)
        self._web: AsyncWebClient | None = None
        self._socket: SocketModeClient | None = None
        self._files: httpx.AsyncClient | None = None
        self._watch: asyncio.Task[None] | None = None
        self._bot_token = ""
        self.bot_user: str | None = None
        self.bot_id: str | None = None
        self._state: AccountState = "stopped"
        self._fatal: str | None = None
        # the bot token refused while running (state `error` until a call succeeds again)
        self._refusal = TokenRefusal(self._report, self._log, self._where, "Slack")
        self._prompts: dict[tuple[str, str], str] = {}  # (channel, ts) of a prompt with buttons -> short id
        # Per-chat arrival order. A later message waits for an earlier one's files at most this long
        # (counted from its own arrival), so its acknowledgement still goes out within Slack's 3 s.
        self._order = ChatOrder(FETCH_TIMEOUT_S + ORDER_MARGIN_S, self._log)

    # ------------------------------------------------------------------ lifecycle

    @property
    def is_running(self) -> bool:
        return self._socket is not None and self._watch is not None and not self._watch.done()

    async def start(self) -> None:
        """Check both tokens (AccountError naming the one Slack refuses), open the socket."""
        if self._config_error is not None:
            raise AccountError(self._config_error)
        if self.is_running:
            return
        bot = self.account.secrets.get("bot_token")
        app = self.account.secrets.get("app_token")
        missing = [name for name, value in (("bot_token", bot), ("app_token", app)) if not value]
        if missing or bot is None or app is None:
            names = " and ".join(f"{n} (set {n}_env or {n}_file)" for n in missing)
            raise AccountError(f"{self._where}: no {names}")
        if not bot.startswith("xoxb-"):
            raise AccountError(f"{self._where}: bot_token (bot_token_env / bot_token_file) must be a bot token, xoxb-…")
        if not app.startswith("xapp-"):
            raise AccountError(
                f"{self._where}: app_token (app_token_env / app_token_file) must be an app-level token, xapp-…"
            )
        self._bot_token = bot
        self._fatal = None
        self._report("starting", None)
        self._web = web = AsyncWebClient(
            token=bot,
            base_url=f"{self._api_url}/api/",
            timeout=api_timeout(),  # type: ignore[arg-type] # slack_sdk hands it to aiohttp's ClientTimeout
            retry_handlers=[_RetryDroppedConnections()],
        )
        try:
            auth = await web.auth_test()
        except SlackApiError as exc:
            error = _error_code(exc)
            if error in AUTH_ERRORS:
                raise AccountError(
                    f"{self._where}: Slack refused the bot token (bot_token_env / bot_token_file): {error}"
                ) from None
            raise RuntimeError(f"auth.test failed: {error}") from None
        self.bot_user = str(auth.get("user_id") or "") or None
        self.bot_id = str(auth.get("bot_id") or "") or None
        sdk_log = self._log.getChild("sdk")
        client = _RefreshingSocketModeClient(
            app_token=app, web_client=web, auto_reconnect_enabled=False, logger=sdk_log
        )
        client.socket_mode_request_listeners.append(self._on_request)
        try:
            client.wss_uri = await client.issue_new_wss_url()
            await asyncio.wait_for(client.connect(), CONNECT_TIMEOUT_S)
        except SlackApiError as exc:
            await _close_quietly(client)
            error = _error_code(exc)
            if error in AUTH_ERRORS:
                raise AccountError(
                    f"{self._where}: Slack refused the app-level token (app_token_env / app_token_file): {error}"
                ) from None
            raise RuntimeError(f"apps.connections.open failed: {error}") from None
        except BaseException:
            await _close_quietly(client)
            raise
        self._socket = client
        self._watch = asyncio.create_task(self._watchdog(client), name=f"slack-watch-{self.account.name}")
        self._log.info("%s: connected in Socket Mode as %s", self._where, self.bot_user)
        self._report("running", None)

    async def stop(self) -> None:
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await watch
        client, self._socket = self._socket, None
        if client is not None:
            await _close_quietly(client)
        files, self._files = self._files, None
        if files is not None:
            await files.aclose()
        self._report("stopped", None)

    def _report(self, state: AccountState, reason: str | None) -> None:
        self._state = state
        try:
            self.context.report(state, reason)
        except Exception:  # noqa: BLE001 - reporting must never break the socket
            self._log.exception("slack: report(%s) failed", state)

    async def _watchdog(self, client: SocketModeClient) -> None:
        """Reconnect a dropped socket with a growing pause; the state says what is going on. A
        `disconnect` frame is the library's to handle (it holds the connect lock meanwhile)."""
        delay = BACKOFF_MIN_S
        down_since: float | None = None
        while True:
            await asyncio.sleep(WATCH_S)
            if await client.is_connected():
                if self._state != "running" and self._refusal.reason is None:
                    self._report("running", None)
                delay = BACKOFF_MIN_S
                down_since = None
                continue
            now = time.monotonic()
            down_since = now if down_since is None else down_since
            if client.connect_operation_lock.locked():
                # The library is reconnecting (a `disconnect` frame); say so if it takes a while.
                if now - down_since > REFRESH_GRACE_S and self._state == "running":
                    self._report("backoff", "reconnecting to Slack (the socket was refreshed)")
                continue
            self._report("backoff", f"socket closed; reconnecting in {delay:g} s")
            await asyncio.sleep(delay)
            delay = min(delay * 2, BACKOFF_MAX_S)
            async with client.connect_operation_lock:
                if await client.is_connected():
                    continue
                try:
                    client.wss_uri = await client.issue_new_wss_url()
                    await asyncio.wait_for(client.connect(), CONNECT_TIMEOUT_S)  # type: ignore[no-untyped-call]
                    if await client.is_connected():
                        self._log.info("%s: reconnected", self._where)
                        self._report(*self._refusal.connected())
                except SlackApiError as exc:
                    error = _error_code(exc)
                    if error in AUTH_ERRORS:
                        reason = f"Slack refused the app-level token (app_token_env / app_token_file): {error}"
                        self._fatal = reason
                        self._report("error", reason)
                        return  # not running: the gateway restarts the adapter once; start() then fails
                    self._log.warning("%s: reconnect failed: %s", self._where, error)
                except (asyncio.CancelledError, KeyboardInterrupt):
                    raise
                except BaseException as exc:  # noqa: BLE001 - a network failure: try again later
                    self._log.warning("%s: reconnect failed: %s: %s", self._where, type(exc).__name__, exc)

    # ------------------------------------------------------------------ inbound

    async def _on_request(self, client: AsyncBaseSocketModeClient, req: SocketModeRequest) -> None:
        # slack_sdk runs each envelope in its own task, started in arrival order: the ticket, taken
        # before the first await, keeps the chat's messages in that order however long one of
        # them takes to read (its files are downloaded first).
        with self._order.ticket(_chat_of(req)) as ticket:
            try:
                if req.type == "events_api":
                    msg = await self._event_message(req.payload)
                elif req.type == "interactive":
                    msg = self._action_message(req.payload)
                else:
                    msg = None  # slash commands, options: not used by this app
            except Exception:  # noqa: BLE001 - a malformed event must not stall the socket
                self._log.exception("%s: could not read a %s envelope; acknowledged and skipped", self._where, req.type)
                msg = None
            if msg is None:
                ticket.release()
                await self._ack(client, req.envelope_id)
                return
            envelope_id = req.envelope_id

            async def ack() -> None:
                await self._ack(client, envelope_id)

            await ticket.wait()
            try:
                await self.context.on_message(replace(msg, ack=ack))
            except Exception as exc:  # noqa: BLE001 - not acknowledged: Slack redelivers it
                self._log.error(
                    "%s: message %s not recorded (%s); Slack will redeliver it", self._where, msg.message_id, exc
                )

    async def _ack(self, client: AsyncBaseSocketModeClient, envelope_id: str) -> None:
        try:
            await client.send_socket_mode_response(SocketModeResponse(envelope_id=envelope_id))
        except Exception as exc:  # noqa: BLE001 - the socket went away: Slack redelivers, the ledger dedupes
            self._log.warning("%s: could not acknowledge envelope %s: %s", self._where, envelope_id, exc)

    async def _event_message(self, payload: Mapping[str, Any]) -> InboundMessage | None:
        event = payload.get("event")
        if not isinstance(event, dict):
            return None
        kind = event.get("type")
        subtype = event.get("subtype")
        if kind not in ("message", "app_mention") or subtype not in ACCEPTED_SUBTYPES:
            return None  # edits, deletions, joins, topic changes, …
        channel, ts = event.get("channel"), event.get("ts")
        if not isinstance(channel, str) or not channel or not isinstance(ts, str) or not ts:
            return None
        user = event.get("user")
        bot_id = event.get("bot_id")
        if (user is not None and user == self.bot_user) or (bot_id is not None and bot_id == self.bot_id):
            return None  # the bot's own posts (Slack echoes them as message.im): acknowledged, not recorded
        sender = str(user or bot_id or "unknown")
        channel_type = event.get("channel_type")
        is_dm = channel_type == "im" or (channel_type is None and channel.startswith("D"))
        raw_text = str(event.get("text") or "")
        mentions_bot = kind == "app_mention" or (self.bot_user is not None and self._mention(raw_text) is not None)
        thread_ts = event.get("thread_ts") if isinstance(event.get("thread_ts"), str) else None
        # A channel's top-level mention starts a thread: the reply goes there, and the thread is the
        # conversation. A DM's main line is one conversation, and so is a channel's (for messages
        # without a mention, under group_policy open); a thread anywhere is its own.
        thread = thread_ts or (ts if mentions_bot and not is_dm else None)
        sender_is_bot = bool(bot_id) or subtype == "bot_message"  # another app: recorded, never let through
        profile = _dict(event.get("user_profile"))
        sender_name = profile.get("display_name") or profile.get("real_name") or None
        attachments = await self._attachments(event.get("files"))
        return InboundMessage(
            channel=CHANNEL,
            account=self.account.name,
            chat=channel,
            chat_type="dm" if is_dm else "group",
            sender=sender,
            message_id=f"{channel}:{ts}",
            text=self._plain(raw_text),
            thread=thread,
            sender_name=str(sender_name) if sender_name else None,
            mentions_bot=mentions_bot,
            reply_to=f"{channel}:{thread_ts}" if thread_ts and thread_ts != ts else None,
            sender_is_bot=sender_is_bot,
            ts=_float(ts),
            attachments=attachments,
            raw=dict(payload),
        )

    def _mention(self, text: str) -> re.Match[str] | None:
        """The bot's mention in `text`: `<@UBOT>`, or `<@UBOT|name>` as older clients and text
        posted through the API write it."""
        return next((m for m in _MENTION_RE.finditer(text) if m.group(1) == self.bot_user), None)

    def _plain(self, text: str) -> str:
        """Slack's markup as plain text: the bot's own mention dropped, links as their URL (with the
        label), `&amp;` `&lt;` `&gt;` decoded."""
        if self.bot_user:
            text = _MENTION_RE.sub(lambda m: "" if m.group(1) == self.bot_user else m.group(0), text)
        text = _SLACK_LINK_RE.sub(lambda m: m.group(1) if not m.group(2) else f"{m.group(2)} ({m.group(1)})", text)
        text = text.replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")
        return text.strip()

    async def _attachments(self, files: Any) -> tuple[Attachment, ...]:
        if not isinstance(files, list):
            return ()
        items = [f for f in files if isinstance(f, dict)]
        return tuple(await asyncio.gather(*(self._attachment(f) for f in items)))

    async def _attachment(self, f: Mapping[str, Any]) -> Attachment:
        name = str(f.get("name") or f.get("title") or f.get("id") or "file")
        mime = str(f.get("mimetype") or "application/octet-stream")
        size = f.get("size") if isinstance(f.get("size"), int) else None
        url = f.get("url_private_download") or f.get("url_private")
        if not mime.startswith("image/") or not isinstance(url, str):
            return Attachment(kind="file", name=name, mime=mime, size=size)
        # The URL comes with the event: one elsewhere (an external file, or anyone's host) would get
        # the bot token. Not fetched; named like any file that could not be had.
        if f.get("is_external") or not self._is_file_url(url):
            self._log.warning("%s: file %s is external or not on a Slack file host: not fetched", self._where, name)
            return Attachment(kind="file", name=name, mime=mime, size=size)
        # An image travels to the server base64-encoded in the turn's frame: one bigger than the
        # gateway's budget (from the server's frame limit) is not fetched, and is named as too big.
        limit = self.context.max_image_bytes()
        if (size or 0) > limit:
            return Attachment(kind="image", name=name, mime=mime, size=size)
        try:
            data = await asyncio.wait_for(self._download(url, limit), FETCH_TIMEOUT_S)
        except TimeoutError:
            self._log.warning("%s: file %s not fetched within %g s", self._where, name, FETCH_TIMEOUT_S)
            data = None
        if data is None:
            return Attachment(kind="file", name=name, mime=mime, size=size)
        if len(data) > limit:  # bigger than Slack said (or it said nothing): read no further
            # named with the bytes read, past the limit: Slack's `size` was wrong or missing
            return Attachment(kind="image", name=name, mime=mime, size=max(len(data), size or 0))
        return Attachment(kind="image", name=name, mime=mime, size=len(data), data=data)

    async def _download(self, url: str, limit: int) -> bytes | None:
        """A private file, fetched with the bot token (`files:read`); None when it cannot be had in
        time. One bigger than `limit` is read only to just past it (the caller sees it is too big)."""
        if self._files is None:
            self._files = httpx.AsyncClient(
                timeout=FETCH_TIMEOUT_S, follow_redirects=True, event_hooks={"request": [self._only_file_hosts]}
            )
        try:
            async with self._files.stream("GET", url, headers={"Authorization": f"Bearer {self._bot_token}"}) as r:
                if r.status_code != 200 or "text/html" in r.headers.get("content-type", ""):
                    self._log.warning(
                        "%s: file fetch answered %s (missing files:read scope?)", self._where, r.status_code
                    )
                    return None
                data = bytearray()
                async for chunk in r.aiter_bytes():
                    data.extend(chunk)
                    if len(data) > limit:
                        break
                return bytes(data)
        except httpx.HTTPError as exc:
            self._log.warning("%s: file fetch failed: %s", self._where, exc)
            return None

    def _is_file_url(self, url: str | httpx.URL) -> bool:
        """Whether the bot token may go to `url`: https on `slack.com` or a `*.slack.com` host (default
        port), or the configured `api_url`'s origin. Parsed by httpx, as the request will be, so
        `https://files.slack.com@other.test/` is other.test's."""
        origin = _origin_of(url)
        if origin is None:
            return False
        if origin == self._api_origin:
            return True
        scheme, host, port = origin
        on_slack = host == SLACK_FILE_DOMAIN or host.endswith("." + SLACK_FILE_DOMAIN)
        return scheme == "https" and port is None and on_slack

    async def _only_file_hosts(self, request: httpx.Request) -> None:
        """Run before every request of the file client, redirects included: a redirect away from
        Slack's file hosts is not followed (httpx drops the token on it; this fetches nothing there)."""
        if not self._is_file_url(request.url):
            raise httpx.RequestError(f"a redirect to {request.url.host} (not a Slack file host)", request=request)

    def _action_message(self, payload: Mapping[str, Any]) -> InboundMessage | None:
        """A click on an approval button, as the `/approve ID` or `/deny ID` its clicker would type."""
        if payload.get("type") != "block_actions":
            return None
        actions = payload.get("actions")
        action = actions[0] if isinstance(actions, list) and actions and isinstance(actions[0], dict) else None
        value = str(action.get("value") or "") if action else ""
        verb, _, short_id = value.partition(":")
        if verb not in ("approve", "deny") or not short_id or not short_id.isalnum():
            return None
        container = _dict(payload.get("container"))
        message = _dict(payload.get("message"))
        channel_obj = _dict(payload.get("channel"))
        channel = str(container.get("channel_id") or channel_obj.get("id") or "")
        user = _dict(payload.get("user"))
        if not channel or not user.get("id"):
            return None
        action_ts = str(action.get("action_ts") or "") if action else ""
        thread = container.get("thread_ts") or message.get("thread_ts")
        name = user.get("name") or user.get("username")
        return InboundMessage(
            channel=CHANNEL,
            account=self.account.name,
            chat=channel,
            chat_type="dm" if channel.startswith("D") else "group",
            sender=str(user["id"]),
            message_id=f"{channel}:action:{action_ts or payload.get('trigger_id')}",
            text=f"/{verb} {short_id}",
            thread=str(thread) if thread else None,
            sender_name=str(name) if name else None,
            mentions_bot=True,  # a click on the bot's own button is addressed to it
            reply_to=f"{channel}:{container.get('message_ts')}" if container.get("message_ts") else None,
            pressed=True,
            ts=_float(action_ts),
            raw=dict(payload),
        )

    # ------------------------------------------------------------------ outbound

    async def _call(self, method: str, call: Callable[..., Awaitable[Any]], **kwargs: Any) -> Any:
        if self._web is None:
            raise DeliveryError("slack: not started")
        try:
            result = await call(**kwargs)
        except SlackApiError as exc:
            error = _error_code(exc)
            if error in TOKEN_ERRORS:
                self._bot_token_refused(method, error)
            raise _delivery_error(method, exc) from None
        except aiohttp.ClientConnectorError as exc:  # never connected: the request was not sent
            raise DeliveryError(f"slack {method}: {type(exc).__name__}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - a timeout, a dropped connection: it may have been performed
            raise DeliveryError(f"slack {method}: {type(exc).__name__}: {exc}", uncertain=True) from None
        if self._refusal.accepted() and self._socket is not None and await self._socket.is_connected():
            self._report("running", None)  # it was not revoked after all
        return result

    def _bot_token_refused(self, method: str, error: str) -> None:
        """Slack refused the bot token while running (revoked, expired, deactivated): nothing can be
        sent any more, so the account is in `error` naming the token, as when start() is refused,
        until a call succeeds again (the socket, on the app-level token, stays up: what comes in is
        still recorded)."""
        self._refusal.refused(
            f"{self._where}: Slack refused the bot token (bot_token_env / bot_token_file): {error} (on {method})"
        )

    async def send(self, target: Target, text: str) -> list[str]:
        """`chat.postMessage` (in `target.thread` when set); returns the message's ts."""
        web = self._web
        if web is None:
            raise DeliveryError("slack: not started")
        kwargs: dict[str, Any] = {"channel": target.chat, "text": text, "unfurl_links": False, "unfurl_media": False}
        if target.thread:
            kwargs["thread_ts"] = target.thread
        if target.key:
            kwargs["metadata"] = {"event_type": REPLY_EVENT, "event_payload": {"key": target.key}}
        response = await self._call("chat.postMessage", web.chat_postMessage, **kwargs)
        ts = response.get("ts")
        if not ts:
            raise DeliveryError("slack chat.postMessage answered without a ts")
        return [str(ts)]

    async def find_sent(self, target: Target, since: float) -> list[str] | None:
        """The ts of the bot's message tagged with `target.key`, posted since `since` (less the clock
        skew) in `target`'s channel or thread; None when there is none. A `DeliveryError` when Slack
        cannot be asked (`missing_scope`: the history scopes) or too much was posted since to tell."""
        web = self._web
        if web is None:
            raise DeliveryError("slack: not started")
        if not target.key:
            return None
        kwargs: dict[str, Any] = {
            "channel": target.chat,
            "oldest": f"{max(since - CLOCK_SKEW_S, 0.0):.6f}",
            "inclusive": True,
            "include_all_metadata": True,
            "limit": LOOKUP_PAGE,
        }
        call: Callable[..., Awaitable[Any]] = web.conversations_history
        method = "conversations.history"
        if target.thread:
            method, call = "conversations.replies", web.conversations_replies
            kwargs["ts"] = target.thread
        for _ in range(LOOKUP_PAGES):
            response = await self._call(method, call, **kwargs)
            for message in response.get("messages") or []:
                if isinstance(message, dict) and self._tagged(message, target.key):
                    return [str(message["ts"])]
            cursor = _dict(response.get("response_metadata")).get("next_cursor")
            if not response.get("has_more") or not cursor:
                return None
            kwargs["cursor"] = cursor
        raise DeliveryError(
            f"slack {method}: more than {LOOKUP_PAGE * LOOKUP_PAGES} messages since the post; cannot tell whether"
            " it arrived",
            permanent=True,
        )

    async def shown(self, target: Target, message_id: str) -> str | None:
        """The text the message `message_id` (a ts) shows now, from `conversations.history` (or
        `.replies` in `target.thread`): whether an edit answered `internal_error` landed. None when
        it is not there; a `DeliveryError` when Slack cannot be asked."""
        web = self._web
        if web is None:
            raise DeliveryError("slack: not started")
        ts = message_id.rsplit(":", 1)[-1]
        kwargs: dict[str, Any] = {"channel": target.chat, "oldest": ts, "latest": ts, "inclusive": True, "limit": 2}
        call: Callable[..., Awaitable[Any]] = web.conversations_history
        method = "conversations.history"
        if target.thread:
            method, call = "conversations.replies", web.conversations_replies
            kwargs["ts"] = target.thread
        response = await self._call(method, call, **kwargs)
        for message in response.get("messages") or []:
            if isinstance(message, dict) and message.get("ts") == ts:
                return str(message.get("text") or "")
        return None

    def _tagged(self, message: Mapping[str, Any], key: str) -> bool:
        """The bot's own message carrying `key` in its reply metadata."""
        metadata = _dict(message.get("metadata"))
        if metadata.get("event_type") != REPLY_EVENT or _dict(metadata.get("event_payload")).get("key") != key:
            return False
        # Only this bot's message: one without a bot_id (a person's, or another app posting with a
        # user token, which may carry any metadata) is never taken for the lost post.
        if self.bot_id and message.get("bot_id") != self.bot_id:
            return False
        if not self.bot_id and self.bot_user and message.get("user") != self.bot_user:
            return False
        return bool(message.get("ts"))

    async def edit(self, target: Target, message_id: str, text: str) -> None:
        """`chat.update`. An approval prompt keeps its buttons while undecided and loses them once
        the gateway shows the decision."""
        web = self._web
        if web is None:
            raise DeliveryError("slack: not started")
        short_id = self._prompts.get((target.chat, message_id))
        if short_id is not None:
            await self.edit_prompt(target, message_id, text, short_id if f"/approve {short_id}" in text else None)
            return
        await self._call("chat.update", web.chat_update, channel=target.chat, ts=message_id, text=text)

    async def edit_prompt(self, target: Target, message_id: str, text: str, short_id: str | None) -> None:
        """`chat.update` of an approval prompt: its buttons while `short_id` is pending, none once
        decided (`blocks` are always sent: Slack keeps the old ones when they are left out, so a
        prompt posted before a restart would keep live buttons)."""
        web = self._web
        if web is None:
            raise DeliveryError("slack: not started")
        kwargs: dict[str, Any] = {
            "channel": target.chat,
            "ts": message_id,
            "text": text,
            "blocks": _prompt_blocks(text, short_id),
        }
        await self._call("chat.update", web.chat_update, **kwargs)
        if short_id is None:
            self._prompts.pop((target.chat, message_id), None)

    async def react(self, target: Target, message_id: str, emoji: str) -> None:
        """`reactions.add` on a message (an inbound `channel:ts` id or a sent ts)."""
        web = self._web
        if web is None:
            raise DeliveryError("slack: not started")
        name = EMOJI_NAMES.get(emoji) or emoji.strip(":")
        if not re.fullmatch(r"[a-z0-9_+\-']{1,100}", name):
            raise DeliveryError(f"slack: no Slack name known for the emoji {emoji!r}", permanent=True)
        try:
            await self._call(
                "reactions.add",
                web.reactions_add,
                channel=target.chat,
                timestamp=message_id.rsplit(":", 1)[-1],
                name=name,
            )
        except DeliveryError as exc:
            if "already_reacted" not in exc.reason:
                raise

    def format(self, text: str) -> str:
        return to_mrkdwn(text)

    @staticmethod
    def prompt_length(text: str) -> int:
        """An approval prompt's Markdown as its section counts it: mrkdwn, every `&` five characters
        (`&amp;`), so the gateway fits the prompt, not `_prompt_blocks` by cutting its end."""
        return len(to_mrkdwn(text))

    async def prompt_approval(self, target: Target, text: str, short_id: str) -> list[str]:
        """The approval prompt as Block Kit: its text and Approve / Deny buttons whose clicks come
        back as `/approve <short_id>` / `/deny <short_id>` from the person who clicked."""
        web = self._web
        if web is None:
            raise DeliveryError("slack: not started")
        body = to_mrkdwn(text)
        kwargs: dict[str, Any] = {"channel": target.chat, "text": body, "blocks": _prompt_blocks(body, short_id)}
        if target.thread:
            kwargs["thread_ts"] = target.thread
        if target.key:  # tagged like a reply part, so a post with an unknown outcome is found, not repeated
            kwargs["metadata"] = {"event_type": REPLY_EVENT, "event_payload": {"key": target.key}}
        response = await self._call("chat.postMessage", web.chat_postMessage, **kwargs)
        ts = str(response.get("ts") or "")
        if not ts:
            raise DeliveryError("slack chat.postMessage answered without a ts")
        self._prompts[(target.chat, ts)] = short_id
        return [ts]


def _prompt_blocks(text: str, short_id: str | None) -> list[dict[str, Any]]:
    """A section with the (already formatted) text; with buttons while `short_id` is pending. The
    gateway fits a prompt to the section (`prompt_length`); the cut here only guards the limit."""
    shown = shorten(text, SECTION_MAX)
    blocks: list[dict[str, Any]] = [
        {"type": "section", "text": {"type": "mrkdwn", "text": shown or escape(" "), "verbatim": True}}
    ]
    if short_id is not None:
        blocks.append(
            {
                "type": "actions",
                "block_id": f"approval-{short_id}",
                "elements": [
                    {
                        "type": "button",
                        "action_id": "approve",
                        "style": "primary",
                        "value": f"approve:{short_id}",
                        "text": {"type": "plain_text", "text": "Approve"},
                    },
                    {
                        "type": "button",
                        "action_id": "deny",
                        "style": "danger",
                        "value": f"deny:{short_id}",
                        "text": {"type": "plain_text", "text": "Deny"},
                    },
                ],
            }  # fmt: skip
        )
    return blocks


def _error_code(exc: SlackApiError) -> str:
    response = exc.response
    try:
        error = response.get("error")
    except Exception:  # noqa: BLE001 - a response that is not JSON
        error = None
    status = getattr(response, "status_code", None)
    return str(error or (f"HTTP {status}" if status else "unknown error"))


def _delivery_error(method: str, exc: SlackApiError) -> DeliveryError:
    """Slack's refusal as a `DeliveryError`. An answer that does not say the call was refused (an
    error Slack documents as possibly partly performed, a 5xx, a page that is no Slack answer) is
    `uncertain`: a post is then looked up before it is posted again, never blindly repeated."""
    error = _error_code(exc)
    status = getattr(exc.response, "status_code", None)
    reason = f"slack {method}: {error}"
    if status == 429 or error == "ratelimited":
        return DeliveryError(reason, retry_after=_retry_after(getattr(exc.response, "headers", None)))
    if error in PERMANENT_ERRORS:
        return DeliveryError(reason, permanent=True)
    if error in UNCERTAIN_ERRORS or not _slack_error(exc) or (isinstance(status, int) and status >= 500):
        return DeliveryError(reason, uncertain=True)
    return DeliveryError(reason)  # another error Slack named (it refused the call): retried


def _slack_error(exc: SlackApiError) -> bool:
    """Whether the answer was Slack's own JSON naming an error (so Slack decided, and said what)."""
    try:
        return isinstance(exc.response.get("error"), str)
    except Exception:  # noqa: BLE001 - a response that is not JSON
        return False


def _retry_after(headers: Any) -> float:
    """`Retry-After` in seconds (Slack sends whole seconds); 1 s when absent or unreadable."""
    value = None
    if isinstance(headers, Mapping):
        for key, v in headers.items():
            if str(key).lower() == "retry-after":
                value = v[0] if isinstance(v, list | tuple) and v else v
                break
    try:
        seconds = float(value) if value is not None else 1.0
    except (TypeError, ValueError):
        return 1.0
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_S) if math.isfinite(seconds) else MAX_RETRY_AFTER_S


def _chat_of(req: SocketModeRequest) -> str:
    """The channel an envelope belongs to, read without awaiting anything ("" when it has none:
    those share one line, and are acknowledged at once anyway)."""
    payload = _dict(req.payload)
    if req.type == "events_api":
        return str(_dict(payload.get("event")).get("channel") or "")
    if req.type == "interactive":
        return str(_dict(payload.get("container")).get("channel_id") or _dict(payload.get("channel")).get("id") or "")
    return ""


def _origin_of(url: str | httpx.URL) -> tuple[str, str, int | None] | None:
    """(scheme, host, port) as httpx parses `url` (None: unparsable, it then matches nothing)."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL:
        return None
    return (parsed.scheme, parsed.host, parsed.port)


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _float(ts: str) -> float | None:
    try:
        return float(ts)
    except (TypeError, ValueError):
        return None


async def _close_quietly(client: SocketModeClient) -> None:
    with contextlib.suppress(Exception):
        await client.close()  # type: ignore[no-untyped-call]


def create_adapter(account: Account, context: AdapterContext) -> SlackAdapter:
    """The plugin entry point (see `plugins.contract`)."""
    return SlackAdapter(account, context)
