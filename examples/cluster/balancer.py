"""A round-robin TCP load balancer on loopback, for trying a cluster on one machine.

    python examples/cluster/balancer.py 127.0.0.1:8800 127.0.0.1:8801 127.0.0.1:8802 127.0.0.1:8803

Listens on the first address and hands each new connection to the next backend in turn (one that
refuses is skipped), copying bytes both ways: HTTP keep-alive, SSE and WebSocket all pass through.
No sticky sessions: any appserver of the cluster takes any connection. For production use what
you already run (nginx, HAProxy, a cloud load balancer) with `/readyz` as the health check.
"""

from __future__ import annotations

import asyncio
import itertools
import sys


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        writer.close()


async def main(listen: str, backends: list[str]) -> None:
    turn = itertools.cycle(range(len(backends)))

    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        for _ in range(len(backends)):
            host, port = backends[next(turn)].rsplit(":", 1)
            try:
                server_r, server_w = await asyncio.wait_for(asyncio.open_connection(host, int(port)), 5)
            except (OSError, TimeoutError):
                continue
            await asyncio.gather(pipe(client_r, server_w), pipe(server_r, client_w))
            return
        client_w.close()

    host, port = listen.rsplit(":", 1)
    server = await asyncio.start_server(handle, host, int(port))
    print(f"balancing {listen} over {', '.join(backends)}", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit("usage: balancer.py LISTEN_HOST:PORT BACKEND_HOST:PORT [BACKEND_HOST:PORT ...]")
    try:
        asyncio.run(main(sys.argv[1], sys.argv[2:]))
    except KeyboardInterrupt:
        pass
