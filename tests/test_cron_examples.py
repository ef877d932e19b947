"""examples/cron/README.md stays runnable: every `appserver` command in its sh blocks runs against a
fresh home, and the tasks come out as the text describes."""

from __future__ import annotations

import json
import re
import shlex
from datetime import UTC, datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

from tests.support.cli import ROOT

README = ROOT / "examples" / "cron" / "README.md"


def commands() -> list[list[str]]:
    out = []
    for block in re.findall(r"```sh\n(.*?)\n```", README.read_text("utf-8"), re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip():
                out.append(shlex.split(line))
    return out


def test_every_example_command_runs_and_the_tasks_match_the_text(home: Path, cli) -> None:
    cmds = commands()
    assert len(cmds) >= 6 and all(c[0] == "appserver" for c in cmds), cmds
    added_at = datetime.now(UTC)
    for cmd in cmds:
        r = cli(*cmd[1:])
        assert r.code == 0, (cmd, r.err)

    tasks = {t["name"]: t for t in cli("cron", "list", "--json").json()}
    assert set(tasks) == {"morning-brief", "stretch"}
    brief, stretch = tasks["morning-brief"], tasks["stretch"]
    assert brief["schedule"]["tz"] == "Europe/Paris" and brief["misfire"] == "run_once"
    assert brief["conversation"] == "new"
    assert brief["occurrence"] == 1  # the `cron run` above

    paris = ZoneInfo("Europe/Paris")
    preview = cli("cron", "preview", "morning-brief", "--count", "5", "--json").json()
    times = [datetime.fromisoformat(x["scheduled_for"]).astimezone(paris) for x in preview]
    assert len(times) == 5
    assert all((t.hour, t.minute, t.weekday() < 5) == (7, 30, True) for t in times), times

    due = datetime.fromisoformat(stretch["next_fire_at"])
    assert timedelta(hours=2) <= due - added_at <= timedelta(hours=2, minutes=2), due
    assert stretch["conversation"] == "default"
    logs = json.loads(cli("cron", "logs", "morning-brief", "--json").out)
    assert [x["event"] for x in logs] == ["fired", "submitted", "outcome"]
    assert logs[-1]["status"] == "completed"
