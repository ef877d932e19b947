"""gateway/split.py: a long reply is not cut inside a Markdown link (`[l132](https://example.com/`
| `132)` was), and a text without whitespace does not start with a part that is just `echo:`.
Measured with the Slack plugin's own formatting, as the outbox does."""

from __future__ import annotations

import re
import time

import pytest

from gateway.split import split_message
from plugins.slack.adapter import MAX_LENGTH
from plugins.slack.format import to_mrkdwn

LINK = re.compile(r"\[[^\]\n]*\]\([^()\s]*\)")


def slack_fits(part: str) -> bool:
    return len(to_mrkdwn(part)) <= MAX_LENGTH


def _links_whole(text: str, parts: list[str]) -> None:
    for link in LINK.findall(text):
        assert any(link in part for part in parts), link
    for part in parts:
        assert part.count("[") == part.count("]") == part.count("(") == part.count(")"), part[-40:]


@pytest.mark.parametrize("sep", [",", "", ";"])
def test_links_without_spaces_are_not_cut_inside(sep: str) -> None:
    text = "echo: " + sep.join(f"[l{i}](https://example.com/{i})" for i in range(400))
    parts = split_message(text, MAX_LENGTH, slack_fits)
    assert len(parts) > 1
    assert "".join(parts) == text  # a hard cut drops nothing
    _links_whole(text, parts)
    assert all(len(p) >= MAX_LENGTH // 2 for p in parts[:-1])


def test_a_space_inside_a_links_text_is_not_a_cut() -> None:
    text = "echo: " + "".join(f"[see part {i} here](https://example.com/{i})" for i in range(300))
    parts = split_message(text, 500)
    _links_whole(text, parts)


def test_a_text_without_whitespace_does_not_start_with_a_tiny_part() -> None:
    text = "echo: " + "x" * 9000
    parts = split_message(text, MAX_LENGTH, slack_fits)
    assert parts[0].startswith("echo: x") and len(parts[0]) == MAX_LENGTH
    assert "".join(parts) == text


def test_a_link_longer_than_half_a_part_is_still_cut() -> None:
    """The limit comes first: a link too long to keep whole is cut like any long word."""
    text = "intro " + "[x](https://example.com/" + "a" * 900 + ")"
    parts = split_message(text, 500)
    assert all(len(p) <= 500 for p in parts) and "".join(parts).replace(" ", "") == text.replace(" ", "")


@pytest.mark.parametrize("unit", ["[x](https://e.example/a) word ", "abcdefg ", "a"])
def test_a_megabyte_line_is_split_in_linear_time(unit: str) -> None:
    """`_wrap` searched the whole rest of a line for links at every cut: a 1 MB line without line
    breaks took seconds (9 s with links), blocking the gateway's loop. Now links are found once.
    Judged by how the CPU time grows from 1/8 MB to 1 MB (linear: 8×; the old search: 64×), not by
    a wall-clock bound, which a loaded machine (CI) overran (1.55 s against 1.5)."""
    text = unit * (1_000_000 // len(unit))

    def cpu(text: str) -> tuple[float, list[str]]:
        started = time.process_time()
        parts = split_message(text, 2000)
        return time.process_time() - started, parts

    small = min(cpu(text[: len(text) // 8])[0] for _ in range(2))
    elapsed, parts = cpu(text)
    assert elapsed < max(small, 0.01) * 24, f"{elapsed:.2f} s of CPU for 1 MB, {small:.3f} s for 1/8 MB"
    assert all(len(p) <= 2000 for p in parts) and len(parts) >= 499
    assert "".join(parts).replace(" ", "") == text.replace(" ", "")
    _links_whole(text, parts)
