"""Pairing: an unknown sender gets a code; the owner approves or denies it (DESIGN §8, issue 16).

A code is 8 characters from an alphabet without 0/O/1/I, valid one hour, and the same code is
given again to the same sender while it is valid; an account has at most three pending codes (a
fourth sender is told to try later). The owner answers with `appserver pairing approve CODE` (or
deny), which works on gateway.db whether or not a server runs; a running gateway notices the
decision within a second (`decided_unhandled`), tells the sender, and releases the messages it
held. A revoke it notices within a tenth of a second (it asks `PRAGMA data_version` many times a
second: `data_version`) and ends the revoked sender's queued turns; revokes are counted
(`pairing_revokes.made`), the gateway writes up to which one it acted (`applied`), and `pairing
revoke` waits for that (`changes`). Approved senders persist until `appserver pairing revoke`; so do
denied ones (a denied sender gets no new code). An expired code's kept messages are refused, and so
are those of an approval revoked before the gateway released them (the code is then `revoked`:
revoke wins).
"""

from __future__ import annotations

import secrets
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from appserver.client.hidden import shown
from gateway.db import transaction
from gateway.sqlstore import in_scope

ALPHABET = "ABCDEFGHJKLMNPQRSTUVWXYZ23456789"
CODE_LENGTH = 8
CODE_TTL_S = 3600.0
MAX_PENDING = 3
EXPIRED_UNAPPROVED = "pairing code expired before it was approved"  # why its kept messages are refused
REVOKED_UNRELEASED = "pairing revoked before its kept messages were released"
# Why a stranger's message is refused when every pairing slot is taken: they are told to try again
# later, and no code exists to keep it for (it is never `held`).
TOO_MANY_PENDING = f"dm: too many pending pairings ({MAX_PENDING}); told to try again later"

Status = Literal["pending", "approved", "denied", "expired", "revoked"]


class PairingError(Exception):
    """A code that cannot be decided (unknown, expired, already decided), said in one line."""


@dataclass(frozen=True, slots=True)
class PairingCode:
    code: str
    channel: str
    account: str
    sender: str
    sender_name: str | None
    chat: str
    created_at: float
    expires_at: float
    status: Status
    decided_at: float | None
    handled: bool

    def to_json(self) -> dict[str, object]:
        return {
            "code": self.code,
            "channel": self.channel,
            "account": self.account,
            "sender": self.sender,
            "sender_name": self.sender_name,
            "chat": self.chat,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            "status": self.status,
            "decided_at": self.decided_at,
        }


_COLUMNS = "code, channel, account, sender, sender_name, chat, created_at, expires_at, status, decided_at, handled"


def _row(row: tuple[object, ...]) -> PairingCode:
    values = list(row)
    values[-1] = bool(values[-1])
    return PairingCode(*values)  # type: ignore[arg-type]


def new_code() -> str:
    return "".join(secrets.choice(ALPHABET) for _ in range(CODE_LENGTH))


def shown_id(sender: str) -> str:
    """A sender id as the owner reads it (the `/pair` listing): each hidden character as its escape
    (`alice\\u200b`) and each backslash doubled, as `appserver pairing list` shows it, so two senders
    never look alike. `alice` and `alice` with a zero-width space were one name, and one's approval
    could pass for the other's. (An id not in NFC shows its marks escaped: `jose\\u0301`, not `josé`.)"""
    return shown(sender.replace("\\", "\\\\"))


def normalize(code: str) -> str:
    """What a person types: case and spaces or dashes do not matter."""
    return "".join(ch for ch in code.upper() if ch.isalnum())


class Pairing:
    """Owner of the `pairing_codes` and `approved_senders` tables."""

    def __init__(self, conn: sqlite3.Connection, clock: Callable[[], float] = time.time) -> None:
        self._conn = conn
        self._clock = clock

    # ---------------------------------------------------------------- the gateway's side

    def code_for(
        self, channel: str, account: str, sender: str, sender_name: str | None, chat: str
    ) -> tuple[PairingCode | None, bool]:
        """The sender's valid pending code (new=False) or a new one (new=True); None when the
        account already has `MAX_PENDING` other pending codes."""
        now = self._clock()
        with transaction(self._conn) as c:
            self._expire(c, now)
            row = c.execute(
                f"SELECT {_COLUMNS} FROM pairing_codes WHERE channel=? AND account=? AND sender=? AND status='pending'",
                (channel, account, sender),
            ).fetchone()
            if row is not None:
                return _row(row), False
            pending = c.execute(
                "SELECT COUNT(*) FROM pairing_codes WHERE channel=? AND account=? AND status='pending'",
                (channel, account),
            ).fetchone()[0]
            if pending >= MAX_PENDING:
                return None, False
            code = new_code()
            while c.execute("SELECT 1 FROM pairing_codes WHERE code=?", (code,)).fetchone():
                code = new_code()
            c.execute(
                f"INSERT INTO pairing_codes ({_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,'pending',NULL,0)",
                (code, channel, account, sender, sender_name, chat, now, now + CODE_TTL_S),
            )
        found = self.get(code)
        assert found is not None
        return found, True

    def has_pending(self, channel: str, account: str, sender: str) -> bool:
        """Whether the sender holds a code still valid now."""
        return self._has_code(channel, account, sender, "status='pending' AND expires_at > ?", self._clock())

    def is_denied(self, channel: str, account: str, sender: str) -> bool:
        """The owner denied this sender a pairing: they hear nothing more (no new code) until
        `appserver pairing revoke` clears it."""
        return self._has_code(channel, account, sender, "status='denied'")

    def approval_pending_release(self, channel: str, account: str, sender: str) -> bool:
        """The sender was approved a moment ago and the gateway has not released their kept
        messages yet (`watch_pairings` acts within a second): new messages wait behind them."""
        return self._has_code(channel, account, sender, "status='approved' AND handled=0")

    def _has_code(self, channel: str, account: str, sender: str, where: str, *args: object) -> bool:
        row = self._conn.execute(
            f"SELECT 1 FROM pairing_codes WHERE channel=? AND account=? AND sender=? AND {where} LIMIT 1",
            (channel, account, sender, *args),
        ).fetchone()
        return row is not None

    def is_approved(self, channel: str, account: str, sender: str) -> bool:
        row = self._conn.execute(
            "SELECT 1 FROM approved_senders WHERE channel=? AND account=? AND sender=?", (channel, account, sender)
        ).fetchone()
        return row is not None

    def decided_unhandled(self) -> list[PairingCode]:
        """Approvals, denials, expiries and revocations the gateway has not acted on yet (oldest
        first): an expired or revoked code's kept messages can never be released, so they are refused."""
        with transaction(self._conn) as c:
            self._expire(c, self._clock())
        rows = self._conn.execute(
            f"SELECT {_COLUMNS} FROM pairing_codes WHERE status IN ('approved','denied','expired','revoked')"
            " AND handled=0"
            " ORDER BY COALESCE(decided_at, expires_at)"
        ).fetchall()
        # on a database other servers' gateways share, the codes of the accounts this one runs
        return [p for p in map(_row, rows) if in_scope(self._conn, p.channel, p.account)]

    def mark_handled(self, code: str) -> None:
        with transaction(self._conn) as c:
            c.execute("UPDATE pairing_codes SET handled=1 WHERE code=?", (code,))

    def data_version(self) -> int:
        """SQLite's `PRAGMA data_version` of this connection: it moves only when another connection
        (an owner's `pairing` command) commits to gateway.db. Asking it costs microseconds and
        touches no page, so the gateway asks it often and looks at the pairings only when it moved."""
        return int(self._conn.execute("PRAGMA data_version").fetchone()[0])

    def mark_applied(self, made: int) -> None:
        """The gateway acted on every revoke up to the `made`-th (the queued turns of senders no
        longer let in are ended): what `appserver pairing revoke` waits for."""
        with transaction(self._conn, durable=False) as c:  # lost at a power cut: a command waits in vain
            c.execute("UPDATE pairing_revokes SET applied=MAX(applied, ?)", (made,))

    def changes(self) -> tuple[int, int]:
        """(made, applied): how many revokes gateway.db has counted, and up to which one the running
        gateway acted on them."""
        row = self._conn.execute("SELECT made, applied FROM pairing_revokes").fetchone()
        return (int(row[0]), int(row[1])) if row else (0, 0)

    # ---------------------------------------------------------------- the owner's side

    def get(self, code: str) -> PairingCode | None:
        row = self._conn.execute(f"SELECT {_COLUMNS} FROM pairing_codes WHERE code=?", (normalize(code),)).fetchone()
        return _row(row) if row else None

    def pending(self) -> list[PairingCode]:
        now = self._clock()
        with transaction(self._conn) as c:
            self._expire(c, now)
        rows = self._conn.execute(
            f"SELECT {_COLUMNS} FROM pairing_codes WHERE status='pending' ORDER BY created_at"
        ).fetchall()
        return [_row(r) for r in rows]

    def approve(self, code: str) -> PairingCode:
        return self._decide(code, "approved")

    def deny(self, code: str) -> PairingCode:
        return self._decide(code, "denied")

    def approved_senders(self) -> list[tuple[str, str, str, float]]:
        rows = self._conn.execute(
            "SELECT channel, account, sender, approved_at FROM approved_senders ORDER BY channel, account, sender"
        ).fetchall()
        return [(str(a), str(b), str(c), float(d)) for a, b, c, d in rows]

    def revocable(self, channel: str | None = None, account: str | None = None) -> list[tuple[str, str, str, str]]:
        """(channel, account, sender, "approved" or "denied") of every sender `revoke` would reset,
        of every account or of one."""
        where = "1=1"
        args: list[object] = []
        if channel is not None:
            where, args = where + " AND channel=?", [*args, channel]
        if account is not None:
            where, args = where + " AND account=?", [*args, account]
        rows = self._conn.execute(
            f"SELECT channel, account, sender, 'approved' FROM approved_senders WHERE {where}"
            f" UNION SELECT channel, account, sender, 'denied' FROM pairing_codes WHERE {where} AND status='denied'"
            " ORDER BY 1, 2, 3",
            [*args, *args],
        ).fetchall()
        return [(str(c), str(a), str(s), str(how)) for c, a, s, how in rows]

    def revoke(self, sender: str, channel: str | None = None, account: str | None = None) -> int:
        """Reset a sender's pairing (of every account, or of one): an approval is removed, and a
        denial forgotten (their next message gets a new code); returns how many were reset.

        A decision the gateway has not acted on yet ends now (`expires_at` is set to this moment, read
        under the write lock, so every message kept before it is older): an approval becomes
        `revoked`, so its kept messages are refused instead of released; a denial becomes `expired`,
        so what it kept is still refused. Messages kept later, for a new code, are not touched."""
        where, args = "sender=?", [sender]
        if channel is not None:
            where, args = where + " AND channel=?", [*args, channel]
        if account is not None:
            where, args = where + " AND account=?", [*args, account]
        with transaction(self._conn) as c:
            now = self._clock()
            approvals = int(c.execute(f"DELETE FROM approved_senders WHERE {where}", args).rowcount)
            denied = c.execute(
                f"SELECT DISTINCT channel, account FROM pairing_codes WHERE {where} AND status='denied'", args
            ).fetchall()
            c.execute(f"DELETE FROM pairing_codes WHERE {where} AND status='denied' AND handled=1", args)
            ended = "expires_at=MIN(expires_at, ?)"
            c.execute(
                f"UPDATE pairing_codes SET status='expired', {ended} WHERE {where} AND status='denied'", [now, *args]
            )
            c.execute(
                f"UPDATE pairing_codes SET status='revoked', {ended} WHERE {where} AND status='approved' AND handled=0",
                [now, *args],
            )
            c.execute("UPDATE pairing_revokes SET made=made+1")  # what `changes` counts
            return approvals + len(denied)

    def _decide(self, code: str, status: Status) -> PairingCode:
        now = self._clock()
        key = normalize(code)
        with transaction(self._conn) as c:
            self._expire(c, now)
            row = c.execute(f"SELECT {_COLUMNS} FROM pairing_codes WHERE code=?", (key,)).fetchone()
            if row is None:
                raise PairingError(f"no pairing code {key}")
            found = _row(row)
            if found.status == "expired":
                raise PairingError(f"code {key} expired; the sender gets a new one by writing again")
            if found.status != "pending":
                raise PairingError(f"code {key} was already {found.status}")
            c.execute("UPDATE pairing_codes SET status=?, decided_at=? WHERE code=?", (status, now, key))
            if status == "approved":
                c.execute(
                    "INSERT OR REPLACE INTO approved_senders (channel, account, sender, approved_at, code)"
                    " VALUES (?,?,?,?,?)",
                    (found.channel, found.account, found.sender, now, key),
                )
        decided = self.get(key)
        assert decided is not None
        return decided

    @staticmethod
    def _expire(c: sqlite3.Connection, now: float) -> None:
        c.execute("UPDATE pairing_codes SET status='expired' WHERE status='pending' AND expires_at <= ?", (now,))
