"""Agent management shared by the CLI and admin front ends: validation first, nothing written on error."""

from __future__ import annotations

import re
from typing import Any

from appserver.agentparams import AGENT_PARAMS, BadParam
from appserver.config import Config
from appserver.errors import InvalidInput, NotFound
from appserver.ids import AGENT_ID_PREFIX
from appserver.providers.registry import ModelStringError, parse_model
from appserver.runtime import Kernel, new_id
from appserver.shown import shown
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
        raise InvalidInput(
            f"invalid agent name {shown(name)}: letters, digits, '_', '-', '.', at most 64 characters", param="name"
        )
    if name.startswith(AGENT_ID_PREFIX):
        # A token or JWT limited to an agent id would also admit an agent named like that id.
        raise InvalidInput(
            f"invalid agent name {shown(name)}: names starting with {AGENT_ID_PREFIX!r} are kept for agent ids",
            param="name",
        )
    return name


def parse_tool_policies(specs: list[str] | tuple[str, ...]) -> dict[str, str]:
    """Parse `NAME=allow|ask|deny` items."""
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, policy = spec.partition("=")
        name, policy = name.strip(), policy.strip()
        if not sep or not TOOL_RE.match(name):
            raise InvalidInput(f"invalid --tool {shown(spec)}: use NAME=allow|ask|deny", param="tool")
        if policy not in POLICIES:
            raise InvalidInput(
                f"invalid policy {shown(policy)} for tool {name!r}: use allow, ask or deny", param="tool"
            )
        out[name] = policy
    return out


def parse_params(specs: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Parse `KEY=VALUE` items; an empty value (`KEY=`) removes the parameter (stored as None)."""
    out: dict[str, Any] = {}
    for spec in specs:
        key, sep, raw = spec.partition("=")
        key, raw = key.strip(), raw.strip()
        if not sep or key not in AGENT_PARAMS:
            raise InvalidInput(
                f"invalid --param {shown(spec)}: use KEY=VALUE with KEY one of {', '.join(AGENT_PARAMS)}", param="param"
            )
        if raw == "":
            out[key] = None
            continue
        try:
            out[key] = AGENT_PARAMS[key].parse(raw)
        except BadParam as exc:
            raise InvalidInput(f"invalid --param {key}={shown(raw)}: {exc}", param="param") from None
    return out


class Agents:
    def __init__(self, kernel: Kernel) -> None:
        self.kernel = kernel
        self.store = kernel.store
        self.config = kernel.config

    async def create(
        self,
        name: str,
        model: str = "echo",
        system: str = "",
        tools: dict[str, str] | None = None,
        params: dict[str, Any] | None = None,
    ) -> AgentRecord:
        agent = AgentRecord(
            id=new_id("agt"),
            name=validate_name(name),
            model=validate_model(model, self.config),
            system=system or "",
            tools=self._known_tools(tools or {}),
            params={k: v for k, v in (params or {}).items() if v is not None},
        )
        return await self.store.create_agent(agent)

    async def create_default(self, name: str) -> bool:
        """The default agent (`name` on `echo`), if the store has no agent at all."""
        agent = AgentRecord(id=new_id("agt"), name=validate_name(name), model=validate_model("echo", self.config))
        return await self.store.create_first_agent(agent)

    async def get(self, ref: str) -> AgentRecord:
        return await self.kernel.resolve_agent(ref)

    def _known_tools(self, tools: dict[str, str]) -> dict[str, str]:
        """Policies name the server's tools only (a client's tools run in the client): a typo such
        as `shel=ask` would otherwise be kept and govern nothing."""
        known = self.kernel.agent_loop.tools.names()
        unknown = sorted(set(tools) - set(known))
        if unknown:
            raise InvalidInput(
                f"no tool named {', '.join(repr(n) for n in unknown)}: the tools are {', '.join(known)}", param="tool"
            )
        return dict(tools)

    async def update(
        self,
        ref: str,
        *,
        name: str | None = None,
        model: str | None = None,
        system: str | None = None,
        tools: dict[str, str] | None = None,
        params: dict[str, Any] | None = None,
    ) -> AgentRecord:
        agent = await self.get(ref)
        if name is not None:
            agent.name = validate_name(name)
        if model is not None:
            agent.model = validate_model(model, self.config)
        if system is not None:
            agent.system = system
        if tools:
            agent.tools.update(self._known_tools(tools))
        for key, value in (params or {}).items():
            if value is None:
                agent.params.pop(key, None)
            else:
                agent.params[key] = value
        return await self.store.update_agent(agent)

    async def delete(self, ref: str) -> AgentRecord:
        agent = await self.get(ref)
        if not await self.store.delete_agent(agent.id):
            raise NotFound(f"unknown agent {shown(ref)}", code="agent_not_found")
        return agent
