"""The floor under the server's HTTP row: a relay that does nothing but relay.

uvicorn (httptools, asyncio, as `appserver serve` runs it) takes a chat completion, asks the
upstream for it with the server's own upstream client (providers/fasttransport.py `LeanClient`,
streamed, as the `openai` provider asks), joins the streamed text and answers one
`chat.completion`. No authentication, no validation, no conversation, no turn, no store: what
one CPython process can serve when every request crosses the network twice and nothing else
happens. bench/compare.py serves it beside the server ("bare relay" row), so the server's
throughput can be read as a share of it, measured on the same host in the same run.

    .venv/bin/python bench/bare_relay.py --port 8001 --upstream http://127.0.0.1:8000/v1
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import orjson  # noqa: E402
import uvicorn  # noqa: E402

from appserver.providers.fasttransport import LeanClient, lean_transport  # noqa: E402

HEADERS = {"Accept": "text/event-stream", "Content-Type": "application/json"}


def relay_app(upstream: str) -> Any:
    client = LeanClient(transport=lean_transport())
    timeout = httpx.Timeout(60.0, connect=10.0)
    url = upstream.rstrip("/") + "/chat/completions"

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        request = orjson.loads(body)
        request["stream"] = True
        request["stream_options"] = {"include_usage": True}
        text: list[str] = []
        usage = None
        async with client.post_stream(url, orjson.dumps(request), HEADERS, timeout) as answer:
            tail = b""
            async for part in answer.aiter_bytes():
                lines = (tail + part).split(b"\n")
                tail = lines.pop()
                for line in lines:
                    if line.startswith(b"data: {"):
                        event = orjson.loads(line[6:])
                        for choice in event.get("choices") or ():
                            text.append((choice.get("delta") or {}).get("content") or "")
                        usage = event.get("usage") or usage
        reply = orjson.dumps(
            {
                "id": "chatcmpl-relay",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": request.get("model"),
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "".join(text)},
                        "finish_reason": "stop",
                    }
                ],
                "usage": usage,
            }
        )
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(reply))],
            }
        )
        await send({"type": "http.response.body", "body": reply})

    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--upstream", required=True, help="the upstream's base URL, e.g. http://127.0.0.1:8000/v1")
    a = ap.parse_args()
    uvicorn.run(
        relay_app(a.upstream),
        host="127.0.0.1",
        port=a.port,
        http="httptools",
        loop="asyncio",
        lifespan="off",
        log_level="warning",
        access_log=False,
    )


if __name__ == "__main__":
    main()
