"""crons.json never grows past the size it is read with (the first of the three cron faults of
tests/test_cron_fixes_s18.py, which has the rest and the helpers used here): a user's add through
the real CLI (a subprocess) on a file near 64 MiB is refused (exit != 0, the file unchanged), and the
`schedule` tool of a real `serve` reports a too long prompt and a full file as tool errors.

A file of its own so that these, each on a file of about 64 MiB, run on another worker than the
scheduler's full-file bookkeeping test (`make test` hands out whole files).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from appserver.fsutil import CRONS_MAX_BYTES
from cron.store import MAX_PROMPT_BYTES, user_limit
from tests.support.cli import cli_env, run_cli
from tests.test_cron_fixes_s18 import fill, ok


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "home"


@pytest.mark.parametrize(
    ("target", "said"),
    [
        (user_limit(12) - 50_000, "room kept for the scheduler"),  # would fit, but eat the scheduler's room
        (CRONS_MAX_BYTES - 60_000, "is read with"),  # a file already that large (an older appserver's)
    ],
)
def test_cli_add_that_would_pass_the_read_limit_is_refused_and_the_file_kept(
    home: Path, target: int, said: str
) -> None:
    """The tester's case: one more add of a long prompt on a file near 64 MiB. Before the fix it
    succeeded, and the next command (or the scheduler) set the file aside: every task stopped."""
    ok(home, "cron", "list")  # the home and its default agent
    before = fill(home, target)
    r = run_cli(home, "cron", "add", "--name", "one-more", "--agent", "assistant", "--every", "1h",
                "--prompt", "p" * 100_000)  # fmt: skip
    assert r.code == 1, (r.code, r.out)
    assert r.err.startswith("error: ") and "nothing was written" in r.err and said in r.err, r.err
    assert (home / "crons.json").read_bytes() == before
    # still readable: nothing set aside (the table, one row a task: `--json` would print the 64 MiB
    # of prompts for this test to parse again)
    listed = [row.split()[1] for row in ok(home, "cron", "list").out.splitlines()[1:]]  # NAME, after ID
    assert "one-more" not in listed and len(listed) == before.count(b'"id": "cron_'), listed
    assert list(home.glob("crons.json.corrupt-*")) == []


async def test_schedule_tool_reports_too_long_prompts_and_a_full_file_as_tool_errors(home: Path) -> None:
    from tests.support.serve import serving
    from tests.support.ws import WS

    env = cli_env(home)
    assert run_cli(home, "agents", "list", env=env).code == 0
    before = fill(home, user_limit(12) - 1000)

    async def call(ws: WS, args: dict[str, Any]) -> str:
        frame = {"type": "submit_input", "agent": "assistant", "conversation": "new",
                 "input": f"/call schedule {json.dumps(args)}"}  # fmt: skip
        ack = await ws.request(frame, 30)
        assert ack["type"] == "ack", ack
        snap = await ws.terminal(ack["turn_id"], 60)
        assert snap["status"] == "completed", snap
        return str(snap["blocks"][-1]["text"])

    with serving(home, env=env) as sp:
        ws = await WS.open(sp.url, open_timeout=30)
        try:
            text = await call(ws, {"action": "create", "name": "huge", "prompt": "q" * (MAX_PROMPT_BYTES + 1),
                                   "in": "2h"})  # fmt: skip
            assert "failed" in text and "prompt too long" in text, text[:300]
            text = await call(ws, {"action": "create", "name": "full", "prompt": "q" * 5000, "in": "2h"})
            assert "failed" in text and "nothing was written" in text, text[:300]
        finally:
            await ws.close()
        now = (home / "crons.json").read_bytes()  # each task a line `{"id": …, "name": …`, as `fill` counts them
    assert now.count(b'"id": "cron_') == before.count(b'"id": "cron_')  # no task added
    assert b'"name": "huge"' not in now and b'"name": "full"' not in now
    assert list(home.glob("crons.json.corrupt-*")) == []
    assert len((home / "crons.json").read_bytes()) <= len(before) + 4096  # the lease record only
