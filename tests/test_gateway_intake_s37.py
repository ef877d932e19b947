"""A cluster gateway child whose server closed its stdin (stopping it) takes no message, even while
it still starts with the start envelope's word and has read no command yet (session 37: a SIGTERM
during a child's restart let the new child acknowledge webhook messages for ~0.2 s that nobody
answered). The gate reads the child's real stdin stream (gateway/main.py `_intake_gate`)."""

from __future__ import annotations

import asyncio
import time

from gateway.intake import IntakeGate
from gateway.main import _intake_gate


async def test_the_gate_closes_once_the_server_closes_the_childs_stdin() -> None:
    stdin = asyncio.StreamReader()
    gate = _intake_gate(time.monotonic() + 60, stdin)  # a word that holds a minute
    assert gate.is_open()
    stdin.feed_data(b'{"id": "1", "op": "ping"}\n')
    stdin.feed_eof()
    assert gate.is_open()  # a command still to read: not let go yet
    await stdin.readline()
    assert not gate.is_open()  # let go: closed though the word still holds
    gate.vouch(time.monotonic() + 60)
    assert not gate.is_open()


async def test_a_server_alone_on_its_store_keeps_the_gate_open() -> None:
    stdin = asyncio.StreamReader()
    gate = _intake_gate(None, stdin)
    stdin.feed_eof()
    assert isinstance(gate, IntakeGate) and gate.is_open()
