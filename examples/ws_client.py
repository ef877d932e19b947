"""A minimal desktop-style client of the appserver WebSocket protocol (docs/protocol.md).

It says hello, subscribes to a conversation, submits one input, renders every snapshot it
receives (whole snapshots: it just redraws), and answers approval requests.

    python examples/ws_client.py --url http://127.0.0.1:8770 --agent assistant "hello"
    python examples/ws_client.py --agent careful --approve "/call clock {}"

`--url` is the server's base URL (`make serve LISTEN=127.0.0.1:9000` → `--url http://127.0.0.1:9000`).
The second line needs an agent whose clock asks for approval; agents are made with the CLI, not over
the protocol, so create it first:

    appserver agents create --name careful --tool clock=ask

It uses `appserver.client`, the protocol client package: it imports nothing of the server (only the
`websockets` package), matches replies to requests and sends the token in a header.
"""

from __future__ import annotations

import argparse
import asyncio
import os

from appserver.client import TERMINAL, ProtocolClient, ProtocolError


async def main(url: str, agent: str, text: str, approve: bool, token: str | None) -> int:
    async with await ProtocolClient.connect(url, token=token, client="example") as client:
        print("welcome", client.welcome["connection_id"])
        try:
            state = await client.request({"type": "subscribe", "conversation": "default", "agent": agent})
        except ProtocolError as exc:
            hint = (
                f"\ncreate it first, e.g.: appserver agents create --name {agent} --tool clock=ask"
                if exc.code == "agent_not_found"
                else ""
            )
            raise SystemExit(f"error {exc.code}: {exc.message}{hint}") from None
        conversation = state["conversation"]["id"]
        print("subscribed", conversation, "state", state["state"])

        ack = await client.submit(agent, text, conversation)
        turn_id = ack["turn_id"]
        print("turn", turn_id, "queue position", ack["queue_position"])
        async for frame in client.frames():
            kind = frame["type"]
            if kind == "turn_updated":
                snap = frame["snapshot"]
                text_now = "".join(b["text"] for b in snap["blocks"] if b["type"] == "text")
                print(f"  rev {snap['revision']:>3} {snap['status']:<9} {snap['phase']:<10} {text_now[-60:]!r}")
                if snap["turn_id"] == turn_id and snap["status"] in TERMINAL:
                    print(f"{snap['status']}: {text_now}")
                    return 0 if snap["status"] == "completed" else 1
            elif kind == "approval_request":
                print("approval_request", frame["name"], frame["arguments"])
                decision = "approve" if approve else "deny"
                await client.send(
                    {
                        "type": "approval_response",
                        "conversation": frame["conversation_id"],
                        "decisions": [{"call_id": frame["call_id"], "decision": decision, "reason": "example client"}],
                    }
                )
            elif kind == "error":
                print("error", frame["code"], frame["message"])
    return 1


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8770")
    p.add_argument("--agent", default="assistant")
    p.add_argument("--approve", action="store_true", help="approve approval requests (default: deny)")
    p.add_argument("--token", default=os.environ.get("APPSERVER_TOKEN"))
    p.add_argument("text", nargs="?", default="hello from the example client")
    a = p.parse_args()
    raise SystemExit(asyncio.run(main(a.url, a.agent, a.text, a.approve, a.token)))
