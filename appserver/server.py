"""The `Server` object: owns the config, the store, providers, tools and the kernel. Passed down, never global."""

from __future__ import annotations

import logging

from appserver.agent.loop import AgentLoop
from appserver.agent.schedule_tool import SCHEDULE
from appserver.agent.tools import ToolRegistry, builtin_tools
from appserver.agents import Agents
from appserver.config import Config
from appserver.providers.registry import ProviderRegistry
from appserver.runtime.kernel import Kernel
from appserver.store.sqlite import SQLiteStore

log = logging.getLogger("appserver")

DEFAULT_AGENT = "assistant"


class Server:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.store = SQLiteStore(config.db_path)
        self.providers = ProviderRegistry(config)
        self.tools = ToolRegistry([*builtin_tools(), SCHEDULE])
        self.services: dict[str, object] = {}
        self.agent_loop = AgentLoop(config, self.providers, self.tools, self.services)
        self.kernel = Kernel(config, self.store, self.agent_loop)
        self.agents = Agents(self.kernel)

    async def open(self, *, serve: bool = False) -> None:
        await self.store.open()
        if self.store.fresh and not await self.store.list_agents():
            await self.agents.create(DEFAULT_AGENT, "echo", "")
        await self.kernel.start(serve=serve)

    async def close(self) -> None:
        await self.kernel.stop()
        await self.providers.aclose()
        await self.store.close()
