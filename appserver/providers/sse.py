"""Incremental Server-Sent Events decoder.

Upstreams and proxies split a stream wherever TCP and their buffers please: inside a `data:` line,
between CR and LF, inside a multi-byte UTF-8 character. The decoder therefore works on bytes, cuts
lines on the ASCII terminators (which never occur inside a UTF-8 sequence) and only decodes whole
lines, so no split position can change the result.
"""

from __future__ import annotations

import sys

from appserver.providers.base import ProviderError
from appserver.values import value

_BOM = b"\xef\xbb\xbf"
MAX_RETRY_DIGITS = 10  # a `retry:` of more digits (over 115 days in ms) is ignored, not int()'d


@value
class SSEEvent:
    """One dispatched event (WHATWG semantics: data lines joined with LF)."""

    data: str
    event: str = "message"
    id: str | None = None
    retry: int | None = None


class SSEDecoder:
    """Feed raw bytes with `feed()`, collect events; call `close()` at end of stream."""

    __slots__ = ("_buf", "_skip_lf", "_started", "_data", "_event", "_id", "_retry", "_has_data", "_max", "_size")

    def __init__(self, max_event_bytes: int | None = None) -> None:
        """`max_event_bytes`: a line, or an event's data lines together (field names included, line
        ends not), past this size is a protocol error (ProviderError), not a buffer that grows with
        whatever an upstream keeps sending. Checked on every line and event however the stream was
        split, finished or not; the data held for an event is bytes, about its size."""
        self._max = sys.maxsize if max_event_bytes is None else max_event_bytes
        self._size = 0  # bytes in the data lines of the current event
        self._buf = bytearray()
        self._skip_lf = False  # last line ended with CR: an LF starting the next chunk belongs to it
        self._started = False  # BOM check done
        self._data = bytearray()  # the current event's data lines, joined with LF, undecoded
        self._has_data = False
        self._event = ""
        self._id: str | None = None
        self._retry: int | None = None

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        """Consume `chunk` (any size, split anywhere) and return the events it completed."""
        if not chunk:
            return []
        if (
            not self._buf
            and self._started
            and not self._has_data
            and not self._skip_lf
            and chunk.startswith(b"data: ")
            and chunk.find(b"\n") == len(chunk) - 2
            and chunk.endswith(b"\n\n")
            and len(chunk) <= self._max
            and b"\r" not in chunk
        ):
            # A read that is exactly one usual event (`data: …` and a blank line) with nothing
            # pending, as a streamed token mostly arrives: what `_drain` makes of it, at once.
            ev = SSEEvent(
                chunk[6:-2].decode("utf-8", errors="replace"), self._event or "message", self._id, self._retry
            )
            self._event = ""
            return [ev]
        self._buf += chunk
        if not self._started:
            if len(self._buf) < len(_BOM) and _BOM.startswith(bytes(self._buf)):
                return []  # could still be a BOM: wait for more bytes
            if self._buf.startswith(_BOM):
                del self._buf[: len(_BOM)]
            self._started = True
        # What is pending (the event's data lines and the bytes not yet cut into lines) bounds any
        # event or line this read completes or leaves unfinished: within the limit, nothing to
        # measure (the usual read); past it, every one is measured.
        over = len(self._buf) + self._size > self._max
        events = self._drain(False, over)
        if over:
            # The unfinished line: too long on its own, or a data line taking the event past it.
            buf = self._buf
            if len(buf) > self._max or (buf.startswith(b"data:") and len(buf) + self._size > self._max):
                self._too_large()
        return events

    def _too_large(self) -> None:
        raise ProviderError("protocol", f"upstream sent an event larger than {self._max} bytes")

    def close(self) -> list[SSEEvent]:
        """End of stream: flush a last line and event even without the trailing blank line.

        The spec discards an unterminated event, but several upstreams end with `data: [DONE]` and
        no blank line; dropping it would lose information, so it is dispatched.
        """
        self._started = True
        events = self._drain(True, len(self._buf) + self._size > self._max)
        if self._buf:
            line = bytes(self._buf)
            self._buf.clear()
            ev = self._line(line)
            if ev is not None:
                events.append(ev)
        ev = self._dispatch()
        if ev is not None:
            events.append(ev)
        return events

    def _drain(self, final: bool, over: bool) -> list[SSEEvent]:
        """Cut the buffer into lines and handle them; `over`: what is pending is past the limit,
        so the events the fast path hands out are measured (`_line` measures the rest)."""
        events: list[SSEEvent] = []
        buf = self._buf
        if not self._skip_lf and b"\r" not in buf:  # LF-only lines (the usual stream): one split
            end = buf.rfind(b"\n")
            if end >= 0:
                lines = bytes(buf[:end]).split(b"\n")
                del buf[: end + 1]
                line = self._line
                i, n = 0, len(lines)
                while i < n:
                    raw = lines[i]
                    # The usual event, `data: …` then a blank line, with nothing pending: at once.
                    if i + 1 < n and not lines[i + 1] and not self._has_data and raw.startswith(b"data: "):
                        if over and len(raw) > self._max:
                            self._too_large()
                        events.append(
                            SSEEvent(
                                raw[6:].decode("utf-8", errors="replace"),
                                self._event or "message",
                                self._id,
                                self._retry,
                            )
                        )
                        self._event = ""
                        i += 2
                        continue
                    ev = line(raw)
                    if ev is not None:
                        events.append(ev)
                    i += 1
            return events
        pos = 0
        n = len(buf)
        if self._skip_lf and n:
            if buf[0] == 0x0A:
                pos = 1
            self._skip_lf = False
        lf = buf.find(b"\n", pos)
        cr = buf.find(b"\r", pos)
        while pos < n:
            # Re-scan only for a terminator already consumed (keeps long buffers linear).
            if 0 <= lf < pos:
                lf = buf.find(b"\n", pos)
            if 0 <= cr < pos:
                cr = buf.find(b"\r", pos)
            if lf < 0 and cr < 0:
                break
            if cr < 0 or (0 <= lf < cr):
                end, nxt = lf, lf + 1
            else:
                end = cr
                if cr + 1 < n:
                    nxt = cr + 2 if buf[cr + 1] == 0x0A else cr + 1
                else:
                    nxt = cr + 1
                    self._skip_lf = not final  # a CRLF may be split between two chunks
            ev = self._line(bytes(buf[pos:end]))
            if ev is not None:
                events.append(ev)
            pos = nxt
        del buf[:pos]
        return events

    def _line(self, raw: bytes) -> SSEEvent | None:
        if not raw:
            return self._dispatch()
        if raw.startswith(b"data"):
            if raw.startswith(b"data: "):  # the usual line
                data: bytes | None = raw[6:]
            elif raw.startswith(b"data:"):
                data = raw[5:]
            elif len(raw) == 4:  # `data` alone: an empty data line
                data = b""
            else:
                data = None  # another field whose name starts with "data"
            if data is not None:
                # Held as bytes, joined with LF (a str and a list slot per line cost ~60 bytes
                # for a 9-byte `data: xy`, so an event's memory was several times its size).
                self._size += len(raw)
                if self._size > self._max:
                    self._too_large()
                if self._has_data:
                    self._data += b"\n"
                self._data += data
                self._has_data = True
                return None
        if len(raw) > self._max:
            self._too_large()
        if raw.startswith(b":"):
            return None  # comment / keep-alive
        line = raw.decode("utf-8", errors="replace")
        name, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if name == "event":
            self._event = value
        elif name == "id":
            if "\0" not in value:
                self._id = value
        elif name == "retry":
            # advisory: ASCII digits (`isdigit` also takes `²`), and few enough for int() (5000 of them
            # raise), else ignored as the spec says for a value that is no integer
            if value.isascii() and value.isdigit() and len(value) <= MAX_RETRY_DIGITS:
                self._retry = int(value)
        return None

    def _dispatch(self) -> SSEEvent | None:
        if not self._has_data:
            self._event = ""
            return None
        ev = SSEEvent(
            # Decoded whole, it reads as line by line would: a line's broken UTF-8 ends at its LF.
            data=self._data.decode("utf-8", errors="replace"),
            event=self._event or "message",
            id=self._id,
            retry=self._retry,
        )
        self._data = bytearray()
        self._size = 0
        self._has_data = False
        self._event = ""
        return ev
