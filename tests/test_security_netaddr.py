"""Listen addresses, loopback detection, Host parsing and the bind rule (issue 4 check 1)."""

from __future__ import annotations

import pytest

from appserver.netaddr import (
    BindRefused,
    ListenAddress,
    check_bind_allowed,
    is_loopback,
    parse_listen,
    split_host_header,
)


@pytest.mark.parametrize(
    ("text", "host", "port"),
    [
        ("127.0.0.1:8770", "127.0.0.1", 8770),
        ("[::1]:9000", "::1", 9000),
        ("[::1]", "::1", 8770),
        ("::1", "::1", 8770),
        ("localhost:8770", "localhost", 8770),
        ("LocalHost:1", "localhost", 1),
        ("8771", "127.0.0.1", 8771),
        (":8772", "127.0.0.1", 8772),
        ("0.0.0.0:80", "0.0.0.0", 80),
        ("[::]:80", "::", 80),
        ("example.com", "example.com", 8770),
        (" 10.0.0.5:0 ", "10.0.0.5", 0),
    ],
)
def test_parse_listen(text: str, host: str, port: int) -> None:
    addr = parse_listen(text)
    assert (addr.host, addr.port) == (host, port)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   ",
        "127.0.0.1:",
        "127.0.0.1:99999",
        "127.0.0.1:-1",
        "127.0.0.1:http",
        "[::1",
        "[::1]x",
        "[127.0.0.1]:80",
        "[zz::1]:80",
        "bad host:80",
        "999.1.1.1:80",
        "a..b:80",
        "[::1]:8770:1",
        "ex ample",
    ],
)
def test_parse_listen_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_listen(text)


def test_listen_address_rendering() -> None:
    assert str(parse_listen("[::1]:8770")) == "[::1]:8770"
    assert parse_listen("[::1]:8770").url() == "http://[::1]:8770"
    assert parse_listen("127.0.0.1:8770").url("https") == "https://127.0.0.1:8770"
    assert parse_listen("0.0.0.0:1").is_wildcard and parse_listen("[::]:1").is_wildcard
    assert ListenAddress("127.0.0.1", 1).is_loopback


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("localhost", True),
        ("LOCALHOST.", True),
        ("app.localhost", True),
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("::1", True),
        ("[::1]", True),
        ("::ffff:127.0.0.1", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.1", False),
        ("localhost.evil.example", False),
        ("example.com", False),
        ("", False),
    ],
)
def test_is_loopback(host: str, expected: bool) -> None:
    assert is_loopback(host) is expected


def test_split_host_header() -> None:
    assert split_host_header("LocalHost:8770") == ("localhost", 8770)
    assert split_host_header("[::1]:8770") == ("::1", 8770)
    assert split_host_header("[::1]") == ("::1", None)
    assert split_host_header("example.com.") == ("example.com", None)
    for bad in (
        "",
        "a b",
        "x:y",
        "[::1",
        "[nope]:1",
        "host:99999",
        "a/b",
        "user@host",
        "::1",
        "é.com",
        "h:",
    ):
        with pytest.raises(ValueError):
            split_host_header(bad)


def test_check_bind_allowed() -> None:
    for ok in ("127.0.0.1:8770", "[::1]:8770", "localhost:8770", "8770"):
        check_bind_allowed(ok, "none")
    for mode in ("token", "jwt"):
        check_bind_allowed("0.0.0.0:8770", mode)
        check_bind_allowed("[::]:8770", mode)
        check_bind_allowed("192.168.1.10:8770", mode)
    for bad in ("0.0.0.0:8770", "[::]:8770", "192.168.1.10:8770", "myhost.lan:8770"):
        with pytest.raises(BindRefused) as info:
            check_bind_allowed(bad, "none")
        msg = str(info.value)
        assert "--listen 127.0.0.1:8770" in msg and "--auth token" in msg and "--auth jwt" in msg
    with pytest.raises(BindRefused):
        check_bind_allowed("127.0.0.1:8770", "bogus")
    with pytest.raises(ValueError):
        check_bind_allowed("nonsense:port", "token")
