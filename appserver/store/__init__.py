"""Persistence: the Store interface, its records, and the SQLite implementation."""

from appserver.store.base import DuplicateTurn, Store, StoreError
from appserver.store.records import (
    AgentRecord,
    ConversationRecord,
    MessageRecord,
    PendingCall,
    TurnCommit,
    TurnRecord,
)
from appserver.store.sqlite import SQLiteStore

__all__ = [
    "AgentRecord",
    "ConversationRecord",
    "DuplicateTurn",
    "MessageRecord",
    "PendingCall",
    "SQLiteStore",
    "Store",
    "StoreError",
    "TurnCommit",
    "TurnRecord",
]
