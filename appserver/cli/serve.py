"""`appserver serve`: Starlette + uvicorn, server.json while running, clean stop on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Iterator

import click
import uvicorn

from appserver.auth import Authenticator
from appserver.cli.common import fail, get_config
from appserver.config import Config, ConfigError
from appserver.http.guard import SecurityGuard
from appserver.logredact import from_config as redactor_from_config
from appserver.logredact import install as install_redactor
from appserver.netaddr import check_bind_allowed, parse_listen
from appserver.http.app import build_app
from appserver.server import Server
from cron.service import cron_background
from appserver.serverinfo import read_live_server, remove_server_json, write_server_json

log = logging.getLogger("appserver.serve")


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


def build_asgi(config: Config, server: Server) -> tuple[SecurityGuard, Authenticator]:
    """The whole app behind the security guard: every route, present and future, is covered."""
    authenticator = Authenticator(config)
    return SecurityGuard(build_app(server, background=[cron_background]), config, authenticator), authenticator


async def serve_async(config: Config, host: str, port: int) -> None:
    server = Server(config)
    app, authenticator = build_asgi(config, server)
    tls = bool(config.server.tls_cert and config.server.tls_key)
    uv_config = uvicorn.Config(
        app,
        host=host,
        port=port,
        lifespan="on",
        log_level="warning",
        server_header=False,
        timeout_graceful_shutdown=5,
        ws_max_size=config.limits.ws_frame_max_bytes,
        ws_ping_interval=config.limits.ws_ping_interval_s or None,
        ws_ping_timeout=config.limits.ws_ping_timeout_s or None,
        ssl_certfile=config.server.tls_cert if tls else None,
        ssl_keyfile=config.server.tls_key if tls else None,
    )
    install_redactor(redactor_from_config(config, authenticator.secrets()))
    uv = _UvicornServer(uv_config)
    task = asyncio.create_task(uv.serve())
    while not uv.started:
        if task.done():
            await task
            fail(f"could not start on {host}:{port}", 1)
        await asyncio.sleep(0.02)
    bound_port = uv.servers[0].sockets[0].getsockname()[1] if uv.servers and uv.servers[0].sockets else port
    url = url_for(host, bound_port, tls)
    write_server_json(config.server_json, url, config.auth.mode, home=str(config.home))
    click.echo(f"appserver listening on {url}  (home {config.home})", err=False)
    try:
        await task
    finally:
        remove_server_json(config.server_json)


@click.command("serve")
@click.option("--listen", default=None, help="HOST:PORT to bind (default 127.0.0.1:8770).")
@click.option("--auth", "auth_mode", type=click.Choice(["none", "token", "jwt"]), default=None, help="Authentication mode (overrides [auth] mode).")
@click.option("--tls-cert", default=None, type=click.Path(dir_okay=False), help="PEM certificate: serve https.")
@click.option("--tls-key", default=None, type=click.Path(dir_okay=False), help="PEM private key for --tls-cert.")
def serve_command(listen: str | None, auth_mode: str | None, tls_cert: str | None, tls_key: str | None) -> None:
    """Run the server."""
    config = get_config()
    if auth_mode:
        config.auth.mode = auth_mode
    if tls_cert or tls_key:
        if not (tls_cert and tls_key):
            fail("--tls-cert and --tls-key go together", 2)
        config.server.tls_cert, config.server.tls_key = tls_cert, tls_key
    try:
        addr = parse_listen(listen or config.server.listen)
        check_bind_allowed(addr, config.auth.mode)
        Authenticator(config)  # a bad JWT/token configuration fails here, before any socket opens
    except (ValueError, ConfigError) as exc:
        fail(str(exc), 2)
    host, port = addr.host, addr.port
    live = read_live_server(config.server_json)
    if live is not None:
        fail(f"a server already runs on this home: {live.get('url')} (pid {live.get('pid')})", 3)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config.server.listen = str(addr)
    asyncio.run(serve_async(config, host, port))
