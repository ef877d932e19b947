"""Prometheus metrics of one Server (a per-Server CollectorRegistry; nothing at module level)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from starlette.requests import Request
from starlette.responses import Response

if TYPE_CHECKING:
    from appserver.runtime import TurnSnapshot
    from appserver.server import Server
    from appserver.store.records import TurnRecord


# The `method` label of appserver_http_requests_total: these as sent, any other as "other" (a request
# the security guard refuses never met a route, and its method is whatever token the client sent).
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
OTHER_METHOD = "other"


class Metrics:
    def __init__(self, server: Server) -> None:
        self.server = server
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "appserver_http_requests_total",
            "HTTP requests on the OpenAI routes by route, method and status",
            ["route", "method", "status"],
            registry=r,
        )
        self.turns = Counter(
            "appserver_turns_total", "Turns (or turn segments) settled, by outcome", ["outcome"], registry=r
        )
        self.turn_latency = Histogram(
            "appserver_turn_latency_seconds",
            "Time from a turn's start to its settlement",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
            registry=r,
        )
        self.active_streams = Gauge("appserver_active_streams", "SSE streams open on the OpenAI routes", registry=r)
        self.queue_depth = Gauge(
            "appserver_queue_depth", "Inputs queued across all conversations in memory", registry=r
        )
        self.queue_depth.set_function(self._queue_depth)
        self.runtimes = Gauge("appserver_conversation_runtimes", "Conversation runtimes in memory", registry=r)
        self.runtimes.set_function(lambda: self.server.kernel.runtime_count)
        server.kernel.on_settled(self.on_turn_settled)
        # Labelled children, looked up once: `labels()` validates and locks on every call.
        self._request_counts: dict[tuple[str, str, int], Any] = {}
        self._turn_counts: dict[str, Any] = {}

    def _queue_depth(self) -> float:
        return float(self.server.kernel.queue_depth())

    def on_turn_settled(self, record: TurnRecord, snapshot: TurnSnapshot) -> None:
        child = self._turn_counts.get(record.status)
        if child is None:
            child = self._turn_counts[record.status] = self.turns.labels(record.status)
        child.inc()
        if record.started_at:
            self.turn_latency.observe(max(0.0, time.time() - record.started_at))

    def observe_request(self, route: str, method: str, status: int) -> None:
        if method not in METHODS:
            method = OTHER_METHOD
        key = (route, method, status)
        child = self._request_counts.get(key)
        if child is None:
            child = self._request_counts[key] = self.requests.labels(route, method, str(status))
        child.inc()

    async def endpoint(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


Endpoint = Callable[[Request], Awaitable[Response]]
