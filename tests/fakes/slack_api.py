"""A loopback fake of Slack: the Web API and the Socket Mode WebSocket, for the real slack_sdk client.

A real HTTP + WebSocket server (starlette + uvicorn) on 127.0.0.1, on an ephemeral port, running its
own event loop in a background thread (like tests/fakes/fakechat.py), so sync tests, async tests and
subprocesses (`appserver serve` and its gateway child) all talk to it.

    with FakeSlack(ack_timeout=1.0) as slack:
        settings = {"api_url": slack.url, ...}            # the plugin uses f"{api_url}/api/"
        ts = slack.inject_dm("U1", "hello")                # a person writes to the bot
        slack.wait_for_text("D1", lambda t: "hi" in t)
        assert slack.acked(slack.event_id_of(ts))

Web API (`POST /api/<method>`, form, query or JSON parameters, `Authorization: Bearer <token>`), as
Slack answers it: `{"ok": true, …}` or `{"ok": false, "error": "…"}` (HTTP 200), and `ratelimited`
as HTTP 429 with `Retry-After`. Methods: `auth.test`, `apps.connections.open` (the `xapp-` app
token only; answers a `ws://` URL), `chat.postMessage` (with `metadata`: `{"event_type": …,
"event_payload": {…}}`, a dict in JSON or a JSON string in a form), `chat.update` (omitted `blocks`
are kept, `blocks: []` removes them; metadata is kept), `reactions.add`, `conversations.info`,
`conversations.history` (top-level messages, the bot's and people's, newest first; `oldest` /
`latest` / `inclusive`, `limit` + `cursor` pagination with `has_more` and
`response_metadata.next_cursor`; a message's `metadata` only with `include_all_metadata`) and
`conversations.replies` (`ts` names the thread: its parent, then the replies oldest first, same
parameters; `thread_not_found` for an unknown ts). Errors: `not_authed` (no token),
`invalid_auth` (a wrong one), `not_allowed_token_type`, `channel_not_found`, `not_in_channel`,
`message_not_found`, `already_reacted`, `msg_too_long`, `no_text`. Files: `GET /files/<id>/<name>`
(`url_private`) needs the bot token (else 403 with an HTML page, as Slack's login redirect would).

Socket Mode: on connect the fake sends `{"type": "hello"}`, then `events_api` / `interactive`
envelopes; the client acknowledges each with `{"envelope_id": …}`. An envelope not acknowledged
within `ack_timeout` (Slack: 3 s) is redelivered (a new envelope id, the same `event_id`,
`retry_attempt` + 1, `retry_reason: "timeout"`), at most `max_retries` times. One socket per app
token: a new connection closes the old one, so nothing is ever delivered to a ghost. `disconnect()`
sends `{"type": "disconnect", "reason": "refresh_requested"}`; `drop()` closes the socket abruptly.

Test side: `inject_dm` (`message.im`, with `files`, `thread_ts`, `bot_id`, `subtype`),
`inject_mention` (`app_mention`), `inject_channel_message` (`message.channels`), `inject_event` (any
inner event), `add_file` (an image or file behind `url_private`; `slow_files(s)` answers downloads
only after `s` seconds), `click` (a `block_actions` button
click as an `interactive` envelope); `messages` / `wait_for_text` (what the bot posted, with every
edit), `calls` (every Web API call with its status and time), `deliveries` / `acked` / `acks` /
`pending` (envelopes), `connections` / `open_sockets` / `wait_connected`; failures with `fail_next`
(any error, not performed; `ratelimited` as 429 + Retry-After), `perform_then_fail` (performed, then
answered with an error: JSON or an HTML page, any status) and `set_not_in_channel`; `on_delivered(hook)` runs
a hook right after an envelope went out (the kill -9 test kills the gateway there).

Web API timing and crash hooks: `hold_answers(method, seconds, count=…, channel=…)` performs the
next calls of `method` (a post is stored, visible to `messages` and the history methods) and
answers them only `seconds` later: a call that Slack performed but answered late, after the
client's timeout (`perform=False`: not performed, `internal_error` late). `on_request(method,
params)` runs when a call arrives, before the fake acts on it; `on_answer(call)` runs after the fake
acted, before the answer is written (and before a hold), so a hook that kills the client there
leaves a performed post whose answer never arrives. Both run synchronously on the fake's loop, at
their exact step; keep them quick.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from tests.fakes.loopback import WEBSOCKET_OPTIONS, LoopbackServer, first_match

BOT_METHODS = (
    "auth.test",
    "chat.postMessage",
    "chat.update",
    "reactions.add",
    "conversations.info",
    "conversations.history",
    "conversations.replies",
)
HISTORY_LIMIT = 100  # conversations.history / replies: the default page (Slack: 100, at most 999)
MAX_TEXT = 40_000  # Slack truncates beyond this; the fake refuses (msg_too_long)


@dataclass(slots=True)
class Call:
    """One Web API call as the fake saw it."""

    method: str
    params: dict[str, Any]
    status: int
    t: float  # time.monotonic() when performed (answered then, unless held: `hold_answers`)
    response: dict[str, Any]
    token: str | None

    @property
    def channel(self) -> str | None:
        ch = self.params.get("channel")
        return None if ch is None else str(ch)


@dataclass(slots=True)
class SlackMessage:
    """A message the bot posted, as it currently reads."""

    ts: str
    channel: str
    thread_ts: str | None
    text: str
    blocks: list[dict[str, Any]] = field(default_factory=list)
    edits: int = 0
    history: list[str] = field(default_factory=list)
    t_sent: float = 0.0
    metadata: dict[str, Any] | None = None  # chat.postMessage's `metadata`, as Slack keeps it


@dataclass(slots=True)
class Delivery:
    """One delivery of an envelope over a socket."""

    envelope_id: str
    event_id: str
    retry_attempt: int
    t: float
    socket: int


@dataclass(slots=True)
class _Envelope:
    event_id: str
    kind: str  # events_api | interactive
    payload: dict[str, Any]
    envelope_id: str = ""
    retry_attempt: int = 0
    sent_at: float | None = None
    acked: bool = False
    dropped: bool = False
    envelope_ids: set[str] = field(default_factory=set)
    lost_ids: set[str] = field(default_factory=set)  # acks of these deliveries never arrive (lose_ack)


@dataclass(slots=True)
class _Failure:
    error: str
    retry_after: float | None
    count: int


@dataclass(slots=True)
class _Garble:
    """A call performed, then answered with an error anyway (`perform_then_fail`)."""

    error: str
    status: int
    html: bool
    count: int


@dataclass(slots=True)
class _Hold:
    method: str
    seconds: float
    count: int
    channel: str | None
    perform: bool
    perform_after: float = 0.0


@dataclass(slots=True)
class _Socket:
    n: int
    ws: WebSocket
    closed: bool = False


class FakeSlack(LoopbackServer):
    """The fake workspace. Every public method is thread-safe and callable from sync code."""

    _label = "fake slack"
    _thread_name = "fakeslack"
    _server_options = WEBSOCKET_OPTIONS

    def __init__(
        self,
        *,
        bot_token: str = "xoxb-fake-bot",
        app_token: str = "xapp-fake-app",
        ack_timeout: float = 1.0,
        max_retries: int = 3,
        bot_user: str = "UBOT",
        bot_id: str = "BBOT",
        team: str = "T0FAKE",
    ) -> None:
        super().__init__()
        self.bot_token = bot_token
        self.app_token = app_token
        self.ack_timeout = ack_timeout
        self.max_retries = max_retries
        self.bot_user = bot_user
        self.bot_id = bot_id
        self.team = team
        self._lock = threading.Lock()
        self._seq = itertools.count(1)
        self._envelopes: list[_Envelope] = []
        self._deliveries: list[Delivery] = []
        self._acks: list[tuple[str, str, float]] = []  # envelope id, event id, t
        self._messages: dict[tuple[str, str], SlackMessage] = {}
        self._order: list[SlackMessage] = []
        self._inbound: set[tuple[str, str]] = set()  # (channel, ts) of people's messages
        self._inbound_events: dict[tuple[str, str], dict[str, Any]] = {}  # the same, as their events
        self._holds: list[_Hold] = []
        # Crash hooks (see the module docstring): quick, synchronous, each at its exact step.
        self.on_request: Callable[[str, dict[str, Any]], None] | None = None
        self.on_answer: Callable[[Call], None] | None = None
        self._reactions: dict[tuple[str, str], list[str]] = {}
        self._calls: list[Call] = []
        self._failures: dict[str, list[_Failure]] = {}
        self._garbles: dict[str, list[_Garble]] = {}
        self._not_in: set[str] = set()
        self._channels: set[str] = set()
        self._files: dict[str, bytes] = {}
        self._file_gets: list[tuple[str, str | None]] = []  # file id, token used
        self._file_delay = 0.0  # seconds before a file's bytes are answered (slow_files)
        self._sockets_total = 0
        self._socket: _Socket | None = None
        self._open: set[int] = set()
        self._on_delivered: Callable[[str, int], None] | None = None

    # ------------------------------------------------------------------ lifecycle

    def _routes(self) -> list[BaseRoute]:
        return [
            Route("/api/{method}", self._api, methods=["POST", "GET"]),
            Route("/files/{file_id}/{name}", self._file, methods=["GET"]),
            WebSocketRoute("/link/", self._ws),
        ]

    async def _serve(self) -> None:
        pump = asyncio.ensure_future(self._pump())
        try:
            await super()._serve()
        finally:
            pump.cancel()

    def _before_stop(self) -> None:
        self._run_on_loop(self._close_socket(self._socket))

    # ------------------------------------------------------------------ test side: people and events

    def _ts(self) -> str:
        return f"{time.time():.0f}.{next(self._seq):06d}"

    def inject_event(self, event: dict[str, Any]) -> str:
        """Queue an `events_api` envelope carrying `event` (an Events API inner event); returns its event_id."""
        event_id = f"Ev{uuid.uuid4().hex[:10].upper()}"
        payload = {
            "token": "verification-token",
            "team_id": self.team,
            "api_app_id": "AFAKEAPP",
            "event": event,
            "type": "event_callback",
            "event_id": event_id,
            "event_time": int(time.time()),
            "authorizations": [{"team_id": self.team, "user_id": self.bot_user, "is_bot": True}],
        }
        with self._lock:
            if "channel" in event and "ts" in event:
                self._channels.add(str(event["channel"]))
                self._inbound.add((str(event["channel"]), str(event["ts"])))
                self._inbound_events[(str(event["channel"]), str(event["ts"]))] = dict(event)
            self._envelopes.append(_Envelope(event_id, "events_api", payload))
        self._notify()
        return event_id

    def inject_dm(
        self,
        user: str,
        text: str,
        *,
        channel: str = "D1",
        thread_ts: str | None = None,
        files: list[dict[str, Any]] | None = None,
        bot_id: str | None = None,
        subtype: str | None = None,
        user_profile: dict[str, Any] | None = None,
    ) -> str:
        """`user` writes `text` in the DM `channel` (`message.im`); returns the message ts."""
        return self._message(user, text, channel, "im", thread_ts, files, bot_id, subtype, user_profile)[0]

    def inject_channel_message(
        self,
        user: str,
        text: str,
        *,
        channel: str = "C1",
        thread_ts: str | None = None,
        bot_id: str | None = None,
        subtype: str | None = None,
    ) -> str:
        """A plain channel message (`message.channels`); returns its ts."""
        return self._message(user, text, channel, "channel", thread_ts, None, bot_id, subtype, None)[0]

    def inject_mention(self, user: str, text: str, *, channel: str = "C1", thread_ts: str | None = None) -> str:
        """`user` mentions the bot in `channel` (`app_mention`; `text` should contain `<@UBOT>`); returns ts."""
        ts = self._ts()
        event: dict[str, Any] = {
            "type": "app_mention",
            "user": user,
            "text": text,
            "ts": ts,
            "channel": channel,
            "event_ts": ts,
            "team": self.team,
        }
        if thread_ts is not None:
            event["thread_ts"] = thread_ts
        self.inject_event(event)
        return ts

    def _message(
        self,
        user: str,
        text: str,
        channel: str,
        channel_type: str,
        thread_ts: str | None,
        files: list[dict[str, Any]] | None,
        bot_id: str | None,
        subtype: str | None,
        user_profile: dict[str, Any] | None,
    ) -> tuple[str, str]:
        ts = self._ts()
        event: dict[str, Any] = {
            "type": "message",
            "channel": channel,
            "user": user,
            "text": text,
            "ts": ts,
            "event_ts": ts,
            "channel_type": channel_type,
            "team": self.team,
        }
        if thread_ts is not None:
            event["thread_ts"] = thread_ts
        if files:
            event["files"] = files
            event["subtype"] = subtype or "file_share"
        elif subtype is not None:
            event["subtype"] = subtype
        if bot_id is not None:
            event["bot_id"] = bot_id
        if user_profile is not None:
            event["user_profile"] = user_profile
        return ts, self.inject_event(event)

    def add_file(self, name: str, data: bytes, mimetype: str = "image/png") -> dict[str, Any]:
        """Host a file; returns its Slack file object (for `inject_dm(files=[...])`)."""
        file_id = f"F{uuid.uuid4().hex[:9].upper()}"
        with self._lock:
            self._files[file_id] = data
        url = f"{self.url}/files/{file_id}/{name}"
        return {
            "id": file_id,
            "name": name,
            "title": name,
            "mimetype": mimetype,
            "filetype": name.rsplit(".", 1)[-1],
            "size": len(data),
            "url_private": url,
            "url_private_download": url + "?download=1",
        }

    def slow_files(self, seconds: float) -> None:
        """Answer every file download only after `seconds` (a slow file server); 0 ends it."""
        with self._lock:
            self._file_delay = max(0.0, seconds)

    def click(
        self,
        user: str,
        channel: str,
        message_ts: str,
        value: str,
        *,
        action_id: str | None = None,
        user_name: str | None = None,
    ) -> str:
        """`user` clicks a button with `value` on the bot's message `message_ts`: an `interactive`
        envelope with a `block_actions` payload. Returns the action_ts."""
        with self._lock:
            msg = self._messages.get((channel, message_ts))
            message = (
                {"type": "message", "ts": msg.ts, "text": msg.text, "blocks": msg.blocks, "bot_id": self.bot_id}
                | ({"thread_ts": msg.thread_ts} if msg.thread_ts else {})
                if msg is not None
                else {"type": "message", "ts": message_ts}
            )
        action_ts = f"{time.time():.6f}"
        container: dict[str, Any] = {
            "type": "message",
            "message_ts": message_ts,
            "channel_id": channel,
            "is_ephemeral": False,
        }
        if msg is not None and msg.thread_ts:
            container["thread_ts"] = msg.thread_ts
        name = user_name or user.lower()
        payload = {
            "type": "block_actions",
            "user": {"id": user, "username": name, "name": name, "team_id": self.team},
            "api_app_id": "AFAKEAPP",
            "token": "verification-token",
            "container": container,
            "trigger_id": f"{next(self._seq)}.{uuid.uuid4().hex[:8]}",
            "team": {"id": self.team, "domain": "fake"},
            "channel": {"id": channel, "name": channel.lower()},
            "message": message,
            "response_url": f"{self.url}/actions/{uuid.uuid4().hex}",
            "actions": [
                {
                    "action_id": action_id or value.split(":", 1)[0],
                    "block_id": "approval",
                    "text": {"type": "plain_text", "text": value.split(":", 1)[0]},
                    "value": value,
                    "type": "button",
                    "action_ts": action_ts,
                }
            ],
        }
        with self._lock:
            self._envelopes.append(_Envelope(f"act-{action_ts}", "interactive", payload))
        self._notify()
        return action_ts

    def add_channel(self, channel: str) -> None:
        with self._lock:
            self._channels.add(channel)

    def set_not_in_channel(self, channel: str, value: bool = True) -> None:
        """Posting to `channel` answers `not_in_channel` (the bot was removed)."""
        with self._lock:
            self._channels.add(channel)
            (self._not_in.add if value else self._not_in.discard)(channel)

    def fail_next(
        self, method: str, error: str = "ratelimited", *, retry_after: float | None = 2.0, count: int = 1
    ) -> None:
        """The next `count` calls of `method` fail with `error` (`ratelimited`: HTTP 429 + Retry-After)."""
        with self._lock:
            self._failures.setdefault(method, []).append(
                _Failure(error, retry_after if error == "ratelimited" else None, count)
            )

    def clear_failures(self, method: str | None = None) -> None:
        """Forget what `fail_next` / `perform_then_fail` queued for `method` (every method when None)
        and is not used up yet."""
        with self._lock:
            for queued in (self._failures, self._garbles):
                if method is None:
                    queued.clear()
                else:
                    queued.pop(method, None)

    def perform_then_fail(
        self, method: str, error: str = "internal_error", *, status: int = 200, html: bool = False, count: int = 1
    ) -> None:
        """Perform the next `count` calls of `method` (a post is stored), then answer each with an
        error all the same: `{"ok": false, "error": error}` with HTTP `status`, or with `html` an HTML
        page (a proxy's 502, a maintenance page served with 200). Slack says of `internal_error` and
        `fatal_error` that part of the operation may have succeeded."""
        with self._lock:
            self._garbles.setdefault(method, []).append(_Garble(error, status, html, count))

    def _take_garble(self, method: str) -> _Garble | None:
        with self._lock:
            queue = self._garbles.get(method)
            if not queue:
                return None
            garble = queue[0]
            garble.count -= 1
            if garble.count <= 0:
                queue.pop(0)
            return garble

    def hold_answers(
        self,
        method: str,
        seconds: float,
        *,
        count: int = 1,
        channel: str | None = None,
        perform: bool = True,
        perform_after: float = 0.0,
    ) -> None:
        """Perform the next `count` calls of `method` (in `channel`, when given) at once and answer
        each only after `seconds`: Slack did it, the answer comes late. With `perform=False` the
        calls are not performed and answer `internal_error` late (Slack lost them); with
        `perform_after` they are performed that many seconds after they arrived (still queued at
        Slack when the client gave up), and answered at `seconds`."""
        with self._lock:
            self._holds.append(_Hold(method, seconds, count, channel, perform, perform_after))

    def _take_hold(self, method: str, channel: str | None) -> _Hold | None:
        with self._lock:
            for hold in self._holds:
                if hold.method == method and (hold.channel is None or hold.channel == channel):
                    hold.count -= 1
                    if hold.count <= 0:
                        self._holds.remove(hold)
                    return hold
        return None

    def on_delivered(self, hook: Callable[[str, int], None] | None) -> None:
        """Call `hook(event_id, retry_attempt)` (in the fake's thread) right after each envelope was sent."""
        self._on_delivered = hook

    # ------------------------------------------------------------------ test side: the socket

    def _current(self, wait: float = 2.0) -> _Socket | None:
        """The connected socket, waiting up to `wait` s for one (a client's handshake can finish
        before the fake has registered its side)."""
        deadline = time.monotonic() + wait
        while self._socket is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return self._socket

    def disconnect(self, reason: str = "refresh_requested") -> bool:
        """Ask the connected client to reconnect (a `disconnect` frame); False without a socket."""
        current = self._current()
        if current is None:
            return False
        frame = {"type": "disconnect", "reason": reason, "debug_info": {"host": "applink-fake"}}
        self._run_on_loop(self._send(current, frame))
        return True

    def drop(self) -> bool:
        """Close the current socket without warning (a network drop); False without a socket."""
        current = self._current()
        if current is None:
            return False
        self._run_on_loop(self._close_socket(current, code=1006))
        return True

    @property
    def connections(self) -> int:
        """Sockets accepted so far."""
        with self._lock:
            return self._sockets_total

    @property
    def open_sockets(self) -> int:
        with self._lock:
            return len(self._open)

    @property
    def connected(self) -> bool:
        return self._socket is not None

    def wait_connected(self, timeout: float = 2.0) -> bool:
        """True once a client's socket is registered (its handshake may finish before the fake's side)."""
        return self._current(timeout) is not None

    # ------------------------------------------------------------------ test side: inspection

    def event_id_of(self, ts: str) -> str:
        with self._lock:
            for env in self._envelopes:
                if str(env.payload.get("event", {}).get("ts")) == ts:
                    return env.event_id
        raise KeyError(ts)

    def lose_ack(self, event_id: str) -> None:
        """The acks of the deliveries made so far of this event are lost (the client died with
        them in flight, whether or not it had sent them): Slack redelivers it after the timeout."""
        with self._lock:
            for env in self._envelopes:
                if env.event_id == event_id:
                    env.lost_ids |= env.envelope_ids
                    env.acked = False

    def acked(self, event_id: str) -> bool:
        with self._lock:
            return any(e.acked for e in self._envelopes if e.event_id == event_id)

    def deliveries(self, event_id: str | None = None) -> list[Delivery]:
        with self._lock:
            return [d for d in self._deliveries if event_id is None or d.event_id == event_id]

    def acks(self) -> list[tuple[str, str, float]]:
        with self._lock:
            return list(self._acks)

    def pending(self) -> list[str]:
        """Event ids not yet acknowledged (nor given up)."""
        with self._lock:
            return [e.event_id for e in self._envelopes if not e.acked and not e.dropped]

    def messages(self, channel: str, thread_ts: str | None = None) -> list[SlackMessage]:
        """The bot's messages in `channel` (all threads, or one), oldest first (copies)."""
        with self._lock:
            return [
                _copy(m)
                for m in self._order
                if m.channel == channel and (thread_ts is None or m.thread_ts == thread_ts)
            ]

    def reactions(self, channel: str, ts: str) -> list[str]:
        with self._lock:
            return list(self._reactions.get((channel, ts), []))

    def calls(self, method: str | None = None, *, channel: str | None = None) -> list[Call]:
        with self._lock:
            return [
                c
                for c in self._calls
                if (method is None or c.method == method) and (channel is None or c.channel == channel)
            ]

    def file_gets(self) -> list[tuple[str, str | None]]:
        with self._lock:
            return list(self._file_gets)

    def wait_for_text(
        self,
        channel: str,
        predicate: str | Callable[[str], bool],
        timeout: float = 5.0,
        *,
        thread_ts: str | None = None,
    ) -> SlackMessage:
        find = first_match(lambda: self.messages(channel, thread_ts), predicate, lambda m: m.text)

        try:
            return self.wait_for(find, timeout, f"text in {channel}")
        except TimeoutError:
            seen = [m.text for m in self.messages(channel)]
            raise TimeoutError(
                f"fake slack: no bot message in {channel} matched within {timeout} s; saw {seen!r}"
            ) from None

    # ------------------------------------------------------------------ server side: plumbing

    def _wake_all(self) -> None:
        # The pump clears the event after each wait, so news that comes while it works is not lost.
        if self._wake is not None:
            self._wake.set()

    async def _send(self, sock: _Socket, frame: dict[str, Any]) -> bool:
        if sock.closed:
            return False
        try:
            await sock.ws.send_text(json.dumps(frame))
        except Exception:  # noqa: BLE001 - the socket went away
            return False
        return True

    async def _close_socket(self, sock: _Socket | None, code: int = 1000) -> None:
        if sock is None or sock.closed:
            return
        sock.closed = True
        with self._lock:
            if self._socket is sock:
                self._socket = None
            self._open.discard(sock.n)
        with contextlib.suppress(Exception):
            await sock.ws.close(code=code if code != 1006 else 1011)

    # ------------------------------------------------------------------ server side: Socket Mode

    async def _ws(self, websocket: WebSocket) -> None:
        ticket = websocket.query_params.get("ticket", "")
        await websocket.accept()
        if not ticket.startswith("t-"):
            await websocket.close(code=1008)
            return
        with self._lock:
            self._sockets_total += 1
            sock = _Socket(self._sockets_total, websocket)
            old, self._socket = self._socket, sock
            self._open.add(sock.n)
        if old is not None:  # one socket per app token: the new one replaces the old, no ghost
            await self._close_socket(old)
        hello = {
            "type": "hello",
            "num_connections": 1,
            "debug_info": {"host": "applink-fake", "build_number": 1, "approximate_connection_time": 18060},
            "connection_info": {"app_id": "AFAKEAPP"},
        }
        await self._send(sock, hello)
        self._wake_all()
        try:
            while True:
                raw = await websocket.receive_text()
                try:
                    frame = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(frame, dict) and isinstance(frame.get("envelope_id"), str):
                    self._ack(frame["envelope_id"])
        except (WebSocketDisconnect, RuntimeError):
            pass
        finally:
            sock.closed = True
            with self._lock:
                if self._socket is sock:
                    self._socket = None
                self._open.discard(sock.n)

    def _ack(self, envelope_id: str) -> None:
        with self._lock:
            for env in self._envelopes:
                if envelope_id in env.envelope_ids:
                    if envelope_id in env.lost_ids:
                        return
                    env.acked = True
                    self._acks.append((envelope_id, env.event_id, time.monotonic()))
                    return

    async def _pump(self) -> None:
        """Deliver envelopes to the current socket, in order; redeliver the unacknowledged ones."""
        while True:
            assert self._wake is not None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 0.05)
            self._wake.clear()
            sock = self._socket
            if sock is None or sock.closed:
                continue
            now = time.monotonic()
            due: list[tuple[_Envelope, dict[str, Any]]] = []
            with self._lock:
                for env in self._envelopes:
                    if env.acked or env.dropped:
                        continue
                    if env.sent_at is not None:
                        if now - env.sent_at < self.ack_timeout:
                            continue
                        if env.retry_attempt >= self.max_retries:
                            env.dropped = True
                            continue
                        env.retry_attempt += 1
                    env.envelope_id = str(uuid.uuid4())
                    env.envelope_ids.add(env.envelope_id)
                    env.sent_at = now
                    frame: dict[str, Any] = {"envelope_id": env.envelope_id, "type": env.kind, "payload": env.payload}
                    if env.kind == "events_api":
                        frame["retry_attempt"] = env.retry_attempt
                        frame["retry_reason"] = "timeout" if env.retry_attempt else ""
                        frame["accepts_response_payload"] = False
                    else:
                        frame["accepts_response_payload"] = True
                    due.append((env, frame))
            for env, frame in due:
                sent = await self._send(sock, frame)
                with self._lock:
                    if not sent:
                        env.sent_at = None  # never reached anyone: not an attempt
                        continue
                    self._deliveries.append(
                        Delivery(frame["envelope_id"], env.event_id, env.retry_attempt, time.monotonic(), sock.n)
                    )
                hook = self._on_delivered
                if hook is not None:
                    hook(env.event_id, env.retry_attempt)

    # ------------------------------------------------------------------ server side: Web API

    async def _file(self, request: Request) -> Response:
        file_id = request.path_params["file_id"]
        auth = request.headers.get("authorization", "")
        token = auth.removeprefix("Bearer ") if auth.startswith("Bearer ") else None
        with self._lock:
            self._file_gets.append((file_id, token))
            data = self._files.get(file_id)
            delay = self._file_delay
        if delay:
            await asyncio.sleep(delay)
        if token != self.bot_token:
            return Response("<html>sign in</html>", status_code=403, media_type="text/html")
        if data is None:
            return Response("not found", status_code=404)
        return Response(data, media_type="application/octet-stream")

    async def _api(self, request: Request) -> Response:
        method = request.path_params["method"]
        params: dict[str, Any] = dict(request.query_params)
        raw = await request.body()
        ctype = request.headers.get("content-type", "")
        if raw:
            if "json" in ctype:
                with contextlib.suppress(ValueError):
                    body = json.loads(raw)
                    if isinstance(body, dict):
                        params.update(body)
            else:
                params.update(dict(parse_qsl(raw.decode("utf-8", "replace"), keep_blank_values=True)))
        auth = request.headers.get("authorization", "")
        token = auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else params.pop("token", None)
        before = self.on_request
        if before is not None:
            before(method, params)
        hold = self._take_hold(method, None if params.get("channel") is None else str(params["channel"]))
        if hold is not None and hold.perform and hold.perform_after > 0:
            await asyncio.sleep(hold.perform_after)
        if hold is not None and not hold.perform:
            status, body = 200, {"ok": False, "error": "internal_error"}
        else:
            status, body = self._dispatch(method, params, token)
        garble = self._take_garble(method) if status == 200 and body.get("ok") else None
        if garble is not None:  # performed; the answer says otherwise
            status, body = garble.status, {"ok": False, "error": garble.error}
        call = Call(method, params, status, time.monotonic(), body, token)
        with self._lock:
            self._calls.append(call)
        after = self.on_answer
        if after is not None:
            after(call)
        if hold is not None:
            await asyncio.sleep(max(0.0, hold.seconds - (hold.perform_after if hold.perform else 0.0)))
        if garble is not None and garble.html:
            page = f"<html><body><h1>{status} {garble.error}</h1></body></html>"
            return Response(page, status_code=status, media_type="text/html")
        headers = {"Retry-After": f"{body.pop('_retry_after'):g}"} if "_retry_after" in body else None
        return JSONResponse(body, status_code=status, headers=headers)

    def _dispatch(self, method: str, p: dict[str, Any], token: str | None) -> tuple[int, dict[str, Any]]:
        def err(error: str) -> tuple[int, dict[str, Any]]:
            return 200, {"ok": False, "error": error}

        if not token:
            return err("not_authed")
        if method == "apps.connections.open":
            if token == self.bot_token:
                return err("not_allowed_token_type")
            if token != self.app_token:
                return err("invalid_auth")
        elif method in BOT_METHODS:
            if token == self.app_token:
                return err("not_allowed_token_type")
            if token != self.bot_token:
                return err("invalid_auth")
        else:
            return 404, {"ok": False, "error": "unknown_method"}
        with self._lock:
            queue = self._failures.get(method)
            failure = queue[0] if queue else None
            if failure is not None and queue is not None:
                failure.count -= 1
                if failure.count <= 0:
                    queue.pop(0)
        if failure is not None:
            if failure.error == "ratelimited":
                body: dict[str, Any] = {"ok": False, "error": "ratelimited"}
                if failure.retry_after is not None:
                    body["_retry_after"] = failure.retry_after
                return 429, body
            return err(failure.error)
        if method == "auth.test":
            return 200, {
                "ok": True,
                "url": "https://fake.slack.com/",
                "team": "Fake",
                "user": "bot",
                "team_id": self.team,
                "user_id": self.bot_user,
                "bot_id": self.bot_id,
            }
        if method == "apps.connections.open":
            return 200, {"ok": True, "url": f"ws://127.0.0.1:{self.port}/link/?ticket=t-{uuid.uuid4().hex}"}
        channel = str(p.get("channel") or "")
        with self._lock:
            if channel not in self._channels:
                return err("channel_not_found")
            if channel in self._not_in and method in ("chat.postMessage", "chat.update", "reactions.add"):
                return err("not_in_channel")
        if method == "conversations.info":
            return 200, {"ok": True, "channel": {"id": channel, "is_im": channel.startswith("D")}}
        if method in ("conversations.history", "conversations.replies"):
            return self._history(method, channel, p)
        if method == "reactions.add":
            ts, name = str(p.get("timestamp") or ""), str(p.get("name") or "")
            with self._lock:
                if (channel, ts) not in self._messages and (channel, ts) not in self._inbound:
                    return err("message_not_found")
                names = self._reactions.setdefault((channel, ts), [])
                if name in names:
                    return err("already_reacted")
                names.append(name)
            return 200, {"ok": True}
        text = p.get("text")
        blocks = _blocks(p.get("blocks"))
        if not isinstance(text, str) or (not text.strip() and not blocks):
            return err("no_text")
        if len(text) > MAX_TEXT:
            return err("msg_too_long")
        if method == "chat.postMessage":
            thread_ts = p.get("thread_ts") or None
            with self._lock:
                ts = self._ts()
                msg = SlackMessage(
                    ts, channel, None if thread_ts is None else str(thread_ts), text, blocks or [],
                    history=[text], t_sent=time.monotonic(), metadata=_metadata(p.get("metadata")),
                )  # fmt: skip
                self._messages[(channel, ts)] = msg
                self._order.append(msg)
            reply = {"type": "message", "text": text, "ts": ts, "bot_id": self.bot_id, "user": self.bot_user}
            return 200, {"ok": True, "channel": channel, "ts": ts, "message": reply}
        # chat.update
        ts = str(p.get("ts") or "")
        with self._lock:
            found = self._messages.get((channel, ts))
            if found is None:
                return err("message_not_found" if (channel, ts) not in self._inbound else "cant_update_message")
            found.text = text
            if blocks is not None:
                found.blocks = blocks
            found.edits += 1
            found.history.append(text)
        return 200, {"ok": True, "channel": channel, "ts": ts, "text": text}

    def _history(self, method: str, channel: str, p: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """conversations.history (top-level messages, newest first) or conversations.replies (a
        thread: its parent, then the replies oldest first), filtered by `oldest` / `latest` and paged."""
        try:
            oldest = float(p.get("oldest") or 0)
            latest = float(p.get("latest") or "inf")
            limit = max(1, min(int(p.get("limit") or HISTORY_LIMIT), 999))
            start = int(str(p.get("cursor") or "0").removeprefix("next:"))
        except ValueError:
            return 200, {"ok": False, "error": "invalid_arguments"}
        inclusive = _flag(p.get("inclusive"))
        with_metadata = _flag(p.get("include_all_metadata"))

        def within(ts: str) -> bool:
            t = float(ts)
            return (oldest <= t if inclusive else oldest < t) and (t <= latest if inclusive else t < latest)

        with self._lock:
            mine = [(m.ts, self._as_event(m, with_metadata)) for m in self._order if m.channel == channel]
            people = [(ts, dict(e)) for (ch, ts), e in self._inbound_events.items() if ch == channel]
        everything = sorted(mine + people, key=lambda pair: float(pair[0]))
        if method == "conversations.history":
            top = [e for ts, e in everything if e.get("thread_ts") in (None, ts) and within(ts)]
            found = top[::-1]
        else:
            parent_ts = str(p.get("ts") or "")
            parent = next((e for ts, e in everything if ts == parent_ts), None)
            if parent is None:
                return 200, {"ok": False, "error": "thread_not_found"}
            replies = [e for ts, e in everything if e.get("thread_ts") == parent_ts and ts != parent_ts and within(ts)]
            found = [parent, *replies]
        page = found[start : start + limit]
        more = start + limit < len(found)
        body: dict[str, Any] = {"ok": True, "messages": page, "has_more": more}
        body["response_metadata"] = {"next_cursor": f"next:{start + limit}" if more else ""}
        return 200, body

    def _as_event(self, m: SlackMessage, with_metadata: bool) -> dict[str, Any]:
        """The bot's message as the history methods show it (caller holds the lock)."""
        event: dict[str, Any] = {
            "type": "message",
            "user": self.bot_user,
            "bot_id": self.bot_id,
            "app_id": "AFAKEAPP",
            "text": m.text,
            "ts": m.ts,
            "team": self.team,
        }
        if m.thread_ts is not None:
            event["thread_ts"] = m.thread_ts
        if m.blocks:
            event["blocks"] = list(m.blocks)
        if m.edits:
            event["edited"] = {"user": self.bot_user, "ts": m.ts}
        if with_metadata and m.metadata is not None:
            event["metadata"] = json.loads(json.dumps(m.metadata))
        return event


def _flag(value: Any) -> bool:
    """A boolean parameter as slack_sdk sends it (`1`/`0`, `true`/`false`, or JSON)."""
    return value is True or str(value).lower() in ("1", "true")


def _metadata(value: Any) -> dict[str, Any] | None:
    """chat.postMessage's `metadata` (a dict in JSON, a JSON string in a form); None when absent or
    not `{"event_type": str, "event_payload": dict}` (Slack then refuses it; the fake ignores it)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if not isinstance(value, dict) or not isinstance(value.get("event_type"), str):
        return None
    if not isinstance(value.get("event_payload"), dict):
        return None
    return {"event_type": value["event_type"], "event_payload": dict(value["event_payload"])}


def _blocks(value: Any) -> list[dict[str, Any]] | None:
    """`blocks` as sent (a JSON string in a form, a list in JSON); None when omitted."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return [b for b in value if isinstance(b, dict)] if isinstance(value, list) else None


def _copy(m: SlackMessage) -> SlackMessage:
    metadata = None if m.metadata is None else json.loads(json.dumps(m.metadata))
    return SlackMessage(
        m.ts, m.channel, m.thread_ts, m.text, list(m.blocks), m.edits, list(m.history), m.t_sent, metadata
    )
