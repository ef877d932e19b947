"""A loopback fake of Discord: the REST API (`/api/v10`) and the gateway WebSocket, for the real discord.py.

A real HTTP + WebSocket server (starlette + uvicorn) on 127.0.0.1, on an ephemeral port, running its
own event loop in a background thread (like tests/fakes/slack_api.py), so sync tests, async tests and
subprocesses (`appserver serve` and its gateway child) all talk to it.

    with FakeDiscord() as discord:
        settings = {"api_url": discord.api_url, "gateway_url": discord.gateway_url, ...}
        mid = discord.inject_dm("42", "hello")
        discord.wait_for_text(discord.dm_channel("42"), lambda t: "hi" in t)

REST, as Discord answers it (`Content-Type: application/json` exactly, which discord.py checks, and
`Via: 1.1 google`, without which discord.py takes a 429 for a Cloudflare ban):
`GET users/@me` (401 for a wrong `Authorization: Bot <token>`), `GET oauth2/applications/@me`,
`GET gateway/bot`, `POST channels/{id}/messages` (JSON; `nonce` + `enforce_nonce`: the same nonce in the
same channel within `nonce_window` seconds answers the message it created, no second one; a nonce longer
than 25 characters is a 400), `PATCH channels/{id}/messages/{mid}`, `GET channels/{id}/messages?after=`
(oldest first after the id; Discord answers newest first, and so does the fake), reactions
(`PUT …/reactions/{emoji}/@me`), `POST channels/{id}/typing`, `POST interactions/{id}/{token}/callback`
(types 4, 6, 7), and attachment bytes at `/attachments/{id}/{name}` (the CDN). Errors: 403 Missing
Permissions (50013) for a channel marked `forbid`, 404 Unknown Channel (10003) / Unknown Message (10008),
429 with `retry_after` (body) and `X-RateLimit-Global` / `global` for `fail_next(..., status=429)`.

Gateway (`?v=10&encoding=json`, text frames): op 10 HELLO → op 2 IDENTIFY (token and intents checked:
a wrong token closes 4004; the message content intent (1 << 15) without `message_content` enabled closes
4014, as Discord does for a privileged intent not enabled in the portal) → READY (with `session_id`,
`resume_gateway_url`) then one GUILD_CREATE per guild. Heartbeats (op 1) are answered with op 11.
Dispatches carry increasing sequence numbers and are kept per session: after `drop()` the client sends
op 6 RESUME and the fake replays what it missed, then RESUMED. `invalidate()` sends op 9 (d=false): the
client IDENTIFYs again and gets a new session; what happened meanwhile is not replayed (catch-up is the
client's job, with `GET messages?after=`). `hold()` keeps new sockets waiting before HELLO (an outage),
`release()` ends it; `hold_history()` keeps `GET messages` waiting (a slow catch-up), `release_history()`
ends that.

Test side: `inject_dm`, `inject_guild_message` (`mention=True` adds the bot to `mentions`;
`mention_role=True` mentions the bot's managed role, which GUILD_CREATE lists with `tags.bot_id`; `reply_to` a
message id sets `message_reference` + `referenced_message`; `thread=` a thread id created by
`add_thread`), `add_attachment` (`slow_attachments(s)` answers the bytes only after `s` seconds),
`click` (an INTERACTION_CREATE for a button); inspection with
`messages(channel)` (what the bot posted, with every edit), `calls()`, `interaction_callbacks()`,
`identifies` / `resumes` / `connections`; `fail_next` (`clear_failures`), `forbid`, `delay_next_post` (the
POST is recorded, its answer held back: a kill -9 lands between the platform's accept and the ledger write).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from urllib.parse import unquote

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from tests.fakes.loopback import WEBSOCKET_OPTIONS, LoopbackServer, first_match

DISCORD_EPOCH_MS = 1420070400000
MESSAGE_CONTENT_INTENT = 1 << 15
MAX_CONTENT = 2000
NONCE_MAX = 25


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    # Discord's API answers through Google's front end (`Via: 1.1 google`); discord.py takes a 429
    # without it for a Cloudflare ban and does not retry.
    headers = {"Via": "1.1 google", **(headers or {})}
    return Response(json.dumps(body), status_code=status, media_type="application/json", headers=headers)


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat()


@dataclass(slots=True)
class Call:
    """One REST call as the fake saw it."""

    method: str
    path: str
    body: Any
    status: int
    t: float  # time.monotonic() when answered
    channel: str | None = None


@dataclass(slots=True)
class BotMessage:
    """A message the bot posted, as it currently reads."""

    id: str
    channel: str
    content: str
    payload: dict[str, Any]
    nonce: str | None = None
    components: list[dict[str, Any]] = field(default_factory=list)
    edits: int = 0
    history: list[str] = field(default_factory=list)
    allowed_mentions: Any = None
    reference: str | None = None


@dataclass(slots=True)
class _Failure:
    status: int
    retry_after: float
    is_global: bool
    count: int


@dataclass(slots=True)
class _Session:
    id: str
    seq: int = 0
    log: list[dict[str, Any]] = field(default_factory=list)  # every dispatch, with "s"
    sock: _Socket | None = None


@dataclass(slots=True)
class _Socket:
    n: int
    ws: WebSocket
    session: _Session | None = None
    closed: bool = False


class FakeDiscord(LoopbackServer):
    """The fake Discord. Every public method is thread-safe and callable from sync code."""

    _label = "fake discord"
    _thread_name = "fakediscord"
    _server_options = WEBSOCKET_OPTIONS

    def __init__(
        self,
        *,
        token: str = "fake.discord.token",
        bot_id: str = "100000000000000001",
        bot_name: str = "appbot",
        guild_id: str = "200000000000000001",
        bot_role_id: str = "200000000000000777",
        message_content: bool = True,
        heartbeat_ms: int = 2000,
        nonce_window: float = 300.0,
    ) -> None:
        super().__init__()
        self.token = token
        self.bot_id = bot_id
        self.bot_name = bot_name
        self.guild_id = guild_id
        self.bot_role_id = bot_role_id  # the bot's managed role (tags.bot_id), as Discord makes one on invite
        self.message_content = message_content
        self.heartbeat_ms = heartbeat_ms
        self.nonce_window = nonce_window
        self._lock = threading.Lock()
        self._counter = itertools.count(1)
        self._channels: dict[str, dict[str, Any]] = {}
        self._dm_of: dict[str, str] = {}
        self._history: dict[str, list[dict[str, Any]]] = {}  # channel -> every message, oldest first
        self._bot_messages: dict[str, BotMessage] = {}
        self._order: list[BotMessage] = []
        self._nonces: dict[tuple[str, str], tuple[str, float]] = {}
        self._calls: list[Call] = []
        self._callbacks: list[tuple[str, dict[str, Any]]] = []
        self._reactions: dict[tuple[str, str], list[str]] = {}
        self._typing: list[str] = []
        self._failures: dict[str, list[_Failure]] = {}
        self._forbidden: set[str] = set()
        self._post_delay: float = 0.0
        self._attachments: dict[str, bytes] = {}
        self._attachment_delay = 0.0  # seconds before attachment bytes are answered (slow_attachments)
        self._session: _Session | None = None
        self._socket: _Socket | None = None
        self._sockets_total = 0
        self._held: list[asyncio.Future[None]] = []
        self._holding = False
        self._history_held: list[asyncio.Future[None]] = []
        self._holding_history = False
        self.identifies = 0
        self.resumes = 0
        self.heartbeats = 0
        self.bot_user = {
            "id": bot_id,
            "username": bot_name,
            "discriminator": "0",
            "avatar": None,
            "global_name": None,
            "bot": True,
            "verified": True,
            "mfa_enabled": False,
            "flags": 0,
        }
        self.add_text_channel("300000000000000001", "general")

    # ------------------------------------------------------------------ lifecycle

    def _routes(self) -> list[BaseRoute]:
        return [
            Route("/api/v10/{path:path}", self._rest, methods=["GET", "POST", "PATCH", "PUT", "DELETE"]),
            Route("/attachments/{aid}/{name}", self._attachment, methods=["GET"]),
            WebSocketRoute("/gateway/", self._ws),
            WebSocketRoute("/resume/", self._ws),
        ]

    def _before_stop(self) -> None:
        self.release()
        self.release_history()
        self._run_on_loop(self._close_socket(self._socket, 1000))

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api/v10"

    @property
    def gateway_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/gateway/"

    # ------------------------------------------------------------------ test side: the world

    def snowflake(self) -> str:
        with self._lock:
            n = next(self._counter)
        return str(((int(time.time() * 1000) - DISCORD_EPOCH_MS) << 22) | (n & 0x3FFFFF))

    def add_text_channel(self, channel_id: str, name: str) -> str:
        with self._lock:
            self._channels[channel_id] = {"id": channel_id, "type": 0, "name": name, "guild_id": self.guild_id,
                                          "position": len(self._channels), "permission_overwrites": [],
                                          "nsfw": False, "parent_id": None, "topic": None, "last_message_id": None,
                                          "rate_limit_per_user": 0}  # fmt: skip
        return channel_id

    def add_thread(self, parent: str, name: str = "a thread", *, announce: bool = True) -> str:
        """A public thread under `parent` (a THREAD_CREATE dispatch goes out unless `announce` is False:
        the client then first learns of it from a message in it); returns its id."""
        tid = self.snowflake()
        thread = {"id": tid, "type": 11, "name": name, "guild_id": self.guild_id, "parent_id": parent,
                  "owner_id": "1", "member_count": 1, "message_count": 0, "rate_limit_per_user": 0, "flags": 0,
                  "thread_metadata": {"archived": False, "auto_archive_duration": 1440, "locked": False,
                                      "archive_timestamp": _iso(time.time())}, "newly_created": True}  # fmt: skip
        with self._lock:
            self._channels[tid] = thread
        if announce:
            self._dispatch("THREAD_CREATE", thread)
        return tid

    def dm_channel(self, user: str) -> str:
        with self._lock:
            if user not in self._dm_of:
                cid = str(400000000000000000 + int(user) % 10**15)
                self._dm_of[user] = cid
                self._channels[cid] = {"id": cid, "type": 1, "recipients": [self._user(user)], "last_message_id": None}
            return self._dm_of[user]

    def add_attachment(self, name: str, data: bytes, content_type: str = "image/png") -> dict[str, Any]:
        aid = self.snowflake()
        with self._lock:
            self._attachments[aid] = data
        url = f"http://127.0.0.1:{self.port}/attachments/{aid}/{name}"
        att: dict[str, Any] = {"id": aid, "filename": name, "size": len(data), "url": url, "proxy_url": url,
                               "content_type": content_type}  # fmt: skip
        if content_type.startswith("image/"):
            att.update(width=1, height=1)
        return att

    def slow_attachments(self, seconds: float) -> None:
        """Answer every attachment download (the CDN) only after `seconds`; 0 ends it."""
        with self._lock:
            self._attachment_delay = max(0.0, seconds)

    def _user(self, user: str, name: str | None = None, bot: bool = False) -> dict[str, Any]:
        return {"id": user, "username": name or f"user{user[-4:]}", "discriminator": "0", "avatar": None,
                "global_name": name, "bot": bot}  # fmt: skip

    def inject_dm(
        self, user: str, text: str, *, name: str | None = None, attachments: list[dict[str, Any]] | None = None,
        bot: bool = False,
    ) -> str:  # fmt: skip
        """`user` writes `text` to the bot in a DM; returns the message id."""
        channel = self.dm_channel(user)
        return self._inject(user, text, channel, None, name=name, attachments=attachments, bot=bot)

    def inject_guild_message(
        self, user: str, text: str, *, channel: str = "300000000000000001", mention: bool = False,
        reply_to: str | None = None, name: str | None = None, attachments: list[dict[str, Any]] | None = None,
        bot: bool = False, message_type: int | None = None, mention_role: bool = False,
    ) -> str:  # fmt: skip
        """A message in a guild text channel or thread (`channel`); `mention` writes `<@bot>` into it and
        adds the bot to `mentions`; `mention_role` writes `<@&role>` of the bot's managed role into it
        and adds the role to `mention_roles` (what Discord's autocomplete often inserts for a bot);
        `reply_to` makes it a reply; `message_type` makes it a system notice of that type (4: channel
        renamed, 18: thread created, …). Returns the message id."""
        if mention:
            text = f"<@{self.bot_id}> {text}"
        if mention_role:
            text = f"<@&{self.bot_role_id}> {text}"
        return self._inject(user, text, channel, self.guild_id, name=name, attachments=attachments, bot=bot,
                            mention=mention, reply_to=reply_to, message_type=message_type,
                            mention_roles=[self.bot_role_id] if mention_role else [])  # fmt: skip

    def _inject(
        self, user: str, text: str, channel: str, guild: str | None, *, name: str | None,
        attachments: list[dict[str, Any]] | None, bot: bool, mention: bool = False, reply_to: str | None = None,
        message_type: int | None = None, mention_roles: list[str] | None = None,
    ) -> str:  # fmt: skip
        mid = self.snowflake()
        msg: dict[str, Any] = {
            "id": mid, "channel_id": channel, "author": self._user(user, name, bot), "content": text,
            "timestamp": _iso(time.time()), "edited_timestamp": None, "tts": False, "mention_everyone": False,
            "mentions": [self.bot_user] if mention else [], "mention_roles": list(mention_roles or []),
            "attachments": attachments or [],
            "embeds": [], "pinned": False, "type": 0, "flags": 0, "components": [],
        }  # fmt: skip
        if reply_to is not None:
            ref = self._find(channel, reply_to)
            msg["type"] = 19
            msg["message_reference"] = {"message_id": reply_to, "channel_id": channel, "type": 0}
            if guild:
                msg["message_reference"]["guild_id"] = guild
            msg["referenced_message"] = ref
        if message_type is not None:
            msg["type"] = message_type
        with self._lock:
            self._history.setdefault(channel, []).append(msg)
            if channel in self._channels:
                self._channels[channel]["last_message_id"] = mid  # as GUILD_CREATE then reports it
        event = dict(msg)
        if guild is not None:
            event["guild_id"] = guild
            event["member"] = {"roles": [], "joined_at": _iso(time.time()), "deaf": False, "mute": False,
                               "flags": 0}  # fmt: skip
        self._dispatch("MESSAGE_CREATE", event)
        return mid

    def _find(self, channel: str, mid: str) -> dict[str, Any] | None:
        with self._lock:
            return next((m for m in self._history.get(channel, []) if m["id"] == mid), None)

    def click(self, user: str, channel: str, message_id: str, custom_id: str, *, name: str | None = None) -> str:
        """`user` presses the button `custom_id` on the bot's message; returns the interaction id."""
        iid = self.snowflake()
        with self._lock:
            ch = dict(self._channels.get(channel) or {"id": channel, "type": 0})
            bm = self._bot_messages.get(message_id)
            message = dict(bm.payload) if bm else None
        data: dict[str, Any] = {
            "id": iid, "application_id": self.bot_id, "type": 3, "token": f"itoken-{iid}", "version": 1,
            "channel_id": channel, "channel": ch, "data": {"custom_id": custom_id, "component_type": 2},
            "locale": "en-US", "app_permissions": "0", "attachment_size_limit": 10 << 20, "entitlements": [],
            "authorizing_integration_owners": {}, "context": 0 if ch.get("guild_id") else 1,
        }  # fmt: skip
        if message is not None:
            data["message"] = message
        if ch.get("guild_id"):
            data["guild_id"] = ch["guild_id"]
            data["member"] = {"user": self._user(user, name), "roles": [], "joined_at": _iso(time.time()),
                              "deaf": False, "mute": False, "flags": 0, "permissions": "0"}  # fmt: skip
        else:
            data["user"] = self._user(user, name)
        self._dispatch("INTERACTION_CREATE", data)
        return iid

    # ------------------------------------------------------------------ test side: failures

    def fail_next(self, kind: str, *, status: int = 429, retry_after: float = 1.0, is_global: bool = False,
                  count: int = 1, channel: str | None = None) -> None:  # fmt: skip
        """The next `count` REST calls of `kind` ("POST messages", "PATCH messages", …) fail with `status`
        (429: with `retry_after` and the global flag); with `channel`, only calls in that channel
        (`clear_failures(f"{kind} in {channel}")`)."""
        key = kind if channel is None else f"{kind} in {channel}"
        with self._lock:
            self._failures.setdefault(key, []).append(_Failure(status, retry_after, is_global, count))

    def clear_failures(self, kind: str | None = None) -> None:
        """Forget the failures `fail_next` queued for `kind` (every kind when None) not used up yet."""
        with self._lock:
            if kind is None:
                self._failures.clear()
            else:
                self._failures.pop(kind, None)

    def forbid(self, channel: str, value: bool = True) -> None:
        """Sends and edits in `channel` answer 403 Missing Permissions."""
        with self._lock:
            (self._forbidden.add if value else self._forbidden.discard)(channel)

    def delay_next_post(self, seconds: float) -> None:
        """The next POST of a message is recorded at once and answered `seconds` later."""
        with self._lock:
            self._post_delay = seconds

    def drop(self) -> bool:
        """Close the gateway socket abruptly (code 4000): the session stays resumable."""
        sock = self._socket
        if sock is None:
            return False
        self._run_on_loop(self._close_socket(sock, 4000))
        return True

    def invalidate(self) -> bool:
        """Send op 9 (not resumable): the client must IDENTIFY again; the session is forgotten."""
        sock = self._socket
        with self._lock:
            self._session = None
        if sock is None:
            return False
        self._run_on_loop(self._send(sock, {"op": 9, "d": False, "s": None, "t": None}))
        return True

    def hold(self) -> None:
        """An outage: new sockets wait before HELLO until `release()`."""
        with self._lock:
            self._holding = True

    def release(self) -> None:
        with self._lock:
            self._holding = False
            held, self._held = self._held, []
        loop = self._loop
        if loop is not None and not loop.is_closed():
            for fut in held:
                loop.call_soon_threadsafe(_resolve, fut)

    def hold_history(self) -> None:
        """`GET channels/{id}/messages` (a catch-up's fetch) waits until `release_history()`, then is
        answered with the history as it is then."""
        with self._lock:
            self._holding_history = True

    def release_history(self) -> None:
        with self._lock:
            self._holding_history = False
            held, self._history_held = self._history_held, []
        loop = self._loop
        if loop is not None and not loop.is_closed():
            for fut in held:
                loop.call_soon_threadsafe(_resolve, fut)

    # ------------------------------------------------------------------ test side: inspection

    def messages(self, channel: str) -> list[BotMessage]:
        with self._lock:
            return [_copy(m) for m in self._order if m.channel == channel]

    def calls(self, kind: str | None = None, *, channel: str | None = None) -> list[Call]:
        with self._lock:
            return [c for c in self._calls
                    if (kind is None or f"{c.method} {c.path}".startswith(kind) or _kind(c.method, c.path) == kind)
                    and (channel is None or c.channel == channel)]  # fmt: skip

    def interaction_callbacks(self) -> list[tuple[str, dict[str, Any]]]:
        with self._lock:
            return list(self._callbacks)

    def reactions(self, channel: str, mid: str) -> list[str]:
        with self._lock:
            return list(self._reactions.get((channel, mid), []))

    def typing(self) -> list[str]:
        with self._lock:
            return list(self._typing)

    @property
    def connections(self) -> int:
        with self._lock:
            return self._sockets_total

    @property
    def connected(self) -> bool:
        sock = self._socket
        return sock is not None and not sock.closed and sock.session is not None

    def wait_for_text(self, channel: str, predicate: str | Callable[[str], bool], timeout: float = 5.0) -> BotMessage:
        find = first_match(lambda: self.messages(channel), predicate, lambda m: m.content)

        try:
            return self.wait_for(find, timeout, f"text in {channel}")
        except TimeoutError:
            seen = [m.content for m in self.messages(channel)]
            raise TimeoutError(
                f"fake discord: no bot message in {channel} matched in {timeout} s; saw {seen!r}"
            ) from None

    # ------------------------------------------------------------------ plumbing

    async def _send(self, sock: _Socket, frame: dict[str, Any]) -> bool:
        if sock.closed:
            return False
        try:
            await sock.ws.send_text(json.dumps(frame))
        except Exception:  # noqa: BLE001 - the socket went away
            return False
        return True

    async def _close_socket(self, sock: _Socket | None, code: int) -> None:
        if sock is None or sock.closed:
            return
        sock.closed = True
        with self._lock:
            if self._socket is sock:
                self._socket = None
        with contextlib.suppress(Exception):
            await sock.ws.close(code=code)

    def dispatch_raw(self, event: str, data: dict[str, Any]) -> None:
        """Send a gateway event as given, however malformed (what a client must survive)."""
        self._dispatch(event, data)

    def _dispatch(self, event: str, data: dict[str, Any]) -> None:
        """Give `event` a sequence number in the current session and send it if a socket is on it."""
        with self._lock:
            session = self._session
            if session is None:
                return  # nobody identified: lost (catch-up is the client's job)
            session.seq += 1
            frame = {"op": 0, "t": event, "s": session.seq, "d": data}
            session.log.append(frame)
            sock = session.sock
        if sock is not None and not sock.closed:
            loop = self._loop
            if loop is not None and not loop.is_closed():
                asyncio.run_coroutine_threadsafe(self._send(sock, frame), loop)

    def _guild_create(self) -> dict[str, Any]:
        with self._lock:
            channels = [dict(c) for c in self._channels.values() if c.get("type") == 0]
            threads = [dict(c) for c in self._channels.values() if c.get("type") == 11]
        return {
            "id": self.guild_id, "name": "Fake Guild", "unavailable": False, "icon": None, "owner_id": "1",
            "channels": channels, "threads": threads, "members": [], "roles": [
                {"id": self.guild_id, "name": "@everyone", "permissions": "104324673", "position": 0, "color": 0,
                 "hoist": False, "managed": False, "mentionable": False, "flags": 0},
                {"id": self.bot_role_id, "name": self.bot_name, "permissions": "0", "position": 1, "color": 0,
                 "hoist": False, "managed": True, "mentionable": False, "flags": 0,
                 "tags": {"bot_id": self.bot_id}}],
            "member_count": 2, "emojis": [], "stickers": [], "voice_states": [], "presences": [], "large": False,
            "joined_at": _iso(time.time()), "features": [], "verification_level": 0, "default_message_notifications": 0,
            "explicit_content_filter": 0, "mfa_level": 0, "premium_tier": 0, "preferred_locale": "en-US",
            "nsfw_level": 0, "system_channel_flags": 0, "stage_instances": [], "guild_scheduled_events": [],
        }  # fmt: skip

    async def _ws(self, websocket: WebSocket) -> None:
        await websocket.accept()
        with self._lock:
            self._sockets_total += 1
            sock = _Socket(self._sockets_total, websocket)
            old, self._socket = self._socket, sock
            holding = self._holding
            fut: asyncio.Future[None] | None = None
            if holding:
                fut = asyncio.get_running_loop().create_future()
                self._held.append(fut)
        if old is not None:
            await self._close_socket(old, 4000)
            with self._lock:
                self._socket = sock
        if fut is not None:
            await fut
        await self._send(sock, {"op": 10, "d": {"heartbeat_interval": self.heartbeat_ms}, "s": None, "t": None})
        try:
            while True:
                raw = await websocket.receive_text()
                try:
                    frame = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(frame, dict):
                    await self._on_frame(sock, frame)
        except (WebSocketDisconnect, RuntimeError):
            pass
        finally:
            sock.closed = True
            with self._lock:
                if self._socket is sock:
                    self._socket = None
                if sock.session is not None and sock.session.sock is sock:
                    sock.session.sock = None

    async def _on_frame(self, sock: _Socket, frame: dict[str, Any]) -> None:
        op, d = frame.get("op"), frame.get("d")
        if op == 1:
            with self._lock:
                self.heartbeats += 1
            await self._send(sock, {"op": 11, "d": None, "s": None, "t": None})
        elif op == 2 and isinstance(d, dict):
            if d.get("token") != self.token:
                await self._close_socket(sock, 4004)
                return
            intents = int(d.get("intents") or 0)
            if intents & MESSAGE_CONTENT_INTENT and not self.message_content:
                await self._close_socket(sock, 4014)
                return
            with self._lock:
                self.identifies += 1
                session = _Session(id=f"session{next(self._counter)}")
                self._session = session
                session.sock = sock
                sock.session = session
            flags = (1 << 19) if self.message_content else 0
            ready = {
                "v": 10, "user": self.bot_user, "guilds": [{"id": self.guild_id, "unavailable": True}],
                "session_id": session.id, "resume_gateway_url": f"ws://127.0.0.1:{self.port}/resume/",
                "application": {"id": self.bot_id, "flags": flags}, "private_channels": [], "relationships": [],
                "shard": [0, 1],
            }  # fmt: skip
            self._dispatch("READY", ready)
            self._dispatch("GUILD_CREATE", self._guild_create())
        elif op == 6 and isinstance(d, dict):
            with self._lock:
                current = self._session
                ok = current is not None and d.get("session_id") == current.id and d.get("token") == self.token
                if ok and current is not None:
                    # Replay what the session missed, then RESUMED, queued in order under the lock so that
                    # no new dispatch can overtake them.
                    self.resumes += 1
                    seq = int(d.get("seq") or 0)
                    current.seq += 1
                    resumed = {"op": 0, "t": "RESUMED", "s": current.seq, "d": {}}
                    replay = [f for f in current.log if f["s"] > seq] + [resumed]
                    current.log.append(resumed)
                    current.sock = sock
                    sock.session = current
                    for f in replay:
                        asyncio.ensure_future(self._send(sock, f))
            if not ok:
                await self._send(sock, {"op": 9, "d": False, "s": None, "t": None})

    # ------------------------------------------------------------------ REST

    def _take_failure(self, kind: str) -> _Failure | None:
        with self._lock:
            queue = self._failures.get(kind)
            if not queue:
                return None
            f = queue[0]
            f.count -= 1
            if f.count <= 0:
                queue.pop(0)
            return f

    async def _rest(self, request: Request) -> Response:
        path = request.path_params["path"]
        method = request.method
        raw = await request.body()
        body: Any = None
        if raw:
            try:
                body = json.loads(raw)
            except ValueError:
                body = raw.decode(errors="replace")
        parts = path.split("/")
        channel = parts[1] if len(parts) > 1 and parts[0] == "channels" else None
        kind = _kind(method, path)
        if method == "GET" and kind == "GET messages" and len(parts) == 3:
            with self._lock:
                fut: asyncio.Future[None] | None = None
                if self._holding_history:
                    fut = asyncio.get_running_loop().create_future()
                    self._history_held.append(fut)
            if fut is not None:
                await fut
        status, answer, headers, delay = self._handle(request, method, parts, body, kind)
        with self._lock:
            self._calls.append(Call(method, path, body, status, time.monotonic(), channel))
        if delay:
            await asyncio.sleep(delay)
        if status == 204:
            return Response(status_code=204)
        return _json(answer, status, headers)

    def _handle(
        self, request: Request, method: str, parts: list[str], body: Any, kind: str
    ) -> tuple[int, Any, dict[str, str] | None, float]:
        auth = request.headers.get("authorization", "")
        if auth != f"Bot {self.token}" and parts[0] != "interactions":
            return 401, {"message": "401: Unauthorized", "code": 0}, None, 0.0
        in_channel = self._take_failure(f"{kind} in {parts[1]}") if parts[0] == "channels" and len(parts) > 1 else None
        failure = in_channel or self._take_failure(kind)
        if failure is not None:
            if failure.status == 429:
                headers = {"X-RateLimit-Global": "true"} if failure.is_global else {}
                if not failure.is_global:
                    headers.update({"X-RateLimit-Limit": "5", "X-RateLimit-Remaining": "0",
                                    "X-RateLimit-Reset-After": str(failure.retry_after),
                                    "X-RateLimit-Bucket": "fakebucket", "X-RateLimit-Scope": "user"})  # fmt: skip
                headers["Retry-After"] = str(int(failure.retry_after + 0.999))
                return 429, {"message": "You are being rate limited.", "retry_after": failure.retry_after,
                             "global": failure.is_global}, headers, 0.0  # fmt: skip
            return failure.status, {"message": f"fake failure {failure.status}", "code": 0}, None, 0.0
        if parts == ["users", "@me"]:
            return 200, self.bot_user, None, 0.0
        if parts == ["oauth2", "applications", "@me"]:
            return 200, {"id": self.bot_id, "name": self.bot_name, "description": "", "icon": None,
                         "bot_public": False, "bot_require_code_grant": False, "owner": self._user("1", "owner"),
                         "verify_key": "00", "flags": (1 << 19) if self.message_content else 0, "summary": "",
                         "team": None, "bot": self.bot_user}, None, 0.0  # fmt: skip
        if parts == ["gateway", "bot"] or parts == ["gateway"]:
            return 200, {"url": f"ws://127.0.0.1:{self.port}/gateway/", "shards": 1, "session_start_limit": {
                "total": 1000, "remaining": 999, "reset_after": 0, "max_concurrency": 1}}, None, 0.0  # fmt: skip
        if parts[0] == "interactions" and len(parts) == 4 and parts[3] == "callback":
            payload = body if isinstance(body, dict) else {}
            with self._lock:
                self._callbacks.append((parts[1], payload))
            kind_ = int(payload.get("type") or 0)
            if kind_ not in (4, 5, 6, 7):
                return 400, {"message": "Invalid interaction response type", "code": 50035}, None, 0.0
            if request.query_params.get("with_response") not in ("1", "true"):
                return 204, None, None, 0.0
            answer: dict[str, Any] = {"interaction": {"id": parts[1], "type": 3, "response_message_loading": False,
                                                      "response_message_ephemeral": False}}  # fmt: skip
            return 200, answer, None, 0.0
        if parts[0] == "channels" and len(parts) >= 2:
            return self._channel_call(method, parts, body, request)
        return 404, {"message": "404: Not Found", "code": 0}, None, 0.0

    def _channel_call(
        self, method: str, parts: list[str], body: Any, request: Request
    ) -> tuple[int, Any, dict[str, str] | None, float]:
        cid = parts[1]
        with self._lock:
            known = cid in self._channels
            forbidden = cid in self._forbidden
        if not known:
            return 404, {"message": "Unknown Channel", "code": 10003}, None, 0.0
        if forbidden and method != "GET":
            return 403, {"message": "Missing Permissions", "code": 50013}, None, 0.0
        rest = parts[2:]
        if rest == [] and method == "GET":  # GET /channels/{id}: what discord.py's fetch_channel reads
            with self._lock:
                return 200, dict(self._channels[cid]), None, 0.0
        if rest == ["typing"] and method == "POST":
            with self._lock:
                self._typing.append(cid)
            return 204, None, None, 0.0
        if rest == ["messages"] and method == "GET":
            after = int(request.query_params.get("after") or 0)
            limit = int(request.query_params.get("limit") or 50)
            with self._lock:
                found = [m for m in self._history.get(cid, []) if int(m["id"]) > after][:limit]
            return 200, list(reversed(found)), None, 0.0
        if rest == ["messages"] and method == "POST":
            return self._post(cid, body if isinstance(body, dict) else {})
        if len(rest) == 2 and rest[0] == "messages" and method == "PATCH":
            return self._patch(cid, rest[1], body if isinstance(body, dict) else {})
        if len(rest) == 5 and rest[0] == "messages" and rest[2] == "reactions" and method == "PUT":
            with self._lock:
                if self._find_locked(cid, rest[1]) is None:
                    return 404, {"message": "Unknown Message", "code": 10008}, None, 0.0
                self._reactions.setdefault((cid, rest[1]), []).append(unquote(rest[3]))
            return 204, None, None, 0.0
        return 404, {"message": "404: Not Found", "code": 0}, None, 0.0

    def _find_locked(self, cid: str, mid: str) -> dict[str, Any] | None:
        return next((m for m in self._history.get(cid, []) if m["id"] == mid), None)

    def _post(self, cid: str, body: dict[str, Any]) -> tuple[int, Any, dict[str, str] | None, float]:
        content = str(body.get("content") or "")
        if len(content) > MAX_CONTENT:
            return (
                400,
                {
                    "message": "Invalid Form Body",
                    "code": 50035,
                    "errors": {
                        "content": {
                            "_errors": [{"code": "BASE_TYPE_MAX_LENGTH", "message": "Must be 2000 or fewer in length."}]
                        }
                    },
                },
                None,
                0.0,
            )
        if not content and not body.get("components"):
            return 400, {"message": "Cannot send an empty message", "code": 50006}, None, 0.0
        nonce = body.get("nonce")
        if nonce is not None and len(str(nonce)) > NONCE_MAX:
            return 400, {"message": "Invalid Form Body", "code": 50035}, None, 0.0
        now = time.monotonic()
        with self._lock:
            delay, self._post_delay = self._post_delay, 0.0
            if nonce is not None and body.get("enforce_nonce"):
                seen = self._nonces.get((cid, str(nonce)))
                if seen is not None and now - seen[1] < self.nonce_window:
                    return 200, dict(self._bot_messages[seen[0]].payload), None, delay
        mid = self.snowflake()
        payload: dict[str, Any] = {
            "id": mid, "channel_id": cid, "author": self.bot_user, "content": content,
            "timestamp": _iso(time.time()), "edited_timestamp": None, "tts": False, "mention_everyone": False,
            "mentions": [], "mention_roles": [], "attachments": [], "embeds": [], "pinned": False, "type": 0,
            "flags": 0, "components": body.get("components") or [],
        }  # fmt: skip
        ref = body.get("message_reference")
        if isinstance(ref, dict) and ref.get("message_id"):
            payload["type"] = 19
            payload["message_reference"] = {"message_id": str(ref["message_id"]), "channel_id": cid}
        if nonce is not None:
            payload["nonce"] = nonce
        with self._lock:
            guild = self._channels[cid].get("guild_id")
            bm = BotMessage(
                mid,
                cid,
                content,
                payload,
                str(nonce) if nonce is not None else None,
                list(payload["components"]),
                0,
                [content],
                body.get("allowed_mentions"),
                str(ref["message_id"]) if isinstance(ref, dict) and ref.get("message_id") else None,
            )
            self._bot_messages[mid] = bm
            self._order.append(bm)
            self._history.setdefault(cid, []).append(payload)
            self._channels[cid]["last_message_id"] = mid
            if nonce is not None and body.get("enforce_nonce"):
                self._nonces[(cid, str(nonce))] = (mid, now)
        event = dict(payload)
        if guild:
            event["guild_id"] = guild
        self._dispatch("MESSAGE_CREATE", event)  # the bot sees its own messages, as on Discord
        return 200, payload, None, delay

    def _patch(self, cid: str, mid: str, body: dict[str, Any]) -> tuple[int, Any, dict[str, str] | None, float]:
        with self._lock:
            bm = self._bot_messages.get(mid)
            if bm is None or bm.channel != cid:
                return 404, {"message": "Unknown Message", "code": 10008}, None, 0.0
            if "content" in body:
                content = str(body.get("content") or "")
                if len(content) > MAX_CONTENT:
                    return 400, {"message": "Invalid Form Body", "code": 50035}, None, 0.0
                bm.content = content
                bm.payload["content"] = content
                bm.history.append(content)
                bm.edits += 1
            if "components" in body:
                bm.components = list(body.get("components") or [])
                bm.payload["components"] = bm.components
            bm.payload["edited_timestamp"] = _iso(time.time())
            return 200, dict(bm.payload), None, 0.0

    async def _attachment(self, request: Request) -> Response:
        with self._lock:
            data = self._attachments.get(request.path_params["aid"])
            delay = self._attachment_delay
        if delay:
            await asyncio.sleep(delay)
        if data is None:
            return Response(status_code=404)
        return Response(data, media_type="application/octet-stream")


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _kind(method: str, path: str) -> str:
    parts = path.split("/")
    if parts[0] == "channels" and len(parts) >= 3:
        return f"{method} {parts[2]}"
    return f"{method} {parts[0]}"


def _copy(m: BotMessage) -> BotMessage:
    return BotMessage(m.id, m.channel, m.content, dict(m.payload), m.nonce, list(m.components), m.edits,
                      list(m.history), m.allowed_mentions, m.reference)  # fmt: skip
