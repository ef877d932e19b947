"""The webhook listener's connection edge: what must hold before a request reaches the adapter.

uvicorn's httptools protocol times out nothing but an idle gap after a response, and its
`limit_concurrency` answers a plain-text 503 to every new request while connections that never send
a request hold the slots: 64 idle connections (or 64 that send half a request head) locked every
signed sender out for as long as they stayed open. This protocol adds, per listener:

* a head deadline: a connection waiting for a request (a new one, or a kept-alive one after its
  reply) must deliver a complete request head within `HEAD_TIMEOUT_S`, else it is closed (silently
  when it sent nothing, with a 408 when it sent part of a head);
* a cap on the head's size (`HEAD_MAX_BYTES`, 431 beyond), counted as it is parsed too: a whole
  head in one read was never counted (the raw count only runs while a read ends inside a head);
* connection caps counted at accept: in all (`max_connections`) and per client address
  (`connections_per_client`; an IPv6 client counts by its /64), so one address cannot take every
  slot. A connection over a cap gets a 503 at once, in the channel's JSON error shape with
  `Retry-After`, and is closed; but at the total cap a newcomer may take the slot of the oldest
  connection that has not sent a validly signed request yet, of the address holding the most of
  them (`Gate`), so a local user filling every slot from several loopback addresses does not lock
  signed senders out; and at either cap, failing that, the oldest such connection of the
  newcomer's own address once it has waited EVICTION_GRACE_S, so a local user filling 127.0.0.1's
  share with idle connections does not lock out a signed sender from 127.0.0.1. The adapter marks
  a verified request through the ASGI scope extension `AUTHENTICATED_EXTENSION`; such a connection
  is never evicted. It marks only a request signed for the first time: a replay of a captured one
  (valid until `tolerance_s` passes) proves nothing, and once earned every slot that way.
* quiet closes: a refused client that is gone already is closed without a traceback, and refusals
  are logged once per REFUSAL_LOG_EVERY_S, never per connection.

Every answer the edge writes itself has the adapter's error shape, `{"accepted": false, "error": …}`.
The body's own deadline (`BODY_TIMEOUT_S`) is the adapter's. Standard library and uvicorn only: a
plugin imports nothing of the server (`tests/test_import_rules.py`), so the server's own edge
(`appserver/security/edge.py`) is not reused, only its approach.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

HEAD_TIMEOUT_S = 5.0  # from the moment a connection waits for a request to its complete head
HEAD_MAX_BYTES = 64 * 1024  # the request line and headers
LINGER_S = 1.0  # after a refusal: what the client still sends is read and dropped this long, then closed
REFUSAL_LOG_EVERY_S = 10.0
# A connection of the newcomer's own address that has not sent a signed request is evicted for it
# (at its address's cap, or at the total cap when no other address holds more) only once it has
# waited this long: a sender's signed request follows its connect within a round trip or two, so only
# a connection held idle or trickling is that old, and a burst of connects does not evict its own
# fresh ones. (Same as the server's edge, appserver/security/fair_slots.py.)
EVICTION_GRACE_S = 1.0
# The ASGI scope extension through which the adapter marks a request whose signature it verified
# and had not seen before: `scope["extensions"][AUTHENTICATED_EXTENSION]["mark"]()`. Such a
# connection is never evicted.
AUTHENTICATED_EXTENSION = "webhook.authenticated"


def client_group(host: str | None) -> str:
    """What the per-client cap counts by: the address, or an IPv6 address's /64 (one host has a
    whole /64 to pick from). An IPv4-mapped IPv6 address is its IPv4 address."""
    if not host:
        return "?"
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network(f"{address}/64", strict=False))
    return str(address)


@dataclass
class Gate:
    """The open connections of one listener, in all and per client group.

    Past `max_connections` a newcomer is not simply refused (a local user holding every slot with
    trickled bodies from several loopback addresses locked signed senders out): room is made by
    evicting a connection that has not shown a valid signature yet, when that makes the slots
    fairer. The newcomer's group must hold no unauthenticated connection, or fewer than the
    victim's group less one; the victim is the oldest unauthenticated connection of the group
    holding the most of them. So a newcomer is never evicted while any group holds more
    unauthenticated connections than its own, and otherwise only after every connection older than
    it; a connection that showed a valid signature (`authenticated`) is never evicted.

    When that would not make the slots fairer, and likewise at the per-client cap, the victim is the
    oldest unauthenticated connection of the newcomer's own group, once it has waited `grace_s`
    (else the newcomer is refused): one address (every local client is 127.0.0.1) holding its share
    with idle or trickling connections then only churns its own unproven connections, and a signed
    sender from that address is served. No group's share changes by it.
    """

    max_connections: int
    per_client: int
    log: logging.Logger
    grace_s: float = EVICTION_GRACE_S
    total: int = 0
    by_client: dict[str, int] = field(default_factory=dict)
    # unauthenticated connections per group, oldest first (dicts keep insertion order): their
    # admission's sequence number and time
    _pending: dict[str, dict[WebhookHttpProtocol, tuple[int, float]]] = field(default_factory=dict)
    _seq: int = 0
    _last_notice: float = -float("inf")
    _held_back: int = 0

    def admit(self, group: str, conn: WebhookHttpProtocol | None = None) -> str | None:
        """Count a new connection from `group`; or why it is refused (nothing counted). At the total
        cap an unauthenticated connection may be evicted to make room (above)."""
        now = time.monotonic()
        if self.by_client.get(group, 0) >= self.per_client and not self._evict_own(
            group,
            now,
            f"evicted to make room: this client has {self.per_client} connections open, its limit "
            "(connections_per_client), and this one had not sent a signed request; retry shortly",
        ):
            return self._refused(
                f"this client has {self.per_client} connections open, its limit (connections_per_client); retry shortly"
            )
        if self.total >= self.max_connections and not self._make_room(group, now):
            return self._refused(
                f"the listener has {self.max_connections} connections open, its limit (max_connections); retry shortly"
            )
        self.total += 1
        self.by_client[group] = self.by_client.get(group, 0) + 1
        if conn is not None:
            self._seq += 1
            self._pending.setdefault(group, {})[conn] = (self._seq, now)
        return None

    def authenticated(self, group: str, conn: WebhookHttpProtocol) -> None:
        """`conn` showed a valid signature: it is never evicted from now on."""
        waiting = self._pending.get(group)
        if waiting is not None and waiting.pop(conn, None) is not None and not waiting:
            del self._pending[group]

    def release(self, group: str, conn: WebhookHttpProtocol | None = None) -> None:
        if conn is not None:
            self.authenticated(group, conn)  # no longer a candidate for eviction
        self.total -= 1
        left = self.by_client.get(group, 0) - 1
        if left > 0:
            self.by_client[group] = left
        else:
            self.by_client.pop(group, None)

    def _make_room(self, group: str, now: float) -> bool:
        if not self._pending:
            return False
        reason = (
            f"evicted to make room: the listener has {self.max_connections} connections open, its limit "
            "(max_connections), and this one had not sent a signed request; retry shortly"
        )
        most = max(len(conns) for conns in self._pending.values())
        mine = len(self._pending.get(group, ()))
        if mine and mine + 1 >= most:
            # evicting elsewhere would not make the slots fairer: the newcomer's own group gives one
            return self._evict_own(group, now, reason) and self.total < self.max_connections
        candidates = (next(iter(conns.items())) for conns in self._pending.values() if len(conns) == most)
        victim, _ = min(candidates, key=lambda item: item[1][0])
        victim.evict(reason)  # releases its slot at once, through `release`
        return self.total < self.max_connections

    def _evict_own(self, group: str, now: float, reason: str) -> bool:
        """Evict the oldest unauthenticated connection of `group` if it has waited `grace_s`."""
        waiting = self._pending.get(group)
        if not waiting:
            return False
        victim, (_, since) = next(iter(waiting.items()))
        if now - since < self.grace_s:
            return False
        victim.evict(reason)  # releases its slot at once, through `release`
        return True

    def _refused(self, reason: str) -> str:
        now = time.monotonic()
        if now - self._last_notice >= REFUSAL_LOG_EVERY_S:
            more = f" ({self._held_back} more since the last notice)" if self._held_back else ""
            self.log.warning("refusing a connection with 503: %s%s", reason, more)
            self._last_notice, self._held_back = now, 0
        else:
            self._held_back += 1
        return reason


class _HeadTooLarge(Exception):
    """Raised in a parser callback: the request head passed HEAD_MAX_BYTES."""


def json_error(status: int, message: str, extra: tuple[tuple[bytes, bytes], ...] = ()) -> bytes:
    """A complete `Connection: close` response with the channel's error body."""
    body = json.dumps({"accepted": False, "error": message}).encode()
    lines = [
        STATUS_LINE[status],
        b"content-type: application/json\r\n",
        b"content-length: %d\r\n" % len(body),
        b"connection: close\r\n",
        *(name + b": " + value + b"\r\n" for name, value in extra),
        b"\r\n",
        body,
    ]
    return b"".join(lines)


class WebhookHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits above; `protocol_class` binds the gate."""

    gate: ClassVar[Gate]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._group: str | None = None  # counted by the gate (None: refused, evicted, or not yet made)
        self._admitted = False  # uvicorn knows of this connection (it was not refused at accept)
        self._closing = False  # answered by the edge: what still arrives is dropped
        self._waiting_head = False  # between requests: the head deadline runs
        self._head_bytes = 0  # raw bytes of reads that ended inside the head (a header line in pieces)
        self._head_parsed = 0  # bytes of the head parsed so far (its request line and header lines)
        self._head_over = False  # the head being parsed passed HEAD_MAX_BYTES
        self._head_timer: asyncio.TimerHandle | None = None
        self._linger_timer: asyncio.TimerHandle | None = None

    # connection

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        peer = transport.get_extra_info("peername")
        host = peer[0] if isinstance(peer, tuple) and peer else None
        group = client_group(host if isinstance(host, str) else None)
        refusal = self.gate.admit(group, self)
        if refusal is not None:
            self.transport = transport
            self._refuse(transport, json_error(503, refusal, ((b"retry-after", b"1"),)))
            return
        self._group = group
        self._admitted = True
        super().connection_made(transport)
        self._await_head()

    def evict(self, reason: str) -> None:
        """Give up this connection's slot at once (the gate makes room for a newcomer): a 503, or a
        cut when a request of it runs, then closed."""
        self._release()
        self._answer(503, reason, ((b"retry-after", b"1"),))

    def authenticated(self) -> None:
        """The adapter verified a request's signature on this connection: it keeps its slot."""
        if self._group is not None:
            self.gate.authenticated(self._group, self)

    def _release(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            self.gate.release(group, self)

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._head_timer, self._linger_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._linger_timer = None
        self._release()
        if not self._admitted:  # refused at accept: uvicorn never knew of it
            return
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        """uvicorn's, but a head over HEAD_MAX_BYTES is a 431 however it arrives: counted as parsed
        (`_count_head`, which stops the parser mid-read: a whole head in one read never reached the
        raw count below, which ended with the head) and in raw bytes while a read ends inside it
        (httptools buffers a header line in pieces without calling back)."""
        if self._closing:
            return
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._unsupported_upgrade_warning()  # never upgraded here (`_should_upgrade`)
        except httptools.HttpParserError:
            if self._head_over:
                self._refuse_head()
                return
            msg = "Invalid HTTP request received."
            self.logger.warning(msg)
            self.send_400_response(msg)
            return
        if self._waiting_head and not self._closing:
            self._head_bytes += len(data)
            if self._head_bytes > HEAD_MAX_BYTES:
                self._refuse_head()

    def _refuse_head(self) -> None:
        self._answer(431, f"the request line and headers exceed {HEAD_MAX_BYTES} bytes")

    def on_url(self, url: bytes) -> None:
        # the request line: METHOD SP url SP HTTP/1.1 CRLF (a URL in pieces calls this per piece)
        line = 0 if self._head_parsed else len(self.parser.get_method()) + len(b"  HTTP/1.1\r\n")
        self._count_head(line + len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4)
        super().on_header(name, value)

    def _count_head(self, n: int) -> None:
        self._head_parsed += n
        if self._head_parsed > HEAD_MAX_BYTES:
            self._head_over = True
            raise _HeadTooLarge()  # httptools stops and raises HttpParserError (`data_received`)

    # the head deadline

    def _await_head(self) -> None:
        self._waiting_head = True
        self._head_bytes = 0
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._on_head_timeout)

    def on_message_begin(self) -> None:
        self._head_parsed = 0
        self._head_over = False
        super().on_message_begin()
        # how the adapter tells the edge a request's signature was valid (`authenticated`)
        self.scope.setdefault("extensions", {})[AUTHENTICATED_EXTENSION] = {"mark": self.authenticated}

    def on_headers_complete(self) -> None:
        self._count_head(2)  # the empty line that ends the head
        self._waiting_head = False
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # starts a request pipelined behind this one, if any
        cycle = self.cycle
        if self.transport.is_closing() or self._closing or (cycle is not None and not cycle.response_complete):
            return
        self._await_head()  # kept alive: the next request's head is due in HEAD_TIMEOUT_S

    def _on_head_timeout(self) -> None:
        self._head_timer = None
        if not self._waiting_head or self._closing or self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            return  # a request runs (a head pipelined behind it is timed once its reply is done)
        if self._head_bytes == 0:
            self._closing = True
            self.transport.close()  # idle: nothing to answer
            return
        self._answer(408, f"the request head did not arrive within {HEAD_TIMEOUT_S:g} s")

    # answers the edge writes itself

    def send_400_response(self, msg: str) -> None:
        self._answer(400, msg)

    def _answer(self, status: int, message: str, extra: tuple[tuple[bytes, bytes], ...] = ()) -> None:
        if self.transport.is_closing() or self._closing:
            return
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # a reply in flight: cut it, its app sees a disconnect
            cycle.message_event.set()
            self._closing = True
            self.transport.abort()
            return
        self._refuse(self.transport, json_error(status, message, extra))

    def _refuse(self, transport: asyncio.Transport, response: bytes) -> None:
        """Write `response` and close without losing it: stop writing (FIN), drop what still
        arrives for LINGER_S, then close (closing with unread input resets the connection, and a
        reset can discard the answer before the client reads it). A client that is gone already
        (ENOTCONN, a reset) is closed quietly: a flood of them must not write a log line each."""
        self._closing = True
        try:
            transport.write(response)
            if transport.is_closing() or not transport.can_write_eof():
                transport.close()
                return
            transport.write_eof()
        except OSError:
            transport.abort()
            return
        self._linger_timer = asyncio.get_running_loop().call_later(LINGER_S, transport.close)

    # no WebSockets here: an upgrade request is an ordinary request (405 or 404), logged by nobody

    def _should_upgrade_to_ws(self) -> bool:
        return False

    def _unsupported_upgrade_warning(self) -> None:
        pass


def protocol_class(gate: Gate) -> type[WebhookHttpProtocol]:
    """The protocol class uvicorn instantiates per connection, bound to one listener's gate."""
    return type("BoundWebhookHttpProtocol", (WebhookHttpProtocol,), {"gate": gate})
