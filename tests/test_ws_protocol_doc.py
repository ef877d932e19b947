"""docs/protocol.md cannot drift: every JSON example validates against the frame models, and every
frame type of the code has an example."""

from __future__ import annotations

import json
import re
from pathlib import Path

from appserver.ws import frames as F

DOC = Path(__file__).resolve().parent.parent / "docs" / "protocol.md"


def _examples() -> list[dict]:
    blocks = re.findall(r"```json\n(.*?)\n```", DOC.read_text("utf-8"), re.DOTALL)
    return [json.loads(b) for b in blocks]


def test_every_example_validates_and_every_frame_has_one() -> None:
    examples = _examples()
    assert examples
    client, server = set(), set()
    for ex in examples:
        kind = ex["type"]
        if kind in F.CLIENT_TYPES:
            F.client_frame.validate_python(ex)
            client.add(kind)
        else:
            assert kind in F.SERVER_TYPES, kind
            F.server_frame.validate_python(ex)
            server.add(kind)
    assert client == set(F.CLIENT_TYPES)
    assert server == set(F.SERVER_TYPES)
