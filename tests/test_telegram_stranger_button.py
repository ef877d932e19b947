"""An approval button pressed by someone else (docs/channels.md, "Approvals in the chat": only the
sender who started the turn, or an admin, may answer; anyone else gets a short refusal), through a
real `appserver serve --channels telegram` with python-telegram-bot against the fake Bot API.

The press is answered before the gateway decides who may answer, so its answer is neutral (no
"Approving…" toast for a press that is then refused); a presser whom access does not let in at all
(a stranger under `dm_policy = "pairing"`) still hears the refusal in the chat, and the prompt stays
open for the person who may answer it."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fakes.telegram_api import FakeTelegram
from tests.support.cli import cli_env, run_cli
from tests.support.gateway import ChannelServer, channel_server, write_config

pytestmark = pytest.mark.timeout(120)

ALICE, MAL, GROUP = 555, 666, -100777
REFUSAL = "Only the person who started this, or an admin, can answer it."


@pytest.fixture(scope="module")
def tg() -> Iterator[FakeTelegram]:
    with FakeTelegram() as fake:
        yield fake


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, tg: FakeTelegram) -> Iterator[ChannelServer]:
    home: Path = tmp_path_factory.mktemp("tg-buttons") / "home"
    settings = {
        "api_url": tg.url,
        "poll_timeout": 1,
        "token_env": "TG_TOKEN",
        "dm_policy": "pairing",
        "group_policy": "open",
        "allow": [str(ALICE)],
        "default_agent": "careful",
    }
    write_config(home, {"telegram": {"main": settings}}, ["telegram"])
    created = run_cli(home, "agents", "create", "--name", "careful", "--tool", "clock=ask")
    assert created.code == 0, created.err
    with channel_server(home, "--channels", "telegram", env=cli_env(home, TG_TOKEN=tg.token)) as server:
        yield server


def test_a_strangers_press_is_refused_in_the_chat_and_its_answer_is_neutral(
    srv: ChannelServer, tg: FakeTelegram
) -> None:
    alice, mal = tg.user(ALICE, "Alice", "alice"), tg.user(MAL, "Mal", "mal")
    tg.inject(GROUP, "/call clock {}", kind="supergroup", sender=alice)
    prompt = tg.wait_for_text(GROUP, lambda t: t.startswith("🔐"), timeout=20)
    short = re.search(r"/approve (\w+)", prompt.text)
    assert short, prompt.text

    pressed = tg.press(GROUP, prompt.message_id, f"approve:{short.group(1)}", sender=mal)
    tg.wait_for_text(GROUP, lambda t: t == REFUSAL, timeout=15)
    answer = tg.callback_answer(pressed.callback_id or "")
    assert answer is not None and not answer.get("text"), answer  # the spinner stops; no "Approving…"
    again = tg.press(GROUP, prompt.message_id, f"deny:{short.group(1)}", sender=mal)  # pressing on: no flood
    time.sleep(1.5)
    assert tg.callback_answer(again.callback_id or "") is not None
    assert [m.text for m in tg.messages(GROUP)].count(REFUSAL) == 1
    assert "✅" not in tg.message(GROUP, prompt.message_id).text  # still open

    tg.press(GROUP, prompt.message_id, f"approve:{short.group(1)}", sender=alice)
    tg.wait_for_text(GROUP, lambda t: t.startswith("clock -> "), timeout=20)
    assert all(not c.params.get("text") for c in tg.calls("answerCallbackQuery"))
