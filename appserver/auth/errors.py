"""Why a credential was refused: one exception carrying the HTTP status and OpenAI error code."""

from __future__ import annotations


class AuthError(Exception):
    """Authentication or authorisation failed; `status` and `code` say how to answer."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


def unauthorized(code: str, message: str) -> AuthError:
    return AuthError(401, code, message)
