"""Session 29, helper T: another credential's stored response is refused before its body is read.

A tester found GET/DELETE /v1/responses/{id}, its /input_items and `previous_response_id` answer
another credential's response with the same 404 as an unknown id, but only after loading the
whole record (body and input items) and then checking whose it is: the 404 took longer the
larger the response (24 ms for one of 4 MB, 1 ms for an unknown id), telling that it exists and
roughly how large it is. Whose a response is is now read first without its body
(`Store.get_response_owner`), and the body only for a caller it is for.

Tests never assert timings (project rule). What is observable instead: a response whose stored
body is damaged makes the store say so in the server's log ("... is damaged (column 'body' of
responses row ...)") the moment its body is read. Alice asking for Bob's damaged response by every
route leaves the log without it, so the body was not read; Bob reading it himself logs it (the
probe works). Before the fix Alice's first 404 read it. The store read itself is checked on SQLite and PostgreSQL.

Real `appserver serve --auth token` on loopback (SQLite), real httpx clients.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import httpx
import pytest

from appserver.auth import TokenStore
from appserver.store import SQLiteStore
from appserver.store.base import Store
from appserver.store.postgres import PostgresStore
from appserver.store.records import ResponseRecord
from tests.support.cli import cli_env, run_cli
from tests.support.pg import temp_database
from tests.support.serve import DrainedStream, ServeProcess, serving

pytestmark = pytest.mark.timeout(90)

T = 15.0


@dataclass
class Srv:
    sp: ServeProcess
    home: Path
    alice: str
    bob: str

    def call(self, who: str, method: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
        return httpx.request(
            method, self.sp.url + path, json=body, headers={"Authorization": f"Bearer {who}"}, timeout=T
        )

    def body_read(self) -> bool:
        """The store said the damaged response's body is damaged: something read it."""
        log = self.sp.proc.stderr
        assert isinstance(log, DrainedStream)
        return log.seen("of responses row")


@pytest.fixture
def srv(tmp_path: Path) -> Iterator[Srv]:
    home = tmp_path / "home"
    env = cli_env(home)
    assert run_cli(home, "agents", "create", "--name", "careful", env=env).code == 0
    tokens = TokenStore(home)
    alice = tokens.create(name="alice")[1]
    bob = tokens.create(name="bob")[1]
    with serving(home, "--auth", "token", env=env) as sp:
        yield Srv(sp, home, alice, bob)


def _damage_body(home: Path, response_id: str) -> None:
    """Make the stored body and input items of `response_id` no JSON: reading them is damage."""
    with sqlite3.connect(home / "appserver.db") as db:
        changed = db.execute(
            "UPDATE responses SET body = '{damaged', input_items = '[damaged' WHERE id = ?", (response_id,)
        ).rowcount
    assert changed == 1


def _bobs_response(srv: Srv) -> tuple[str, str]:
    """A response of Bob's and the id of its output message (an `item_reference` names it)."""
    made = srv.call(srv.bob, "POST", "/v1/responses", {"model": "assistant", "input": "bob's secret " * 2000})
    assert made.status_code == 200, made.text
    body = made.json()
    return body["id"], body["output"][0]["id"]


def _routes(rid: str, item: str) -> list[tuple[str, str, dict[str, Any] | None]]:
    """Every way to name a stored response: by path, as the previous response, by an item of it."""
    return [
        ("GET", f"/v1/responses/{rid}", None),
        ("GET", f"/v1/responses/{rid}/input_items", None),
        ("POST", f"/v1/responses/{rid}/cancel", None),
        ("DELETE", f"/v1/responses/{rid}", None),
        ("POST", "/v1/responses", {"model": "assistant", "input": "hi", "previous_response_id": rid}),
        (
            "POST",
            "/v1/responses",
            {"model": "assistant", "input": [{"type": "item_reference", "id": item}, "hi"]},
        ),
        (
            "POST",
            "/v1/responses",
            {
                "model": "assistant",
                "input": [{"type": "item_reference", "id": item}, "hi"],
                "previous_response_id": rid,
            },
        ),
    ]


def test_another_credentials_response_is_refused_without_reading_its_body(srv: Srv) -> None:
    rid, item = _bobs_response(srv)
    _damage_body(srv.home, rid)
    for method, path, body in _routes(rid, item):
        got = srv.call(srv.alice, method, path, body)
        assert got.status_code in (400, 404), (method, path, got.status_code, got.text)
        assert srv.call(srv.alice, "GET", "/v1/models").status_code == 200  # its log lines are out
        assert not srv.body_read(), f"{method} {path} by another credential read the response's body"
    time.sleep(0.5)  # a line the server wrote is read off its pipe by then (it is no timing asserted)
    assert not srv.body_read(), "a request by another credential read the response's body"
    # the probe works: Bob's own read of it finds the damage, logged before his answer
    srv.call(srv.bob, "GET", f"/v1/responses/{rid}")
    deadline = time.monotonic() + T
    while not srv.body_read() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert srv.body_read()


def test_another_credentials_response_and_an_unknown_id_answer_alike(srv: Srv) -> None:
    rid, item = _bobs_response(srv)
    fake = "resp_" + uuid.uuid4().hex
    fake_item = "msg_" + fake.removeprefix("resp_") + item[4 + 32 :]
    for (method, path, body), (_, fake_path, fake_body) in zip(
        _routes(rid, item), _routes(fake, fake_item), strict=True
    ):
        theirs = srv.call(srv.alice, method, path, body)
        unknown = srv.call(srv.alice, method, fake_path, fake_body)
        assert theirs.status_code == unknown.status_code, (method, path, theirs.text, unknown.text)
        assert theirs.text.replace(rid, "ID").replace(item, "ITEM") == unknown.text.replace(fake, "ID").replace(
            fake_item, "ITEM"
        ), (method, path)
    assert srv.call(srv.bob, "GET", f"/v1/responses/{rid}").status_code == 200  # Bob's still, and whole


async def _owner_read(store: Store) -> None:
    await store.open()
    try:
        first = ResponseRecord(
            id="resp_" + uuid.uuid4().hex,
            agent_id="agt_x",
            conversation_id="conv_x",
            body={"output": ["x" * 100_000]},
            input_items=[{"type": "message", "content": "y" * 100_000}],
        )
        second = ResponseRecord(
            id="resp_" + uuid.uuid4().hex,
            agent_id="agt_x",
            conversation_id="conv_x",
            body={},
            previous_response_id=first.id,
            stored=False,
        )
        await store.save_response(first)
        await store.save_response(second)
        owner = await store.get_response_owner(second.id)
        assert owner is not None
        assert (owner.id, owner.agent_id, owner.conversation_id, owner.previous_response_id) == (
            second.id,
            "agt_x",
            "conv_x",
            first.id,
        )
        assert {f.name for f in fields(owner)} == {"id", "agent_id", "conversation_id", "previous_response_id"}
        first_owner = await store.get_response_owner(first.id)
        assert first_owner is not None and first_owner.previous_response_id is None
        assert await store.get_response_owner("resp_" + uuid.uuid4().hex) is None
    finally:
        await store.close()


def test_response_owner_is_read_without_the_body_sqlite(tmp_path: Path) -> None:
    asyncio.run(_owner_read(SQLiteStore(tmp_path / "appserver.db")))


def test_response_owner_is_read_without_the_body_postgres() -> None:
    with temp_database("s29t") as url:
        asyncio.run(_owner_read(PostgresStore(url)))


def test_an_item_of_an_id_alone_is_an_item_reference(tmp_path_factory: pytest.TempPathFactory) -> None:
    """OpenAI's ItemReferenceParam has an optional `type`: `{"id": …}` alone is a reference (found by
    schemathesis: it was refused as a message without `role`). One with more keys stays a message."""
    home = tmp_path_factory.mktemp("s29t_ref") / "home"
    home.mkdir()
    with serving(home, env=cli_env(home)) as sp, httpx.Client(base_url=sp.url, timeout=30) as http:
        first = http.post("/v1/responses", json={"model": "assistant", "input": "hello"})
        assert first.status_code == 200, first.text
        item = next(o["id"] for o in first.json()["output"] if o["type"] == "message")
        for ref in ({"id": item}, {"id": item, "type": None}):
            r = http.post(
                "/v1/responses", json={"model": "assistant", "input": [ref, {"role": "user", "content": "again"}]}
            )
            assert r.status_code == 200, r.text
        unknown = http.post(
            "/v1/responses", json={"model": "assistant", "input": [{"id": ""}, {"role": "user", "content": "again"}]}
        )
        assert unknown.status_code == 400 and unknown.json()["error"]["code"] == "item_not_found", unknown.text
        message = http.post("/v1/responses", json={"model": "assistant", "input": [{"id": "m", "content": "x"}]})
        assert message.status_code == 400, message.text
        assert message.json()["error"]["param"] == "input[0].role", message.text
