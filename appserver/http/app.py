"""The Starlette application: health probes here; front-end routes mount onto it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import BaseRoute, Route

from appserver.http.openai_routes import openai_routes
from appserver.server import Server
from appserver.ws.routes import ws_routes


async def healthz(request: Request) -> JSONResponse:
    return JSONResponse({"status": "ok"})


async def readyz(request: Request) -> JSONResponse:
    server: Server = request.app.state.server
    checks: dict[str, Any] = {"store": "ok", "kernel": "ok"}
    try:
        await server.store.list_agents()
    except Exception as exc:  # the probe reports, it never raises
        checks["store"] = f"error: {exc}"
    if server.kernel._stopping:
        checks["kernel"] = "stopping"
    ready = all(v == "ok" for v in checks.values())
    return JSONResponse({"status": "ready" if ready else "not_ready", "checks": checks}, status_code=200 if ready else 503)


BackgroundService = Callable[[Server], AbstractAsyncContextManager[Any]]


def build_app(server: Server, *, extra_routes: list[BaseRoute] | None = None, background: list[BackgroundService] | None = None) -> Starlette:
    """Build the ASGI app. The lifespan opens the Server (store, crash settle), runs the background
    services (e.g. the cron scheduler) while it serves, and closes everything in reverse order."""

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await server.open(serve=True)
        try:
            async with AsyncExitStack() as stack:
                for service in background or []:
                    await stack.enter_async_context(service(server))
                yield
        finally:
            await server.close()

    routes: list[BaseRoute] = [Route("/healthz", healthz, methods=["GET"]), Route("/readyz", readyz, methods=["GET"])]
    routes.extend(openai_routes(server))
    routes.extend(ws_routes(server))
    routes.extend(extra_routes or [])
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.server = server
    return app
