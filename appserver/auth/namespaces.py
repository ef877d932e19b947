"""Namespaces: the one conversation-ownership rule of every front end (HTTP, WebSocket, cron)."""

from __future__ import annotations

from appserver.auth.principal import Principal
from appserver.auth.tokens import is_reserved_name


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


# The namespace of a capability token (`namespace_of`: kind `token`, subject `token:NAME`).
TOKEN_NAMESPACE = "token:token:"


def is_gateway_namespace(ns: str | None) -> bool:
    """The channel gateway's namespace: its token's reserved name (`TokenRecord.subject`), which no
    other token carries (an older token of such a name gets `gateway~<id>`, not reserved)."""
    return ns is not None and ns.startswith(TOKEN_NAMESPACE) and is_reserved_name(ns[len(TOKEN_NAMESPACE) :])


def speaks_for_chats(principal: Principal) -> bool:
    """Whether a turn this caller submits may say it came from a chat (`source` kind `channel`) or a
    scheduled run (`cron_prompt`): the gateway's credential, or the local owner (auth mode none,
    where the gateway connects as the owner does). What believes those kinds (the schedule tool's
    chat origin and delivery) must not take them from any other credential, `admin` included."""
    return principal.kind == "none" or is_gateway_namespace(namespace_of(principal))
