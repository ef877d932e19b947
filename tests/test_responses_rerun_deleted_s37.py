"""A keyed repeat of a /v1/responses request whose cut-off turn it would re-run in place (session 37)
still answers for its `previous_response_id` as any request does: deleted since the attempt it
repeats, it is 404 `previous_response_not_found` (the re-run placement came first and ran the
input on the deleted response's context). Through a real `appserver serve` on the echo model."""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx
import pytest

from tests.support.serve import start_serve
from tests.test_idempotency_s37a import RESPONSES, SLOW, T, _leave_mid_reply, _rows

pytestmark = pytest.mark.timeout(120)


def test_a_repeat_whose_previous_response_was_deleted_is_404(tmp_path: Path) -> None:
    sp = start_serve(tmp_path / "home")
    try:
        first = httpx.post(f"{sp.url}{RESPONSES}", json={"model": "assistant", "input": "hello"}, timeout=T)
        assert first.status_code == 200, first.text
        rid = first.json()["id"]
        body = {"model": "assistant", "stream": True, "input": SLOW, "previous_response_id": rid}
        key = {"Idempotency-Key": f"k-{uuid.uuid4().hex}"}
        _leave_mid_reply(sp, RESPONSES, body, key)
        assert httpx.delete(f"{sp.url}{RESPONSES}/{rid}", timeout=T).status_code == 200
        turns = _rows(sp.home, "SELECT count(*) FROM turns")
        again = httpx.post(f"{sp.url}{RESPONSES}", json=body, headers=key, timeout=T)
        assert again.status_code == 404, again.text
        error = again.json()["error"]
        assert (error["code"], error["param"]) == ("previous_response_not_found", "previous_response_id"), error
        assert _rows(sp.home, "SELECT count(*) FROM turns") == turns  # nothing ran
    finally:
        sp.stop()
