"""The offline `echo` model's `/call NAME ARGS`: one call per line, a line ending at a newline only.
JSON arguments may hold U+2028, U+2029 or U+0085 raw inside a string; `str.splitlines` ended the
line there and the client got the arguments cut short (`{"s": "a`), not JSON."""

from __future__ import annotations

import json

import pytest

from appserver.providers.base import ChatMessage, ProviderRequest, ToolCallArgs, ToolCallStart
from appserver.providers.echo import EchoProvider


async def calls_of(text: str) -> list[tuple[str, str]]:
    request = ProviderRequest(model="echo", messages=[ChatMessage("user", text)])
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    async for chunk in EchoProvider().stream(request):
        if isinstance(chunk, ToolCallStart):
            names[chunk.index] = chunk.name
        elif isinstance(chunk, ToolCallArgs):
            args[chunk.index] = args.get(chunk.index, "") + chunk.delta
    return [(names[i], args.get(i, "")) for i in sorted(names)]


@pytest.mark.parametrize("separator", ["\u2028", "\u2029", "\u0085", "\x1c"])
async def test_a_call_whose_arguments_hold_a_unicode_line_break_is_whole(separator: str) -> None:
    arguments = json.dumps({"s": f"a{separator}b"}, ensure_ascii=False)
    [(name, got)] = await calls_of(f"/call f {arguments}")
    assert name == "f"
    assert json.loads(got) == {"s": f"a{separator}b"}


async def test_calls_on_their_own_lines_are_each_a_call() -> None:
    got = await calls_of('/call f {"x": 1}\r\n/call g {}\n/call h {"y": "\u2028"}')
    assert [name for name, _ in got] == ["f", "g", "h"]
    assert [json.loads(a) for _, a in got] == [{"x": 1}, {}, {"y": "\u2028"}]
