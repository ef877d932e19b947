"""appserver/fastjson.py: orjson's speed, the standard library's answers where the two differ."""

from __future__ import annotations

import json
import math

import pytest

from appserver import fastjson


def std(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


@pytest.mark.parametrize(
    "value",
    [
        {"a": [1, 2.5, True, None, "é\u2028\x00\x1f"], "b": {}},
        {1: "int key", None: "none key"},  # orjson refuses keys that are not strings
        [2**70, -(2**70)],  # orjson refuses integers beyond 64 bits
        "lone \ud800 surrogate",  # orjson refuses it; the standard library writes it
        [1e16, 1e-7, 0.1],
    ],
)
def test_dumps_gives_what_json_dumps_gives(value: object) -> None:
    assert json.loads(fastjson.dumps(value)) == json.loads(std(value))
    if not isinstance(value, list) or not isinstance(value[0], float):
        assert fastjson.dumps(value) == std(value)


def test_nan_is_written_as_null_not_as_an_invalid_literal() -> None:
    assert fastjson.dumps([math.nan, math.inf]) == "[null,null]"


def test_dumps_default() -> None:
    class Odd:
        def __str__(self) -> str:
            return "odd"

    assert fastjson.dumps({"x": Odd()}, default=str) == '{"x":"odd"}'
    assert fastjson.dumps({1: Odd()}, default=str) == '{"1":"odd"}'  # the fallback keeps `default`


@pytest.mark.parametrize(
    "text",
    ['{"a":1,"a":2}', "NaN", '{"x":Infinity}', '"\\ud800"', "[1.5e400]", '{"n":18446744073709551615}'],
)
def test_loads_chunk_accepts_what_json_loads_accepts(text: str) -> None:
    got, want = fastjson.loads_chunk(text), json.loads(text)
    if isinstance(want, float) and math.isnan(want):
        assert math.isnan(got)
    else:
        assert got == want
    assert fastjson.loads_chunk(text.encode()) == got or isinstance(want, float)


@pytest.mark.parametrize("text", ["", "{", "[1,]", "nul"])
def test_loads_chunk_refuses_what_json_refuses(text: str) -> None:
    with pytest.raises(ValueError):
        fastjson.loads_chunk(text)


def test_stored_json_keeps_every_digit() -> None:
    """What the store writes it reads back exactly (loads_chunk would read this as a float)."""
    from appserver.store.rows import dump_json, load_json

    value = {"seed": 123456789012345678901234567890, "n": [2**64 + 1]}
    assert load_json(dump_json(value)) == value
