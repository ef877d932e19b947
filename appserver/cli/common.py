"""Shared CLI plumbing: the home/config, JSON output, one-line errors with exit codes."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click

from appserver.config import Config, ConfigError, load_config
from appserver.errors import KernelError
from appserver.fsutil import CorruptStateFile
from appserver.server import Server
from appserver.serverinfo import HomeStarting, find_live_server

T = TypeVar("T")


def fail(message: str, code: int = 1) -> NoReturn:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def get_config() -> Config:
    try:
        return load_config()
    except (ConfigError, CorruptStateFile) as exc:
        fail(str(exc), 2)


def live_server_or_fail(server_json: Path) -> dict[str, Any] | None:
    """server.json of the server that owns this home (waiting while one starts), or None."""
    try:
        return find_live_server(server_json)
    except HomeStarting as exc:
        fail(f"{exc}; try again in a moment", 3)


def print_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, ensure_ascii=False, default=str))


def with_server(fn: Callable[[Server], Awaitable[T]], *, config: Config | None = None) -> T:
    """Run `fn` against an in-process Server on this home; kernel errors become one-line exits."""

    async def runner() -> T:
        server = Server(config or get_config())
        await server.open()
        try:
            return await fn(server)
        finally:
            await server.close()

    try:
        return asyncio.run(runner())
    except KernelError as exc:
        fail(exc.message, 2 if exc.http_status in (400, 404, 409) else 1)
    except (ConfigError, CorruptStateFile) as exc:
        fail(str(exc), 2)
