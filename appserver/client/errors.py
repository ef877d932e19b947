"""The errors a protocol client raises: the server refused a frame, the connection could not be
opened, or the connection is gone."""

from __future__ import annotations


class ProtocolError(Exception):
    """An `error` frame from the server (or the client's own refusal), with its protocol code."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


class Closed(ProtocolError):
    """The connection is gone for good (or was lost before a reply that is unsafe to re-send)."""


class ConnectError(ProtocolError):
    """The connection could not be opened, and the network is not why (that is an `OSError`):

    * `invalid_url`: not a URL a client can connect to (scheme, host, port);
    * the server answered the WebSocket upgrade with an HTTP error (`status`): `code` is the one
      its JSON error body gives (`invalid_api_key`, `insufficient_scope`, `websocket_refused`, …),
      else `http_<status>`;
    * `handshake_failed`: what answered is not a WebSocket server (or not a protocol server);
      `connect_timeout`: no WebSocket connection in time; `welcome_timeout`: the connection was
      taken but hello got no welcome in time;
    * `proxy_failed`: the environment's proxy did not open the tunnel to the server (it answered the
      CONNECT with an HTTP error, fatal for a 407, or with no HTTP, or closed the connection).

    `fatal`: trying again cannot help (401/403: the credential or the URL is refused; a bad URL),
    so a reconnecting client gives up at once instead of retrying until its deadline."""

    def __init__(self, code: str, message: str, *, status: int | None = None, fatal: bool = False) -> None:
        super().__init__(code, message)
        self.status = status
        self.fatal = fatal
