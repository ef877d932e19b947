"""gateway/split.py: long replies split at the limit, on paragraphs then lines, fences kept whole."""

from __future__ import annotations

import logging
import random
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gateway.split import fences_on_own_lines, is_grapheme_boundary, split_message

# A fence line (CommonMark): no backtick in the info string after a backtick fence.
FENCE = re.compile(r"^ {0,3}(`{3,}(?=[^`]*$)|~{3,})(.*)$")


def open_fence_after(lines: list[str]) -> str | None:
    """The fence marker still open after these lines (None when balanced)."""
    opener = open_fence_line(lines)
    m = FENCE.match(opener) if opener is not None else None
    return m.group(1) if m else None


def open_fence_line(lines: list[str]) -> str | None:
    """The line that opened the fence still open after these lines (None when balanced)."""
    opener: str | None = None
    marker = ""
    for line in lines:
        m = FENCE.match(line)
        if not m:
            continue
        if opener is None:
            opener, marker = line, m.group(1)
        elif m.group(1)[0] == marker[0] and len(m.group(1)) >= len(marker) and not m.group(2).strip():
            opener = None
    return opener


def content(text: str) -> str:
    """The text without fence lines and whitespace: what a split must keep, in order."""
    return "".join(re.sub(r"\s+", "", line) for line in text.split("\n") if not FENCE.match(line))


def unmarked(text: str) -> str:
    """`text` without inline markup characters (the splitter closes and reopens spans at a cut)."""
    return re.sub(r"[`|*_~]", "", text)


def check(text: str, limit: int, fits: Callable[[str], bool] | None = None) -> list[str]:
    parts = split_message(text, limit, fits)
    # A fence in mid-line is moved to a line of its own first: only line breaks change, and only a
    # run of backticks that really opens (or closes) a code block becomes a fence line.
    moved = fences_on_own_lines(text)
    assert re.sub(r"\s+", "", moved) == re.sub(r"\s+", "", text)
    left_open = open_fence_line(moved.split("\n"))  # a fence a line of the text opens, or none
    assert left_open is None or left_open in text.split("\n"), f"literal backticks made an opener: {moved!r}"
    text = moved
    # A fence marker too long to close and reopen around code within the limit is not followed.
    followed = all(2 * len(m.group(1)) + 3 <= limit for m in map(FENCE.match, text.split("\n")) if m)
    assert parts, "a non-empty reply gives parts"
    for part in parts:
        assert 0 < len(part) <= limit
        assert fits is None or fits(part), f"a part the platform would refuse: {part!r}"
        assert part.strip()
        assert not followed or open_fence_after(part.split("\n")) is None, f"unbalanced fence in {part!r}"
    # nothing lost, nothing added but the markers that close and reopen a span across a cut, order kept
    assert unmarked(content("\n".join(parts))) == unmarked(content(text))
    added = sum(1 for p in parts for line in p.split("\n") if FENCE.match(line))
    original = sum(1 for line in text.split("\n") if FENCE.match(line))
    # Only close/reopen pairs are added, and a close for a fence the reply left open at its end.
    unclosed = open_fence_after(text.split("\n")) is not None
    assert added >= original and (not followed or (added - original - unclosed) % 2 == 0)
    return parts


def long_reply(seed: int = 7) -> str:
    rnd = random.Random(seed)
    words = "the gateway splits replies at paragraph and line boundaries never inside fences".split()
    blocks: list[str] = []
    while sum(len(b) + 2 for b in blocks) < 10_000:
        kind = rnd.random()
        if kind < 0.5:
            blocks.append(" ".join(rnd.choice(words) for _ in range(rnd.randint(5, 90))))
        elif kind < 0.8:
            lang = rnd.choice(["python", "", "sh"])
            body = "\n".join(
                f"    value_{i} = compute({i}, '{'x' * rnd.randint(0, 60)}')" for i in range(rnd.randint(3, 70))
            )
            blocks.append(f"```{lang}\n{body}\n```")
        else:
            blocks.append("\n".join(f"- item {i}: " + rnd.choice(words) * 3 for i in range(8)))
    return "\n\n".join(blocks)[:10_000].rsplit("\n", 1)[0] + "\n```\n"


@pytest.mark.parametrize("limit", [2000, 4096, 1000, 500])
def test_ten_thousand_characters_with_fences(limit: int) -> None:
    text = long_reply()
    assert len(text) >= 9_000 and text.count("```") >= 6
    parts = check(text, limit)
    assert len(parts) >= len(text) // limit
    # Parts are well filled: only the last may be short.
    assert all(len(p) >= limit // 3 for p in parts[:-1])


def test_prefers_paragraph_boundaries() -> None:
    paras = [f"p{i} " * 60 for i in range(6)]  # ~180-char paragraphs
    text = "\n\n".join(paras)
    parts = check(text, 450)
    assert parts == ["\n\n".join(paras[0:2]), "\n\n".join(paras[2:4]), "\n\n".join(paras[4:6])]


def test_then_line_boundaries() -> None:
    lines = [f"line {i:03d} " + "x" * 40 for i in range(40)]
    parts = check("\n".join(lines), 300)
    for part in parts:
        assert all(line in lines for line in part.split("\n"))


def test_fence_is_closed_and_reopened_with_its_info_string() -> None:
    code = "\n".join(f"print({i})" for i in range(100))
    text = f"Here:\n\n```python\n{code}\n```\n\nDone."
    parts = check(text, 200)
    assert len(parts) > 4
    for part in parts[1:-1]:
        assert part.startswith("```python\n") and part.endswith("\n```")
    assert parts[-1].endswith("Done.")
    tilde = check("~~~~\n" + code + "\n~~~~", 200)
    assert all(p.startswith("~~~~") and p.endswith("~~~~") for p in tilde)


def test_over_long_lines_are_cut_at_spaces_or_hard() -> None:
    words = " ".join(f"w{i}" for i in range(400))
    parts = check(words, 100)
    assert all(not p.startswith(" ") for p in parts)
    blob = "z" * 1000
    assert check(blob, 100) == ["z" * 100] * 10
    fenced = check("```\n" + blob + "\n```", 100)
    assert all(p.startswith("```\n") for p in fenced)


def test_short_and_empty() -> None:
    assert split_message("short", 100) == ["short"]
    assert split_message("", 100) == []
    assert split_message("\n\n  \n", 100) == []
    with pytest.raises(ValueError):
        split_message("x", 10)


@settings(max_examples=150, deadline=None)
@given(
    text=st.lists(
        st.one_of(
            st.sampled_from(["```", "```py", "~~~", "````", "", "  ```", "text line", "- a"]),
            st.text(alphabet="ab `~\n", max_size=120),
        ),
        max_size=80,
    ).map("\n".join),
    limit=st.integers(min_value=40, max_value=300),
)
@example(text="```\n```\n```\n```\n```\n```\n```\n```\n`` ``````", limit=40)
def test_any_markdown_splits_within_the_limit(text: str, limit: int) -> None:
    if not text.strip():
        assert split_message(text, limit) == [] or len(text) <= limit
        return
    if len(text) <= limit:
        assert split_message(text, limit) == [text]
        return
    check(text, limit)


# ---------------------------------------------------------------------------- grapheme clusters

FAMILY = "\U0001f468\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466"  # 👨‍👩‍👧‍👦, 7 code points
CLUSTERS = {
    "family (ZWJ)": FAMILY,
    "technologist, skin tone (ZWJ)": "\U0001f469\U0001f3fd\u200d\U0001f4bb",  # 👩🏽‍💻
    "rainbow flag (VS + ZWJ)": "\U0001f3f3\ufe0f\u200d\U0001f308",  # 🏳️‍🌈
    "thumbs up, skin tone": "\U0001f44d\U0001f3fd",  # 👍🏽
    "heart + VS16": "\u2764\ufe0f",  # ❤️
    "flag DE": "\U0001f1e9\U0001f1ea",  # 🇩🇪
    "flag FR": "\U0001f1eb\U0001f1f7",  # 🇫🇷
    "flag England (tags)": "\U0001f3f4\U000e0067\U000e0062\U000e0065\U000e006e\U000e0067\U000e007f",
    "e + combining acute": "e\u0301",
    "a + two marks": "a\u0308\u0304",
    "keycap": "1\ufe0f\u20e3",  # 1️⃣
    "Hangul L V T": "\u1100\u1161\u11a8",  # 각 as jamo
    "Hangul LV + T": "\uac00\u11a8",
    "Devanagari conjunct": "\u0915\u094d\u0937\u093f",  # क्षि
    "CJK": "\u6f22",  # 漢
    "CRLF": "\r\n",
}


def clusters(text: str) -> list[str]:
    cuts = [k for k in range(1, len(text)) if is_grapheme_boundary(text, k)]
    return [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize("name", sorted(CLUSTERS))
def test_each_sample_is_one_cluster(name: str) -> None:
    cluster = CLUSTERS[name]
    assert clusters(cluster) == [cluster]
    assert clusters(cluster * 3) == [cluster] * 3


def test_cluster_boundaries_between_characters() -> None:
    de, fr, jp = "\U0001f1e9\U0001f1ea", "\U0001f1eb\U0001f1f7", "\U0001f1ef\U0001f1f5"
    assert clusters(de + fr + jp) == [de, fr, jp]  # pairs, never the middle pair
    assert clusters(de + "\U0001f1eb") == [de, "\U0001f1eb"]  # an odd one out stands alone
    assert clusters("a\r\nb") == ["a", "\r\n", "b"]
    assert clusters("\r\r\n\n") == ["\r", "\r\n", "\n"]
    assert clusters("\u6f22\u5b57\u304b\u306a") == ["\u6f22", "\u5b57", "\u304b", "\u306a"]
    assert clusters("\ud55c\uad6d\uc5b4") == ["\ud55c", "\uad6d", "\uc5b4"]  # 한국어 precomposed
    assert clusters("\u0928\u092e\u0938\u094d\u0924\u0947") == ["\u0928", "\u092e", "\u0938\u094d\u0924\u0947"]  # नमस्ते
    assert clusters("ab\u200bcd") == ["a", "b", "\u200b", "c", "d"]  # a zero-width space is a control
    assert clusters("x\U0001f44d") == ["x", "\U0001f44d"]


@pytest.mark.parametrize("name", sorted(set(CLUSTERS) - {"CRLF"}))
@pytest.mark.parametrize("limit", [32, 33, 37, 100, 1990])
def test_a_long_line_without_spaces_is_cut_between_clusters(name: str, limit: int) -> None:
    cluster = CLUSTERS[name]
    text = cluster * (3 * limit // len(cluster) + 5)
    parts = split_message(text, limit)
    assert "".join(parts) == text  # a hard cut drops nothing
    for part in parts:
        assert 0 < len(part) <= limit
        assert len(part) % len(cluster) == 0 and part == cluster * (len(part) // len(cluster)), repr(part[:12])


def test_the_discord_family_reply_is_cut_between_families() -> None:
    text = FAMILY * 400
    parts = split_message(text, 1990)
    assert "".join(parts) == text and all(len(p) <= 1990 for p in parts)
    assert all(p.startswith(FAMILY) and p.endswith(FAMILY) for p in parts)


def test_a_fenced_line_of_emoji_is_cut_between_clusters() -> None:
    text = "```\n" + FAMILY * 300 + "\n```"
    parts = check(text, 200)
    for part in parts:
        body = part.removeprefix("```\n").removesuffix("\n```")
        assert body and body == FAMILY * (len(body) // len(FAMILY))


def test_a_space_carrying_a_mark_is_not_cut_at() -> None:
    text = "a" * 50 + " \u0301" + "b" * 80
    parts = split_message(text, 60)
    assert "".join(parts) == text
    assert not any(p.startswith("\u0301") for p in parts)


def test_a_cluster_longer_than_the_limit_is_cut_inside_it() -> None:
    text = "e" + "\u0301" * 500  # one pathological cluster: the limit comes first
    parts = split_message(text, 100)
    assert "".join(parts) == text and all(len(p) <= 100 for p in parts)


TOKENS = sorted({c for c in CLUSTERS.values() if c != "\r\n"} | {"a", "b", "x"}, key=len, reverse=True)
WHOLE = re.compile("(?:" + "|".join(re.escape(t) for t in TOKENS) + "| |\n)*")


@settings(max_examples=150, deadline=None)
@given(
    pieces=st.lists(
        st.one_of(
            st.sampled_from(TOKENS),
            st.sampled_from([" ", "\n", "\n\n", "\n```\n", "\n```py\n"]),
            st.lists(st.sampled_from(TOKENS), min_size=20, max_size=120).map("".join),
        ),
        max_size=60,
    ),
    limit=st.integers(min_value=32, max_value=300),
)
def test_any_text_of_clusters_splits_between_clusters(pieces: list[str], limit: int) -> None:
    text = "".join(pieces)
    if not text.strip() or len(text) <= limit:
        return
    parts = check(text, limit)
    for part in parts:
        body = "\n".join(line for line in part.split("\n") if not FENCE.match(line))
        assert WHOLE.fullmatch(body), f"a cluster was cut: {body!r}"


def test_an_indented_over_long_line_never_gives_an_empty_part() -> None:
    for text in ("  " + "z" * 100, " " * 40 + "z" * 100, "x\n  " + FAMILY * 30):
        parts = check(text, 32)
        assert all(p.strip() for p in parts), parts


# ------------------------------------------------------------------ a platform's own measure (Telegram)


def utf16(text: str) -> int:
    return len(text.encode("utf-16-le")) // 2


@settings(max_examples=150, deadline=None)
@given(
    pieces=st.lists(
        st.one_of(
            st.sampled_from(TOKENS),
            st.sampled_from([" ", "\n", "\n\n", "\n```\n", "\n```py\n"]),
            st.lists(st.sampled_from(TOKENS), min_size=20, max_size=120).map("".join),
        ),
        max_size=60,
    ),
    limit=st.integers(min_value=64, max_value=300),
)
def test_parts_measured_the_platforms_way_fit_and_keep_clusters_and_fences(pieces: list[str], limit: int) -> None:
    """With `fits` (here: UTF-16 units, as Telegram counts), every part passes it, clusters stay whole
    and fences balanced, and nothing is lost."""
    text = "".join(pieces)
    if not text.strip() or utf16(text) <= limit:
        return  # one part, as written
    parts = check(text, limit, lambda part: utf16(part) <= limit)
    for part in parts:
        body = "\n".join(line for line in part.split("\n") if not FENCE.match(line))
        assert WHOLE.fullmatch(body), f"a cluster was cut: {body!r}"
    assert split_message(text, limit, lambda part: True) == split_message(text, limit)


def test_emoji_heavy_telegram_replies_are_split_greedily_not_finer_and_finer() -> None:
    """1,000 lines of "😀😀😀 hello world" are 19,000 UTF-16 units: five Telegram messages, each as full as
    it can be (whole lines), not eight (each 4,000-character part cut again at 4/5 of its room)."""
    from gateway.delivery import Outbox, ReplySink
    from gateway.ratelimit import ChatRateLimiter
    from plugins.contract import Account, AdapterContext, Target
    from plugins.telegram import create_adapter

    context = AdapterContext(None, None, Path("."), logging.getLogger("test.split"))  # type: ignore[arg-type]
    adapter = create_adapter(Account("telegram", "main", {}, {"token": "1:x"}), context)
    sink = ReplySink(Outbox(adapter, ChatRateLimiter(), asyncio_sleep_never), Target("1"))
    limit = adapter.limits.max_length
    text = "😀😀😀 hello world\n" * 1000
    parts = sink._chunks(text)
    shown = [adapter.measure(adapter.format(p)) for p in parts]
    assert len(parts) == 5 and all(n <= limit for n in shown), shown
    assert all(n > limit - 19 for n in shown[:-1]), shown  # full but for less than one line
    assert "\n".join(parts) == text.rstrip("\n")
    fenced = "```\n" + "👨‍👩‍👧‍👦 x\n" * 900 + "```"  # 12,600 units shown: four messages
    parts = sink._chunks(fenced)
    assert len(parts) == 4 and all(adapter.measure(adapter.format(p)) <= limit for p in parts)
    assert all(p.startswith("```\n") and p.endswith("\n```") for p in parts)


async def asyncio_sleep_never(_: float) -> None:
    raise AssertionError("nothing is sent here")


def test_a_hard_cut_through_a_run_of_fence_characters_leaves_no_fence_open() -> None:
    """A line of 37 backticks in a fence, at limit 40: its hard cut left `````` ````` `````` alone
    in the next part, an opener nothing closed (found by the property test above)."""
    parts = check("```\n" + "`" * 37, 40)
    assert all(open_fence_after(p.split("\n")) is None for p in parts), parts


def test_backticks_in_mid_line_that_nothing_closes_stay_text() -> None:
    """Eight fences, then `` `` `````` ``: the run of six backticks, which no line after it closes,
    was moved to a line of its own as an opener, and the split closed it: an empty code block in
    place of the text (found by the property test above)."""
    text = "```\n" * 8 + "`` ``````"
    assert fences_on_own_lines(text) == text
    parts = check(text, 40)
    assert parts[-1] == "`` ``````", parts


@pytest.mark.parametrize(
    ("text", "moved"),
    [
        ("`` ``````", "`` ``````"),  # nothing closes it: literal backticks
        ("a ```` b\n```", "a ```` b\n```"),  # a shorter run does not close a longer one
        ("Here: ```python\nprint(1)\n```", "Here: \n```python\nprint(1)\n```"),
        ("```\nx = 1```\nprose", "```\nx = 1\n```\nprose"),
        ("say ```x``` ok", "say ```x``` ok"),  # a pair on one line is inline
        ("```x``` then ```py\ncode\n```", "```x``` then \n```py\ncode\n```"),  # ```x``` is no fence line
        ("````\nx ``` y\n````", "````\nx ``` y\n````"),  # a shorter run inside is code
        ("~~~\nsay ```py\n~~~", "~~~\nsay ```py\n~~~"),  # so is all inside a tilde fence
        ("a ```` b ``` c\n```", "a ```` b \n``` c\n```"),
        ("```\ncode``` ~~~\n```", "```\ncode``` ~~~\n```"),  # ` ~~~` on its own line would open a fence
    ],
)
def test_fences_in_mid_line_follow_commonmark_lengths(text: str, moved: str) -> None:
    assert fences_on_own_lines(text) == moved


def test_a_cut_never_makes_a_fence_line_of_prose() -> None:
    """A hard cut or a cut at a space left a rest of backticks (or ` ``` `) on a line of its own:
    an opener the part then closed, an empty code block in place of the text."""
    for text in ("aaaaaaaawordwordwordword" + "`" * 11, "aabb~~~   " + "`" * 23):
        parts = check(text, 32)
        assert "".join(parts) == text, parts  # a hard cut before the backticks: nothing dropped
        assert not any(FENCE.match(line) for part in parts for line in part.split("\n")), parts


def test_a_fence_too_long_to_reopen_in_a_part_is_cut_as_prose() -> None:
    """A fence of 20 backticks at limit 33: a part cannot hold its closer and reopener around any
    code, and a blank line inside it made parts of only the two, without end."""
    text = " " + "`" * 20 + " \n\n\n```` abb`   wordword ``````a``````bb a``a\n\n" + "`" * 11 + "abbaa"
    parts = split_message(text, 33)
    assert all(0 < len(p) <= 33 for p in parts)
    assert content("\n".join(parts)) == content(text)
