"""The Starlette application: health probes here; front-end routes mount onto it."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import Message, Receive, Scope, Send

from appserver.http.bodies import JsonBodies
from appserver.http.common import api_route_label, is_api_route
from appserver.http.errors import error_response, new_request_id
from appserver.http.metrics import Metrics
from appserver.http.openai_routes import openai_routes
from appserver.http.requestid import current_request_id
from appserver.http.stopping import Stopping
from appserver.security.guard import OPS_DETAIL
from appserver.server import Server
from appserver.services import Services
from appserver.ws.routes import ws_routes

log = logging.getLogger("appserver.http")

Endpoint = Callable[[Request], Awaitable[Response]]


async def healthz(request: Request) -> JSONResponse:
    return JSONResponse({"status": "ok"})


async def readyz(request: Request) -> JSONResponse:
    """The server's named checks (appserver/readiness.py): 503 when one fails; warnings listed.
    Their details (paths, free bytes, a database's address) only to whom may see them (`OPS_DETAIL`):
    anyone else on the network gets each check's name and status."""
    server: Server = request.app.state.server
    ready, body = await server.readiness.report()
    if not may_see_detail(request, server):
        body = {"status": body["status"], "checks": [{k: c[k] for k in ("name", "status")} for c in body["checks"]]}
    return JSONResponse(body, status_code=200 if ready else 503)


def may_see_detail(request: Request, server: Server) -> bool:
    """The security guard's answer; without the guard (an app built alone), auth mode `none` only."""
    state = request.scope.get("state") or {}
    return bool(state.get(OPS_DETAIL, server.config.auth.mode == "none"))


async def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own 404 (no route) and 405 (route, not this method) as OpenAI error objects, not
    text/plain; OPTIONS on a route without its own OPTIONS handler answers 204 with `Allow`."""
    assert isinstance(exc, HTTPException)
    headers = dict(exc.headers or {})
    shown = f"{request.method} {request.url.path}"[:200]
    if exc.status_code == 405:
        allow = headers.get("Allow", "")
        if request.method == "OPTIONS":
            return Response(status_code=204, headers={"Allow": ", ".join(filter(None, (allow, "OPTIONS")))})
        return error_response(
            405, f"Method not allowed ({shown}); use {allow}", code="method_not_allowed", headers=headers
        )
    if exc.status_code == 404:
        slash = request.url.path.endswith("/") and request.url.path != "/"
        hint = " (paths take no trailing slash)" if slash else ""
        return error_response(404, f"Invalid URL ({shown}): no such route{hint}", code="unknown_url", headers=headers)
    return error_response(exc.status_code, str(exc.detail), code="http_error", headers=headers)


async def server_error(request: Request, exc: Exception) -> Response:
    """A route that raised: the OpenAI error object with the request id (the traceback is logged
    by Starlette with the same id)."""
    rid = current_request_id() or new_request_id()
    return error_response(
        500, f"The server had an error while processing your request (request id {rid}).", code="internal_error"
    )


class RefusalCounts:
    """The security guard's refusals of requests to the OpenAI routes, counted as the routes count
    their own answers (`appserver_http_requests_total`) under the route's fixed label; a path no
    OpenAI route takes is not counted, so the labels stay bounded whatever paths clients send."""

    def __init__(self, metrics: Metrics, routes: list[BaseRoute]) -> None:
        self.metrics = metrics
        self.routes = [
            (r.path_regex, label)
            for r in routes
            if isinstance(r, Route) and (label := api_route_label(r.endpoint)) is not None
        ]

    def __call__(self, scope: Scope, status: int) -> None:
        path = scope.get("path") or ""
        if not path.startswith("/v1/") or scope.get("root_path"):
            return
        for regex, label in self.routes:
            if regex.match(path):
                self.metrics.observe_request(label, str(scope.get("method") or ""), status)
                return


class App:
    """The Starlette app, with the OpenAI API routes of a fixed path reached without its router.

    A request to `/v1/chat/completions` passed through eight layers of Starlette (two middlewares,
    the router, the route, two exception wrappers) before the endpoint, about a tenth of a small
    request's time. Those endpoints (`api_route`) dispatch on the method and turn every error into
    an OpenAI error object themselves, so for them the layers add nothing; every other request,
    WebSockets and the lifespan go through Starlette as before.
    """

    def __init__(
        self,
        starlette: Starlette,
        direct: dict[str, tuple[Endpoint, frozenset[str]]],
        refusals: RefusalCounts | None = None,
    ) -> None:
        self.starlette = starlette
        self.direct = direct
        self.refusals = refusals

    def count_refusal(self, scope: Scope, status: int) -> None:
        """The security guard refused this request (guard.py): counted in the metrics."""
        if self.refusals is not None:
            self.refusals(scope, status)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        hit = self.direct.get(scope["path"]) if scope["type"] == "http" and not scope.get("root_path") else None
        if hit is None or scope["method"] not in hit[1]:  # a method the route does not take: Starlette's 405
            await self.starlette(scope, receive, send)
            return
        endpoint = hit[0]
        scope["app"] = self.starlette
        started = False

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            response = await endpoint(Request(scope, receive, send))
            await response(scope, receive, tracked_send)
        except Exception:
            # What Starlette's ServerErrorMiddleware does: log it, answer 500 if nothing went out yet.
            log.exception("request %s on %s failed", current_request_id() or "-", scope["path"])
            if not started:
                await (await server_error(Request(scope, receive, send), RuntimeError()))(scope, receive, send)


def build_app(
    server: Server,
    services: Services,
    *,
    extra_routes: list[BaseRoute] | None = None,
    stopping: Stopping | None = None,
) -> App:
    """Build the ASGI app. The lifespan opens the Server (store, crash settle), runs the background
    services (`Services.running`) while it serves, and closes everything in reverse order.
    `stopping.stop()` (serve calls it when its graceful wait is over) answers the OpenAI requests
    still waiting with an OpenAI error instead of leaving them to be cut (http/stopping.py)."""

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await server.open(serve=True)
        try:
            async with services.running():
                yield
        finally:
            await server.close()

    routes: list[BaseRoute] = [Route("/healthz", healthz, methods=["GET"]), Route("/readyz", readyz, methods=["GET"])]
    routes.extend(openai_routes(server, services.metrics, stopping, services.places))
    routes.extend(ws_routes(server, services.hub, services.cron, services.places))
    routes.extend(extra_routes or [])
    app = Starlette(
        routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error, Exception: server_error}
    )
    # A path with a trailing slash (POST /v1/responses/) is no route: a 404 error object, never
    # Starlette's 307 with an empty body and a Location built from the Host header.
    app.router.redirect_slashes = False
    app.state.server = server
    app.state.json_bodies = JsonBodies(int(server.config.limits.max_messages))  # both OpenAI POST routes
    direct = {
        r.path: (r.endpoint, frozenset(r.methods or ()))
        for r in routes
        if isinstance(r, Route) and r.path.startswith("/v1/") and "{" not in r.path and is_api_route(r.endpoint)
    }
    return App(app, direct, RefusalCounts(services.metrics, routes))
