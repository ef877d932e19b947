"""Several servers on one PostgreSQL database: instances, conversation leases, and messages.

Each `appserver serve` on a PostgreSQL store registers an **instance** (a row in `instances`) and
holds a session advisory lock keyed by that row on a connection of its own: the *session*. The
session LISTENs for the cluster's notifications and renews the row's heartbeat every
`heartbeat_s`. An instance is **gone** when its heartbeat is older than `instance_timeout_s`, or
when its lock is free (the session ended: PostgreSQL frees it at once when a killed process's
socket closes) and its heartbeat is older than a grace of 2.5 heartbeats (so a server whose session
the database dropped and that takes it again at once is not judged gone meanwhile). Both are the
instance's own, recorded in its row: servers whose `[store]` timings differ judge each other each
by the timings it promised (and fences itself by, `Cluster.fenced`), never by their own.

A conversation's runtime lives in one instance at a time: loading it takes the conversation's
lease (`conversation_owners`), which another instance can take only once the holder is gone or
let go (a holder deletes its lease when it drops an idle runtime). Instances talk through NOTIFY:
each listens on a channel of its own (requests and replies: `send`, `call`) and all on one
channel for turn snapshots (`publish_turn`). A payload larger than NOTIFY allows goes through the
`cluster_mail` table and the notification carries its id.

Everything here judges time by the database's clock, so hosts whose clocks differ agree.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import socket
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from appserver.ids import new_id
from appserver.store.base import StoreUnavailable

if TYPE_CHECKING:  # the driver is imported only by a server that joins a cluster (a PostgreSQL store)
    import psycopg
    from psycopg.rows import DictRow

    Conn = psycopg.AsyncConnection[DictRow]

log = logging.getLogger("appserver.cluster")
T = TypeVar("T")

# classid of every instance lock (pg_advisory_lock(int4, int4): classid, objid = the row's lock_key).
INSTANCE_LOCK_CLASS = 0x61707069
TURNS_CHANNEL = "appserver_turns"
NOTIFY_MAX = 7000  # bytes of payload sent inline; PostgreSQL allows a little under 8,000
MAIL_TTL_S = 300.0
CALL_TIMEOUT_S = 10.0
# A call with a key is sent again this often until its reply comes: a notification is lost while
# the peer's session (its LISTEN) or this server's is being taken again. The peer runs each key once.
RESEND_S = 1.0
SERVED_TTL_S = 300.0  # how long a peer remembers the reply to a key it ran
SERVED_MAX = 4096  # and at most this many of them
# A read is given up after 2.5 heartbeats unanswered, never sooner than this: with short heartbeats
# on a busy host, a round trip and the heartbeat can both be late without the database hanging.
READ_WAIT_MIN_S = 5.0
# A notification needs no durability (a lost one is made up for by the store, which the others
# read when they hear nothing): its transaction does not wait for the WAL to reach the disk.
NO_FLUSH = "set_config('synchronous_commit', 'off', true)"

NOW = "extract(epoch from clock_timestamp())"
LOCK_HELD = (
    "EXISTS (SELECT 1 FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2 "
    f"AND l.classid = {INSTANCE_LOCK_CLASS} AND l.objid = i.lock_key::oid)"
)
# By the judge's timings alone: for a schema before the instances recorded theirs (`_live_instances`
# asks before migrating) and cron's lease (cron/pgstore.py).
LIVE = f"(i.heartbeat_at >= {NOW} - %(timeout)s AND (i.heartbeat_at >= {NOW} - %(grace)s OR {LOCK_HELD}))"
# `back` while this server cannot judge (its session away, its own heartbeat overdue): every
# heartbeat counts as fresh (1e15 s is some 30 million years ahead, and exact in a double).
AWAY = 1e15
# How a server of the cluster judges the others (`Cluster.params`): as LIVE, but each heartbeat
# counts from no earlier than `back`, the database time this server's own heartbeat was renewed
# after a gap (its session lost, or the database hung: after an outage every heartbeat is stale,
# and each instance gets a full timeout from then to renew its own), and nobody is judged at all
# while it cannot judge (`back` in the future). `until`: the database time after which the
# statement judges nobody either. A statement sent while this server's heartbeat was fresh may be
# held up on its way (a database that hangs answers everything that waited at once when it comes
# back, before any heartbeat is renewed): run late, it would find every heartbeat stale.
BEAT = f"GREATEST(i.heartbeat_at, %(back)s, CASE WHEN {NOW} > %(until)s THEN {AWAY:.0f}::float8 ELSE 0 END)"
# Each instance by its own timeout and grace, those its row recorded (a row of an older version has
# none: by the judge's, `timeout` and `grace`). A server that judges by the timeout alone for now
# (`grace` no shorter than `timeout`: just back, see `Cluster.params`) gives each its own timeout.
OWN_TIMEOUT = "COALESCE(i.instance_timeout_s, %(timeout)s)"
OWN_GRACE = f"CASE WHEN %(grace)s >= %(timeout)s THEN {OWN_TIMEOUT} ELSE COALESCE(i.heartbeat_s * 2.5, %(grace)s) END"
LIVE_SINCE = f"({BEAT} >= {NOW} - {OWN_TIMEOUT} AND ({BEAT} >= {NOW} - {OWN_GRACE} OR {LOCK_HELD}))"


class Database(Protocol):
    """What the cluster uses of the PostgreSQL store: where it is, its pooled statements, and its
    ordered, group-committing writer."""

    url: str
    connect_timeout_s: float

    async def _write(self, job: Callable[[Conn], Awaitable[T]]) -> T: ...

    async def _row(self, query: str, params: tuple[Any, ...] | Mapping[str, Any] = ()) -> Any: ...

    async def _rows(self, query: str, params: tuple[Any, ...] | Mapping[str, Any] = ()) -> list[Any]: ...


class ClusterError(Exception):
    """A peer did not answer, or answered with an error it could not describe."""


class PeerError(Exception):
    """A peer answered a call with an error: `kind` and `data` as the peer described it."""

    def __init__(self, kind: str, message: str, data: dict[str, Any]) -> None:
        super().__init__(message)
        self.kind = kind
        self.data = data


@dataclass(slots=True, frozen=True)
class Lease:
    """The outcome of taking a conversation's lease: held here (`token`) or by `holder`."""

    token: str | None = None
    holder: str | None = None


MessageHandler = Callable[[str, dict[str, Any]], Any]  # (op, args) -> awaitable result (JSON-able)
NoticeHandler = Callable[[str, str, int, str], None]  # conv, turn, revision, body (or "@<mail id>")


def channel_of(instance_id: str) -> str:
    return "appserver_" + instance_id.lower()


class Cluster:
    """This server's membership of the database's cluster. Started by `PostgresStore.claim_server`."""

    def __init__(self, store: Database, *, heartbeat_s: float, instance_timeout_s: float, address: str) -> None:
        self.store = store
        self.heartbeat_s = heartbeat_s
        self.instance_timeout_s = instance_timeout_s
        self.address = address
        self.instance_id = new_id("inst")
        self.lock_key = secrets.randbelow(2**31 - 2) + 1
        self.peers = 0  # live instances besides this one, as of the last heartbeat
        # The shortest timeout this server judges a live instance by (its own, or a peer's that
        # recorded a shorter one), as of the last heartbeat: it bounds `trust_s`.
        self._shortest_timeout_s = instance_timeout_s
        self.on_more_peers: Callable[[], None] | None = None  # the kernel: the count rose (one joined)
        self._session: Conn | None = None
        self._task: asyncio.Task[None] | None = None
        self._calls: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._on_message: MessageHandler | None = None
        self._on_notice: NoticeHandler | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stopped = False
        self.lost = False  # the instance row was deleted by a survivor: this server was judged gone
        self._left = False  # judged gone, its row and leases were deleted (`_leave`)
        self._held: dict[str, str] = {}  # conversation id -> token of each lease taken and not let go
        self._up_since: float | None = None  # when the session was (re)connected
        self._returned = False  # its session was taken again, or its heartbeat renewed after a gap
        self._down_since: float | None = None  # when it was lost, while it is
        self._beat_ok = time.monotonic()  # when the heartbeat was last renewed (or the session taken)
        self._beat_db = 0.0  # the database time of that renewal
        # The database time the heartbeat was renewed after a gap (the session lost, the database
        # hung; 0: never), from which the others' heartbeats count.
        self._back_at = 0.0
        self.on_lost: Callable[[], None] | None = None  # the kernel: stop what runs here
        # channels: told the moment `cut_off` turns true (its session lost, or judged gone), to
        # pause its gateway's intake at once rather than at its next word (appserver/channels.py)
        self.on_cut_off: Callable[[], None] | None = None
        # The store's repairs (writes an outage made fail), run after a heartbeat renewed.
        self.after_beat: Callable[[], Awaitable[None]] | None = None
        self._repairing: asyncio.Task[None] | None = None
        self._said_unserved = False  # a request from a peer refused while fenced was logged
        # key of a call run here -> (when, its reply): a repeat of the key gets that reply, never a second run
        self._served: OrderedDict[str, tuple[float, asyncio.Future[dict[str, Any]]]] = OrderedDict()

    @property
    def trust_s(self) -> float:
        """How long after its own heartbeat's last renewal this server still judges the others.
        Half the shortest timeout it judges anyone by (its own, or a live peer's recorded one): the
        others' heartbeats, renewed at most a third of their timeout apart, look at most this much
        older than they are when a stall of the whole database ends, still short of their timeout.
        Half its own alone was 15 s at the defaults, and a stall of a few seconds made a peer with a
        1.5 s timeout look gone to it: judged by its own blindness."""
        return min(self.instance_timeout_s, self._shortest_timeout_s) / 2

    @property
    def beat_s(self) -> float:
        """How often this server renews its heartbeat: its own period, or more often beside a peer
        with a shorter timeout. A renewal is how it knows it still sees the database: renewed less
        often than `trust_s`, it would stop judging between renewals (a dead quick peer never
        judged gone); a third of the shortest timeout, as `[store]` allows at the most."""
        return min(self.heartbeat_s, self.trust_s * 2 / 3)

    @property
    def params(self) -> dict[str, float]:
        """How the others are judged (the parameters of LIVE_SINCE: `timeout` and `grace` are this
        server's, for a row that recorded none of its own). While this instance's own
        session is away, or its own heartbeat was not renewed for `trust_s` (the database hangs,
        or is too slow to answer it, or this process was stopped), not at all: everyone counts as
        live (its pool may reach the database before its session does, and its sweep would judge by
        heartbeats nobody could renew). So neither does a statement that runs later than `trust_s`
        after that renewal (`until`: sent before a hang, run when it ends). Once its heartbeat is
        renewed after such a gap, each heartbeat counts from no earlier than that moment (`back`):
        after an outage of the whole database longer than the timeout every heartbeat is stale, and
        the first server back judged all the others gone (each of them fenced) before their
        sessions were back too. And until it has been up for a few heartbeats, only by the
        timeout; back after a loss or a gap, for its whole timeout: the others' sessions (and
        locks) come back after its own, as late as a loaded host makes them (a lock-free grace
        from a few heartbeats on fenced a live peer whose session came back 0.7 s after this
        one's, at 0.2 s heartbeats); one not back by then is gone by its timeout. (A server just
        started keeps the few heartbeats: a killed one it replaces is taken over in seconds.)"""
        grace = self.heartbeat_s * 2.5
        now = time.monotonic()
        unsettled_s = grace + self.heartbeat_s
        if self._returned:
            unsettled_s = max(unsettled_s, self.instance_timeout_s)
        settled = self._up_since is not None and now - self._up_since >= unsettled_s
        away = self._up_since is None or now - self._beat_ok > self.trust_s
        timeout = self.instance_timeout_s
        return {
            "timeout": timeout,
            "grace": grace if settled else timeout,
            "back": AWAY if away else self._back_at,
            "until": self._beat_db + self.trust_s,
        }

    def _renewed(self, at: float) -> None:
        """This instance's heartbeat was renewed at database time `at`. After a gap longer than
        `trust_s` (by either clock: the database hung or was away, or this process was stopped),
        the others' heartbeats count from then on (`back`), and the lock-free grace waits a few
        heartbeats again: a stall of the whole database kept them from renewing theirs too, and
        the first server whose heartbeat goes through (its connection released a moment before the
        others') judged every other one gone."""
        now = time.monotonic()
        if max(at - self._beat_db, now - self._beat_ok) > self.trust_s:
            self._back_at = at
            self._up_since = now
            self._returned = True
        self._beat_db = at

    @property
    def fenced(self) -> bool:
        """Runs nothing: judged gone (`lost`), or its session away longer than the grace, after
        which the others may judge it gone and take its conversations over at any moment."""
        if self.lost:
            return True
        now = time.monotonic()
        if self._down_since is not None and now - self._down_since > self.heartbeat_s * 2.5:
            return True
        # its heartbeat not renewed (a session that hangs): judged gone at the timeout, lock or not
        return now - self._beat_ok > self.instance_timeout_s - self.heartbeat_s

    @property
    def fenced_in(self) -> float:
        """Seconds until this server is `fenced` unless its heartbeat is renewed (or its session
        taken again) meanwhile; 0 when it is. Its gateway takes messages no longer than this."""
        if self.lost:
            return 0.0
        now = time.monotonic()
        left = self._beat_ok + self.instance_timeout_s - self.heartbeat_s - now
        if self._down_since is not None:
            left = min(left, self._down_since + self.heartbeat_s * 2.5 - now)
        return max(0.0, left)

    @property
    def cut_off(self) -> bool:
        """May the others have taken this server's conversations over without its knowing? Fenced,
        or its session away at all: the others judge it gone by its free lock once the grace has
        passed, and it cannot tell until its session is back. A turn whose write fails now is not
        told it failed (runtime/finish.py): its end is read from the database once it can be."""
        return self._down_since is not None or self.fenced

    @property
    def read_wait_s(self) -> float:
        """How long a read waits for the database at most: 2.5 heartbeats, never under READ_WAIT_MIN_S."""
        return max(self.heartbeat_s * 2.5, READ_WAIT_MIN_S)

    @property
    def unread_in(self) -> float:
        """Seconds a turn this server let go unsaved while cut off (runtime `Kernel._cut_off`) is
        given for its end to be read from the database: until the others may have taken its
        conversation over (`fenced_in`), then one read wait (`read_wait_s`) for the end they wrote.
        A request still waiting for that end then is told it could not be read (http: 503)."""
        return self.fenced_in + self.read_wait_s

    def answering(self, since: float) -> bool:
        """Has the database renewed this server's heartbeat since `since` (monotonic), or not yet
        been given 2.5 heartbeats (at least READ_WAIT_MIN_S) to?"""
        return self._beat_ok >= since or time.monotonic() - since <= self.read_wait_s

    async def answered(self, work: Awaitable[T], what: str) -> T:
        """`work` (a read: safe to give up), given up with StoreUnavailable once the database has
        answered neither it nor this server's heartbeat for 2.5 heartbeats (at least 5 s). A database that hangs
        (its connections open, nothing answered) is ended by no statement_timeout, which it
        enforces itself: a request waited as long as the hang lasted. Given up, `work` is
        cancelled and ends in the background (psycopg tries to cancel the statement, then closes
        its connection)."""
        task = asyncio.ensure_future(work)
        began = time.monotonic()
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=min(0.5, self.heartbeat_s))
                if done:
                    return task.result()
                if not self.answering(began):
                    raise StoreUnavailable(
                        f"{what}: the database answered neither it nor this server's heartbeat for "
                        f"{time.monotonic() - began:.1f} s (it hangs, or cannot be reached)"
                    )
        finally:
            if not task.done():
                task.cancel()
                task.add_done_callback(_retrieved)

    # ------------------------------------------------------------ membership

    async def start(self) -> None:
        """Register, take the instance lock and listen (raises StoreOpenError when it cannot)."""
        await self._connect()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="cluster-session")

    def handle(self, on_message: MessageHandler, on_notice: NoticeHandler) -> None:
        """Where requests from peers and turn notices go (the kernel's side of the cluster)."""
        self._on_message = on_message
        self._on_notice = on_notice

    async def _connect(self, *, again: bool = False) -> None:
        import psycopg
        from psycopg.rows import dict_row

        conn = await psycopg.AsyncConnection.connect(
            self.store.url,
            autocommit=True,
            row_factory=dict_row,
            connect_timeout=max(1, int(self.store.connect_timeout_s)),
            application_name=f"appserver serve {self.instance_id}"[:63],
        )
        try:
            # Never a blocking wait: after a lost session the old one may linger in the database
            # until it notices; then this try fails and the session loop tries again shortly.
            cur = await conn.execute("SELECT pg_try_advisory_lock(%s, %s) AS got", (INSTANCE_LOCK_CLASS, self.lock_key))
            got = await cur.fetchone()
            if not (got and got["got"]):
                raise ClusterError(f"the lock of instance {self.instance_id} is still held by its earlier session")
            if again and self.lost:
                await self._leave(conn)
            elif again:
                # Never registered anew: a survivor that judged this instance gone deleted its row
                # and took its conversations over, and a row put back would make it live again
                # beside them (two servers running one conversation).
                cur = await conn.execute(
                    f"UPDATE instances SET heartbeat_at = {NOW} WHERE id = %s RETURNING heartbeat_at",
                    (self.instance_id,),
                )
                row = await cur.fetchone()
                if row is None or not await self._leases_still_held(conn):
                    self.judged_gone()
                    await self._leave(conn)
                elif row is not None:
                    # The others' heartbeats count from now (`back`) only after a gap that matters
                    # (`_renewed`): taken again after every short loss (a database that keeps ending
                    # sessions), a killed server was never judged gone. The lock-free grace waits a
                    # timeout again after any (`_up_since`, below): the others' sessions, ended
                    # with this one (a restart of the database), come back after it.
                    self._renewed(float(row["heartbeat_at"]))
            else:
                cur = await conn.execute(
                    "INSERT INTO instances(id, host, pid, address, lock_key, started_at, heartbeat_at, "
                    f"heartbeat_s, instance_timeout_s) VALUES (%s, %s, %s, %s, %s, {NOW}, {NOW}, %s, %s) "
                    "RETURNING heartbeat_at",
                    (
                        self.instance_id,
                        socket.gethostname(),
                        os.getpid(),
                        self.address,
                        self.lock_key,
                        self.heartbeat_s,
                        self.instance_timeout_s,
                    ),
                )
                row = await cur.fetchone()
                self._beat_db = float(row["heartbeat_at"]) if row else 0.0
            await conn.execute(f"LISTEN {channel_of(self.instance_id)}")
            await conn.execute(f"LISTEN {TURNS_CHANNEL}")
        except BaseException:
            await conn.close()
            raise
        self._session = conn
        self._up_since = self._beat_ok = time.monotonic()
        self._returned = self._returned or again
        self._down_since = None
        await self._count_peers(conn)

    async def _count_peers(self, conn: Conn) -> None:
        """Count the live peers, and note the shortest timeout among the live rows (`trust_s`)."""
        cur = await conn.execute(
            f"SELECT count(*) AS n, min({OWN_TIMEOUT}) AS shortest FROM instances i WHERE {LIVE_SINCE}", self.params
        )
        row = await cur.fetchone()
        before, self.peers = self.peers, max(0, int(row["n"]) - 1) if row else 0
        shortest = row["shortest"] if row else None
        self._shortest_timeout_s = float(shortest) if shortest is not None else self.instance_timeout_s
        if self.peers > before and self.on_more_peers is not None:
            self.on_more_peers()

    async def _run(self) -> None:
        """Listen; renew the heartbeat; take the session again when the database ended it."""
        beat_at = time.monotonic()
        said_at = 0.0
        while not self._stopped:
            conn = self._session
            try:
                if conn is None or conn.closed:
                    self._session_lost()
                    await self._connect(again=True)
                    if not self.lost:
                        log.warning("cluster: the database ended this instance's session; taken again")
                    continue
                # Listened to until the next beat is due, not on a fixed grid: beside a peer at the
                # shortest timings (0.1 s / 1 s) a beat landing on the next 0.25 s step came later
                # than `trust_s`, and every renewal then read as a return after a gap (`_renewed`):
                # nobody was ever judged gone.
                due = beat_at + self.beat_s - time.monotonic()
                async for note in conn.notifies(timeout=max(0.005, min(0.25, due))):
                    self._dispatch(note.channel, note.payload)
                if time.monotonic() - beat_at >= self.beat_s and self.lost:
                    beat_at = time.monotonic()
                    await self._leave(conn)  # a no-op once done; the session only listens now
                    self._beat_ok = time.monotonic()
                elif time.monotonic() - beat_at >= self.beat_s:
                    # Late (the process was stopped, or starved): others may have judged it gone.
                    late = time.monotonic() - self._beat_ok > self.heartbeat_s * 2.5
                    beat_at = time.monotonic()
                    cur = await conn.execute(
                        f"UPDATE instances SET heartbeat_at = {NOW} WHERE id = %s RETURNING heartbeat_at",
                        (self.instance_id,),
                    )
                    row = await cur.fetchone()
                    if row is not None:
                        self._renewed(float(row["heartbeat_at"]))
                    if row is None or (late and not await self._leases_still_held(conn)):
                        self.judged_gone()
                        await self._leave(conn)
                    self._beat_ok = time.monotonic()
                    await self._count_peers(conn)
                    self._repair()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._session_lost()  # before the close, which awaits
                if self._session is not None:
                    await self._session.close()
                self._session = None
                self._up_since = None
                now = time.monotonic()
                if now - said_at >= 30.0:
                    said_at = now
                    log.error("cluster: lost the database session of instance %s: %s", self.instance_id, exc)
                await asyncio.sleep(min(0.5, self.heartbeat_s))

    def _session_lost(self) -> None:
        """Its session is away (`cut_off` from now on): noted once, and said at once (`on_cut_off`)."""
        if self._down_since is None:
            self._down_since = time.monotonic()
            if self.on_cut_off is not None:
                self.on_cut_off()

    def _repair(self) -> None:
        """Run the store's repairs (`after_beat`) in the background, one run at a time: the
        heartbeat just renewed, so the database is reachable again."""
        if self.after_beat is None or self.lost or (self._repairing is not None and not self._repairing.done()):
            return
        self._repairing = asyncio.get_running_loop().create_task(self._run_repair(self.after_beat))

    async def _run_repair(self, repair: Callable[[], Awaitable[None]]) -> None:
        try:
            await repair()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # tried again after the next heartbeat
            log.warning("cluster: the store's repairs failed (tried again shortly): %s", exc)

    async def _leases_still_held(self, conn: Conn) -> bool:
        """Does this instance still hold every conversation lease it took? While its session was
        away it was not live, and another server may have taken one (a request for it there)."""
        held = dict(self._held)
        if not held:
            return True
        cur = await conn.execute(
            "SELECT conversation_id, token FROM conversation_owners WHERE conversation_id = ANY(%s)", (list(held),)
        )
        rows = {r["conversation_id"]: r["token"] for r in await cur.fetchall()}
        return all(rows.get(conversation_id) == token for conversation_id, token in held.items())

    async def _leave(self, conn: Conn) -> None:
        """Judged gone, leave the cluster as a stopping server does: delete this instance's leases
        and row. Its heartbeat renewed a row a survivor had not yet deleted (it came back before the
        survivor's sweep, or only one of its leases was taken): it stayed a live member that runs
        nothing, and its other conversations and its channel accounts were never taken over."""
        if self._left:
            return
        await _delete_membership(conn, self.instance_id)
        self._left = True

    def judged_gone(self) -> None:
        """This instance's row is gone: a survivor judged it gone and took its conversations over.
        From now on it runs nothing (the kernel refuses, `/readyz` fails): restart it."""
        if self.lost:
            return
        self.lost = True
        if self.on_lost is not None:
            self.on_lost()
        if self.on_cut_off is not None:
            self.on_cut_off()
        # The timings its row recorded, which the others judge it by (`LIVE_SINCE`).
        log.error(
            "cluster: instance %s was judged gone by another server (its heartbeat stopped for longer than "
            "%g s, or its database session for %g s); its conversations were taken over and it runs "
            "nothing more: restart it",
            self.instance_id,
            self.instance_timeout_s,
            self.heartbeat_s * 2.5,
        )

    async def stop(self) -> None:
        """Leave the cluster: delete this instance's leases and row, so others take over at once."""
        self._stopped = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(ClusterError("this server is stopping"))
        for task in list(self._tasks):
            task.cancel()
        if self._repairing is not None:
            self._repairing.cancel()
        session, self._session = self._session, None
        if session is not None and not session.closed:
            try:
                await _delete_membership(session, self.instance_id)
            except Exception:
                pass  # the rows expire on their own: the others judge this instance gone
            await session.close()

    # ------------------------------------------------------------ judging others

    async def owner_alive(self, owner: str | None, *, strict: bool = False) -> bool:
        """Does the instance stamped `owner` (a turn's or a claim's) still live? `strict`: only
        while its session holds its lock, without the grace that lets a server whose session the
        database ended take it again (a killed server is then dead at once)."""
        if not owner:
            return False
        if owner == self.instance_id:
            return True
        alive = f"{LIVE_SINCE} AND {LOCK_HELD}" if strict else LIVE_SINCE
        row = await self.store._row(
            f"SELECT 1 AS ok FROM instances i WHERE i.id = %(id)s AND {alive}", {**self.params, "id": owner}
        )
        return row is not None

    async def forget_gone(self) -> list[str]:
        """Delete the rows of gone instances (one survivor wins each); returns their ids. None while
        this server cannot judge (its session away, its heartbeat overdue: see `params`)."""
        params = self.params
        if params["back"] == AWAY:
            return []
        rows = await self.store._rows(
            f"DELETE FROM instances i WHERE NOT {LIVE_SINCE} AND i.id <> %(me)s RETURNING id",
            {**params, "me": self.instance_id},
        )
        return [r["id"] for r in rows]

    # ------------------------------------------------------------ conversation leases

    async def take(self, conversation_id: str) -> Lease:
        """Take the conversation's lease: `Lease.token` when this instance holds it now, else
        `Lease.holder`, the live instance that does. Each take has a token of its own, so letting
        go of an earlier one (`release`, in the background) never deletes a later one."""
        token = secrets.token_hex(8)
        args = {**self.params, "conv": conversation_id, "me": self.instance_id, "token": token}

        async def job(conn: Conn) -> Lease | None:
            cur = await conn.execute(
                "INSERT INTO conversation_owners AS o (conversation_id, instance_id, token, since) "
                f"VALUES (%(conv)s, %(me)s, %(token)s, {NOW}) ON CONFLICT (conversation_id) DO UPDATE "
                "SET instance_id = EXCLUDED.instance_id, token = EXCLUDED.token, since = EXCLUDED.since "
                "WHERE o.instance_id = EXCLUDED.instance_id OR NOT EXISTS "
                f"(SELECT 1 FROM instances i WHERE i.id = o.instance_id AND {LIVE_SINCE}) RETURNING instance_id",
                args,
            )
            if await cur.fetchone() is not None:
                return Lease(token=token)
            cur = await conn.execute(
                "SELECT instance_id FROM conversation_owners WHERE conversation_id = %s", (conversation_id,)
            )
            holder = await cur.fetchone()
            return Lease(holder=str(holder["instance_id"])) if holder is not None else None

        for _ in range(5):
            # Through the store's writer: a take commits with the group of writes in flight (a new
            # conversation's lease lands with the conversation), in order with this server's releases.
            lease = await self.store._write(job)
            if lease is not None:
                if lease.token is not None:
                    self._held[conversation_id] = lease.token
                return lease
        raise ClusterError(f"could not take or find the owner of conversation {conversation_id}")

    def held(self) -> list[str]:
        """The conversations whose lease this instance took and has not let go."""
        return list(self._held)

    def release(self, conversation_id: str) -> None:
        """Let go of a conversation whose runtime this instance dropped (in the background): the
        lease of its latest take, by its token, so a later take's is never deleted."""
        token = self._held.pop(conversation_id, None)
        if token is not None:
            self._spawn(self._release(conversation_id, token))

    async def _release(self, conversation_id: str, token: str) -> None:
        async def job(conn: Conn) -> None:
            await conn.execute(
                "DELETE FROM conversation_owners WHERE conversation_id = %s AND token = %s", (conversation_id, token)
            )

        await self.store._write(job)

    async def take_channel(self, account: str) -> str | None:
        """Take the lease of a channel account (`channel:name`) for this instance's gateway: None
        when this instance holds it now, else the live instance that does."""
        args = {**self.params, "account": account, "me": self.instance_id}
        row = await self.store._row(
            "INSERT INTO channel_owners AS o (account, instance_id, since) "
            f"VALUES (%(account)s, %(me)s, {NOW}) ON CONFLICT (account) DO UPDATE "
            "SET instance_id = EXCLUDED.instance_id, since = EXCLUDED.since "
            "WHERE o.instance_id = EXCLUDED.instance_id OR NOT EXISTS "
            f"(SELECT 1 FROM instances i WHERE i.id = o.instance_id AND {LIVE_SINCE}) RETURNING instance_id",
            args,
        )
        if row is not None:
            return None
        holder = await self.store._row("SELECT instance_id FROM channel_owners WHERE account = %s", (account,))
        return str(holder["instance_id"]) if holder is not None else "another instance"

    async def orphaned_conversations(self) -> list[str]:
        """Conversations with queued or running turns whose lease no live instance holds, or a paused
        turn whose cancel was acknowledged (`turns.cancel_ack`: taken up, it ends cancelled)."""
        rows = await self.store._rows(
            f"WITH live AS (SELECT id FROM instances i WHERE {LIVE_SINCE}) "
            "SELECT DISTINCT t.conversation_id FROM turns t WHERE (t.status IN ('queued', 'running') "
            "OR (t.status = 'awaiting' AND t.cancel_ack IS NOT NULL)) "
            "AND NOT EXISTS (SELECT 1 FROM conversation_owners o WHERE o.conversation_id = t.conversation_id "
            "AND o.instance_id IN (SELECT id FROM live))",
            self.params,
        )
        return [r["conversation_id"] for r in rows]

    async def waiting_here(self, older_than_s: float) -> list[str]:
        """Conversations this instance holds with a turn queued for longer than `older_than_s`
        (a notification that never came: the owner catches up with the store)."""
        rows = await self.store._rows(
            "SELECT DISTINCT t.conversation_id FROM turns t JOIN conversation_owners o "
            "ON o.conversation_id = t.conversation_id WHERE t.status = 'queued' AND o.instance_id = %s "
            "AND t.created_at < %s",
            (self.instance_id, time.time() - older_than_s),
        )
        return [r["conversation_id"] for r in rows]

    async def note_following(self, conversation_ids: list[str], ttl_s: float) -> None:
        """Record that this instance follows these conversations for `ttl_s` more seconds, so a
        server that takes one of them later knows to publish its turns from the start."""
        await self.store._row(
            "INSERT INTO conversation_followers(conversation_id, instance_id, until) "
            f"SELECT c, %s, {NOW} + %s FROM unnest(%s::text[]) AS c "
            "ON CONFLICT (conversation_id, instance_id) DO UPDATE SET until = EXCLUDED.until RETURNING 1",
            (self.instance_id, ttl_s, conversation_ids),
        )

    async def followed_elsewhere(self, conversation_id: str) -> bool:
        row = await self.store._row(
            f"SELECT 1 AS yes FROM conversation_followers WHERE conversation_id = %s AND instance_id <> %s "
            f"AND until > {NOW} LIMIT 1",
            (conversation_id, self.instance_id),
        )
        return row is not None

    async def holders(self, conversation_ids: list[str]) -> dict[str, str]:
        """The instance holding each of these conversations (those held by none are left out)."""
        rows = await self.store._rows(
            "SELECT conversation_id, instance_id FROM conversation_owners WHERE conversation_id = ANY(%s)",
            (conversation_ids,),
        )
        return {r["conversation_id"]: r["instance_id"] for r in rows}

    # ------------------------------------------------------------ messages

    async def _notify(self, channel: str, body: str, *, head: str = "", mail_id: str | None = None) -> None:
        """NOTIFY `head + body`; a body too large for NOTIFY goes into a `cluster_mail` row and
        the notice carries `head + "@<id>"` instead (`mail_id`: a row the newest body replaces,
        so a long reply does not leave a row per revision)."""
        if len(head.encode()) + len(body.encode()) <= NOTIFY_MAX:
            await self.store._row(f"SELECT {NO_FLUSH}, pg_notify(%s, %s) AS sent", (channel, head + body))
            return
        mail_id = mail_id or new_id("mail")
        await self.store._row(
            f"WITH m AS (INSERT INTO cluster_mail(id, body, created_at) VALUES (%s, %s, {NOW}) "
            "ON CONFLICT (id) DO UPDATE SET body = EXCLUDED.body, created_at = EXCLUDED.created_at) "
            f"SELECT {NO_FLUSH}, pg_notify(%s, %s) AS sent",
            (mail_id, body, channel, head + "@" + mail_id),
        )

    async def read_mail(self, payload: str) -> str:
        """A notification's payload: itself, or the mail it names (`@<id>`)."""
        if not payload.startswith("@"):
            return payload
        row = await self.store._row("SELECT body FROM cluster_mail WHERE id = %s", (payload[1:],))
        if row is None:
            raise ClusterError(f"cluster mail {payload[1:]} is gone")
        return str(row["body"])

    async def send(self, instance_id: str, op: str, args: dict[str, Any]) -> None:
        """A request that wants no answer."""
        body = json.dumps({"op": op, "args": args, "from": self.instance_id})
        await self._notify(channel_of(instance_id), body)

    async def call(
        self,
        instance_id: str,
        op: str,
        args: dict[str, Any],
        timeout: float = CALL_TIMEOUT_S,
        *,
        key: str | None = None,
        on_sent: Callable[[], None] | None = None,
    ) -> dict[str, Any]:
        """A request answered by the peer within `timeout`; raises PeerError with the peer's error,
        ClusterError when no answer came. `key`: the request's identity, the same for every call
        that passes it on again: the peer runs a key once and answers each repeat with that run's
        reply, so the request is sent again every RESEND_S until a reply comes (a notification
        is lost when a session is taken again: the request, or the reply). `on_sent`: told once
        the request went out (it may be run from then on)."""
        req = new_id("req")
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._calls[req] = fut
        try:
            message: dict[str, Any] = {"op": op, "args": args, "from": self.instance_id, "req": req}
            if key is not None:
                message["key"] = key
            body = json.dumps(message)
            channel = channel_of(instance_id)
            await self._notify(channel, body, mail_id="req:" + req)
            if on_sent is not None:
                on_sent()
            async with asyncio.timeout(timeout):
                while key is not None and not fut.done():
                    await asyncio.wait({fut}, timeout=RESEND_S)
                    if not fut.done():
                        try:
                            await self._notify(channel, body, mail_id="req:" + req)
                        except Exception as exc:  # sent again at the next round
                            log.debug("cluster: could not send %s to %s again: %s", op, instance_id, exc)
                reply = await fut
        except TimeoutError:
            raise ClusterError(f"instance {instance_id} did not answer {op} within {timeout:.0f} s") from None
        finally:
            self._calls.pop(req, None)
        if reply.get("ok"):
            return dict(reply.get("result") or {})
        error = reply.get("error") or {}
        raise PeerError(str(error.get("kind", "error")), str(error.get("message", "the peer failed")), error)

    def publish_turn(self, conversation_id: str, turn_id: str, revision: int, body: str) -> None:
        """Tell every instance of a turn's newest snapshot. The caller publishes only the turns of
        a conversation another server follows (it said so): not gated on `peers`, which is counted
        only at each heartbeat, so a server that joined since is not counted yet."""
        head = f"{conversation_id} {turn_id} {revision} "
        self._spawn(self._notify(TURNS_CHANNEL, body, head=head, mail_id="turn:" + turn_id))

    # ------------------------------------------------------------ incoming

    def _dispatch(self, channel: str, payload: str) -> None:
        if channel == TURNS_CHANNEL:
            head = payload.split(" ", 3)
            if len(head) == 4 and self._on_notice is not None:
                conv, turn, rev, body = head
                try:
                    self._on_notice(conv, turn, int(rev), body)
                except Exception:
                    log.exception("cluster: a turn notice failed")
            return
        self._spawn(self._incoming(payload))

    async def _incoming(self, payload: str) -> None:
        try:
            msg = json.loads(await self.read_mail(payload))
        except Exception:
            log.exception("cluster: an unreadable message")
            return
        if "reply" in msg:
            fut = self._calls.get(msg["reply"])
            if fut is not None and not fut.done():
                fut.set_result(msg)
            return
        if self._on_message is None:
            return
        req = msg.get("req")
        key = msg.get("key")
        if isinstance(key, str) and key and req is not None:
            reply = {**await self._serve_once(key, msg), "reply": req}
        else:
            reply = await self._serve(msg)
        if req is not None and msg.get("from"):
            try:
                await self._notify(channel_of(str(msg["from"])), json.dumps(reply))
            except Exception:
                log.exception("cluster: could not answer %s", msg.get("from"))

    async def _serve_once(self, key: str, msg: dict[str, Any]) -> dict[str, Any]:
        """The reply to a keyed request: run once (the first copy that arrives), and that reply
        again for each repeat, also one that arrives while the run goes on."""
        now = time.monotonic()
        while self._served:
            oldest, (at, _) = next(iter(self._served.items()))
            if len(self._served) < SERVED_MAX and now - at < SERVED_TTL_S:
                break
            del self._served[oldest]
        entry = self._served.get(key)
        if entry is not None:
            return await asyncio.shield(entry[1])
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._served[key] = (now, fut)
        try:
            reply = await self._serve(msg)
        except BaseException:  # cancelled (this server stops): a repeat may run it
            self._served.pop(key, None)
            fut.cancel()
            raise
        fut.set_result(reply)
        return reply

    async def _serve(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Run a peer's request: the reply to send (its result, or its error described)."""
        assert self._on_message is not None
        req = msg.get("req")
        try:
            result = await self._on_message(str(msg.get("op")), dict(msg.get("args") or {}))
            reply: dict[str, Any] = {"reply": req, "ok": True, "result": result or {}}
        except Exception as exc:
            reply = {"reply": req, "ok": False, "error": describe(exc)}
            if req is None:
                if self.fenced:
                    # Judged gone, or its session away: every request it still hears fails alike.
                    if not self._said_unserved:
                        self._said_unserved = True
                        log.warning(
                            "cluster: requests from the other servers are not served while this one is fenced "
                            "(%s %s from %s: %s)",
                            msg.get("op"),
                            msg.get("args"),
                            msg.get("from"),
                            exc,
                        )
                elif isinstance(exc, StoreUnavailable):
                    # the database ended a session (a restart, a terminated backend): the periodic
                    # pull makes up for this request; one line, not a traceback
                    log.warning("cluster: request %s from %s failed: %s", msg.get("op"), msg.get("from"), exc)
                else:
                    log.exception("cluster: request %s from %s failed", msg.get("op"), msg.get("from"))
        else:
            if not self.fenced:
                self._said_unserved = False
        return reply

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("cluster: a background step failed: %s", task.exception())

    async def purge_mail(self) -> None:
        await self.store._row(f"DELETE FROM cluster_mail WHERE created_at < {NOW} - %s RETURNING 1", (MAIL_TTL_S,))
        await self.store._row(f"DELETE FROM conversation_followers WHERE until < {NOW} RETURNING 1")


async def _delete_membership(conn: Conn, instance_id: str) -> None:
    """Delete an instance's leases, then its row: the others take over what it held at once."""
    await conn.execute("DELETE FROM conversation_owners WHERE instance_id = %s", (instance_id,))
    await conn.execute("DELETE FROM channel_owners WHERE instance_id = %s", (instance_id,))
    await conn.execute("DELETE FROM instances WHERE id = %s", (instance_id,))


def _retrieved(task: asyncio.Future[Any]) -> None:
    """A task given up on: its outcome is nobody's (read, so asyncio does not log it as lost)."""
    if not task.cancelled():
        task.exception()


def describe(exc: BaseException) -> dict[str, Any]:
    """An exception as a peer can raise it again (appserver errors keep their class and fields)."""
    data: dict[str, Any] = {"kind": type(exc).__name__, "message": str(exc)}
    for name in ("code", "param", "status", "holder"):
        value = getattr(exc, name, None)
        if isinstance(value, str | int) or value is None:
            data[name] = value
    return data


__all__ = ["Cluster", "ClusterError", "Lease", "PeerError", "channel_of", "describe"]
