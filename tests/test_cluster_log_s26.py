"""A peer's request that fails because the database ended a session is one warning line: the
periodic pull makes up for it (a terminated backend logged a chained traceback at ERROR)."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from appserver.store.base import StoreUnavailable
from appserver.store.cluster import Cluster


async def test_a_request_cut_off_by_the_database_is_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    cluster = Cluster(store=object(), heartbeat_s=1.0, instance_timeout_s=5.0, address="")  # type: ignore[arg-type]

    async def failing(op: str, args: dict[str, Any]) -> dict[str, Any]:
        if op == "pull":
            raise StoreUnavailable("the database ended every connection of the read")
        raise RuntimeError("a bug")

    cluster._on_message = failing
    with caplog.at_level(logging.INFO, logger="appserver.cluster"):
        await cluster._incoming(json.dumps({"op": "pull", "from": "inst_other", "args": {}}))
    [record] = caplog.records
    assert record.levelno == logging.WARNING and record.exc_info is None
    assert "request pull from inst_other failed: the database ended every connection" in record.getMessage()

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="appserver.cluster"):
        await cluster._incoming(json.dumps({"op": "other", "from": "inst_other", "args": {}}))
    [record] = caplog.records
    assert record.levelno == logging.ERROR and record.exc_info is not None  # anything else: a traceback
