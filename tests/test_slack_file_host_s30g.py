"""The bot token goes only to Slack's own file hosts.

A Slack file object names the URL to fetch it from (`url_private`), and the event carries it: an
external file (`is_external`) or a crafted one can name any host. The adapter fetched every image
from whatever `url_private` said, with `Authorization: Bearer xoxb-…`, so that host got the bot
token. Now an image is fetched only from https on `slack.com` / `*.slack.com`, or from the
configured `api_url`'s origin (here the loopback fake); anything else is named as a file, not
fetched. A file host answering with a redirect to another host is not followed there either.

The real adapter (slack_sdk, httpx) against tests/fakes/slack_api.py, plus a second loopback HTTP
server on another port of 127.0.0.1 as the foreign host, which records every request it gets.
"""

from __future__ import annotations

import errno
import http.server
import logging
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import BaseRoute, Route

from plugins.contract import Account, AdapterContext, InboundMessage
from plugins.slack import SlackAdapter, create_adapter
from tests.fakes.slack_api import FakeSlack

PORTS = range(53000, 53500)  # this test's loopback ports
PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 24


def _bind_in_range(used: set[int]) -> socket.socket:
    """A socket bound to 127.0.0.1 on a free port of `PORTS` (not in `used`)."""
    for port in PORTS:
        if port in used:
            continue
        sock = socket.socket()
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as exc:
            sock.close()
            if exc.errno == errno.EADDRINUSE:
                continue
            raise
        return sock
    raise RuntimeError("no free port in 53000-53499")


class ForeignHost:
    """Another host than Slack's: answers every GET with a PNG and records (path, Authorization)."""

    def __init__(self, used: set[int]) -> None:
        self.seen: list[tuple[str, str | None]] = []
        seen = self.seen

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                seen.append((self.path, self.headers.get("Authorization")))
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(PNG)))
                self.end_headers()
                self.wfile.write(PNG)

            def log_message(self, *args: Any) -> None:
                pass

        sock = _bind_in_range(used)
        self.port = int(sock.getsockname()[1])
        sock.close()
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="foreign-host", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=5)


class RedirectingSlack(FakeSlack):
    """The fake, whose file host also answers `/moved/<name>` with a 302 to `redirect_to`."""

    def __init__(self, port: int) -> None:
        super().__init__(ack_timeout=1.0)
        self._port = port
        self.redirect_to = ""

    def _routes(self) -> list[BaseRoute]:
        return [Route("/moved/{name}", self._moved, methods=["GET"]), *super()._routes()]

    async def _moved(self, request: Request) -> Response:
        return RedirectResponse(self.redirect_to, status_code=302)


@pytest.fixture(scope="module")
def hosts() -> Iterator[tuple[RedirectingSlack, ForeignHost]]:
    probe = _bind_in_range(set())
    slack_port = int(probe.getsockname()[1])
    probe.close()
    foreign = ForeignHost({slack_port})
    try:
        with RedirectingSlack(slack_port) as slack:
            yield slack, foreign
    finally:
        foreign.close()


@pytest.fixture
async def running(
    hosts: tuple[RedirectingSlack, ForeignHost], tmp_path: Path
) -> AsyncIterator[tuple[SlackAdapter, dict[str, InboundMessage]]]:
    slack, _ = hosts
    taken: dict[str, InboundMessage] = {}

    async def on_message(msg: InboundMessage) -> None:
        taken.setdefault(msg.message_id, msg)
        if msg.ack is not None:
            await msg.ack()

    ctx = AdapterContext(on_message, lambda state, reason: None, tmp_path, logging.getLogger("test.slack"))
    account = Account(
        "slack", "main", {"api_url": slack.url}, {"bot_token": slack.bot_token, "app_token": slack.app_token}
    )
    adapter = create_adapter(account, ctx)
    assert isinstance(adapter, SlackAdapter)
    await adapter.start()
    try:
        yield adapter, taken
    finally:
        await adapter.stop()


def _image(name: str, url: str, **extra: Any) -> dict[str, Any]:
    return {"id": f"F{name.upper()}", "name": name, "title": name, "mimetype": "image/png", "filetype": "png",
            "size": len(PNG), "url_private": url, **extra}  # fmt: skip


async def test_an_external_or_foreign_image_never_gets_the_bot_token(
    hosts: tuple[RedirectingSlack, ForeignHost], running: tuple[SlackAdapter, dict[str, InboundMessage]]
) -> None:
    slack, foreign = hosts
    _, taken = running
    foreign.seen.clear()
    genuine = slack.add_file("real.png", PNG)
    external = _image("ext.png", f"{foreign.url}/steal/ext.png", is_external=True, external_type="app")
    crafted = _image("crafted.png", f"{foreign.url}/steal/crafted.png", is_external=False)
    ts = slack.inject_dm("U5", "look at these", channel="D-host", files=[genuine, external, crafted])
    await slack.wait_for_async(lambda: f"D-host:{ts}" in taken, 10, "the message")
    real, ext, other = taken[f"D-host:{ts}"].attachments
    assert foreign.seen == [], foreign.seen  # the other host got no request at all, so no token
    # the foreign ones are named as files (not fetched); Slack's own is still fetched with the token
    assert (ext.kind, ext.name, ext.data) == ("file", "ext.png", None)
    assert (other.kind, other.name, other.data) == ("file", "crafted.png", None)
    assert (real.kind, real.data) == ("image", PNG)
    assert (genuine["id"], slack.bot_token) in slack.file_gets()
    assert taken[f"D-host:{ts}"].text == "look at these"


async def test_a_redirect_to_another_host_is_not_followed_with_the_token(
    hosts: tuple[RedirectingSlack, ForeignHost], running: tuple[SlackAdapter, dict[str, InboundMessage]]
) -> None:
    slack, foreign = hosts
    _, taken = running
    foreign.seen.clear()
    slack.redirect_to = f"{foreign.url}/steal/moved.png"
    moved = _image("moved.png", f"{slack.url}/moved/moved.png")
    ts = slack.inject_dm("U5", "moved", channel="D-redirect", files=[moved])
    await slack.wait_for_async(lambda: f"D-redirect:{ts}" in taken, 10, "the message")
    [attachment] = taken[f"D-redirect:{ts}"].attachments
    assert not [auth for _, auth in foreign.seen if auth and slack.bot_token in auth], foreign.seen
    assert foreign.seen == [], foreign.seen  # not fetched from there at all
    assert (attachment.kind, attachment.data) == ("file", None)


@pytest.mark.parametrize(
    ("url", "gets_token"),
    [
        ("https://files.slack.com/files-pri/T1-F1/cat.png", True),
        ("https://files-edu.slack.com/files-pri/T1-F1/cat.png", True),
        ("https://acme.enterprise.slack.com/files-pri/T1-F1/cat.png", True),
        ("https://slack.com/files-pri/T1-F1/cat.png", True),
        ("https://FILES.SLACK.COM/files-pri/T1-F1/cat.png", True),
        ("http://files.slack.com/files-pri/T1-F1/cat.png", False),  # not https
        ("https://files.slack.com:8443/files-pri/T1-F1/cat.png", False),
        ("https://evilslack.com/cat.png", False),
        ("https://files.slack.com.evil.test/cat.png", False),
        ("https://files.slack.com@evil.test/cat.png", False),  # userinfo: the host is evil.test
        ("https://files.slack.com\\@evil.test/cat.png", False),
        ("https://evil.test/files.slack.com/cat.png", False),
        ("not a url", False),
    ],
)
def test_which_hosts_get_the_token(url: str, gets_token: bool, tmp_path: Path) -> None:
    async def on_message(msg: InboundMessage) -> None:
        pass

    ctx = AdapterContext(on_message, lambda state, reason: None, tmp_path, logging.getLogger("test.slack"))
    adapter = create_adapter(Account("slack", "main", {}, {}), ctx)
    assert isinstance(adapter, SlackAdapter)
    assert adapter._is_file_url(url) is gets_token
    # the configured api_url's origin (a self-hosted Slack, the fake) gets it, another port does not
    local = create_adapter(Account("slack", "main", {"api_url": "http://127.0.0.1:53001"}, {}), ctx)
    assert isinstance(local, SlackAdapter)
    assert local._is_file_url("http://127.0.0.1:53001/files/F1/cat.png")
    assert not local._is_file_url("http://127.0.0.1:53002/files/F1/cat.png")
