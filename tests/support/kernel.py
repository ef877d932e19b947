"""An in-process `Server` on a test home: the kernel without HTTP, for tests that drive it directly."""

from __future__ import annotations

from pathlib import Path

from appserver.config import load_config
from appserver.server import Server


async def open_server(home: Path, config_toml: str | None = None, **env: str) -> Server:
    """Open a `Server` on `home` (retries fast, so no test waits on backoff); `config_toml` is written
    first when given. The caller closes it."""
    if config_toml is not None:
        home.mkdir(parents=True, exist_ok=True)
        (home / "config.toml").write_text(config_toml)
    server = Server(load_config(home, environ={"APPSERVER_LIMITS__RETRY_BASE_MS": "5", **env}))
    await server.open()
    return server
