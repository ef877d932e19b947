"""Shortening text with "…" never cuts a character a person sees in two (plugins/graphemes.py
`shorten`, re-exported by plugins.contract): the failure reason of a turn (gateway/delivery.py), an
approval prompt's arguments (gateway/approvals.py) and a Slack section (plugins/slack)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.approvals import ARGS_HEAD, ARGS_SHOWN, ARGS_TAIL, Prompt
from gateway.delivery import visible_text
from gateway.split import is_grapheme_boundary
from plugins.contract import Target, shorten
from plugins.slack.adapter import SECTION_MAX, _prompt_blocks

FAMILY = "\U0001f468\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466"  # 👨‍👩‍👧‍👦, 7 code points
FLAG = "\U0001f1eb\U0001f1f7"  # 🇫🇷
THUMB = "\U0001f44d\U0001f3fd"  # 👍🏽
E_ACUTE = "e\u0301"  # é as e + combining acute
HANGUL = "\u1100\u1161\u11a8"  # 각 as jamo


def test_a_short_text_is_unchanged() -> None:
    assert shorten("hello", 5) == "hello"
    assert shorten("", 3) == ""


def test_a_long_text_ends_with_the_ellipsis_within_the_limit() -> None:
    assert shorten("abcdefghij", 5) == "abcd…"


@pytest.mark.parametrize("cluster", [FAMILY, FLAG, THUMB, E_ACUTE, HANGUL, "\r\n", "\ud83d\ude00"])
def test_a_cluster_across_the_cut_is_left_out_whole(cluster: str) -> None:
    for before in range(1, 10):
        text = "a" * before + cluster + "z" * 20
        for limit in range(before + 2, before + len(cluster) + 1):  # the cut would fall inside it
            out = shorten(text, limit)
            assert out == "a" * before + "…", (before, limit, out)
        assert shorten(text, before + len(cluster) + 1) == "a" * before + cluster + "…"


def test_a_single_cluster_longer_than_the_room_is_cut_since_the_limit_comes_first() -> None:
    out = shorten(FAMILY * 2, 4)
    assert len(out) == 4 and out.endswith("…")


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(["a", " ", E_ACUTE, FAMILY, FLAG, THUMB, HANGUL, "\u0301", "\u200d", "ß"])).map("".join),
    st.integers(min_value=1, max_value=40),
)
def test_the_cut_is_at_a_grapheme_boundary_and_within_the_limit(text: str, limit: int) -> None:
    out = shorten(text, limit)
    assert len(out) <= limit
    if out == text:
        return
    head = out[:-1]
    assert out.endswith("…") and text.startswith(head)
    if head:  # cut inside a cluster only when the first cluster alone is longer than the room
        first_boundary = next(k for k in range(1, len(text) + 1) if is_grapheme_boundary(text, k))
        assert is_grapheme_boundary(text, len(head)) or first_boundary > limit - 1


def test_a_failed_turns_reason_is_shortened_at_a_boundary() -> None:
    reason = "x" * 197 + FAMILY + " and more"
    line = visible_text({"status": "failed", "blocks": [], "error": {"message": reason}})
    assert line == "⚠ The turn failed: " + "x" * 197 + "…"


def test_an_approval_prompts_arguments_are_shortened_at_a_boundary() -> None:
    args = (
        '{"text": "' + "y" * (ARGS_HEAD - 11) + FLAG * 3 + "z" * ARGS_SHOWN + THUMB * 3 + "w" * (ARGS_TAIL - 6) + '"}'
    )
    prompt = Prompt("call_12345678", "conv", "turn", "slack:main", Target("C1"), "U1", "shell", args)
    shown = prompt.text().split("```")[1].strip("\n")
    head, tail = shown.split(" … ")
    assert args.startswith(head) and is_grapheme_boundary(args, len(head)) and len(head) <= ARGS_HEAD
    assert args.endswith(tail) and is_grapheme_boundary(args, len(args) - len(tail)) and len(tail) >= ARGS_TAIL
    assert f"({len(args) - len(head) - len(tail):,} of {len(args):,} characters not shown" in prompt.text()


def test_a_slack_section_is_shortened_at_a_boundary() -> None:
    text = "z" * (SECTION_MAX - 2) + THUMB + "tail"
    [section] = _prompt_blocks(text, None)
    shown = section["text"]["text"]
    assert shown == "z" * (SECTION_MAX - 2) + "…"
