"""An authenticated caller (`Principal`) and the scopes a credential can carry."""

from __future__ import annotations

import time
from dataclasses import field
from typing import Any

from appserver.ids import AGENT_ID_PREFIX
from appserver.values import value

SCOPES: tuple[str, ...] = ("openai", "ws", "admin")
DEFAULT_TOKEN_SCOPES: tuple[str, ...] = ("openai", "ws")


@value
class Principal:
    """An authenticated caller and what it may touch.

    `agents` None means every agent; otherwise a set of agent ids and/or names. `expires_at` is a
    Unix time (None: never); a live WebSocket is closed when it passes (for a JWT: when it plus
    the leeway passes, see `Authenticator.valid_until`).
    """

    subject: str
    kind: str  # none | token | jwt
    agents: frozenset[str] | None = None
    scopes: frozenset[str] = frozenset(SCOPES)
    expires_at: float | None = None
    token_id: str | None = None
    claims: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @classmethod
    def local(cls) -> Principal:
        """The principal of auth mode `none` (loopback only): every agent, every scope."""
        return cls(subject="local", kind="none")

    def allows_agent(self, agent_id: str, agent_name: str | None = None) -> bool:
        if self.agents is None:
            return True
        if agent_id in self.agents:
            return True
        # By name too, unless the name looks like an agent id (no longer allowed as a name, but a
        # store may hold one from before): a limit to an id admits that agent only.
        return agent_name is not None and agent_name in self.agents and not agent_name.startswith(AGENT_ID_PREFIX)

    def has_scope(self, scope: str) -> bool:
        return scope in self.scopes

    def is_expired(self, now: float | None = None) -> bool:
        return self.expires_at is not None and (now if now is not None else time.time()) >= self.expires_at
