"""Slack and Discord formatting of hostile runs (plugins/slack/format.py, plugins/discord/format.py)
and the gateway's split of such a reply: formatting any run of markup characters takes time linear
in its length, since the gateway formats on its event loop, several times per part while it splits
(Slack's patterns backtracked: 4,000 backticks took a second, 8,000 eleven, a heading line of 4,000
spaces more than a minute); a run of backticks is read as CommonMark reads it (a run nothing closes
is literal) and shown whole; ordinary Markdown comes out as it did."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from gateway.delivery import Outbox, ReplySink
from gateway.ratelimit import ChatRateLimiter
from plugins.contract import Account, AdapterContext, Target
from plugins.discord import to_discord
from plugins.slack import MAX_LENGTH, SlackAdapter, create_adapter, to_mrkdwn

# Formatting 50,000 characters takes well under a second now; the backtracking patterns took
# minutes (quadratic) to hours (cubic) on these texts. The mark fails such a run, never a slow machine.
BOUND = pytest.mark.timeout(8)
N = 50_000


async def _never_sleep(_: float) -> None:
    raise AssertionError("nothing is sent here")


def _shown(mrkdwn: str) -> str:
    """What Slack shows of mrkdwn that holds no markup: its three entities decoded."""
    return mrkdwn.replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")


def _parts(reply: str) -> list[str]:
    """The parts the gateway makes of `reply` for Slack: `_chunks` is the split it runs, with the
    adapter's `format` as its test of a part."""
    context = AdapterContext(None, None, Path("."), logging.getLogger("test.slackfmt"))  # type: ignore[arg-type]
    adapter = create_adapter(Account("slack", "main", {}, {"bot_token": "xoxb-1", "app_token": "xapp-1"}), context)
    assert isinstance(adapter, SlackAdapter)
    return ReplySink(Outbox(adapter, ChatRateLimiter(), _never_sleep), Target("C1"))._chunks(reply)


# Texts with no markup Slack would render: each shows exactly as written.
LITERAL = {
    "backticks": "a " + "`" * N,
    "backtick runs of every length": "".join("`" * k + "x" for k in range(1, 316)),
    "fence of spaces": "```" + " " * N + "`",  # a backtick after the marker: no fence line
    "open brackets": "[" * N,
    "brackets then one close": "[" * N + "]",
    "nested brackets": "[" * (N // 2) + "]" * (N // 2),
    "images never closed": "![" * (N // 2),
    "links never closed": "[a](" * (N // 4),
    "urls never closed": "[a](http://x" + "(a)a" * (N // 4) + " x",
    "bold never closed": "**a " * (N // 4),
    "bold under never closed": "__a " * (N // 4),
    "italic never closed": "a *" * (N // 3),
    "strike never closed": "~~a " * (N // 4),
    "quoted stars": "> " + "*a " * (N // 3),
    "pipes": "|" * N,
    "less-thans": "<" * N,
    "ampersands": "&" * N,
    "mentions": "<@U1" * (N // 4),
    "channel pings": "<!here>" * (N // 7),
}
# Texts that hold markup: formatted as the markup says, in bounded time.
MARKED = {
    "stars": "*" * N,
    "underscores": "_" * N,
    "tildes": "a " + "~" * N,
    "heading of hashes": "# " + "#" * N + "x",
    "heading of spaces": "# a" + " " * N + "x",
    "heading of trailing hashes": "# a" + " #" * (N // 2),
    "bullet of stars": "- x" + " *a" * (N // 3),
    "code spans": "`a` " * (N // 4),
    "links": "[a](https://x.org) " * (N // 19),
}


@BOUND
@pytest.mark.parametrize("kind", list(LITERAL))
def test_a_hostile_run_without_markup_is_formatted_fast_and_shown_whole(kind: str) -> None:
    """Slack shows every character, and none of Slack's own controls (`<@…>`, `<!…>`) get through;
    Discord passes the text as it is."""
    text = LITERAL[kind]
    out = to_mrkdwn(text)
    assert _shown(out) == text
    assert "<" not in out and ">" not in out
    assert to_discord(text) == text


@BOUND
@pytest.mark.parametrize("kind", list(MARKED))
def test_a_hostile_run_with_markup_is_formatted_fast(kind: str) -> None:
    text = MARKED[kind]
    out = to_mrkdwn(text)
    assert out.strip() and len(out) <= 2 * len(text)
    assert to_discord(text) == text


@BOUND
def test_hostile_headings_and_bullets_keep_their_text() -> None:
    assert to_mrkdwn("# " + "#" * N + "x") == "*" + "#" * N + "x*"
    assert to_mrkdwn("# a" + " " * N + "x") == "*a" + " " * N + "x*"
    assert to_mrkdwn("# a" + " #" * (N // 2)) == "*a" + " #" * (N // 2 - 1) + "*"  # one closing run
    assert to_mrkdwn("- x" + " *a" * (N // 3)) == "• x" + " *a" * (N // 3)


@BOUND
@pytest.mark.parametrize("kind", ["backticks", "open brackets", "less-thans", "mentions", "bold never closed"])
def test_the_split_of_a_hostile_reply_is_fast_and_shows_it_whole(kind: str) -> None:
    """The gateway's split formats each part about a dozen times; every part fits and the parts show
    the text (a space a part ends at is dropped)."""
    text = LITERAL[kind]
    parts = _parts(text)
    assert all(0 < len(to_mrkdwn(part)) <= MAX_LENGTH for part in parts)
    assert "".join(_shown(to_mrkdwn(part)) for part in parts).replace(" ", "") == text.replace(" ", "")


@BOUND
@pytest.mark.parametrize(
    "reply",
    [
        "echo: " + "`" * 5_001,
        "see: " + "`" * 4_500 + " end",
        "echo: " + "`" * 4_092,
        "a `" + "`" * 9_000 + "` b",
    ],
)
def test_a_long_run_of_backticks_is_shown_whole(reply: str) -> None:
    """No run is closed by one as long: Slack shows every character, in order. The rest of a run the
    split cut is a part that reads like a fence line; it is shown as written, not as an empty block."""
    parts = _parts(reply)
    shown = [_shown(to_mrkdwn(part)) for part in parts]
    assert "".join(shown) == reply, [len(s) for s in shown]
    assert all(len(to_mrkdwn(part)) <= MAX_LENGTH for part in parts)


@pytest.mark.parametrize(
    ("markdown", "mrkdwn"),
    [
        ("`a``b`", "`a``b`"),  # a run of two does not close a run of one
        ("``a`b``", "`a`b`"),
        ("```` x ``", "```` x ``"),  # nothing closes either run: both are text
        ("x ``` y ` z", "x ``` y ` z"),
        ("`a` ``" + "`" * 30, "`a` " + "`" * 32),
        ("``a` **b**`", "``a` **b**`"),  # the single backticks pair: what is inside is code
        ("**`x`** `y", "*`x`* `y"),
        ("`<!here>` <!here>", "`&lt;!here&gt;` &lt;!here&gt;"),
        ("```py `x`\nno fence", "```py `x`\nno fence"),  # a backtick after the marker: no fence line
        ("```", "```"),  # only a fence line: shown as written, not as an empty block
        ("# ", "# "),  # nor an empty message
    ],
)
def test_code_spans_follow_commonmark(markdown: str, mrkdwn: str) -> None:
    assert to_mrkdwn(markdown) == mrkdwn


def test_the_other_markup_is_as_it_was() -> None:
    """The linear scanners give what the patterns gave: pairs from the leftmost opener to the first
    closer of the same delimiter, links whose label runs to the first `]`, heading and fence lines."""
    cases = {
        "**a __b** c__": "*a __b* c__",
        "__a **b__ c**": "*a **b* c**",
        "*****": "***",
        "***a***": "*_a*_",
        "*a **b** c*": "_a *b* c_",
        "a *b* c *d": "a _b_ c *d",
        "2*3*4 and *it*": "2*3*4 and _it_",
        "snake_case_name and _it_": "snake_case_name and _it_",
        "~~x~~ ~~ y~~": "~x~ ~~ y~~",
        "a ~~b~~ `~~c~~`": "a ~b~ `~~c~~`",
        "[a [b](https://x.org/(p)q)": "<https://x.org/(p)q|a [b>",
        "[[x]] [](https://x.org)": "[[x]] [](https://x.org)",
        "![img](http://x.org/i.png) and ![](http://y)": "<http://x.org/i.png|img> and ![](http://y)",
        "!![a](http://x)": "!<http://x|a>",
        "[`code` label](https://x.org)": "<https://x.org|`code` label>",
        "## Title ##": "*Title*",
        "# C#": "*C*",
        "#  **Bold** title  #  ": "*Bold title*",
        "####### seven": "####### seven",
        "- **a** and `b`": "• *a* and `b`",
        "```py\ncode < 1\n```": "```\ncode &lt; 1\n```",
        "x\n```\nopen": "x\n```\nopen\n```",
        "x <@U1> & <!here>": "x &lt;@U1&gt; &amp; &lt;!here&gt;",
    }
    assert {md: to_mrkdwn(md) for md in cases} == cases


@pytest.mark.timeout(8)
@pytest.mark.parametrize("hostile", ["<http://" * 50_000, "<@U1|" * 50_000, "<mailto:a|" * 50_000])
def test_inbound_links_and_mentions_are_found_in_linear_time(hostile: str) -> None:
    """An inbound text of raw `<http://` without a `>` (a bot's message) made each search run to
    the end again: 16,000 characters took a second, 50,000 ten."""
    from plugins.slack.adapter import _MENTION_RE, _SLACK_LINK_RE

    assert _SLACK_LINK_RE.sub("L", hostile) == hostile
    assert _MENTION_RE.findall(hostile) == []
    assert _SLACK_LINK_RE.sub("L", "a <https://x.y|label> b") == "a L b"
    assert _MENTION_RE.findall("hi <@U12|bob> and <@U34>") == ["U12", "U34"]
