"""OpenAI-compatible routes (/v1/models, /v1/chat/completions, /v1/responses). Filled by issue 3."""

from __future__ import annotations

from starlette.routing import BaseRoute

from appserver.server import Server


def openai_routes(server: Server) -> list[BaseRoute]:
    return []
