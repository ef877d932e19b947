"""Listen addresses and Host values: parsing, loopback detection, the bind safety rule.

One parser for `--listen`, `server.listen` and `Host` headers, so the guard and `serve` agree on
what "loopback" and "the listen host" mean.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import re
import socket
import struct
from dataclasses import dataclass

from appserver.shown import shown

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8770

# RFC 1123 host names (letters, digits, hyphens; dot-separated labels); underscores are tolerated
# because some internal DNS uses them.
_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_HOSTNAME_RE = re.compile(rf"^{_LABEL}(?:\.{_LABEL})*\.?$")

WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})


@dataclass(frozen=True, slots=True)
class ListenAddress:
    """A parsed `HOST:PORT`; `host` is unbracketed (`::1`), lower-case."""

    host: str
    port: int

    @property
    def is_ipv6(self) -> bool:
        return ":" in self.host

    @property
    def url_host(self) -> str:
        """The host as it appears in a URL or a Host header (IPv6 bracketed)."""
        return f"[{self.host}]" if self.is_ipv6 else self.host

    @property
    def is_wildcard(self) -> bool:
        return self.host in WILDCARD_HOSTS

    @property
    def is_loopback(self) -> bool:
        return is_loopback(self.host)

    def url(self, scheme: str = "http") -> str:
        return f"{scheme}://{self.url_host}:{self.port}"

    def __str__(self) -> str:
        return f"{self.url_host}:{self.port}"


def _parse_port(text: str, original: str) -> int:
    """ASCII digits, at most five of them: int() would take `٥` and refuse 5000 digits in its own words."""
    if not text.isdigit() or not text.isascii() or len(text) > 5:
        raise ValueError(f"invalid port in listen address {shown(original)}: expected 0-65535")
    port = int(text)
    if not 0 <= port <= 65535:
        raise ValueError(f"invalid port in listen address {shown(original)}: expected 0-65535")
    return port


def _check_host(host: str, original: str) -> str:
    """Validate a bare host (IP literal or DNS name) and return it normalised."""
    host = host.lower()
    if ":" in host:
        try:
            return str(ipaddress.IPv6Address(host.split("%", 1)[0])) + (
                "%" + host.split("%", 1)[1] if "%" in host else ""
            )
        except ValueError:
            raise ValueError(f"invalid IPv6 address in {original!r}") from None
    try:
        return str(ipaddress.IPv4Address(host))
    except ValueError:
        pass
    if not host.isascii() or not _HOSTNAME_RE.match(host) or host.replace(".", "").isdigit():
        raise ValueError(f"invalid host name in {original!r}")
    return host.rstrip(".")


def parse_listen(value: str, default_port: int = DEFAULT_PORT) -> ListenAddress:
    """Parse `127.0.0.1:8770`, `[::1]:8770`, `localhost:8770`, `8770`, `:8770` or a bare host.

    Raises ValueError with the offending text so `serve` can print a one-line reason.
    """
    if not isinstance(value, str):
        raise ValueError(f"listen address must be a string, got {type(value).__name__}")
    text = value.strip()
    if not text:
        raise ValueError("empty listen address; expected HOST:PORT, e.g. 127.0.0.1:8770")
    if text.isascii() and text.isdigit():
        return ListenAddress(DEFAULT_HOST, _parse_port(text, value))
    if text.startswith(":") and text[1:].isascii() and text[1:].isdigit():
        return ListenAddress(DEFAULT_HOST, _parse_port(text[1:], value))
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise ValueError(f"unterminated '[' in listen address {value!r}; expected [::1]:8770")
        host, rest = text[1:end], text[end + 1 :]
        if ":" not in host:
            raise ValueError(f"brackets are only for IPv6 addresses in {value!r}")
        if rest == "":
            port = default_port
        elif rest.startswith(":"):
            port = _parse_port(rest[1:], value)
        else:
            raise ValueError(f"unexpected text after ']' in listen address {value!r}")
        return ListenAddress(_check_host(host, value), port)
    if text.count(":") > 1:
        # A bare IPv6 literal without port: accept it, a port would be ambiguous.
        try:
            return ListenAddress(str(ipaddress.IPv6Address(text)), default_port)
        except ValueError:
            raise ValueError(f"invalid listen address {value!r}; write IPv6 addresses as [::1]:8770") from None
    host, sep, port_text = text.partition(":")
    port = _parse_port(port_text, value) if sep else default_port
    if not host:
        raise ValueError(f"missing host in listen address {value!r}")
    return ListenAddress(_check_host(host, value), port)


def is_loopback(host: str) -> bool:
    """True for `localhost` (and `*.localhost`, RFC 6761), 127.0.0.0/8, ::1 and ::ffff:127.x."""
    h = host.strip().lower().rstrip(".")
    if h.startswith("[") and h.endswith("]"):
        h = h[1:-1]
    if h == "localhost" or h.endswith(".localhost"):
        return True
    try:
        addr = ipaddress.ip_address(h.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped.is_loopback
    return addr.is_loopback


def is_ip_literal(host: str) -> bool:
    h = host.strip("[]").split("%", 1)[0]
    try:
        ipaddress.ip_address(h)
    except ValueError:
        return False
    return True


def split_host_header(value: str) -> tuple[str, int | None]:
    """Split a Host header (`name`, `name:port`, `[v6]`, `[v6]:port`) → (lower-case host, port).

    Raises ValueError on anything a well-formed client would not send.
    """
    text = value.strip()
    if not text or not text.isascii() or any(c in text for c in " \t/\\@?#"):
        raise ValueError("malformed Host header")
    port: int | None = None
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise ValueError("malformed Host header")
        host, rest = text[1:end], text[end + 1 :]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError("malformed Host header") from None
        if rest:
            if not rest.startswith(":") or not (rest.isascii() and rest[1:].isdigit()) or len(rest) > 6:
                raise ValueError("malformed Host header")
            port = int(rest[1:])
    else:
        if text.count(":") > 1:
            raise ValueError("malformed Host header")
        host, sep, port_text = text.partition(":")
        if sep:
            if not (port_text.isascii() and port_text.isdigit()) or len(port_text) > 5:
                raise ValueError("malformed Host header")
            port = int(port_text)
        if not host or not _HOSTNAME_RE.match(host):
            raise ValueError("malformed Host header")
    if port is not None and port > 65535:
        raise ValueError("malformed Host header")
    return host.lower().rstrip("."), port


class BindRefused(ValueError):
    """`serve` must not start: a non-loopback address without authentication."""


def check_bind_allowed(listen: str | ListenAddress, auth_mode: str) -> None:
    """Refuse a non-loopback bind (including 0.0.0.0 / ::) unless auth is token or jwt.

    Pure so `serve` can call it before opening any socket; the message names the flags to use.
    """
    addr = listen if isinstance(listen, ListenAddress) else parse_listen(listen)
    if auth_mode not in ("none", "token", "jwt"):
        raise BindRefused(f"unknown auth mode {auth_mode!r}; expected none, token or jwt")
    if auth_mode != "none":
        return
    if addr.is_wildcard or not addr.is_loopback:
        raise BindRefused(
            f"refusing to listen on {addr} without authentication: anyone who can reach it could "
            "drive your agents. Either bind a loopback address (--listen 127.0.0.1:"
            f"{addr.port} or --listen [::1]:{addr.port}), or enable auth with --auth token "
            "(then create a token with `appserver token create`) or --auth jwt "
            "(with [auth] jwt_secret_file or jwt_public_key_file in config.toml)."
        )


def parse_trusted_proxies(entries: list[str]) -> list[str]:
    """`[server] trusted_proxies` → normalised IP addresses and CIDR networks (`10.0.0.0/8`).

    Only a peer in this list may set the client address (`X-Forwarded-For`) and scheme
    (`X-Forwarded-Proto`); from anyone else those headers are ignored, so a client cannot pose as
    another address to escape the per-client limit. `*` is refused: name the proxies (or, if every
    peer really is a proxy, say `0.0.0.0/0` and `::/0`). Raises ValueError naming the bad entry.
    """
    out: list[str] = []
    for entry in entries:
        text = str(entry).strip()
        if text == "*":
            raise ValueError("[server] trusted_proxies: '*' is not supported; list the proxies' addresses or networks")
        try:
            if "/" in text:
                out.append(str(ipaddress.ip_network(text, strict=False)))
            else:
                out.append(str(ipaddress.ip_address(text.strip("[]"))))
        except ValueError:
            raise ValueError(f"[server] trusted_proxies: {entry!r} is not an IP address or network (CIDR)") from None
    return out


# The headers through which a front end (reverse proxy, tunnel) names the client it passes a request
# on for. A request carrying any of them is not from the peer that sent it.
FORWARDING_HEADERS = frozenset({b"forwarded", b"x-forwarded-for", b"x-real-ip"})


def forwarded_host(text: str) -> str:
    """One hop of a forwarding header (`1.2.3.4`, `1.2.3.4:80`, `[::1]:80`, `::1`, RFC 7239's
    quoted `"[::1]:80"`) → the normalised IP address. Raises ValueError on anything else, RFC 7239's
    `unknown` and obfuscated `_names` included: an address nobody can read is nobody's."""
    h = text.strip().strip('"').strip()
    if h.startswith("["):
        h = h[1 : h.find("]")] if "]" in h else ""
    elif h.count(":") == 1:
        h = h.partition(":")[0]
    return str(ipaddress.ip_address(h.split("%", 1)[0]))


def forwarded_for_hops(value: str) -> list[str]:
    """The `for=` hops of an RFC 7239 `Forwarded` value, first hop first. Raises ValueError when an
    element names no `for=` or names one that is not an IP address."""
    hops: list[str] = []
    for element in value.split(","):
        fors = [pair.partition("=")[2] for pair in element.split(";") if pair.strip().lower().startswith("for=")]
        if len(fors) != 1:
            raise ValueError("a Forwarded element without exactly one for=")
        hops.append(forwarded_host(fors[0]))
    return hops


def forwarded_list_hops(value: str) -> list[str]:
    """The hops of an `X-Forwarded-For` or `X-Real-IP` value (comma-separated), first hop first."""
    return [forwarded_host(part) for part in value.split(",")]


class TrustedProxies:
    """`[server] trusted_proxies`, parsed once: is an address one of them, and which hop of a chain
    they passed on is the client (the last one not among them, as uvicorn reads X-Forwarded-For)."""

    def __init__(self, entries: list[str]) -> None:
        self.networks = [ipaddress.ip_network(entry, strict=False) for entry in parse_trusted_proxies(entries)]

    def __bool__(self) -> bool:
        return bool(self.networks)

    def __contains__(self, host: str) -> bool:
        try:
            addr = ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
        except ValueError:
            return False
        return any(addr in net for net in self.networks)

    def client_of(self, hops: list[str]) -> str:
        """The client a chain of hops names: the last hop that is not a trusted proxy (every one is:
        the first)."""
        for host in reversed(hops):
            if host not in self:
                return host
        return hops[0]


# sock_diag (netlink, Linux): the kernel finds one TCP socket by its four addresses, in microseconds.
# (/proc/net/tcp says the same, but reading it walks the whole connection table: ~10 ms here.)
_NETLINK_INET_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST = 1
_NLMSG_HEADER = struct.Struct("=IHHII")
_DIAG_REQUEST = struct.Struct("=BBBxI")  # family, protocol, ext, states
_DIAG_SOCKID = struct.Struct(">HH16s16s")  # sport, dport, src, dst (then if, cookie: native order)
_DIAG_TAIL = struct.Struct("=III")
_DIAG_STATE_AT = _NLMSG_HEADER.size + 1  # inet_diag_msg: family, state, timer, retrans, then the id
_DIAG_UID_AT = _NLMSG_HEADER.size + 4 + _DIAG_SOCKID.size + _DIAG_TAIL.size + 12  # after expires, queues
_DIAG_INODE_AT = _DIAG_UID_AT + 4
_NLMSG_ERROR = 2
# The states of a socket that is still one end of a connection (ESTABLISHED, SYN_SENT, FIN_WAIT1,
# FIN_WAIT2, CLOSE_WAIT, LAST_ACK, CLOSING): TIME_WAIT and CLOSE are ends closed, and a LISTEN
# socket is what the kernel finds instead once the socket asked about is gone (its lookup falls back
# to a listener on the same address and port, which may well be the owner's).
_CONNECTED_STATES = frozenset({1, 2, 4, 5, 8, 9, 11})
_NO_COOKIE = 0xFFFFFFFF
# `tcp_peer_uid`: the far end is no more. Its owner closed it (TIME_WAIT, where the kernel reports
# uid 0, root; or orphaned: no file holds it) or reset it (no such socket), possibly right after
# sending a whole request, which the server still reads: nobody's, never the owner's.
PEER_GONE = -1


def _diag_address(host: str) -> tuple[int, bytes] | None:
    """(family, 16 bytes) of an address as sock_diag takes it; None when it is not an IP address."""
    try:
        addr = ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped  # an IPv4 client of a dual-stack listener: its own socket is IPv4
    if isinstance(addr, ipaddress.IPv6Address):
        return socket.AF_INET6, addr.packed
    return socket.AF_INET, addr.packed.ljust(16, b"\0")


def tcp_peer_uid(peer: tuple[str, int], server: tuple[str, int]) -> int | None:
    """The Unix user owning the far end of a TCP connection whose both ends are on this machine,
    asked of the kernel (Linux sock_diag: the socket whose local end is `peer` and remote end
    `server`). `PEER_GONE` when the kernel finds no such connected socket (closed, reset, or only
    a listener on that port); None where the kernel cannot be asked (not Linux, netlink refused,
    not an IP address). The kernel answers "no such socket" also when it has no sock_diag for TCP
    at all: `kernel_tells_peers` tells the two apart."""
    src, dst = _diag_address(str(peer[0])), _diag_address(str(server[0]))
    if src is None or dst is None or src[0] != dst[0] or not hasattr(socket, "AF_NETLINK"):
        return None
    ports = (int(peer[1]), int(server[1]))
    uid = _diag_uid(src[0], ports, src[1], dst[1])
    if uid == PEER_GONE and src[0] == socket.AF_INET:
        # an IPv4 client on a dual-stack IPv6 socket (Java's, say) connected to a mapped address
        uid = _diag_uid(socket.AF_INET6, ports, _V4_MAPPED + src[1][:4], _V4_MAPPED + dst[1][:4])
    return uid


_V4_MAPPED = b"\0" * 10 + b"\xff\xff"


def _diag_uid(family: int, ports: tuple[int, int], src: bytes, dst: bytes) -> int | None:
    """One sock_diag question (`tcp_peer_uid`): the uid of the connected TCP socket of `family`
    whose local end is (src, ports[0]) and remote end (dst, ports[1])."""
    body = (
        _DIAG_REQUEST.pack(family, socket.IPPROTO_TCP, 0, 0xFFFFFFFF)
        + _DIAG_SOCKID.pack(ports[0], ports[1], src, dst)
        + _DIAG_TAIL.pack(0, _NO_COOKIE, _NO_COOKIE)
    )
    request = _NLMSG_HEADER.pack(_NLMSG_HEADER.size + len(body), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, 1, 0) + body
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_INET_DIAG) as nl:
            nl.settimeout(1.0)
            nl.send(request)
            reply = nl.recv(8192)
    except OSError:
        return None
    if len(reply) < _NLMSG_HEADER.size:
        return None
    kind = _NLMSG_HEADER.unpack_from(reply)[1]
    if kind == _NLMSG_ERROR and len(reply) >= _NLMSG_HEADER.size + 4:
        errno_ = -struct.unpack_from("=i", reply, _NLMSG_HEADER.size)[0]
        return PEER_GONE if errno_ == errno.ENOENT else None  # else: this kernel cannot tell
    if kind != _SOCK_DIAG_BY_FAMILY or len(reply) < _DIAG_INODE_AT + 4:
        return None
    state = reply[_DIAG_STATE_AT]
    found = _DIAG_SOCKID.unpack_from(reply, _DIAG_STATE_AT + 3)
    uid, inode = struct.unpack_from("=II", reply, _DIAG_UID_AT)
    if found != (ports[0], ports[1], src, dst) or state not in _CONNECTED_STATES or inode == 0:
        return PEER_GONE
    return int(uid)


def kernel_tells_peers() -> bool:
    """Whether this kernel answers `tcp_peer_uid` at all: asked about a connection of this process
    to itself, on loopback, it names this process's user. A kernel without sock_diag for TCP says
    "no such socket" for every connection, which `tcp_peer_uid` would read as a peer gone."""
    try:
        with socket.create_server(("127.0.0.1", 0)) as listener:
            server = listener.getsockname()
            with socket.create_connection(server, timeout=1.0) as client:
                accepted, _ = listener.accept()
                with accepted:
                    return tcp_peer_uid(client.getsockname(), server) == os.geteuid()
    except OSError:
        return False
