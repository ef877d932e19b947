"""`appserver chat`: a terminal client of the /ws protocol of the server running on this home.

Prints the reply as it grows, reasoning dimmed, tool calls compactly; asks `approve? [y/N]` for
approvals; Ctrl-C cancels the running turn (a second Ctrl-C exits); `/new` starts a conversation,
`/quit` (or Ctrl-D) leaves.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
from typing import Any

import click

from appserver.cli.common import fail, get_config, live_server_or_fail
from appserver.ws.client import TERMINAL, Closed, ProtocolClient, ProtocolError

DIM, RESET = "\x1b[2m", "\x1b[0m"


class _Lines:
    """stdin lines on a daemon thread (so a blocked read never keeps the process alive)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.queue: asyncio.Queue[str | None] = asyncio.Queue()
        self.loop = loop
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            line = sys.stdin.readline()
            self.loop.call_soon_threadsafe(self.queue.put_nowait, line if line else None)
            if not line:
                return

    async def get(self) -> str | None:
        return await self.queue.get()


class Renderer:
    """Turns successive whole snapshots into terminal output (only the new part of each block)."""

    def __init__(self, color: bool) -> None:
        self.color = color
        self.printed: dict[int, int] = {}
        self.tool_status: dict[int, str] = {}
        self.kind: str | None = None

    def out(self, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    def snapshot(self, snap: dict[str, Any]) -> None:
        for i, block in enumerate(snap.get("blocks") or []):
            kind = block["type"]
            if kind in ("text", "reasoning"):
                text = block.get("text") or ""
                done = self.printed.get(i, 0)
                if len(text) > done:
                    if self.kind != kind and self.kind is not None:
                        self.out("\n")
                    new = text[done:]
                    self.out(f"{DIM}{new}{RESET}" if kind == "reasoning" and self.color else new)
                    self.printed[i] = len(text)
                    self.kind = kind
            elif kind == "tool_call":
                status = block.get("status") or ""
                if status != "streaming" and self.tool_status.get(i) != status:
                    self.tool_status[i] = status
                    if self.kind is not None:
                        self.out("\n")
                    line = f"[{block.get('name')}({block.get('arguments') or ''}) {status}]"
                    if block.get("output") is not None:
                        out = str(block["output"]).replace("\n", " ")
                        line = f"[{block.get('name')} {status}: {out[:120]}]"
                    self.out(f"{DIM}{line}{RESET}\n" if self.color else line + "\n")
                    self.kind = None

    def end(self, snap: dict[str, Any]) -> None:
        if self.kind is not None:
            self.out("\n")
        if snap["status"] == "cancelled":
            self.out("[cancelled]\n")
        elif snap["status"] == "failed":
            self.out(f"[failed: {(snap.get('error') or {}).get('message') or snap.get('stop_reason')}]\n")


async def chat(url: str, agent: str, conversation: str, token: str | None) -> int:
    loop = asyncio.get_running_loop()
    client = await ProtocolClient.connect(url, token=token, client="appserver-chat")
    lines = _Lines(loop)
    color = sys.stdout.isatty()
    interrupts: asyncio.Queue[None] = asyncio.Queue()
    loop.add_signal_handler(signal.SIGINT, interrupts.put_nowait, None)
    try:
        state = await client.request({"type": "subscribe", "conversation": conversation, "agent": agent})
        conv_id = state["conversation"]["id"]
        agent_id = state["conversation"]["agent_id"]
        click.echo(f"chatting with {agent} in conversation {conv_id}  (/new, /quit; Ctrl-C cancels a turn)")
        while True:
            sys.stdout.write("you> ")
            sys.stdout.flush()
            line_task = loop.create_task(lines.get())
            int_task = loop.create_task(interrupts.get())
            done, _ = await asyncio.wait({line_task, int_task}, return_when=asyncio.FIRST_COMPLETED)
            if int_task in done:
                line_task.cancel()
                sys.stdout.write("\n")
                return 0
            int_task.cancel()
            line = line_task.result()
            if line is None or line.strip() in ("/quit", "/exit"):
                sys.stdout.write("\n")
                return 0
            text = line.rstrip("\n")
            if not text.strip():
                continue
            if text.strip() == "/new":
                await client.request({"type": "unsubscribe", "conversation": conv_id})
                created = await client.request({"type": "create_conversation", "agent": agent_id})
                conv_id = created["conversation"]["id"]
                await client.request({"type": "subscribe", "conversation": conv_id})
                click.echo(f"new conversation {conv_id}")
                continue
            try:
                ack = await client.submit(agent_id, text, conv_id, source={"client": "chat"})
            except ProtocolError as exc:
                click.echo(f"error: {exc.message}")
                continue
            if not await run_turn(client, ack["turn_id"], conv_id, lines, interrupts, Renderer(color)):
                return 130
    except Closed as exc:
        click.echo(f"\nerror: {exc.message}", err=True)
        return 1
    finally:
        loop.remove_signal_handler(signal.SIGINT)
        await client.close()


async def run_turn(client: ProtocolClient, turn_id: str, conv_id: str, lines: _Lines, interrupts: asyncio.Queue[None], r: Renderer) -> bool:
    """Render one turn to its end. Returns False when the user asked to exit (second Ctrl-C)."""
    loop = asyncio.get_running_loop()
    cancelling = False
    while True:
        frame_task = loop.create_task(client.next_frame())
        int_task = loop.create_task(interrupts.get())
        done, _ = await asyncio.wait({frame_task, int_task}, return_when=asyncio.FIRST_COMPLETED)
        if int_task in done:
            frame_task.cancel()
            if cancelling:
                r.out("\n")
                return False
            cancelling = True
            r.out("\n^C cancelling (Ctrl-C again to exit)\n")
            r.kind = None
            await client.send({"type": "cancel", "conversation": conv_id})
            continue
        int_task.cancel()
        frame = frame_task.result()
        kind = frame.get("type")
        if kind == "turn_updated" and frame["snapshot"]["turn_id"] == turn_id:
            snap = frame["snapshot"]
            r.snapshot(snap)
            if snap["status"] in TERMINAL:
                r.end(snap)
                return True
        elif kind == "approval_request" and frame["conversation_id"] == conv_id:
            if r.kind is not None:
                r.out("\n")
                r.kind = None
            r.out(f"{frame['name']}({frame['arguments']}) wants to run. approve? [y/N] ")
            answer = await lines.get()
            decision = "approve" if (answer or "").strip().lower() in ("y", "yes") else "deny"
            await client.send({"type": "approval_response", "conversation": conv_id, "decisions": [{"call_id": frame["call_id"], "decision": decision}]})
        elif kind == "approval_resolved" and frame["conversation_id"] == conv_id:
            r.out(f"[{frame['call_id']} {frame['status']} elsewhere]\n")
        elif kind == "error":
            r.out(f"error: {frame.get('message')}\n")


@click.command("chat")
@click.option("--agent", default="assistant", show_default=True, help="Agent id or name.")
@click.option("--conversation", default="default", show_default=True, help="default or a conversation id.")
@click.option("--url", default=None, help="Server URL (default: the server running on this home).")
@click.option("--token", default=None, envvar="APPSERVER_TOKEN", help="Bearer token when the server requires one.")
def chat_command(agent: str, conversation: str, url: str | None, token: str | None) -> None:
    """Chat with an agent through the running server (WebSocket protocol)."""
    if url is None:
        live = live_server_or_fail(get_config().server_json)
        if live is None:
            fail("no server is running on this home: start `appserver serve` (or give --url)", 3)
        url = str(live["url"])
    try:
        code = asyncio.run(chat(url, agent, conversation, token))
    except ProtocolError as exc:
        fail(exc.message, 2)
    except OSError as exc:
        fail(f"cannot reach the server at {url}: {exc}", 1)
    sys.exit(code)
