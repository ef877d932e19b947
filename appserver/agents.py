"""Agent management shared by the CLI and admin front ends: validation first, nothing written on error."""

from __future__ import annotations

import re

from appserver.config import Config
from appserver.errors import InvalidInput, NotFound
from appserver.providers.registry import ModelStringError, parse_model
from appserver.runtime.kernel import Kernel, new_id
from appserver.store.records import POLICIES, AgentRecord

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")
TOOL_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


def validate_model(model: str, config: Config) -> str:
    try:
        parse_model(model, config)
    except ModelStringError as exc:
        raise InvalidInput(str(exc), param="model") from None
    return model.strip()


def validate_name(name: str) -> str:
    if not NAME_RE.match(name or ""):
        raise InvalidInput(f"invalid agent name {name!r}: letters, digits, '_', '-', '.', at most 64 characters", param="name")
    return name


def parse_tool_policies(specs: list[str] | tuple[str, ...]) -> dict[str, str]:
    """Parse `NAME=allow|ask|deny` items."""
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, policy = spec.partition("=")
        name, policy = name.strip(), policy.strip()
        if not sep or not TOOL_RE.match(name):
            raise InvalidInput(f"invalid --tool {spec!r}: use NAME=allow|ask|deny", param="tool")
        if policy not in POLICIES:
            raise InvalidInput(f"invalid policy {policy!r} for tool {name!r}: use allow, ask or deny", param="tool")
        out[name] = policy
    return out


class Agents:
    def __init__(self, kernel: Kernel) -> None:
        self.kernel = kernel
        self.store = kernel.store
        self.config = kernel.config

    async def create(self, name: str, model: str = "echo", system: str = "", tools: dict[str, str] | None = None, params: dict | None = None) -> AgentRecord:
        agent = AgentRecord(id=new_id("agt"), name=validate_name(name), model=validate_model(model, self.config), system=system or "", tools=dict(tools or {}), params=dict(params or {}))
        return await self.store.create_agent(agent)

    async def get(self, ref: str) -> AgentRecord:
        return await self.kernel.resolve_agent(ref)

    async def update(self, ref: str, *, name: str | None = None, model: str | None = None, system: str | None = None, tools: dict[str, str] | None = None, params: dict | None = None) -> AgentRecord:
        agent = await self.get(ref)
        if name is not None:
            agent.name = validate_name(name)
        if model is not None:
            agent.model = validate_model(model, self.config)
        if system is not None:
            agent.system = system
        if tools:
            agent.tools.update(tools)
        if params:
            agent.params.update(params)
        return await self.store.update_agent(agent)

    async def delete(self, ref: str) -> AgentRecord:
        agent = await self.get(ref)
        if not await self.store.delete_agent(agent.id):
            raise NotFound(f"unknown agent {ref!r}", code="agent_not_found")
        return agent
