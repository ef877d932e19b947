"""A pin the gateway's credential may not use is refused, and a pin that became so is explained (session 30).

In auth mode `token` the gateway holds a token named `gateway` and, as any token, continues only
the conversations of its own namespace (docs/security.md, "Conversation namespaces"). `route add
KEY AGENT --conversation ID` checked the agent but not that: a conversation made by `appserver run`
(no owner) was taken, and every message of the chat then failed, the chat told the conversation
"no longer exists" and `channels status` that the server "does not find" it. Now `route add`
applies the server's rule for the gateway's namespace (refused, exit 2, nothing written), and for a
pin made before the mode became `token` `channels status` says why the server does not find it
(the server answers not found on purpose, so the gateway cannot tell). Real `appserver serve
--channels telegram` on the fake Bot API (tests/fakes/telegram_api.py), the CLI in processes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.db import default_path, open_db
from gateway.routing import RouteKey, Router
from tests.fakes.telegram_api import FakeTelegram
from tests.support.cli import cli_env, run_cli
from tests.support.gateway import ChannelServer, channel_server, write_config

pytestmark = pytest.mark.timeout(120)

UNPINNED_USER = 77  # its pin to an unowned conversation is refused; later pinned to the gateway's own
PINNED_EARLIER_USER = 78  # pinned in auth mode none, before the mode became token


def _route(home: Path, key: str) -> tuple[str | None, str | None]:
    """(the route's pin, the conversation the gateway bound) at `key`."""
    conn = open_db(default_path(home))
    try:
        router = Router(conn)
        route_key = RouteKey.typed(key)
        route = router.get(route_key)
        resolved = router.resolve(route_key, "assistant")
        return (route.conversation if route else None), (resolved.conversation if resolved else None)
    finally:
        conn.close()


@pytest.fixture(scope="module")
def tg() -> Iterator[FakeTelegram]:
    with FakeTelegram() as fake:
        yield fake


@pytest.fixture(scope="module")
def cli_conversation(tmp_path_factory: pytest.TempPathFactory, tg: FakeTelegram) -> tuple[Path, str]:
    """A home whose auth mode became `token` after `appserver run` made a conversation (no owner) and
    a chat was pinned to it in mode `none`, which takes it."""
    home = tmp_path_factory.mktemp("s30c") / "home"
    settings = {"api_url": tg.url, "poll_timeout": 1, "token_env": "TG_TOKEN", "dm_policy": "open"}
    write_config(home, {"telegram": {"main": {**settings, "default_agent": "assistant"}}}, ["telegram"])
    made = run_cli(home, "run", "--conversation", "new", "hello from the cli", "--json")
    assert made.code == 0, made.err
    conversation = str(made.json()["conversation_id"])
    early = f"telegram:main:{PINNED_EARLIER_USER}"
    pinned = run_cli(home, "channels", "route", "add", early, "assistant", "--conversation", conversation)
    assert pinned.code == 0, pinned.err  # the local owner's gateway sees every conversation
    with open(home / "config.toml", "a") as config:
        config.write('\n[auth]\nmode = "token"\n')
    return home, conversation


@pytest.fixture(scope="module")
def srv(cli_conversation: tuple[Path, str], tg: FakeTelegram) -> Iterator[ChannelServer]:
    home, _ = cli_conversation
    env = cli_env(home, TG_TOKEN=tg.token)
    with channel_server(home, "--channels", "telegram", env=env) as server:
        yield server


def test_route_add_refuses_a_conversation_outside_the_gateways_namespace(
    cli_conversation: tuple[Path, str], srv: ChannelServer, tg: FakeTelegram
) -> None:
    home, conversation = cli_conversation
    key = f"telegram:main:{UNPINNED_USER}"
    refused = run_cli(home, "channels", "route", "add", key, "assistant", "--conversation", conversation)
    assert refused.code == 2, (refused.code, refused.out, refused.err)
    assert f"conversation {conversation} has no owner" in refused.err, refused.err
    assert "the channel gateway may use only the conversations of its own credential" in refused.err, refused.err
    assert "nothing written" in refused.err and len(refused.err.strip().splitlines()) == 1, refused.err
    assert _route(home, key)[0] is None

    # another token's conversation (made through the server): its namespace, not the gateway's
    minted = run_cli(home, "token", "create", "--name", "alice", "--json")
    assert minted.code == 0, minted.err
    alices = run_cli(
        home,
        "run",
        "--conversation",
        "new",
        "hello from alice",
        "--json",
        env=cli_env(home, APPSERVER_TOKEN=str(minted.json()["token"])),
    )
    assert alices.code == 0, alices.err
    theirs = str(alices.json()["conversation_id"])
    refused = run_cli(home, "channels", "route", "add", key, "assistant", "--conversation", theirs)
    assert refused.code == 2, (refused.code, refused.out, refused.err)
    assert f"conversation {theirs} belongs to the credential namespace token:token:alice" in refused.err, refused.err
    assert _route(home, key)[0] is None

    # the chat is answered in a conversation the gateway opens (its namespace): that one is a pin it takes
    tg.dm("first hello", user_id=UNPINNED_USER)
    tg.wait_for_text(UNPINNED_USER, "echo: first hello", timeout=30)
    own = _route(home, key)[1]
    assert own is not None and own != conversation
    taken = run_cli(home, "channels", "route", "add", key, "assistant", "--conversation", own)
    assert taken.code == 0, taken.err
    assert _route(home, key) == (own, own)
    tg.dm("pinned hello", user_id=UNPINNED_USER)
    tg.wait_for_text(UNPINNED_USER, "echo: pinned hello", timeout=30)
    assert not [m.text for m in tg.messages(UNPINNED_USER) if "pinned by the operator" in m.text]


def test_status_says_why_a_pin_made_before_token_mode_is_not_found(
    cli_conversation: tuple[Path, str], srv: ChannelServer, tg: FakeTelegram
) -> None:
    home, conversation = cli_conversation
    tg.dm("hello?", user_id=PINNED_EARLIER_USER)
    # the chat learns nothing of namespaces (the server answers not found on purpose)
    tg.wait_for_text(
        PINNED_EARLIER_USER, lambda t: f"pinned by the operator to conversation {conversation}" in t, timeout=30
    )
    status = run_cli(home, "channels", "status", env=cli_env(home, TG_TOKEN=tg.token))
    assert status.code == 0, status.err
    hints = [line for line in status.out.splitlines() if line.startswith("hint: ")]
    assert len(hints) == 1, status.out
    assert f"telegram:main:{PINNED_EARLIER_USER}:__root__" in hints[0], hints
    assert f"conversation {conversation} has no owner" in hints[0], hints
    assert "fix it with `appserver channels route add`" in hints[0], hints

    as_json = run_cli(home, "channels", "status", "--json", env=cli_env(home, TG_TOKEN=tg.token))
    assert as_json.code == 0, as_json.err
    (account,) = [a for a in as_json.json()["accounts"] if a["account"] == "main"]
    assert f"conversation {conversation} has no owner" in account["last_failure"]["hint"], account
