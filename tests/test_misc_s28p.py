"""Session 28, helper P: findings of an outside tester.

1. In a cluster, an input for an idle conversation another server holds was acknowledged at
   `queue_position` 1, and the holder, taking it up, showed it at 1 too, so `appserver run` and
   `chat` printed `[queued behind 1 input(s)]` for every input sent through a server that does
   not hold the conversation. docs/protocol.md: the count of inputs ahead of it, 0 when nothing
   is. Now the accept counts the turn running or paused there (if any) and the queued ones before
   it, and the holder numbers a turn it takes up at the head of an idle queue 0. Real PostgreSQL,
   two real `appserver serve` processes, `websockets` clients, the CLI.
2. examples/plugins/echo_room, set up as its docstring said, never reached an agent (no
   `default_agent`, and the default `dm_policy` asks for a pairing first); and an approved
   sender was told their messages were on their way to the assistant when nothing routed the
   chat to one. A real `serve --channels echo_room` set up from the docstring itself.
3. docs/configuration.md's table of ranges missed keys and gave `[store]` timeouts the wrong
   range (now checked against `config.RULES`); `APPSERVER_DISABLE_CRON=maybe` was refused in a
   garbled sentence; `store copy --to sqlite:///x` showed the URL as `sqlite:/x`.
"""

from __future__ import annotations

import ast
import asyncio
import re
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.cli import ROOT, cli_env, run_cli
from tests.support.gateway import channel_server
from tests.support.pg import require_postgres, temp_database
from tests.support.serve import ServeProcess, start_serve_at, stop_all
from tests.support.source import parse_source
from tests.support.ws import WS

T = 30.0
ASK = "/call clock {}"  # on the agent `careful` (clock=ask): pauses for an approval


# ------------------------------------------------------------------ 1. queue positions in a cluster


@pytest.fixture
def pg() -> Iterator[str]:
    require_postgres()
    with temp_database("fixp28_qpos") as url:
        yield url


def _listen(home: Path, port: int, url: str) -> ServeProcess:
    """`serve` on `port`, or the next ones of 35000-35099 while one is taken."""
    return start_serve_at(home, port, cli_env(home, APPSERVER_STORE__URL=url), last=35099, step=7)


def _submit(conv: str, text: str, agent: str = "assistant") -> dict[str, Any]:
    return {"type": "submit_input", "agent": agent, "conversation": conv, "input": text}


async def _ack(ws: WS, frame: dict[str, Any]) -> dict[str, Any]:
    ack = await ws.request(frame, T)
    assert ack["type"] == "ack", ack
    return ack


def _conversation_on(sp: ServeProcess, agent: str = "assistant") -> str:
    r = httpx.post(
        sp.url + "/v1/chat/completions",
        headers={"X-Conversation-Id": "new"},
        json={"model": agent, "messages": [{"role": "user", "content": "warm"}]},
        timeout=T,
    )
    assert r.status_code == 200, r.text
    return r.headers["x-conversation-id"]


async def test_an_input_for_an_idle_conversation_another_server_holds_waits_behind_nothing(
    pg: str, tmp_path: Path
) -> None:
    a = _listen(tmp_path / "a", 35001, pg)
    b = _listen(tmp_path / "b", 35002, pg)
    try:
        conv = _conversation_on(a)  # A holds it
        holder = await WS.open(a.url)
        try:
            deadline = time.monotonic() + T
            while (await holder.request({"type": "subscribe", "conversation": conv}))["state"] != "idle":
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
        finally:
            await holder.close()
        ws = await WS.open(b.url)
        try:
            ack = await _ack(ws, _submit(conv, "on B"))
            assert ack["queue_position"] == 0, ack
            end = await ws.terminal(ack["turn_id"], T)
            assert end["status"] == "completed", end
            # B's own snapshot, and the holder's as it takes the turn up: nothing ahead of it
            snaps = ws.snapshots(ack["turn_id"])
            assert [s["queue_position"] for s in snaps] == [0] * len(snaps), snaps
        finally:
            await ws.close()
        # the CLI through B's home: nothing said of a queue
        r = run_cli(tmp_path / "b", "run", "--conversation", conv, "idle conv", env=cli_env(tmp_path / "b"))
        assert r.code == 0, r.err
        assert "queued behind" not in r.err, r.err
    finally:
        stop_all(b, a)


async def test_the_turns_ahead_are_counted_alike_on_every_server(pg: str, tmp_path: Path) -> None:
    """A turn runs on the holder, one input is queued there: the next, on either server, is
    behind 2; behind a turn paused for an approval, an input is behind 1."""
    r = run_cli(
        tmp_path / "a",
        "agents",
        "create",
        "--name",
        "careful",
        "--tool",
        "clock=ask",
        env=cli_env(tmp_path / "a", APPSERVER_STORE__URL=pg),
    )
    assert r.code == 0, r.err
    a = _listen(tmp_path / "a", 35011, pg)
    b = _listen(tmp_path / "b", 35012, pg)
    on_a = on_b = None
    try:
        conv = _conversation_on(a)
        on_a, on_b = await WS.open(a.url), await WS.open(b.url)
        running = await _ack(on_a, _submit(conv, "/slow 200"))
        assert running["queue_position"] == 0, running
        assert (await _ack(on_a, _submit(conv, "second")))["queue_position"] == 1
        assert (await _ack(on_b, _submit(conv, "third")))["queue_position"] == 2
        assert (await _ack(on_a, _submit(conv, "fourth")))["queue_position"] == 3
        await on_a.request({"type": "cancel", "conversation": conv, "turn_id": running["turn_id"]}, T)

        paused_conv = _conversation_on(a, "careful")
        paused = await _ack(on_a, _submit(paused_conv, ASK, "careful"))
        await on_a.expect(lambda f: f["type"] == "approval_request" and f["turn_id"] == paused["turn_id"], T)
        behind = await _ack(on_b, _submit(paused_conv, "after the pause", "careful"))
        assert behind["queue_position"] == 1, behind
        shown = await on_b.expect(
            lambda f: f["type"] == "turn_updated" and f["snapshot"]["turn_id"] == behind["turn_id"], T
        )
        assert shown["snapshot"]["queue_position"] == 1, shown
    finally:
        for ws in (on_a, on_b):
            if ws is not None:
                await ws.close()
        stop_all(b, a)


# ------------------------------------------------------------------ 2. the echo_room example, as its docstring says


EXAMPLE = ROOT / "examples" / "plugins" / "echo_room"


def _docstring() -> str:
    doc = ast.get_docstring(parse_source(EXAMPLE / "plugin.py"))
    assert doc is not None
    return doc


def _room_home(tmp_path: Path) -> tuple[Path, Path, list[str]]:
    """A home set up word for word as the example's docstring says (its /tmp/room in `tmp_path`),
    with two more accounts: `paired` (the block without its `dm_policy` line: the default,
    pairing) and `bare` (without `default_agent` either: nothing routes its chat). Returns the
    home, the room folder and the arguments of the `serve` command the docstring gives."""
    doc = _docstring()
    block = doc.split("add an account to config.toml:\n\n", 1)[1].split("\n\n", 1)[0]
    lines = [line.removeprefix("    ") for line in block.splitlines()]
    assert lines[0] == "[channels.echo_room.accounts.main]", lines
    room = tmp_path / "room"
    room.mkdir()
    main = "\n".join(lines).replace("/tmp/room/", f"{room}/")
    paired = "\n".join(line for line in lines if not line.startswith("dm_policy"))
    paired = paired.replace("accounts.main]", "accounts.paired]").replace("/tmp/room/", f"{room}/paired-")
    bare = "\n".join(line for line in lines if not line.startswith(("dm_policy", "default_agent")))
    bare = bare.replace("accounts.main]", "accounts.bare]").replace("/tmp/room/", f"{room}/bare-")
    home = tmp_path / "home"
    shutil.copytree(EXAMPLE, home / "channels" / "echo_room", ignore=shutil.ignore_patterns("__pycache__"))
    (home / "config.toml").write_text(f"{main}\n\n{paired}\n\n{bare}\n")
    serve = re.search(r"`appserver (serve [^`]*)`", doc)
    assert serve is not None, doc
    return home, room, serve.group(1).split()[1:]


def _outbox_line(path: Path, pred: Callable[[str], bool], timeout: float = 20) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = path.read_text().splitlines() if path.exists() else []
        for line in lines:
            if pred(line):
                return line
        time.sleep(0.05)
    raise AssertionError(f"no such line in {path}: {lines}")


def _say(inbox: Path, line: str) -> None:
    with inbox.open("a") as f:
        f.write(line + "\n")


def test_the_echo_room_example_answers_as_its_docstring_says(tmp_path: Path) -> None:
    home, room, serve_args = _room_home(tmp_path)
    doc = _docstring()
    tried = re.search(r'`echo "([^"]*)" >> /tmp/room/inbox\.txt`', doc)
    assert tried is not None, doc
    with channel_server(home, "--listen", "127.0.0.1:35101", *serve_args) as srv:
        # as the docstring says: the message is answered
        _say(room / "inbox.txt", tried.group(1))
        said = tried.group(1).partition(": ")[2]
        _outbox_line(room / "outbox.txt", lambda t: t == f"[room] echo: {said}")

        # the default, pairing: a code first, then, approved, the kept message is answered
        _say(room / "paired-inbox.txt", "ann: kept for later")
        _outbox_line(room / "paired-outbox.txt", lambda t: "pairing code" in t)
        listed = run_cli(home, "pairing", "list")
        code = next(line.split()[0] for line in listed.out.splitlines() if " paired " in f" {line} ")
        assert run_cli(home, "pairing", "approve", code).code == 0
        notice = _outbox_line(room / "paired-outbox.txt", lambda t: "✅" in t)
        assert notice == "[room] ✅ You're approved. Your messages are on their way to the assistant.", notice
        _outbox_line(room / "paired-outbox.txt", lambda t: t == "[room] echo: kept for later")

        # nothing routes the chat: approved, the sender is told the truth
        _say(room / "bare-inbox.txt", "bob: anyone there?")
        _outbox_line(room / "bare-outbox.txt", lambda t: "pairing code" in t)
        listed = run_cli(home, "pairing", "list")
        code = next(line.split()[0] for line in listed.out.splitlines() if " bare " in f" {line} ")
        assert run_cli(home, "pairing", "approve", code).code == 0
        notice = _outbox_line(room / "bare-outbox.txt", lambda t: "✅" in t)
        assert "not connected to an agent" in notice and "on their way" not in notice, notice
        assert srv.proc.poll() is None


# ------------------------------------------------------------------ 3. the documented ranges of the settings


def _documented_ranges() -> tuple[dict[str, tuple[str, str]], set[str]]:
    """The table of docs/configuration.md: `section.key` -> (its row's `integer`/`number`, the
    row's bounds as written) for each key a numeric row names, and the patterns of the row that
    covers "every other" key (`limits.*_timeout_s`)."""
    text = (ROOT / "docs" / "configuration.md").read_text()
    table = text.split("| keys | allowed |\n| --- | --- |\n", 1)[1].split("\n\n", 1)[0]
    ranges: dict[str, tuple[str, str]] = {}
    patterns: set[str] = set()
    for row in table.splitlines():
        keys, allowed = (cell.strip() for cell in row.strip("|").split(" | ", 1))
        kind = re.match(r"(integer|number) (.*)", allowed)
        if kind is None:
            continue
        section = "limits"
        for token in re.findall(r"`([^`]+)`", keys):
            prefix = re.match(r"\[([a-z]+)(?:\.NAME)?\] ?(.*)", token)
            if prefix is not None:
                section, token = prefix.group(1), prefix.group(2)
            if not token:
                continue
            name = f"{section}.{token}"
            if "*" in token:
                patterns.add(name)
                continue
            assert name not in ranges, f"{name} is in two rows of the table"
            ranges[name] = (kind.group(1), kind.group(2))
    return ranges, patterns


def _bounds(written: str) -> tuple[float | None, float | None, float | None]:
    """(ge, gt, le) of `≥ 1024`, `> 0`, `0.1 – 3600`, `1024 – 16 MiB` (anything after is a note)."""
    unit = {"": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}

    def num(value: str, suffix: str) -> float:
        return float(value) * unit[suffix]

    found = re.match(r"(≥|>) ([\d.]+)(?: (KiB|MiB|GiB))?\b", written)
    if found is not None:
        n = num(found.group(2), found.group(3) or "")
        return (n, None, None) if found.group(1) == "≥" else (None, n, None)
    found = re.match(r"([\d.]+)(?: (KiB|MiB|GiB))? – ([\d.]+)(?: (KiB|MiB|GiB))?\b", written)
    assert found is not None, f"cannot read the range {written!r}"
    return num(found.group(1), found.group(2) or ""), None, num(found.group(3), found.group(4) or "")


def test_the_documented_range_of_each_setting_is_the_one_it_is_held_to() -> None:
    import dataclasses
    import typing

    from appserver import config

    ranges, patterns = _documented_ranges()
    # checks past the rule's own bounds (`_check_value`): as a user meets them
    held = {"cron.tick_s": config.Rule(ge=0.1, le=3600)}
    hints: dict[str, Any] = {}
    for cls, section in config._SECTIONS.items():
        for f in dataclasses.fields(cls):
            hints[f"{section}.{f.name}"] = typing.get_type_hints(cls)[f.name]
    numeric = {k: held.get(k, r) for k, r in config.RULES.items() if not r.choices}
    wrong = []
    for key, rule in sorted(numeric.items()):
        hint = hints[key]
        if typing.get_origin(hint) is dict:
            hint = typing.get_args(hint)[1]
        kind = "integer" if hint is int else "number"
        expected = (rule.ge, rule.gt, rule.le)
        if key not in ranges:
            # the row of "every other" key: > 0
            covered = any(re.fullmatch(p.replace(".", r"\.").replace("*", ".*"), key) for p in patterns)
            if not covered:
                wrong.append(f"{key}: not in the table")
            elif (kind, expected) != ("number", (None, 0, None)):
                wrong.append(f"{key}: in the row of every other key (number > 0), but {kind} {expected}")
            continue
        doc_kind, written = ranges[key]
        if (doc_kind, _bounds(written)) != (kind, expected):
            wrong.append(f"{key}: documented {doc_kind} {written!r}, held to {kind} {expected}")
    for key in ranges:
        if key not in numeric:
            wrong.append(f"{key}: documented, but no such setting has a range")
    assert not wrong, "\n".join(wrong)


# ------------------------------------------------------------------ 3. two messages


def test_a_wrong_disable_cron_value_is_refused_in_one_clean_sentence(tmp_path: Path) -> None:
    from appserver.config import ConfigError, load_config

    with pytest.raises(ConfigError) as refused:
        load_config(tmp_path, environ={"APPSERVER_DISABLE_CRON": "maybe"})
    assert str(refused.value) == (
        "APPSERVER_DISABLE_CRON='maybe': must be 1, true, yes or on to turn cron off, "
        "or 0, false, no or off to leave it on"
    )


def test_store_copy_shows_a_wrong_url_as_it_was_given(tmp_path: Path) -> None:
    home = tmp_path / "home"
    assert run_cli(home, "agents", "list").code == 0
    r = run_cli(home, "store", "copy", "--to", "sqlite:///x")
    assert r.code == 2
    assert r.err.startswith("error: --to: sqlite:///x has scheme 'sqlite'"), r.err
    # with its password hidden, a URL without a host keeps its `//` too
    r = run_cli(home, "store", "copy", "--to", "mysql:///db?password=hunter22")
    assert r.code == 2 and "mysql:///db?password=***" in r.err and "hunter22" not in r.err, r.err
