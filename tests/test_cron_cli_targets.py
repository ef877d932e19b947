"""What a cron task points at must exist, through the real CLI: `agents delete` disables the deleted
agent's tasks (kept, with the reason) instead of leaving them to fail at every fire, and `cron add`
refuses a conversation that does not exist or is another agent's, and a `--deliver` target whose
channel account is not configured (exit code 2, one line, nothing saved)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import CLIResult, cli_env, run_cli


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "home"


def ok(home: Path, *args: str, env: dict[str, str] | None = None) -> CLIResult:
    r = run_cli(home, *args, env=env)
    assert r.code == 0, (args, r.out, r.err)
    return r


def one_line_error(r: CLIResult, code: int) -> str:
    """The single `error: …` line of a refused command (never a traceback)."""
    assert r.code == code, (r.code, r.out, r.err)
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.err
    return lines[0]


def task(home: Path, ref: str) -> dict[str, Any]:
    return ok(home, "cron", "show", ref, "--json").json()


def stored_tasks(home: Path) -> list[dict[str, Any]]:
    path = home / "crons.json"
    return json.loads(path.read_text())["tasks"] if path.exists() else []


def conversation_of(home: Path, agent: str) -> str:
    return str(ok(home, "run", "--agent", agent, "--json", "hi").json()["conversation_id"])


# ---------------------------------------------------------------- agents delete


def test_deleting_an_agent_disables_its_tasks_and_says_which(home: Path) -> None:
    ok(home, "agents", "create", "--name", "doomed")
    dt = ok(home, "cron", "add", "--name", "dt", "--agent", "doomed", "--every", "2s", "--prompt", "hi", "--json")
    dt_id = dt.json()["id"]
    ok(home, "cron", "add", "--name", "later", "--agent", "doomed", "--in", "2h", "--prompt", "hi")
    ok(home, "cron", "add", "--name", "off", "--agent", "doomed", "--every", "1h", "--prompt", "hi")
    ok(home, "cron", "disable", "off")  # already disabled: left as it is, not named
    ok(home, "cron", "add", "--name", "mine", "--agent", "assistant", "--every", "1h", "--prompt", "hi")

    r = ok(home, "agents", "delete", "doomed")
    lines = r.out.strip().splitlines()
    assert lines[0].startswith("deleted doomed (agt_"), r.out
    assert lines[1].startswith("disabled 2 cron tasks of doomed: "), r.out
    assert f"dt ({dt_id})" in lines[1] and "later (cron_" in lines[1] and "off" not in lines[1], r.out
    assert len(lines) == 2 and r.err == "", (r.out, r.err)

    for name in ("dt", "later"):
        shown = task(home, name)
        assert shown["enabled"] is False and shown["state"] == "disabled", shown
        assert "doomed" in shown["last_error"] and "deleted" in shown["last_error"], shown
    assert task(home, "off")["last_error"] is None
    mine = task(home, "mine")
    assert mine["enabled"] is True and mine["state"] == "scheduled" and mine["last_error"] is None
    assert "was deleted" in ok(home, "cron", "show", "dt").out  # the plain view tells it too

    # an agent created again under the name is another agent: the old task stays off
    ok(home, "agents", "create", "--name", "doomed")
    assert task(home, "dt")["enabled"] is False


def test_delete_json_lists_the_disabled_tasks(home: Path) -> None:
    ok(home, "agents", "create", "--name", "doomed")
    tid = ok(home, "cron", "add", "--name", "dt", "--agent", "doomed", "--every", "1h", "--prompt", "p", "--json")
    out = ok(home, "agents", "delete", "doomed", "--json").json()  # stdout stays one JSON document
    assert out["name"] == "doomed"
    assert out["cron_tasks_disabled"] == [{"id": tid.json()["id"], "name": "dt"}]


def test_deleting_an_agent_without_tasks_or_crons_json(home: Path) -> None:
    ok(home, "agents", "create", "--name", "plain")
    assert not (home / "crons.json").exists()
    r = ok(home, "agents", "delete", "plain")
    assert r.out.strip().splitlines() == [r.out.strip()] and "cron" not in r.out + r.err, (r.out, r.err)
    assert not (home / "crons.json").exists()  # nothing to disable: no file written


def test_deleting_an_agent_with_an_unreadable_crons_json(home: Path) -> None:
    ok(home, "agents", "create", "--name", "doomed")
    (home / "crons.json").write_text("{not json")
    r = ok(home, "agents", "delete", "doomed")
    assert r.out.startswith("deleted doomed (agt_"), r.out
    warning = r.err.strip().splitlines()
    assert len(warning) == 1 and warning[0].startswith("warning: the cron tasks of doomed could not be checked")
    assert (home / "crons.json").read_text() == "{not json"  # left in place, not set aside
    assert not list(home.glob("crons.json.corrupt-*"))
    assert "doomed" not in ok(home, "agents", "list").out

    gone = run_cli(home, "agents", "delete", "doomed")  # the deletion's own exit code, unchanged
    assert gone.code == 2 and "doomed" in one_line_error(gone, 2)


# ---------------------------------------------------------------- cron add --conversation


def test_add_refuses_an_unknown_conversation(home: Path) -> None:
    r = run_cli(home, "cron", "add", "--name", "t", "--agent", "assistant", "--every", "1h",
                "--prompt", "p", "--conversation", "nosuchconv")  # fmt: skip
    assert "'nosuchconv'" in one_line_error(r, 2)
    assert stored_tasks(home) == []


def test_add_refuses_another_agents_conversation_and_takes_its_own(home: Path) -> None:
    ok(home, "agents", "create", "--name", "other")
    theirs = conversation_of(home, "other")
    r = run_cli(home, "cron", "add", "--name", "t", "--agent", "assistant", "--every", "1h",
                "--prompt", "p", "--conversation", theirs)  # fmt: skip
    line = one_line_error(r, 2)
    assert theirs in line and "other" in line and "assistant" in line, line
    assert stored_tasks(home) == []

    added = ok(home, "cron", "add", "--name", "t", "--agent", "other", "--every", "1h",
               "--prompt", "p", "--conversation", theirs, "--json")  # fmt: skip
    assert added.json()["conversation"] == theirs
    for keyword in ("default", "new"):  # the keywords need no conversation yet
        ok(home, "cron", "add", "--name", f"k-{keyword}", "--agent", "assistant", "--every", "1h",
           "--prompt", "p", "--conversation", keyword)  # fmt: skip
    assert sorted(t["name"] for t in stored_tasks(home)) == ["k-default", "k-new", "t"]


# ---------------------------------------------------------------- cron add --deliver


def test_add_refuses_a_delivery_account_that_is_not_configured(home: Path) -> None:
    r = run_cli(home, "cron", "add", "--name", "t", "--agent", "assistant", "--every", "1h",
                "--prompt", "p", "--deliver", "webhook:x:y")  # fmt: skip
    line = one_line_error(r, 2)
    assert "'webhook:x:y'" in line and "webhook:x" in line, line
    assert stored_tasks(home) == []

    env = cli_env(home, APPSERVER_CHANNELS__WEBHOOK__ACCOUNTS__MAIN__REPLY_URL="http://127.0.0.1:9/replies")
    r = run_cli(home, "cron", "add", "--name", "t", "--agent", "assistant", "--every", "1h",
                "--prompt", "p", "--deliver", "webhook:x:y", env=env)  # fmt: skip
    assert "webhook:main" in one_line_error(r, 2)  # names what is configured
    assert stored_tasks(home) == []


def test_add_takes_a_configured_account_and_notes_a_channel_not_enabled(home: Path) -> None:
    account = {"APPSERVER_CHANNELS__WEBHOOK__ACCOUNTS__MAIN__REPLY_URL": "http://127.0.0.1:9/replies"}
    r = ok(home, "cron", "add", "--name", "off", "--agent", "assistant", "--every", "1h",
           "--prompt", "p", "--deliver", "webhook:main:room:thread", env=cli_env(home, **account))  # fmt: skip
    assert "not enabled" in r.err and "appserver channels enable webhook" in r.err, r.err

    enabled = cli_env(home, APPSERVER_CHANNELS__ENABLED="webhook", **account)
    r = ok(home, "cron", "add", "--name", "on", "--agent", "assistant", "--every", "1h",
           "--prompt", "p", "--deliver", "webhook:main:room", env=enabled)  # fmt: skip
    assert "not enabled" not in r.err, r.err
    assert {t["name"]: t["deliver"] for t in stored_tasks(home)} == {
        "off": "webhook:main:room:thread",
        "on": "webhook:main:room",
    }


def test_a_task_whose_conversation_went_away_still_says_why_it_cannot_run(home: Path) -> None:
    """`cron add` no longer takes an unknown conversation, but one can still go away after (here:
    crons.json edited by hand): `cron run` then names the reason in one line, exit code 1."""
    ok(home, "cron", "add", "--name", "lost", "--agent", "assistant", "--every", "1h", "--prompt", "p")
    path = home / "crons.json"
    path.write_text(path.read_text().replace('"conversation": "new"', '"conversation": "conv_does_not_exist"'))
    assert task(home, "lost")["conversation"] == "conv_does_not_exist"
    r = run_cli(home, "cron", "run", "lost")
    assert r.code == 1 and "Traceback" not in r.err, (r.code, r.err)
    errors = [x for x in r.err.splitlines() if x.startswith("error:")]  # the runner also logs a warning
    assert len(errors) == 1, r.err
    line = errors[0]
    assert "run #1 of lost could not be submitted" in line and "conv_does_not_exist" in line, line
    assert "None" not in r.out + r.err, (r.out, r.err)  # never "None (turn None)"
    j = run_cli(home, "cron", "run", "lost", "--json")
    assert j.code == 1
    out = json.loads(j.out)
    assert out["turn_id"] is None and out["outcome"] is None and out["error"], out
