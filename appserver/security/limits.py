"""Size and concurrency limits the guard enforces on requests that reached the app: the declared
and the streamed body size (`[limits] body_max_bytes`) and concurrent requests per client
(`[limits] connections_per_client`); and the turns a credential holds open, through the WebSocket
and HTTP alike (`[limits] open_turns_per_client`, `OpenTurns`, shared by a server's front ends as
its `TurnPlaces`, made once by `build_services`). Head and connection limits are in edge.py."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING

from appserver.auth.principal import Principal
from appserver.auth.tokens import GATEWAY_ID_PREFIX, is_reserved_name
from appserver.runtime import SETTLED_SNAPSHOT_STATUS, TurnHandle
from appserver.security.asgi import CLOSE, Refusal, Scope
from appserver.security.headers import Headers
from appserver.store.base import StoreUnavailable

if TYPE_CHECKING:
    from appserver.server import Server


class BodyLimit:
    def __init__(self, body_max: int) -> None:
        self.body_max = body_max

    def check_length(self, hdrs: Headers) -> None:
        """Refuse a malformed or conflicting Content-Length (400) or one over the limit (413)."""
        values = hdrs.get(b"content-length")
        if not values:
            return
        parsed: set[int] = set()
        for v in values:
            for part in v.split(b","):
                p = part.strip()
                if not p.isdigit() or len(p) > 18:
                    raise Refusal(400, "invalid_content_length", "malformed Content-Length", [CLOSE])
                parsed.add(int(p))
        if len(parsed) != 1:
            raise Refusal(400, "invalid_content_length", "conflicting Content-Length headers", [CLOSE])
        if parsed.pop() > self.body_max:
            raise self.too_large()

    def too_large(self) -> Refusal:
        return Refusal(
            413,
            "request_too_large",
            f"request body exceeds the limit of {self.body_max} bytes ([limits] body_max_bytes)",
            [CLOSE],
        )


def client_key(scope: Scope) -> str | None:
    client = scope.get("client")
    if not client:
        return None
    return str(client[0])


log = logging.getLogger("appserver.guard")

TOO_MANY_CONNECTIONS = "too_many_connections"

HEALTH_PATHS = frozenset({"/healthz", "/readyz"})


def slot_key(scope: Scope, principal: Principal | None) -> str | None:
    """Whose slots a request takes: an authenticated credential's own (so connections nobody
    authenticated, all from one address on a local server, cannot use up a token's), else its
    address. Health probes take none: they must answer while a client floods the server. (A
    WebSocket still waiting for its `hello` takes none of these: `PendingSockets`.)"""
    if scope["type"] == "http" and scope.get("path") in HEALTH_PATHS:
        return None
    if principal is not None and principal.kind in ("token", "jwt"):
        return f"{principal.kind}:{principal.subject}"
    return client_key(scope)


class ClientSlots:
    """Concurrent requests and sockets per client address; 0 means unlimited."""

    def __init__(self, per_client: int) -> None:
        self.per_client = per_client
        self._active: dict[str, int] = {}

    def check(self, client: str | None) -> None:
        if client is not None and self.per_client > 0 and self._active.get(client, 0) >= self.per_client:
            raise Refusal(429, TOO_MANY_CONNECTIONS, "too many concurrent requests from this client")

    def acquire(self, client: str | None) -> None:
        if client is not None:
            self._active[client] = self._active.get(client, 0) + 1

    def release(self, client: str | None) -> None:
        if client is None:
            return
        left = self._active.get(client, 1) - 1
        if left > 0:
            self._active[client] = left
        else:
            self._active.pop(client, None)


class PendingSockets:
    """WebSockets upgraded without a credential that have not authenticated by `hello` yet, per
    client address, oldest first.

    They take none of their address's `connections_per_client` slots: 256 such sockets from one
    address (reopened as the hello timeout closed them) held every slot of it, and a browser-style
    client of the same address (every client on one host, or behind one proxy), which can only
    authenticate in `hello`, got 429 at its upgrade for as long as that went on. They have a bucket
    of their own instead, of the same size per address (so memory stays bounded as before), and a
    newcomer is never refused by it: at the bound the oldest waiting socket of the address gives up
    its place (closed 4401 `authentication timeout`). A client that sends its `hello` right after
    the upgrade keeps its socket unless that many newer sockets of its address arrive in between.
    """

    NOTICE_EVERY_S = 10.0

    def __init__(self, per_client: int) -> None:
        self.per_client = per_client if per_client > 0 else DEFAULT_PENDING_PER_CLIENT
        self._waiting: dict[str | None, dict[SlotHold, None]] = {}
        self._noticed = -self.NOTICE_EVERY_S
        self._unnoticed = 0

    def admit(self, client: str | None, hold: SlotHold) -> None:
        waiting = self._waiting.setdefault(client, {})
        while len(waiting) >= self.per_client:
            oldest = next(iter(waiting))
            del waiting[oldest]
            oldest.evicted()
            self._notice(client)
        waiting[hold] = None

    def _notice(self, client: str | None) -> None:
        """One warning per interval (each eviction closes quietly: a client reopening its sockets
        would fill the log)."""
        self._unnoticed += 1
        now = time.monotonic()
        if now - self._noticed >= self.NOTICE_EVERY_S:
            log.warning(
                "%d WebSocket(s) waiting for their hello closed (4401) to admit newer ones "
                "([limits] connections_per_client = %d such per address), latest from %s",
                self._unnoticed,
                self.per_client,
                client,
            )
            self._noticed, self._unnoticed = now, 0

    def leave(self, client: str | None, hold: SlotHold) -> None:
        waiting = self._waiting.get(client)
        if waiting is None:
            return
        waiting.pop(hold, None)
        if not waiting:
            del self._waiting[client]

    def count(self, client: str | None) -> int:
        return len(self._waiting.get(client, ()))


# The bound of `PendingSockets` per address when `connections_per_client` is 0 (off).
DEFAULT_PENDING_PER_CLIENT = 256


class SlotHold:
    """The one slot a request or WebSocket holds, and whose it is. A WebSocket upgraded without
    credentials holds a place among its address's `PendingSockets` (`pending`) until `hello`
    authenticates it; then `move` takes the credential's slot instead (refused like an over-cap
    upgrade when that is full) and gives the place back, so the cap of a credential counts its
    hello-authenticated sockets too. A pending socket may lose its place to a newer one
    (`evicted`): `on_evict` (its session's) closes it."""

    def __init__(self, slots: ClientSlots, key: str | None, pending: PendingSockets | None = None) -> None:
        self.slots = slots
        self.key = key
        self.pending = pending
        self.released = False
        self.lost = False  # evicted from `pending`
        self.on_evict: Callable[[], None] | None = None

    def acquire(self) -> None:
        if self.pending is not None:
            self.pending.admit(self.key, self)
        else:
            self.slots.acquire(self.key)

    def move(self, key: str | None) -> None:
        """Hold `key`'s slot instead of the current one; raises the 429 `Refusal` (holding the
        current one still) when `key`'s slots are all taken."""
        if self.released or self.lost or (key == self.key and self.pending is None):
            return
        self.slots.check(key)
        self.slots.acquire(key)  # nothing awaits between the check and the take
        self._give_back()
        self.key = key

    def evicted(self) -> None:
        """`PendingSockets` took this socket's place for a newer one (it is no longer counted)."""
        self.lost = True
        self.pending = None
        if self.on_evict is not None:
            self.on_evict()

    def _give_back(self) -> None:
        if self.lost:
            return
        if self.pending is not None:
            self.pending.leave(self.key, self)
            self.pending = None
        else:
            self.slots.release(self.key)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._give_back()


TOO_MANY_OPEN_TURNS = "too_many_open_turns"


def open_turns_key(principal: Principal | None) -> str | None:
    """Whose open turns a WebSocket's submit or an HTTP request's turn counts against: its
    credential's (kind and subject, as `slot_key` groups them); None for callers that are not
    counted. The local owner of auth mode `none` is the only caller of its server (no other
    credential to starve), and the channel gateway submits for every chat sender of every account
    under its one credential, which only the server mints (a `gwt_` id with a reserved name:
    `TokenStore.mint_gateway`; `token create` refuses those names), so nobody else can present it."""
    if principal is None or principal.kind not in ("token", "jwt"):
        return None
    if principal.kind == "token" and _is_channel_gateway(principal):
        return None
    return f"{principal.kind}:{principal.subject}"


def _is_channel_gateway(principal: Principal) -> bool:
    name = principal.subject.removeprefix("token:")
    return (principal.token_id or "").startswith(GATEWAY_ID_PREFIX) and is_reserved_name(name)


class OpenTurns:
    """Turns each credential holds open on this server: accepted and not ended (queued, running,
    or paused for an approval or a client tool's result), at most `per_client` (0 = no cap).

    The WebSocket detaches turns from their socket (a disconnect never cancels one), so one
    connection could start any number of them, each in a fresh conversation where `queue_max`
    never bites, and slow every other credential. HTTP turns count in the same places: a reply
    with client tool calls or an approval request returns while its turn stays open, paused (for
    `client_tool_timeout_s`, `approval_timeout_s`), holding no `connections_per_client` slot, so
    requests forking an old response into fresh conversations could pin any number of them
    (`TurnPlaces`). A place is taken (`take`) before the submit, so submits racing on several sockets cannot
    pass the cap together, then given back at once if nothing was accepted (`give_back`), or kept
    (`hold`) until the turn ends, however it ends, also after its socket closed: exactly once. A
    restart forgets nothing: each turn records whose place it holds (`Kernel.COUNTED_FOR`), and
    the turns a server takes up open that no live server counts (a restart's, a dead cluster
    server's) are counted here (`restore`), once each, until they end or move away (`let_go`)."""

    def __init__(self, per_client: int) -> None:
        self.per_client = per_client
        self._open: dict[str, int] = {}
        self._holds: set[asyncio.Task[None]] = set()  # the event loop holds tasks only weakly
        self._held: dict[str, str] = {}  # turn id -> key of each turn `hold` keeps a place for
        # turn id -> (key, the task watching it) of each turn counted by `restore`
        self._restored: dict[str, tuple[str, asyncio.Task[None]]] = {}

    def take(self, key: str | None) -> bool:
        """One place of `key`'s; False (nothing taken) when all are taken. Never awaits."""
        if key is None or self.per_client <= 0:
            return True
        held = self._open.get(key, 0)
        if held >= self.per_client:
            return False
        self._open[key] = held + 1
        return True

    def give_back(self, key: str | None) -> None:
        if key is None or self.per_client <= 0:
            return
        left = self._open.get(key, 1) - 1
        if left > 0:
            self._open[key] = left
        else:
            self._open.pop(key, None)

    def restore(self, key: str, turn_id: str, ended: Callable[[], Awaitable[None]], name: str) -> None:
        """Count a turn accepted for `key` by a server that counts it no more (an earlier process
        of this one, a dead server of the cluster) and taken up here still open: its place is
        taken whatever the count (the cap may have been lowered meanwhile), then held until
        `ended()` returns. Once per turn: told of it again (taken up anew, its handle changed),
        the count stays and the newer `ended` is watched. Never awaits."""
        if self.per_client <= 0:
            return
        known = self._restored.get(turn_id)
        if known is None:
            self._open[key] = self._open.get(key, 0) + 1
        else:
            key = known[0]
            known[1].cancel()  # its place is kept, watched by the new task
        task = asyncio.get_running_loop().create_task(
            self._watch(key, ended, lambda: self._forget_restored(turn_id)), name=name
        )
        self._restored[turn_id] = (key, task)
        self._holds.add(task)
        task.add_done_callback(self._holds.discard)

    def _forget_restored(self, turn_id: str) -> None:
        """Give back the place of a restored turn, unless a newer task watches it now (or it was
        given back already): only the current task's end counts."""
        known = self._restored.get(turn_id)
        if known is not None and known[1] is asyncio.current_task():
            del self._restored[turn_id]
            self.give_back(known[0])

    def let_go(self, turn_id: str) -> None:
        """A restored turn moved to another server, which counts it: its place here comes back
        now. Nothing for a turn not counted by `restore`. Never awaits."""
        known = self._restored.pop(turn_id, None)
        if known is not None:
            known[1].cancel()
            self.give_back(known[0])

    def hold(
        self, key: str | None, ended: Callable[[], Awaitable[None]], name: str, turn_id: str | None = None
    ) -> None:
        """Keep `key`'s place until `ended()` returns (the turn ended), raises or is cancelled.
        `turn_id`: the turn it is kept for (`holds` knows it then)."""
        if key is None or self.per_client <= 0:
            return
        if turn_id is not None:
            self._held[turn_id] = key
        task = asyncio.get_running_loop().create_task(
            self._watch(key, ended, partial(self._held_ends, key, turn_id)), name=name
        )
        self._holds.add(task)
        task.add_done_callback(self._holds.discard)

    def _held_ends(self, key: str, turn_id: str | None) -> None:
        if turn_id is not None:
            self._held.pop(turn_id, None)
        self.give_back(key)

    def holds(self, turn_id: str) -> bool:
        """Does turn `turn_id` hold a place already (kept by `hold` or `restore`)? A request that
        answers a paused turn takes none of its own for it."""
        return turn_id in self._held or turn_id in self._restored

    async def _watch(self, key: str, ended: Callable[[], Awaitable[None]], release: Callable[[], None]) -> None:
        """Wait for a turn's end (`ended()` returns, raises or is cancelled), then `release` its place."""
        try:
            await ended()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("watching an open turn of %s failed; its place is given back", key)
        finally:
            release()

    def count(self, key: str | None) -> int:
        return self._open.get(key, 0) if key is not None else 0

    def refusal(self) -> str:
        return (
            f"this credential already holds {self.per_client} open turns on this server (queued, running or "
            "waiting for an approval or a client tool's result), the limit of [limits] open_turns_per_client: "
            "wait for one to end (or cancel one), then submit again"
        )


# How often an open turn whose end was not seen is looked up in the store (`TurnPlaces.turn_ended`).
OPEN_TURN_RECHECK_S = 60.0


class TurnPlaces:
    """The open-turn count of one server (`[limits] open_turns_per_client`), which its WebSocket
    endpoint and its HTTP routes share (`Services.places`): a credential's turns count in one
    `OpenTurns` whichever front end started them. It also registers the count with the kernel
    (`count_restored`), once, before the first place is taken by either, and watches each turn
    holding a place until it ends (`turn_ended`)."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.open_turns = OpenTurns(int(server.config.limits.open_turns_per_client))
        self._restored = False  # the turns open at the server's start are counted (`count_restored`)

    def count_restored(self) -> None:
        """Before the first place is taken: have the kernel count here, against the credentials
        that submitted them, each open turn it takes up (paused for an answer, queued again: at the
        server's start, a catch-up, a take-over of a dead cluster server's) or finds open in no
        live server's hands, which no live server counts; those of its start are handed over now,
        later ones as they come. The count lives in memory; a restart would otherwise forget it,
        and each restart let a credential open `open_turns_per_client` more. Never awaits."""
        if self._restored:
            return
        self._restored = True
        self.server.kernel.count_open_turns(self._count_taken_up, self.open_turns.let_go)

    def _count_taken_up(self, cap_key: str, handle: TurnHandle) -> None:
        """Count a turn the kernel took up (`count_restored`) until it ends; once per turn."""
        if handle.controller.snapshot().terminal:
            return  # ended since
        name = f"open-turn:{handle.turn_id}"
        self.open_turns.restore(cap_key, handle.turn_id, partial(self.turn_ended, handle), name)

    def hold(self, cap_key: str | None, handle: TurnHandle) -> None:
        """Keep the place `cap_key` took for the turn of `handle` until that turn ends."""
        self.open_turns.hold(cap_key, partial(self.turn_ended, handle), f"open-turn:{handle.turn_id}", handle.turn_id)

    async def turn_ended(self, handle: TurnHandle) -> None:
        """Return once the turn ended (completed, failed, cancelled, withdrawn from its queue, ended
        with its deleted agent): its snapshot says so. A paused turn is still open. Should its end
        never reach this handle (its runtime was dropped and loaded again), the store says so:
        looked up every OPEN_TURN_RECHECK_S."""
        controller = handle.controller
        seen = -1
        while True:
            try:
                snap = await controller.wait_settled(OPEN_TURN_RECHECK_S, after_revision=seen)
            except TimeoutError:
                if await self._turn_over(handle.turn_id):
                    return
                continue
            if snap.terminal:
                return
            seen = snap.revision  # paused: wait for what comes after the pause

    async def _turn_over(self, turn_id: str) -> bool:
        try:
            turn = await self.server.store.get_turn(turn_id)
        except StoreUnavailable:
            return False  # asked again at the next look
        return turn is None or turn.status in SETTLED_SNAPSHOT_STATUS
