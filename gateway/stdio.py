"""The control lines the gateway child writes on stdout, and the supervisor's reader of them.

The child's stdout carries nothing but these lines::

    GATEWAY_READY
    GATEWAY_RESPONSE {"id": "<request id>", ...}
    GATEWAY_EVENT {"type": "<event type>", ...}

each one JSON object on one line (ASCII, so no byte of it can end the line early). `ControlWriter.
take_stdout()` runs first thing in the child: it keeps a private duplicate of the real stdout for
itself, points file descriptor 1 at stderr (so even `os.write(1, …)` or a subprocess a plugin
starts lands in the log) and sets `sys.stdout` to `sys.stderr`. Nothing a plugin prints can then
reach the supervisor's control pipe, let alone forge a response. The supervisor reads with
`parse_line`, which accepts only these shapes and treats every other line as noise.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import sys
import threading
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TextIO

READY = "GATEWAY_READY"
RESPONSE = "GATEWAY_RESPONSE"
EVENT = "GATEWAY_EVENT"
MAX_LINE = 1 << 20  # a control line longer than this is noise, not a message
# The longest command line (supervisor -> child, without its newline) the child reads: the
# supervisor refuses to send a longer one (`CommandTooLarge`), and the child skips one that comes
# anyway, answering an error for it when its id can be read, instead of exiting.
COMMAND_MAX_LINE = 1 << 22
# A string in a control line the child writes is cut to this many characters (an error's text, an
# account's reason): the line then stays far below MAX_LINE, which the supervisor would drop.
MAX_FIELD_CHARS = 4000
_COMMAND_ID = re.compile(rb'^\s*\{\s*"id"\s*:\s*"([A-Za-z0-9_.-]{1,64})"')

Kind = Literal["ready", "response", "event"]

log = logging.getLogger("gateway.stdio")


@dataclass(frozen=True)
class ControlLine:
    kind: Kind
    payload: dict[str, Any]


class ControlWriter:
    """Writes control lines to the one stream that reaches the supervisor. Thread-safe."""

    def __init__(self, stream: TextIO, redact: Callable[[Any], Any] | None = None) -> None:
        self._out = stream
        self._lock = threading.Lock()
        # The accounts' secrets masked in every payload (gateway/redact.py), before it is cut: an
        # account's reason or an error may quote a platform's answer echoing a token.
        self._redact = redact

    @classmethod
    def take_stdout(cls, redact: Callable[[Any], Any] | None = None) -> ControlWriter:
        """Keep the real stdout for control lines and send everything else written to it to
        stderr. Call once, before any plugin is imported."""
        sys.stdout.flush()
        private = os.dup(1)  # not inheritable: a subprocess never gets the control pipe
        os.dup2(2, 1)
        sys.stdout = sys.stderr
        return cls(os.fdopen(private, "w", encoding="ascii", buffering=1), redact)

    def ready(self) -> None:
        self._write(READY)

    def response(self, request_id: str, payload: Mapping[str, Any]) -> None:
        line = f"{RESPONSE} {_dump({**self._clean(payload), 'id': request_id})}"
        if len(line) > MAX_LINE:  # the supervisor would drop it and wait for nothing: say so instead
            log.error(
                "the answer to command %s is %d bytes, over the control line limit; answering an error",
                request_id,
                len(line),
            )
            error = f"the gateway's answer was {len(line)} bytes, over the control channel's {MAX_LINE} bytes"
            line = f"{RESPONSE} {_dump({'ok': False, 'error': error, 'id': request_id})}"
        self._write(line)

    def event(self, event_type: str, payload: Mapping[str, Any]) -> None:
        line = f"{EVENT} {_dump({**self._clean(payload), 'type': event_type})}"
        if len(line) > MAX_LINE:
            log.error("dropped a %s event of %d bytes, over the control line limit", event_type, len(line))
            return
        self._write(line)

    def close(self) -> None:
        self._out.close()

    def _clean(self, payload: Mapping[str, Any]) -> Any:
        return _clip(self._redact(payload) if self._redact is not None else payload)

    def _write(self, line: str) -> None:
        with self._lock:
            self._out.write(line + "\n")
            self._out.flush()


def parse_line(line: str | bytes) -> ControlLine | None:
    """A control line, or None for anything that is not exactly one (logged by the caller)."""
    if isinstance(line, bytes):
        try:
            line = line.decode("ascii")
        except UnicodeDecodeError:
            return None
    line = line.rstrip("\r\n")
    if len(line) > MAX_LINE:
        return None
    if line == READY:
        return ControlLine("ready", {})
    head, sep, body = line.partition(" ")
    kinds: dict[str, Kind] = {RESPONSE: "response", EVENT: "event"}
    if not sep or head not in kinds:
        return None
    try:
        payload = json.loads(body)
    except ValueError:
        return None
    if not isinstance(payload, dict):
        return None
    field = "id" if head == RESPONSE else "type"
    if not isinstance(payload.get(field), str):
        return None
    return ControlLine(kinds[head], payload)


async def read_lines(stream: asyncio.StreamReader) -> AsyncIterator[ControlLine | bytes]:
    """The supervisor's view of the child's stdout: control lines, and the raw bytes of any other
    line (to log, never to act on). Ends at EOF. Give the stream a limit above `MAX_LINE`."""
    while True:
        try:
            raw = await stream.readuntil(b"\n")
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                yield exc.partial
            return
        except asyncio.LimitOverrunError as exc:
            # Too long to be ours: the whole line is noise, and so is its tail (never re-parsed).
            head = await stream.readexactly(exc.consumed)
            await _skip_line(stream)
            yield head
            continue
        parsed = parse_line(raw)
        yield parsed if parsed is not None else raw


async def _skip_line(stream: asyncio.StreamReader) -> None:
    while True:
        try:
            await stream.readuntil(b"\n")
            return
        except asyncio.LimitOverrunError as exc:
            await stream.readexactly(exc.consumed)
        except asyncio.IncompleteReadError:
            return


@dataclass(frozen=True)
class Overlong:
    """A command line longer than COMMAND_MAX_LINE, skipped: its size and its id when readable."""

    size: int
    request_id: str | None


async def read_command(stream: asyncio.StreamReader) -> bytes | Overlong:
    """The child's next command line (b"" at EOF). A line longer than the stream's limit is read
    past, up to its newline, and comes back as `Overlong` (never an exception: one bad line must
    not end the child and every channel with it). Give the stream a limit of COMMAND_MAX_LINE."""
    try:
        return await stream.readuntil(b"\n")
    except asyncio.IncompleteReadError as exc:
        return bytes(exc.partial)
    except asyncio.LimitOverrunError as exc:
        head = await stream.readexactly(exc.consumed)
        match = _COMMAND_ID.match(head[:200])
        size = len(head)
        while True:
            try:
                size += len(await stream.readuntil(b"\n")) - 1
                break
            except asyncio.LimitOverrunError as more:
                size += len(await stream.readexactly(more.consumed))
            except asyncio.IncompleteReadError as end:
                size += len(end.partial)
                break
        return Overlong(size, match.group(1).decode("ascii") if match else None)


def _clip(value: Any) -> Any:
    """`value` with every string in it cut to MAX_FIELD_CHARS characters."""
    if isinstance(value, str):
        return value if len(value) <= MAX_FIELD_CHARS else value[: MAX_FIELD_CHARS - 1] + "…"
    if isinstance(value, Mapping):
        return {k: _clip(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clip(v) for v in value]
    return value


def _dump(payload: Mapping[str, Any]) -> str:
    return json.dumps(payload, ensure_ascii=True, separators=(",", ":"), allow_nan=False)
