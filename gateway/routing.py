"""Routes: which agent (and conversation) answers a chat or thread.

A route key is `channel:account:chat:thread`, with thread `__root__` for a chat's main line. Lookup
order for a message: its own key, then its chat's root route, then the account's `default_agent`
(from config). A thread that falls back to its chat gets a conversation of its own: the gateway binds
the conversation the server created to the thread's key (`bind`); `/new` binds a fresh one.
Routes live in gateway.db beside the ledger (DESIGN §13).
"""

from __future__ import annotations

import sqlite3
import time
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from gateway.db import transaction
from plugins.contract import ROUTE_PART_MAX

ROOT = "__root__"


@dataclass(frozen=True)
class RouteKey:
    """`channel:account:chat:thread`; no part may be empty or contain `:` or a control character."""

    channel: str
    account: str
    chat: str
    thread: str = ROOT

    def __post_init__(self) -> None:
        for part in (self.channel, self.account, self.chat, self.thread):
            if not part or ":" in part:
                raise ValueError(f"route key parts must be non-empty and without ':': {part!r}")
            if not part.isprintable() and any(unicodedata.category(ch) == "Cc" for ch in part):
                # a newline or a NUL would split the key's line in `route list` and in logs
                raise ValueError(f"route key parts must not contain control characters: {part!r}")

    @classmethod
    def parse(cls, text: str) -> RouteKey:
        """Read `channel:account:chat[:thread]` (a stored key: as it was written)."""
        parts = text.split(":")
        if len(parts) not in (3, 4):
            raise ValueError(f"a route key is channel:account:chat[:thread], not {text!r}")
        return cls(*parts)

    @classmethod
    def typed(cls, text: str) -> RouteKey:
        """Read a key as an operator typed it. A part with whitespace (around it or inside), a
        control character, or longer than any platform's id could never match a message, so it is
        refused rather than kept as a route that never answers; it is not stripped either, which
        wrote the route for another chat (`' kit '` for `kit`) without a word."""
        parts = text.split(":")
        for part in parts:
            if part != part.strip():
                raise ValueError(f"a route key part must not begin or end with whitespace: {part!r}")
            if any(ch.isspace() for ch in part):
                raise ValueError(f"route key parts are platform ids, without spaces: {part!r}")
            if len(part) > ROUTE_PART_MAX:
                raise ValueError(f"a route key part is at most {ROUTE_PART_MAX} characters (a platform id)")
        return cls.parse(":".join(parts))

    @classmethod
    def of(cls, channel: str, account: str, chat: str, thread: str | None) -> RouteKey:
        """The key of a message (a message with no thread is on the chat's root)."""
        return cls(channel, account, chat, thread or ROOT)

    @property
    def root(self) -> RouteKey:
        return RouteKey(self.channel, self.account, self.chat, ROOT)

    def __str__(self) -> str:
        return f"{self.channel}:{self.account}:{self.chat}:{self.thread}"


@dataclass(frozen=True)
class Route:
    key: RouteKey
    agent: str
    conversation: str | None


@dataclass(frozen=True)
class Resolution:
    """Where a message goes. `conversation` None: ask the server for a new one, then `bind` it."""

    key: RouteKey
    agent: str
    conversation: str | None
    source: Literal["route", "chat", "default"]
    pinned: bool = False  # the route names its conversation (`route add --conversation`): `/new` cannot change it


class Router:
    """Owner of the `routes` and `route_conversations` tables."""

    def __init__(self, conn: sqlite3.Connection, clock: Callable[[], float] = time.time) -> None:
        self._conn = conn
        self._clock = clock

    def add(self, key: RouteKey, agent: str, conversation: str | None = None) -> Route:
        """Create or replace the route at `key` (a conversation bound to the old one is dropped)."""
        with transaction(self._conn) as c:
            c.execute(
                "INSERT INTO routes (key, agent, conversation, created_at) VALUES (?,?,?,?)"
                " ON CONFLICT(key) DO UPDATE SET agent=excluded.agent,"
                " conversation=excluded.conversation",
                (str(key), agent, conversation, self._clock()),
            )
            c.execute("DELETE FROM route_conversations WHERE key=?", (str(key),))
        return Route(key, agent, conversation)

    def remove(self, key: RouteKey) -> bool:
        with transaction(self._conn) as c:
            n = c.execute("DELETE FROM routes WHERE key=?", (str(key),)).rowcount
            c.execute("DELETE FROM route_conversations WHERE key=?", (str(key),))
        return n == 1

    def get(self, key: RouteKey) -> Route | None:
        row = self._conn.execute("SELECT agent, conversation FROM routes WHERE key=?", (str(key),)).fetchone()
        return Route(key, row[0], row[1]) if row else None

    def routes(self, channel: str | None = None, account: str | None = None) -> list[Route]:
        """Routes, optionally of one channel (and account), ordered by key."""
        prefix = "" if channel is None else f"{channel}:" + ("" if account is None else f"{account}:")
        rows = self._conn.execute(
            "SELECT key, agent, conversation FROM routes WHERE substr(key, 1, ?) = ? ORDER BY key",
            (len(prefix), prefix),
        ).fetchall()
        return [Route(RouteKey.parse(k), a, c) for k, a, c in rows]

    def resolve(self, key: RouteKey, default_agent: str | None = None) -> Resolution | None:
        """The agent and conversation for a message at `key`; None when nothing routes it."""
        bound = self._bound(key)
        own = self.get(key)
        if own is not None:
            if own.conversation is not None:  # the operator's pin: no binding replaces it (not even a stale one)
                return Resolution(key, own.agent, own.conversation, "route", pinned=True)
            return Resolution(key, own.agent, bound, "route")
        if key.thread != ROOT:
            chat = self.get(key.root)
            if chat is not None:
                return Resolution(key, chat.agent, bound, "chat")
        if default_agent:
            return Resolution(key, default_agent, bound, "default")
        return None

    def bind(self, key: RouteKey, conversation: str) -> None:
        """Remember the conversation the server created for `key`."""
        with transaction(self._conn) as c:
            c.execute(
                "INSERT INTO route_conversations (key, conversation, bound_at) VALUES (?,?,?)"
                " ON CONFLICT(key) DO UPDATE SET conversation=excluded.conversation,"
                " bound_at=excluded.bound_at",
                (str(key), conversation, self._clock()),
            )

    def forget(self, key: RouteKey) -> bool:
        """Drop the bound conversation (`/new`); the next message starts a new one, unless the route
        pins its conversation (`Resolution.pinned`), which this leaves as it is."""
        with transaction(self._conn) as c:
            n = c.execute("DELETE FROM route_conversations WHERE key=?", (str(key),)).rowcount
        return n == 1

    def _bound(self, key: RouteKey) -> str | None:
        row = self._conn.execute("SELECT conversation FROM route_conversations WHERE key=?", (str(key),)).fetchone()
        return row[0] if row else None


def move_chat_keys(c: sqlite3.Connection, channel: str, account: str, old: str, new: str) -> tuple[int, int]:
    """Re-key the routes and bound conversations of chat `old` (its root and every thread) to chat
    `new`, inside the caller's transaction (`Ledger.move_chat`): the chat keeps its agent and its
    history under its new platform id. A key the new chat already has stays (it was set knowing the
    new id); the old one it would replace is dropped. Returns (routes moved, conversations moved)."""
    before, after = f"{channel}:{account}:{old}:", f"{channel}:{account}:{new}:"
    moved = []
    for table in ("routes", "route_conversations"):
        c.execute(
            f"DELETE FROM {table} WHERE substr(key, 1, ?) = ? AND ? || substr(key, ?) IN (SELECT key FROM {table})",
            (len(before), before, after, len(before) + 1),
        )
        cur = c.execute(
            f"UPDATE {table} SET key = ? || substr(key, ?) WHERE substr(key, 1, ?) = ?",
            (after, len(before) + 1, len(before), before),
        )
        moved.append(cur.rowcount)
    return moved[0], moved[1]
