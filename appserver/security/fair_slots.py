"""Who gives up a connection slot at the global cap: fair eviction of connections that never
authenticated.

The edge caps open connections at accept (`[limits] max_connections`, 503 beyond). A client that
opens connections and trickles partial request heads (each line just before the head timeout) held
every slot from one address, and every other client got 503 until it stopped: the per-client cap
counts requests only once their head is parsed. A per-address cap on connections still in their
head would not do: on a laptop every client (CLI, desktop app, gateway child, SDK pools) is
127.0.0.1, behind a proxy every peer is the proxy, and a burst of legitimate connects is all heads at
once. So nothing changes below the cap; at the cap a newcomer may take the slot of a connection
that has not yet authenticated (`SlotGate.make_room`): still in its first head, or whose requests
were all refused or public (a 401 kept alive, re-sent before each keep-alive timeout, held a slot
for good), or a WebSocket still waiting for its `hello`. A connection that sent a request with a
valid credential (any, in auth mode none) is never evicted by this. Same approach as the webhook
listener's `Gate` (plugins/webhook/edge.py), which the server may not import.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

# No connection is evicted before it has waited this long without authenticating (the edge uses
# at most half its head timeout): a client sends its head and credential within a round trip or
# two of connecting, so only one that holds its slot idle or trickles is older. Whoever the
# newcomer is: a burst of connects does not evict its own fresh ones, and a flood of connects from
# many addresses (any local process can use all of 127.0.0.0/8; a remote one a whole IPv6 /64)
# cannot make a legitimate newcomer the oldest before its request was even read.
EVICTION_GRACE_S = 1.0
_V4_MAPPED = bytes(10) + b"\xff\xff"


def client_group(host: str | None) -> str:
    """What fairness counts by: the address; an IPv6 address by its /64 (one host has a whole /64 to
    pick from); an IPv4-mapped IPv6 address as its IPv4 address. (inet_pton: ipaddress took 20-40 µs
    a connection.)"""
    if not host:
        return "?"
    if ":" not in host:  # IPv4 as asyncio gives it (already canonical): no parse on the hot path
        return host
    try:
        packed = socket.inet_pton(socket.AF_INET6, host.split("%", 1)[0])
    except (OSError, ValueError):
        return host
    if packed[:12] == _V4_MAPPED:
        return socket.inet_ntop(socket.AF_INET, packed[12:])
    return socket.inet_ntop(socket.AF_INET6, packed[:8] + bytes(8)) + "/64"


class Evictable(Protocol):
    """A connection the gate may close to make room (the edge's HTTP protocol)."""

    def evict(self, reason: str) -> None:
        """Close at once (a 503 if part of a head arrived); its slot is free from now on."""


@dataclass(frozen=True, slots=True)
class Eviction:
    """What `make_room` did, for the edge's (throttled) log line."""

    victim_group: str
    victim_age_s: float
    victim_group_unproven: int


@dataclass(slots=True)
class SlotGate:
    """The connections of one listener that have not authenticated yet ("unproven"), per
    client group, oldest first; and how many evicted ones have not gone yet.

    At the cap (`make_room`), the victim is the oldest unproven connection of the group holding the
    most of them, when that makes the slots fairer: the newcomer's group holds none, or fewer than
    the victim's group less one (so two groups never trade slots back and forth, and a newcomer is
    never evicted while another group holds more unproven connections than its own). Otherwise,
    within the newcomer's own group, its oldest unproven connection: one address (everyone, on a
    laptop or behind a proxy) cannot lock its other clients out, and no group's share changes.
    Either way only a victim that has waited at least the grace (`EVICTION_GRACE_S`); else the
    newcomer is refused, as before.

    Every step is O(1) but the choice among the groups holding the most, which looks at no more
    than `SCAN` of them: at the cap, thousands of addresses must not make each accept a long scan.
    """

    # how long a connection must have waited before it may be evicted (`EVICTION_GRACE_S`)
    grace_s: float = EVICTION_GRACE_S
    # unproven connections per group, oldest first (dicts keep insertion order): conn -> admitted at
    _unproven: dict[str, dict[Evictable, float]] = field(default_factory=dict)
    # every unproven connection, oldest first, and its group
    _group_of: dict[Evictable, str] = field(default_factory=dict)
    # the groups by how many unproven connections they hold, and the most any holds
    _by_count: dict[int, dict[str, None]] = field(default_factory=dict)
    _most: int = 0
    # evicted, still counted by the server until their `connection_lost`
    _leaving: set[Evictable] = field(default_factory=set)

    SCAN: ClassVar[int] = 64

    @property
    def leaving(self) -> int:
        """Evicted connections whose slot is free but that the server still counts."""
        return len(self._leaving)

    def admitted(self, conn: Evictable, group: str) -> None:
        """`conn` got a slot and has not authenticated yet: a candidate for eviction."""
        waiting = self._unproven.setdefault(group, {})
        waiting[conn] = time.monotonic()
        self._group_of[conn] = group
        self._recount(group, len(waiting) - 1, len(waiting))

    def proven(self, conn: Evictable) -> None:
        """`conn` authenticated (or is gone): never evicted from now on."""
        group = self._group_of.pop(conn, None)
        if group is None:
            return
        waiting = self._unproven[group]
        del waiting[conn]
        if not waiting:
            del self._unproven[group]
        self._recount(group, len(waiting) + 1, len(waiting))

    def gone(self, conn: Evictable) -> None:
        """`conn` is closed: the server no longer counts it."""
        self.proven(conn)
        self._leaving.discard(conn)

    def make_room(self, group: str, reason: str) -> Eviction | None:
        """At the cap, for a newcomer of `group`: evict one unproven connection (above) and say
        which, or None (nothing fair to evict: refuse the newcomer)."""
        if not self._group_of:
            return None
        most = self._most
        mine = len(self._unproven.get(group, ()))
        now = time.monotonic()
        if not mine or mine < most - 1:
            victim = self._oldest_of_heaviest()
        else:
            victim = next(iter(self._unproven[group]))
        victim_group = self._group_of[victim]
        waiting = self._unproven[victim_group]
        since = waiting[victim]
        if now - since < self.grace_s:
            return None
        eviction = Eviction(victim_group, now - since, len(waiting))
        self.proven(victim)
        self._leaving.add(victim)
        victim.evict(reason)
        return eviction

    def _oldest_of_heaviest(self) -> Evictable:
        """The oldest unproven connection of the groups holding the most: the first of them in age
        order. Looks at `SCAN` groups or connections at most (then: the oldest of the first group
        to reach that count)."""
        top = self._by_count[self._most]
        if len(top) <= self.SCAN:
            oldest = (next(iter(self._unproven[g].items())) for g in top)
            return min(oldest, key=lambda item: item[1])[0]
        for i, (conn, group) in enumerate(self._group_of.items()):
            if group in top:
                return conn
            if i >= self.SCAN:
                break
        return next(iter(self._unproven[next(iter(top))]))

    def _recount(self, group: str, old: int, new: int) -> None:
        """`group` now holds `new` unproven connections (was `old`, one apart)."""
        if old:
            bucket = self._by_count[old]
            del bucket[group]
            if not bucket:
                del self._by_count[old]
                if self._most == old and new < old:
                    self._most = new  # it moved one down: that count is held (or none is, at 0)
        if new:
            self._by_count.setdefault(new, {})[group] = None
            self._most = max(self._most, new)
