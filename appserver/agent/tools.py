"""Server-side tools and the per-agent policy that gates them (allow | ask | deny)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from appserver.config import Config
from appserver.providers.base import ToolSpec
from appserver.store.records import AgentRecord


@dataclass(slots=True, frozen=True)
class ToolOutput:
    text: str
    is_error: bool = False


@dataclass(slots=True)
class ToolContext:
    agent: AgentRecord
    conversation_id: str
    turn_id: str
    config: Config
    services: dict[str, Any] = field(default_factory=dict)  # e.g. the cron store for `schedule`

    @property
    def workspace(self) -> Path:
        return self.config.workspace(self.agent.id)


ToolFn = Callable[[dict[str, Any], ToolContext], Awaitable[ToolOutput]]


@dataclass(slots=True, frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]
    run: ToolFn
    default_policy: str = "allow"
    enabled_by_default: bool = True  # False: offered only when the agent names it in its policies
    read_only: bool = True  # read-only tools run together; writers are serialised per resource key
    resource_key: Callable[[dict[str, Any], ToolContext], str] | None = None

    def spec(self) -> ToolSpec:
        return ToolSpec(self.name, self.description, self.parameters)


class ToolRegistry:
    """The server tools known to one Server. Built once; front ends never add to it."""

    def __init__(self, tools: list[Tool] | None = None) -> None:
        self._tools: dict[str, Tool] = {}
        for tool in tools or []:
            self.add(tool)

    def add(self, tool: Tool) -> None:
        self._tools[tool.name] = tool

    def get(self, name: str) -> Tool | None:
        return self._tools.get(name)

    def names(self) -> list[str]:
        return sorted(self._tools)

    def policy(self, agent: AgentRecord, name: str) -> str | None:
        """The effective policy of a server tool for an agent, or None when it is not offered."""
        tool = self._tools.get(name)
        if tool is None:
            return None
        configured = agent.tools.get(name)
        if configured is None:
            return tool.default_policy if tool.enabled_by_default else None
        return configured

    def offered(self, agent: AgentRecord) -> list[Tool]:
        return [t for n, t in sorted(self._tools.items()) if self.policy(agent, n) in ("allow", "ask")]


# ---------------------------------------------------------------- built-in tools


async def _clock(args: dict[str, Any], ctx: ToolContext) -> ToolOutput:
    tz_name = args.get("timezone") or "UTC"
    try:
        tz = ZoneInfo(str(tz_name))
    except (ZoneInfoNotFoundError, ValueError):
        return ToolOutput(f"unknown timezone {tz_name!r}; use an IANA name such as Europe/Paris", is_error=True)
    return ToolOutput(datetime.now(tz).isoformat(timespec="seconds") + f" ({tz_name})")


async def _shell(args: dict[str, Any], ctx: ToolContext) -> ToolOutput:
    command = args.get("command")
    if not isinstance(command, str) or not command.strip():
        return ToolOutput("shell needs a non-empty string argument 'command'", is_error=True)
    limits = ctx.config.limits
    timeout = min(float(args.get("timeout_s") or limits.shell_timeout_s), limits.shell_timeout_s)
    workspace = ctx.workspace
    workspace.mkdir(parents=True, exist_ok=True, mode=0o700)
    proc = await asyncio.create_subprocess_shell(
        command,
        cwd=workspace,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        stdin=asyncio.subprocess.DEVNULL,
        start_new_session=True,
    )
    cap = limits.shell_output_max_bytes
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except (TimeoutError, asyncio.CancelledError) as exc:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        await proc.wait()
        if isinstance(exc, asyncio.CancelledError):
            raise
        return ToolOutput(f"command timed out after {timeout:g} s and was killed", is_error=True)
    text = out[:cap].decode("utf-8", "replace")
    if len(out) > cap:
        text += f"\n[output truncated: {len(out)} bytes, showing the first {cap}]"
    if proc.returncode:
        return ToolOutput(f"exit code {proc.returncode}\n{text}", is_error=True)
    return ToolOutput(text)


CLOCK = Tool(
    name="clock",
    description="Current date and time in a timezone (IANA name, default UTC).",
    parameters={"type": "object", "properties": {"timezone": {"type": "string"}}, "additionalProperties": False},
    run=_clock,
)

SHELL = Tool(
    name="shell",
    description="Run a shell command in the agent's workspace directory; returns its combined output.",
    parameters={
        "type": "object",
        "properties": {"command": {"type": "string"}, "timeout_s": {"type": "number"}},
        "required": ["command"],
    },
    run=_shell,
    default_policy="ask",
    enabled_by_default=False,
    read_only=False,
    resource_key=lambda args, ctx: f"workspace:{ctx.agent.id}",
)


def builtin_tools() -> list[Tool]:
    return [CLOCK, SHELL]


def parse_arguments(arguments: str) -> dict[str, Any]:
    """Parse tool-call arguments; raise ValueError with a model-readable message."""
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError as exc:
        raise ValueError(f"arguments are not valid JSON ({exc.msg} at position {exc.pos})") from None
    if not isinstance(value, dict):
        raise ValueError("arguments must be a JSON object")
    return value
