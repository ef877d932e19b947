"""`X-Conversation-Id` names belong to the credential that sends them (session 20 fix).

A tester found header names global across credentials: with `serve --auth token`, token B sending
`X-Conversation-Id: project-x` first made the conversation `project-x` B's, and token A sending
the same header afterwards got 404 `conversation_not_found`. B could squat names A's app would
use, and 200 vs 404 told anyone which names other namespaces use. Now a credential without
`admin` that sends a name gets the conversation `NAME~<tag>` of its own namespace (`<tag>` a
digest of the agent and the namespace, as for its own default `conv_default~<tag>`): the two
credentials' `project-x` are two conversations, and neither learns of the other's. Admin and the
local owner keep bare names; a conversation made under a bare name before the fix is still found
by its owner under it; the id an answer echoes, sent back, is the same conversation.

Real `appserver serve --auth token` on loopback (SQLite), real httpx / websockets clients; one
PostgreSQL case (two servers on one database) when PostgreSQL is reachable.
"""

from __future__ import annotations

import asyncio
import json
import re
import sqlite3
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from appserver.auth import TokenStore
from appserver.store import ConversationRecord, SQLiteStore
from tests.support.cli import cli_env, run_cli
from tests.support.pg import require_postgres, temp_database
from tests.support.serve import ServeProcess, serving, start_serve
from tests.support.ws import WS

pytestmark = pytest.mark.timeout(90)

T = 10.0
QUALIFIED = re.compile(r"^(?P<name>.+)~[0-9a-f]{24}$")
LEGACY = "legacy-project"  # made under its bare name, owned by A, before names were qualified
LEGACY_OF_B = "legacy-of-b"  # the same, owned by B
LEGACY_WS = "legacy-ws"  # the same, owned by A, named only over WebSocket


@dataclass
class Srv:
    sp: ServeProcess
    home: Path
    a: str
    b: str
    admin: str

    @property
    def url(self) -> str:
        return self.sp.url


def _agent_id(home: Path, name: str) -> str:
    with sqlite3.connect(home / "appserver.db") as c:
        return str(c.execute("SELECT id FROM agents WHERE name = ?", (name,)).fetchone()[0])


async def _legacy(home: Path, agent_id: str, conv_id: str, namespace: str) -> None:
    store = SQLiteStore(home / "appserver.db")
    await store.open()
    try:
        await store.create_conversation(ConversationRecord(id=conv_id, agent_id=agent_id, namespace=namespace))
    finally:
        await store.close()


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Srv]:
    home = tmp_path_factory.mktemp("names") / "home"
    env = cli_env(home)
    assert run_cli(home, "agents", "create", "--name", "careful", env=env).code == 0
    tokens = TokenStore(home)
    rec_a, a = tokens.create(name="alice")  # default scopes openai,ws; every agent
    rec_b, b = tokens.create(name="bob")
    admin = tokens.create(name="ops", scopes="openai,ws,admin")[1]
    assistant = _agent_id(home, "assistant")
    # conversations an older server made under bare header names, in A's and B's namespaces
    asyncio.run(_legacy(home, assistant, LEGACY, f"{rec_a.principal().kind}:{rec_a.subject}"))
    asyncio.run(_legacy(home, assistant, LEGACY_OF_B, f"{rec_b.principal().kind}:{rec_b.subject}"))
    asyncio.run(_legacy(home, assistant, LEGACY_WS, f"{rec_a.principal().kind}:{rec_a.subject}"))
    with serving(home, "--auth", "token", env=env) as sp:
        yield Srv(sp, home, a, b, admin)


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def chat(
    url: str, token: str, conversation: str, text: str, model: str = "assistant", route: str = "chat"
) -> httpx.Response:
    headers = {**_bearer(token), "X-Conversation-Id": conversation}
    if route == "responses":
        body: dict[str, Any] = {"model": model, "input": text}
        return httpx.post(url + "/v1/responses", json=body, headers=headers, timeout=30)
    body = {"model": model, "messages": [{"role": "user", "content": text}]}
    return httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=30)


def conv_of(reply: httpx.Response) -> str:
    assert reply.status_code == 200, reply.text
    return reply.headers["X-Conversation-Id"]


def users(home: Path, conversation_id: str) -> list[str]:
    """The user messages of a conversation, as stored."""
    with sqlite3.connect(home / "appserver.db") as c:
        rows = c.execute(
            "SELECT content FROM messages WHERE conversation_id = ? AND role = 'user' ORDER BY id", (conversation_id,)
        ).fetchall()
    return [json.loads(r[0]) for r in rows]


def namespace_of(home: Path, conversation_id: str) -> list[tuple[Any, ...]]:
    with sqlite3.connect(home / "appserver.db") as c:
        return c.execute("SELECT namespace FROM conversations WHERE id = ?", (conversation_id,)).fetchall()


def not_found(reply: httpx.Response) -> None:
    assert reply.status_code == 404, reply.text
    assert reply.json()["error"]["code"] == "conversation_not_found", reply.text
    assert "X-Conversation-Id" not in reply.headers


def _name() -> str:
    return "project-" + uuid.uuid4().hex[:10]


# ---------------------------------------------------------------- the tester's report


def test_two_credentials_sending_the_same_name_get_two_conversations(srv: Srv) -> None:
    name = _name()
    b_conv = conv_of(chat(srv.url, srv.b, name, "bob first"))
    a_conv = conv_of(chat(srv.url, srv.a, name, "alice first"))  # was: 404 conversation_not_found
    assert a_conv != b_conv
    assert QUALIFIED.match(a_conv)["name"] == name  # type: ignore[index]
    assert QUALIFIED.match(b_conv)["name"] == name  # type: ignore[index]
    # each continues its own, by the name and by the id its answer echoed
    assert conv_of(chat(srv.url, srv.a, name, "alice second", route="responses")) == a_conv
    assert conv_of(chat(srv.url, srv.b, b_conv, "bob second")) == b_conv
    assert users(srv.home, a_conv) == ["alice first", "alice second"]
    assert users(srv.home, b_conv) == ["bob first", "bob second"]
    assert namespace_of(srv.home, a_conv) != namespace_of(srv.home, b_conv)
    assert users(srv.home, name) == []  # nothing under the bare name


def test_a_name_used_by_another_credential_answers_exactly_as_an_unused_one(srv: Srv) -> None:
    """No existence oracle: A's first use of a name B uses looks like its first use of any name."""
    used, unused = _name(), _name()
    conv_of(chat(srv.url, srv.b, used, "bob owns it"))
    r_used = chat(srv.url, srv.a, used, "probe")
    r_unused = chat(srv.url, srv.a, unused, "probe")
    assert r_used.status_code == r_unused.status_code == 200
    assert conv_of(r_used).removeprefix(used) == conv_of(r_unused).removeprefix(unused)  # the same tag
    assert users(srv.home, conv_of(r_used)) == ["probe"]


def test_the_echoed_id_sent_back_is_the_same_conversation_never_qualified_twice(srv: Srv) -> None:
    name = _name()
    first = conv_of(chat(srv.url, srv.a, name, "one"))
    again = conv_of(chat(srv.url, srv.a, first, "two"))
    assert again == first
    assert conv_of(chat(srv.url, srv.a, name, "three", route="responses")) == first
    assert users(srv.home, first) == ["one", "two", "three"]
    # and the echoed id works first, before the bare name was ever sent (it is the caller's own)
    other = _name()
    tagged = first.replace(name, other, 1)
    assert conv_of(chat(srv.url, srv.a, tagged, "by id first")) == tagged
    assert conv_of(chat(srv.url, srv.a, other, "by name after")) == tagged
    assert users(srv.home, tagged) == ["by id first", "by name after"]


def test_another_credentials_id_is_not_found_and_never_created(srv: Srv) -> None:
    name = _name()
    a_conv = conv_of(chat(srv.url, srv.a, name, "alice's"))
    not_found(chat(srv.url, srv.b, a_conv, "bob tries alice's id"))
    not_found(chat(srv.url, srv.b, a_conv, "bob tries again", route="responses"))
    assert users(srv.home, a_conv) == ["alice's"]
    # an id A will use (A's tag is derivable from what A was echoed) cannot be made ahead by B
    later = _name()
    squat = a_conv.replace(name, later, 1)
    not_found(chat(srv.url, srv.b, squat, "bob squats"))
    assert namespace_of(srv.home, squat) == []
    assert conv_of(chat(srv.url, srv.a, later, "alice later")) == squat
    assert users(srv.home, squat) == ["alice later"]
    # an id with a made-up tag is refused the same way, for everybody
    not_found(chat(srv.url, srv.b, f"{name}~{'0' * 24}", "made up"))
    not_found(chat(srv.url, srv.a, f"{name}~{'0' * 24}", "made up"))


def test_admin_keeps_bare_names_and_sees_namespaced_ids(srv: Srv) -> None:
    name = _name()
    assert conv_of(chat(srv.url, srv.admin, name, "admin's")) == name
    assert conv_of(chat(srv.url, srv.admin, name, "admin's again")) == name
    assert namespace_of(srv.home, name) == [(None,)]
    assert users(srv.home, name) == ["admin's", "admin's again"]
    # A's same name is A's own conversation, not the admin's unowned one
    a_conv = conv_of(chat(srv.url, srv.a, name, "alice's"))
    assert a_conv != name and users(srv.home, name) == ["admin's", "admin's again"]
    # admin sees every conversation: A's id reaches A's conversation
    assert conv_of(chat(srv.url, srv.admin, a_conv, "admin in alice's")) == a_conv
    assert users(srv.home, a_conv) == ["alice's", "admin in alice's"]
    # but makes no namespaced id ahead of its namespace
    later = a_conv.replace(name, _name(), 1)
    not_found(chat(srv.url, srv.admin, later, "admin squats"))
    assert namespace_of(srv.home, later) == []


def test_a_conversation_made_under_a_bare_name_before_is_still_found_by_its_owner(srv: Srv) -> None:
    assert conv_of(chat(srv.url, srv.a, LEGACY, "alice continues")) == LEGACY
    assert conv_of(chat(srv.url, srv.a, LEGACY, "and again", route="responses")) == LEGACY
    assert users(srv.home, LEGACY) == ["alice continues", "and again"]
    # B's same name is B's own (was: 404, which told B the name is taken)
    b_conv = conv_of(chat(srv.url, srv.b, LEGACY, "bob's"))
    assert QUALIFIED.match(b_conv)["name"] == LEGACY  # type: ignore[index]
    assert users(srv.home, LEGACY) == ["alice continues", "and again"]
    # B's own legacy conversation is B's; A's name for it is A's own
    assert conv_of(chat(srv.url, srv.b, LEGACY_OF_B, "bob continues")) == LEGACY_OF_B
    assert conv_of(chat(srv.url, srv.a, LEGACY_OF_B, "alice's")) != LEGACY_OF_B
    assert users(srv.home, LEGACY_OF_B) == ["bob continues"]


def test_a_name_is_the_namespaces_on_one_agent(srv: Srv) -> None:
    """The tag digests the namespace: a credential's name is one conversation, of the agent it was
    first used with; on another agent it is not found, as before (nothing of another credential)."""
    name = _name()
    one = conv_of(chat(srv.url, srv.a, name, "assistant's"))
    not_found(chat(srv.url, srv.a, name, "careful's", model="careful"))
    not_found(chat(srv.url, srv.a, one, "wrong agent", model="careful"))
    assert conv_of(chat(srv.url, srv.b, name, "bob on careful", model="careful")) != one


def test_an_id_the_server_made_is_that_conversation_or_not_found(srv: Srv) -> None:
    """`conv_…` ids (WebSocket `new`, a history match, a fork) are ids, not names: the caller's own
    is continued, another credential's is not found exactly as an unknown one, and a namespaced
    credential never creates one."""
    made = conv_of(chat(srv.url, srv.a, "new", "made by the server"))
    assert re.fullmatch(r"conv_[0-9a-f]{23}", made)
    assert conv_of(chat(srv.url, srv.a, made, "again")) == made
    assert users(srv.home, made) == ["made by the server", "again"]
    theirs, unknown = chat(srv.url, srv.b, made, "bob"), chat(srv.url, srv.b, "conv_" + "0" * 23, "bob")
    not_found(theirs)
    not_found(unknown)
    assert theirs.json()["error"]["message"].replace(made, "X") == unknown.json()["error"]["message"].replace(
        "conv_" + "0" * 23, "X"
    )
    not_found(chat(srv.url, srv.a, "conv_" + "1" * 23, "alice"))
    assert namespace_of(srv.home, "conv_" + "1" * 23) == []


def test_the_longest_name_and_its_id_fit(srv: Srv) -> None:
    name = "n" + uuid.uuid4().hex + "x" * (128 - 33)
    assert len(name) == 128
    conv = conv_of(chat(srv.url, srv.a, name, "long"))
    assert len(conv) == 128 + 1 + 24
    assert conv_of(chat(srv.url, srv.a, conv, "long again")) == conv
    assert users(srv.home, conv) == ["long", "long again"]
    for bad in (name + "y", name + "y" + conv[128:], f"{name}~{'0' * 23}", f"{conv}0", f"{conv}~{'0' * 24}", "a~b"):
        r = chat(srv.url, srv.a, bad, "too long or malformed")
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["code"] == "invalid_conversation_id"


def test_the_own_default_by_its_id(srv: Srv) -> None:
    """`default` echoes `conv_default~<tag>`; sent back, that is the same default (was: 400)."""
    default = conv_of(chat(srv.url, srv.b, "default", "b default"))
    assert default.startswith("conv_default~")
    assert conv_of(chat(srv.url, srv.b, default, "b default by id")) == default
    assert users(srv.home, default)[-2:] == ["b default", "b default by id"]
    not_found(chat(srv.url, srv.a, default, "not a's"))


def test_simultaneous_first_uses_by_two_credentials_land_in_one_conversation_each(srv: Srv) -> None:
    name = _name()
    n = 6

    async def go() -> list[tuple[str, httpx.Response]]:
        async with httpx.AsyncClient(timeout=30) as client:

            async def one(who: str, token: str, i: int) -> tuple[str, httpx.Response]:
                headers = {**_bearer(token), "X-Conversation-Id": name}
                if i % 2:
                    body: dict[str, Any] = {"model": "assistant", "input": f"{who} {i}"}
                    return who, await client.post(srv.url + "/v1/responses", json=body, headers=headers)
                body = {"model": "assistant", "messages": [{"role": "user", "content": f"{who} {i}"}]}
                return who, await client.post(srv.url + "/v1/chat/completions", json=body, headers=headers)

            jobs = [one("a", srv.a, i) for i in range(n)] + [one("b", srv.b, i) for i in range(n)]
            return list(await asyncio.gather(*jobs))

    replies = asyncio.run(go())
    bad = [(w, r.status_code, r.text[:200]) for w, r in replies if r.status_code != 200]
    assert not bad, bad
    a_convs = {conv_of(r) for w, r in replies if w == "a"}
    b_convs = {conv_of(r) for w, r in replies if w == "b"}
    assert len(a_convs) == len(b_convs) == 1 and a_convs != b_convs
    assert sorted(users(srv.home, a_convs.pop())) == sorted(f"a {i}" for i in range(n))
    assert sorted(users(srv.home, b_convs.pop())) == sorted(f"b {i}" for i in range(n))


# ---------------------------------------------------------------- WebSocket


def test_a_conversation_the_header_made_is_reachable_over_websocket_by_its_id(srv: Srv) -> None:
    name = _name()
    conv = conv_of(chat(srv.url, srv.a, name, "over http"))

    async def go() -> None:
        ws = await WS.open(srv.url, headers=_bearer(srv.a), open_timeout=T)
        other = await WS.open(srv.url, headers=_bearer(srv.b), open_timeout=T)
        try:
            frame = {"type": "submit_input", "agent": "assistant", "conversation": conv, "input": "over ws"}
            ack = await ws.request(frame, T)
            assert ack["type"] == "ack" and ack["conversation_id"] == conv, ack
            assert (await ws.terminal(ack["turn_id"], T))["status"] == "completed"
            history = await ws.request({"type": "get_history", "conversation": conv}, T)
            assert history["type"] == "history", history
            state = await ws.request({"type": "subscribe", "conversation": conv}, T)
            assert state["type"] == "conversation_state", state
            # B: as for an unknown id
            for refused in (
                await other.request({**frame, "input": "bob"}, T),
                await other.request({"type": "get_history", "conversation": conv}, T),
                await other.request({"type": "subscribe", "conversation": conv}, T),
            ):
                assert refused["type"] == "error" and refused["code"] == "conversation_not_found", refused
            listed = await other.request({"type": "list_conversations"}, T)
            assert conv not in {c["id"] for c in listed["conversations"]}
        finally:
            await ws.close()
            await other.close()

    asyncio.run(go())
    assert users(srv.home, conv) == ["over http", "over ws"]
    # and back over HTTP, by the name and by the id
    assert conv_of(chat(srv.url, srv.a, name, "http again")) == conv


def test_a_header_name_over_websocket_is_the_callers_own(srv: Srv) -> None:
    """Frames read a bare name as X-Conversation-Id does: the caller's own `NAME~<tag>` (or what it
    made under the bare name before); WebSocket never creates one, and another credential's is
    not found, as an unknown one."""
    name = _name()
    conv = conv_of(chat(srv.url, srv.a, name, "named over http"))

    async def go() -> None:
        ws = await WS.open(srv.url, headers=_bearer(srv.a), open_timeout=T)
        other = await WS.open(srv.url, headers=_bearer(srv.b), open_timeout=T)
        try:
            frame = {"type": "submit_input", "agent": "assistant", "conversation": name, "input": "named over ws"}
            ack = await ws.request(frame, T)
            assert ack["type"] == "ack" and ack["conversation_id"] == conv, ack
            assert (await ws.terminal(ack["turn_id"], T))["status"] == "completed"
            history = await ws.request({"type": "get_history", "conversation": name}, T)
            assert history["type"] == "history" and history["conversation_id"] == conv, history
            legacy = await ws.request({"type": "get_history", "conversation": LEGACY_WS}, T)
            assert legacy["type"] == "history" and legacy["conversation_id"] == LEGACY_WS, legacy
            unknown = _name()
            for sock, ref in ((other, name), (other, LEGACY_WS), (ws, unknown), (other, unknown)):
                refused = await sock.request({**frame, "conversation": ref, "input": "x"}, T)
                assert refused["type"] == "error" and refused["code"] == "conversation_not_found", refused
                refused = await sock.request({"type": "subscribe", "conversation": ref}, T)
                assert refused["type"] == "error" and refused["code"] == "conversation_not_found", refused
        finally:
            await ws.close()
            await other.close()

    asyncio.run(go())
    assert users(srv.home, conv) == ["named over http", "named over ws"]


# ---------------------------------------------------------------- PostgreSQL, two servers


def test_postgresql_two_servers_two_credentials_one_name(tmp_path: Path) -> None:
    require_postgres()
    with temp_database("names_s20") as url:
        env = cli_env(tmp_path / "admin", APPSERVER_STORE__URL=url, APPSERVER_AUTH__MODE="token")

        def token(name: str) -> str:
            made = run_cli(tmp_path / "admin", "token", "create", "--name", name, "--json", env=env)
            assert made.code == 0, made.err
            return str(json.loads(made.out)["token"])

        assert run_cli(tmp_path / "admin", "agents", "list", env=env).code == 0  # makes the schema
        a, b = token("app-a"), token("app-b")
        nodes: list[ServeProcess] = []
        try:
            for i in range(2):
                home = tmp_path / f"node{i}"
                nodes.append(
                    start_serve(home, env=cli_env(home, APPSERVER_STORE__URL=url, APPSERVER_AUTH__MODE="token"))
                )
            name = _name()
            n = 6

            async def go() -> list[tuple[str, httpx.Response]]:
                async with httpx.AsyncClient(timeout=30) as client:

                    async def one(who: str, tok: str, i: int) -> tuple[str, httpx.Response]:
                        headers = {**_bearer(tok), "X-Conversation-Id": name}
                        body = {"model": "assistant", "messages": [{"role": "user", "content": f"{who} {i}"}]}
                        node = nodes[i % 2].url
                        return who, await client.post(node + "/v1/chat/completions", json=body, headers=headers)

                    jobs = [one("a", a, i) for i in range(n)] + [one("b", b, i) for i in range(n)]
                    return list(await asyncio.gather(*jobs))

            replies = asyncio.run(go())
            bad = [(w, r.status_code, r.text[:200]) for w, r in replies if r.status_code != 200]
            assert not bad, bad
            a_convs = {conv_of(r) for w, r in replies if w == "a"}
            b_convs = {conv_of(r) for w, r in replies if w == "b"}
            assert len(a_convs) == len(b_convs) == 1 and a_convs != b_convs
            with psycopg.connect(url) as c:
                for conv in (*a_convs, *b_convs):
                    rows = c.execute("SELECT namespace FROM conversations WHERE id = %s", (conv,)).fetchall()
                    assert len(rows) == 1 and rows[0][0] is not None
                assert c.execute("SELECT count(*) FROM conversations WHERE id = %s", (name,)).fetchall() == [(0,)]
            # each echoed id, sent to the other server, continues it; the other credential's is not found
            (a_conv,) = a_convs
            assert conv_of(chat(nodes[1].url, a, a_conv, "a by id")) == a_conv
            not_found(chat(nodes[0].url, b, a_conv, "b tries"))
        finally:
            for sp in nodes:
                sp.stop()
            for sp in nodes:
                sp.kill()


def test_the_responses_conversation_field_reads_a_name_as_the_header_does(srv: Srv) -> None:
    """`conversation` in a Responses body names the caller's own conversation of that name, as
    `X-Conversation-Id` does; another credential's name or id stays not found."""
    name = _name()
    mine = conv_of(chat(srv.url, srv.a, name, "by the header"))
    for ref in (name, mine):
        reply = httpx.post(
            srv.url + "/v1/responses",
            json={"model": "assistant", "input": f"by the field as {ref}", "conversation": ref},
            headers=_bearer(srv.a),
            timeout=30,
        )
        assert conv_of(reply) == mine
    assert users(srv.home, mine) == ["by the header", f"by the field as {name}", f"by the field as {mine}"]
    for ref in (name, mine):  # bob: alice's name means his own (none yet), her id is hers
        reply = httpx.post(
            srv.url + "/v1/responses",
            json={"model": "assistant", "input": "probe", "conversation": ref},
            headers=_bearer(srv.b),
            timeout=30,
        )
        not_found(reply)


def test_default_in_any_case_and_names_with_spaces_read_alike_everywhere(srv: Srv) -> None:
    """`DEFAULT` over WebSocket is the default, as over HTTP; a Responses `conversation` name with
    spaces around it is read as the header reads it (stripped)."""
    name = _name()
    mine = conv_of(chat(srv.url, srv.a, name, "named"))
    reply = httpx.post(
        srv.url + "/v1/responses",
        json={"model": "assistant", "input": "spaced", "conversation": f"  {name} "},
        headers=_bearer(srv.a),
        timeout=30,
    )
    assert conv_of(reply) == mine
    default_http = conv_of(chat(srv.url, srv.a, "default", "to the default"))

    async def go() -> None:
        ws = await WS.open(srv.url, headers=_bearer(srv.a), open_timeout=T)
        try:
            for ref in ("DEFAULT", "Default", "default"):
                history = await ws.request({"type": "get_history", "conversation": ref, "agent": "assistant"}, T)
                assert history["type"] == "history" and history["conversation_id"] == default_http, history
        finally:
            await ws.close()

    asyncio.run(go())
