"""Kernel throughput on the offline echo model, in-process (prints; asserts nothing).

turns/s at concurrency 64 over 64 conversations (target >= 3,000)
median per-turn time at concurrency 1
and, side by side, the cost of the provider alone (echo streamed with no kernel) as a ratio.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from appserver.config import load_config  # noqa: E402
from appserver.providers.base import ChatMessage, ProviderRequest  # noqa: E402
from appserver.providers.echo import EchoProvider  # noqa: E402
from appserver.runtime import SubmitRequest  # noqa: E402
from appserver.server import Server  # noqa: E402


async def provider_only(n: int) -> float:
    echo = EchoProvider()
    t0 = time.perf_counter()
    for i in range(n):
        async for _ in echo.stream(ProviderRequest("echo", [ChatMessage("user", f"hello {i}")])):
            pass
    return (time.perf_counter() - t0) / n


async def main() -> None:
    turns_per_conv = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    with tempfile.TemporaryDirectory() as tmp:
        server = Server(load_config(Path(tmp), environ={}))
        await server.open()
        try:
            kernel = server.kernel
            convs = []
            for _ in range(64):
                sub = await kernel.submit(SubmitRequest(agent="assistant", input="warm up", conversation="new"))
                await sub.wait(10)
                convs.append(sub.conversation_id)

            async def worker(conv: str) -> None:
                for i in range(turns_per_conv):
                    sub = await kernel.submit(SubmitRequest(agent="assistant", input=f"hello {i}", conversation=conv))
                    await sub.wait(30)

            t0 = time.perf_counter()
            await asyncio.gather(*(worker(c) for c in convs))
            elapsed = time.perf_counter() - t0
            total = 64 * turns_per_conv
            print(
                f"concurrency 64 x 64 conversations: {total} turns in {elapsed:.2f} s = "
                f"{total / elapsed:,.0f} turns/s (target >= 3,000)"
            )

            samples = []
            conv = convs[0]
            for i in range(300):
                t = time.perf_counter()
                sub = await kernel.submit(
                    SubmitRequest(agent="assistant", input=f"one at a time {i}", conversation="new" if i % 2 else conv)
                )
                await sub.wait(10)
                samples.append(time.perf_counter() - t)
            median = statistics.median(samples)
            base = await provider_only(300)
            print(
                f"concurrency 1: median {median * 1e6:,.0f} us per turn; echo provider alone {base * 1e6:,.0f} us; "
                f"kernel/provider ratio {median / base:.1f}x"
            )
        finally:
            await server.close()


if __name__ == "__main__":
    asyncio.run(main())
