"""`appserver.http.app.App`: the OpenAI API routes of a fixed path skip Starlette's router and
middlewares; what those layers did for them (the app in the scope, a 500 as an OpenAI error object
when a reply fails before its head went out) still happens, and every other request is Starlette's."""

from __future__ import annotations

from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from appserver.config import load_config
from appserver.http.app import App
from appserver.http.common import api_route, is_api_route
from appserver.http.metrics import Metrics
from appserver.server import Server


class _Exploding(Response):
    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        raise RuntimeError("the reply could not be written")


async def _client(app: App) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver")


def _app(tmp_path: Any) -> App:
    metrics = Metrics(Server(load_config(tmp_path / "home", environ={})))

    async def ok(request: Request) -> Response:
        return JSONResponse({"app_state": request.app.state.marker, "path": request.url.path})

    async def explode(request: Request) -> Response:
        return _Exploding()

    async def other(request: Request) -> Response:
        return JSONResponse({"via": "starlette"})

    routes = [
        Route("/v1/ok", api_route(metrics, "/v1/ok", {"POST": ok}), methods=["POST", "GET"]),
        Route("/v1/explode", api_route(metrics, "/v1/explode", {"GET": explode}), methods=["GET"]),
        Route("/v1/other/{x}", api_route(metrics, "/v1/other/{x}", {"GET": other}), methods=["GET"]),
    ]
    starlette = Starlette(routes=routes)
    starlette.state.marker = "here"
    fixed = [r for r in routes if "{" not in r.path and is_api_route(r.endpoint)]
    direct = {r.path: (r.endpoint, frozenset(r.methods or ())) for r in fixed}
    assert set(direct) == {"/v1/ok", "/v1/explode"}
    return App(starlette, direct)


async def test_direct_route_sees_the_app_and_dispatches_on_the_method(tmp_path: Any) -> None:
    async with await _client(_app(tmp_path)) as client:
        r = await client.post("/v1/ok")
        assert r.status_code == 200 and r.json() == {"app_state": "here", "path": "/v1/ok"}
        r = await client.get("/v1/ok")  # a method of the route that api_route does not serve: its 405
        assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
        r = await client.request("PROPFIND", "/v1/ok")  # not a method of the route: Starlette's 405
        assert r.status_code == 405
        r = await client.get("/v1/other/1")  # a path with parameters: Starlette's router
        assert r.status_code == 200 and r.json() == {"via": "starlette"}
        r = await client.get("/v1/ok/")  # not the exact path: Starlette (its redirect or 404)
        assert r.status_code in (307, 404)


async def test_a_reply_that_fails_before_its_head_is_an_openai_500(tmp_path: Any) -> None:
    async with await _client(_app(tmp_path)) as client:
        r = await client.get("/v1/explode")
    assert r.status_code == 500
    assert r.json()["error"]["code"] == "internal_error"
