"""echo_room: an example user channel plugin, a "chat room" made of two text files.

Install it by copying this folder to `$APPSERVER_HOME/channels/echo_room/` (the folder name must equal
the manifest's `id`), then add an account to config.toml:

    [channels.echo_room.accounts.main]
    inbox = "/tmp/room/inbox.txt"     # optional; default <data_dir>/inbox.txt
    outbox = "/tmp/room/outbox.txt"   # optional; default <data_dir>/outbox.txt
    default_agent = "assistant"       # the agent that answers; without one (or a route) nothing does
    dm_policy = "open"                # anyone who writes in the room; see below for the default

and start the server with the channel: `appserver serve --channels echo_room`.

Each line appended to the inbox is one message (`name: text` sets the sender, else the sender is
`you`); each reply is appended to the outbox as `[chat] text`. Try it with
`echo "ann: hello" >> /tmp/room/inbox.txt` and `tail -f /tmp/room/outbox.txt`.

Without the `dm_policy` line the account keeps the default, `pairing`: a sender's first message is
answered with a pairing code instead (`[room] Hi! ... Your pairing code is ABCD-EFGH ...`; the
pending codes are in `appserver pairing list`); once you run `appserver pairing approve ABCD-EFGH`,
the messages they wrote meanwhile are answered (docs/channels.md, "Pairing").

The contract (`plugins.contract`) in five points, each marked below with CONTRACT:
1. the module defines `create_adapter(account, context) -> Adapter`;
2. the adapter has `limits`, `start()`, `stop()`, `is_running` and `send(target, text) -> ids`;
3. inbound traffic becomes `InboundMessage`s handed to `await context.on_message(msg)`, which returns
   once the gateway's ledger has committed the message: only then may the platform be told it was
   received (here: the saved read offset);
4. `message_id` is stable across redeliveries (here: the line's byte offset), so a message read again
   after a crash is recognised by the ledger and makes no second turn;
5. a refused send raises `DeliveryError`; a configuration that cannot work raises `AccountError`.

A plugin imports only `plugins.contract`, the standard library and its platform library.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from plugins.contract import (
    Account,
    AccountError,
    AdapterContext,
    DeliveryError,
    InboundMessage,
    Limits,
    Target,
)

CHAT = "room"  # one room; the route key is echo_room:<account>:room:__root__


class EchoRoomAdapter:
    # CONTRACT 2: the gateway splits replies longer than max_length; this room cannot edit messages.
    limits = Limits(max_length=4000, can_edit=False)

    def __init__(self, account: Account, context: AdapterContext) -> None:
        self.account = account
        self.context = context
        settings = account.settings
        self.inbox = Path(settings.get("inbox") or context.data_dir / "inbox.txt")
        self.outbox = Path(settings.get("outbox") or context.data_dir / "outbox.txt")
        self.poll_s = float(settings.get("poll_s", 0.2))
        self._offset_file = context.data_dir / f"{account.name}.offset"
        self._task: asyncio.Task[None] | None = None

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def start(self) -> None:
        """CONTRACT 2: returns once running; a setting that cannot work is an AccountError."""
        try:
            self.inbox.parent.mkdir(parents=True, exist_ok=True)
            self.inbox.touch(exist_ok=True)
        except OSError as exc:
            raise AccountError(
                f"echo_room account '{self.account.name}': cannot use inbox {self.inbox}: {exc}"
            ) from exc
        self._task = asyncio.create_task(self._poll())
        self.context.report("running", None)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self.context.report("stopped", None)

    async def send(self, target: Target, text: str) -> list[str]:
        """CONTRACT 2 and 5: post the text, return the platform's ids, raise DeliveryError if refused."""
        try:
            self.outbox.parent.mkdir(parents=True, exist_ok=True)
            with self.outbox.open("a", encoding="utf-8") as out:
                offset = out.tell()
                out.write(f"[{target.chat}] {text}\n")
        except OSError as exc:
            raise DeliveryError(f"cannot write {self.outbox}: {exc}") from exc
        return [str(offset)]

    async def _poll(self) -> None:
        offset = self._load_offset()
        while True:
            try:
                offset = await self._read_new_lines(offset)
            except Exception as exc:  # e.g. the gateway could not record a message: try again later
                self.context.report("backoff", f"{exc!r}; retrying in 1 s")
                await asyncio.sleep(1.0)
                self.context.report("running", None)
            await asyncio.sleep(self.poll_s)

    async def _read_new_lines(self, offset: int) -> int:
        with self.inbox.open("rb") as f:
            f.seek(offset)
            data = f.read()
        # Only complete lines; a line still being written waits for its newline.
        while b"\n" in data:
            line, data = data.split(b"\n", 1)
            text = line.decode("utf-8", "replace").strip()
            if text:
                sender, sep, body = text.partition(": ")
                if not sep or " " in sender:
                    sender, body = "you", text
                # CONTRACT 3 and 4: a stable id, handed over; this returns after the ledger commit.
                await self.context.on_message(
                    InboundMessage(
                        channel=self.account.channel,
                        account=self.account.name,
                        chat=CHAT,
                        chat_type="dm",
                        sender=sender,
                        message_id=str(offset),
                        text=body,
                    )
                )
            offset += len(line) + 1
            self._save_offset(offset)  # our "ack": only after on_message returned
        return offset

    def _load_offset(self) -> int:
        try:
            return int(self._offset_file.read_text())
        except (OSError, ValueError):
            return 0

    def _save_offset(self, offset: int) -> None:
        self._offset_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._offset_file.with_suffix(".tmp")
        tmp.write_text(str(offset))
        tmp.replace(self._offset_file)


def create_adapter(account: Account, context: AdapterContext) -> EchoRoomAdapter:
    """CONTRACT 1: the gateway calls this once per configured account."""
    return EchoRoomAdapter(account, context)
