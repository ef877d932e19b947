"""SSE decoding and `<think>` splitting must not depend on where the bytes/deltas were cut."""

from __future__ import annotations

import random

import pytest

from appserver.providers.base import Reasoning, Text
from appserver.providers.sse import SSEDecoder, SSEEvent
from appserver.providers.think import ThinkSplitter


def decode(pieces: list[bytes]) -> list[SSEEvent]:
    dec = SSEDecoder()
    out: list[SSEEvent] = []
    for p in pieces:
        out.extend(dec.feed(p))
    out.extend(dec.close())
    return out


BODY = (
    "\ufeff: keep-alive comment\r\n"
    "\r\n"
    "event: greeting\r\n"
    'data: {"text": "héllo wörld ✓ 🙂"}\r\n'
    "id: 7\r\n"
    "\r\n"
    "data: line one\n"
    "data:line two\n"
    "data\n"
    "\n"
    ": another comment\n"
    "retry: 1500\n"
    "data: 日本語のテキスト\r"
    "\r"
    "event: empty-is-not-dispatched\n"
    "\n"
    "data: last, no blank line"
).encode()

EXPECTED = [
    SSEEvent(data='{"text": "héllo wörld ✓ 🙂"}', event="greeting", id="7"),
    SSEEvent(data="line one\nline two\n", id="7"),
    SSEEvent(data="日本語のテキスト", id="7", retry=1500),
    SSEEvent(data="last, no blank line", id="7", retry=1500),
]


def test_sse_whole_body() -> None:
    assert decode([BODY]) == EXPECTED


def test_sse_every_two_way_split() -> None:
    # Covers cuts inside the BOM, inside multi-byte UTF-8 characters, between CR and LF and
    # inside `data:` field names.
    for i in range(len(BODY) + 1):
        assert decode([BODY[:i], BODY[i:]]) == EXPECTED, f"split at {i}"


def test_sse_one_byte_at_a_time() -> None:
    assert decode([BODY[i : i + 1] for i in range(len(BODY))]) == EXPECTED


def test_sse_random_multi_splits() -> None:
    rng = random.Random(1234)
    for _ in range(300):
        cuts = sorted(rng.sample(range(1, len(BODY)), rng.randint(2, 12)))
        pieces = [BODY[a:b] for a, b in zip([0, *cuts], [*cuts, len(BODY)], strict=True)]
        assert decode(pieces) == EXPECTED


def test_sse_cr_then_lf_in_next_chunk_is_one_terminator() -> None:
    assert decode([b"data: a\r", b"\ndata: b\r\n\r\n"]) == [SSEEvent(data="a\nb")]


def test_sse_lone_cr_at_end_of_stream() -> None:
    assert decode([b"data: x\r"]) == [SSEEvent(data="x")]


def test_sse_invalid_utf8_is_replaced_not_fatal() -> None:
    assert decode([b"data: \xff ok\n\n"]) == [SSEEvent(data="\ufffd ok")]


# ---------------------------------------------------------------- think splitter


def split_all(deltas: list[str]) -> list[Text | Reasoning]:
    sp = ThinkSplitter()
    out: list[Text | Reasoning] = []
    for d in deltas:
        out.extend(sp.feed(d))
    out.extend(sp.flush())
    return out


def coalesce(chunks: list[Text | Reasoning]) -> list[Text | Reasoning]:
    out: list[Text | Reasoning] = []
    for c in chunks:
        if out and type(out[-1]) is type(c):
            out[-1] = type(c)(out[-1].text + c.text)
        else:
            out.append(c)
    return out


def test_think_tags_split_across_deltas() -> None:
    got = split_all(["<th", "ink>pondering", " deeply</thi", "nk>The answer."])
    assert coalesce(got) == [Reasoning("pondering deeply"), Text("The answer.")]
    # A partial tag is never shown as text.
    assert not any(isinstance(c, Text) and "<" in c.text for c in got)


def test_think_blank_lines_after_tags_are_layout() -> None:
    assert coalesce(split_all(["<think>\n", "hmm\n</think>", "\n\n", "Hi"])) == [
        Reasoning("hmm\n"),
        Text("Hi"),
    ]


THINK_TEXT = "\n <think>a < b and </th is not a tag</think>\n\nresult: x<y </think> end, <think>not a tag</think>"
THINK_EXPECTED = [
    Reasoning("a < b and </th is not a tag"),
    Text("result: x<y </think> end, <think>not a tag</think>"),
]


def test_think_every_two_way_split() -> None:
    assert coalesce(split_all([THINK_TEXT])) == THINK_EXPECTED
    for i in range(len(THINK_TEXT) + 1):
        got = split_all([THINK_TEXT[:i], THINK_TEXT[i:]])
        assert coalesce(got) == THINK_EXPECTED, f"split at {i}"


def test_think_every_char_separately() -> None:
    got = split_all(list(THINK_TEXT))
    assert coalesce(got) == THINK_EXPECTED
    visible = "".join(c.text for c in got if isinstance(c, Text))
    assert "<thi" not in visible.split("x<y")[0]


@pytest.mark.parametrize(
    ("deltas", "expected"),
    [
        (["hello <th"], [Text("hello <th")]),
        (["hello <th", "inking"], [Text("hello <thinking")]),
        (["  <th"], [Text("  <th")]),  # never completes: flushed as text at the end
        (["<think>reason</thi"], [Reasoning("reason</thi")]),  # dangling close inside reasoning
        (["<thunk>x"], [Text("<thunk>x")]),
        (["a<", "b"], [Text("a<b")]),
        ([""], []),
        # once the answer has begun, a tag is text the model meant: it never hides the rest
        (
            ["Use a <think> tag like <think>x</think> in prompts."],
            [Text("Use a <think> tag like <think>x</think> in prompts.")],
        ),
        (["The answer.", "<think>", "more"], [Text("The answer.<think>more")]),
        (["<think>a</think>b", "<think>c</think>"], [Reasoning("a"), Text("b<think>c</think>")]),
    ],
)
def test_think_partial_tags(deltas: list[str], expected: list[Text | Reasoning]) -> None:
    assert coalesce(split_all(deltas)) == expected


def test_think_holds_back_only_possible_tag_prefixes() -> None:
    sp = ThinkSplitter()
    assert sp.feed("  <thi") == []  # the text may still open with a think block
    assert sp.feed("s is") == [Text("  <this is")]
    assert sp.feed(" <think>") == [Text(" <think>")]  # the answer began: nothing held back now


def test_text_held_at_the_start_goes_out_before_what_follows_it() -> None:
    """Whitespace or a tag prefix held back at the start is text once a tool call or a refusal
    follows: in order, before it (it came out after them)."""
    sp = ThinkSplitter()
    assert sp.feed("\n\n") == []
    assert sp.settle() == [Text("\n\n")]
    assert sp.feed("<think>x</think>") == [Text("<think>x</think>")]  # no block opens any more
    inside = ThinkSplitter()
    assert inside.feed("<think>why") == [Reasoning("why")]
    assert inside.settle() == []  # a call inside the reasoning: the block goes on
    assert inside.feed("</think>ok") == [Text("ok")]
