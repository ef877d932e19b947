"""Session 30: a provider's API key quoted in an upstream's error never leaks in part where the
text is cut for a message.

The redactor matches whole secrets only, and the provider used to cut what the upstream said
(a text error body at 500 characters, a `Location` at 300, a JSON answer's `object` at 40) before
the agent loop redacted it: a key straddling the cut came out without its last characters, which
no redactor recognised (35 of 36 characters reached the client and the stored turn). Now an
error answer is redacted whole, with the provider's own secrets, before it is parsed or cut, and
every cut drops the word it falls in (appserver/providers/upstream.py `clip`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from appserver.runtime.kernel import SubmitRequest
from tests.fakes.openai_upstream import FakeOpenAI
from tests.support.kernel import open_server

pytestmark = pytest.mark.timeout(60)

KEY = "Qz7KeyValue0123456789ABCDEFGHIJKLmnop"  # no well-known shape: only its exact value is known
KEY_ENV = "S30I_UPSTREAM_KEY"


def _leaks(text: str) -> list[str]:
    """The prefixes of KEY (5 characters or more) found in `text`: any is a leak."""
    return [KEY[:n] for n in range(5, len(KEY) + 1) if KEY[:n] in text]


def _say_key(fake: FakeOpenAI, case: str, pad: int) -> None:
    """Queue an answer quoting the key where a cut falls inside it (`pad` characters before it)."""
    if case == "text body":
        fake.fail(401, "x" * pad + " invalid api key: " + KEY + " please check")
    elif case == "location":
        where = "http://127.0.0.1:9/login/" + "y" * pad + "/" + KEY  # in a path: no `key=` shape
        fake.script(b"", status=302, headers={"Location": where}, content_type="text/plain")
    else:  # a 200 JSON answer that is no completion, its `object` quoting the key
        said = json.dumps({"object": "z" * pad + " bad key " + KEY})
        fake.script(said, content_type="application/json")


@pytest.mark.parametrize(
    ("case", "pads"),
    [
        ("text body", (447, 470, 480, 490, 497)),  # cut at 500
        ("location", (230, 250, 260)),  # cut at 300
        ("object", (0, 10, 20)),  # cut at 40
    ],
)
async def test_a_key_cut_short_in_an_upstream_error_never_leaks_in_part(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str, pads: tuple[int, ...]
) -> None:
    monkeypatch.setenv(KEY_ENV, KEY)
    home = tmp_path / "home"
    with FakeOpenAI() as fake:
        toml = (
            f'[providers.up]\nkind = "openai"\nbase_url = "{fake.base_url}"\n'
            f'api_key_env = "{KEY_ENV}"\nmax_attempts = 1\n'
        )
        server = await open_server(home, toml)
        try:
            await server.agents.create("asker", "up:m")
            for pad in pads:
                _say_key(fake, case, pad)
                sub = await server.kernel.submit(SubmitRequest(agent="asker", input="hi", conversation="new"))
                snap = await sub.wait(20)
                assert snap.status == "failed" and snap.error is not None, snap
                said = json.dumps(snap.error)
                assert fake.requests[-1].headers["authorization"] == f"Bearer {KEY}"  # the key was sent
                assert not _leaks(said), (case, pad, said)
        finally:
            await server.close()
    stored = b"".join(p.read_bytes() for p in home.glob("appserver.db*"))
    assert not _leaks(stored.decode("utf-8", "replace")), case


def test_a_cut_keeps_whole_words_only() -> None:
    from appserver.providers.upstream import clip

    said = "invalid api key: " + KEY + " please check"
    for limit in range(1, len(said) + 1):
        cut = clip(said, limit)
        assert len(cut) <= limit and not _leaks(cut.replace(KEY, "")), (limit, cut)
        assert cut == said or cut.endswith("…"), (limit, cut)
    assert clip(said, len(said)) == said and clip("a" * 600, 500) == "…"
