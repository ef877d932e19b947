"""OpenAI-compatible routes: /v1/models, /v1/chat/completions, /v1/responses, and GET /metrics."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from appserver.http.chat import ChatCompletions
from appserver.http.common import (
    advertised_ids,
    api_route,
    json_response,
    model_object,
    principal_of,
    resolve_model,
    visible_agents,
)
from appserver.http.conversation_match import ConversationMatcher
from appserver.http.errors import ApiError
from appserver.http.metrics import Metrics
from appserver.http.responses import Responses
from appserver.http.stopping import Stopping
from appserver.security.limits import TurnPlaces
from appserver.server import Server

ALL_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]  # api_route answers each
# OpenAI's routes under /v1/responses/ this server does not implement, and what to do instead. Each
# is its own route, ahead of /v1/responses/{id}: read as a response id, a POST got a 405 pointing
# at GET (`responses.compact()` of the SDK), a GET a 404 for a response named "compact".
UNOFFERED_RESPONSE_ROUTES = {
    "compact": (
        "response compaction (OpenAI's POST /v1/responses/compact, the SDK's responses.compact()): this "
        "server compacts a conversation's context itself as it nears the agent's context window, so continue "
        "with previous_response_id or conversation as usual"
    ),
    "input_tokens": (
        "input token counting (OpenAI's POST /v1/responses/input_tokens, the SDK's "
        "responses.input_tokens.count()): each response's usage gives the tokens its model calls took"
    ),
}


def openai_routes(
    server: Server, metrics: Metrics, stopping: Stopping | None = None, places: TurnPlaces | None = None
) -> list[BaseRoute]:
    """`stopping`: the server's stop answers what still waits with an OpenAI error (stopping.py).
    `places`: the open-turn count shared with the WebSocket endpoint (`Services.places`)."""
    stopping = stopping or Stopping()
    places = places or TurnPlaces(server)
    matcher = ConversationMatcher(server)  # one for both routes: they match on the same history points
    chat = ChatCompletions(server, metrics, matcher, places, stopping)
    responses = Responses(server, metrics, matcher, places, stopping)

    async def list_models(request: Request) -> Response:
        agents = await server.store.list_agents()
        adv = advertised_ids(agents)
        visible = {a.id for a in await visible_agents(server, principal_of(request))}
        return json_response(
            {"object": "list", "data": [model_object(a, adv[a.id]) for a in agents if a.id in visible]}
        )

    async def get_model(request: Request) -> Response:
        if request.path_params["model"].endswith("/") or not request.path_params["model"]:
            # as every other path with a trailing slash: no route (a model's id never ends with one)
            raise ApiError(
                404,
                f"Invalid URL (GET {request.url.path[:200]}): no such route (paths take no trailing slash); "
                "use GET /v1/models to list the models, or GET /v1/models/{id}",
                code="unknown_url",
            )
        agent, model_id = await resolve_model(server, principal_of(request), request.path_params["model"], lookup=True)
        return json_response(model_object(agent, model_id))

    def route(path: str, name: str, methods: dict) -> Route:  # type: ignore[type-arg]
        return Route(path, api_route(metrics, name, methods, stopping, server.store.note_failure), methods=ALL_METHODS)

    paths = {f"/v1/responses/{name}": what for name, what in UNOFFERED_RESPONSE_ROUTES.items()}
    unoffered = [route(path, path, dict.fromkeys(ALL_METHODS, not_offered(what))) for path, what in paths.items()]
    return [
        route("/v1/models", "/v1/models", {"GET": list_models}),
        route("/v1/models/{model:path}", "/v1/models/{id}", {"GET": get_model}),
        route("/v1/chat/completions", "/v1/chat/completions", {"POST": chat.post}),
        route("/v1/responses", "/v1/responses", {"POST": responses.post}),
        *unoffered,
        route("/v1/responses/{response_id}", "/v1/responses/{id}", {"GET": responses.get, "DELETE": responses.delete}),
        route(
            "/v1/responses/{response_id}/input_items", "/v1/responses/{id}/input_items", {"GET": responses.input_items}
        ),
        route("/v1/responses/{response_id}/cancel", "/v1/responses/{id}/cancel", {"POST": responses.cancel}),
        Route("/metrics", metrics.endpoint, methods=["GET"]),
    ]


def not_offered(what: str) -> Callable[[Request], Awaitable[Response]]:
    """The handler of an OpenAI route this server does not implement: 404 `unknown_url` (as any
    route it lacks) saying what the route is and what to do instead, whatever the method."""

    async def refuse(request: Request) -> Response:
        shown = f"{request.method} {request.url.path}"[:200]
        raise ApiError(404, f"Invalid URL ({shown}): this server does not implement {what}.", code="unknown_url")

    return refuse
