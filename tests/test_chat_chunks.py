"""The streamed chat chunk of a text delta: encoded around its text, byte for byte what encoding
the whole chunk writes (appserver/http/chat.py `_Ctx.chunk`)."""

from __future__ import annotations

import json

import pytest

from appserver.http.chat import _Ctx
from appserver.http.common import dumps

TEXTS = ["", "hello", 'quo"te', "back\\slash", "line\nbreak", "tab\t", "\u2028\u2029", "é中文😀", "\x00text\x00", "}]"]


def _ctx(model_id: str, include_usage: bool = False) -> _Ctx:
    ctx = object.__new__(_Ctx)  # only the fields chunk() reads: the constructor needs a whole request
    ctx.id, ctx.created, ctx.model_id, ctx._content_frame = "chatcmpl-abc", 1_700_000_000, model_id, None
    ctx.include_usage = include_usage
    return ctx


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("model_id", ["m", 'we"ird\u2028model'])
@pytest.mark.parametrize("text", TEXTS)
def test_a_text_delta_chunk_is_the_whole_chunk_encoded(model_id: str, text: str, include_usage: bool) -> None:
    ctx = _ctx(model_id, include_usage)
    body = {
        "id": "chatcmpl-abc",
        "object": "chat.completion.chunk",
        "created": 1_700_000_000,
        "model": model_id,
        "choices": [{"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}],
    }
    if include_usage:  # stream_options.include_usage: null on every chunk but the usage chunk (as OpenAI)
        body["usage"] = None
    whole = dumps(body)
    assert ctx.chunk({"content": text}) == whole
    assert ctx.chunk({"content": text}) == whole  # the second one from the cached frame
    assert json.loads(whole)["choices"][0]["delta"]["content"] == text
    assert "\n" not in whole and "\u2028" not in whole


def test_other_deltas_take_the_general_path() -> None:
    ctx = _ctx("m")
    for delta, finish in (({"role": "assistant", "content": ""}, None), ({}, "stop"), ({"content": "x"}, "stop")):
        got = json.loads(ctx.chunk(delta, finish))
        assert got["choices"][0]["delta"] == delta and got["choices"][0]["finish_reason"] == finish
