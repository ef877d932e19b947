"""Found by a re-attack of this session's channel changes, through a real `appserver serve`:

1. An approval answered on behalf of a person whose display name holds a NUL (or is very long)
   was refused whole (`bad_frame`: "on_behalf_of: must not contain a NUL character"), so that
   person could never answer from the chat. The name is now cleaned when it is recorded.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.support.cli import careful_home
from tests.support.serve import serving
from tests.support.ws import WS

pytestmark = pytest.mark.timeout(60)


def test_an_answer_on_behalf_of_an_odd_name_is_recorded_cleaned(tmp_path: Path) -> None:
    home = careful_home(tmp_path)

    async def main(url: str) -> list[str]:
        ws = await WS.open(url)
        decided: list[str] = []
        for name in ("Ann\x00Lee", "x" * 3000, "Bob\u202e\nLee"):
            ack = await ws.request(
                {"type": "submit_input", "agent": "careful", "conversation": "new", "input": "/call clock {}"}
            )
            assert ack["type"] == "ack", ack
            request = await ws.expect(lambda f: f["type"] == "approval_request", 20)
            answer = await ws.request(
                {
                    "type": "approval_response",
                    "conversation": ack["conversation_id"],
                    "decisions": [{"call_id": request["call_id"], "decision": "deny"}],
                    "on_behalf_of": name,
                }
            )
            assert answer["type"] == "ack" and answer["results"][0]["accepted"], answer
            snap = await ws.terminal(ack["turn_id"])
            decided.append(str(snap["blocks"][-2].get("output") or snap["blocks"][-1].get("text")))
        await ws.close()
        return decided

    with serving(home) as sp:
        decided = asyncio.run(main(sp.url))
    assert "by Ann Lee (via test)" in decided[0], decided[0]
    assert "x" * 100 + " (via test)" in decided[1] and "x" * 101 not in decided[1], decided[1][:300]
    assert "Bob Lee (via test)" in decided[2] and "\u202e" not in decided[2], decided[2]
