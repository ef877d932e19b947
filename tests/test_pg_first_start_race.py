"""Servers of a cluster started at once on a new database: one of them creates the schema, and only
that one finds the database new and creates the default agent. Found by starting three at once:
two `assistant` agents, so every request naming it was refused as ambiguous."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from appserver.config import load_config
from appserver.server import Server
from tests.support.pg import require_postgres, temp_database

pytestmark = pytest.mark.timeout(90)


async def test_servers_started_at_once_on_a_new_database_make_one_default_agent(tmp_path: Path) -> None:
    require_postgres()
    for attempt in range(3):
        with temp_database(f"first_start{attempt}") as url:
            servers = [
                Server(load_config(tmp_path / f"a{attempt}n{i}", environ={"APPSERVER_STORE__URL": url}))
                for i in range(4)
            ]
            try:
                await asyncio.gather(*(s.open() for s in servers))
                agents = await servers[0].store.list_agents()
                assert [a.name for a in agents] == ["assistant"], agents
                assert sum(s.store.fresh for s in servers) == 1
            finally:
                for s in servers:
                    await s.close()
