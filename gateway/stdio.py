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
import os
import sys
import threading
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TextIO

READY = "GATEWAY_READY"
RESPONSE = "GATEWAY_RESPONSE"
EVENT = "GATEWAY_EVENT"
MAX_LINE = 1 << 20  # a control line longer than this is noise, not a message

Kind = Literal["ready", "response", "event"]


@dataclass(frozen=True)
class ControlLine:
    kind: Kind
    payload: dict[str, Any]


class ControlWriter:
    """Writes control lines to the one stream that reaches the supervisor. Thread-safe."""

    def __init__(self, stream: TextIO) -> None:
        self._out = stream
        self._lock = threading.Lock()

    @classmethod
    def take_stdout(cls) -> ControlWriter:
        """Keep the real stdout for control lines and send everything else written to it to
        stderr. Call once, before any plugin is imported."""
        sys.stdout.flush()
        private = os.dup(1)  # not inheritable: a subprocess never gets the control pipe
        os.dup2(2, 1)
        sys.stdout = sys.stderr
        return cls(os.fdopen(private, "w", encoding="ascii", buffering=1))

    def ready(self) -> None:
        self._write(READY)

    def response(self, request_id: str, payload: Mapping[str, Any]) -> None:
        self._write(f"{RESPONSE} {_dump({**payload, 'id': request_id})}")

    def event(self, event_type: str, payload: Mapping[str, Any]) -> None:
        self._write(f"{EVENT} {_dump({**payload, 'type': event_type})}")

    def close(self) -> None:
        self._out.close()

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


def _dump(payload: Mapping[str, Any]) -> str:
    return json.dumps(payload, ensure_ascii=True, separators=(",", ":"), allow_nan=False)
