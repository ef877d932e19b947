"""What the approval prompt and the gateway's own lines show, through each platform's real
formatter (gateway/approvals.py, gateway/commands.py):

* bidi overrides and invisible characters in a tool's arguments or name are shown as escapes, so
  `ls \\u202e; rm -rf ~ #\\u202c` cannot display reversed as a harmless command;
* a name someone else chose (a chat display name, the server's `decided_by`) is shown literally,
  never as a link or bold in the bot's own message;
* `@bot /cmd` is this bot's command, `/cmd@otherbot` is not.
"""

from __future__ import annotations

import json
import re
import unicodedata

import pytest

from gateway.approvals import OUTCOME_LINES, Prompt, code_span
from gateway.commands import Command, for_another_bot, parse_command
from gateway.supervisor import _why
from plugins.contract import Target
from plugins.discord.format import to_discord
from plugins.slack.format import to_mrkdwn
from plugins.telegram.format import to_html

BIDI_AND_INVISIBLE = (
    "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u200e\u200f\u061c\u200c\u200d\u2060\u2064\ufeff\u00ad"
)


def prompt(arguments: str, name: str = "shell", decided: str | None = None) -> Prompt:
    p = Prompt("call_0123456789", "conv", "turn", "telegram:main", Target("1"), "7", name, arguments)
    p.decided = decided
    return p


def hidden(text: str) -> list[str]:
    """The format and control characters left in `text` (newlines aside), but the zero-width spaces
    the prompt itself puts between backticks."""
    return [f"U+{ord(c):04X}" for c in text if unicodedata.category(c) in ("Cf", "Cc") and c not in "\n\u200b"]


@pytest.mark.parametrize("render", [lambda t: t, to_html, to_mrkdwn, to_discord])
def test_bidi_controls_in_the_arguments_and_name_are_shown_as_escapes(render: object) -> None:
    args = json.dumps({"command": "ls /tmp \u202e; rm -rf ~ #\u202c"}, ensure_ascii=False)
    text = render(prompt(args, name="she\u202ell").text())  # type: ignore[operator]
    assert hidden(text) == [], hidden(text)
    assert "ls /tmp \\u202e; rm -rf ~ #\\u202c" in text and "she\\u202ell" in text


def test_every_invisible_character_is_escaped_and_a_models_zero_width_space_shows() -> None:
    text = prompt("{" + BIDI_AND_INVISIBLE + "\u200b``" + "}").text()
    assert hidden(text) == []
    for c in BIDI_AND_INVISIBLE:
        assert f"\\u{ord(c):04x}" in text
    body = text.split("```")[1]
    assert "\\u200b`\u200b`" in body  # the model's is visible; the one breaking the backticks is ours


@pytest.mark.parametrize(
    ("render", "forbidden"),
    [(to_html, ("<a ", "<b>")), (to_mrkdwn, ("<http",)), (to_discord, ())],
)
def test_a_name_in_a_decision_line_is_shown_literally(render: object, forbidden: tuple[str, ...]) -> None:
    name = "[Verify your account](http://evil.example/login) **URGENT** `x` \u202e"
    line = f"{OUTCOME_LINES['approved']} by {code_span(name)}"
    text = render(prompt("{}", decided=line).text())  # type: ignore[operator]
    for bad in forbidden:
        assert bad not in text, text
    tail = text.rsplit("\n", 1)[-1]
    assert "[Verify your account](http://evil.example/login) **URGENT** 'x' \\u202e" in tail, tail
    if render is not to_html:  # Slack and Discord render the text themselves: the name sits in one code span
        assert re.fullmatch(r"✅ Approved by `[^`]+`", tail), tail


def test_a_long_name_is_cut_and_an_empty_one_still_shows() -> None:
    assert code_span("a" * 500) == "`" + "a" * 100 + "…`"
    assert code_span(" \n ") == "`?`"


@pytest.mark.parametrize(
    ("text", "me", "expected"),
    [
        ("@mybot /approve ABC", "mybot", Command("approve", ("ABC",))),
        ("@MyBot   /cancel", "mybot", Command("cancel", ())),
        ("/cancel@mybot", "mybot", Command("cancel", ())),
        ("/status@MYBOT now", "mybot", Command("status", ("now",))),
        ("/cancel@otherbot", "mybot", None),
        ("/cancel@otherbot", None, None),
        ("@otherbot /cancel", "mybot", None),
        ("@mybotty /cancel", "mybot", None),
        ("/cancel", None, Command("cancel", ())),
        ("@mybot hello /cancel", "mybot", None),
        # a slash and a space is text for the agent: "/ help me…" is not /help
        ("/ help me write a poem", None, None),
        ("/\nstatus of the shed project", None, None),
        ("@mybot / new idea: a shed", "mybot", None),
    ],
)
def test_commands_are_this_bots_only(text: str, me: str | None, expected: Command | None) -> None:
    assert parse_command(text, me) == expected


def test_a_command_for_another_bot_is_recognised_as_such() -> None:
    assert for_another_bot("/cancel@otherbot", "mybot")
    assert for_another_bot("@mybot /approve@otherbot X", "mybot")
    assert not for_another_bot("/cancel@mybot", "mybot")
    assert not for_another_bot("/slow@otherbot 3", "mybot")  # not one of ours: text for the agent


def test_a_silent_ping_timeout_is_logged_as_a_timeout() -> None:
    assert _why(TimeoutError()) == "timeout"
    assert _why(RuntimeError("the child is gone")) == "the child is gone"
    assert _why(OSError()) == "OSError"
