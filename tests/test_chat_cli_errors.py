"""`appserver chat` and `appserver run` against a real `appserver serve` (token auth) when things go
wrong: one clear line and an exit code, never a traceback, and never a session that goes on as
somebody else or ends as a success after losing input.

* A refused upgrade (bad, revoked or openai-only token: 401/403) or a bad `--url` used to print
  websockets' InvalidStatus / InvalidURI / ValueError traceback: the client library now raises its
  own `ConnectError` (appserver/client/connection.py `_open`), and a reconnecting client gives up
  at once on a 401 instead of retrying until its deadline.
* A line bigger than the server's frame limit ended the session (1009) and the lines after it were
  lost, with exit code 0: the client refuses such a frame itself (the welcome says the limit), and a
  session whose connection is gone for good exits 1.
* `chat --agent ops --conversation <a conversation of another agent>` said "chatting with ops" and
  ran the turns as the other agent: the server refuses the subscribe (conversation_not_found).
* Negative, NaN or infinite `--reconnect-wait` / `--timeout` are usage errors (exit 2).
* With piped input, a turn a server crash interrupted made `chat` exit 0 (only `failed` turns
  counted) where `run` exits 1: it is no success either. A turn cancelled on purpose still is.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from appserver.auth import TokenStore
from appserver.cli.chat import chat, did_not_complete
from appserver.cli.run import server_url_source
from appserver.client import ConnectError, ProtocolClient
from tests.support.cli import CLIResult, cli_env, run_cli
from tests.support.serve import ServeProcess, serving, start_serve
from tests.support.wait import wait_for
from tests.support.zygote_client import appserver_popen
from tests.test_client_failover import running_turn_with_draft

pytestmark = pytest.mark.timeout(120)

FRAME_MAX = 64 * 1024


@dataclass
class Srv:
    sp: ServeProcess
    good: str  # ws + openai
    http_only: str  # openai only: 403 at the upgrade
    revoked: str

    @property
    def home(self) -> Path:
        return self.sp.home


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Srv]:
    home = tmp_path_factory.mktemp("chaterr") / "home"
    env = cli_env(home, APPSERVER_LIMITS__WS_FRAME_MAX_BYTES=str(FRAME_MAX))
    made = run_cli(home, "agents", "create", "--name", "ops", env=env)  # `assistant` comes with the home
    assert made.code == 0, made.err
    tokens = TokenStore(home)
    good = tokens.create(name="good", scopes="openai,ws")[1]
    http_only = tokens.create(name="http", scopes="openai")[1]
    revoked = tokens.create(name="gone", scopes="openai,ws")[1]
    tokens.revoke("gone")
    with serving(home, "--auth", "token", env=env) as sp:
        yield Srv(sp, good, http_only, revoked)


def cli(home: Path, *args: str, stdin: str = "", timeout: float = 60, **env: str) -> CLIResult:
    """The CLI as a child process, with `stdin` as its input (a file or pipe: no terminal)."""
    return run_cli(home, *args, stdin=stdin, timeout=timeout, env=cli_env(home, **env))


def one_line(r: CLIResult, code: int, needle: str) -> None:
    assert r.code == code, (r.code, r.out, r.err)
    assert "Traceback" not in r.err and "Traceback" not in r.out, r.err
    lines = [line for line in r.err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], r.err


def test_a_refused_token_is_one_line_and_not_a_traceback(srv: Srv) -> None:
    refused = "refused the token (401 invalid_api_key: invalid, expired or revoked token)"
    cases = [
        ("aps_bad", refused),
        (srv.revoked, refused),
        (srv.http_only, "refused the connection (403 insufficient_scope: this credential lacks the 'ws' scope)"),
    ]
    for token, needle in cases:
        one_line(cli(srv.home, "chat", "--token", token, stdin="hi\n"), 1, needle)
        one_line(cli(srv.home, "run", "hi", APPSERVER_TOKEN=token), 1, needle)
    # no token at all: the server asks for one in hello; the line says how to give it
    one_line(cli(srv.home, "chat", stdin="hi\n"), 1, "(give --token or set APPSERVER_TOKEN)")


def test_a_bad_url_is_a_usage_error_and_a_refused_path_one_line(srv: Srv) -> None:
    for url, why in (
        ("notaurl", "it must start with http://, https://, ws:// or wss://"),
        ("ftp://127.0.0.1:9", "it must start with http://, https://, ws:// or wss://"),
        ("http://127.0.0.1:99999", "Port out of range 0-65535"),
        ("http://[::1", "Invalid IPv6 URL"),
    ):
        one_line(cli(srv.home, "chat", "--url", url, stdin="hi\n"), 2, f"--url: invalid server URL {url!r}: {why}")
    r = cli(srv.home, "chat", "--url", srv.sp.url + "/foo", "--token", srv.good, stdin="hi\n")
    one_line(r, 1, "refused the connection (403 websocket_refused")


def test_seconds_must_be_finite_and_not_negative(srv: Srv) -> None:
    for args in (
        ("chat", "--reconnect-wait", "-1"),
        ("chat", "--reconnect-wait", "nan"),
        ("chat", "--reconnect-wait", "inf"),
        ("run", "--timeout", "-1", "hi"),
        ("run", "--timeout", "nan", "hi"),
        ("run", "--timeout", "0", "hi"),
        ("run", "--reconnect-wait", "-1", "hi"),
    ):
        r = cli(srv.home, *args, stdin="hi\n", APPSERVER_TOKEN=srv.good)
        assert r.code == 2, (args, r.code, r.err)
        assert f"Invalid value for '{args[1]}'" in r.err and "Traceback" not in r.err, (args, r.err)


def test_chat_refuses_a_conversation_of_another_agent(srv: Srv) -> None:
    made = cli(srv.home, "run", "--conversation", "new", "--json", "first", APPSERVER_TOKEN=srv.good)
    assert made.code == 0, made.err
    conv = made.json()["conversation_id"]  # the `assistant`'s
    r = cli(srv.home, "chat", "--agent", "ops", "--conversation", conv, "--token", srv.good, stdin="x\n")
    one_line(r, 2, f"unknown conversation '{conv}' for agent ops")
    assert "chatting with" not in r.out and "echo: x" not in r.out, r.out
    # the same for `run --approve` (as run does without a server)
    r = cli(srv.home, "run", "--agent", "ops", "--conversation", conv, "--approve", "call_x", APPSERVER_TOKEN=srv.good)
    one_line(r, 2, f"unknown conversation '{conv}' for agent ops")
    # and its own agent is fine
    r = cli(srv.home, "chat", "--agent", "assistant", "--conversation", conv, "--token", srv.good, stdin="x\n")
    assert r.code == 0 and "echo: x" in r.out, (r.out, r.err)


def test_chat_refuses_a_line_bigger_than_a_frame_and_goes_on(srv: Srv) -> None:
    marker = f"after-big-{time.monotonic_ns()}"
    stdin = "x" * (FRAME_MAX + 10) + "\n" + marker + "\n"
    r = cli(srv.home, "chat", "--conversation", "new", "--token", srv.good, stdin=stdin)
    assert r.code == 1, (r.code, r.err)  # a line of the script was not sent (it says so, and goes on)
    assert "Traceback" not in r.err, r.err
    assert "error: line too long:" in r.out and f"limit of {FRAME_MAX:,} bytes" in r.out, r.out[-2000:]
    assert f"echo: {marker}" in r.out, r.out[-2000:]  # the line after it was sent and answered


def test_chat_with_piped_input_exits_1_when_a_turn_failed_after_running_every_line(srv: Srv) -> None:
    """A script cannot read `[failed: …]` off the screen: with input from a pipe, a failed turn makes
    the exit code 1, once every line has run (was: 0). A session whose turns all worked exits 0."""
    marker = f"after-fail-{time.monotonic_ns()}"
    r = cli(srv.home, "chat", "--conversation", "new", "--token", srv.good, stdin=f"/error 400\n{marker}\n")
    assert r.code == 1, (r.code, r.out, r.err)
    assert "[failed:" in r.out and f"echo: {marker}" in r.out, r.out[-2000:]
    assert "Traceback" not in r.err, r.err
    ok = cli(srv.home, "chat", "--conversation", "new", "--token", srv.good, stdin=f"{marker}\n")
    assert ok.code == 0, (ok.code, ok.out, ok.err)


def test_chat_with_piped_input_exits_1_when_a_turn_was_interrupted_but_not_when_cancelled(tmp_path: Path) -> None:
    """kill -9 mid-turn, then a new server on the home: it settles the turn as interrupted, chat
    reconnects to it and shows `[interrupted: …]`, and its exit code says the turn did not complete
    (was: 0). `/cancel` ends a turn on purpose: that session exits 0."""
    home = tmp_path / "home"
    env = cli_env(home, APPSERVER_LIMITS__DRAFT_INTERVAL_S="0.1")
    sp = start_serve(home, env=env)
    try:
        with appserver_popen(
            ["chat", "--conversation", "new"],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        ) as proc:
            assert proc.stdin is not None
            proc.stdin.write("/slow 200\n")  # 200 words 50 ms apart: 10 s, far longer than the test needs
            proc.stdin.flush()
            wait_for(lambda: running_turn_with_draft(home), 15, "the turn to run and checkpoint text")
            sp.kill()  # SIGKILL: nothing is settled, the connection drops
            sp = start_serve(home, env=env)  # its start settles the turn as interrupted
            out, err = proc.communicate(timeout=60)  # stdin ends: chat leaves once the turn has ended
        assert "[interrupted: the server stopped while this turn was running]" in out, (out, err)
        assert proc.returncode == 1, (proc.returncode, out, err)
        assert "Traceback" not in err, err
        cancelled = cli(home, "chat", "--conversation", "new", stdin="/slow 200\n/cancel\n")
        assert "[cancelled]" in cancelled.out and "w200" not in cancelled.out, (cancelled.out, cancelled.err)
        assert cancelled.code == 0, (cancelled.code, cancelled.out, cancelled.err)
    finally:
        sp.kill()


def test_which_ended_turns_count_against_the_exit_code() -> None:
    interrupted = {"kind": "interrupted", "message": "the server stopped while this turn was running"}
    assert did_not_complete({"status": "failed", "error": {"kind": "upstream"}})
    assert did_not_complete({"status": "failed", "error": {"kind": "unknown"}})  # rebuilt after a reconnect
    assert did_not_complete({"status": "cancelled", "error": interrupted})
    assert not did_not_complete({"status": "cancelled", "error": None})  # Ctrl-C, /cancel, another client
    assert not did_not_complete({"status": "completed", "error": None})
    assert not did_not_complete({"status": "awaiting"})


async def test_chat_exits_1_when_the_server_closes_over_a_frame(
    srv: Srv, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A client that does not know the server's limit sends the big line, and the server closes the
    connection (1009): the session ends with exit code 1, said once, not 0 with the next line lost."""
    monkeypatch.setattr(ProtocolClient, "max_frame_bytes", property(lambda self: 1 << 30), raising=False)
    read, write = os.pipe()
    os.write(write, b"small\n")
    big = ("y" * (FRAME_MAX + 10) + "\nnext line\n").encode()

    def feed() -> None:
        with os.fdopen(write, "wb") as w:
            w.write(big)

    monkeypatch.setattr("sys.stdin", types.SimpleNamespace(fileno=lambda: read))
    feeder = asyncio.get_running_loop().run_in_executor(None, feed)
    try:
        code = await asyncio.wait_for(chat(srv.sp.url, "assistant", "new", srv.good, False, 0.0, None), 60)
    finally:
        await feeder
        os.close(read)
    out, err = capsys.readouterr()
    assert code == 1, (out, err)
    assert "echo: small" in out
    assert err.count("error: ") == 1 and "1009" in err, err


async def test_a_reconnecting_client_gives_up_at_once_when_its_token_is_refused(tmp_path: Path) -> None:
    """A server back after a crash that refuses the token (401) is not retried until the deadline."""
    home = tmp_path / "home"
    env = cli_env(home)
    assert run_cli(home, "agents", "list", env=env).code == 0
    good = TokenStore(home).create(name="good", scopes="ws")[1]
    token = [good]
    sp = start_serve(home, "--auth", "token", env=env)
    try:
        client = await ProtocolClient.connect(
            sp.url,
            token=lambda: token[0],
            reconnect=True,
            reconnect_s=60,
            url_source=server_url_source(home / "server.json"),
        )
        sp.kill()  # SIGKILL: the connection drops (1006), the client reconnects
        token[0] = "aps_bad"
        sp = start_serve(home, "--auth", "token", env=env)
        start = time.monotonic()

        async def frames() -> list[dict[str, object]]:
            return [f async for f in client.frames()]

        seen = await asyncio.wait_for(frames(), 20)
        assert time.monotonic() - start < 20
        assert [f.get("name") for f in seen if f.get("type") == "event"] == ["connection_lost"], seen
        reason = client.closed_message()
        assert "refused to reconnect" in reason and "401 invalid_api_key" in reason, reason
        await client.close()
        # and a first connect with it is a ConnectError saying so
        with pytest.raises(ConnectError) as refused:
            await ProtocolClient.connect(sp.url, token="aps_bad")
        assert refused.value.status == 401 and refused.value.fatal and refused.value.code == "invalid_api_key"
    finally:
        sp.kill()


def test_run_behind_a_turn_waiting_for_an_approval_says_so(tmp_path: Path) -> None:
    """`appserver run` into a conversation whose turn waits for an approval printed nothing until
    the approval timed out (600 s): now one stderr line names the call and how to answer it. A
    key sent before says its turn is followed instead of printing the old answer as new."""
    from tests.support.cli import careful_home

    home = careful_home(tmp_path)
    env = cli_env(home)
    sp = start_serve(home, env=env)
    try:
        first = run_cli(home, "run", "--agent", "careful", "--conversation", "new", "--json", "/call clock {}", env=env)
        paused = json.loads(first.out)
        conv = paused["conversation_id"]
        (call,) = [c["call_id"] for c in paused["pending"]]
        with appserver_popen(
            ["run", "--agent", "careful", "--conversation", conv, "--timeout", "60", "behind it"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        ) as behind:
            assert behind.stderr is not None
            line = behind.stderr.readline()  # said at once, not after the approval's 600 s
            assert "queued behind 1 input(s)" in line and call in line and "--approve" in line, line
            approved = run_cli(home, "run", "--agent", "careful", "--conversation", conv, "--approve", call, env=env)
            assert approved.code == 0, approved.err
            out, _ = behind.communicate(timeout=30)
        assert "echo: behind it" in out, out
        once = run_cli(home, "run", "--idempotency-key", "k1", "first", env=env)
        again = run_cli(home, "run", "--idempotency-key", "k1", "second", env=env)
        assert once.out == again.out and "following its turn" in again.err, (once, again)
    finally:
        sp.stop()


def test_a_provider_added_while_the_server_runs_is_named_not_a_traceback(tmp_path: Path) -> None:
    """config.toml gained a provider while `serve` ran; the CLI (reading the new file) let an agent
    use it; its turns failed with a traceback in the server log ("failed inside the server"). Now
    one line says the provider is loaded at the next start."""
    home = tmp_path / "home"
    env = cli_env(home)
    sp = start_serve(home, env=env)
    try:
        config = home / "config.toml"
        config.write_text(
            config.read_text() + '\n[providers.later]\nkind = "openai"\nbase_url = "http://127.0.0.1:9/v1"\n'
        )
        made = run_cli(home, "agents", "create", "--name", "late", "--model", "later:m", env=env)
        assert made.code == 0, made.err
        ran = run_cli(home, "run", "--agent", "late", "hi", env=env)
        assert ran.code != 0 and "loaded at the next start" in ran.err, (ran.code, ran.err)
    finally:
        sp.stop()
    log = sp.proc.stderr.read() if sp.proc.stderr else ""
    assert "Traceback" not in log and "loaded at the next start" in log, log[-2000:]


def test_run_takes_url_and_token_like_chat(srv: Srv, tmp_path: Path) -> None:
    """`run --url … --token …` reaches a server of another home (a laptop driving a small server):
    nothing runs in-process on the local home, the token goes with it, a paused turn's answer hint
    names the same --url, and a bad --url or a refused token is one line (was: no such options)."""
    elsewhere = tmp_path / "laptop"  # no server here: without --url the turn would run in-process
    r = cli(elsewhere, "run", "--url", srv.sp.url, "--token", srv.good, "--json", "over there")
    assert r.code == 0, (r.code, r.out, r.err)
    conv = r.json()["conversation_id"]
    assert r.json()["text"] == "echo: over there"
    hist = cli(srv.home, "conversations", "history", conv, APPSERVER_TOKEN=srv.good)
    assert "over there" in hist.out, (hist.out, hist.err)
    assert not (elsewhere / "appserver.db").exists()  # the local home was not used
    careful = cli(srv.home, "agents", "create", "--name", "careful-url", "--tool", "clock=ask")
    assert careful.code == 0, careful.err
    paused = cli(elsewhere, "run", "--url", srv.sp.url, "--token", srv.good, "--agent", "careful-url", "/call clock {}")
    assert paused.code == 0 and "awaiting approval" in paused.out, (paused.code, paused.out, paused.err)
    assert f"--url {srv.sp.url} --approve CALL_ID" in paused.out, paused.out
    call_id = paused.out.split("awaiting approval: ")[1].split()[0]
    conv = paused.out.split("conversation: ")[1].split()[0]
    answer = ("run", "--url", srv.sp.url, "--token", srv.good, "--agent", "careful-url", "--conversation", conv)
    approved = cli(elsewhere, *answer, "--approve", call_id)
    assert approved.code == 0 and "[clock completed]" in approved.err, (approved.code, approved.out, approved.err)
    one_line(cli(elsewhere, "run", "--url", srv.sp.url, "--token", "aps_bad", "hi"), 1, "refused the token (401")
    one_line(cli(elsewhere, "run", "--url", srv.sp.url, "hi"), 1, "(give --token or set APPSERVER_TOKEN)")
    one_line(cli(elsewhere, "run", "--url", "notaurl", "hi"), 2, "--url: invalid server URL 'notaurl'")
    env_token = cli(elsewhere, "run", "--url", srv.sp.url, "hi", APPSERVER_TOKEN=srv.good)
    assert env_token.code == 0 and "echo: hi" in env_token.out, (env_token.out, env_token.err)
