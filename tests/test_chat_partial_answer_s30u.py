"""`appserver chat` asking of the second of two calls of one step, after the first was answered: the
line saying the first is approved (its block now shows it, docs/protocol.md) was printed after the
second prompt, leaving the cursor on a bare line under it. It goes above the prompt, which is drawn
again (chat.py `Chat.render`).

Real parts: `appserver serve`, a WebSocket client that starts the turn, `chat` on a pseudo-terminal."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, serving
from tests.support.ws import WS
from tests.test_chat_terminal import Pty

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeProcess, dict[str, str]]]:
    home: Path = tmp_path_factory.mktemp("s30u") / "home"
    env = cli_env(home)
    assert run_cli(home, "agents", "create", "--name", "careful", "--tool", "clock=ask", env=env).code == 0
    with serving(home, env=env) as sp:
        yield sp, env


async def _two_calls_waiting(url: str) -> str:
    ws = await WS.open(url)
    try:
        text = '/call clock {}\n/call clock {"tz": "UTC"}'
        ack = await ws.request({"type": "submit_input", "agent": "careful", "conversation": "new", "input": text})
        await ws.expect(lambda f: f["type"] == "turn_updated" and f["snapshot"]["status"] == "awaiting", timeout=30)
        return str(ack["conversation_id"])
    finally:
        await ws.close()


def test_an_answered_calls_line_goes_above_the_next_prompt(server: tuple[ServeProcess, dict[str, str]]) -> None:
    sp, env = server
    conv = asyncio.run(_two_calls_waiting(sp.url))
    chat = Pty([sys.executable, "-m", "appserver", "chat", "--agent", "careful", "--conversation", conv], env)
    try:
        chat.expect("approve? [y/N] ")
        chat.write("y\r")
        chat.expect('clock({"tz": "UTC"}) wants to run. approve? [y/N] ')
        chat.expect("approved]")
        chat.settle()
        screen = [line for line in chat.screen() if line.strip()]
        assert screen[-1].endswith('clock({"tz": "UTC"}) wants to run. approve? [y/N]'), screen
        assert any(line.endswith("clock({}) approved]") for line in screen[:-1]), screen
        chat.write("n\r")
        chat.expect("you> ", timeout=30)
        chat.write("/quit\r")
        assert chat.wait() == 0
    finally:
        chat.kill()
