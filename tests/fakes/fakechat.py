"""A loopback fake chat platform with Telegram-like semantics, for driving the channel gateway end to end.

A real HTTP server (starlette + uvicorn) on 127.0.0.1, on an ephemeral port, running its own event loop in a
background thread, so sync tests, async tests and subprocesses (`appserver serve` and its gateway child) can all
talk to it. The plugin in tests/fakes/fakechat_plugin/ is its client.

    install_plugin(home)                                 # $APPSERVER_HOME/channels/fakechat/
    with FakeChat() as chat:
        config += chat.account_toml("main")              # base_url = chat.url, poll_timeout = 1.0
        mid = chat.inject("c1", "hello")                 # a user writes to the bot
        reply = chat.wait_for_text("c1", lambda t: "hi" in t, timeout=5)
        assert chat.acked_offset > chat.update_id_of(mid)

Wire API: `POST /<method>` with a JSON body, answered `{"ok": true, "result": ...}` or
`{"ok": false, "error_code": N, "error": "...", "retry_after": S}` (`retry_after` on 429 only, also in a
`Retry-After` header). Methods: getMe, getUpdates {offset, timeout}, sendMessage {chat, thread, reply_to, text},
editMessageText {chat, message_id, text}, setReaction {chat, message_id, emoji}, sendChatAction {chat, action}.

Telegram semantics kept on purpose: an update is redelivered by every getUpdates until a later call's `offset`
passes it; a new getUpdates while another is held terminates the held one with 409 (Conflict); editing to the
identical text is a 400 "message is not modified"; a text longer than `max_length` is a 400.
"""

from __future__ import annotations

import asyncio
import copy
import json
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse
from starlette.routing import BaseRoute, Route

from tests.fakes.loopback import LoopbackServer, first_match

PLUGIN_DIR = Path(__file__).resolve().parent / "fakechat_plugin"


def install_plugin(home: Path, *, symlink: bool = False) -> Path:
    """Put the fakechat user plugin at `$APPSERVER_HOME/channels/fakechat/` (a copy, or a symlink); returns it."""
    dest = home / "channels" / "fakechat"
    dest.parent.mkdir(parents=True, exist_ok=True)
    if symlink:
        dest.symlink_to(PLUGIN_DIR, target_is_directory=True)
    else:
        shutil.copytree(PLUGIN_DIR, dest, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


METHODS = ("getMe", "getUpdates", "sendMessage", "editMessageText", "setReaction", "sendChatAction")


@dataclass(slots=True)
class Call:
    """One wire call as the fake saw it."""

    method: str
    payload: dict[str, Any]
    status: int
    t: float  # time.monotonic() when the answer was produced
    response: dict[str, Any]

    @property
    def chat(self) -> str | None:
        chat = self.payload.get("chat")
        return None if chat is None else str(chat)


@dataclass(slots=True)
class BotMessage:
    """A message the bot posted, as it currently reads."""

    id: str
    chat: str
    thread: str | None
    reply_to: str | None
    text: str
    edits: int = 0
    history: list[str] = field(default_factory=list)  # every text it had, first to current
    t_sent: float = 0.0  # monotonic


@dataclass(slots=True)
class _Failure:
    status: int
    retry_after: float | None
    error: str
    count: int


class FakeChat(LoopbackServer):
    """The fake platform. Every public method is thread-safe and callable from sync code."""

    _label = "fakechat"
    _thread_name = "fakechat"

    def __init__(self, *, token: str | None = None, max_length: int = 4096, bot_id: str = "bot") -> None:
        super().__init__()
        self.token = token  # when set, every call must carry `Authorization: Bearer <token>` (else 401)
        self.max_length = max_length
        self.bot_id = bot_id
        self._lock = threading.Lock()
        self._updates: list[dict[str, Any]] = []  # not yet forgotten (update_id >= acked offset)
        self._next_update_id = 1
        self._next_sent_id = 1
        self._bot_messages: dict[tuple[str, str], BotMessage] = {}
        self._order: list[BotMessage] = []
        self._reactions: dict[tuple[str, str], str | None] = {}
        self._calls: list[Call] = []
        self._failures: dict[str, list[_Failure]] = {}
        self._crash_pending = 0
        self._acked_offset = 0
        self._poll_count = 0
        self._update_ids: dict[str, int] = {}  # inbound message_id -> update_id
        self._inbound_chat: dict[str, str] = {}  # inbound message_id -> chat
        self._closing = False
        # event-loop side (only touched on the server's loop)
        self._held: dict[str, asyncio.Event] = {}  # auth key -> "you were superseded" event of the held poll

    # ------------------------------------------------------------------ lifecycle

    def _routes(self) -> list[BaseRoute]:
        return [Route("/{method}", self._handle, methods=["POST"])]

    def _before_stop(self) -> None:
        with self._lock:
            self._closing = True
        self._notify()

    def account_settings(self, poll_timeout: float = 1.0, **extra: Any) -> dict[str, Any]:
        """Settings for a fakechat account pointed at this fake."""
        return {"base_url": self.url, "poll_timeout": poll_timeout, **extra}

    def account_toml(self, name: str = "main", *, poll_timeout: float = 1.0, token_env: str | None = None) -> str:
        """A `[channels.fakechat.accounts.<name>]` table for config.toml pointed at this fake."""
        lines = [f"[channels.fakechat.accounts.{name}]", f'base_url = "{self.url}"', f"poll_timeout = {poll_timeout}"]
        if token_env is not None:
            lines.append(f'token_env = "{token_env}"')
        return "\n".join(lines) + "\n"

    # ------------------------------------------------------------------ test-side API

    def inject(
        self,
        chat: str,
        text: str,
        *,
        sender: str = "u1",
        chat_type: str = "dm",
        thread: str | None = None,
        sender_name: str | None = None,
        mentions_bot: bool = False,
        reply_to: str | None = None,
        sender_is_bot: bool = False,
    ) -> str:
        """A user posts `text` in `chat`: queue an update; returns its message id (`m<update_id>`)."""
        with self._lock:
            update_id = self._next_update_id
            self._next_update_id += 1
            message_id = f"m{update_id}"
            self._updates.append(
                {
                    "update_id": update_id,
                    "message": {
                        "message_id": message_id,
                        "chat": chat,
                        "chat_type": chat_type,
                        "thread": thread,
                        "sender": sender,
                        "sender_name": sender_name,
                        "sender_is_bot": sender_is_bot,
                        "text": text,
                        "mentions_bot": mentions_bot,
                        "reply_to": reply_to,
                        "ts": time.time(),
                    },
                }
            )
            self._update_ids[message_id] = update_id
            self._inbound_chat[message_id] = chat
        self._notify()
        return message_id

    def update_id_of(self, message_id: str) -> int:
        with self._lock:
            return self._update_ids[message_id]

    def is_acked(self, message_id: str) -> bool:
        """True once a getUpdates offset has passed the update carrying `message_id`."""
        with self._lock:
            return self._acked_offset > self._update_ids[message_id]

    def pending_updates(self) -> list[dict[str, Any]]:
        """Updates not yet acknowledged by offset (they will be redelivered)."""
        with self._lock:
            return copy.deepcopy(self._updates)

    def messages(self, chat: str, thread: str | None = None) -> list[BotMessage]:
        """The bot's messages in `chat`, oldest first (copies). `thread=None` means every thread of the chat
        and its root; a thread id keeps that thread only."""
        with self._lock:
            return [_copy(m) for m in self._order if m.chat == chat and (thread is None or m.thread == thread)]

    def message(self, chat: str, message_id: str) -> BotMessage:
        with self._lock:
            return _copy(self._bot_messages[(chat, message_id)])

    def reactions(self, chat: str) -> dict[str, str | None]:
        """message id -> the bot's current reaction in `chat`."""
        with self._lock:
            return {mid: emoji for (c, mid), emoji in self._reactions.items() if c == chat}

    def calls(self, method: str | None = None, *, chat: str | None = None) -> list[Call]:
        """Every call so far (optionally of one method and/or to one chat), in order."""
        with self._lock:
            return [
                c for c in self._calls if (method is None or c.method == method) and (chat is None or c.chat == chat)
            ]

    def fail_next(
        self, method: str, status: int = 429, retry_after: float | None = 2.0, count: int = 1, error: str | None = None
    ) -> None:
        """The next `count` calls of `method` fail with `status` (429 carries `retry_after`). Failures queued
        for one method are consumed in order."""
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}")
        default = {
            429: f"Too Many Requests: retry after {retry_after}",
            400: "Bad Request",
            401: "Unauthorized",
            403: "Forbidden: bot was blocked by the user",
            409: "Conflict: terminated by other getUpdates request",
        }.get(status, "Internal Server Error" if status >= 500 else "error")
        with self._lock:
            self._failures.setdefault(method, []).append(
                _Failure(status, retry_after if status == 429 else None, error or default, count)
            )

    def crash_next_delivery(self) -> None:
        """The next getUpdates answer that carries at least one update also carries `"crash": true`; the plugin
        then SIGKILLs its own process before handing the update on. One crash per call."""
        with self._lock:
            self._crash_pending += 1

    @property
    def acked_offset(self) -> int:
        """The highest offset any getUpdates call has sent (updates below it are forgotten)."""
        with self._lock:
            return self._acked_offset

    @property
    def poll_count(self) -> int:
        """getUpdates calls received so far (failed ones included)."""
        with self._lock:
            return self._poll_count

    def wait_for_text(
        self,
        chat: str,
        predicate: str | Callable[[str], bool],
        timeout: float = 5.0,
        *,
        thread: str | None = None,
    ) -> BotMessage:
        """Wait until a bot message in `chat` (optionally `thread`) reads as wanted: `predicate` is the exact
        text, or a function of the text. Returns that message (a copy); TimeoutError with what was seen."""
        find = first_match(lambda: self.messages(chat, thread), predicate, lambda m: m.text)

        try:
            return self.wait_for(find, timeout, f"text in chat {chat!r}")
        except TimeoutError:
            seen = [m.text for m in self.messages(chat, thread)]
            raise TimeoutError(
                f"fakechat: no bot message in {chat!r} matched within {timeout} s; saw {seen!r}"
            ) from None

    def wait_acked(self, message_id: str, timeout: float = 5.0) -> None:
        self.wait_for(lambda: self.is_acked(message_id), timeout, f"ack of {message_id}")

    # Async twin, for tests whose event loop also runs the adapter (the sync one would block it).

    async def wait_for_text_async(
        self,
        chat: str,
        predicate: str | Callable[[str], bool],
        timeout: float = 5.0,
        *,
        thread: str | None = None,
    ) -> BotMessage:
        find = first_match(lambda: self.messages(chat, thread), predicate, lambda m: m.text)

        return await self.wait_for_async(find, timeout, f"text in chat {chat!r}")

    # ------------------------------------------------------------------ server side

    async def _handle(self, request: Request) -> JSONResponse:
        method = request.path_params["method"]
        try:
            raw = await request.body()
        except ClientDisconnect:  # the client gave up (a cancelled poll): nothing happened
            return JSONResponse({"ok": False, "error": "client disconnected"}, status_code=499)
        try:
            payload = json.loads(raw) if raw else {}
        except ValueError:
            payload = None
        if not isinstance(payload, dict):
            return self._answer(
                method, {}, 400, {"ok": False, "error_code": 400, "error": "body must be a JSON object"}
            )
        if method == "getUpdates":
            with self._lock:
                self._poll_count += 1
        if self.token is not None and request.headers.get("authorization") != f"Bearer {self.token}":
            return self._answer(method, payload, 401, {"ok": False, "error_code": 401, "error": "Unauthorized"})
        if method not in METHODS:
            return self._answer(method, payload, 404, {"ok": False, "error_code": 404, "error": "Not Found"})
        failure = self._take_failure(method)
        if failure is not None:
            body: dict[str, Any] = {"ok": False, "error_code": failure.status, "error": failure.error}
            if failure.retry_after is not None:
                body["retry_after"] = failure.retry_after
            return self._answer(method, payload, failure.status, body)
        if method == "getUpdates":
            return await self._get_updates(payload, request.headers.get("authorization", ""))
        status, body = self._dispatch(method, payload)
        return self._answer(method, payload, status, body)

    def _take_failure(self, method: str) -> _Failure | None:
        with self._lock:
            queue = self._failures.get(method)
            if not queue:
                return None
            failure = queue[0]
            failure.count -= 1
            if failure.count <= 0:
                queue.pop(0)
            return failure

    def _answer(self, method: str, payload: dict[str, Any], status: int, body: dict[str, Any]) -> JSONResponse:
        with self._lock:
            self._calls.append(Call(method, payload, status, time.monotonic(), body))
        headers = {"Retry-After": str(body["retry_after"])} if "retry_after" in body else None
        return JSONResponse(body, status_code=status, headers=headers)

    async def _get_updates(self, payload: dict[str, Any], auth_key: str) -> JSONResponse:
        try:
            offset = int(payload.get("offset") or 0)
            timeout = max(0.0, min(float(payload.get("timeout") or 0.0), 60.0))
        except (TypeError, ValueError):
            return self._answer("getUpdates", payload, 400, {"ok": False, "error_code": 400, "error": "bad offset"})
        with self._lock:
            if offset > self._acked_offset:
                self._acked_offset = offset
            self._updates = [u for u in self._updates if u["update_id"] >= self._acked_offset]
        # Telegram: a new getUpdates terminates a held one with 409.
        previous = self._held.pop(auth_key, None)
        if previous is not None:
            previous.set()
        superseded = asyncio.Event()
        self._held[auth_key] = superseded
        deadline = time.monotonic() + timeout
        try:
            while True:
                with self._lock:
                    batch = [u for u in self._updates if u["update_id"] >= offset]
                    closing = self._closing
                    crash = False
                    if batch and self._crash_pending > 0:
                        self._crash_pending -= 1
                        crash = True
                if batch or closing:
                    body: dict[str, Any] = {"ok": True, "result": json.loads(json.dumps(batch))}
                    if crash:
                        body["crash"] = True
                    return self._answer("getUpdates", payload, 200, body)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return self._answer("getUpdates", payload, 200, {"ok": True, "result": []})
                assert self._wake is not None
                wake = asyncio.ensure_future(self._wake.wait())
                stop = asyncio.ensure_future(superseded.wait())
                try:
                    await asyncio.wait({wake, stop}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    wake.cancel()
                    stop.cancel()
                if superseded.is_set():
                    body = {"ok": False, "error_code": 409, "error": "Conflict: terminated by other getUpdates request"}
                    return self._answer("getUpdates", payload, 409, body)
        finally:
            if self._held.get(auth_key) is superseded:
                del self._held[auth_key]

    def _dispatch(self, method: str, p: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        def bad(error: str, status: int = 400) -> tuple[int, dict[str, Any]]:
            return status, {"ok": False, "error_code": status, "error": error}

        if method == "getMe":
            return 200, {"ok": True, "result": {"id": self.bot_id, "name": self.bot_id}}
        chat = p.get("chat")
        if not isinstance(chat, str) or not chat:
            return bad("Bad Request: chat not found")
        if method == "sendChatAction":
            return 200, {"ok": True, "result": True}
        if method == "sendMessage":
            text = p.get("text")
            if not isinstance(text, str) or not text.strip():
                return bad("Bad Request: message text is empty")
            if len(text) > self.max_length:
                return bad("Bad Request: message is too long")
            with self._lock:
                mid = f"s{self._next_sent_id}"
                self._next_sent_id += 1
                msg = BotMessage(
                    id=mid,
                    chat=chat,
                    thread=_opt_str(p.get("thread")),
                    reply_to=_opt_str(p.get("reply_to")),
                    text=text,
                    history=[text],
                    t_sent=time.monotonic(),
                )
                self._bot_messages[(chat, mid)] = msg
                self._order.append(msg)
            return 200, {"ok": True, "result": {"message_id": mid}}
        target_id = str(p.get("message_id"))
        if method == "editMessageText":
            text = p.get("text")
            if not isinstance(text, str) or not text.strip():
                return bad("Bad Request: message text is empty")
            if len(text) > self.max_length:
                return bad("Bad Request: message is too long")
            with self._lock:
                found = self._bot_messages.get((chat, target_id))
                if found is None:
                    return bad("Bad Request: message to edit not found")
                if found.text == text:
                    return bad("Bad Request: message is not modified")
                found.text = text
                found.edits += 1
                found.history.append(text)
            return 200, {"ok": True, "result": True}
        if method == "setReaction":
            with self._lock:
                if (chat, target_id) not in self._bot_messages and self._inbound_chat.get(target_id) != chat:
                    return bad("Bad Request: message to react not found")
                self._reactions[(chat, target_id)] = p.get("emoji") or None
            return 200, {"ok": True, "result": True}
        return bad("Not Found", 404)


def _opt_str(value: Any) -> str | None:
    return None if value is None else str(value)


def _copy(m: BotMessage) -> BotMessage:
    return BotMessage(m.id, m.chat, m.thread, m.reply_to, m.text, m.edits, list(m.history), m.t_sent)
