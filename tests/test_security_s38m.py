"""Who is "the owner on this machine" (auth mode none, /readyz details, WebSockets), through a real
`appserver serve` on loopback with real httpx, openai and websockets clients:

* a request a reverse proxy or tunnel on this machine passes on for someone else (it carries
  `Forwarded`, `X-Forwarded-For` or `X-Real-IP`) is not the owner: refused in mode none (403
  `forwarded_needs_auth`, also the WebSocket upgrade), and without the details of /readyz;
* with `[server] trusted_proxies`, the proxy's `Forwarded` and `X-Real-IP` name the client as its
  `X-Forwarded-For` does (uvicorn reads only the latter): a remote client is refused in mode none
  whichever the proxy sends, a loopback one served, an unreadable one refused (400);
* another Unix user of this machine (Linux: the kernel says whose a loopback connection is) is not
  the owner: refused in mode none (403 `other_user`), no /readyz details in token mode either.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import websockets

from tests.support.cli import cli_env
from tests.support.serve import ServeProcess, serving

pytestmark = pytest.mark.timeout(60)

T = 10.0
REMOTE = "203.0.113.5"
FORWARDING = [
    {"X-Forwarded-For": REMOTE},
    {"Forwarded": f"for={REMOTE};proto=https"},
    {"X-Real-IP": REMOTE},
]


@pytest.fixture
def none_server(tmp_path: Path) -> Iterator[ServeProcess]:
    home = tmp_path / "home"
    with serving(home, env=cli_env(home)) as sp:
        yield sp


@pytest.fixture
def proxied_server(tmp_path: Path) -> Iterator[ServeProcess]:
    home = tmp_path / "home"
    with serving(home, env=cli_env(home, APPSERVER_SERVER__TRUSTED_PROXIES="127.0.0.1")) as sp:
        yield sp


def _models(sp: ServeProcess, headers: dict[str, str]) -> httpx.Response:
    return httpx.get(sp.url + "/v1/models", headers=headers, timeout=T)


def _ws_upgrade_status(sp: ServeProcess, headers: dict[str, str]) -> tuple[int, bytes]:
    """The HTTP status of the WebSocket upgrade (101 when accepted) and the refusal's body."""

    async def attempt() -> tuple[int, bytes]:
        url = sp.url.replace("http://", "ws://") + "/ws"
        try:
            async with websockets.connect(url, additional_headers=headers, open_timeout=T):
                return 101, b""
        except websockets.InvalidStatus as exc:
            return exc.response.status_code, exc.response.body or b""

    return asyncio.run(asyncio.wait_for(attempt(), T * 2))


@pytest.mark.parametrize("header", FORWARDING, ids=lambda h: next(iter(h)))
def test_mode_none_refuses_what_a_proxy_on_this_machine_forwards(
    none_server: ServeProcess, header: dict[str, str]
) -> None:
    client = openai.OpenAI(base_url=none_server.url + "/v1", api_key="unused", default_headers=header, max_retries=0)
    with pytest.raises(openai.PermissionDeniedError) as refused:
        client.models.list()
    assert refused.value.code == "forwarded_needs_auth", refused.value.body
    assert "--auth token" in refused.value.message
    status, body = _ws_upgrade_status(none_server, header)
    assert status == 403 and b"forwarded_needs_auth" in body, (status, body)
    # still served to the owner, and the probes still answer (without the details) for the proxy
    assert _models(none_server, {}).status_code == 200
    assert _ws_upgrade_status(none_server, {})[0] == 101
    ready = httpx.get(none_server.url + "/readyz", headers=header, timeout=T)
    assert ready.status_code == 200 and "bytes free" not in ready.text, ready.text
    assert "bytes free" in httpx.get(none_server.url + "/readyz", timeout=T).text


@pytest.mark.parametrize("header", FORWARDING, ids=lambda h: next(iter(h)))
def test_a_trusted_proxy_names_the_client_in_every_forwarding_header(
    proxied_server: ServeProcess, header: dict[str, str]
) -> None:
    refused = _models(proxied_server, header)
    assert refused.status_code == 403, refused.text
    assert refused.json()["error"]["code"] in ("loopback_only", "forwarded_needs_auth"), refused.text
    assert _ws_upgrade_status(proxied_server, header)[0] == 403
    name = next(iter(header))
    local = {name: header[name].replace(REMOTE, "127.0.0.3")}
    assert _models(proxied_server, local).status_code == 200, local
    assert _models(proxied_server, {}).status_code == 200


def test_a_trusted_proxy_that_names_no_address_is_refused(proxied_server: ServeProcess) -> None:
    for header in ({"Forwarded": "for=unknown"}, {"Forwarded": "for=_hidden"}, {"X-Real-IP": "somewhere"}):
        r = _models(proxied_server, header)
        assert r.status_code == 400 and r.json()["error"]["code"] == "unreadable_forwarding", (header, r.text)


# ── another Unix user of this machine (Linux, the test running as root) ─────────────────────────

OTHER_UID = 65534  # nobody
AS_OTHER_USER = ["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups"]
OTHER_CLIENT = r"""
import asyncio, json, sys
import httpx, websockets
url = sys.argv[1]
out = {
    "models": httpx.get(url + "/v1/models", timeout=10).text,
    "healthz": httpx.get(url + "/healthz", timeout=10).status_code,
    "readyz": httpx.get(url + "/readyz", timeout=10).text,
}
async def upgrade():
    try:
        async with websockets.connect(url.replace("http://", "ws://") + "/ws", open_timeout=10):
            return 101
    except websockets.InvalidStatus as exc:
        return exc.response.status_code
out["ws"] = asyncio.run(upgrade())
print(json.dumps(out))
"""


def _as_other_user(url: str) -> dict[str, object]:
    """Run the clients above as uid `nobody` against `url`, and what they got."""
    run = subprocess.run(
        [*AS_OTHER_USER, sys.executable, "-c", OTHER_CLIENT, url],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return dict(json.loads(run.stdout))


def _skip_unless_root_on_linux() -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("the peer's Unix user of a loopback connection is read from the kernel on Linux only")
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("running a client as another Unix user needs root and setpriv")
    probe = subprocess.run(
        [*AS_OTHER_USER, sys.executable, "-c", "import httpx, websockets"],
        capture_output=True,
        timeout=30,
        cwd="/",
    )
    if probe.returncode != 0:
        pytest.skip("uid nobody cannot run this interpreter and its packages")


def test_mode_none_serves_only_the_servers_own_unix_user(none_server: ServeProcess) -> None:
    _skip_unless_root_on_linux()
    got = _as_other_user(none_server.url)
    assert '"other_user"' in str(got["models"]) and "--auth token" in str(got["models"]), got
    assert got["ws"] == 403 and got["healthz"] == 200, got
    assert "bytes free" not in str(got["readyz"]), got
    # the server's own user still is the owner
    assert _models(none_server, {}).status_code == 200
    assert "bytes free" in httpx.get(none_server.url + "/readyz", timeout=T).text


def test_readyz_details_are_not_for_another_unix_user_in_token_mode(tmp_path: Path) -> None:
    _skip_unless_root_on_linux()
    home = tmp_path / "home"
    with serving(home, "--auth", "token", env=cli_env(home)) as sp:
        got = _as_other_user(sp.url)
        assert "bytes free" not in str(got["readyz"]) and got["healthz"] == 200, got
        assert "bytes free" in httpx.get(sp.url + "/readyz", timeout=T).text
