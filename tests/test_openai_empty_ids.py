"""An empty conversation id names no conversation (404, like an unknown id), in either form the
Responses API accepts; found by schemathesis generating `{"conversation": {"id": ""}}`."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.support.serve import serving


@pytest.mark.parametrize("conversation", ["", {"id": ""}])
def test_an_empty_conversation_id_is_not_found(tmp_path: Path, conversation: object) -> None:
    with serving(tmp_path / "home") as srv:
        r = httpx.post(
            srv.url + "/v1/responses",
            json={"model": "assistant", "input": "hi", "conversation": conversation},
            timeout=10,
        )
    assert r.status_code == 404, r.text
    assert r.json()["error"]["code"] == "conversation_not_found"
    assert r.json()["error"]["param"] == "conversation"
