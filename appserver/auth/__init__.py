"""Who is calling: principals, capability tokens, JWT bearer verification, the Authenticator, and the
namespace rule that decides which conversations a caller may see.

One public face: front ends and the CLI import from `appserver.auth`, never from its modules.
"""

from appserver.auth.authenticator import HELLO_GRACE_S, HELLO_TIMEOUT_S, REVOCATION_POLL_S, Authenticator
from appserver.auth.errors import AuthError, TokensStale
from appserver.auth.jwt import JwtVerifier
from appserver.auth.namespaces import (
    conversation_namespace,
    is_gateway_namespace,
    namespace_allows,
    namespace_of,
    sees_all,
    speaks_for_chats,
)
from appserver.auth.principal import DEFAULT_TOKEN_SCOPES, SCOPES, Principal
from appserver.auth.stores import token_store_for
from appserver.auth.tokens import (
    GATEWAY_TOKEN_NAME,
    TOKEN_PREFIX,
    ReservedNameTaken,
    TokenRecord,
    TokenStore,
    check_token_name,
    fingerprint,
    is_reserved_name,
    parse_agents,
    parse_duration,
    parse_scopes,
)

__all__ = [
    "DEFAULT_TOKEN_SCOPES",
    "GATEWAY_TOKEN_NAME",
    "HELLO_GRACE_S",
    "HELLO_TIMEOUT_S",
    "REVOCATION_POLL_S",
    "SCOPES",
    "TOKEN_PREFIX",
    "AuthError",
    "Authenticator",
    "JwtVerifier",
    "Principal",
    "ReservedNameTaken",
    "TokenRecord",
    "TokenStore",
    "TokensStale",
    "check_token_name",
    "conversation_namespace",
    "fingerprint",
    "is_gateway_namespace",
    "is_reserved_name",
    "token_store_for",
    "namespace_allows",
    "namespace_of",
    "parse_agents",
    "parse_duration",
    "parse_scopes",
    "sees_all",
    "speaks_for_chats",
]
