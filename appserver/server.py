"""The `Server` object: owns the config, the store, providers, tools, the kernel and the readiness
checks. Passed down, never global. The services `serve` runs around it (hub, metrics, cron) are
typed fields of `appserver.services.Services`, not entries in a bag on the Server."""

from __future__ import annotations

import logging

from appserver.agent.loop import AgentLoop
from appserver.agent.schedule_tool import schedule_tool
from appserver.agent.tools import ToolRegistry, builtin_tools
from appserver.agent_admin import Agents
from appserver.config import Config
from appserver.fsutil import set_aside_files, set_aside_notice, tighten_home
from appserver.providers.registry import ProviderRegistry
from appserver.readiness import CheckResult, Readiness
from appserver.runtime import Kernel
from appserver.store.select import make_store

log = logging.getLogger("appserver")

DEFAULT_AGENT = "assistant"


class Server:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.store = make_store(config)
        self.providers = ProviderRegistry(config)
        self.tools = ToolRegistry([*builtin_tools(), schedule_tool(self.store)])
        self.agent_loop = AgentLoop(config, self.providers, self.tools)
        self.kernel = Kernel(config, self.store, self.agent_loop)
        self.agents = Agents(self.kernel)
        self.readiness = Readiness()
        self.store.register_readiness(self.readiness, min_free_bytes=config.limits.min_free_disk_bytes)
        self.readiness.register("kernel", self._check_kernel, ttl_s=0)
        self.readiness.register("state_files", self._check_state_files)
        self._opened = False

    async def open(self, *, serve: bool = False) -> None:
        """Tighten the home, open the store (refusing a damaged one), settle crashed turns.
        Idempotent: `serve` opens before it binds the app, so a refusal is one line, not a
        traceback from inside the ASGI lifespan."""
        if self._opened:
            return
        home = self.config.home
        changed = tighten_home(home)
        if changed:
            shown = ", ".join(str(p.relative_to(home)) if p != home else str(p) for p in changed[:5])
            more = f" and {len(changed) - 5} more" if len(changed) > 5 else ""
            log.info("permissions tightened to owner-only (0700/0600) under %s: %s%s", home, shown, more)
        await self.store.open()
        if serve:
            await self.store.claim_server()
        # A new home or database gets the default agent. A database several servers share gets it
        # whenever a server starts on it with no agent at all: its first start may have been
        # killed between creating the schema and the agent, and nothing else would ever make it.
        shared = getattr(self.store, "shared", False)
        if self.store.fresh or (serve and shared):
            await self.agents.create_default(DEFAULT_AGENT)
        await self.kernel.start(serve=serve)
        if serve:
            self.providers.warm(a.model for a in await self.store.list_agents())
        self._opened = True
        for path in set_aside_files(home):
            log.warning("%s", set_aside_notice(home, path))

    async def close(self) -> None:
        if not self._opened:
            await self.store.close()  # an open that failed half way
            return
        self._opened = False
        await self.kernel.stop()
        await self.providers.aclose()
        await self.store.close()

    async def _check_kernel(self) -> CheckResult:
        return CheckResult("fail", "stopping") if self.kernel.stopping else CheckResult("ok")

    async def _check_state_files(self) -> CheckResult:
        found = set_aside_files(self.config.home)
        if not found:
            return CheckResult("ok")
        return CheckResult("warn", "; ".join(set_aside_notice(self.config.home, p) for p in found))
