"""What a conversation runtime needs from the world, handed in by the kernel (not the kernel
itself): the runtime never calls up, so runtime and kernel do not import each other."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from appserver.agent.loop import AgentLoop
from appserver.config import Config
from appserver.runtime.snapshot import TurnController, TurnSnapshot
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
    # A server of a cluster: asked when a turn's write failed (runtime/finish.py). True when this
    # server is cut off from its cluster (the others may have taken the conversation over): the
    # conversation's open turns here then follow the store, and the turn ends nothing here.
    cut_off: Callable[[TurnRecord, TurnController], bool] | None = None


class ClusterAccept(Protocol):
    async def __call__(
        self, turn: TurnRecord, idempotency_scope: str | None, open_limit: int, *, start_if_free: bool = False
    ) -> list[str]: ...
