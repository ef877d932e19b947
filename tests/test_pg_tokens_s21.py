"""Capability tokens on a PostgreSQL store under a database that goes away or stalls.

Found by an outside test of `appserver serve --store postgresql://… --auth token`:

* After any loss of the database session (a restart, a failover, `pg_terminate_backend`) the first
  request with a token on each server, once the token cache was a second old, got HTTP 500
  `internal_error` (so did WebSocket upgrades; under a storm of terminations, unknown tokens got 500
  instead of 401): the token check ran its query on the ended connection and did not retry it.
* The token check read the database on the server's event loop: while that read was slow (a lock, a
  database away: up to the 5 s connect timeout per try) every request of the server stalled,
  `/healthz` and requests with a token it knew included, and one request with an unknown token was
  enough to start such a read.

Real servers, real sockets, a real PostgreSQL (its own database, dropped at the end).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.cli import cli_env, run_cli
from tests.support.pg import temp_database
from tests.support.serve import ServeProcess, serving
from tests.support.ws import ws_url

psycopg = pytest.importorskip("psycopg")
websockets = pytest.importorskip("websockets")

LOCK_S = 10.0  # how long the token table stays locked: a stalled server answers nothing meanwhile
SERVED_S = 6.0  # "answered while the lock is held": well below LOCK_S, far above any real latency


def _env(home: Path, url: str) -> dict[str, str]:
    return cli_env(home, APPSERVER_STORE__URL=url, APPSERVER_AUTH__MODE="token")


def _token(tmp_path: Path, url: str, name: str) -> str:
    admin = tmp_path / "admin"
    made = run_cli(admin, "token", "create", "--name", name, "--json", env=_env(admin, url))
    assert made.code == 0, made.err
    return str(json.loads(made.out)["token"])


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _terminate_sessions(url: str) -> int:
    """End every session of the test's database but this one (what a restart or failover does)."""
    with psycopg.connect(url, autocommit=True) as c:
        row = c.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        ).fetchone()
    return int(row[0]) if row else 0


def _error_code(r: httpx.Response) -> str:
    try:
        return str(r.json().get("error", {}).get("code"))
    except ValueError:
        return r.text[:100]


async def _hello(sp: ServeProcess, headers: dict[str, str] | None, token: str | None = None) -> dict[str, Any]:
    """The answer to a hello; an error frame gets the close code that follows it as `close_code`."""
    async with websockets.connect(ws_url(sp.url), additional_headers=headers, open_timeout=20) as ws:
        frame: dict[str, Any] = {"type": "hello", "protocol": 1, "request_id": "h"}
        if token is not None:
            frame["token"] = token
        await ws.send(json.dumps(frame))
        answer = dict(json.loads(await asyncio.wait_for(ws.recv(), 20)))
        if answer.get("type") == "error":
            try:
                await asyncio.wait_for(ws.recv(), 20)
            except websockets.ConnectionClosed:
                pass
            answer["close_code"] = ws.close_code
        return answer


@pytest.fixture
def pg_url() -> Any:
    with temp_database("tok_s21") as url:
        yield url


def test_a_lost_database_session_never_fails_a_token_request(tmp_path: Path, pg_url: str) -> None:
    """Every session of the database is ended; a second later (the token cache is stale), a known
    token is accepted, an unknown one is refused with 401, on HTTP and on a WebSocket upgrade or
    hello: never a 500."""
    home = tmp_path / "h"
    with serving(home, env=_env(home, pg_url)) as sp:
        token = _token(tmp_path, pg_url, "survivor")
        assert httpx.get(sp.url + "/v1/models", headers=_bearer(token), timeout=20).status_code == 200
        # twice: on the pool's first connections, then on those it made again after the first
        # round's ends (a third round met connections made the same way as the second's)
        for _ in range(2):
            assert _terminate_sessions(pg_url) >= 1
            time.sleep(1.3)  # past the token cache's second
            r = httpx.get(sp.url + "/v1/models", headers=_bearer(token), timeout=20)
            assert r.status_code == 200, (r.status_code, r.text)
            _terminate_sessions(pg_url)
            time.sleep(0.3)
            r = httpx.get(sp.url + "/v1/models", headers=_bearer("aps_unknown" + "x" * 20), timeout=20)
            assert r.status_code == 401, (r.status_code, r.text)
            _terminate_sessions(pg_url)
            time.sleep(1.3)
            assert asyncio.run(_hello(sp, _bearer(token)))["type"] == "welcome"
            _terminate_sessions(pg_url)
            time.sleep(1.3)
            assert asyncio.run(_hello(sp, None, token))["type"] == "welcome"


def test_a_token_minted_elsewhere_works_at_once_and_a_revoke_lands_within_a_second(tmp_path: Path, pg_url: str) -> None:
    """A token the server has never seen (minted by the CLI a moment ago) is accepted by its very
    first request (it was a 401 when the server had looked at the database less than 0.2 s before);
    a revoke closes a live socket of the token and refuses it within about a second."""
    home = tmp_path / "h"
    with serving(home, env=_env(home, pg_url)) as sp:
        first = _token(tmp_path, pg_url, "first")
        assert httpx.get(sp.url + "/v1/models", headers=_bearer(first), timeout=20).status_code == 200
        for i in range(3):
            fresh = _token(tmp_path, pg_url, f"fresh{i}")
            r = httpx.get(sp.url + "/v1/models", headers=_bearer(fresh), timeout=20)
            assert r.status_code == 200, (r.status_code, r.text)
            assert asyncio.run(_hello(sp, None, fresh))["type"] == "welcome"
        admin = tmp_path / "admin"

        async def revoke_under_a_live_socket() -> tuple[int | None, float]:
            async with websockets.connect(ws_url(sp.url), additional_headers=_bearer(first)) as ws:
                await ws.send(json.dumps({"type": "hello", "protocol": 1, "request_id": "h"}))
                assert json.loads(await asyncio.wait_for(ws.recv(), 20))["type"] == "welcome"
                gone = await asyncio.to_thread(run_cli, admin, "token", "revoke", "first", env=_env(admin, pg_url))
                assert gone.code == 0, gone.err
                revoked_at = time.monotonic()
                with pytest.raises(websockets.ConnectionClosed):
                    while True:
                        await asyncio.wait_for(ws.recv(), 10)
                return ws.close_code, time.monotonic() - revoked_at

        code, took = asyncio.run(revoke_under_a_live_socket())
        assert code == 4401 and took < 2.5, (code, took)
        r = httpx.get(sp.url + "/v1/models", headers=_bearer(first), timeout=20)
        assert r.status_code == 401 and _error_code(r) == "invalid_api_key", r.text


def test_a_slow_token_read_never_stalls_the_server(tmp_path: Path, pg_url: str) -> None:
    """The token table is locked (a stand-in for a database that is slow or away) for LOCK_S while
    a request with an unknown token makes the server read it: /healthz and a request with a token
    the server knows are answered meanwhile, and the unknown token gets 503 `store_unavailable`
    with Retry-After within a bounded wait, not at the lock's end (before: all of them stalled for
    the whole lock). Once the lock is gone, the unknown token is a plain 401 again."""
    home = tmp_path / "h"
    with serving(home, env=_env(home, pg_url)) as sp:
        token = _token(tmp_path, pg_url, "known")
        assert httpx.get(sp.url + "/v1/models", headers=_bearer(token), timeout=20).status_code == 200
        results: dict[str, tuple[float, httpx.Response | BaseException]] = {}
        t0 = 0.0

        def timed(name: str, method: str, path: str, headers: dict[str, str], **kw: Any) -> threading.Thread:
            def run() -> None:
                try:
                    r: httpx.Response | BaseException = httpx.request(
                        method, sp.url + path, headers=headers, timeout=LOCK_S * 3, **kw
                    )
                except Exception as exc:
                    r = exc
                results[name] = (time.monotonic() - t0, r)

            th = threading.Thread(target=run, daemon=True)
            th.start()
            return th

        with psycopg.connect(pg_url) as locker:
            locker.execute("LOCK TABLE token_state IN ACCESS EXCLUSIVE MODE")
            t0 = time.monotonic()
            threads = [timed("unknown", "GET", "/v1/models", _bearer("aps_unknown_" + "y" * 30))]
            time.sleep(0.3)  # the unknown token's read has started and waits on the lock
            threads.append(timed("healthz", "GET", "/healthz", {}))
            threads.append(timed("known", "GET", "/v1/models", _bearer(token)))
            body = {"model": "assistant", "messages": [{"role": "user", "content": "hi"}]}
            threads.append(timed("chat", "POST", "/v1/chat/completions", _bearer(token), json=body))
            unknown_hello: list[dict[str, Any]] = []
            ws_thread = threading.Thread(
                target=lambda: unknown_hello.append(asyncio.run(_hello(sp, None, "aps_unknown_" + "z" * 30))),
                daemon=True,
            )
            ws_thread.start()
            for th in threads:
                th.join(SERVED_S - (time.monotonic() - t0))
            ws_thread.join(max(0.1, SERVED_S - (time.monotonic() - t0)))
            held = time.monotonic() - t0
            answered = {
                name: (round(at, 2), r if isinstance(r, BaseException) else r.status_code)
                for name, (at, r) in results.items()
            }
            locker.rollback()  # the lock's end
        assert held < LOCK_S, held
        assert set(answered) == {"unknown", "healthz", "known", "chat"}, (
            f"stalled while the table was locked: {answered}"
        )
        assert answered["healthz"][1] == 200, answered
        # a token the server knows: served, or (once its cache is too old to trust) 503, never a stall
        for name in ("known", "chat"):
            assert answered[name][1] in (200, 503), answered
        at, unknown = results["unknown"]
        assert isinstance(unknown, httpx.Response) and unknown.status_code == 503, answered
        assert _error_code(unknown) == "store_unavailable", unknown.text
        assert unknown.headers.get("retry-after") == "1", unknown.headers
        assert unknown_hello and unknown_hello[0].get("code") == "store_unavailable", unknown_hello
        # "try again later", which clients reconnect on, not 4401: the credential was not refused
        assert unknown_hello[0]["close_code"] == 1013, unknown_hello
        # the lock is gone: a plain 401 and a 200 again
        r = httpx.get(sp.url + "/v1/models", headers=_bearer("aps_unknown_" + "y" * 30), timeout=20)
        assert r.status_code == 401, r.text
        assert httpx.get(sp.url + "/v1/models", headers=_bearer(token), timeout=20).status_code == 200


def test_a_flood_of_unknown_tokens_reads_the_database_a_few_times_a_second(tmp_path: Path, pg_url: str) -> None:
    """Unknown tokens make the server look for tokens minted elsewhere, but at most a few times a
    second however many arrive; every one of them is a 401."""
    home = tmp_path / "h"
    with serving(home, env=_env(home, pg_url)) as sp:
        _token(tmp_path, pg_url, "someone")

        def scans() -> int:
            with psycopg.connect(pg_url, autocommit=True) as c:
                c.execute("SELECT pg_stat_force_next_flush()")
                row = c.execute(
                    "SELECT coalesce(seq_scan, 0) + coalesce(idx_scan, 0) FROM pg_stat_user_tables "
                    "WHERE relname = 'token_state'"
                ).fetchone()
            return int(row[0]) if row else 0

        async def flood() -> list[int]:
            async with httpx.AsyncClient(timeout=30) as client:

                async def one(i: int) -> int:
                    r = await client.get(sp.url + "/v1/models", headers=_bearer(f"aps_bogus_{i:08d}_" + "q" * 20))
                    return r.status_code

                return list(await asyncio.gather(*(one(i) for i in range(300))))

        before = scans()
        t0 = time.monotonic()
        codes = asyncio.run(flood())
        took = time.monotonic() - t0
        time.sleep(1.2)  # the server's backend reports its counts at most every second
        read = scans() - before
        assert set(codes) == {401}, sorted(set(codes))
        # at most ~5 reads a second for unknown tokens plus the background look every half second
        assert read <= (took + 2.5) * 8 + 5, (read, took)
