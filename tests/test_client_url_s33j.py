"""Server URLs with a query: an `@` in a query or fragment value never shows what follows it in
an error line (it was taken for the end of a user part, and the rest of the value was printed),
and `/ws` goes on the path, before the query (it was appended to the query: a 403)."""

from __future__ import annotations

from pathlib import Path

import pytest

from appserver.client.auth import shown_url, ws_url
from tests.support.cli import run_cli

SECRET = "Zq9SECRETtail"


@pytest.mark.parametrize(
    "url",
    [
        f"http://127.0.0.1:9/ws?key=ab@{SECRET}",
        f"http://127.0.0.1:9/ws?key=ab\uff20{SECRET}&x=1",
        f"http://127.0.0.1:9/ws#tok=a@{SECRET}",
        f"http://alice:{SECRET}@127.0.0.1:9/ws?q=1@b",
    ],
)
def test_no_part_of_a_value_after_an_at_is_shown(url: str) -> None:
    assert SECRET not in shown_url(url)
    assert "SECRET" not in shown_url(url)


def test_a_url_whose_only_at_is_in_the_user_part_keeps_its_host_and_path_shown() -> None:
    assert shown_url("http://alice:pw@host:1/ws?t=1#a=2") == "http://alice:***@host:1/ws?t=***#a=***"


def test_ws_goes_on_the_path_before_a_query() -> None:
    assert ws_url("http://h:1/?x=1") == "ws://h:1/ws?x=1"
    assert ws_url("https://h/ws?x=1") == "wss://h/ws?x=1"
    assert ws_url("http://h/") == "ws://h/ws"


def test_the_cli_error_line_for_such_a_url_keeps_the_value_hidden(tmp_path: Path) -> None:
    result = run_cli(tmp_path / "home", "run", "--url", f"http://127.0.0.1:9/ws?key=ab@{SECRET}", "hi", timeout=30)
    assert result.code != 0
    assert "SECRET" not in result.err + result.out, result.err


@pytest.mark.parametrize(
    "url",
    [
        f"https://h.example/ws?token={SECRET}&next=mailto:me@x.com",
        f"https://{SECRET}@h.example:8443/ws?next=a@b",
        f"http://x/?token={SECRET}&u=a:b@c",
        f"http://x/#access_token={SECRET}&x=mailto:me@x",
    ],
)
def test_a_colon_and_a_later_at_never_show_the_query_or_a_token_before_them(url: str) -> None:
    assert "SECRET" not in shown_url(url), shown_url(url)
