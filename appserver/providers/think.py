"""Split a leading inline `<think>…</think>` block of streamed text into reasoning.

Local models (DeepSeek-R1, Qwen3 through Ollama, llama.cpp, vLLM without a reasoning parser) put
their reasoning inline in `content`, before the answer. Only a block that opens the text (after
whitespace) is reasoning: once the answer has begun, a `<think>` in it is text the model meant
(a prompt-writing tip, code, a quote), never a toggle that would hide the rest of the answer.
Deltas are cut anywhere, so a tag may arrive as `<th` + `ink>`: the splitter holds back what could
still become the tag it looks for and never shows it as text until it is known not to be one.
"""

from __future__ import annotations

from typing import Literal

from appserver.providers.base import Reasoning, Text

OPEN_TAG = "<think>"
CLOSE_TAG = "</think>"

State = Literal["start", "inside", "answer"]


def _partial_suffix(buf: str, tag: str) -> int:
    """Length of the longest suffix of `buf` that is a proper prefix of `tag`."""
    for k in range(min(len(buf), len(tag) - 1), 0, -1):
        if tag.startswith(buf[-k:]):
            return k
    return 0


class ThinkSplitter:
    """Stateful: `feed(delta)` → Text/Reasoning chunks; `flush()` once at end of stream.

    `start`: only whitespace so far, a think block may open; `inside`: reasoning until the close
    tag; `answer`: everything is text."""

    __slots__ = ("_open", "_close", "_state", "_pending", "_strip_ws", "texted")

    def __init__(self, open_tag: str = OPEN_TAG, close_tag: str = CLOSE_TAG) -> None:
        self._open = open_tag
        self._close = close_tag
        self._state: State = "start"
        self._pending = ""  # held back: leading whitespace, or what may still become a tag
        # Models put blank lines after `</think>` (and after `<think>`); they are layout, not content.
        self._strip_ws = False
        self.texted = False  # some answer text came out (not only reasoning, nor only whitespace)

    @property
    def inside(self) -> bool:
        return self._state == "inside"

    def feed(self, delta: str) -> list[Text | Reasoning]:
        out: list[Text | Reasoning] = []
        if self._state == "answer":  # the common delta: in one step
            self._emit(out, delta)
            return out
        buf = self._pending + delta
        self._pending = ""
        if self._state == "start":
            lead = buf.lstrip()
            if not lead or (self._open.startswith(lead) and lead != self._open):
                self._pending = buf  # whitespace, or the opening tag still arriving
                return out
            if not lead.startswith(self._open):
                self._state = "answer"  # the answer begins with this text: no reasoning block
                self._emit(out, buf)
                return out
            self._state, self._strip_ws = "inside", True
            buf = lead[len(self._open) :]
        i = buf.find(self._close)
        if i >= 0:
            self._emit(out, buf[:i])
            self._state, self._strip_ws = "answer", True
            self._emit(out, buf[i + len(self._close) :])
            return out
        k = _partial_suffix(buf, self._close)
        self._emit(out, buf[: len(buf) - k])
        self._pending = buf[len(buf) - k :]
        return out

    def settle(self) -> list[Text | Reasoning]:
        """Something other than text follows (a tool call, a refusal): what was held back at the
        start (whitespace, a tag prefix) is text after all and goes out before it, in order; no
        think block can open any more. Inside a block nothing changes (reasoning goes on)."""
        if self._state != "start":
            return []
        out: list[Text | Reasoning] = []
        pending, self._pending = self._pending, ""
        self._state = "answer"
        self._emit(out, pending)
        return out

    def flush(self) -> list[Text | Reasoning]:
        """End of stream: what was held back was ordinary text (or reasoning) after all."""
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
        if self._state == "inside":
            out.append(Reasoning(text))
        else:
            self.texted = True
            out.append(Text(text))
