"""Split inline `<think>…</think>` reasoning out of streamed text.

Local models (DeepSeek-R1, Qwen3 through Ollama, llama.cpp, vLLM without a reasoning parser) put
their reasoning inline in `content`. Deltas are cut anywhere, so a tag may arrive as `<th` + `ink>`:
the splitter holds back any suffix that could still become a tag and never shows it as text until it
is known not to be one.
"""

from __future__ import annotations

from appserver.providers.base import Reasoning, Text

OPEN_TAG = "<think>"
CLOSE_TAG = "</think>"


def _partial_suffix(buf: str, tag: str) -> int:
    """Length of the longest suffix of `buf` that is a proper prefix of `tag`."""
    for k in range(min(len(buf), len(tag) - 1), 0, -1):
        if tag.startswith(buf[-k:]):
            return k
    return 0


class ThinkSplitter:
    """Stateful: `feed(delta)` → Text/Reasoning chunks; `flush()` once at end of stream."""

    __slots__ = ("_open", "_close", "_inside", "_pending", "_strip_ws")

    def __init__(self, open_tag: str = OPEN_TAG, close_tag: str = CLOSE_TAG) -> None:
        self._open = open_tag
        self._close = close_tag
        self._inside = False
        self._pending = ""  # a held-back possible tag prefix
        # Models put blank lines after `</think>` (and after `<think>`); they are layout, not content.
        self._strip_ws = False

    @property
    def inside(self) -> bool:
        return self._inside

    def feed(self, delta: str) -> list[Text | Reasoning]:
        out: list[Text | Reasoning] = []
        if not self._pending and (self._close if self._inside else self._open)[0] not in delta:
            self._emit(out, delta)  # no tag and no start of one (the common delta): in one step
            return out
        buf = self._pending + delta
        self._pending = ""
        while buf:
            tag = self._close if self._inside else self._open
            i = buf.find(tag)
            if i >= 0:
                self._emit(out, buf[:i])
                self._inside = not self._inside
                self._strip_ws = True
                buf = buf[i + len(tag) :]
                continue
            k = _partial_suffix(buf, tag)
            self._emit(out, buf[: len(buf) - k])
            self._pending = buf[len(buf) - k :] if k else ""
            break
        return out

    def flush(self) -> list[Text | Reasoning]:
        """End of stream: a tag prefix that never completed was ordinary text after all."""
        out: list[Text | Reasoning] = []
        pending, self._pending = self._pending, ""
        self._emit(out, pending)
        return out

    def _emit(self, out: list[Text | Reasoning], text: str) -> None:
        if self._strip_ws:
            text = text.lstrip()
            if not text:
                return
            self._strip_ws = False
        if not text:
            return
        out.append(Reasoning(text) if self._inside else Text(text))
