"""appserver/strictjson.py parses small inputs with orjson first: both paths give the same answers
and the same refusals (the standard path words every refusal)."""

from __future__ import annotations

import pytest

from appserver import strictjson

ACCEPTED = [
    (b'{"a": 9223372036854775807}', {"a": 2**63 - 1}),
    (b'{"a":-9223372036854775808}', {"a": -(2**63)}),
    (b'\xef\xbb\xbf{"a":1}', {"a": 1}),
    (b'{"a":"\\ud83d\\ude00"}', {"a": "\U0001f600"}),
    (b"[" * 64 + b"]" * 64, None),
    (b'{"a":1,"a":2}', {"a": 2}),
    (b'{"x":1.5e3,"y":-0}', {"x": 1500.0, "y": 0}),
]

REFUSED = [
    (b'{"a": 9223372036854775808}', "invalid_json"),
    (b'{"a": 18446744073709551616}', "invalid_json"),
    (b'{"a":"\\ud800"}', "invalid_unicode"),
    (b"[" * 65 + b"]" * 65, "json_too_deep"),
    (b'{"a":NaN}', "invalid_json"),
    (b'{"a":1e400}', "invalid_json"),
    (b'"\xff"', "invalid_json"),
    (b'{"a":', "invalid_json"),
]


@pytest.mark.parametrize(("raw", "want"), ACCEPTED)
def test_accepted_alike(raw: bytes, want: object) -> None:
    got = strictjson.loads(raw)
    if want is not None:
        assert got == want
    big = raw + b" " * (strictjson.FAST_MAX_BYTES + 1)  # too big for the fast path: the standard one
    assert strictjson.loads(big) == got


@pytest.mark.parametrize(("raw", "code"), REFUSED)
def test_refused_alike(raw: bytes, code: str) -> None:
    with pytest.raises(strictjson.JsonRejected) as fast:
        strictjson.loads(raw)
    with pytest.raises(strictjson.JsonRejected) as slow:
        strictjson.loads(raw + b" " * (strictjson.FAST_MAX_BYTES + 1))
    assert fast.value.code == slow.value.code == code
    assert str(fast.value).split(":")[0] == str(slow.value).split(":")[0]  # positions differ (the padding)
