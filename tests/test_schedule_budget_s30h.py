"""Session 30: what the `schedule` tool may take of crons.json is bounded in bytes.

crons.json is one file for every namespace and the operator, read with a 64 MiB limit and
rewritten whole by every run's claim. The tool bounded a namespace by count only (100 tasks of up
to 1 MiB prompts each), so one token's model filled the file: the operator's `cron add` and every
other namespace's `schedule create` were refused, and the refusal told the model the server's home
path and how much the other namespaces' tasks took. Now a tool prompt holds at most 16 KiB, a
namespace's tasks at most 512 KiB of the file and all the tool's tasks together a quarter of it
(each task counted with the bookkeeping room kept for it); a refusal names only the caller's own
tasks, and a fault of the file itself is told without its path or sizes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from appserver.auth import TokenStore
from cron.schedule import ScheduleSpec
from cron.store import MAX_PROMPT_BYTES, CronStore, CronTask, make_task, user_limit, utcnow
from tests.support.cli import cli_env, run_cli
from tests.support.serve import serving
from tests.support.ws import WS

pytestmark = pytest.mark.timeout(180)

T = 30.0


@dataclass
class Srv:
    url: str
    home: Path
    env: dict[str, str]
    alice: str
    bob: str


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Srv]:
    home = tmp_path_factory.mktemp("s30h") / "home"
    env = cli_env(home)
    assert run_cli(home, "agents", "list", env=env).code == 0
    tokens = TokenStore(home)
    alice = tokens.create(name="alice", agents="assistant")[1]  # scopes openai,ws: no admin
    bob = tokens.create(name="bob", agents="assistant")[1]
    with serving(home, "--auth", "token", env=env) as sp:
        yield Srv(sp.url, home, env, alice, bob)


async def schedule(srv: Srv, token: str, args: dict[str, object]) -> str:
    """The tool's output for one `/call schedule` in a new conversation of `token`'s namespace."""
    ws = await WS.open(srv.url, headers={"Authorization": f"Bearer {token}"}, open_timeout=T)
    try:
        frame = {"type": "submit_input", "agent": "assistant", "conversation": "new",
                 "input": "/call schedule " + json.dumps(args)}  # fmt: skip
        ack = await ws.request(frame, T)
        assert ack["type"] == "ack", ack
        snap = await ws.terminal(ack["turn_id"], T)
    finally:
        await ws.close()
    [call] = [b for b in snap["blocks"] if b.get("type") == "tool_call"]
    return str(call["output"])


def replace_tasks(home: Path, tasks: list[CronTask]) -> None:
    """crons.json holding `tasks` only (the scheduler's lease record kept), written in one save."""
    store = CronStore(home)
    with store.lock():
        state = store.load()
        state.tasks[:] = tasks
        store.save(state)


def lines_of(home: Path, namespace: str) -> int:
    """The bytes of the task lines of `namespace` in crons.json."""
    text = (home / "crons.json").read_bytes()
    return sum(len(line) for line in text.splitlines() if f'"namespace": "{namespace}"'.encode() in line)


def tells_nothing_of_the_server(srv: Srv, text: str) -> None:
    assert str(srv.home) not in text and "crons.json" not in text, text
    big = [n for n in re.findall(r"\d[\d,]*", text) if int(n.replace(",", "")) >= 1_000_000]
    assert not big, text  # no size of the file, nor of all the tasks (the caller's own are < 1 MB)


def operator_task(name: str, prompt: str, namespace: str | None = None) -> CronTask:
    return make_task(name=name, agent="assistant", schedule=ScheduleSpec("every", "1h", "UTC"), prompt=prompt,
                     now=utcnow(), namespace=namespace)  # fmt: skip


async def test_one_token_takes_a_bounded_share_of_the_file(srv: Srv) -> None:
    replace_tasks(srv.home, [])
    text = await schedule(srv, srv.alice, {"action": "create", "name": "doc", "in": "2h", "prompt": "d" * 65536})
    assert "failed" in text and "prompt too long" in text, text[:300]
    made, refusal = 0, ""
    for i in range(60):  # 60 tasks of 16,000-byte prompts: under the count cap, ~1 MB
        text = await schedule(
            srv, srv.alice, {"action": "create", "name": f"t{i}", "every": "30d", "prompt": "A" * 16000}
        )
        if not text.startswith("created"):
            refusal = text
            break
        made += 1
    assert refusal, "60 tasks of 16 KB prompts were all accepted from one token"
    assert 20 <= made < 60, (made, refusal)
    assert "this owner" in refusal, refusal
    tells_nothing_of_the_server(srv, refusal)
    assert lines_of(srv.home, "token:token:alice") <= 512 * 1024
    text = await schedule(srv, srv.bob, {"action": "create", "name": "b", "in": "2h", "prompt": "hello"})
    assert text.startswith("created"), text  # another namespace is not crowded out


async def test_the_tools_tasks_together_leave_the_operator_his_room(srv: Srv) -> None:
    # What sixteen other tokens could have made (or an older appserver let one make): 16 MiB.
    others = [operator_task(f"o{i}", "B" * MAX_PROMPT_BYTES, f"token:token:other{i}") for i in range(16)]
    replace_tasks(srv.home, others)
    text = await schedule(srv, srv.bob, {"action": "create", "name": "late", "in": "2h", "prompt": "hello"})
    assert "failed" in text and "no room" in text, text
    tells_nothing_of_the_server(srv, text)
    assert lines_of(srv.home, "token:token:bob") == 0
    r = run_cli(srv.home, "cron", "add", "--name", "daily", "--agent", "assistant", "--cron", "0 8 * * *",
                "--prompt", "summarize the news " * 5000, env=srv.env)  # fmt: skip
    assert r.code == 0, r.err


async def test_a_full_file_is_refused_without_its_path_or_size(srv: Srv) -> None:
    # The operator's own tasks (as `cron add` makes them) fill the file up to its user limit.
    big = "\x01" * MAX_PROMPT_BYTES  # 6 MiB in JSON
    tasks = [operator_task(f"big{i}", big) for i in range(10)]
    store = CronStore(srv.home)
    with store.lock():  # as replace_tasks, but one save: the server's scheduler reads 64 MiB once
        state = store.load()
        state.tasks[:] = tasks
        size = len(store.render_bytes(state))  # the size crons.json would have with these tasks
        room = user_limit(12) - 1000 - size  # 12: with the filler and the new one
        state.tasks.append(operator_task("filler", "\x01" * ((room - 1000) // 6)))
        store.save(state, cache=True)  # kept: the clean-up below parses 64 MiB again only if it changed
    text = await schedule(srv, srv.alice, {"action": "create", "name": "small", "in": "2h", "prompt": "hello " * 1000})
    assert "failed" in text and "nothing was written" in text, text
    tells_nothing_of_the_server(srv, text)
    with store.lock():
        state = store.load()
        state.tasks.clear()
        store.save(state)
