"""Telegram formatting of hostile runs (plugins/telegram/format.py) and the split of such a reply
(gateway/split.py): a long run of backticks is shown whole, as CommonMark reads it (a run nothing
closes is literal), in parts of a fair size; and formatting any run of markup characters takes time
linear in its length, since the gateway formats on its event loop, several times per part."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from gateway.delivery import Outbox, ReplySink
from gateway.ratelimit import ChatRateLimiter
from gateway.split import split_message
from plugins.contract import Account, AdapterContext, Target
from plugins.telegram import TelegramAdapter, create_adapter, to_html
from tests.fakes.telegram_api import parse_html, utf16_len

# Formatting 50,000 characters takes well under a second now; the backtracking patterns took
# minutes (quadratic) to hours (cubic) on these texts. The mark fails such a run, never a slow machine.
BOUND = pytest.mark.timeout(8)
N = 50_000


async def _never_sleep(_: float) -> None:
    raise AssertionError("nothing is sent here")


def _adapter_and_sink() -> tuple[TelegramAdapter, ReplySink]:
    """The Telegram adapter and a reply sink over it: `_chunks` is the split the gateway runs, with the
    adapter's `format` and `measure` as its test of a part."""
    context = AdapterContext(None, None, Path("."), logging.getLogger("test.tgfmt"))  # type: ignore[arg-type]
    adapter = create_adapter(Account("telegram", "main", {}, {"token": "1:x"}), context)
    assert isinstance(adapter, TelegramAdapter)
    return adapter, ReplySink(Outbox(adapter, ChatRateLimiter(), _never_sleep), Target("1"))


def _shown_parts(reply: str) -> tuple[list[str], list[str], int]:
    """The parts the gateway makes of `reply`, what Telegram shows of each, and its limit."""
    adapter, sink = _adapter_and_sink()
    parts = sink._chunks(reply)
    return parts, [parse_html(adapter.format(part)) for part in parts], adapter.limits.max_length


@BOUND
@pytest.mark.parametrize(
    "reply",
    [
        "echo: " + "`" * 5_001,  # 3 messages showing 4, 4 and 2,007 characters
        "see: " + "`" * 4_500 + " end",  # 1,016 of 4,509 characters shown
        "echo: " + "`" * 4_092,
        "echo: " + "`" * N,
        "a `" + "`" * 9_000 + "` b",
    ],
)
def test_a_long_run_of_backticks_is_shown_whole_in_full_parts(reply: str) -> None:
    """No markup in these replies (no run is closed by one as long): Telegram shows every character,
    in order, each part within the limit, and every part but the last at least half full (the
    first was `echo` alone)."""
    parts, shown, limit = _shown_parts(reply)
    assert "".join(shown) == reply, [len(s) for s in shown]
    assert all(utf16_len(s) <= limit for s in shown)
    assert all(len(s) >= limit // 2 for s in shown[:-1]), [len(s) for s in shown]
    assert len(parts) == -(-len(reply) // limit)  # as few as the limit allows


@pytest.mark.parametrize(
    ("markdown", "html"),
    [
        ("`a``b`", "<code>a``b</code>"),  # a run of two does not close a run of one
        ("``a`b``", "<code>a`b</code>"),
        ("```` x ``", "```` x ``"),  # nothing closes either run: both are text
        ("x ``` y ` z", "x ``` y ` z"),
        ("`` a ` b ``", "<code>a ` b</code>"),  # one space stripped on each side
        ("``a`` and ```b```", "<code>a</code> and <code>b</code>"),
        ("`a` ``" + "`" * 30, "<code>a</code> " + "`" * 32),
        ("**`x`** `y", "<b><code>x</code></b> `y"),
        ("```py `x`\nno fence", "```py <code>x</code>\nno fence"),  # a backtick after it: no fence line
    ],
)
def test_code_spans_follow_commonmark(markdown: str, html: str) -> None:
    assert to_html(markdown) == html


def test_the_other_markup_is_as_it_was() -> None:
    """The linear scanners give what the patterns gave: pairs from the leftmost opener to the first
    closer of the same delimiter, links whose label runs to the first `]`, heading and fence lines."""
    cases = {
        "**a __b** c__": "<b>a __b</b> c__",
        "__a **b__ c**": "<b>a **b</b> c**",
        "*****": "<b>*</b>",
        "a *b* c *d": "a <i>b</i> c *d",
        "snake_case_name and _it_": "snake_case_name and <i>it</i>",
        "~~x~~ ~~ y~~": "<s>x</s> ~~ y~~",
        "[a [b](https://x.org/(p)q)": '<a href="https://x.org/(p)q">a [b</a>',
        "[[x]] [](https://x.org)": "[[x]] [](https://x.org)",
        "## Title ##": "<b>Title</b>",
        "# C#": "<b>C</b>",
        "```py extra\ncode\n```": '<pre><code class="language-py">code</code></pre>',
    }
    assert {md: to_html(md) for md in cases} == cases


HOSTILE = {
    "backticks": "a " + "`" * N,
    "stars": "*" * N,
    "underscores": "_" * N,
    "tildes": "a " + "~" * N,
    "pipes": "|" * N,
    "open brackets": "[" * N,
    "brackets then one close": "[" * N + "]",
    "nested brackets": "[" * (N // 2) + "]" * (N // 2),
    "links never closed": "[a](" * (N // 4),
    "urls never closed": "[a](http://x" + "(a)a" * (N // 4) + " x",
    "bold never closed": "**a " * (N // 4),
    "bold under never closed": "__a " * (N // 4),
    "italic never closed": "a *" * (N // 3),
    "italic under never closed": "a _" * (N // 3),
    "strike never closed": "~~a " * (N // 4),
    "heading of hashes": "# " + "#" * N + "x",
    "fence of spaces": "```" + " " * N + "`",
    "quoted stars": "> " + "*a " * (N // 3),
    "backtick runs of every length": "".join("`" * k + "x" for k in range(1, 316)),
}


@BOUND
@pytest.mark.parametrize("kind", list(HOSTILE))
def test_formatting_a_hostile_run_is_linear(kind: str) -> None:
    """50,000 characters of each kind are formatted (and split as the gateway does) well within the
    mark's bound, into HTML Telegram accepts; text that holds no markup is shown as it is."""
    text = HOSTILE[kind]
    shown = parse_html(to_html(text))
    if kind in ("backticks", "pipes", "open brackets", "brackets then one close", "nested brackets"):
        assert shown == text
    assert shown.strip()
    _, parts, limit = _shown_parts(text)  # each part formatted about a dozen times
    assert all(0 < utf16_len(part) <= limit for part in parts)
    if shown == text:  # no markup: every part shows its text (a space a part ends at is dropped)
        assert "".join(parts).replace(" ", "") == text.replace(" ", "")


@BOUND
@pytest.mark.parametrize("text", ["[" * N, "![" * (N // 2), "[a]" * (N // 3), "[x](" * (N // 4)])
def test_the_split_finds_links_in_linear_time(text: str) -> None:
    """The split keeps links whole, so it finds them first: a pattern tried at each `[` read the
    rest of the line from each (40,000 `[`: 11 s on the event loop). None of these is a link."""
    parts = split_message(text, 4_000)
    assert "".join(parts) == text and all(len(part) == 4_000 for part in parts[:-1])
