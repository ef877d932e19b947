"""What a conversation runtime needs from the world, handed in by the kernel (not the kernel
itself): the runtime never calls up, so runtime and kernel do not import each other."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from appserver.agent.loop import AgentLoop
from appserver.config import Config
from appserver.runtime.snapshot import TurnSnapshot
from appserver.store.base import Store
from appserver.store.records import TurnRecord


@dataclass(slots=True, frozen=True)
class RuntimeDeps:
    store: Store
    config: Config
    agent_loop: AgentLoop
    owner: str  # this process's identity, recorded on the turns it runs
    settled: Callable[[TurnRecord, TurnSnapshot], None]  # told once per turn (segment) settled
    # A server of a cluster: accepts go through `PostgresStore.accept_in_cluster` (the queue bound
    # counted in the database, acceptance order across servers); None on a server of its own.
    cluster_accept: ClusterAccept | None = None


class ClusterAccept(Protocol):
    async def __call__(
        self, turn: TurnRecord, idempotency_scope: str | None, open_limit: int, *, start_if_free: bool = False
    ) -> list[str]: ...
