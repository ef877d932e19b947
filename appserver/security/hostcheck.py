"""Host check (DNS rebinding): only requests aimed at an authority this server serves get in.

A Host that is well formed but not ours (not loopback, not the listen host, not in
`allowed_hosts`) gets **421 Misdirected Request**: RFC 9110 §15.5.20 defines it for a request
aimed at an authority this server does not serve, which is exactly what a DNS-rebinding page
produces; a client may legitimately retry elsewhere. A Host that is missing, duplicated or
malformed gets 400 because the request itself is broken. On a wildcard bind (0.0.0.0 / ::) IP
literals are accepted too: the server cannot know its addresses, and a rebinding attack always
arrives with the attacker's DNS name, never an IP literal.
"""

from __future__ import annotations

from collections.abc import Iterable

from appserver.config import ConfigError
from appserver.netaddr import ListenAddress, is_ip_literal, is_loopback, split_host_header
from appserver.security.asgi import CLOSE, Refusal
from appserver.security.headers import Headers, single
from appserver.security.memo import Memo


class HostCheck:
    def __init__(self, listen: ListenAddress, allowed_hosts: Iterable[str]) -> None:
        self.listen = listen
        self.allow_any_host = False
        self.allowed_hosts: set[tuple[str, int | None]] = set()
        for entry in allowed_hosts:
            if entry.strip() == "*":
                self.allow_any_host = True
                continue
            try:
                self.allowed_hosts.add(split_host_header(entry))
            except ValueError:
                raise ConfigError(f"[server] allowed_hosts: invalid entry {entry!r}") from None
        self._memo = Memo()

    def host_allowed(self, host: str, port: int | None) -> bool:
        if self.allow_any_host or is_loopback(host):
            return True
        if not self.listen.is_wildcard and host == self.listen.host:
            return True
        if (host, None) in self.allowed_hosts or (host, port) in self.allowed_hosts:
            return True
        return self.listen.is_wildcard and is_ip_literal(host)

    def check(self, hdrs: Headers) -> None:
        """Refuse (400 or 421) unless the request's single Host header names this server."""
        values = hdrs.get(b"host")
        if values and len(values) == 1 and self._memo.get(("host-ok", values[0])):
            return  # this exact Host value passed every check below before
        value = single(hdrs, b"host", "invalid_host")
        if value is None:
            raise Refusal(400, "invalid_host", "missing Host header", [CLOSE])
        try:
            host, port = split_host_header(value)
        except ValueError:
            raise Refusal(400, "invalid_host", "malformed Host header", [CLOSE]) from None
        if not self._memo.check(("host", host, port), lambda: self.host_allowed(host, port)):
            raise Refusal(
                421,
                "host_not_allowed",
                "this server does not serve that Host; add it to [server] allowed_hosts if intended",
                [CLOSE],
            )
        self._memo.check(("host-ok", hdrs[b"host"][0]), lambda: True)
