"""`appserver serve`: Starlette + uvicorn, server.json while running, clean stop on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Iterator

import click
import uvicorn

from appserver.cli.common import fail, get_config
from appserver.config import Config
from appserver.http.app import build_app
from appserver.server import Server
from appserver.serverinfo import read_live_server, remove_server_json, write_server_json

log = logging.getLogger("appserver.serve")


def split_listen(listen: str) -> tuple[str, int]:
    """`HOST:PORT`, `[::1]:PORT` or `PORT` → (host, port)."""
    text = listen.strip()
    if text.isdigit():
        return "127.0.0.1", int(text)
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest.lstrip(":")
    else:
        host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"invalid listen address {listen!r}: use HOST:PORT, [::1]:PORT or PORT")
    return host, int(port)


def url_for(host: str, port: int, tls: bool = False) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"{'https' if tls else 'http'}://{shown}:{port}"


class _UvicornServer(uvicorn.Server):
    """uvicorn re-raises a captured SIGTERM after shutdown (exit status -15); we own the signals so
    a clean stop exits 0 and the `finally` that removes server.json always runs."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal)
        try:
            yield
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    def _on_signal(self) -> None:
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True


async def serve_async(config: Config, host: str, port: int) -> None:
    server = Server(config)
    app = build_app(server)
    uv = _UvicornServer(uvicorn.Config(app, host=host, port=port, lifespan="on", log_level="warning", server_header=False, timeout_graceful_shutdown=5))
    task = asyncio.create_task(uv.serve())
    while not uv.started:
        if task.done():
            await task
            fail(f"could not start on {host}:{port}", 1)
        await asyncio.sleep(0.02)
    bound_port = uv.servers[0].sockets[0].getsockname()[1] if uv.servers and uv.servers[0].sockets else port
    url = url_for(host, bound_port)
    write_server_json(config.server_json, url, config.auth.mode, home=str(config.home))
    click.echo(f"appserver listening on {url}  (home {config.home})", err=False)
    try:
        await task
    finally:
        remove_server_json(config.server_json)


@click.command("serve")
@click.option("--listen", default=None, help="HOST:PORT to bind (default 127.0.0.1:8770).")
def serve_command(listen: str | None) -> None:
    """Run the server."""
    config = get_config()
    try:
        host, port = split_listen(listen or config.server.listen)
    except ValueError as exc:
        fail(str(exc), 2)
    live = read_live_server(config.server_json)
    if live is not None:
        fail(f"a server already runs on this home: {live.get('url')} (pid {live.get('pid')})", 3)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config.server.listen = f"{host}:{port}"
    asyncio.run(serve_async(config, host, port))
