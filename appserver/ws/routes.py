"""The WebSocket protocol endpoint at /ws. Filled by issue 5."""

from __future__ import annotations

from starlette.routing import BaseRoute

from appserver.server import Server


def ws_routes(server: Server) -> list[BaseRoute]:
    return []
