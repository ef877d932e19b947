"""A loopback fake of the Telegram Bot API, for driving the `telegram` channel plugin (and the real
python-telegram-bot inside it) in tests and through a real `appserver serve --channels telegram`.

A real HTTP server (starlette + uvicorn) on 127.0.0.1, on an ephemeral port, running its own event loop
in a background thread, so sync tests, async tests and subprocesses can all talk to it.

    with FakeTelegram() as tg:
        settings = {"api_url": tg.url, "poll_timeout": 1, "token_env": "TG_TOKEN"}   # env TG_TOKEN=tg.token
        msg = tg.dm("hello")                        # a user writes to the bot in a private chat
        reply = tg.wait_for_text(msg.chat_id, "echo: hello")
        assert tg.acked(msg)

Wire API, as Telegram's: `POST` (or `GET`) `/bot<token>/<method>` with a form-encoded, multipart or JSON
body (form values that are objects or arrays are JSON text), answered `{"ok": true, "result": …}` or
`{"ok": false, "error_code": N, "description": "…", "parameters": {"retry_after": N}}`; files at
`GET /file/bot<token>/<file_path>`. Methods: getMe, deleteWebhook, getUpdates, sendMessage,
editMessageText, sendChatAction, getFile, answerCallbackQuery, setMessageReaction.

Telegram semantics kept on purpose:
- an update is redelivered by every getUpdates until a later call's `offset` passes it (then it is
  forgotten); a new getUpdates on the same token while one is held terminates the held one with 409
  ("Conflict: terminated by other getUpdates request; …"), as Telegram does; `other_poller()` plays a
  second process polling the same token, so every poll is refused with 409 while it runs;
- `parse_mode=HTML` is parsed like Telegram parses it (the tags Telegram knows, `&lt; &gt; &amp; &quot;`
  and numeric entities only), and a malformed text is refused with 400 "Bad Request: can't parse
  entities: …"; the 4096-character limit counts UTF-16 code units of the text after entity parsing;
- editing a message to the same text and markup is 400 "Bad Request: message is not modified: …";
- a wrong token is 401 "Unauthorized" (every method); an unknown chat is 400 "Bad Request: chat not
  found"; a chat that blocked or removed the bot is 403;
- with `privacy_mode=True`, group messages reach the bot only when they mention it, reply to it or are
  commands (Telegram's default for bots in groups).

Failures: `fail_next` (an error the Bot API answers in its JSON, the call not performed) and
`perform_then_page` (the call performed, then answered with an HTML page instead of JSON). A photo's
sizes can be `broken` (the download answers 500), `pathless` (getFile answers without `file_path`,
which the Bot API leaves optional) or `hanging` (the download never answers, until the fake stops).

Albums: `inject(..., media_group="g1")` on each part (Telegram sends one update per photo); inside
`with tg.together():` the injected updates reach the bot in one getUpdates answer.

Crash hooks (`on_request`, `on_answer`, `on_delivery`) let a test kill the bot's process at one exact
step of the wire: each runs synchronously on the fake's event loop, at its step, before the fake serves
anything else. Never in a worker thread after the answer: a hook that lags behind its step (as a
starlette background task does on a loaded machine, by 100 ms and more) kills the client at whatever
step it reached meanwhile, e.g. with a reply's sendMessage already performed and its answer unread.
"""

from __future__ import annotations

import asyncio
import contextlib
import html
import html.parser
import json
import re
import threading
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from tests.fakes.loopback import LoopbackServer, first_match

MAX_TEXT = 4096
METHODS = (
    "getMe",
    "deleteWebhook",
    "getUpdates",
    "sendMessage",
    "editMessageText",
    "sendChatAction",
    "getFile",
    "answerCallbackQuery",
    "setMessageReaction",
)
# The reactions Telegram allows a bot to set without Premium (a subset is enough here).
ALLOWED_REACTIONS = frozenset(
    "👍 👎 ❤ 🔥 🥰 👏 😁 🤔 🤯 😱 🤬 😢 🎉 🤩 🤮 💩 🙏 👌 🕊 🤡 🥱 🥴 "
    "😍 🐳 ❤‍🔥 🌚 🌭 💯 🤣 ⚡ 🍌 🏆 💔 🤨 😐 🍓 🍾 💋 🖕 😈 "
    "😴 😭 🤓 👻 👨‍💻 👀 🎃 🙈 😇 😨 🤝 ✍ 🤗 🫡 🎅 🎄 ☃ 💅 🤪 🗿 🆒 💘 🙉 🦄 😘 💊 🙊 😎 👾 🤷‍♂ 🤷 🤷‍♀ 😡".split()
)
NOT_MODIFIED = (
    "Bad Request: message is not modified: specified new message content and reply markup are exactly the "
    "same as a current content and reply markup of the message"
)
CONFLICT = "Conflict: terminated by other getUpdates request; make sure that only one bot instance is running"


# ---------------------------------------------------------------------- Telegram's HTML


class EntityParseError(ValueError):
    """What Telegram answers as 400 "Bad Request: can't parse entities: <message>"."""


_TAGS = {
    "b",
    "strong",
    "i",
    "em",
    "u",
    "ins",
    "s",
    "strike",
    "del",
    "span",
    "tg-spoiler",
    "a",
    "code",
    "pre",
    "blockquote",
    "tg-emoji",
}
_ENTITY_RE = re.compile(r"&(lt|gt|amp|quot|#[0-9]{1,7}|#x[0-9a-fA-F]{1,6});")
_TAG_RE = re.compile(r"<(/?)([a-zA-Z][a-zA-Z0-9-]*)((?:\s+[a-zA-Z-]+\s*=\s*(?:\"[^\"]*\"|'[^']*'|[^\s>]+))*)\s*(/?)>")
_ATTR_RE = re.compile(r"([a-zA-Z-]+)\s*=\s*(\"[^\"]*\"|'[^']*'|[^\s>]+)")


def parse_html(text: str) -> str:
    """The plain text Telegram shows for `text` sent with `parse_mode=HTML`, or `EntityParseError` with
    Telegram's message for a text it refuses (unknown tag, unclosed or crossing tags, a bad entity, a
    raw `<` or `&`)."""
    out: list[str] = []
    stack: list[str] = []
    i = 0
    n = len(text)

    def offset(pos: int) -> int:
        return len(text[:pos].encode("utf-8"))

    while i < n:
        c = text[i]
        if c == "<":
            m = _TAG_RE.match(text, i)
            if m is None:
                raise EntityParseError(f'Unsupported start tag "" at byte offset {offset(i)}')
            closing, name, attrs, _selfclose = m.group(1), m.group(2).lower(), m.group(3), m.group(4)
            if name not in _TAGS:
                kind = "end" if closing else "start"
                raise EntityParseError(f'Unsupported {kind} tag "{name}" at byte offset {offset(i)}')
            if closing:
                if not stack:
                    raise EntityParseError(f"Unexpected end tag at byte offset {offset(i)}")
                if stack[-1] != name:
                    raise EntityParseError(
                        f'Unmatched end tag at byte offset {offset(i)}, expected "</{stack[-1]}>", found "</{name}>"'
                    )
                stack.pop()
            else:
                found = {k.lower(): v.strip("\"'") for k, v in _ATTR_RE.findall(attrs or "")}
                if name == "span" and found.get("class") != "tg-spoiler":
                    raise EntityParseError(f'Tag "span" must have class "tg-spoiler" at byte offset {offset(i)}')
                stack.append(name)
            i = m.end()
            continue
        if c == "&":
            m = _ENTITY_RE.match(text, i)
            if m is None:
                raise EntityParseError(f"Can't find end of the entity starting at byte offset {offset(i)}")
            out.append(html.unescape(m.group(0)))
            i = m.end()
            continue
        out.append(c)
        i += 1
    if stack:
        raise EntityParseError(f'Can\'t find end tag corresponding to start tag "{stack[-1]}"')
    return "".join(out)


def utf16_len(text: str) -> int:
    return len(text.encode("utf-16-le")) // 2


# ---------------------------------------------------------------------- records


@dataclass(slots=True)
class Call:
    """One wire call as the fake saw it."""

    method: str
    params: dict[str, Any]
    status: int
    t: float  # time.monotonic() when the answer was produced
    response: dict[str, Any]

    @property
    def chat_id(self) -> int | None:
        chat = self.params.get("chat_id")
        try:
            return None if chat is None else int(chat)
        except (TypeError, ValueError):
            return None


@dataclass(slots=True)
class BotMessage:
    """A message the bot posted, as it currently reads."""

    chat_id: int
    message_id: int
    text: str  # as shown (entities parsed)
    source: str  # as sent (HTML when parse_mode was HTML)
    parse_mode: str | None
    thread: int | None
    reply_to: int | None
    reply_markup: dict[str, Any] | None
    edits: int = 0
    history: list[str] = field(default_factory=list)  # every shown text, first to current
    t_sent: float = 0.0  # monotonic


@dataclass(frozen=True, slots=True)
class Injected:
    """An update the test injected."""

    update_id: int
    chat_id: int
    message_id: int | None  # None for a callback query
    callback_id: str | None = None


@dataclass(slots=True)
class _Failure:
    status: int
    description: str
    retry_after: int | None
    count: int


@dataclass(slots=True)
class _Chat:
    id: int
    type: str  # private | group | supergroup
    title: str | None
    is_forum: bool
    next_message_id: int = 1
    blocked: str | None = None  # a 403 description once the bot was removed / blocked


class FakeTelegram(LoopbackServer):
    """The fake Bot API. Every public method is thread-safe and callable from sync code."""

    _label = "fake Telegram"
    _thread_name = "fake-telegram"

    def __init__(
        self,
        *,
        token: str = "123456789:TEST-fake-token_abcdefghijklmnop",
        bot_id: int = 123456789,
        username: str = "appserver_test_bot",
        privacy_mode: bool = False,
        port: int = 0,
    ) -> None:
        super().__init__(port=port)
        self.token = token
        self.bot_id = bot_id
        self.username = username
        self.privacy_mode = privacy_mode
        # Crash hooks (see the module docstring): quick, synchronous, each at its exact step.
        # `on_request(method, params)`: a call arrived; the fake has not acted on it yet (it will).
        self.on_request: Callable[[str, dict[str, Any]], None] | None = None
        # `on_answer(call)`: the fake acted on a call (a send is in the chat, an offset acknowledged)
        # and its answer is not written yet: the client has not seen it.
        self.on_answer: Callable[[Call], None] | None = None
        # `on_delivery(update_ids)`: an answer carrying these updates is about to be written; they
        # count as delivered (Telegram keeps them until an offset passes them), the client has not
        # read them yet.
        self.on_delivery: Callable[[list[int]], None] | None = None
        self._lock = threading.RLock()
        self._updates: list[dict[str, Any]] = []
        self._next_update_id = 100
        self._chats: dict[int, _Chat] = {}
        self._bot_messages: dict[tuple[int, int], BotMessage] = {}
        self._order: list[BotMessage] = []
        self._user_messages: dict[tuple[int, int], dict[str, Any]] = {}
        self._reactions: dict[tuple[int, int], list[str]] = {}
        self._files: dict[str, tuple[str, bytes]] = {}  # file_id -> (file_path, bytes)
        self._broken_paths: set[str] = set()  # file paths whose download answers 500
        self._hanging_paths: set[str] = set()  # file paths whose download never answers
        self._pathless: set[str] = set()  # file ids getFile answers without a file_path
        self._callbacks: dict[str, dict[str, Any] | None] = {}  # id -> answer (None until answered)
        self._calls: list[Call] = []
        self._polls: list[tuple[int, float, list[int]]] = []  # (offset, t arrived, update ids answered)
        self._failures: dict[str, list[_Failure]] = {}
        self._pages: dict[str, list[int]] = {}  # method -> HTTP statuses of pages answered after performing
        self._acked_offset = 0
        self._other_poller = False
        self._closing = False
        self._held: asyncio.Event | None = None

    # ------------------------------------------------------------------ lifecycle

    def _routes(self) -> list[BaseRoute]:
        return [
            Route("/bot{token}/{method}", self._handle, methods=["GET", "POST"]),
            Route("/file/bot{token}/{path:path}", self._file, methods=["GET"]),
        ]

    def _before_stop(self) -> None:
        with self._lock:
            self._closing = True
        self._notify()

    def settings(self, **extra: Any) -> dict[str, Any]:
        """Plugin settings pointed at this fake (token passed separately)."""
        return {"api_url": self.url, "poll_timeout": 1, **extra}

    # ------------------------------------------------------------------ test side: chats and messages

    def chat(self, chat_id: int, kind: str = "private", *, title: str | None = None, is_forum: bool = False) -> int:
        """Declare a chat (done implicitly by the inject helpers); returns its id."""
        with self._lock:
            self._ensure_chat(chat_id, kind, title, is_forum)
        return chat_id

    def _ensure_chat(self, chat_id: int, kind: str, title: str | None, is_forum: bool) -> _Chat:
        found = self._chats.get(chat_id)
        if found is None:
            found = self._chats[chat_id] = _Chat(chat_id, kind, title, is_forum)
        return found

    def block(self, chat_id: int, description: str = "Forbidden: bot was kicked from the group chat") -> None:
        """The bot was removed from (or blocked by) this chat: every call to it is 403 from now on."""
        with self._lock:
            self._chats[chat_id].blocked = description

    @staticmethod
    def user(
        user_id: int = 1001, first_name: str = "Ann", username: str | None = "ann", is_bot: bool = False
    ) -> dict[str, Any]:
        u: dict[str, Any] = {"id": user_id, "is_bot": is_bot, "first_name": first_name}
        if username:
            u["username"] = username
        return u

    def dm(self, text: str, *, user_id: int = 1001, first_name: str = "Ann", **kw: Any) -> Injected:
        """A private message from user `user_id` (the private chat's id is the user's id)."""
        return self.inject(user_id, text, kind="private", sender=self.user(user_id, first_name), **kw)

    def inject(
        self,
        chat_id: int,
        text: str | None = None,
        *,
        kind: str = "private",
        sender: dict[str, Any] | None = None,
        title: str | None = "Team",
        thread: int | None = None,
        reply_to: int | None = None,
        photo: bytes | None = None,
        document: tuple[str, str, bytes] | None = None,  # (file name, mime type, content)
        caption: str | None = None,
        photo_sizes: list[bytes] | None = None,  # a photo's sizes, small to large, instead of `photo`'s three
        unsized: Collection[int] = (),  # indexes into `photo_sizes` sent without `file_size` (it is optional)
        broken: Collection[int] = (),  # indexes into `photo_sizes` whose download answers 500
        pathless: Collection[int] = (),  # indexes into `photo_sizes` getFile answers without `file_path`
        hanging: Collection[int] = (),  # indexes into `photo_sizes` whose download never answers
        media_group: str | None = None,  # the message is a part of this album (`media_group_id`)
        sticker: str | None = None,  # a sticker with this emoji ("" for one without an emoji)
        entities: list[dict[str, Any]] | None = None,  # the text's (or caption's) entities, as given
    ) -> Injected:
        """A user message in `chat_id` (`kind` private | group | supergroup; `thread` makes the
        supergroup a forum and the message a topic message). `@<bot username>` in the text is marked as
        a mention entity. Returns the queued update's ids; a message privacy mode hides is still given
        an id but never delivered."""
        sender = sender or self.user()
        with self._lock:
            chat = self._ensure_chat(chat_id, kind, None if kind == "private" else title, thread is not None)
            if thread is not None:
                chat.is_forum = True
            message_id = chat.next_message_id
            chat.next_message_id += 1
            msg: dict[str, Any] = {
                "message_id": message_id,
                "from": dict(sender),
                "chat": self._chat_json(chat),
                "date": int(time.time()),
            }
            if thread is not None:
                msg["message_thread_id"] = thread
                msg["is_topic_message"] = True
            body = text if text is not None else caption
            if text is not None:
                msg["text"] = text
            if caption is not None:
                msg["caption"] = caption
            if entities is None:
                entities = self._mentions(body or "")
            if entities:
                msg["entities" if text is not None else "caption_entities"] = entities
            if reply_to is not None:
                original = self._bot_messages.get((chat_id, reply_to))
                if original is not None:
                    msg["reply_to_message"] = self._bot_message_json(original)
                elif (chat_id, reply_to) in self._user_messages:
                    msg["reply_to_message"] = dict(self._user_messages[(chat_id, reply_to)])
            if photo is not None:
                msg["photo"] = self._photo_sizes(photo)
            if photo_sizes is not None:
                msg["photo"] = self._given_sizes(photo_sizes, unsized, broken, pathless, hanging)
            if media_group is not None:
                msg["media_group_id"] = media_group
            if sticker is not None:
                file_id = self._add_file(f"stickers/file_{len(self._files)}.webp", b"RIFF....WEBP")
                msg["sticker"] = {
                    "file_id": file_id,
                    "file_unique_id": f"u{file_id}",
                    "type": "regular",
                    "width": 512,
                    "height": 512,
                    "is_animated": False,
                    "is_video": False,
                    "file_size": 12,
                    **({"emoji": sticker} if sticker else {}),
                }
            if document is not None:
                name, mime, content = document
                file_id = self._add_file(f"documents/{name}", content)
                msg["document"] = {
                    "file_id": file_id,
                    "file_unique_id": f"u{file_id}",
                    "file_name": name,
                    "mime_type": mime,
                    "file_size": len(content),
                }
            self._user_messages[(chat_id, message_id)] = msg
            hidden = (
                self.privacy_mode
                and kind != "private"
                and not entities
                and not (body or "").startswith("/")
                and "reply_to_message" not in msg
            )
            update_id = self._next_update_id
            if not hidden:
                self._next_update_id += 1
                self._updates.append({"update_id": update_id, "message": msg})
        self._notify()
        return Injected(update_id, chat_id, message_id)

    def redeliver(self, injected: Injected) -> Injected:
        """The same user message in an update of its own again, as Telegram delivers one whose
        acknowledgement it never learnt of (the bot crashed before its next getUpdates)."""
        assert injected.message_id is not None
        with self._lock:
            msg = dict(self._user_messages[(injected.chat_id, injected.message_id)])
            update_id = self._next_update_id
            self._next_update_id += 1
            self._updates.append({"update_id": update_id, "message": msg})
        self._notify()
        return Injected(update_id, injected.chat_id, injected.message_id)

    def edit_user_message(self, chat_id: int, message_id: int, text: str) -> Injected:
        """The user edits one of their messages: an `edited_message` update."""
        with self._lock:
            msg = dict(self._user_messages[(chat_id, message_id)])
            msg["text"] = text
            msg["edit_date"] = int(time.time())
            self._user_messages[(chat_id, message_id)] = msg
            update_id = self._next_update_id
            self._next_update_id += 1
            self._updates.append({"update_id": update_id, "edited_message": msg})
        self._notify()
        return Injected(update_id, chat_id, message_id)

    def press(self, chat_id: int, message_id: int, data: str, *, sender: dict[str, Any] | None = None) -> Injected:
        """A user presses an inline button with callback data `data` under the bot's message."""
        sender = sender or self.user()
        with self._lock:
            found = self._bot_messages[(chat_id, message_id)]
            buttons = [b for row in (found.reply_markup or {}).get("inline_keyboard", []) for b in row]
            if not any(b.get("callback_data") == data for b in buttons):
                raise ValueError(f"no button with callback data {data!r} under message {message_id}")
            update_id = self._next_update_id
            self._next_update_id += 1
            callback_id = f"{update_id}{message_id}77"
            self._callbacks[callback_id] = None
            self._updates.append(
                {
                    "update_id": update_id,
                    "callback_query": {
                        "id": callback_id,
                        "from": dict(sender),
                        "message": self._bot_message_json(found),
                        "chat_instance": f"ci{chat_id}",
                        "data": data,
                    },
                }
            )
        self._notify()
        return Injected(update_id, chat_id, None, callback_id)

    def _mentions(self, text: str) -> list[dict[str, Any]]:
        out = []
        for m in re.finditer(r"@" + re.escape(self.username) + r"\b", text, re.IGNORECASE):
            prefix = text[: m.start()]
            out.append({"type": "mention", "offset": utf16_len(prefix), "length": utf16_len(m.group(0))})
        return out

    def _photo_sizes(self, content: bytes) -> list[dict[str, Any]]:
        """Three sizes as Telegram gives them (small to large); only the largest has the full bytes."""
        sizes = []
        for i, (w, h, data) in enumerate(
            ((90, 60, content[:64]), (320, 213, content[: len(content) // 2]), (1280, 853, content))
        ):
            file_id = self._add_file(f"photos/file_{len(self._files)}_{i}.jpg", data)
            sizes.append(
                {"file_id": file_id, "file_unique_id": f"u{file_id}", "width": w, "height": h, "file_size": len(data)}
            )
        return sizes

    def _given_sizes(
        self,
        sizes: list[bytes],
        unsized: Collection[int] = (),
        broken: Collection[int] = (),
        pathless: Collection[int] = (),
        hanging: Collection[int] = (),
    ) -> list[dict[str, Any]]:
        """The sizes a test gives, each its own file (small to large, as Telegram lists them); those
        in `unsized` have no `file_size`, those in `broken` cannot be downloaded (500), those in
        `pathless` are answered by getFile without `file_path`, those in `hanging` never download."""
        out = []
        for i, data in enumerate(sizes):
            path = f"photos/file_{len(self._files)}_{i}.jpg"
            file_id = self._add_file(path, data)
            if i in broken:
                self._broken_paths.add(path)
            if i in hanging:
                self._hanging_paths.add(path)
            if i in pathless:
                self._pathless.add(file_id)
            side = 90 * (i + 1)
            size: dict[str, Any] = {"file_id": file_id, "file_unique_id": f"u{file_id}", "width": side, "height": side}
            if i not in unsized:
                size["file_size"] = len(data)
            out.append(size)
        return out

    def _add_file(self, path: str, content: bytes) -> str:
        file_id = f"AgAC{len(self._files):04d}x"
        self._files[file_id] = (path, content)
        return file_id

    def _chat_json(self, chat: _Chat) -> dict[str, Any]:
        out: dict[str, Any] = {"id": chat.id, "type": chat.type}
        if chat.type == "private":
            out["first_name"] = "Ann"
        else:
            out["title"] = chat.title or "Team"
        if chat.is_forum:
            out["is_forum"] = True
        return out

    def _bot_message_json(self, m: BotMessage) -> dict[str, Any]:
        chat = self._chats[m.chat_id]
        out: dict[str, Any] = {
            "message_id": m.message_id,
            "from": {"id": self.bot_id, "is_bot": True, "first_name": "Test Bot", "username": self.username},
            "chat": self._chat_json(chat),
            "date": int(time.time()),
            "text": m.text,
        }
        if m.thread is not None:
            out["message_thread_id"] = m.thread
            out["is_topic_message"] = True
        if m.reply_markup:
            out["reply_markup"] = m.reply_markup
        if m.edits:
            out["edit_date"] = int(time.time())
        return out

    @contextlib.contextmanager
    def together(self) -> Iterator[None]:
        """The updates injected inside reach the bot in one getUpdates answer (none is answered
        before the block ends)."""
        with self._lock:
            yield

    # ------------------------------------------------------------------ test side: inspection

    def messages(self, chat_id: int, thread: int | None = None) -> list[BotMessage]:
        """The bot's messages in a chat, oldest first (copies); `thread` keeps one topic only."""
        with self._lock:
            return [_copy(m) for m in self._order if m.chat_id == chat_id and (thread is None or m.thread == thread)]

    def message(self, chat_id: int, message_id: int) -> BotMessage:
        with self._lock:
            return _copy(self._bot_messages[(chat_id, message_id)])

    def reactions(self, chat_id: int, message_id: int) -> list[str]:
        with self._lock:
            return list(self._reactions.get((chat_id, message_id), []))

    def callback_answer(self, callback_id: str) -> dict[str, Any] | None:
        """How the bot answered a callback query (None until it did)."""
        with self._lock:
            return self._callbacks.get(callback_id)

    def calls(self, method: str | None = None, *, chat_id: int | None = None) -> list[Call]:
        with self._lock:
            return [
                c
                for c in self._calls
                if (method is None or c.method == method) and (chat_id is None or c.chat_id == chat_id)
            ]

    def polls(self) -> list[tuple[int, float, list[int]]]:
        """Every getUpdates that got past auth and failures: (offset it sent, monotonic time it arrived,
        update ids it was given so far: empty while it is held or when it was answered empty or 409)."""
        with self._lock:
            return [(o, t, list(ids)) for o, t, ids in self._polls]

    @property
    def acked_offset(self) -> int:
        """The highest offset a getUpdates call has sent (updates below it are forgotten)."""
        with self._lock:
            return self._acked_offset

    def acked(self, injected: Injected) -> bool:
        return self.acked_offset > injected.update_id

    def deliveries(self, injected: Injected) -> int:
        """How many getUpdates answers carried this update."""
        with self._lock:
            return sum(1 for _, _, ids in self._polls if injected.update_id in ids)

    def pending(self) -> list[int]:
        """Update ids not yet acknowledged (they will be redelivered)."""
        with self._lock:
            return [u["update_id"] for u in self._updates]

    # ------------------------------------------------------------------ test side: failures

    def fail_next(
        self, method: str, status: int = 429, *, retry_after: int | None = None, count: int = 1, description: str = ""
    ) -> None:
        """The next `count` calls of `method` fail with `status` (429 carries `retry_after`, default 3)."""
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}")
        if status == 429 and retry_after is None:
            retry_after = 3
        default = {
            429: f"Too Many Requests: retry after {retry_after}",
            400: "Bad Request",
            401: "Unauthorized",
            403: "Forbidden: bot was blocked by the user",
            409: CONFLICT,
        }.get(status, "Internal Server Error" if status >= 500 else "error")
        with self._lock:
            self._failures.setdefault(method, []).append(_Failure(status, description or default, retry_after, count))

    def perform_then_page(self, method: str, status: int = 200) -> None:
        """Perform the next call of `method` (a message is stored), then answer it with an HTML page
        with HTTP `status` instead of the Bot API's JSON (a proxy's or a maintenance page)."""
        with self._lock:
            self._pages.setdefault(method, []).append(status)

    def other_poller(self, running: bool = True) -> None:
        """Another process polls the same token: while it runs every getUpdates is refused with 409."""
        with self._lock:
            self._other_poller = running
        if running and self._loop is not None:
            self._loop.call_soon_threadsafe(self._terminate_held)

    def _terminate_held(self) -> None:
        if self._held is not None:
            self._held.set()

    def revoke_token(self, new_token: str = "123456789:REVOKED") -> None:
        """The token is revoked in BotFather: the old one is 401 from now on."""
        with self._lock:
            self.token = new_token

    # ------------------------------------------------------------------ waiting

    def _finder(self, chat_id: int, predicate: str | Callable[[str], bool], thread: int | None) -> Callable[[], Any]:
        return first_match(lambda: self.messages(chat_id, thread), predicate, lambda m: m.text)

    def wait_for_text(
        self, chat_id: int, predicate: str | Callable[[str], bool], timeout: float = 10.0, *, thread: int | None = None
    ) -> BotMessage:
        """Wait until a bot message in the chat reads as wanted (the exact shown text, or a function of it)."""
        try:
            found: BotMessage = self.wait_for(self._finder(chat_id, predicate, thread), timeout, f"text in {chat_id}")
            return found
        except TimeoutError:
            seen = [m.text for m in self.messages(chat_id)]
            raise TimeoutError(
                f"fake Telegram: no bot message in {chat_id} matched in {timeout} s; saw {seen!r}"
            ) from None

    async def wait_for_text_async(
        self, chat_id: int, predicate: str | Callable[[str], bool], timeout: float = 10.0, *, thread: int | None = None
    ) -> BotMessage:
        try:
            return await self.wait_for_async(self._finder(chat_id, predicate, thread), timeout, f"text in {chat_id}")
        except TimeoutError:
            seen = [m.text for m in self.messages(chat_id)]
            raise TimeoutError(
                f"fake Telegram: no bot message in {chat_id} matched in {timeout} s; saw {seen!r}"
            ) from None

    # ------------------------------------------------------------------ server side

    def _answer(self, method: str, params: dict[str, Any], status: int, body: dict[str, Any]) -> JSONResponse:
        call = Call(method, params, status, time.monotonic(), body)
        with self._lock:
            self._calls.append(call)
        hook = self.on_answer
        if hook is not None:
            hook(call)
        return JSONResponse(body, status_code=status)

    @staticmethod
    def _error(status: int, description: str, retry_after: int | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"ok": False, "error_code": status, "description": description}
        if retry_after is not None:
            body["parameters"] = {"retry_after": retry_after}
        return body

    async def _params(self, request: Request) -> dict[str, Any]:
        params: dict[str, Any] = dict(request.query_params)
        ctype = request.headers.get("content-type", "")
        if request.method == "POST":
            if ctype.startswith("application/json"):
                raw = await request.body()
                data = json.loads(raw) if raw else {}
                if isinstance(data, dict):
                    params.update(data)
            elif ctype.startswith(("application/x-www-form-urlencoded", "multipart/form-data")):
                form = await request.form()
                params.update({k: v for k, v in form.items() if isinstance(v, str)})
        return params

    async def _handle(self, request: Request) -> Response:
        method = request.path_params["method"]
        try:
            params = await self._params(request)
        except ClientDisconnect:
            return JSONResponse(self._error(499, "client disconnected"), status_code=499)
        except ValueError:
            return self._answer(method, {}, 400, self._error(400, "Bad Request: invalid JSON"))
        with self._lock:
            token = self.token
        if request.path_params["token"] != token:
            return self._answer(method, params, 401, self._error(401, "Unauthorized"))
        if method not in METHODS:
            return self._answer(method, params, 404, self._error(404, "Not Found"))
        hook = self.on_request
        if hook is not None:
            hook(method, params)
        failure = self._take_failure(method)
        if failure is not None:
            body = self._error(failure.status, failure.description, failure.retry_after)
            return self._answer(method, params, failure.status, body)
        if method == "getUpdates":
            return await self._get_updates(params)
        try:
            status, body = self._dispatch(method, params)
        except (KeyError, TypeError, ValueError) as exc:
            status, body = 400, self._error(400, f"Bad Request: {type(exc).__name__}: {exc}")
        with self._lock:
            pages = self._pages.get(method)
            page = pages.pop(0) if pages and status == 200 else None
        if page is not None:  # performed; the answer is no Bot API answer
            self._answer(method, params, page, {"ok": False, "description": "an HTML page"})
            return Response(f"<html><body>{page}</body></html>", status_code=page, media_type="text/html")
        return self._answer(method, params, status, body)

    async def _file(self, request: Request) -> Response:
        with self._lock:
            token = self.token
            found = next((c for p, c in self._files.values() if p == request.path_params["path"]), None)
        if request.path_params["token"] != token:
            return JSONResponse(self._error(401, "Unauthorized"), status_code=401)
        if found is None:
            return JSONResponse(self._error(404, "Not Found"), status_code=404)
        if request.path_params["path"] in self._broken_paths:
            return Response("file server error", status_code=500, media_type="text/plain")
        if request.path_params["path"] in self._hanging_paths:
            while True:  # never answered: the client gives up, or the fake stops
                with self._lock:
                    if self._closing:
                        break
                await asyncio.sleep(0.05)
            return Response("stopping", status_code=503, media_type="text/plain")
        return Response(found, media_type="application/octet-stream")

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

    async def _get_updates(self, params: dict[str, Any]) -> Response:
        try:
            offset = int(params.get("offset") or 0)
            timeout = max(0.0, min(float(params.get("timeout") or 0), 50.0))
            limit = max(1, min(int(params.get("limit") or 100), 100))
        except (TypeError, ValueError):
            return self._answer("getUpdates", params, 400, self._error(400, "Bad Request: invalid offset"))
        with self._lock:
            if self._other_poller:
                return self._answer("getUpdates", params, 409, self._error(409, CONFLICT))
            if offset > self._acked_offset:
                self._acked_offset = offset
                self._updates = [u for u in self._updates if u["update_id"] >= offset]
            answered: list[int] = []
            self._polls.append((offset, time.monotonic(), answered))
        # Telegram: a new getUpdates terminates a held one with 409.
        if self._held is not None:
            self._held.set()
        superseded = self._held = asyncio.Event()
        deadline = time.monotonic() + timeout
        try:
            while True:
                with self._lock:
                    batch = [u for u in self._updates if u["update_id"] >= offset][:limit]
                    closing = self._closing
                    if batch or closing or deadline <= time.monotonic():
                        ids = [u["update_id"] for u in batch]
                        answered.extend(ids)
                        body = {"ok": True, "result": json.loads(json.dumps(batch))}
                        break
                assert self._wake is not None
                wake = asyncio.ensure_future(self._wake.wait())
                stop = asyncio.ensure_future(superseded.wait())
                try:
                    await asyncio.wait(
                        {wake, stop}, timeout=max(0.0, deadline - time.monotonic()), return_when=asyncio.FIRST_COMPLETED
                    )
                finally:
                    wake.cancel()
                    stop.cancel()
                if superseded.is_set():
                    return self._answer("getUpdates", params, 409, self._error(409, CONFLICT))
        finally:
            if self._held is superseded:
                self._held = None
        hook = self.on_delivery
        if ids and hook is not None:
            hook(ids)
        return self._answer("getUpdates", params, 200, body)

    def _dispatch(self, method: str, p: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        def bad(description: str, status: int = 400) -> tuple[int, dict[str, Any]]:
            return status, self._error(status, description)

        def ok(result: Any) -> tuple[int, dict[str, Any]]:
            return 200, {"ok": True, "result": result}

        if method == "getMe":
            return ok(
                {
                    "id": self.bot_id,
                    "is_bot": True,
                    "first_name": "Test Bot",
                    "username": self.username,
                    "can_join_groups": True,
                    "can_read_all_group_messages": not self.privacy_mode,
                    "supports_inline_queries": False,
                }
            )
        if method == "deleteWebhook":
            return ok(True)
        if method == "getFile":
            with self._lock:
                found = self._files.get(str(p.get("file_id")))
            if found is None:
                return bad("Bad Request: invalid file_id")
            path, content = found
            answer = {"file_id": p["file_id"], "file_unique_id": f"u{p['file_id']}", "file_size": len(content)}
            with self._lock:
                if str(p["file_id"]) not in self._pathless:  # `file_path` is optional in the Bot API
                    answer["file_path"] = path
            return ok(answer)
        if method == "answerCallbackQuery":
            cid = str(p.get("callback_query_id"))
            with self._lock:
                if cid not in self._callbacks or self._callbacks[cid] is not None:
                    return bad("Bad Request: query is too old and response timeout expired or query ID is invalid")
                self._callbacks[cid] = {k: v for k, v in p.items() if k != "callback_query_id"}
            return ok(True)
        chat_id = int(p["chat_id"]) if p.get("chat_id") not in (None, "") else None
        if chat_id is None:
            return bad("Bad Request: chat_id is empty")
        with self._lock:
            chat = self._chats.get(chat_id)
            if chat is None:
                return bad("Bad Request: chat not found")
            if chat.blocked:
                return bad(chat.blocked, 403)
            thread = int(p["message_thread_id"]) if p.get("message_thread_id") not in (None, "") else None
            if thread is not None and not chat.is_forum:
                return bad("Bad Request: message thread not found")
            if method == "sendChatAction":
                if p.get("action") not in ("typing", "upload_photo", "upload_document", "choose_sticker"):
                    return bad("Bad Request: wrong parameter action in request")
                return ok(True)
            if method == "setMessageReaction":
                mid = int(p["message_id"])
                if (chat_id, mid) not in self._bot_messages and (chat_id, mid) not in self._user_messages:
                    return bad("Bad Request: message to react not found")
                reaction = _json(p.get("reaction")) or []
                emoji = [str(r.get("emoji")) for r in reaction if isinstance(r, dict) and r.get("type") == "emoji"]
                if any(e not in ALLOWED_REACTIONS for e in emoji):
                    return bad("Bad Request: REACTION_INVALID")
                self._reactions[(chat_id, mid)] = emoji
                return ok(True)
            text = p.get("text")
            if not isinstance(text, str) or not text.strip():
                return bad("Bad Request: message text is empty")
            parse_mode = p.get("parse_mode") or None
            if parse_mode not in (None, "HTML"):
                return bad(f"Bad Request: unsupported parse_mode {parse_mode!r} in this fake")
            try:
                shown = parse_html(text) if parse_mode == "HTML" else text
            except EntityParseError as exc:
                return bad(f"Bad Request: can't parse entities: {exc}")
            if not shown.strip():
                return bad("Bad Request: text must be non-empty")
            if utf16_len(shown) > MAX_TEXT:
                return bad("Bad Request: message is too long")
            markup = _json(p.get("reply_markup"))
            if method == "sendMessage":
                reply_to = None
                reply = _json(p.get("reply_parameters"))
                if isinstance(reply, dict):
                    reply_to = int(reply["message_id"])
                    missing = (chat_id, reply_to) not in self._bot_messages and (
                        chat_id,
                        reply_to,
                    ) not in self._user_messages
                    if missing:
                        if not reply.get("allow_sending_without_reply"):
                            return bad("Bad Request: message to be replied not found")
                        reply_to = None
                elif p.get("reply_to_message_id") not in (None, ""):
                    reply_to = int(p["reply_to_message_id"])
                message_id = chat.next_message_id
                chat.next_message_id += 1
                m = BotMessage(chat_id, message_id, shown, text, parse_mode, thread, reply_to, markup)
                m.history.append(shown)
                m.t_sent = time.monotonic()
                self._bot_messages[(chat_id, message_id)] = m
                self._order.append(m)
                return ok(self._bot_message_json(m))
            if method == "editMessageText":
                edited = self._bot_messages.get((chat_id, int(p["message_id"])))
                if edited is None:
                    return bad("Bad Request: message to edit not found")
                if edited.text == shown and edited.reply_markup == markup and edited.parse_mode == parse_mode:
                    return bad(NOT_MODIFIED)
                edited.text, edited.source, edited.parse_mode, edited.reply_markup = shown, text, parse_mode, markup
                edited.edits += 1
                edited.history.append(shown)
                return ok(self._bot_message_json(edited))
        return bad("Not Found", 404)


def _json(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return None
    return value


def _copy(m: BotMessage) -> BotMessage:
    return BotMessage(
        m.chat_id,
        m.message_id,
        m.text,
        m.source,
        m.parse_mode,
        m.thread,
        m.reply_to,
        json.loads(json.dumps(m.reply_markup)) if m.reply_markup else None,
        m.edits,
        list(m.history),
        m.t_sent,
    )
