"""A ``` inside a line of a fenced code block (`FENCE = "```"`, `echo "```" >> README.md`) is code,
not the block's end (outside finding, s33): the gateway's pre-pass (gateway/split.py
`fences_on_own_lines`, run by `Outbox.format` on every send and by `split_message`) took the first
run at least as long as the opener for a closer, even with text after it, and moved it to a line of
its own. The block ended there, the rest of the code was shown as prose, the agent's real closer
opened a new block and the prose after it was shown as code (in a split reply, to the last part).
Now a run closes a block in mid-line only at the end of its line (`print(x)````), and each
platform shows the inner run as code: Slack and Discord break it with a zero-width space (Discord
ends a block at the first ``` anywhere), Telegram's `<pre>` shows it as it is. Pure functions
through the real adapters' `format`, and one reply end to end through the real Slack path."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

import plugins.discord
import plugins.slack
import plugins.telegram
from gateway.delivery import Outbox, ReplySink
from gateway.ratelimit import ChatRateLimiter
from gateway.split import fences_on_own_lines, split_message
from plugins.contract import Account, AdapterContext, Target
from plugins.discord import to_discord
from plugins.slack import to_mrkdwn
from tests.fakes.slack_api import FakeSlack
from tests.support.cli import cli_env
from tests.support.gateway import ChannelServer, channel_server, write_config

ZWSP = "\u200b"
REPORTED = '```sh\necho "```" >> README.md\n```\nDone. **bold**'
BLOCK = '```python\nFENCE = "```"\ndef f(**kwargs):\n    return a*b*c\n```\n'


async def _never_sleep(_: float) -> None:
    raise AssertionError("nothing is sent here")


def _outbox(plugin: ModuleType, secrets: dict[str, str]) -> Outbox:
    context = AdapterContext(None, None, Path("."), logging.getLogger("test.split_s33c"))  # type: ignore[arg-type]
    adapter = plugin.create_adapter(Account(plugin.__name__.split(".")[-1], "main", {}, secrets), context)
    return Outbox(adapter, ChatRateLimiter(), _never_sleep)


SLACK = (plugins.slack, {"bot_token": "xoxb-1", "app_token": "xapp-1"})
DISCORD = (plugins.discord, {"token": "x"})
TELEGRAM = (plugins.telegram, {"token": "1:x"})


def _code_and_prose(text: str, sent: bool = True) -> tuple[list[str], list[str]]:
    """The lines inside ``` blocks and outside them. `sent`: Slack mrkdwn or Discord Markdown, read
    as the platforms do (Discord ends a block at the next ``` anywhere: none may be left in a line
    but a fence); else the gateway's Markdown, whose fences are lines of their own."""
    code: list[str] = []
    prose: list[str] = []
    inside = False
    for line in text.split("\n"):
        if re.fullmatch(r"```[\w+-]*", line):
            inside = not inside
        else:
            assert not sent or "```" not in line, f"a ``` in mid-line would open or close a block: {line!r}"
            (code if inside else prose).append(line)
    assert not inside, f"a block left open: {text!r}"
    return code, prose


@pytest.mark.parametrize(
    ("text", "moved"),
    [
        (REPORTED, REPORTED),  # the run has text after it: code
        ('```python\nFENCE = "```"\n```', '```python\nFENCE = "```"\n```'),
        ("```\nx ``` y ```` z\n```", "```\nx ``` y ```` z\n```"),  # runs with text after them, any length
        ("```\nprint(x)```\nprose", "```\nprint(x)\n```\nprose"),  # at the end of its line: it closes
        ("```\nprint(x)```  \t\nprose", "```\nprint(x)\n```\nprose"),  # whitespace after it is nothing
        ('```\nFENCE = "```" + x```\nprose', '```\nFENCE = "```" + x\n```\nprose'),  # only the last run closes
        ("````\nprint(x)```\n````", "````\nprint(x)```\n````"),  # shorter than the opener: code
        # An opener in mid-line as before; a later line's inner run does not count as its closer.
        ("Here: ```python\nprint(1)\n```", "Here: \n```python\nprint(1)\n```"),
        ('Here: ```python\nFENCE = "```"\n```', 'Here: \n```python\nFENCE = "```"\n```'),
        ('a ```py\nFENCE = "```"', 'a ```py\nFENCE = "```"'),  # nothing closes it: literal backticks
    ],
)
def test_a_run_closes_a_block_in_mid_line_only_at_the_end_of_its_line(text: str, moved: str) -> None:
    assert fences_on_own_lines(text) == moved


def test_slack_is_sent_what_its_formatter_makes_of_the_reply() -> None:
    """The reported reply: "Done." was in a code block and `**bold**` was not converted."""
    sent = _outbox(*SLACK).format(REPORTED)
    assert sent == to_mrkdwn(REPORTED) == f'```\necho "``{ZWSP}`" &gt;&gt; README.md\n```\nDone. *bold*'


@pytest.mark.parametrize(("platform", "bold"), [(SLACK, "*bold*"), (DISCORD, "**bold**")], ids=["slack", "discord"])
def test_slack_and_discord_show_the_line_as_code_and_the_prose_after_as_prose(
    platform: tuple[ModuleType, dict[str, str]], bold: str
) -> None:
    sent = _outbox(*platform).format("echo: " + BLOCK + "Done. **bold**")
    code, prose = _code_and_prose(sent)
    assert [line.replace(ZWSP, "") for line in code] == ['FENCE = "```"', "def f(**kwargs):", "    return a*b*c"]
    assert [line.strip() for line in prose if line.strip()] == ["echo:", f"Done. {bold}"]


def test_telegram_shows_the_line_in_its_pre_block_as_written() -> None:
    """Telegram's HTML reads no backticks in `<pre>`: escaping is all it takes."""
    sent = _outbox(*TELEGRAM).format(REPORTED)
    block = '<pre><code class="language-sh">echo &quot;```&quot; &gt;&gt; README.md</code></pre>'
    assert sent == f"{block}\nDone. <b>bold</b>"


def test_discord_breaks_every_run_in_a_block_and_writes_its_fences_as_three() -> None:
    """Discord ends a block at the first ``` after its opener, wherever it is, and knows no longer
    fence: a block of four backticks showing Markdown (the common way to quote a fence) ended at its
    inner ```py line."""
    text = "````md\n```py\nx = 1\n```\n````\nafter ``` it\n~~~\n``` in tildes\n~~~"
    out = to_discord(text)
    # (a tilde block's fences too: Discord knows none)
    assert out == f"```md\n``{ZWSP}`py\nx = 1\n``{ZWSP}`\n```\nafter ``` it\n```\n``{ZWSP}` in tildes\n```"
    after = "```py\nprint(1)\n```\n**a** ``` b"
    assert to_discord(after) == after  # a run after the block: as written


def test_a_split_reply_keeps_each_such_line_in_its_block_and_reopens_the_language() -> None:
    """In a split reply the blocks were closed at `FENCE = "` and prose and code stayed swapped to
    the last part, later openers showing as literal backticks (a zero-width space in them) inside code."""
    reply = "long\n" + "\n".join(f"Block {i}:\n" + BLOCK for i in range(70))
    parts = split_message(reply, 1000)
    assert len(parts) > 3
    for part in parts:
        code, prose = _code_and_prose(part, sent=False)
        assert all(line.startswith("Block ") or line in ("long", "") for line in prose), part
        assert all(line in ('FENCE = "```"', "def f(**kwargs):", "    return a*b*c") for line in code), part
    reopened = [p for p in parts if not p.startswith(("Block", "long"))]
    assert all(p.startswith("```python\n") for p in reopened), reopened  # cut inside a block: its language again
    slack = ReplySink(_outbox(*SLACK), Target("D1"))
    for part in slack._chunks(reply):
        code, prose = _code_and_prose(slack.outbox.format(part))
        assert all(line.startswith("Block ") or line in ("long", "") for line in prose), part
        assert f'FENCE = "``{ZWSP}`"' in code or not code


@pytest.fixture(scope="module")
def slack() -> Iterator[FakeSlack]:
    with FakeSlack(ack_timeout=1.0) as fake:
        yield fake


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, slack: FakeSlack) -> Iterator[ChannelServer]:
    home = tmp_path_factory.mktemp("slack_s33c") / "home"
    settings = {"api_url": slack.url, "bot_token_env": "SLACK_BOT", "app_token_env": "SLACK_APP",
                "dm_policy": "open", "default_agent": "assistant"}  # fmt: skip
    write_config(home, {"slack": {"main": settings}}, ["slack"])
    env = cli_env(home, SLACK_BOT=slack.bot_token, SLACK_APP=slack.app_token)
    with channel_server(home, "--channels", "slack", env=env) as server:
        yield server


@pytest.mark.timeout(90)
def test_slack_end_to_end_keeps_the_line_in_its_code_block(srv: ChannelServer, slack: FakeSlack) -> None:
    """A DM to the echo agent, through the real gateway child and slack_sdk, to the fake Slack."""
    slack.inject_dm("U1", REPORTED, channel="D-s33c")
    reply = slack.wait_for_text("D-s33c", lambda t: "README.md" in t and "Done." in t, timeout=30)
    assert reply.text == f'echo: \n```\necho "``{ZWSP}`" &gt;&gt; README.md\n```\nDone. *bold*', reply.text
