"""gateway/tool.py: what `message_channel` accepts from the model and what it refuses, with why."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.tool import NAME, SPEC, ToolCall, ToolRefusal, parse_call, target_name
from plugins.contract import Target

HERE = Target("chat1", "th1")


def call(arguments: Any, *, reply_to: str | None = "msg7") -> ToolCall:
    raw = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return parse_call(raw, channel="tg", account="main", here=HERE, reply_to=reply_to)


def refused(arguments: Any, match: str, *, reply_to: str | None = "msg7") -> None:
    with pytest.raises(ToolRefusal, match=match):
        call(arguments, reply_to=reply_to)


def test_spec_names_the_tool_and_its_actions() -> None:
    assert SPEC["name"] == NAME == "message_channel"
    assert SPEC["parameters"]["properties"]["action"]["enum"] == ["send", "reply", "react", "edit"]


def test_send_to_this_chat() -> None:
    c = call({"action": "send", "text": "hello"})
    assert c == ToolCall("send", "hello", HERE, None, None)


def test_send_to_another_chat_of_the_same_account() -> None:
    assert call({"action": "send", "text": "x", "target": "tg:main:other"}).target == Target("other")
    assert call({"action": "send", "text": "x", "target": "tg:main:other:t2"}).target == Target("other", "t2")
    assert call({"action": "send", "text": "x", "target": ""}).target == HERE


def test_reply_goes_to_the_message_answered() -> None:
    c = call({"action": "reply", "text": "yes"})
    assert c.target == Target("chat1", "th1", "msg7")
    assert c.message_id == "msg7"


def test_react_and_edit() -> None:
    c = call({"action": "react", "emoji": "👍"})
    assert (c.action, c.message_id, c.emoji, c.target) == ("react", "msg7", "👍", HERE)
    c = call({"action": "edit", "text": "fixed", "message_id": "m3"})
    assert (c.action, c.message_id, c.text, c.target) == ("edit", "m3", "fixed", HERE)


@pytest.mark.parametrize(
    ("arguments", "match"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ("null", "JSON object"),
        ("", "action must be one of"),
        ({"action": "delete"}, "action must be one of"),
        ({"action": ["send"]}, "action must be one of"),
        ({"text": "no action"}, "action must be one of"),
        ({"action": "send"}, "send needs a non-empty text"),
        ({"action": "send", "text": "   "}, "send needs a non-empty text"),
        ({"action": "send", "text": 5}, "send needs a non-empty text"),
        ({"action": "reply"}, "reply needs a non-empty text"),
        ({"action": "edit", "message_id": "m1"}, "edit needs a non-empty text"),
        ({"action": "edit", "text": "x"}, "edit needs the message_id"),
        ({"action": "edit", "text": "x", "message_id": 3}, "edit needs the message_id"),
        ({"action": "react"}, "react needs an emoji"),
        ({"action": "react", "emoji": " "}, "react needs an emoji"),
        ({"action": "reply", "text": "x", "target": "tg:main:other"}, "target applies only to send"),
        ({"action": "edit", "text": "x", "message_id": "m", "target": "tg:main:o"}, "target applies only to send"),
        ({"action": "send", "text": "x", "target": "tg:other:chat"}, "only send through tg:main"),
        ({"action": "send", "text": "x", "target": "slack:main:chat"}, "only send through tg:main"),
        ({"action": "send", "text": "x", "target": "tg:main"}, "target must be"),
        ({"action": "send", "text": "x", "target": "tg:main::t"}, "target must be"),
        ({"action": "send", "text": "x", "target": "tg:main:c:t:extra"}, "target must be"),
    ],
)
def test_refusals(arguments: Any, match: str) -> None:
    refused(arguments, match)


def test_reply_or_react_without_a_message_to_answer() -> None:
    refused({"action": "reply", "text": "x"}, "no message to reply to", reply_to=None)
    refused({"action": "react", "emoji": "👍"}, "no message to react to", reply_to=None)
    # A send does not need one.
    assert call({"action": "send", "text": "x"}, reply_to=None).target == HERE


def test_target_name() -> None:
    assert target_name("tg", "main", Target("c")) == "tg:main:c"
    assert target_name("tg", "main", Target("c", "t")) == "tg:main:c:t"
