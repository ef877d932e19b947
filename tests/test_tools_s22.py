"""Tool fixes found in session 22.

1. What an approver saw was not what ran: prompts showed the model's arguments text, execution used
   `json.loads` (the last of a repeated key wins, `\\u0045` escapes are decoded). A repeated key is
   now refused unrun and unasked, and every front end is announced the canonical form of what runs.
2. A shell command inherited the server's secrets (provider keys, APPSERVER_TOKEN, channel secrets).
3. `sleep 30 & echo started` waited for its whole timeout (the call waited for the output pipe).
4. `env -i setsid …` escaped the kill at the call's end and after a kill -9 of the server.
5. The output cap cut inside a UTF-8 character (a U+FFFD at the end).
Also: a deny reason is capped before the model gets it; conflicting `--tool` options are refused.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from appserver.agent.tools import SHELL, ToolContext
from appserver.config import Config
from appserver.store.records import AgentRecord
from gateway.approvals import Prompt
from plugins.contract import Target
from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, serving, start_serve
from tests.support.ws import WS

# ---------------------------------------------------------------- helpers


def _agent(home: Path, name: str, policy: str) -> str:
    r = run_cli(home, "agents", "create", "--name", name, "--tool", f"shell={policy}", "--json")
    assert r.code == 0, r.err
    return str(r.json()["id"])


def _ctx(home: Path, **limits: float) -> ToolContext:
    cfg = Config(home=home)
    for name, value in limits.items():
        setattr(cfg.limits, name, value)
    agent = AgentRecord(id="a", name="a", model="echo", system="", tools={}, params={}, created_at=0, updated_at=0)
    return ToolContext(agent, "c", "t", cfg)


def _pids_running(marker: str) -> list[int]:
    """The live processes whose command line holds `marker` (a sleep with a unique duration)."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                state = f.read().rsplit(b") ", 1)[1][:1]
        except (OSError, IndexError):
            continue
        if marker in cmdline and state != b"Z":
            found.append(int(entry.name))
    return found


def _kill_leftovers(*markers: str) -> None:
    """Teardown: kill what this test started and the code under test left running (by pid)."""
    for marker in markers:
        for pid in _pids_running(marker):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _gone(marker: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _pids_running(marker):
            return True
        time.sleep(0.05)
    return not _pids_running(marker)


def _until(pred: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return bool(pred())


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeProcess, dict[str, str]]]:
    """One real `appserver serve` with an agent that asks before each shell call and one allowed."""
    home = tmp_path_factory.mktemp("s22") / "home"
    ids = {"ask": _agent(home, "ask", "ask"), "sh": _agent(home, "sh", "allow")}
    with serving(home, env=cli_env(home)) as sp:
        yield sp, ids


async def _first_of(ws: WS, turn_id: str, timeout: float = 20) -> dict[str, Any]:
    """The turn's approval request or its terminal snapshot, whichever comes first."""
    return await ws.expect(
        lambda f: (
            f["type"] == "approval_request"
            or (
                f["type"] == "turn_updated"
                and f["snapshot"]["turn_id"] == turn_id
                and f["snapshot"]["status"] in ("completed", "failed", "cancelled")
            )
        ),
        timeout,
    )


async def _submit(ws: WS, agent: str, text: str) -> tuple[str, str]:
    conv = (await ws.request({"type": "create_conversation", "agent": agent}))["conversation"]["id"]
    await ws.request({"type": "subscribe", "conversation": conv})
    ack = await ws.request({"type": "submit_input", "agent": agent, "conversation": conv, "input": text})
    assert ack["type"] == "ack", ack
    return conv, str(ack["turn_id"])


# ---------------------------------------------------------------- 1. what is approved is what runs


@pytest.mark.parametrize(
    "arguments",
    [
        '{"command": "ls -la", "why": "' + "a harmless listing; " * 12 + '", "command": "echo EVIL > pwned.txt"}',
        '{"command": "echo EVIL > pwned.txt", "opts": {"x": 1, "x": 2}}',  # at any depth
    ],
)
def test_a_repeated_key_is_refused_unrun_and_nobody_is_asked(
    server: tuple[ServeProcess, dict[str, str]], arguments: str
) -> None:
    sp, ids = server

    async def go() -> None:
        ws = await WS.open(sp.url)
        try:
            _, turn = await _submit(ws, "ask", "/call shell " + arguments)
            first = await _first_of(ws, turn)
            assert first["type"] == "turn_updated", f"an approval was asked for: {first}"
            snap = first["snapshot"]
            [call] = [b for b in snap["blocks"] if b["type"] == "tool_call"]
            assert call["is_error"] and "Invalid arguments for shell" in call["output"], call
            assert "more than once" in call["output"], call
            assert snap["status"] == "completed" and not snap["pending"]
        finally:
            await ws.close()

    asyncio.run(go())
    assert not (sp.home / "workspaces" / ids["ask"] / "pwned.txt").exists()


def test_every_approval_shows_the_canonical_form_of_what_runs(server: tuple[ServeProcess, dict[str, str]]) -> None:
    """The escapes the model wrote are shown decoded (an invisible bidi control stays an escape),
    in the WS approval request, the snapshot's pending call and block, the history, and the
    gateway's chat prompt; approved, exactly that runs."""
    sp, ids = server
    raw = '{"command": "echo \\u0045\\u0056\\u0049\\u004c-ran \\u003e out.txt \\u202e", "timeout_s": 10}'
    canonical = '{"command": "echo EVIL-ran > out.txt \\u202e", "timeout_s": 10}'

    async def go() -> str:
        ws = await WS.open(sp.url)
        try:
            conv, turn = await _submit(ws, "ask", "/call shell " + raw)
            request = await _first_of(ws, turn)
            assert request["type"] == "approval_request", request
            assert request["arguments"] == canonical
            awaiting = [
                f["snapshot"] for f in ws.seen if f["type"] == "turn_updated" and f["snapshot"]["status"] == "awaiting"
            ][-1]
            assert [p["arguments"] for p in awaiting["pending"]] == [canonical]
            [block] = [b for b in awaiting["blocks"] if b["type"] == "tool_call"]
            assert block["arguments"] == canonical
            # a chat approver sees the command that runs
            prompt = Prompt(request["call_id"], conv, turn, "telegram:main", Target("1"), "u", "shell", canonical)
            assert "echo EVIL-ran > out.txt" in prompt.text()
            # the history (what the provider is sent back) holds what runs too
            history = await ws.request({"type": "get_history", "conversation": conv})
            stored = [c for m in history["messages"] for c in m.get("tool_calls") or []]
            assert [c["arguments"] for c in stored] == [canonical], stored
            answer = {"call_id": request["call_id"], "decision": "approve"}
            await ws.request({"type": "approval_response", "conversation": conv, "decisions": [answer]})
            done = await ws.terminal(turn)
            assert done["status"] == "completed", done
            return conv
        finally:
            await ws.close()

    asyncio.run(go())
    out = sp.home / "workspaces" / ids["ask"] / "out.txt"
    assert out.read_text().startswith("EVIL-ran"), out.read_text()


def test_the_responses_approval_item_shows_what_runs(server: tuple[ServeProcess, dict[str, str]]) -> None:
    sp, _ = server
    raw = '{"command": "echo \\u0045\\u0056\\u0049\\u004c"}'
    body = {"model": "ask", "input": "/call shell " + raw}
    r = httpx.post(sp.url + "/v1/responses", json=body, timeout=30)
    assert r.status_code == 200, r.text
    [item] = [i for i in r.json()["output"] if i["type"] == "mcp_approval_request"]
    assert item["arguments"] == '{"command": "echo EVIL"}', item


def test_a_chat_prompt_never_cuts_inside_the_shell_command() -> None:
    command = "ls -la; " + "; ".join(f"echo step{i}" for i in range(40)) + "; echo EVIL > pwned.txt"
    arguments = json.dumps({"command": command, "why": "a harmless listing of the workspace, " * 8})
    text = Prompt("call_0123456789", "c", "t", "telegram:main", Target("1"), "u", "shell", arguments).text()
    assert command in text, text
    assert "why" in text and "not used by the tool" in text
    huge = json.dumps({"command": "ls; " + "".join(f"echo {i}; " for i in range(600)) + "echo EVIL"})
    text = Prompt("call_0123456789", "c", "t", "telegram:main", Target("1"), "u", "shell", huge).text()
    assert "cannot be judged from this prompt" in text and len(text) < 2000, text


# ---------------------------------------------------------------- 2. the server's secrets stay out


def test_a_shell_command_does_not_get_the_servers_secrets(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.toml").write_text(
        "[providers.acme]\n"
        'kind = "openai"\nbase_url = "http://127.0.0.1:9/v1"\napi_key_env = "ACME_S22_KEY"\n\n'
        "[channels.webhook.accounts.main]\n"
        'listen = "127.0.0.1:22798"\nsecret_env = "HOOK_S22_SECRET"\ndefault_agent = "sh"\n'
    )
    secrets = {
        "OPENAI_API_KEY": "sk-proj-s22openaikey0123456789abcdef",
        "ACME_S22_KEY": "sk-s22acmekey0123456789abcdefghij",
        "HOOK_S22_SECRET": "whsec-s22-topsecret-42",
        "APPSERVER_TOKEN": "aps_s22tokenvalue0123456789",
    }
    env = cli_env(home, **secrets, S22_PLAIN="plain-s22-visible")
    r = run_cli(home, "agents", "create", "--name", "sh", "--tool", "shell=allow", env=env)
    assert r.code == 0, r.err
    with serving(home, env=env) as sp:
        body = {"model": "sh", "messages": [{"role": "user", "content": '/call shell {"command": "env"}'}]}
        r2 = httpx.post(
            sp.url + "/v1/chat/completions",
            json=body,
            headers={"Authorization": "Bearer " + secrets["APPSERVER_TOKEN"]},
            timeout=30,
        )
        assert r2.status_code == 200, r2.text
        shown = r2.json()["choices"][0]["message"]["content"]
    assert "plain-s22-visible" in shown, shown  # the rest of the environment is there
    for name, value in secrets.items():
        assert value not in shown, f"{name} reached the command"


# ---------------------------------------------------------------- 3./4. what a command leaves behind


async def test_a_command_returns_when_its_shell_exits_and_what_it_left_is_killed(tmp_path: Path) -> None:
    ctx = _ctx(tmp_path)
    markers = ("30.2201", "30.2202", "30.2203", "30.2204")
    try:
        cases = [
            (f"sleep {markers[0]} & echo started; exit 0", False, "started\n"),
            (f"sleep {markers[1]} >/dev/null 2>&1 & echo redirected", False, "redirected\n"),
            (f"nohup sleep {markers[2]} & exit 3", True, "exit code 3\n"),
            (f"env -i setsid sleep {markers[3]} & echo escaped", False, "escaped\n"),
        ]
        for (command, is_error, text), marker in zip(cases, markers, strict=True):
            started = time.monotonic()
            out = await asyncio.wait_for(SHELL.run({"command": command, "timeout_s": 8}, ctx), 30)
            assert time.monotonic() - started < 5, (command, out)
            assert (out.is_error, out.text) == (is_error, text), (command, out)
            # killed when the call ends, with or without its output redirected, in a session of its own too
            assert _gone(marker, 5), f"{command!r} left {marker} running"
    finally:
        _kill_leftovers(*markers)


async def test_a_timed_out_command_s_escaped_process_is_killed_too(tmp_path: Path) -> None:
    ctx = _ctx(tmp_path)
    try:
        command = "env -i setsid sleep 30.2211 & env -i setsid sh -c 'sleep 30.2212 & wait' & sleep 30.2213"
        out = await asyncio.wait_for(SHELL.run({"command": command, "timeout_s": 1}, ctx), 30)
        assert out.is_error and out.text.startswith("command timed out after 1 s"), out
        for marker in ("30.2211", "30.2212", "30.2213"):
            assert _gone(marker, 5), f"{marker} survived the timeout"
    finally:
        _kill_leftovers("30.2211", "30.2212", "30.2213")


async def test_a_chain_deeper_than_the_guards_rounds_is_killed_too(tmp_path: Path) -> None:
    """70 nested subshells left running by a command that returns at once (a re-attack): the
    guard kills a level per round, and the levels past its rounds outlived the call, handed to
    init. The process group is killed after the guard too."""
    ctx = _ctx(tmp_path)
    marker = "31.5151"
    nest = f"f() {{ if [ $1 -gt 0 ]; then (f $(($1-1))) & wait; else exec sleep {marker}; fi; }}"
    command = f"{nest}; f 70 & sleep 1; echo started"
    try:
        out = await asyncio.wait_for(SHELL.run({"command": command, "timeout_s": 20}, ctx), 60)
        assert (out.is_error, out.text) == (False, "started\n"), out
        assert _gone(marker, 10), "the deepest level of the chain outlived the call"
    finally:
        _kill_leftovers(marker)


def test_the_canonical_form_escapes_what_renders_as_nothing_or_as_a_false_space() -> None:
    from appserver.agent.tools import canonical_arguments

    shown = canonical_arguments({"command": "a\u034fb \u3164 \u2800 rm\u2003-rf x\u00a0y é 😀", "k\u3164": 1})
    for escaped in ("\\u034f", "\\u3164", "\\u2800", "\\u2003", "\\u00a0"):
        assert escaped in shown, (escaped, shown)
    assert "é 😀" in shown and json.loads(shown)["command"].startswith("a\u034fb")


def test_a_server_killed_with_kill_9_leaves_no_escaped_process(tmp_path: Path) -> None:
    home = tmp_path / "home"
    _agent(home, "sh", "allow")
    env = cli_env(home)
    markers = ("500.2221", "500.2222", "500.2223")
    sp = start_serve(home, env=env)
    try:
        command = f"env -i setsid sleep {markers[0]} & setsid sleep {markers[1]} & echo hi; sleep {markers[2]}"
        body = {
            "model": "sh",
            "messages": [{"role": "user", "content": "/call shell " + json.dumps({"command": command})}],
        }

        async def call() -> None:
            async with httpx.AsyncClient(timeout=30) as client:
                try:
                    await client.post(sp.url + "/v1/chat/completions", json=body)
                except httpx.HTTPError:
                    pass  # the server is killed under it

        async def go() -> None:
            task = asyncio.create_task(call())
            ok = await asyncio.to_thread(_until, lambda: all(_pids_running(m) for m in markers), 15)
            assert ok, [_pids_running(m) for m in markers]
            sp.proc.send_signal(signal.SIGKILL)
            sp.proc.wait(10)
            await asyncio.wait_for(task, 30)

        asyncio.run(go())
        for marker in markers:
            assert _gone(marker, 8), f"{marker} outlived the server"
    finally:
        sp.kill()
        _kill_leftovers(*markers)


# ---------------------------------------------------------------- 5. the output cap and a character


async def test_the_output_cap_never_cuts_a_character_in_two(tmp_path: Path) -> None:
    ctx = _ctx(tmp_path, shell_output_max_bytes=10)
    out = await SHELL.run({"command": r"printf 'abcdefghi\342\202\254 euro'"}, ctx)
    assert not out.is_error
    assert "\ufffd" not in out.text, out.text
    assert out.text == "abcdefghi\n[output truncated: 17 bytes, showing the first 9]", out.text
    whole = await SHELL.run({"command": r"printf 'abcdefg\342\202\254 euro'"}, ctx)
    assert whole.text.startswith("abcdefg€\n[output truncated: 15 bytes, showing the first 10]"), whole.text


# ---------------------------------------------------------------- also: deny reasons, --tool conflicts


def test_a_huge_deny_reason_reaches_the_model_capped(server: tuple[ServeProcess, dict[str, str]]) -> None:
    sp, _ = server

    async def go() -> None:
        ws = await WS.open(sp.url)
        try:
            conv, turn = await _submit(ws, "ask", '/call shell {"command": "echo ran"}')
            request = await _first_of(ws, turn)
            assert request["type"] == "approval_request", request
            answer = {"call_id": request["call_id"], "decision": "deny", "reason": "no. " * 100_000}
            await ws.request({"type": "approval_response", "conversation": conv, "decisions": [answer]})
            done = await ws.terminal(turn)
            [call] = [b for b in done["blocks"] if b["type"] == "tool_call"]
            assert call["status"] == "denied", call
            assert len(call["output"]) < 5000 and "reason cut" in call["output"], len(call["output"])
            assert call["output"].startswith("The user denied this call to shell"), call["output"][:200]
        finally:
            await ws.close()

    asyncio.run(go())


def test_conflicting_tool_policies_are_refused(tmp_path: Path) -> None:
    home = tmp_path / "home"
    r = run_cli(home, "agents", "create", "--name", "x", "--tool", "shell=allow", "--tool", "shell=deny")
    assert r.code == 2 and "conflicting --tool" in r.err, (r.code, r.err)
    assert "x" not in [a["name"] for a in run_cli(home, "agents", "list", "--json").json()]
    r = run_cli(home, "agents", "update", "assistant", "--tool", "shell=ask", "--tool", "shell=allow")
    assert r.code == 2 and "conflicting --tool" in r.err, (r.code, r.err)
    same = run_cli(home, "agents", "update", "assistant", "--tool", "shell=ask", "--tool", "shell=ask")
    assert same.code == 0, same.err  # the same policy twice is no conflict
