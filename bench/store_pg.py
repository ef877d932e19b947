"""Store throughput, SQLite and PostgreSQL side by side (prints; asserts nothing).

    .venv/bin/python bench/store_pg.py [turns_per_worker]

1. Through the Store interface (SQLiteStore vs PostgresStore): turns/s for accept_turn + commit_turn
   (a user and an assistant message each) at concurrency 1 and 64, and reads/s (get_turn +
   list_messages(limit=20)) at concurrency 1 and 64.
2. The drivers alone on the same statements (psycopg 3 vs asyncpg, when installed): a turn's
   writes one transaction each, 32 turns per transaction, and point reads, on one connection.

PostgreSQL: `APPSERVER_TEST_PG` (default postgresql://postgres@127.0.0.1:5432/postgres); a
database of its own is created and dropped.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from appserver.store import AgentRecord, ConversationRecord, MessageRecord, TurnCommit, TurnRecord  # noqa: E402
from appserver.store.postgres import PostgresStore  # noqa: E402
from appserver.store.sqlite import SQLiteStore  # noqa: E402
from tests.support.pg import temp_database, truncate_all  # noqa: E402

CONVERSATIONS = 64


async def _setup(store: SQLiteStore | PostgresStore) -> list[str]:
    await store.create_agent(AgentRecord(id="agt_bench", name="bench"))
    convs = [f"conv_{i}" for i in range(CONVERSATIONS)]
    for c in convs:
        await store.create_conversation(ConversationRecord(id=c, agent_id="agt_bench"))
    return convs


async def _turns(store: SQLiteStore | PostgresStore, convs: list[str], workers: int, per_worker: int) -> float:
    async def worker(w: int) -> None:
        conv = convs[w % len(convs)]
        for i in range(per_worker):
            tid = f"turn_{workers}_{w}_{i}"
            await store.accept_turn(
                TurnRecord(
                    id=tid, conversation_id=conv, agent_id="agt_bench", status="running", input={"content": "hi"}
                )
            )
            await store.commit_turn(
                conv,
                TurnCommit(
                    tid,
                    "completed",
                    "end_turn",
                    [MessageRecord(role="user", content=f"hello {i}"), MessageRecord(role="assistant", content="echo")],
                    usage={"input_tokens": 2, "output_tokens": 1},
                    iteration=1,
                ),
            )

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(workers)))
    return workers * per_worker / (time.perf_counter() - t0)


async def _reads(store: SQLiteStore | PostgresStore, convs: list[str], workers: int, per_worker: int) -> float:
    turns = [t.id for c in convs[:8] for t in await store.list_turns(c)][:200]

    async def worker(w: int) -> None:
        for i in range(per_worker):
            turn = await store.get_turn(turns[(w + i) % len(turns)])
            assert turn is not None
            await store.list_messages(turn.conversation_id, limit=20)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(workers)))
    return workers * per_worker / (time.perf_counter() - t0)


async def _store_numbers(store: SQLiteStore | PostgresStore, per_worker: int) -> dict[str, float]:
    await store.open()
    try:
        convs = await _setup(store)
        return {
            "turns/s  c=1": await _turns(store, convs, 1, per_worker * 4),
            "turns/s  c=64": await _turns(store, convs, 64, per_worker),
            "reads/s  c=1": await _reads(store, convs, 1, per_worker * 4),
            "reads/s  c=64": await _reads(store, convs, 64, per_worker),
        }
    finally:
        await store.close()


# ------------------------------------------------------------------ the drivers alone

DDL = """
DROP TABLE IF EXISTS bench_turns; DROP TABLE IF EXISTS bench_messages;
CREATE TABLE bench_turns(id TEXT PRIMARY KEY, conv TEXT, status TEXT, input TEXT, usage TEXT, created_at FLOAT8);
CREATE TABLE bench_messages(id BIGSERIAL PRIMARY KEY, conv TEXT, turn_id TEXT, role TEXT, content TEXT,
                            created_at FLOAT8)
"""
INS_TURN = "INSERT INTO bench_turns VALUES ({0},{1},{2},{3},{4},{5})"
INS_MSG = (
    "INSERT INTO bench_messages(conv, turn_id, role, content, created_at) VALUES ({0},{1},{2},{3},{4}) RETURNING id"
)
UPD_TURN = "UPDATE bench_turns SET status={0}, usage={1} WHERE id={2}"
SEL_TURN = "SELECT * FROM bench_turns WHERE id={0}"


async def _psycopg(url: str, n: int, batch: int) -> tuple[float, float]:
    import psycopg
    from psycopg.rows import dict_row

    q = [s.format(*["%s"] * 6) for s in (INS_TURN, INS_MSG, UPD_TURN, SEL_TURN)]
    async with await psycopg.AsyncConnection.connect(url, autocommit=True, row_factory=dict_row) as c:
        await c.execute(DDL)
        t0 = time.perf_counter()
        for b in range(0, n, batch):
            async with c.pipeline(), c.transaction():
                for i in range(b, b + batch):
                    await c.execute(q[0], (f"t{i}", "c", "running", '{"content":"hi"}', "{}", 1.0))
                    m1 = await c.execute(q[1], ("c", f"t{i}", "user", '"hi"', 1.0))
                    m2 = await c.execute(q[1], ("c", f"t{i}", "assistant", '"echo"', 1.0))
                    await c.execute(q[2], ("completed", "{}", f"t{i}"))
                    await m1.fetchone()
                    await m2.fetchone()
        writes = n / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        for i in range(n):
            await (await c.execute(q[3], (f"t{i}",))).fetchone()
        return writes, n / (time.perf_counter() - t0)


async def _asyncpg(url: str, n: int, batch: int) -> tuple[float, float]:
    import asyncpg  # type: ignore[import-not-found,unused-ignore]

    q = [s.format(*[f"${i}" for i in range(1, 7)]) for s in (INS_TURN, INS_MSG, UPD_TURN, SEL_TURN)]
    c = await asyncpg.connect(url)
    try:
        await c.execute(DDL)
        t0 = time.perf_counter()
        for b in range(0, n, batch):
            async with c.transaction():
                for i in range(b, b + batch):
                    await c.execute(q[0], f"t{i}", "c", "running", '{"content":"hi"}', "{}", 1.0)
                    await c.fetchval(q[1], "c", f"t{i}", "user", '"hi"', 1.0)
                    await c.fetchval(q[1], "c", f"t{i}", "assistant", '"echo"', 1.0)
                    await c.execute(q[2], "completed", "{}", f"t{i}")
        writes = n / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        for i in range(n):
            await c.fetchrow(q[3], f"t{i}")
        return writes, n / (time.perf_counter() - t0)
    finally:
        await c.close()


async def _drivers(url: str, n: int) -> list[tuple[str, Callable[[str, int, int], Awaitable[tuple[float, float]]]]]:
    found: list[tuple[str, Callable[[str, int, int], Awaitable[tuple[float, float]]]]] = [("psycopg 3", _psycopg)]
    try:
        import asyncpg  # type: ignore[import-not-found,unused-ignore]  # noqa: F401
    except ImportError:
        print("(asyncpg is not installed: driver comparison shows psycopg only; pip install asyncpg)")
    else:
        found.append(("asyncpg", _asyncpg))
    return found


def _table(title: str, columns: list[str], rows: dict[str, list[Any]]) -> None:
    print(f"\n{title}")
    print(f"  {'':16}" + "".join(f"{c:>14}" for c in columns))
    for name, values in rows.items():
        print(f"  {name:16}" + "".join(f"{v:>14,.0f}" if isinstance(v, float) else f"{v!s:>14}" for v in values))


async def main() -> None:
    per_worker = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    with temp_database("bench") as url, tempfile.TemporaryDirectory() as tmp:
        sqlite = await _store_numbers(SQLiteStore(Path(tmp) / "bench.db"), per_worker)
        truncate_all(url)
        pg = await _store_numbers(PostgresStore(url), per_worker)
        _table(
            "Store (SQLite: WAL, synchronous=NORMAL; PostgreSQL: psycopg 3 + pool, fsync on)",
            ["SQLiteStore", "PostgresStore"],
            {k: [sqlite[k], pg[k]] for k in sqlite},
        )

        n = 64 * per_worker
        results: dict[str, list[Any]] = {}
        for name, fn in await _drivers(url, n):
            one_w, reads = await fn(url, n, 1)
            grouped_w, _ = await fn(url, n, 32)
            results[name] = [one_w, grouped_w, reads]
        _table(
            "Drivers alone, one connection (turn = insert + 2 messages + update)",
            ["turns/s tx=1", "turns/s tx=32", "point reads/s"],
            results,
        )


if __name__ == "__main__":
    asyncio.run(main())
