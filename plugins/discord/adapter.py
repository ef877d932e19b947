"""The Discord adapter: the real discord.py (2.x) `Client` — its gateway WebSocket in, its REST
client out.

Inbound: every MESSAGE_CREATE the bot can see (DMs, guild channels, threads) becomes an
`InboundMessage` keyed by the message's snowflake, which is stable however often it arrives (a
RESUME replay, a catch-up fetch): the ledger dedupes. discord.py dispatches each event as a task of
its own; a per-channel ticket (`plugins.inorder`) taken as the event arrives hands a channel's
messages over in arrival order, so a message whose image is still downloading is not overtaken by
the next one (which waits at most `FETCH_TIMEOUT_S + ORDER_MARGIN_S` from its own arrival). Discord
has no acknowledgement; `on_message` returning means the ledger committed it. After that the
message's id is noted per channel in `<data_dir>/last_seen.json` (written atomically, in a thread, at
most once a second and at stop), and on every new session (READY: the first connect, or a
re-IDENTIFY after the session was invalidated or lost in a long outage) the adapter fetches, for
each channel it has seen, the messages after that id and hands each to `on_message`: what the
gateway missed while it was away is answered once (also in server channels and threads never seen
whose last message is newer than the newest one recorded: first written to during the outage).
Live messages of a channel being caught up (from READY on: discord.py hands messages over before
`on_ready`) wait until its catch-up has handed the older ones over, at most `CATCH_UP_WAIT_S`, so the
channel keeps Discord's order; a channel with a live message waiting is caught up next, and other
channels are not held up. A channel whose fetch fails (a 5xx, a 429 longer than discord.py waits) or
does not answer within `CATCH_UP_FETCH_S` (discord.py sleeping out a 429 or retrying a 5xx) is
fetched again after a bounded backoff, and its saved position stays before what is not fetched yet
(`gap`) whatever is recorded meanwhile. A message both fetched and live (or replayed) is handed over
once. The bot's own messages are skipped; other bots'
are handed over marked `sender_is_bot` (the gateway never lets them through). A mention of the bot's
managed role (`<@&role>`, `tags.bot_id` the bot) is a mention of the bot. System notices
(message types other than a default message and a reply: a rename, a pin, a thread started) are
skipped.

Outbound: `POST channels/{id}/messages` with `allowed_mentions` none (an agent cannot ping @everyone,
a role or a person), a reply reference in guild channels, and `nonce` + `enforce_nonce` derived from
`Target.key`, so a resend of the same reply part after a crash returns the message Discord already
has instead of posting a second one. Rate limits are discord.py's (it sleeps out a 429 and retries,
the global flag included); only when it gives up (`max_ratelimit_timeout` exceeded) does a 429 become
`DeliveryError(retry_after=…)`, which holds back only that kind of call in that channel (Discord limits
per route), unless Discord said the limit is global (`X-RateLimit-Global` / `X-RateLimit-Scope:
global`, seen by an aiohttp trace on discord.py's session, as its `RateLimited` does not say):
`retry_scope="account"`, every call of the account waits. 403/404 are permanent failures with
Discord's reason.

Approvals are a message with two buttons (`approve:<id>` / `deny:<id>`); a press is handed over as
`/approve <id>` or `/deny <id>` from the presser and acknowledged (interaction callback type 6,
deferred update) only once the gateway's ledger has committed it, as Slack's envelopes are: a crash
in between leaves Discord showing "This interaction failed", so the person presses again, never a
press Discord took that the gateway lost. Discord wants the answer within 3 s: a press waits for the
channel's earlier messages at most `PRESS_WAIT_S` (then is recorded ahead of one still downloading
an image), and one whose record is still not through at `PRESS_ACK_S` is acknowledged anyway and
recorded after. A press that cannot be recorded is answered with a note, seen only by the presser,
to press again. The gateway then edits the prompt, which drops the buttons.

The connection is discord.py's: it heartbeats, RESUMEs after a drop and re-IDENTIFYs after an
invalid session. Its events drive the reported state (`running` on READY/RESUMED, `backoff` on a
disconnect). A token Discord refuses is an `AccountError` naming the secret's source; the message
content intent not enabled in the developer portal (close code 4014) is an `AccountError` saying so.

`discord.http.Route.BASE` and `DiscordWebSocket.DEFAULT_GATEWAY` are class attributes: the account's
`api_url` / `gateway_url` settings (for a local fake or a proxy) apply process-wide.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import discord
import discord.gateway
import discord.http

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
)
from plugins.discord.format import to_discord
from plugins.discord.settings import DEFAULT_API_URL, DEFAULT_GATEWAY_URL, SECRETS, check_settings
from plugins.inorder import ChatOrder, Ticket
from plugins.statefile import atomic_write_text, move_aside

CHANNEL = "discord"
MAX_LENGTH = 1990  # Discord refuses content over 2,000 characters; a margin for the status line
CONTENT_MAX = 2000  # Discord's own limit: an approval prompt (no status line) is fitted to it
FETCH_TIMEOUT_S = 10.0
ORDER_MARGIN_S = 2.0  # how much longer than a download a later message of the channel waits for it
READY_TIMEOUT_S = 30.0
MAX_RATELIMIT_WAIT_S = 30.0  # discord.py sleeps out shorter 429s itself; longer ones come back to the gateway
MAX_RETRY_AFTER_S = 300.0
CATCH_UP_LIMIT = 500  # per channel and reconnect
# A live message of a channel whose catch-up is pending waits at most this long (from the channel's
# first waiting message) for the catch-up to hand the older messages over, then goes ahead.
CATCH_UP_WAIT_S = 30.0
# A channel whose catch-up fetch failed (a 5xx through discord.py's retries, a 429 longer than it
# waits) is fetched again after this, doubling up to the most (or after Discord's `retry_after`).
CATCH_UP_RETRY_S = 2.0
CATCH_UP_RETRY_MAX_S = 60.0
# Each page of a catch-up fetch is waited for at most this long: discord.py sleeps out a 429 (up to
# `MAX_RATELIMIT_WAIT_S`, five times) and retries a 5xx for ~25 s, and meanwhile every other channel's
# catch-up would wait behind it. One that runs out is fetched again later (`CATCH_UP_RETRY_S`).
CATCH_UP_FETCH_S = 5.0
# A channel discord.py does not know (a thread it never saw created) whose lookup failed is asked
# again after these pauses, all within `FETCH_TIMEOUT_S` of the first try.
LOOKUP_RETRY_S = (0.5, 1.5)
HANDED_KEPT = 4096  # ids of messages recently handed over, so a message fetched and also live goes once
NONCE_LENGTH = 25  # Discord's limit for a string nonce
NONCE_WINDOW_S = 120.0  # Discord enforces a nonce "for a few minutes": taken as two
FIND_POSTED_LIMIT = 100  # messages after the first attempt looked at for a repeat past the window
SEND_TIMEOUT_S = 60.0  # a send without an answer by then is repeated (same nonce)
STATE_FILE = "last_seen.json"
SAVE_EVERY_S = 1.0  # the catch-up state is written at most this often (and at stop), off the event loop
MAX_SNOWFLAKE_DIGITS = 20  # 2**64 - 1 has 20 digits
# discord.py waits 5 s before each re-IDENTIFY (not the first) and `GUILD_READY_TIMEOUT_S` after the
# last GUILD_CREATE before READY. Tests against a loopback fake shorten both through the environment
# (a positive number of seconds); unset, these are the values used.
REIDENTIFY_WAIT_S = 5.0
GUILD_READY_TIMEOUT_S = 0.5
REIDENTIFY_WAIT_ENV = "APPSERVER_DISCORD_REIDENTIFY_WAIT_S"
GUILD_READY_TIMEOUT_ENV = "APPSERVER_DISCORD_GUILD_READY_TIMEOUT_S"
# Discord wants an interaction answered within 3 s of the press. A press waits for the channel's
# earlier messages (one may still be downloading an image) at most `PRESS_WAIT_S`, then is recorded
# ahead of them: acknowledged after the record, it is never lost to a crash. One whose record is still
# not through at `PRESS_ACK_S` (a slow ledger) is acknowledged anyway, so Discord does not fail it.
PRESS_WAIT_S = 2.0
PRESS_ACK_S = 2.5
# Past Discord's window an acknowledgement is useless: one still failing or rate limited then is
# given up (at least `PRESS_ACK_MIN_S` after it began), so the press's effect does not wait on it.
PRESS_WINDOW_S = 3.0
PRESS_ACK_MIN_S = 0.5
PRESS_NOT_RECORDED = "⚠️ Your press could not be recorded. Please press the button again."


# What a person wrote (a message, a reply); every other type is a notice Discord makes (a channel
# renamed, a pin, a thread started, a member joined) whose text would otherwise become a turn.
PERSON_MESSAGE_TYPES = frozenset({discord.MessageType.default, discord.MessageType.reply})

# Events that make or restore a session: a failure there is the connection's (it reconnects).
SESSION_EVENTS = frozenset({"READY", "RESUMED"})


class _Client(discord.Client):
    """discord.Client whose events go to the adapter."""

    def __init__(self, adapter: DiscordAdapter, **options: Any) -> None:
        super().__init__(**options)
        self._adapter = adapter
        parsers = self._connection.parsers  # the dict discord.py's websocket dispatches through
        for event, parse in list(parsers.items()):
            if event not in SESSION_EVENTS:
                parsers[event] = self._guarded(event, parse)
        if "READY" in parsers:
            parsers["READY"] = self._session_start(parsers["READY"])

    def _session_start(self, parse: Callable[[Any], None]) -> Callable[[Any], None]:
        """READY's parser, telling the adapter first: a new session, so a catch-up comes, and the live
        messages dispatched from now on (discord.py hands them over before `on_ready`, which waits
        for the guilds) wait for it in their channels."""

        def run(data: Any) -> None:
            self._adapter._on_session_start()
            parse(data)

        return run

    def _guarded(self, event: str, parse: Callable[[Any], None]) -> Callable[[Any], None]:
        """A parser that skips an event discord.py cannot read (a malformed MESSAGE_UPDATE raised
        KeyError out of the websocket loop: the session dropped, and a message arriving during the
        reconnect was lost), saying so once per event."""

        def run(data: Any) -> None:
            try:
                parse(data)
            except Exception as exc:  # noqa: BLE001 - one bad event must not end the session
                self._adapter._log.warning(
                    "%s: skipped a %s event that could not be read: %s: %s",
                    self._adapter._where,
                    event,
                    type(exc).__name__,
                    exc,
                )

        return run

    async def before_identify_hook(self, shard_id: int | None, *, initial: bool = False) -> None:
        """As discord.py's (which waits 5 s before a re-IDENTIFY), with the wait from the environment."""
        if not initial:
            await asyncio.sleep(env_seconds(REIDENTIFY_WAIT_ENV, REIDENTIFY_WAIT_S))

    async def on_ready(self) -> None:
        await self._adapter._on_ready()

    async def on_resumed(self) -> None:
        self._adapter._report(*self._adapter._refusal.connected())
        self._adapter._start_catch_up(only_held=True)

    async def on_disconnect(self) -> None:
        self._adapter._on_disconnect()

    async def on_message(self, message: discord.Message) -> None:
        await self._adapter._on_discord_message(message)

    async def on_interaction(self, interaction: discord.Interaction) -> None:
        await self._adapter._on_interaction(interaction)


class _Gate:
    """A channel whose catch-up has not handed its messages over yet, and the live messages of the
    channel waiting for that (each a future of its ticket, in arrival order)."""

    __slots__ = ("entry", "again", "waiters", "running", "opened", "timer", "failures", "retry")

    def __init__(self, entry: dict[str, Any] | None) -> None:
        self.entry = entry  # where the catch-up starts; None: not known yet whether it is caught up
        self.again: dict[str, Any] | None = None  # planned again (a new session) while being fetched
        self.waiters: list[asyncio.Future[Ticket]] = []
        self.running = False  # being fetched now
        self.opened = False  # its live messages no longer wait (caught up, or waited long enough)
        self.timer: asyncio.TimerHandle | None = None
        self.failures = 0  # fetches of it that failed in a row
        self.retry: asyncio.TimerHandle | None = None  # a failed fetch, tried again when this fires


class DiscordAdapter:
    """One Discord bot (one token)."""

    limits = Limits(max_length=MAX_LENGTH, can_edit=True, can_react=True, edits_per_second=1.0)
    secret_keys = SECRETS  # a reference to any other name is refused (plugins/contract.py)
    prompt_max_length = CONTENT_MAX
    # Discord itself answers a repeated send with the same nonce with the message it already has
    # (`enforce_nonce`, for a few minutes): the gateway may repeat a send whose outcome is unknown.
    dedupes_sends = True
    dedupe_window_s = NONCE_WINDOW_S  # past it, `find_posted` looks for the message before a repeat

    def __init__(self, account: Account, context: AdapterContext) -> None:
        self.account = account
        self.context = context
        self._log = context.log
        self._where = f"discord account '{account.name}'"
        self._config_error: str | None = None
        try:
            check_settings(account.settings)
        except ValueError as exc:
            self._config_error = f"{self._where}: {exc}"
        api_url = account.settings.get("api_url", DEFAULT_API_URL)
        gateway_url = account.settings.get("gateway_url", DEFAULT_GATEWAY_URL)
        if not isinstance(api_url, str) or not api_url.startswith(("http://", "https://")):
            api_url = DEFAULT_API_URL  # refused at start (the error above)
        if not isinstance(gateway_url, str) or not gateway_url.startswith(("ws://", "wss://")):
            gateway_url = DEFAULT_GATEWAY_URL
        self._api_url = api_url.rstrip("/")
        self._gateway_url = gateway_url if gateway_url.endswith("/") else gateway_url + "/"
        self._client: _Client | None = None
        self._runner: asyncio.Task[None] | None = None
        self._ready: asyncio.Event = asyncio.Event()
        self._state: AccountState = "stopped"
        self._fatal: str | None = None
        # the token refused on a REST call (state `error` until a call succeeds again)
        self._refusal = TokenRefusal(self._report, self._log, self._where, "Discord")
        self._global_until = 0.0  # loop time until which Discord's global rate limit holds (a 429 said so)
        self._prompts: dict[tuple[str, str], str] = {}  # (channel, message id) of a prompt -> short id
        self._state_path = Path(context.data_dir) / STATE_FILE
        self._state_writable = True  # False while the saved file exists but cannot be read: never clobber it
        self._seen: dict[str, dict[str, Any]] = self._load_seen()
        self._seen_dirty = False  # `_seen` has changes not written yet
        self._saver: asyncio.Task[None] | None = None
        self._save_now = asyncio.Event()  # stop: the saver writes without waiting out its second
        self._catch_up: asyncio.Task[None] | None = None
        # Channels whose catch-up has not handed its messages over yet, in the order planned; their
        # live messages wait there (`_Gate`). `_planning`: a session started, and which channels
        # never seen are caught up is known only at `on_ready` (the guilds' channels are needed).
        self._gates: dict[int, _Gate] = {}
        self._urgent: dict[int, None] = {}  # gated channels with a live message waiting: caught up first
        self._planning = False
        self._unplaced: set[int] = set()  # channels whose lookup failed: their place is a guess
        self._handed: dict[int, None] = {}  # the last `HANDED_KEPT` message ids handed over, oldest first
        self.bot_user_id: int | None = None
        # Per-channel arrival order; a later message waits for an earlier one's attachments at most
        # this long (from its own arrival), then goes ahead.
        self._order = ChatOrder(FETCH_TIMEOUT_S + ORDER_MARGIN_S, self._log)

    # ------------------------------------------------------------------ lifecycle

    @property
    def is_running(self) -> bool:
        return (
            self._client is not None
            and self._runner is not None
            and not self._runner.done()
            and not self._client.is_closed()
        )

    async def start(self) -> None:
        if self._config_error is not None:
            raise AccountError(self._config_error)
        if self.is_running:
            return
        token = self.account.secrets.get("token")
        source = self.account.secret_sources.get("token") or "token_env / token_file"
        if not token:
            raise AccountError(f"{self._where}: no token (set token_env or token_file)")
        discord.http.Route.BASE = self._api_url
        gw = discord.gateway.DiscordWebSocket
        gw.DEFAULT_GATEWAY = type(gw.DEFAULT_GATEWAY)(self._gateway_url)
        self._fatal = None
        self._ready = asyncio.Event()
        self._report("starting", None)
        # Voice is not used: no "PyNaCl / davey is not installed" warnings in the log at every start.
        discord.VoiceClient.warn_nacl = False
        if hasattr(discord.VoiceClient, "warn_dave"):
            discord.VoiceClient.warn_dave = False
        intents = discord.Intents.none()
        intents.guilds = True
        intents.guild_messages = True
        intents.dm_messages = True
        intents.message_content = True
        client = _Client(
            self,
            intents=intents,
            max_ratelimit_timeout=MAX_RATELIMIT_WAIT_S,
            chunk_guilds_at_startup=False,
            guild_ready_timeout=env_seconds(GUILD_READY_TIMEOUT_ENV, GUILD_READY_TIMEOUT_S),
            allowed_mentions=discord.AllowedMentions.none(),
            http_trace=self._limit_trace(),
        )
        self._client = client
        try:
            await client.login(token)
        except discord.LoginFailure:
            await _close_quietly(client)
            self._client = None
            raise AccountError(f"{self._where}: Discord refused the token ({source}): 401 Unauthorized") from None
        except BaseException:
            await _close_quietly(client)
            self._client = None
            raise
        self.bot_user_id = client.user.id if client.user else None
        self._runner = asyncio.create_task(self._run(client), name=f"discord-{self.account.name}")
        ready = asyncio.create_task(self._ready.wait())
        try:
            await asyncio.wait({ready, self._runner}, timeout=READY_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()
        if not self._ready.is_set():
            reason = self._fatal
            await self._shutdown()  # no "stopped" report: the gateway records the failure raised here
            if reason is not None:
                raise AccountError(f"{self._where}: {reason}")
            raise RuntimeError(f"{self._where}: the gateway did not become ready within {READY_TIMEOUT_S:g} s")
        self._log.info("%s: connected as %s", self._where, client.user)

    async def _run(self, client: _Client) -> None:
        try:
            await client.connect(reconnect=True)
        except discord.PrivilegedIntentsRequired:
            self._fatal = (
                "the Message Content intent is not enabled for this bot: turn on 'Message Content Intent' "
                "under Bot → Privileged Gateway Intents in the Discord developer portal"
            )
            self._report("error", self._fatal)
        except discord.ConnectionClosed as exc:
            if exc.code == 4004:
                source = self.account.secret_sources.get("token") or "token_env / token_file"
                self._fatal = f"Discord refused the token ({source}): gateway close 4004"
            else:
                self._fatal = f"the gateway closed the connection ({exc.code}): {exc.reason or 'no reason'}"
            self._report("error", self._fatal)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - not running: the gateway restarts the adapter with backoff
            self._report("backoff", f"gateway connection failed: {type(exc).__name__}: {exc}")
        finally:
            await _close_quietly(client)

    async def stop(self) -> None:
        await self._shutdown()
        self._report("stopped", None)

    async def _shutdown(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await _close_quietly(client)
        for task in (self._runner, self._catch_up):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self._runner = None
        self._catch_up = None
        self._planning = False
        gates, self._gates = self._gates, {}
        self._urgent.clear()
        for channel_id, gate in gates.items():  # nothing waits on for a catch-up that will not come
            if gate.retry is not None:
                gate.retry.cancel()
            self._open_gate(channel_id, gate)
        await self._flush_seen()

    def _report(self, state: AccountState, reason: str | None) -> None:
        if state == self._state and state == "running":
            return
        self._state = state
        try:
            self.context.report(state, reason)
        except Exception:  # noqa: BLE001 - reporting must never break the connection
            self._log.exception("discord: report(%s) failed", state)

    def _on_disconnect(self) -> None:
        if self._client is not None and not self._client.is_closed() and self._state == "running":
            self._report("backoff", "gateway connection lost; reconnecting")

    def _limit_trace(self) -> aiohttp.TraceConfig:
        """Watches discord.py's answers for a 429 Discord says is global: its `RateLimited` (a wait
        longer than it sleeps out) does not say, and a global one holds every call of the bot."""
        trace = aiohttp.TraceConfig()
        trace.on_request_end.append(self._on_response)
        return trace

    async def _on_response(self, session: Any, ctx: Any, params: aiohttp.TraceRequestEndParams) -> None:
        headers = params.response.headers
        scope = headers.get("X-RateLimit-Scope", "").lower()
        is_global = headers.get("X-RateLimit-Global", "").lower() == "true" or scope == "global"
        if params.response.status == 429 and is_global:
            self._global_until = asyncio.get_running_loop().time() + _bounded(headers.get("Retry-After"))

    async def _rest(self, op: str, awaitable: Any) -> Any:
        """`_call`, watching the token: a 401 (the token was reset) puts the account in `error`
        naming the token at once, as a refused login does at start; a call that succeeds again
        ends that. A rate limit while Discord's global one holds is the account's (`retry_scope`)."""
        try:
            result = await _call(op, awaitable)
        except _TokenRefused as exc:
            source = self.account.secret_sources.get("token") or "token_env / token_file"
            self._refusal.refused(f"{self._where}: Discord refused the token ({source}): {exc.reason}")
            raise
        except DeliveryError as exc:
            if exc.retry_after is None or asyncio.get_running_loop().time() >= self._global_until:
                raise
            raise DeliveryError(f"{exc.reason} (global)", retry_after=exc.retry_after, retry_scope="account") from None
        if self._refusal.accepted() and self._ready.is_set():
            self._report("running", None)
        return result

    async def _on_ready(self) -> None:
        """A new session (first connect, or a re-IDENTIFY): running, then catch up on what was missed."""
        self._ready.set()
        self._report(*self._refusal.connected())
        self._start_catch_up()

    def _on_session_start(self) -> None:
        """READY arrived (before discord.py reads it): every channel seen is caught up in this session,
        so its live messages wait for that from now on; a server channel never seen may be too, which
        is known at `on_ready`."""
        self._planning = True
        for key, entry in list(self._seen.items()):
            self._plan(int(key), entry)

    def _plan(self, channel_id: int, entry: dict[str, Any]) -> None:
        """Catch `channel_id` up from `entry` (as it is now: a live message recorded meanwhile must
        not move the start past what was missed). A channel already planned keeps its place and its
        entry (the older one, which starts earlier); a gate a live message opened meanwhile gets it."""
        gate = self._gates.get(channel_id)
        if gate is None:
            self._gates[channel_id] = _Gate(entry)
            return
        if gate.entry is None:
            gate.entry = entry
        elif gate.running:  # its fetch may be past by now: fetched again from here once it ends
            gate.again = gate.again or entry
        if gate.opened and not gate.running:  # waited out in an earlier session: waited for again
            gate.opened = False

    def _start_catch_up(self, *, only_held: bool = False) -> None:
        """Fetch what was missed: after a new session every channel seen (planned at READY) and the
        server channels never seen that have news; after a RESUME only the channels holding a message
        that could not be recorded. One task works through the planned channels, those with a live
        message waiting first."""
        if only_held:
            for key, entry in list(self._seen.items()):
                if entry.get("failed") or entry.get("gap"):
                    self._plan(int(key), entry)
        else:
            for key, entry in list(self._seen.items()):  # also when READY's hook did not run
                self._plan(int(key), entry)
            try:
                unseen = self._unseen_with_news()
            except Exception:  # noqa: BLE001 - the channels seen are still caught up, and nothing waits on
                self._log.exception("%s: could not look for channels never seen with news", self._where)
                unseen = []
            for key, entry in unseen:
                self._plan(int(key), entry)
            self._planning = False
            for channel_id, gate in list(self._gates.items()):
                if gate.entry is None:  # a live message's channel that turned out to have nothing to fetch
                    del self._gates[channel_id]
                    self._open_gate(channel_id, gate)
        if self._gates and (self._catch_up is None or self._catch_up.done()):
            self._catch_up = asyncio.create_task(self._catch_up_all(), name=f"discord-catchup-{self.account.name}")

    def _wait_for_catch_up(self, message: discord.Message) -> asyncio.Future[Ticket] | None:
        """A live message of a channel whose catch-up is pending waits for it: its place in the
        channel's line (a ticket) comes when the catch-up has handed the older messages over, in the
        order the live messages arrived, or `CATCH_UP_WAIT_S` after the first of them began to wait.
        None: nothing to wait for (no catch-up pending there, or no longer waited for). Synchronous,
        before the handler's first await, like the ticket it stands for."""
        channel_id = message.channel.id
        gate = self._gates.get(channel_id)
        if gate is None:
            in_server = message.guild is not None or getattr(message.channel, "guild_id", None) is not None
            if not (self._planning and in_server):  # a DM never seen is never fetched (no list of DMs)
                return None
            gate = self._gates[channel_id] = _Gate(None)  # known at `on_ready`
        if gate.opened:
            return None
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[Ticket] = loop.create_future()
        gate.waiters.append(waiter)
        if gate.timer is None:
            gate.timer = loop.call_later(CATCH_UP_WAIT_S, self._catch_up_too_slow, channel_id, gate)
        if not gate.running:
            self._urgent[channel_id] = None
        return waiter

    def _catch_up_too_slow(self, channel_id: int, gate: _Gate) -> None:
        if gate.opened:
            return
        self._log.warning(
            "%s: channel %s: the messages sent while the gateway was away are not handed over after %g s; "
            "handing on the ones that came since first",
            self._where,
            channel_id,
            CATCH_UP_WAIT_S,
        )
        self._open_gate(channel_id, gate)
        if gate.entry is None and self._gates.get(channel_id) is gate:
            del self._gates[channel_id]

    def _open_gate(self, channel_id: int, gate: _Gate) -> None:
        """The channel's live messages go on, in the order they came (their tickets taken here, after
        every message the catch-up handed over); later ones do not wait. Idempotent."""
        gate.opened = True
        if gate.timer is not None:
            gate.timer.cancel()
            gate.timer = None
        waiters, gate.waiters = gate.waiters, []
        for waiter in waiters:
            if not waiter.done():  # not cancelled (its handler gave up or was cancelled)
                waiter.set_result(self._order.ticket(channel_id))

    # ------------------------------------------------------------------ inbound

    async def _on_discord_message(self, message: discord.Message, meta: dict[str, Any] | None = None) -> None:
        if self.bot_user_id is not None and message.author.id == self.bot_user_id:
            return  # our own posts come back as MESSAGE_CREATE
        if message.type not in PERSON_MESSAGE_TYPES:  # a rename, a pin, "started a thread": nobody wrote it
            self._log.debug("%s: skipped system message %s (%s)", self._where, message.id, message.type)
            return
        # discord.py dispatches each event as its own task, started in arrival order: the ticket,
        # taken before the first await, keeps the channel's messages in that order however long
        # one of them takes to read (its attachments are downloaded first). A live message of a
        # channel being caught up gets its ticket once the catch-up has handed the older ones over.
        waiter = self._wait_for_catch_up(message) if meta is None else None
        ticket = self._order.ticket(message.channel.id) if waiter is None else None
        try:
            try:
                msg = await self._inbound(message, meta)
            except Exception:  # noqa: BLE001 - a malformed message must not stall the others
                self._log.exception("%s: could not read message %s; skipped", self._where, message.id)
                return
            if waiter is not None:
                ticket = await waiter  # bounded: the gate opens after `CATCH_UP_WAIT_S` at the latest
            assert ticket is not None
            await ticket.wait()
            if message.id in self._handed:  # fetched by the catch-up and also live, or replayed
                self._log.debug("%s: message %s already handed over", self._where, message.id)
                return
            try:
                await self.context.on_message(msg)
            except Exception as exc:  # noqa: BLE001 - not recorded: the catch-up after a reconnect brings it again
                self._log.error("%s: message %s not recorded (%s)", self._where, msg.message_id, exc)
                self._note_seen(message.channel.id, message.id, msg, recorded=False)
                return
            self._note_handed(message.id)
            self._note_seen(message.channel.id, message.id, msg)
        finally:
            if ticket is None and waiter is not None:
                if waiter.done() and not waiter.cancelled():
                    ticket = waiter.result()
                else:
                    waiter.cancel()  # the gate skips it
            if ticket is not None:
                ticket.release()

    def _note_handed(self, message_id: int) -> None:
        handed = self._handed
        handed[message_id] = None
        if len(handed) > HANDED_KEPT:
            del handed[next(iter(handed))]

    async def _where_is(self, message: discord.Message) -> tuple[str, str | None, str]:
        """(chat, thread, chat_type) of a live message. A guild channel discord.py does not know (a
        thread whose THREAD_CREATE it never saw) is looked up: taken as a chat of its own, a thread
        escaped its parent channel's route (a stricter agent) and was answered by the default one."""
        channel = message.channel
        if isinstance(channel, discord.DMChannel | discord.GroupChannel):
            return str(channel.id), None, "dm"
        if isinstance(channel, discord.Thread):
            return str(channel.parent_id), str(channel.id), "group"
        if isinstance(channel, discord.PartialMessageable):
            saved = None if channel.id in self._unplaced else _where_of(self._seen.get(str(channel.id)))
            return saved or await self._place(channel.id)
        guild_id = message.guild.id if message.guild else getattr(channel, "guild_id", None)
        if guild_id is None:
            return str(channel.id), None, "dm"
        return str(channel.id), None, "group"

    async def _inbound(self, message: discord.Message, meta: dict[str, Any] | None) -> InboundMessage:
        where = _where_of(meta) if meta is not None else None
        if where is None:  # a live message, or a saved entry that does not say where (never a KeyError)
            where = await self._where_is(message)
        chat, thread, chat_type = where
        me = self.bot_user_id
        mentions_bot = me is not None and (any(u.id == me for u in message.mentions) or me in message.raw_mentions)
        # The bot's managed role (`<@&role>`, which Discord's autocomplete often offers for a bot) is a
        # mention of the bot too: its id is unique across servers, so a caught-up message whose guild
        # discord.py did not attach is still recognised.
        my_roles = self._bot_role_ids(message)
        mentioned_roles = {*message.raw_role_mentions, *(r.id for r in message.role_mentions)}
        if my_roles & mentioned_roles:
            mentions_bot = True
        reply_to: str | None = None
        ref = message.reference
        if ref is not None and ref.message_id is not None:
            reply_to = str(ref.message_id)
            resolved = ref.resolved
            if isinstance(resolved, discord.Message) and me is not None and resolved.author.id == me:
                mentions_bot = True
        text = message.content
        if me is not None:
            text = text.replace(f"<@{me}>", "").replace(f"<@!{me}>", "")
        for role_id in my_roles:
            text = text.replace(f"<@&{role_id}>", "")
        attachments = tuple([await self._attachment(a) for a in message.attachments])
        author = message.author
        return InboundMessage(
            channel=CHANNEL,
            account=self.account.name,
            chat=chat,
            chat_type="dm" if chat_type == "dm" else "group",
            sender=str(author.id),
            message_id=str(message.id),
            text=text.strip(),
            thread=str(thread) if thread else None,
            sender_name=author.display_name or author.name or None,
            mentions_bot=mentions_bot,
            reply_to=reply_to,
            sender_is_bot=bool(author.bot) or message.webhook_id is not None,  # integrations are bots too
            ts=message.created_at.timestamp(),
            attachments=attachments,
            raw={
                "id": str(message.id),
                "channel_id": str(message.channel.id),
                "guild_id": str(message.guild.id) if message.guild else None,
            },  # fmt: skip
        )

    def _bot_role_ids(self, message: discord.Message) -> set[int]:
        """The ids of the bot's own managed roles (`tags.bot_id` is the bot): of the message's server,
        else of every server the bot is in (a caught-up message may come without its guild)."""
        client = self._client
        guilds: list[discord.Guild] = [message.guild] if message.guild is not None else []
        if not guilds and client is not None:
            guilds = list(client.guilds)
        ids: set[int] = set()
        for guild in guilds:
            role = guild.self_role
            if role is not None:
                ids.add(role.id)
        return ids

    async def _attachment(self, a: discord.Attachment) -> Attachment:
        mime = a.content_type or "application/octet-stream"
        if not mime.startswith("image/"):
            return Attachment(kind="file", name=a.filename, mime=mime, size=a.size)
        # An image travels to the server base64-encoded in the turn's frame: one bigger than the
        # gateway's budget (from the server's frame limit) is not fetched, and is named as too big.
        limit = self.context.max_image_bytes()
        if a.size > limit:
            return Attachment(kind="image", name=a.filename, mime=mime, size=a.size)
        try:
            data = await asyncio.wait_for(a.read(), FETCH_TIMEOUT_S)
        except (TimeoutError, discord.HTTPException, OSError) as exc:
            self._log.warning("%s: attachment %s not fetched: %s", self._where, a.filename, exc)
            return Attachment(kind="file", name=a.filename, mime=mime, size=a.size)
        if len(data) > limit:
            return Attachment(kind="image", name=a.filename, mime=mime, size=len(data))
        return Attachment(kind="image", name=a.filename, mime=mime, size=len(data), data=data)

    async def _on_interaction(self, interaction: discord.Interaction) -> None:
        """A press on an approval button, handed over as `/approve ID` or `/deny ID` and acknowledged
        once recorded (`_PressAnswer`). Any other interaction (this bot offers none) is not answered."""
        if interaction.type != discord.InteractionType.component:
            return
        data: dict[str, Any] = dict(interaction.data or {})
        custom_id = str(data.get("custom_id") or "")
        verb, _, short_id = custom_id.partition(":")
        if verb not in ("approve", "deny") or not short_id or not short_id.isalnum():
            return
        channel_id = interaction.channel_id
        if channel_id is None:
            return
        ticket = self._order.ticket(channel_id)  # in line with the channel's messages: before the first await
        answer = _PressAnswer(interaction, self._log, self._where)
        # Discord fails a press not answered within 3 s: acknowledged at `PRESS_ACK_S` if not recorded by then
        late = asyncio.get_running_loop().call_later(PRESS_ACK_S, answer.defer_late)
        try:
            channel = interaction.channel
            thread: str | None = None
            chat = str(channel_id)
            if isinstance(channel, discord.Thread):
                chat, thread = str(channel.parent_id), str(channel.id)
            user = interaction.user
            msg = InboundMessage(
                channel=CHANNEL,
                account=self.account.name,
                chat=chat,
                chat_type="group" if interaction.guild_id else "dm",
                sender=str(user.id),
                message_id=f"interaction:{interaction.id}",
                text=f"/{verb} {short_id}",
                thread=thread,
                sender_name=user.display_name or user.name or None,
                mentions_bot=True,  # a press on the bot's own button is addressed to it
                reply_to=str(interaction.message.id) if interaction.message else None,
                ts=interaction.created_at.timestamp(),
                pressed=True,
                raw={"interaction_id": str(interaction.id), "custom_id": custom_id},
                ack=answer.defer,  # called by the gateway once its ledger committed the press
            )
            try:
                await asyncio.wait_for(ticket.wait(), PRESS_WAIT_S)
            except TimeoutError:
                self._log.warning(
                    "%s: channel %s: an earlier message is still being read after %g s; button press %s is "
                    "recorded first (Discord wants an answer within 3 s)",
                    self._where,
                    channel_id,
                    PRESS_WAIT_S,
                    interaction.id,
                )
            try:
                await self.context.on_message(msg)
            except Exception as exc:  # noqa: BLE001 - not recorded: the person is told to press again
                late.cancel()
                self._log.error("%s: button press %s not recorded (%s)", self._where, interaction.id, exc)
                await answer.not_recorded()
                return
            late.cancel()
            await answer.defer()  # `on_message` returned: committed (also when the ack was not called)
        finally:
            late.cancel()
            ticket.release()

    # ------------------------------------------------------------------ catch-up

    def _load_seen(self) -> dict[str, dict[str, Any]]:
        """The catch-up state as saved. A file that is not the JSON object this adapter writes (torn,
        bit rot, edited by hand) is moved aside to `last_seen.json.corrupt-<UTC time>` with an error:
        never read as empty and later overwritten, which would lose what it says silently. Every id
        in it is checked here (ASCII digits, at most a snowflake's 20), so nothing later int()s a `٥`
        as 5 or 5000 digits into a ValueError: an entry with an unusable channel or `last` is
        dropped, an unusable `failed` id is dropped (the original is set aside first)."""
        path = self._state_path
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return {}
        except OSError as exc:
            self._state_writable = False
            self._log.error(
                "%s: cannot read the catch-up state %s (%s); messages sent while the gateway was away are not "
                "fetched, and the file is left as it is until it can be read",
                self._where,
                path,
                exc,
            )
            return {}
        try:
            # every integer as its text: ids are kept as text anyway, and int() of 5000 digits would
            # fail the whole file
            value = json.loads(raw.decode("utf-8"), parse_int=str)
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            self._set_aside(f"not valid JSON ({exc})")
            return {}
        if not isinstance(value, dict):
            self._set_aside(f"a JSON {type(value).__name__}, not an object")
            return {}
        out: dict[str, dict[str, Any]] = {}
        dropped = 0
        unplaced = 0
        for key, entry in value.items():
            if not (_snowflake(key) and isinstance(entry, dict) and _snowflake_int(entry.get("last")) is not None):
                dropped += 1
                continue
            raw_failed = entry.get("failed")
            failed = (
                [i for i in raw_failed if isinstance(i, str) and _snowflake(i)] if isinstance(raw_failed, list) else []
            )
            if raw_failed is not None and failed != raw_failed:
                dropped += 1
            out[key] = {"last": entry["last"]}
            where = _where_of(entry)
            if where is None:
                # where the channel is (chat, thread, DM or not) is unusable, but its catch-up point is
                # not: kept, the channel is looked up when it is caught up (and noted whole again)
                unplaced += 1
            else:
                out[key] |= {"chat": where[0], "thread": where[1], "chat_type": where[2]}
            if failed:
                out[key]["failed"] = failed
            gap = entry.get("gap")
            if isinstance(gap, str) and _snowflake(gap):
                out[key]["gap"] = gap
            elif gap is not None:
                dropped += 1
        if dropped or unplaced:
            problems = [
                f"{dropped} channel(s) or message id(s) that are not Discord ids" if dropped else "",
                f"{unplaced} channel(s) without a usable chat, thread and chat_type" if unplaced else "",
            ]
            self._set_aside("; ".join(p for p in problems if p) + "; the rest is kept")
            self._save_seen(out)
        return out

    def _set_aside(self, reason: str) -> None:
        """Move a damaged catch-up state aside (kept for a look), loudly."""
        try:
            moved_to = move_aside(self._state_path)
        except OSError as exc:
            self._state_writable = False
            self._log.error(
                "%s: the catch-up state %s is damaged (%s) and could not be moved aside (%s); it is left as it is",
                self._where,
                self._state_path,
                reason,
                exc,
            )
            return
        self._log.error(
            "%s: the catch-up state %s is damaged (%s): moved aside to %s; messages sent while the gateway "
            "was away before now may not be fetched",
            self._where,
            self._state_path,
            reason,
            moved_to,
        )

    def _seen_changed(self) -> None:
        """Have the catch-up state written soon. Writing it whole (two fsyncs) for every message, on
        the event loop, cost milliseconds per message once many channels were seen; now one write a
        second at most, in a thread. A crash loses at most that second of positions: the catch-up
        then fetches those messages again and the ledger, keyed by message id, knows them."""
        self._seen_dirty = True
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # no event loop (a synchronous caller): write it now
            self._seen_dirty = False
            self._save_seen(self._seen)
            return
        if self._saver is None or self._saver.done():
            self._saver = asyncio.create_task(self._save_soon(), name=f"discord-state-{self.account.name}")

    async def _save_soon(self) -> None:
        """Write the state a second after its first change (sooner once stop asks), again while it changes."""
        while self._seen_dirty:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._save_now.wait(), SAVE_EVERY_S)
            self._seen_dirty = False
            # a copy: the entries are replaced, never changed in place, so the thread reads a stable map
            await asyncio.to_thread(self._save_seen, dict(self._seen))

    async def _flush_seen(self) -> None:
        """At stop: the changes not written yet are written now."""
        saver = self._saver
        if saver is not None and not saver.done():
            self._save_now.set()
            with contextlib.suppress(Exception):
                await saver
        self._save_now.clear()
        if self._seen_dirty:
            self._seen_dirty = False
            await asyncio.to_thread(self._save_seen, dict(self._seen))

    def _save_seen(self, seen: dict[str, dict[str, Any]]) -> None:
        if not self._state_writable:
            return
        try:
            atomic_write_text(self._state_path, json.dumps(seen, sort_keys=True))
        except OSError as exc:
            self._log.warning("%s: could not save %s: %s", self._where, self._state_path, exc)

    def _note_seen(self, channel_id: int, message_id: int, msg: InboundMessage, *, recorded: bool = True) -> None:
        """Remember where the catch-up of a channel starts: after the newest recorded message, but
        never past a message that could not be recorded (kept in `failed` until it is), nor past
        messages its pending catch-up has not fetched yet (`gap`, its start, kept until it has: a
        live message recorded meanwhile moved `last` past them, and a restart then never fetched
        them). A place only guessed (its lookup failed) is not saved as the channel's."""
        key = str(channel_id)
        old = self._seen.get(key) or {"last": "0"}
        place = {"chat": msg.chat, "thread": msg.thread, "chat_type": msg.chat_type}
        if channel_id in self._unplaced:
            known = _where_of(old)
            if known is None:
                return  # nothing to save it under yet: looked up again with its next message
            place = dict(zip(("chat", "thread", "chat_type"), known, strict=True))
        failed = {n for n in map(_snowflake_int, old.get("failed") or []) if n is not None}
        last = _snowflake_int(old.get("last")) or 0
        if recorded:
            failed.discard(message_id)
            last = max(last, message_id)
        else:
            failed.add(message_id)
        entry: dict[str, Any] = {"last": str(last), **place}
        if failed:
            entry["failed"] = [str(i) for i in sorted(failed)]
        gap = self._pending_gap(channel_id, old)
        if gap is not None:
            entry["gap"] = str(gap)
        if entry == old:
            return
        self._seen[key] = entry
        self._seen_changed()

    def _pending_gap(self, channel_id: int, old: dict[str, Any]) -> int | None:
        """Where the channel's messages not fetched yet begin: a gap saved before, or the start of
        its catch-up while one is planned (failed, or not run yet); None when there is none."""
        saved = _snowflake_int(old.get("gap"))
        gate = self._gates.get(channel_id)
        planned = _catch_up_start(gate.entry) if gate is not None and gate.entry is not None else None
        starts = [n for n in (saved, planned) if n is not None]
        return min(starts) if starts else None

    async def _catch_up_all(self) -> None:
        """Catch the planned channels up one after the other, a channel with a live message waiting
        first; each channel's gate opens once its messages are handed over. A channel whose fetch
        failed keeps its gate (its live messages wait at most `CATCH_UP_WAIT_S` in all) and is
        fetched again later (`_retry_later`): the others are not held up by it meanwhile."""
        while (channel_id := self._next_to_catch_up()) is not None:
            gate = self._gates[channel_id]
            assert gate.entry is not None
            start = _catch_up_start(gate.entry)
            gate.running = True
            try:
                await self._catch_up_channel(channel_id, gate.entry)
            except asyncio.CancelledError:
                raise
            except (discord.Forbidden, discord.NotFound) as exc:  # for good: trying again changes nothing
                self._log.warning("%s: catch-up of channel %s failed: %s", self._where, channel_id, exc)
                gate.again = None
            except Exception as exc:  # noqa: BLE001 - one channel that cannot be read does not stop the rest
                gate.again = None  # its entry, the older one, still starts before whatever came since
                self._retry_later(channel_id, gate, exc)
                continue
            finally:
                gate.running = False
            gate.failures = 0
            self._gap_closed(channel_id, start)
            if gate.again is not None and self._gates.get(channel_id) is gate:
                # a new session came meanwhile: what was written before it is fetched too, and
                # the channel's live messages keep waiting for that
                gate.entry, gate.again, gate.opened = gate.again, None, False
                if gate.waiters:
                    self._urgent[channel_id] = None
            else:
                if self._gates.get(channel_id) is gate:
                    del self._gates[channel_id]
                self._open_gate(channel_id, gate)

    def _retry_later(self, channel_id: int, gate: _Gate, exc: Exception) -> None:
        """A failed fetch: tried again after a bounded backoff (or Discord's `retry_after`). Its gate
        stays planned, so the channel's saved position keeps the start of what is not fetched yet
        (`_note_seen`) however many live messages are recorded meanwhile."""
        gate.failures += 1
        delay = min(CATCH_UP_RETRY_S * 2 ** (gate.failures - 1), CATCH_UP_RETRY_MAX_S)
        delay = max(delay, _retry_after(exc))
        self._log.warning(
            "%s: catch-up of channel %s failed (%s: %s); trying again in %g s",
            self._where,
            channel_id,
            type(exc).__name__,
            exc,
            delay,
        )
        gate.retry = asyncio.get_running_loop().call_later(delay, self._retry_due, channel_id, gate)

    def _retry_due(self, channel_id: int, gate: _Gate) -> None:
        gate.retry = None
        if self._gates.get(channel_id) is not gate or self._client is None:
            return
        if gate.waiters:
            self._urgent[channel_id] = None
        if self._catch_up is None or self._catch_up.done():
            self._catch_up = asyncio.create_task(self._catch_up_all(), name=f"discord-catchup-{self.account.name}")

    def _gap_closed(self, channel_id: int, start: int) -> None:
        """The channel is fetched from `start` on: a saved gap from there (or later) is no more."""
        key = str(channel_id)
        entry = self._seen.get(key)
        gap = _snowflake_int(entry.get("gap")) if entry is not None else None
        if entry is None or gap is None or gap < start:
            return
        self._seen[key] = {k: v for k, v in entry.items() if k != "gap"}
        self._seen_changed()

    def _next_to_catch_up(self) -> int | None:
        while self._urgent:
            channel_id = next(iter(self._urgent))
            del self._urgent[channel_id]
            gate = self._gates.get(channel_id)
            if gate is not None and _due(gate):
                return channel_id
        return next((c for c, g in self._gates.items() if _due(g)), None)

    def _unseen_with_news(self) -> list[tuple[str, dict[str, Any]]]:
        """Server channels and active threads never seen whose last message is newer than the newest
        message recorded anywhere (the previous run's last moment, as far as it is known): a channel
        first written to while the gateway was away, or in the second before a crash that the state
        file had not saved yet. Caught up from that watermark. DMs have no such list (Discord sends
        none to a bot), nor does a first run (no watermark: history is not answered)."""
        client = self._client
        marks = [_snowflake_int(e.get("last")) or 0 for e in self._seen.values()]
        watermark = max(marks, default=0)
        if client is None or watermark == 0:
            return []
        found: list[tuple[str, dict[str, Any]]] = []
        for guild in client.guilds:
            channels: list[discord.TextChannel | discord.Thread] = [*guild.text_channels, *guild.threads]
            for channel in channels:
                last = getattr(channel, "last_message_id", None)
                if str(channel.id) in self._seen or not isinstance(last, int) or last <= watermark:
                    continue
                me = guild.me
                if me is not None and not channel.permissions_for(me).read_message_history:
                    continue
                found.append((str(channel.id), {"last": str(watermark)}))
        if found:
            self._log.info("%s: %d channel(s) never seen have new messages; catching up", self._where, len(found))
        return found

    async def _catch_up_channel(self, channel_id: int, entry: dict[str, Any]) -> None:
        client = self._client
        if client is None:
            return
        if _where_of(entry) is None:  # its saved entry did not say where it is: ask once for all its messages
            entry = {**entry, **dict(zip(("chat", "thread", "chat_type"), await self._place(channel_id), strict=True))}
        channel = client.get_partial_messageable(channel_id)
        count = 0
        after = discord.Object(id=_catch_up_start(entry))
        messages = channel.history(limit=CATCH_UP_LIMIT, after=after, oldest_first=True)
        while (message := await _next_within(messages, CATCH_UP_FETCH_S)) is not None:
            if self.bot_user_id is not None and message.author.id == self.bot_user_id:
                continue
            count += 1
            await self._on_discord_message(message, entry)
        if count:
            self._log.info("%s: caught up on %d message(s) in channel %s", self._where, count, channel_id)

    async def _place(self, channel_id: int) -> tuple[str, str | None, str]:
        """(chat, thread, chat_type) of a channel from discord.py's cache (servers' channels and
        threads), else from Discord; when neither knows, a group: a pairing code is never posted where
        others may read it."""
        client = self._client
        channel: Any = client.get_channel(channel_id) if client is not None else None
        if channel is None and client is not None:
            channel = await self._look_up(client, channel_id)
        if isinstance(channel, discord.DMChannel | discord.GroupChannel):
            return str(channel_id), None, "dm"
        if isinstance(channel, discord.Thread):
            return str(channel.parent_id), str(channel_id), "group"
        return str(channel_id), None, "group"

    async def _look_up(self, client: discord.Client, channel_id: int) -> Any:
        """The channel as Discord describes it, asked again after a failure that may pass (a 5xx, a
        429, a timeout) within `FETCH_TIMEOUT_S` in all; None when it is not known. A channel whose
        lookup failed is noted `_unplaced`: its guessed place is neither saved nor trusted, so its
        next message asks again (a thread taken for a chat of its own escaped its parent's route)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + FETCH_TIMEOUT_S
        pauses = iter(LOOKUP_RETRY_S)
        while True:
            try:
                channel = await asyncio.wait_for(client.fetch_channel(channel_id), deadline - loop.time())
            except (TimeoutError, discord.HTTPException, discord.InvalidData, OSError) as exc:
                pause = next(pauses, None)
                transient = not isinstance(exc, discord.NotFound | discord.Forbidden | discord.InvalidData)
                again = transient and pause is not None and loop.time() + pause < deadline
                self._log.warning(
                    "%s: could not look channel %s up (%s: %s); %s",
                    self._where,
                    channel_id,
                    type(exc).__name__,
                    exc,
                    f"asking again in {pause:g} s" if again else "taken as a group for now",
                )
                if not again:
                    self._unplaced.add(channel_id)
                    return None
                await asyncio.sleep(pause or 0.0)
                continue
            self._unplaced.discard(channel_id)
            return channel

    # ------------------------------------------------------------------ outbound

    def _channel(self, target: Target) -> discord.PartialMessageable:
        client = self._client
        if client is None:
            raise DeliveryError("discord: not started")
        channel_id = _snowflake_int(target.thread or target.chat)
        if channel_id is None:
            raise DeliveryError(f"discord: not a channel id: {_cut(target.thread or target.chat)!r}", permanent=True)
        return client.get_partial_messageable(channel_id)

    async def thread_in_chat(self, chat: str, thread: str) -> bool:
        """Whether `thread` is a thread of the channel `chat`. A Discord thread is a channel of its own:
        unchecked, a target's thread part could name any channel or DM the bot can post to. Known from
        a message seen there, else from discord.py's cache or Discord (`_place`)."""
        if _snowflake_int(chat) is None or _snowflake_int(thread) is None or chat == thread:
            return False
        if _where_of(self._seen.get(thread)) == (chat, thread, "group"):
            return True
        return await self._place(int(thread)) == (chat, thread, "group")

    async def send(self, target: Target, text: str) -> list[str]:
        return [await self._post(target, text, None)]

    async def find_posted(self, target: Target, since: float, text: str) -> list[str] | None:
        """The bot's message since `since` with this part's nonce or this text: asked before a
        repeat past the nonce window, where Discord would post the part a second time."""
        channel = self._channel(target)
        nonce = nonce_for(target.key) if target.key else None
        after = discord.Object(id=discord.utils.time_snowflake(datetime.fromtimestamp(since - 2.0, tz=UTC)))
        found: list[str] = []

        async def look() -> None:
            async for m in channel.history(limit=FIND_POSTED_LIMIT, after=after, oldest_first=True):
                mine = self.bot_user_id is not None and m.author.id == self.bot_user_id
                if mine and ((nonce is not None and str(m.nonce) == nonce) or m.content == text):
                    found.append(str(m.id))
                    return

        await self._rest("find", asyncio.wait_for(look(), FETCH_TIMEOUT_S))
        return found or None

    async def _post(self, target: Target, text: str, components: list[dict[str, Any]] | None) -> str:
        """`POST channels/{id}/messages` through discord.py's HTTP client (its rate limiting included),
        with the payload written out here so that `enforce_nonce` is sent whatever the discord.py 2.x."""
        channel = self._channel(target)
        if target.thread is not None and not await self.thread_in_chat(target.chat, target.thread):
            raise DeliveryError(f"discord: {_cut(target.thread)} is not a thread of channel {_cut(target.chat)}",
                                permanent=True)  # fmt: skip
        payload: dict[str, Any] = {"content": text, "allowed_mentions": {"parse": []}}
        if target.key:
            payload["nonce"] = nonce_for(target.key)
            payload["enforce_nonce"] = True
        if target.reply_to and _snowflake(target.reply_to) and not _is_dm(self, target):
            payload["message_reference"] = {
                "message_id": target.reply_to,
                "channel_id": str(channel.id),
                "fail_if_not_exists": False,
            }
        if components is not None:
            payload["components"] = components
        route = discord.http.Route("POST", "/channels/{channel_id}/messages", channel_id=channel.id)
        # Bounded, so a repeat after a lost answer comes well within the nonce's few minutes
        # (aiohttp's own limit is 5 minutes); discord.py sleeps out rate limits up to 30 s in it.
        request = asyncio.wait_for(channel._state.http.request(route, json=payload), SEND_TIMEOUT_S)
        data = await self._rest("send", request)
        message_id = data.get("id") if isinstance(data, dict) else None
        if not message_id:
            raise DeliveryError("discord send: answered without a message id")
        return str(message_id)

    async def edit(self, target: Target, message_id: str, text: str) -> None:
        channel = self._channel(target)
        kwargs: dict[str, Any] = {"content": text, "allowed_mentions": discord.AllowedMentions.none()}
        short_id = self._prompts.get((str(channel.id), message_id))
        if short_id is not None and f"/approve {short_id}" not in text:
            kwargs["view"] = None  # decided: the buttons go away
            self._prompts.pop((str(channel.id), message_id), None)
        await self._rest("edit", channel.get_partial_message(_message_id(message_id)).edit(**kwargs))

    async def edit_prompt(self, target: Target, message_id: str, text: str, short_id: str | None) -> None:
        """Edit an approval prompt: its buttons stay while `short_id` is pending and go once decided
        (None), also for a prompt posted before a restart (which this process never saw)."""
        channel = self._channel(target)
        kwargs: dict[str, Any] = {"content": text, "allowed_mentions": discord.AllowedMentions.none()}
        if short_id is None:
            kwargs["view"] = None
        await self._rest("edit", channel.get_partial_message(_message_id(message_id)).edit(**kwargs))
        if short_id is None:
            self._prompts.pop((str(channel.id), message_id), None)

    async def react(self, target: Target, message_id: str, emoji: str) -> None:
        channel = self._channel(target)
        await self._rest("react", channel.get_partial_message(_message_id(message_id)).add_reaction(emoji))

    async def typing(self, target: Target) -> None:
        channel = self._channel(target)
        await self._rest("typing", channel._state.http.send_typing(channel.id))

    def format(self, text: str) -> str:
        return to_discord(text)

    @staticmethod
    def prompt_length(text: str) -> int:
        """An approval prompt's Markdown as posted (`to_discord`), in UTF-16 units: never fewer than
        Discord counts, so a prompt (pending or decided) is never refused as too long."""
        return len(to_discord(text).encode("utf-16-le")) // 2

    async def prompt_approval(self, target: Target, text: str, short_id: str) -> list[str]:
        """The prompt with Approve / Deny buttons; a press comes back as `/approve ID` / `/deny ID`."""
        buttons = [
            {"type": 2, "style": 3, "label": "Approve", "custom_id": f"approve:{short_id}"},
            {"type": 2, "style": 4, "label": "Deny", "custom_id": f"deny:{short_id}"},
        ]
        mid = await self._post(target, to_discord(text), [{"type": 1, "components": buttons}])
        self._prompts[(str(target.thread or target.chat), mid)] = short_id
        return [mid]


def nonce_for(key: str) -> str:
    """A Discord nonce (at most 25 characters) that is the same for the same reply part."""
    return hashlib.sha256(key.encode()).hexdigest()[:NONCE_LENGTH]


def _snowflake(text: str) -> bool:
    """A Discord id as text: ASCII digits (`str.isdigit` alone also takes `٥` and `²`), at most
    a 64-bit number's 20 (int() refuses a few thousand with its own ValueError)."""
    return text.isascii() and text.isdigit() and len(text) <= MAX_SNOWFLAKE_DIGITS


def _snowflake_int(value: object) -> int | None:
    """A Discord id (text, as the state file and the gateway hold them) as a number; None when it is none."""
    return int(value) if isinstance(value, str) and _snowflake(value) else None


def _where_of(entry: Any) -> tuple[str, str | None, str] | None:
    """(chat, thread, chat_type) as a saved catch-up entry says, or None when it does not say it in
    the shape this adapter writes (Discord ids as text, `thread` an id or null, `dm` or `group`)."""
    if not isinstance(entry, dict):
        return None
    chat, thread, chat_type = entry.get("chat"), entry.get("thread"), entry.get("chat_type")
    if _snowflake_int(chat) is None or chat_type not in ("dm", "group"):
        return None
    if thread is not None and _snowflake_int(thread) is None:
        return None
    return str(chat), thread, str(chat_type)


def _catch_up_start(entry: dict[str, Any]) -> int:
    """The id a channel's catch-up fetches after: before its oldest message not recorded, else
    before its unfetched gap, else after its newest recorded one, whichever is earliest."""
    failed = [n for n in map(_snowflake_int, entry.get("failed") or []) if n is not None]
    starts = [min(failed) - 1 if failed else _snowflake_int(entry.get("last")) or 0]
    gap = _snowflake_int(entry.get("gap"))
    if gap is not None:
        starts.append(gap)
    return min(starts)


def _due(gate: _Gate) -> bool:
    """A planned channel that can be fetched now (not being fetched, not waiting to try again)."""
    return gate.entry is not None and not gate.running and gate.retry is None


async def _next_within(messages: AsyncIterator[discord.Message], seconds: float) -> discord.Message | None:
    """The next message of a history (None at its end), its page waited for at most `seconds`: a
    `TimeoutError` then, so the caller moves on instead of waiting out discord.py's own retries."""
    try:
        return await asyncio.wait_for(anext(messages, None), seconds)
    except TimeoutError:
        raise TimeoutError(f"no answer within {seconds:g} s") from None


def _retry_after(exc: BaseException) -> float:
    """The wait Discord asked for with a 429 (that discord.py gave up sleeping out), else 0."""
    if isinstance(exc, discord.RateLimited):
        return _bounded(exc.retry_after)
    if isinstance(exc, discord.HTTPException) and exc.status == 429 and exc.response is not None:
        return _bounded(exc.response.headers.get("Retry-After"))
    return 0.0


def _message_id(value: str) -> int:
    """A message id to edit or react to; a permanent DeliveryError when it is no Discord id."""
    number = _snowflake_int(value)
    if number is None:
        raise DeliveryError(f"discord: not a message id: {_cut(value)!r}", permanent=True)
    return number


def _cut(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[:limit] + "…"


def _is_dm(adapter: DiscordAdapter, target: Target) -> bool:
    """Whether `target` is a DM (no reply reference there): from discord.py's cache, else from the
    channels this adapter has seen."""
    client = adapter._client
    if client is not None and _snowflake(target.chat):
        cached = client.get_channel(int(target.chat))
        if cached is not None:
            return isinstance(cached, discord.DMChannel | discord.GroupChannel)
    entry = adapter._seen.get(str(target.thread or target.chat))
    return entry is not None and entry.get("chat_type") == "dm"


class _PressAnswer:
    """Discord's answer to one button press: the deferred update (type 6) once the press is recorded,
    or at `PRESS_ACK_S` when the record is slower than that; sent once, whoever asks first. A press
    that could not be recorded gets, instead, a note only the presser sees (a followup when it was
    acknowledged already): never silence while the prompt still waits. The acknowledgement is given
    up at the end of Discord's window (`PRESS_WINDOW_S` from the press): discord.py would otherwise
    retry a 5xx or sleep out a 429 for up to 30 s, and the gateway applies the press (and the
    channel's next messages wait) only once `defer` returns."""

    def __init__(self, interaction: discord.Interaction, log: Any, where: str) -> None:
        self._interaction = interaction
        self._log = log
        self._where = where
        self._deferred: asyncio.Task[bool] | None = None
        self._window_ends = asyncio.get_running_loop().time() + PRESS_WINDOW_S

    async def defer(self) -> None:
        """Acknowledge the press (the gateway's `ack`): never raises, a failure is logged."""
        await self._defer_once()

    def defer_late(self) -> None:
        """`PRESS_ACK_S` after the press and not recorded yet: acknowledged before Discord fails it."""
        if self._deferred is None:
            self._log.warning(
                "%s: button press %s not recorded within %g s; acknowledged before it is",
                self._where,
                self._interaction.id,
                PRESS_ACK_S,
            )
            self._defer_once()

    def _defer_once(self) -> asyncio.Task[bool]:
        if self._deferred is None:
            self._deferred = asyncio.ensure_future(self._send_defer())
        return self._deferred

    async def _send_defer(self) -> bool:
        bound = max(self._window_ends - asyncio.get_running_loop().time(), PRESS_ACK_MIN_S)
        try:
            # type 6: deferred update, the gateway edits the prompt
            await asyncio.wait_for(self._interaction.response.defer(), bound)
        except (
            TimeoutError,
            discord.HTTPException,
            discord.InteractionResponded,
            OSError,
            aiohttp.ClientError,
        ) as exc:
            self._log.warning(
                "%s: could not acknowledge interaction %s within Discord's %g s: %s: %s",
                self._where,
                self._interaction.id,
                PRESS_WINDOW_S,
                type(exc).__name__,
                exc,
            )
            return False
        return True

    async def not_recorded(self) -> None:
        """Tell the presser the press was not taken: the answer itself (Discord shows no failure, the
        note says to press again), or a followup when the press was acknowledged already."""
        interaction = self._interaction
        try:
            if self._deferred is None:
                await interaction.response.send_message(PRESS_NOT_RECORDED, ephemeral=True)
            else:
                await self._deferred
                await interaction.followup.send(PRESS_NOT_RECORDED, ephemeral=True)
        except (discord.HTTPException, discord.InteractionResponded, OSError, aiohttp.ClientError) as exc:
            self._log.warning(
                "%s: could not tell the presser of interaction %s to press again: %s", self._where, interaction.id, exc
            )


class _TokenRefused(DeliveryError):
    """Discord refused the bot token on a REST call (401)."""


async def _call(op: str, awaitable: Any) -> Any:
    try:
        return await awaitable
    except discord.RateLimited as exc:
        raise DeliveryError(f"discord {op}: rate limited", retry_after=_bounded(exc.retry_after)) from None
    except discord.Forbidden as exc:
        raise DeliveryError(f"discord {op}: {_said(403, exc.text, 'Forbidden')}", permanent=True) from None
    except discord.NotFound as exc:
        raise DeliveryError(f"discord {op}: {_said(404, exc.text, 'Not Found')}", permanent=True) from None
    except discord.HTTPException as exc:
        if exc.status == 429:
            retry = exc.response.headers.get("Retry-After") if exc.response is not None else None
            raise DeliveryError(
                f"discord {op}: {_said(429, exc.text, 'Too Many Requests')}", retry_after=_bounded(retry)
            ) from None
        if exc.status == 401:  # the token was reset in the developer portal (or is wrong)
            raise _TokenRefused(f"discord {op}: {_said(401, exc.text, 'Unauthorized')}", permanent=True) from None
        if 400 <= exc.status < 500:
            raise DeliveryError(f"discord {op}: {_said(exc.status, exc.text)}", permanent=True) from None
        raise DeliveryError(f"discord {op}: {_said(exc.status, exc.text)}") from None
    except aiohttp.ClientConnectorError as exc:  # never connected: the request was not sent
        raise DeliveryError(f"discord {op}: {type(exc).__name__}: {exc}") from None
    except (TimeoutError, OSError, aiohttp.ClientError) as exc:  # the request may have been performed
        raise DeliveryError(f"discord {op}: {type(exc).__name__}: {exc}", uncertain=True) from None


def _said(status: int, text: str | None, default: str = "") -> str:
    """The status and what Discord said, once: its message for a 401 is itself "401: Unauthorized"."""
    said = (text or default).strip()
    if said == str(status) or said.startswith(f"{status}:"):
        return said
    return f"{status} {said}".rstrip()


def _bounded(value: Any) -> float:
    try:
        seconds = float(value) if value is not None else 1.0
    except (TypeError, ValueError):
        return 1.0
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_S) if math.isfinite(seconds) else MAX_RETRY_AFTER_S


async def _close_quietly(client: discord.Client) -> None:
    with contextlib.suppress(Exception):
        await client.close()


def create_adapter(account: Account, context: AdapterContext) -> DiscordAdapter:
    """The plugin entry point (see `plugins.contract`)."""
    return DiscordAdapter(account, context)
