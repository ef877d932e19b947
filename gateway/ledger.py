"""The ledger: every inbound platform update, from receipt to a delivered or failed reply.

Ledger-first ingress (issue 15): an adapter acknowledges an update to its platform only after
`record` has committed, and submission and delivery are driven from here, so after a crash anywhere
the gateway resumes from these rows instead of from memory. One update is one row, keyed by
`channel:account:message_id`, which is also the turn's idempotency key on the server (a digest
of it when it is too long or holds a control character: `UpdateKey.idempotency_key`).

States, each move one committed transaction::

    received ──decide──► allowed ──submitted──► submitted ──finished──► finished ──delivered──► delivered
        │                   │                      │                       │
        ├──► denied         └──────────────────────┴───────failed──────────┴──► failed
        └──► held (pairing; `release` moves it to allowed)

`to_decide`, `to_submit`, `in_flight` and `to_deliver` are the resume queries, oldest first, so
per-chat order survives a restart. Beside the state, a reply's progress is noted as it goes out: the
platform ids of the parts sent (`note_sent`) and, before each new part's send, that it is being
attempted (`note_sending`), so a restart knows a part may exist although its id was never noted.
A chat command the gateway answers itself stays `allowed` while it runs: `take_command` notes it
taken (durably, before its effect) and `note_command_answer` keeps its answer before it is sent, so
a restart resends that answer under the same key and never runs the command a second time.
A notice that follows a decision or a failure (a stranger's pairing code, a refused answer to an
approval prompt, "⚠ Could not start a turn") is owed in the same column, written with the decision
(`decide(..., notice=True)`, `mark_failed(..., notice=text)`) and cleared once it went out (`told`):
a restart says what `to_tell` still finds (`Entry.owes_notice`), under the key `notice_key`.

Settled rows (`delivered`, `failed`, `denied`) are deleted `RETENTION_S` after they settled
(`prune_settled`, run by the gateway at start and hourly), so the file does not grow for ever.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import math
import os
import re
import sqlite3
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

from gateway.approvals import move_prompt_rows
from gateway.db import open_db, transaction
from gateway.routing import move_chat_keys
from gateway.sqlstore import CommitUnknown, in_scope

State = Literal["received", "allowed", "denied", "held", "submitted", "finished", "delivered", "failed"]
Decision = Literal["allow", "deny", "pair"]

_DECIDED: dict[Decision, State] = {"allow": "allowed", "deny": "denied", "pair": "held"}

# What the server takes as an idempotency key (appserver/ws/frames.py `SubmitInput`): at most 256
# characters, none of them a control character.
IDEMPOTENCY_KEY_MAX = 256
_KEY_CONTROL = re.compile("[\x00-\x1f\x7f]")
DIGEST_MARK = "h:"  # the id part of a digest key starts with it; no natural key's id part does
NOTICE_MARK = "notice:"  # the key a decision's or a failure's notice goes out under starts with it
# The states a row owes its notice in: the notice follows the decision or the failure that set it.
_TELLING: tuple[str, ...] = ("held", "denied", "failed")

# A settled row is kept this long after it settled, then deleted. Its only later use is to recognise
# the same update arriving again (no second turn), and no platform redelivers that late: Telegram
# keeps an unacknowledged update 24 h, Slack retries an event within the hour, Discord's catch-up
# reads after the newest message it recorded (plugins/discord: last_seen.json, not the ledger), and
# a captured webhook request replays only within `tolerance_s` (at most a day); a webhook sender
# that retries an `id` after a month gets a second turn. A positive number of days in
# APPSERVER_GATEWAY_LEDGER_RETENTION_DAYS overrides it (no [channels] key: docs/channels.md).
RETENTION_DAYS_ENV = "APPSERVER_GATEWAY_LEDGER_RETENTION_DAYS"
RETENTION_S = 30 * 86400.0
SETTLED: tuple[State, ...] = ("delivered", "failed", "denied")
PRUNE_SCAN = 500  # rows looked at per prune transaction: a few milliseconds of the gateway's loop
UNHEARD_MAX = 10_000  # writes whose COMMIT went unanswered remembered at most (`Ledger._unheard`)


def retention_s() -> float:
    """`RETENTION_S`, or the environment's number of days when it is a positive number."""
    try:
        days = float(os.environ.get(RETENTION_DAYS_ENV, ""))
    except ValueError:
        return RETENTION_S
    return days * 86400.0 if 0 < days < math.inf else RETENTION_S


class LedgerStateError(Exception):
    """A move the state machine does not allow (e.g. delivering a reply that never finished)."""


@dataclass(frozen=True)
class UpdateKey:
    """Identity of one platform update; `str()` is its ledger name, `idempotency_key` the turn's
    key on the server (the same string whenever the server takes it)."""

    channel: str
    account: str
    message_id: str

    def __str__(self) -> str:
        return f"{self.channel}:{self.account}:{self.message_id}"

    @property
    def idempotency_key(self) -> str:
        """`channel:account:message_id` when the server takes it as a key (at most 256 characters,
        no control character) and the id does not start with `h:`: every key a platform's short ids
        make, so rows written by older versions keep matching. Otherwise (a webhook `id` of 1,024
        characters, one with a newline, a plugin's odd ids, and any id starting with `h:`)
        `channel:account:h:<sha256 hex of that string>`: deterministic, so a redelivered message
        still maps to the same key and the server still makes it one turn. The two forms never
        meet: a natural key's id part never starts with `h:`, a digest key's always does (channel
        and account hold no `:`), so an id crafted as `h:<digest of another id>` gets a digest of
        its own instead of taking that id's turn."""
        natural = str(self)
        if (
            len(natural) <= IDEMPOTENCY_KEY_MAX
            and not _KEY_CONTROL.search(natural)
            and not self.message_id.startswith(DIGEST_MARK)
        ):
            return natural
        digest = hashlib.sha256(natural.encode("utf-8", "surrogatepass")).hexdigest()
        short = f"{self.channel}:{self.account}:{DIGEST_MARK}{digest}"
        if len(short) <= IDEMPOTENCY_KEY_MAX and not _KEY_CONTROL.search(short):
            return short
        return f"{DIGEST_MARK}{digest}"  # (a channel and account name that long: the digest covers them)


@dataclass(frozen=True)
class Receipt:
    """An update as received, before it is recorded."""

    key: UpdateKey
    chat: str
    sender: str
    thread: str | None
    payload: dict[str, Any]


@dataclass(frozen=True)
class Entry:
    """One ledger row as read back (a projection: the database owns the state)."""

    seq: int
    key: UpdateKey
    chat: str
    thread: str | None
    sender: str
    payload: dict[str, Any]
    state: State
    decision: Decision | None
    reason: str | None
    turn_id: str | None
    conversation: str | None
    reply: str | None
    remote_ids: tuple[str, ...]
    received_at: float
    updated_at: float
    batch: str | None = None  # the message id of the batch's first message, when debounced into one
    sending: tuple[str, float] | None = None  # the reply part last attempted: its key, when (epoch s)

    @property
    def idempotency_key(self) -> str:
        return self.key.idempotency_key

    @property
    def command_taken(self) -> bool:
        """An allowed row whose command already took (or began to take) effect: `take_command`."""
        return self.state == "allowed" and self.sending is not None

    @property
    def owes_notice(self) -> bool:
        """A held, denied or failed row whose notice (`notice_key`) has not gone out yet."""
        return self.state in _TELLING and self.sending is not None and self.sending[0] == notice_key(self.key)

    @property
    def is_batch_member(self) -> bool:
        """In a batch but not its first message (the first one carries the turn's delivery)."""
        return self.batch is not None and self.batch != self.key.message_id


@dataclass(frozen=True)
class ChatMove:
    """What `Ledger.move_chat` re-pointed from a chat's old id to its new one."""

    routes: int
    conversations: int
    prompts: int
    messages: int = 0  # not submitted yet: `_move_waiting_rows`

    def __bool__(self) -> bool:
        return bool(self.routes or self.conversations or self.prompts or self.messages)


class Ledger:
    """Owner of the `ledger` table. Every method is one atomic transaction."""

    def __init__(self, conn: sqlite3.Connection, clock: Callable[[], float] = time.time) -> None:
        self._conn = conn
        self._clock = clock
        # Receipts, and held messages being released, whose COMMIT's answer was lost (PostgreSQL: the
        # session cut while COMMIT was in flight, `CommitUnknown`): their rows may exist although this
        # process never took them in. A receipt recorded again finds its row and is taken in then
        # (`record_many` says it new); a release run again returns what the unheard one moved.
        self._unheard: dict[UpdateKey, None] = {}
        self._unheard_releases: dict[tuple[str, str, str], tuple[str, ...]] = {}

    @classmethod
    def open(cls, path: Path, clock: Callable[[], float] = time.time, *, gateway: bool = False) -> Ledger:
        """`gateway`: opened by the gateway process, which holds `gateway.lock` (db.open_db)."""
        return cls(open_db(path, gateway=gateway), clock)

    @property
    def connection(self) -> sqlite3.Connection:
        """The shared database connection (routes live in the same file)."""
        return self._conn

    def close(self) -> None:
        self._conn.close()

    def record(
        self,
        key: UpdateKey,
        *,
        chat: str,
        sender: str,
        thread: str | None = None,
        payload: Mapping[str, Any] | None = None,
    ) -> tuple[Entry, bool]:
        """Record an update as `received`; a redelivery of the same key changes nothing.

        Returns the row and whether it was new. The caller acks the platform after this returns.
        """
        return self.record_many([Receipt(key, chat, sender, thread, dict(payload or {}))])[0]

    def record_many(self, receipts: Sequence[Receipt]) -> list[tuple[Entry, bool]]:
        """`record` for several updates in one durable (fsynced) transaction: a group commit."""
        now = self._clock()
        created: list[bool] = []
        try:
            with transaction(self._conn, durable=True) as c:
                for r in receipts:
                    body = json.dumps(r.payload, ensure_ascii=False, separators=(",", ":"))
                    cur = c.execute(
                        "INSERT OR IGNORE INTO ledger (channel, account, message_id, chat, thread, sender,"
                        " payload, state, received_at, updated_at) VALUES (?,?,?,?,?,?,?,'received',?,?)",
                        (r.key.channel, r.key.account, r.key.message_id, r.chat, r.thread, r.sender, body, now, now),
                    )
                    created.append(cur.rowcount == 1)
            rows = [self.get(r.key) for r in receipts]
        except (CommitUnknown, sqlite3.OperationalError) as exc:
            if isinstance(exc, CommitUnknown) or len(created) == len(receipts):
                # Inserted here by a COMMIT whose answer was lost, or committed and not read back: the
                # rows may exist, and nobody acks them nor takes them in. Their redelivery does.
                self._remember_unheard([r.key for r, new in zip(receipts, created, strict=False) if new])
            raise
        out = []
        for r, new, entry in zip(receipts, created, rows, strict=True):
            assert entry is not None
            if r.key in self._unheard:
                del self._unheard[r.key]
                # recorded before by a write this process never heard back from, so never taken in
                new = new or entry.state == "received"
            out.append((entry, new))
        return out

    def _remember_unheard(self, keys: Iterable[UpdateKey]) -> None:
        for key in keys:
            self._unheard[key] = None
        while len(self._unheard) > UNHEARD_MAX:
            del self._unheard[next(iter(self._unheard))]

    def decide(self, key: UpdateKey, decision: Decision, reason: str, *, notice: bool = False) -> Entry:
        """Record the access decision (allow, deny, or pair: held until the sender is approved).
        `notice`: a notice to the sender follows (their pairing code, a refusal), owed from this same
        write on, so a crash before it went out does not lose it (`to_tell`)."""
        if not notice:
            return self._move(key, ("received",), _DECIDED[decision], decision=decision, reason=reason)
        owed = self._notice_mark(key)
        return self._move(key, ("received",), _DECIDED[decision], decision=decision, reason=reason, sending=owed)

    def release(self, key: UpdateKey, reason: str) -> Entry:
        """A held message's sender was approved: it becomes submittable (a pairing code still owed
        is no longer worth saying)."""
        return self._move(key, ("held",), "allowed", decision="allow", reason=reason, sending=None)

    def release_held(
        self, channel: str, account: str, sender: str, reason: str, still_allowed: Callable[[], bool]
    ) -> list[Entry] | None:
        """Release every message kept for `sender` (oldest first), in one transaction that first asks
        `still_allowed` (which reads the same database): the write lock is taken before it looks, so a
        revoke committed by another process is either seen (None: nothing released) or comes after."""
        who = (channel, account, sender)
        unheard = self._unheard_releases.pop(who, ())
        rows: list[tuple[Any, ...]] = []
        try:
            with transaction(self._conn, durable=False) as c:
                if not still_allowed():
                    return None
                rows = c.execute(
                    "SELECT message_id FROM ledger WHERE state='held' AND channel=? AND account=? AND sender=?"
                    " ORDER BY id",
                    (channel, account, sender),
                ).fetchall()
                c.execute(
                    "UPDATE ledger SET state='allowed', decision='allow', reason=?, updated_at=?, sending=NULL"
                    " WHERE state='held' AND channel=? AND account=? AND sender=?",
                    (reason, self._clock(), channel, account, sender),
                )
                # read back in the transaction (see `_move`): a retry after a lost read finds none held
                mids = [str(mid) for (mid,) in rows]
                released = [self.get(UpdateKey(channel, account, mid)) for mid in mids]
                # what an earlier run of this release moved and nothing submitted yet: its COMMIT's answer
                # lost, or its batch write after it lost (ChatOps._release) - released, never queued here
                done = c.execute(
                    "SELECT message_id FROM ledger WHERE state='allowed' AND reason=? AND channel=? AND account=?"
                    " AND sender=? ORDER BY id",
                    (reason, channel, account, sender),
                ).fetchall()
                later = [*(str(mid) for (mid,) in done), *unheard]
                earlier = [
                    self.get(UpdateKey(channel, account, mid)) for mid in dict.fromkeys(later) if mid not in mids
                ]
                released += [e for e in earlier if e is not None and e.state == "allowed" and e.reason == reason]
        except CommitUnknown:
            self._unheard_releases[who] = (*unheard, *(str(mid) for (mid,) in rows))
            raise
        return sorted((e for e in released if e is not None), key=lambda e: e.seq)

    def assign_batch(self, keys: Sequence[UpdateKey]) -> str:
        """Write down that these allowed messages (of one account) make one turn, before it is
        submitted: a resubmission after a crash is then the same batch. Returns the batch id (the
        first message's id); messages already in a batch keep theirs."""
        first = keys[0]
        with transaction(self._conn, durable=False) as c:
            c.executemany(
                "UPDATE ledger SET batch=? WHERE channel=? AND account=? AND message_id=? AND batch IS NULL",
                [(first.message_id, k.channel, k.account, k.message_id) for k in keys],
            )
        return first.message_id

    def batch_of(self, entry: Entry) -> list[Entry]:
        """Every message of `entry`'s batch, in order (just the entry when it is in none)."""
        if entry.batch is None:
            return [entry]
        rows = self._conn.execute(
            f"SELECT {_COLUMNS} FROM ledger WHERE channel=? AND account=? AND batch=? ORDER BY id",
            (entry.key.channel, entry.key.account, entry.batch),
        ).fetchall()
        return [_entry(r) for r in rows]

    def take_command(self, key: UpdateKey, answer_key: str, at: float) -> Entry:
        """An allowed chat command is about to take effect: written down durably first (in
        `sending`, as the key its answer goes out under and when), so a restart never runs it again
        (a second `/cancel` would stop the turn that started after the first; `Entry.command_taken`)."""
        mark = json.dumps({"part": answer_key, "at": at})
        with transaction(self._conn, durable=True) as c:
            c.execute(
                "UPDATE ledger SET sending=?, updated_at=? WHERE channel=? AND account=? AND message_id=?"
                " AND state='allowed' AND sending IS NULL",
                (mark, self._clock(), key.channel, key.account, key.message_id),
            )
            return self._require(key)  # in the transaction, as `_move` reads back

    def note_command_answer(self, key: UpdateKey, answer: str) -> None:
        """A taken command's answer (in `reply`), before it is sent: a restart sends this same text
        under the same key (deduped where the platform can) instead of running the command again."""
        with transaction(self._conn, durable=False) as c:
            c.execute(
                "UPDATE ledger SET reply=?, updated_at=? WHERE channel=? AND account=? AND message_id=?"
                " AND state='allowed'",
                (answer, self._clock(), key.channel, key.account, key.message_id),
            )

    def mark_command(self, key: UpdateKey, reason: str, remote_ids: Sequence[str | int] = ()) -> Entry:
        """A chat command the gateway answered itself (no turn): done, with the answer's ids."""
        ids = json.dumps([str(i) for i in remote_ids])
        return self._move(key, ("allowed",), "delivered", reason=reason, remote_ids=ids)

    def refuse(self, key: UpdateKey, reason: str) -> Entry:
        """A held message whose sender's pairing was denied (or expired): denied, with the reason; a
        pairing code still owed is no longer worth saying."""
        return self._move(key, ("held",), "denied", decision="deny", reason=reason, sending=None)

    def told(self, key: UpdateKey) -> None:
        """The notice `key` owed went out (or was given up, logged): a restart does not say it again."""
        with transaction(self._conn, durable=False) as c:
            c.execute(
                f"UPDATE ledger SET sending=NULL, updated_at=? WHERE channel=? AND account=? AND message_id=?"
                f" AND state IN ({','.join('?' * len(_TELLING))}) AND sending IS NOT NULL",
                (self._clock(), key.channel, key.account, key.message_id, *_TELLING),
            )

    def to_tell(self) -> list[Entry]:
        """Rows whose notice was owed when the gateway stopped (`Entry.owes_notice`), oldest first."""
        rows = self._conn.execute(
            f"SELECT {_COLUMNS} FROM ledger WHERE state IN ({','.join('?' * len(_TELLING))})"
            " AND sending IS NOT NULL ORDER BY id",
            _TELLING,
        ).fetchall()
        return [e for e in self._ours(map(_entry, rows)) if e.owes_notice]

    def _notice_mark(self, key: UpdateKey) -> str:
        return json.dumps({"part": notice_key(key), "at": self._clock()})

    def held(self, channel: str, account: str, sender: str) -> list[Entry]:
        """Messages kept while `sender`'s pairing is pending, oldest first."""
        rows = self._conn.execute(
            f"SELECT {_COLUMNS} FROM ledger WHERE state='held' AND channel=? AND account=? AND sender=? ORDER BY id",
            (channel, account, sender),
        ).fetchall()
        return [_entry(r) for r in rows]

    def mark_submitted(self, key: UpdateKey, turn_id: str, conversation: str | None = None) -> Entry:
        """The server accepted the turn (in `conversation`). Repeating with the same turn id is a no-op."""
        entry = self._require(key)
        if entry.state == "submitted" and entry.turn_id == turn_id:
            return entry
        if conversation is None:
            return self._move(key, ("allowed",), "submitted", turn_id=turn_id)
        return self._move(key, ("allowed",), "submitted", turn_id=turn_id, conversation=conversation)

    def note_sent(self, key: UpdateKey, remote_ids: Sequence[str | int], shown: str | None) -> None:
        """A reply occupies these platform messages so far (no state change), and while the turn
        runs shows `shown`: after a restart the reply continues in them, from that text, instead of
        sending again what the platform already has."""
        ids = json.dumps([str(i) for i in remote_ids])
        with transaction(self._conn, durable=False) as c:
            if shown is None:
                c.execute(
                    "UPDATE ledger SET remote_ids=?, updated_at=? WHERE channel=? AND account=?"
                    " AND message_id=? AND state IN ('submitted', 'finished')",
                    (ids, self._clock(), key.channel, key.account, key.message_id),
                )
            else:
                c.execute(
                    "UPDATE ledger SET remote_ids=?, reply=?, updated_at=? WHERE channel=? AND account=?"
                    " AND message_id=? AND state = 'submitted'",
                    (ids, shown, self._clock(), key.channel, key.account, key.message_id),
                )

    def note_sending(self, key: UpdateKey, part: str, at: float) -> None:
        """The reply part `part` (its `Target.key`) is about to be sent, first tried at `at`: after a
        crash before its id is noted, the restart looks for it instead of assuming it is not there."""
        mark = json.dumps({"part": part, "at": at})
        with transaction(self._conn, durable=False) as c:
            c.execute(
                "UPDATE ledger SET sending=?, updated_at=? WHERE channel=? AND account=? AND message_id=?"
                " AND state IN ('submitted', 'finished')",
                (mark, self._clock(), key.channel, key.account, key.message_id),
            )

    def mark_finished(self, key: UpdateKey, reply: str) -> Entry:
        """The turn settled with `reply` to deliver (kept so a restart can deliver it)."""
        return self._move(key, ("submitted",), "finished", reply=reply)

    def mark_delivered(self, key: UpdateKey, remote_ids: Sequence[str | int]) -> Entry:
        """The platform accepted the reply; `remote_ids` are its message ids."""
        ids = json.dumps([str(i) for i in remote_ids])
        return self._move(key, ("finished",), "delivered", remote_ids=ids)

    def mark_failed(self, key: UpdateKey, reason: str, *, notice: str | None = None) -> Entry:
        """Give up on this update with a reason shown by `channels status`; never silent. `notice`:
        what the chat is told of it, kept (in `reply`) and owed from this same write on (`to_tell`)."""
        sources: tuple[State, ...] = ("allowed", "submitted", "finished")
        if notice is None:
            return self._move(key, sources, "failed", reason=reason)
        return self._move(key, sources, "failed", reason=reason, reply=notice, sending=self._notice_mark(key))

    def move_chat(self, channel: str, account: str, old: str, new: str) -> ChatMove:
        """The platform gave chat `old` the id `new` for good (a Telegram group upgraded to a
        supergroup): what gateway.db keeps under the chat (its routes, the conversations bound to it
        and its threads, its waiting approval prompts) moves to the new id in one durable
        transaction, so the chat's history, agent and pending answers follow it. The messages of
        the chat not submitted yet (waiting their turn, held by debounce) move too
        (`_move_waiting_rows`), so they are routed as the chat now is; the others keep the id their
        reply went to (their message ids hold it too); sender access is per sender, unaffected.
        Moving again finds nothing left under the old id: a no-op."""
        with transaction(self._conn, durable=True) as c:
            routes, conversations = move_chat_keys(c, channel, account, old, new)
            prompts = move_prompt_rows(c, f"{channel}:{account}", old, new)
            waiting = _move_waiting_rows(c, channel, account, old, new)
        return ChatMove(routes, conversations, prompts, waiting)

    def get(self, key: UpdateKey) -> Entry | None:
        row = self._conn.execute(
            f"SELECT {_COLUMNS} FROM ledger WHERE channel=? AND account=? AND message_id=?",
            (key.channel, key.account, key.message_id),
        ).fetchone()
        return _entry(row) if row else None

    def to_decide(self) -> list[Entry]:
        """Recorded (and acked) but no access decision yet: a crash came in between."""
        return self._in_state("received")

    def to_submit(self) -> list[Entry]:
        """Allowed and not yet accepted by the server: submit with the entry's idempotency key."""
        return self._in_state("allowed")

    def in_flight(self) -> list[Entry]:
        """Accepted turns whose outcome is not recorded yet: watch them, never submit again."""
        return self._in_state("submitted")

    def answered_since(self, seq: int, reason: str) -> list[Entry]:
        """Chat commands answered (`mark_command` with `reason`, e.g. `command /cancel`) after the
        row `seq`, oldest first: what a restart asks of a turn still `submitted` before them (a
        `/cancel` that withdrew it, whose own answer went out before the gateway died again)."""
        rows = self._conn.execute(
            f"SELECT {_COLUMNS} FROM ledger WHERE state='delivered' AND reason=? AND id>? ORDER BY id", (reason, seq)
        ).fetchall()
        return self._ours(map(_entry, rows))

    def last_admitted(self, channel: str, account: str, chat: str) -> Entry | None:
        """The newest message of `chat` that access let in (decided `allow`, or released by an
        approval), or None: a chat only refused (a stranger under `allowlist`) is no chat the account
        talks to (`channeltool.reachable`), and its type and sender are those of someone let in."""
        row = self._conn.execute(
            f"SELECT {_COLUMNS} FROM ledger WHERE channel=? AND account=? AND chat=? AND decision='allow'"
            " ORDER BY id DESC LIMIT 1",
            (channel, account, chat),
        ).fetchone()
        return _entry(row) if row else None

    def last_admitted_in(self, conversation: str) -> Entry | None:
        """The newest message access let in that went to `conversation`: the chat (and thread) whose
        conversation it is, for a turn there no message started (a scheduled run's approval)."""
        row = self._conn.execute(
            f"SELECT {_COLUMNS} FROM ledger WHERE conversation=? AND decision='allow' ORDER BY id DESC LIMIT 1",
            (conversation,),
        ).fetchone()
        return _entry(row) if row else None

    def to_deliver(self) -> list[Entry]:
        """Turns that finished but whose reply was not recorded as delivered."""
        return self._in_state("finished")

    def last_activity(self, channel: str, account: str) -> tuple[float | None, float | None]:
        """When the account's last message came in, and when its last answer (a reply or a command's
        answer) was delivered: what `channels status` shows as last inbound and outbound, read back at
        a start (a kill -9 can lose the last second of the saved status, the ledger has it)."""
        last_in, last_out = self._conn.execute(
            "SELECT MAX(received_at), MAX(CASE WHEN state='delivered' AND remote_ids != '[]' THEN updated_at END)"
            " FROM ledger WHERE channel=? AND account=?",
            (channel, account),
        ).fetchone()
        return last_in, last_out

    def counts(self) -> dict[str, int]:
        """Rows per state, for `channels status`."""
        rows = self._conn.execute("SELECT state, COUNT(*) FROM ledger GROUP BY state").fetchall()
        return {state: n for state, n in rows}

    def last_failures(self) -> dict[tuple[str, str], tuple[str, str | None, float]]:
        """Per (channel, account), its most recent `failed` row: (message id, reason, when)."""
        rows = self._conn.execute(
            # the row that holds each account's latest failure (both backends: no bare columns beside a MAX)
            "SELECT channel, account, message_id, reason, updated_at FROM ledger f WHERE state='failed'"
            " AND updated_at = (SELECT MAX(l.updated_at) FROM ledger l WHERE l.state='failed'"
            "  AND l.channel=f.channel AND l.account=f.account) ORDER BY id"
        ).fetchall()
        return {(channel, account): (message_id, reason, at) for channel, account, message_id, reason, at in rows}

    def prune(self, before: float, *, after: int = 0, scan: int = PRUNE_SCAN) -> tuple[int, int | None]:
        """Delete the rows that settled before `before` (epoch seconds) among the `scan` rows after
        id `after`, in one short transaction. Returns how many went and the id to go on after (None:
        the rest are newer). Kept whatever their age: a row not settled, the newest row of each chat
        and its newest row access let in (what makes it a chat the account talks to:
        `channeltool.reachable`, `last_admitted`), and the rows of a batch while any of its messages
        is not settled (`batch_of` reads them together)."""
        rows = self._conn.execute(
            "SELECT id, received_at, channel, account FROM ledger WHERE id > ? ORDER BY id LIMIT ?", (after, scan)
        ).fetchall()
        aged = list(itertools.takewhile(lambda r: r[1] < before, rows))
        # a database shared with other servers' gateways: only this one's accounts (theirs prune their own)
        old = [row_id for row_id, _, channel, account in aged if in_scope(self._conn, channel, account)]
        done = len(aged) < len(rows) or len(rows) < scan
        if not aged:
            return 0, None
        if not old:
            return 0, None if done else aged[-1][0]
        settled = ",".join("?" * len(SETTLED))
        with transaction(self._conn, durable=False) as c:
            cur = c.execute(
                f"DELETE FROM ledger WHERE id IN ({','.join('?' * len(old))}) AND state IN ({settled})"
                " AND updated_at < ?"
                " AND id < (SELECT MAX(n.id) FROM ledger n"
                "  WHERE n.channel=ledger.channel AND n.account=ledger.account AND n.chat=ledger.chat)"
                " AND id <> COALESCE((SELECT MAX(a.id) FROM ledger a WHERE a.channel=ledger.channel"
                "  AND a.account=ledger.account AND a.chat=ledger.chat AND a.decision='allow'), -1)"
                " AND (batch IS NULL OR NOT EXISTS (SELECT 1 FROM ledger b WHERE b.channel=ledger.channel"
                f"  AND b.account=ledger.account AND b.batch=ledger.batch AND b.state NOT IN ({settled})))",
                (*old, *SETTLED, before, *SETTLED),
            )
            deleted = cur.rowcount
        return deleted, None if done else aged[-1][0]

    def _in_state(self, state: State) -> list[Entry]:
        rows = self._conn.execute(f"SELECT {_COLUMNS} FROM ledger WHERE state=? ORDER BY id", (state,)).fetchall()
        return self._ours(map(_entry, rows))

    def _ours(self, entries: Iterable[Entry]) -> list[Entry]:
        """The entries of the accounts this gateway runs, when its database is shared with other
        servers' gateways (`sqlstore.scope_of`); every entry of the home's own gateway.db."""
        return [e for e in entries if in_scope(self._conn, e.key.channel, e.key.account)]

    def _require(self, key: UpdateKey) -> Entry:
        entry = self.get(key)
        if entry is None:
            raise LedgerStateError(f"{key} is not in the ledger")
        return entry

    def _move(self, key: UpdateKey, sources: tuple[State, ...], target: State, **fields: str | None) -> Entry:
        sets = "".join(f", {name}=?" for name in fields)
        marks = ",".join("?" * len(sources))
        with transaction(self._conn, durable=False) as c:
            cur = c.execute(
                f"UPDATE ledger SET state=?, updated_at=?{sets} WHERE channel=? AND account=?"
                f" AND message_id=? AND state IN ({marks})",
                (
                    target,
                    self._clock(),
                    *fields.values(),
                    key.channel,
                    key.account,
                    key.message_id,
                    *sources,
                ),
            )
            moved = cur.rowcount == 1
            # read back in the same transaction: on PostgreSQL a read after the commit can fail (the
            # session lost) and the caller's retry would find the move already made
            entry = self._require(key)
        if not moved:
            if entry.state == target and _made(entry, fields):
                # this very move was made already: run again after its COMMIT's answer was lost
                # (PostgreSQL, `CommitUnknown`), so it is done, not refused
                return entry
            raise LedgerStateError(f"{key}: cannot move from {entry.state} to {target}")
        return entry


def _made(entry: Entry, fields: Mapping[str, str | None]) -> bool:
    """Whether `entry` holds what a move writing `fields` wrote: its decision, turn, reply, the
    reply's ids, the part or notice its `sending` names (not when: a step run again takes a new
    time). `reason` is not compared: it is stored masked (gateway/redact.py)."""
    for name, value in fields.items():
        if name == "reason":
            continue
        if name == "sending":
            part = _sending(value)
            if (part[0] if part else None) != (entry.sending[0] if entry.sending else None):
                return False
        elif name == "remote_ids":
            if value is None or tuple(json.loads(value)) != entry.remote_ids:
                return False
        elif getattr(entry, name) != value:
            return False
    return True


def notice_key(key: UpdateKey) -> str:
    """The key a row's owed notice goes out under (`Target.key`): the same at a restart's resend, so
    a platform that dedupes or can be asked does not show it twice."""
    return f"{NOTICE_MARK}{key.idempotency_key}"


# A message not submitted yet: its chat is still only where it is to be answered (`_move_waiting_rows`).
_WAITING: tuple[State, ...] = ("received", "allowed", "held")


def _move_waiting_rows(c: sqlite3.Connection, channel: str, account: str, old: str, new: str) -> int:
    """Re-point the not yet submitted messages of chat `old` (queued, held by debounce or pairing)
    to chat `new`, inside `Ledger.move_chat`'s transaction: the gateway reads the chat of a message
    from its row when it submits it, so a message sent before the move is routed as the chat is now
    (its agent, its conversation, its approval policy), never by a route left behind under the old
    id or the default agent. Their keys keep the old id: it names the message on the platform."""
    marks = ",".join("?" * len(_WAITING))
    cur = c.execute(
        f"UPDATE ledger SET chat=? WHERE channel=? AND account=? AND chat=? AND state IN ({marks})",
        (new, channel, account, old, *_WAITING),
    )
    return cur.rowcount


_COLUMNS = (
    "id, channel, account, message_id, chat, thread, sender, payload, state, decision, reason,"
    " turn_id, conversation, reply, remote_ids, received_at, updated_at, batch, sending"
)


def _entry(row: tuple[Any, ...]) -> Entry:
    return Entry(
        seq=row[0],
        key=UpdateKey(row[1], row[2], row[3]),
        chat=row[4],
        thread=row[5],
        sender=row[6],
        payload=json.loads(row[7]),
        state=cast(State, row[8]),
        decision=cast("Decision | None", row[9]),
        reason=row[10],
        turn_id=row[11],
        conversation=row[12],
        reply=row[13],
        remote_ids=tuple(json.loads(row[14])),
        received_at=row[15],
        updated_at=row[16],
        batch=row[17],
        sending=_sending(row[18]),
    )


def _sending(raw: str | None) -> tuple[str, float] | None:
    if not raw:
        return None
    try:
        mark = json.loads(raw)
        return str(mark["part"]), float(mark["at"])
    except (ValueError, KeyError, TypeError):
        return None


async def prune_settled(ledger: Ledger, before: float) -> int:
    """Delete every row `Ledger.prune` may that settled before `before`, a short transaction at a
    time with the event loop let go in between (the gateway's messages are never held up long).
    Returns how many rows went; a database error is raised (the next pass tries again)."""
    total, after = 0, 0
    while True:
        deleted, cursor = ledger.prune(before, after=after)
        total += deleted
        if cursor is None:
            return total
        after = cursor
        await asyncio.sleep(0)
