"""Namespaces: the one conversation-ownership rule of every front end (HTTP, WebSocket, cron)."""

from __future__ import annotations

from appserver.auth.principal import Principal


def namespace_of(principal: Principal) -> str:
    """The caller's identity as stored with what it creates (conversations, idempotency scopes)."""
    return f"{principal.kind}:{principal.subject}"


def sees_all(principal: Principal) -> bool:
    """The local owner (auth mode none) and `admin` credentials see every conversation."""
    return principal.kind == "none" or principal.has_scope("admin")


def conversation_namespace(principal: Principal) -> str | None:
    """The namespace a caller's conversations are created in and looked up by; None means "sees
    every conversation", and what such a caller creates is unowned (namespace NULL), like the
    conversations of the CLI, of cron and an agent's shared default conversation."""
    return None if sees_all(principal) else namespace_of(principal)


def namespace_allows(caller: str | None, owner: str | None) -> bool:
    """THE rule, for HTTP, WebSocket and cron targets alike: a caller sees and uses a conversation
    only when it is in the caller's own namespace; `caller` None (admin, local) sees all, and an
    unowned conversation (`owner` None) is seen by nobody else. Refusals must look like "not
    found", so a credential learns nothing about conversations it may not use."""
    return caller is None or owner == caller
