"""The composition root: `serve` builds typed `Services` around the `Server` (no string-keyed bag),
and a service registers its own readiness check while it runs (cron: `cron`, a warning)."""

from __future__ import annotations

from pathlib import Path

import pytest

from appserver.config import load_config
from appserver.fsutil import CorruptStateFile
from appserver.server import Server
from appserver.services import build_services


async def test_cron_registers_its_readiness_check_while_it_runs(tmp_path: Path) -> None:
    server = Server(load_config(tmp_path / "home", environ={"APPSERVER_DISABLE_CRON": "1"}))
    services = build_services(server)
    assert not hasattr(server, "services")
    await server.open()
    try:
        assert "cron" not in server.readiness.names
        async with services.running():
            assert server.readiness.names[:3] == ["store", "kernel", "state_files"]
            assert "cron" in server.readiness.names
            ready, body = await server.readiness.report()
            assert ready and {"name": "cron", "status": "ok"} in body["checks"]
            (server.config.home / "crons.json").write_text("{ not json")
            with pytest.raises(CorruptStateFile), services.cron.scheduler.store.transaction():
                pass
            server.readiness.register("cron", services.cron.readiness, ttl_s=0)  # skip the cache
            ready, body = await server.readiness.report()
            cron = next(c for c in body["checks"] if c["name"] == "cron")
            assert ready and cron["status"] == "warn" and "set aside" in cron["detail"]
        assert "cron" not in server.readiness.names
    finally:
        await server.close()
