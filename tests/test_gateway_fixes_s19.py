"""Gateway (and one cron) fixes from the nineteenth session's outside attacks.

* A gateway lock path the gateway cannot open (a directory in its place) is a `gateway_error`
  event naming it, not a traceback that ends the child and comes back at every restart.
* A line that is one Markdown link longer than a part is one long word: it is cut hard at the
  limit, never after a tiny head (`echo:` alone as a first chat message).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gateway.db import default_path
from gateway.main import lock_ledger
from gateway.split import split_message


class Control:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def event(self, kind: str, payload: dict[str, Any]) -> None:
        self.events.append((kind, payload))


async def test_a_lock_path_that_is_a_directory_is_a_clear_gateway_error(tmp_path: Path) -> None:
    lock = default_path(tmp_path).with_name("gateway.lock")
    lock.mkdir(parents=True)
    control = Control()
    assert await lock_ledger(tmp_path, control, wait_s=0.1) is None  # type: ignore[arg-type]
    [(kind, payload)] = control.events
    assert kind == "gateway_error", control.events
    assert "cannot open the gateway lock" in payload["message"] and str(lock) in payload["message"], payload
    assert lock.is_dir()  # left where it is for the operator


def test_a_link_longer_than_a_part_is_cut_hard_not_after_a_tiny_head() -> None:
    url = "https://example.com/" + "a" * 100
    text = "echo: [" + "link text " * 500 + "](" + url + ")"
    parts = split_message(text, 4000)
    assert len(parts[0]) == 4000 and parts[0].startswith("echo: [link text"), [len(p) for p in parts]
    assert "".join(parts) == text  # a hard cut drops nothing
    short = "echo: [short](https://x.y/" + "b" * 30 + ") " + "word " * 1000  # a short link: cut at a space
    assert all(len(p) <= 4000 for p in split_message(short, 4000))
    assert split_message(short, 4000)[0].startswith("echo: [short](")


def test_a_cron_timezone_name_too_long_is_refused_short() -> None:
    """`cron add --tz` and the schedule tool go through `get_zone`: a 5,000-character name is refused
    in one short line (was: quoted whole)."""
    import pytest

    from cron.schedule import ScheduleError, get_zone

    with pytest.raises(ScheduleError) as refused:
        get_zone("a" * 5000)
    assert "unknown timezone" in str(refused.value) and len(str(refused.value)) < 200, str(refused.value)
    assert get_zone("Europe/Paris").key == "Europe/Paris"


def test_a_fence_opened_mid_line_is_split_as_a_fence() -> None:
    """`Here it is: ```python` opens a code block on Discord, Slack and Telegram: a long reply
    cut inside it closes and reopens it in every part, and prose after its closer is never wrapped
    in a code block (was: the first part left it open, the code parts had no fences, and the
    closer was taken for an opener)."""
    code = "\n".join(f"x = {i}  # a line of code" for i in range(300))
    text = "echo: ```python\n" + code + "\n```\n\n" + "prose " * 500
    parts = split_message(text, 2000)
    assert all(len(p) <= 2000 for p in parts)
    coded = [p for p in parts if "x = " in p]
    assert len(coded) >= 3 and all(p.count("```") == 2 for p in coded), [p.count("```") for p in coded]
    assert all(p.rstrip().endswith("```") for p in coded)
    assert all("```python" in p for p in coded[1:])  # reopened with its language
    prose = [p for p in parts if "x = " not in p]
    assert prose and all("```" not in p for p in prose), prose
    inline = "say ```x``` then " + "word " * 1000  # a pair on one line is no fence
    assert all(p.count("```") in (0, 2) for p in split_message(inline, 2000))
