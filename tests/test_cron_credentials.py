"""Tasks the `schedule` tool makes for a credential live and die with it, and the tool is bounded.

A task made in a token's conversation carries the token's namespace. Once the token is revoked its
runs are skipped at fire time (a `missed` record and an error in the server log say why); the task
is kept, and a token re-created under the same name (a rotation) gets it back. The tool caps each
namespace at 100 tasks and a recurring task at once a minute, and it lists and cancels only the
tasks made in its caller's own namespace, never the operator's `cron add` tasks. Real token
stores, crons.json and run logs on disk; one real `serve --auth token` with WebSocket clients;
real CLI turns (`/call` on the echo model) for the unowned caller.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from appserver.auth import TokenStore, namespace_of
from cron.credentials import TokenCredentials
from cron.runlog import read_runs
from cron.schedule import ScheduleSpec
from cron.scheduler import Scheduler
from cron.store import UNOWNED_TOOL_NAMESPACE, CronStore, CronTask, Occurrence, make_task, utcnow
from tests.support.cli import CLIResult, cli_env, run_cli
from tests.support.serve import serving
from tests.support.wait import wait_for
from tests.support.ws import WS

pytestmark = pytest.mark.timeout(90)
T0 = datetime(2026, 1, 1, 0, 0, tzinfo=UTC)
T = 10.0


class FakeClock:
    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


def token_namespace(home: Path, name: str) -> str:
    """A fresh token's namespace, as a request made with it gets it."""
    tokens = TokenStore(home)
    _, plaintext = tokens.create(name=name)
    principal = tokens.verify(plaintext)
    assert principal is not None
    return namespace_of(principal)


async def test_a_revoked_tokens_task_is_skipped_loudly_and_comes_back_with_a_rotation(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    home = tmp_path / "home"
    ns = token_namespace(home, "mallory")
    store = CronStore(home)
    task = store.add(make_task(name="persist", agent="echo", schedule=ScheduleSpec("every", "1h", "UTC"),
                               prompt="p", now=T0, exact=True, namespace=ns))  # fmt: skip
    fired: list[int] = []

    async def fire(t: CronTask, occ: Occurrence) -> str:
        fired.append(occ.number)
        return f"turn_{occ.number}"

    clock = FakeClock(T0 + timedelta(hours=1, seconds=1))
    s = Scheduler(store, fire=fire, clock=clock, credentials=TokenCredentials(TokenStore(home), cache_s=0))
    await s.tick()
    assert fired == [1]  # alive: runs
    TokenStore(home).revoke("mallory")
    clock.now = T0 + timedelta(hours=2, seconds=1)
    with caplog.at_level("ERROR", logger="appserver.cron"):
        await s.tick()
    assert fired == [1]  # revoked: no turn in its name
    missed = [r for r in read_runs(store.runs_dir, task.id) if r["event"] == "missed"]
    assert len(missed) == 1 and "revoked" in missed[0]["reason"], missed
    assert "revoked" in caplog.text and task.id in caplog.text
    assert store.read().get(task.id) is not None  # kept, not deleted
    TokenStore(home).create(name="mallory")  # rotation: the same name, a new secret
    clock.now = T0 + timedelta(hours=3, seconds=1)
    await s.tick()
    assert fired == [1, 2]
    await s.close()


# ------------------------------------------------------------------ through a real server


async def _call(ws: WS, conversation: str, args: dict[str, Any]) -> tuple[str, str]:
    frame = {"type": "submit_input", "agent": "assistant", "conversation": conversation,
             "input": f"/call schedule {json.dumps(args)}"}  # fmt: skip
    ack = await ws.request(frame, T)
    assert ack["type"] == "ack", ack
    snap = await ws.terminal(ack["turn_id"], T)
    return ack["conversation_id"], snap["blocks"][-1]["text"]


async def test_token_revoke_stops_a_task_of_a_running_server(tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = cli_env(home)
    assert run_cli(home, "agents", "list", env=env).code == 0
    _, secret = TokenStore(home).create(name="mallory")
    with serving(home, "--auth", "token", env=env) as sp:
        ws = await WS.open(sp.url, headers={"Authorization": f"Bearer {secret}"}, open_timeout=T)
        try:
            _, text = await _call(ws, "new", {"action": "create", "name": "persist", "prompt": "M", "in": "4s"})
            assert "created task persist" in text, text
        finally:
            await ws.close()
        assert run_cli(home, "token", "revoke", "mallory", env=env).code == 0  # before `persist` is due
        task_id = json.loads((home / "crons.json").read_text())["tasks"][0]["id"]
        runs = home / "cron-runs" / f"{task_id}.jsonl"
        wait_for(lambda: runs.exists() and runs.read_text().strip() != "", 20, "the revoked token's run")
        events = [r["event"] for r in read_runs(home / "cron-runs", task_id)]
        assert events == ["missed"], events  # no turn was submitted in a revoked token's name
        wait_for(lambda: sp.proc.stderr.seen("run skipped"), 10, "the server log line")  # type: ignore[union-attr]
        by_hand = run_cli(home, "cron", "run", "persist", env=env)  # nor by hand: refused, no run used
        assert by_hand.code == 2 and "revoked" in by_hand.err, (by_hand.code, by_hand.out, by_hand.err)
        assert [r["event"] for r in read_runs(home / "cron-runs", task_id)] == ["missed"]
        listed = run_cli(home, "cron", "list", "--json", env=env)
        assert listed.code == 0, listed.err
        (persist,) = json.loads(listed.out)  # kept, with its owner shown
        assert persist["namespace"] == persist["owner"] and persist["namespace"].startswith("token:")
        assert persist["namespace"] in run_cli(home, "cron", "list", env=env).out  # the table names it too


async def test_the_tool_caps_a_namespace_and_a_recurring_interval(tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = cli_env(home)
    assert run_cli(home, "agents", "list", env=env).code == 0
    _, secret = TokenStore(home).create(name="alice")
    with serving(home, "--auth", "token", env=env) as sp:
        ws = await WS.open(sp.url, headers={"Authorization": f"Bearer {secret}"}, open_timeout=T)
        try:
            conv, text = await _call(ws, "new", {"action": "create", "name": "fast", "prompt": "x", "every": "30s"})
            assert "failed" in text and "once a minute" in text, text
            _, text = await _call(ws, conv, {"action": "create", "name": "t0", "prompt": "x", "every": "1m"})
            assert "created task t0" in text, text
            ns, agent = next(
                (t["namespace"], t["agent"]) for t in json.loads((home / "crons.json").read_text())["tasks"]
            )
            store = CronStore(home)  # fill the namespace up to the cap
            for i in range(1, 100):
                store.add(make_task(name=f"t{i}", agent=agent, schedule=ScheduleSpec("in", "2h", "UTC"), prompt="x",
                                    now=utcnow(), conversation=conv, namespace=ns))  # fmt: skip
            _, text = await _call(ws, conv, {"action": "create", "name": "one-more", "prompt": "x", "in": "2h"})
            assert "failed" in text and "(100)" in text, text
            assert len(json.loads((home / "crons.json").read_text())["tasks"]) == 100
        finally:
            await ws.close()


# ------------------------------------------------------------------ an unowned caller


def ok(home: Path, *args: str) -> CLIResult:
    r = run_cli(home, *args)
    assert r.code == 0, (args, r.out, r.err)
    return r


def tool(home: Path, args: dict[str, Any]) -> str:
    return str(ok(home, "run", "--json", f"/call schedule {json.dumps(args)}").json()["text"])


def test_the_tool_neither_lists_nor_cancels_the_operators_cli_tasks(tmp_path: Path) -> None:
    home = tmp_path / "home"
    ok(home, "cron", "add", "--name", "backup", "--agent", "assistant", "--every", "1h", "--prompt", "ops")
    assert "created task mine" in tool(home, {"action": "create", "name": "mine", "prompt": "p", "every": "1h"})
    listed = tool(home, {"action": "list"})
    assert "mine (" in listed and "backup" not in listed, listed
    text = tool(home, {"action": "cancel", "name": "backup"})
    assert "failed" in text and "no cron task 'backup'" in text, text
    owners = {t["name"]: t["owner"] for t in ok(home, "cron", "list", "--json").json()}
    assert owners == {"backup": "operator", "mine": UNOWNED_TOOL_NAMESPACE}
    assert "cancelled task mine" in tool(home, {"action": "cancel", "name": "mine"})


async def test_a_task_of_an_older_token_named_gateway_stays_live(tmp_path: Path) -> None:
    """A token named `gateway` made by an older appserver authenticates into a namespace of its own
    (`TokenRecord.subject`): the credential check of its cron tasks reads the same namespace, not
    the one its name alone would give (was: its tasks were skipped as revoked)."""
    from appserver.auth import namespace_of
    from tests.test_security_fixes_s18 import add_token_as_an_older_appserver_did

    home = tmp_path / "home"
    TokenStore(home)  # the file exists, as after any `token create`
    plaintext = add_token_as_an_older_appserver_did(home, "gateway", ["openai", "ws"], None)
    principal = TokenStore(home).verify(plaintext)
    assert principal is not None
    ns = namespace_of(principal)
    assert ns != "token:gateway", ns  # not the gateway's namespace
    check = TokenCredentials(TokenStore(home), cache_s=0)
    assert check(ns, "agt_x") is None, check(ns, "agt_x")
    assert check("token:gateway", "agt_x") is not None  # nobody's live namespace here


# ------------------------------------------------------------------ a token narrowed by a rotation


async def test_a_task_stops_when_its_token_is_narrowed_to_other_agents_or_scopes(tmp_path: Path) -> None:
    """A rotation that keeps the token's name but limits it to other agents (by name or id), or
    takes away every scope that submits turns, stops its tasks as a revocation does (was: only the
    name was checked, so a narrowed token's task kept running turns on an agent it may not use)."""
    home = tmp_path / "home"
    ns = token_namespace(home, "dave")
    store = CronStore(home)
    task = store.add(make_task(name="rot", agent="agt_free", schedule=ScheduleSpec("every", "1h", "UTC"),
                               prompt="p", now=T0, exact=True, namespace=ns))  # fmt: skip
    fired: list[int] = []

    async def fire(t: CronTask, occ: Occurrence) -> str:
        fired.append(occ.number)
        return f"turn_{occ.number}"

    async def names() -> dict[str, str]:
        return {"agt_free": "free", "agt_assistant": "assistant"}

    clock = FakeClock(T0 + timedelta(hours=1, seconds=1))
    tokens = TokenCredentials(TokenStore(home), cache_s=0)
    s = Scheduler(store, fire=fire, clock=clock, credentials=tokens, agent_names=names)

    async def hour(n: int) -> list[str]:
        clock.now = T0 + timedelta(hours=n, seconds=1)
        await s.tick()
        return [r.get("reason", "") for r in read_runs(store.runs_dir, task.id) if r["event"] == "missed"]

    assert await hour(1) == [] and fired == [1]  # every agent: runs
    TokenStore(home).revoke("dave")
    TokenStore(home).create(name="dave", agents=["assistant"])
    missed = await hour(2)
    assert fired == [1] and len(missed) == 1, (fired, missed)
    assert "may no longer use the task's agent free (agt_free)" in missed[0], missed
    TokenStore(home).revoke("dave")
    TokenStore(home).create(name="dave", agents=["free"])  # limited by name to the task's agent
    assert len(await hour(3)) == 1 and fired == [1, 2]  # (a missed run uses no number)
    TokenStore(home).revoke("dave")
    TokenStore(home).create(name="dave", agents=["agt_free"])  # by id
    assert len(await hour(4)) == 1 and fired == [1, 2, 3]
    TokenStore(home).revoke("dave")
    TokenStore(home).create(name="dave", scopes=["admin"])  # no scope that submits turns
    missed = await hour(5)
    assert fired == [1, 2, 3] and len(missed) == 2 and "may no longer submit turns" in missed[1], missed
    await s.close()


async def test_a_narrowed_tokens_task_is_refused_by_hand_through_a_running_server(tmp_path: Path) -> None:
    """`appserver cron run` beside a live server (the `cron_run` frame, the server's cron service)
    refuses the task of a narrowed token as the in-process run does, before a run number is used."""
    home = tmp_path / "home"
    env = cli_env(home)
    assert run_cli(home, "agents", "create", "--name", "free", env=env).code == 0
    _, secret = TokenStore(home).create(name="dave")
    with serving(home, "--auth", "token", env=env) as sp:
        ws = await WS.open(sp.url, headers={"Authorization": f"Bearer {secret}"}, open_timeout=T)
        try:
            _, text = await _call(ws, "new", {"action": "create", "name": "rot", "prompt": "M", "in": "1h"})
            assert "created task rot" in text, text
        finally:
            await ws.close()
        TokenStore(home).revoke("dave")
        TokenStore(home).create(name="dave", agents=["free"])  # the rotation narrows it to another agent
        by_hand = run_cli(home, "cron", "run", "rot", env=env)
        assert by_hand.code == 2 and "may no longer use the task's agent assistant" in by_hand.err, (
            by_hand.code,
            by_hand.out,
            by_hand.err,
        )
        task_id = json.loads((home / "crons.json").read_text())["tasks"][0]["id"]
        assert read_runs(home / "cron-runs", task_id) == []  # nothing claimed, nothing fired
