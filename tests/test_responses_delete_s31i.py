"""Two DELETEs of one response: one deletes it, the other is told it is not there (session 31).

Found from outside on a PostgreSQL cluster: DELETEs of the same response at once all answered 200
`deleted: true` (each read the response, then deleted whatever was left; on one PostgreSQL server
all twelve of twelve did). One after the other, the second was already 404. Real `appserver serve`
on SQLite and on PostgreSQL, concurrent requests over loopback.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from tests.support.pg import require_postgres, temp_database
from tests.support.serve import serving


async def _delete_at_once(url: str, response_id: str, n: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        return list(await asyncio.gather(*(client.delete(f"/v1/responses/{response_id}") for _ in range(n))))


def _one_deletes(url: str) -> None:
    for round_ in range(5):
        made = httpx.post(url + "/v1/responses", json={"model": "assistant", "input": f"hi {round_}"}, timeout=30)
        assert made.status_code == 200, made.text
        rid = made.json()["id"]
        answers = asyncio.run(_delete_at_once(url, rid, 12))
        deleted = [r for r in answers if r.status_code == 200]
        assert len(deleted) == 1, [(r.status_code, r.text) for r in answers]
        assert deleted[0].json() == {"id": rid, "object": "response.deleted", "deleted": True}
        for r in answers:
            if r.status_code != 200:
                assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found", r.text
        assert httpx.get(f"{url}/v1/responses/{rid}", timeout=10).status_code == 404


def test_of_deletes_at_once_exactly_one_deletes(tmp_path: Path) -> None:
    with serving(tmp_path / "home") as sp:
        _one_deletes(sp.url)


def test_of_deletes_at_once_on_postgresql_exactly_one_deletes(tmp_path: Path) -> None:
    require_postgres()
    with temp_database("s31del") as url, serving(tmp_path / "home", "--store", url) as sp:
        _one_deletes(sp.url)
