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


# Where the server's error codes are written: the WebSocket front end, what it calls (kernel
# errors, auth) and the guard in front of it. The client package and the CLI have codes of their own.
SERVER_SOURCES = ("ws", "auth", "security", "runtime", "store", "errors.py")
PROSE_CODE = (
    r"`error` `([a-z_]+)`",  # gets `error` `bad_frame`
    r"gets `([a-z_]+)`",
    r"`([a-z_]+)` error\b",  # an `invalid_frame` error
    r"`([a-z_]+)` otherwise",
    r"else `([a-z_]+)`",
    r'error: "([a-z_]+)"',
)


def _doc_codes() -> tuple[set[str], set[str]]:
    """The codes of the error-code table, and the codes the prose names (`gets X`, `an X error`…)."""
    text = DOC.read_text("utf-8")
    table = set(re.findall(r"^\| `([a-z_]+)` \|", text, re.MULTILINE))
    prose = {code for pattern in PROSE_CODE for code in re.findall(pattern, text)}
    return table, prose - set(F.CLIENT_TYPES) - set(F.SERVER_TYPES)  # "gets `tool_call_request`": a frame


def test_every_error_code_the_doc_names_is_in_its_table_and_sent_by_the_server() -> None:
    """The doc promised `invalid_frame` for an over-long title while the server sends `bad_frame`:
    a client that matched on the documented code never matched. A code named anywhere in the prose
    must be in the table, and every code of the table must be one the server's code can send."""
    table, prose = _doc_codes()
    assert len(table) >= 20, table  # the table was found
    assert prose, "no code named in the prose: the patterns no longer match the doc"
    assert prose <= table, f"named in docs/protocol.md but not in its error-code table: {sorted(prose - table)}"
    root = Path(__file__).resolve().parent.parent / "appserver"
    source = "\n".join(
        p.read_text("utf-8")
        for where in SERVER_SOURCES
        for p in ([root / where] if where.endswith(".py") else sorted((root / where).rglob("*.py")))
    )
    never_sent = sorted(code for code in table if f'"{code}"' not in source)
    assert not never_sent, f"in docs/protocol.md's error-code table, but the server never sends them: {never_sent}"
