"""`Store.answered_http_idempotency` (DELETE /v1/responses/{id} finds the keys whose stored answer
would replay the deleted response) on both stores, with the contract test's fixtures."""

from __future__ import annotations

from appserver.store.records import HttpIdempotency
from tests.test_store_contract import AnyStore, backend, pg_url, store

__all__ = ["backend", "pg_url", "store"]  # the contract test's fixtures: both stores


async def test_answered_http_idempotency_lists_done_keys_of_a_conversation(store: AnyStore) -> None:
    for key in ("done-1", "done-2", "pending", "other"):
        assert await store.claim_http_idempotency(HttpIdempotency("scope", key, "hash")) is None
    await store.finish_http_idempotency("scope", "done-1", 200, "application/json", '{"id":"resp_1"}', "conv_1")
    await store.finish_http_idempotency("scope", "done-2", 200, "text/event-stream", "data: {}\n\n", "conv_1")
    await store.finish_http_idempotency("scope", "other", 200, "application/json", "{}", "conv_2")
    got = sorted(await store.answered_http_idempotency("conv_1"), key=lambda e: e.key)
    assert [(e.key, e.state, e.body) for e in got] == [
        ("done-1", "done", '{"id":"resp_1"}'),
        ("done-2", "done", "data: {}\n\n"),
    ]
    assert await store.answered_http_idempotency("conv_none") == []
