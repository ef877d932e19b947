"""runtime/latest.py: `Latest` wakes every waiter on a publish, forgets waiters that gave up, and
`Quiet` (a consumer's keepalive) falls due only after a quiet interval, with one timer moved lazily."""

from __future__ import annotations

import asyncio

from appserver.runtime.latest import Latest, Quiet


async def test_publish_wakes_every_waiter() -> None:
    cell: Latest[str] = Latest("a", 0)
    waiters = [asyncio.create_task(cell.wait_newer(0)) for _ in range(5)]
    await asyncio.sleep(0)
    cell.publish("b")
    assert await asyncio.gather(*waiters) == [(1, "b")] * 5


async def test_waiters_that_time_out_do_not_pile_up() -> None:
    cell: Latest[int] = Latest(0, 0)
    for _ in range(50):
        try:
            await cell.wait_newer(0, timeout=0.001)
        except TimeoutError:
            pass
    assert cell._waiters == []


async def test_quiet_falls_due_only_after_a_quiet_interval() -> None:
    cell: Latest[int] = Latest(0, 0)
    quiet = Quiet(0.05)
    try:

        async def publisher() -> None:
            for v in range(1, 8):  # every 20 ms for 140 ms: never quiet for 50 ms
                await asyncio.sleep(0.02)
                cell.publish(v)

        task = asyncio.create_task(publisher())
        seen, quiets = 0, 0
        while seen < 7:
            if await cell.wait_newer_or_quiet(seen, quiet):
                seen = cell.version
            else:
                quiets += 1
        await task
        assert quiets == 0
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        assert await cell.wait_newer_or_quiet(seen, quiet) is False  # nothing more: due ~50 ms on
        assert 0.03 <= loop.time() - t0 <= 0.5
        assert cell._waiters == []  # the waiter woken by the keepalive left the list
        cell.publish(8)
        assert await cell.wait_newer_or_quiet(seen, quiet) is True
    finally:
        quiet.close()
