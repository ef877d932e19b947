"""gateway/split.py: long replies split at the limit, on paragraphs then lines, fences kept whole."""

from __future__ import annotations

import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.split import split_message

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")


def open_fence_after(lines: list[str]) -> str | None:
    """The fence marker still open after these lines (None when balanced)."""
    marker: str | None = None
    for line in lines:
        m = FENCE.match(line)
        if not m:
            continue
        if marker is None:
            marker = m.group(1)
        elif m.group(1)[0] == marker[0] and len(m.group(1)) >= len(marker) and not m.group(2).strip():
            marker = None
    return marker


def content(text: str) -> str:
    """The text without fence lines and whitespace: what a split must keep, in order."""
    return "".join(re.sub(r"\s+", "", line) for line in text.split("\n") if not FENCE.match(line))


def check(text: str, limit: int) -> list[str]:
    parts = split_message(text, limit)
    assert parts, "a non-empty reply gives parts"
    for part in parts:
        assert 0 < len(part) <= limit
        assert part.strip()
        assert open_fence_after(part.split("\n")) is None, f"unbalanced fence in {part!r}"
    assert content("\n".join(parts)) == content(text)  # nothing lost, nothing added, order kept
    added = sum(1 for p in parts for line in p.split("\n") if FENCE.match(line))
    original = sum(1 for line in text.split("\n") if FENCE.match(line))
    # Only close/reopen pairs are added, and a close for a fence the reply left open at its end.
    unclosed = open_fence_after(text.split("\n")) is not None
    assert added >= original and (added - original - unclosed) % 2 == 0
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
def test_any_markdown_splits_within_the_limit(text: str, limit: int) -> None:
    if not text.strip():
        assert split_message(text, limit) == [] or len(text) <= limit
        return
    if len(text) <= limit:
        assert split_message(text, limit) == [text]
        return
    check(text, limit)
