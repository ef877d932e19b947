"""Why a credential was refused: one exception carrying the HTTP status and OpenAI error code."""

from __future__ import annotations

from collections.abc import Awaitable, Callable


class AuthError(Exception):
    """Authentication or authorisation failed; `status` and `code` say how to answer."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


def unauthorized(code: str, message: str) -> AuthError:
    return AuthError(401, code, message)


class TokensStale(Exception):
    """The token store cannot answer from what it holds in memory (auth/pgtokens.py: a token it
    does not know, or its copy of the database's tokens is too old to trust). The caller awaits
    `wait()` (the database is read off the event loop; the wait is bounded, and raises AuthError
    503 `store_unavailable` when the database did not answer) and then asks again with
    `since=asked_at`, which the store answers from memory. Never raised by the file store."""

    def __init__(self, asked_at: float, wait: Callable[[float], Awaitable[None]]) -> None:
        super().__init__("the capability tokens must be read from the database first")
        self.asked_at = asked_at
        self._wait = wait

    async def wait(self) -> None:
        await self._wait(self.asked_at)


def store_unavailable(message: str) -> AuthError:
    return AuthError(503, "store_unavailable", message)
