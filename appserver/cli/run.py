"""`appserver run`: one turn, in-process, or through the live server's /ws protocol when one owns this home.

In-process, `run` owns the home for the turn as `serve` does (serve.lock, serverinfo.claim_for_turns):
a `serve` started meanwhile is refused, naming it, and a second in-process `run` waits for it.
A server that refuses the first connection because it is stopping is waited for (STOP_WAIT_S);
then the turn runs through the server that replaced it, else in-process (`through_home_server`).
Ctrl-C cancels the turn wherever it runs; SIGTERM/SIGHUP end the command (in-process the turn ends
with it, settled as interrupted; through a server it goes on there). Exit 128 + the signal's number.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import math
import shlex
import signal
import sys
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import click

from appserver.cli.common import cancel_until_done, fail, get_config, print_json, with_server
from appserver.cli.safetext import exact, visible
from appserver.errors import InvalidInput, NotAwaiting
from appserver.runtime import Decision, SubmitRequest, TurnSnapshot, max_steps_note
from appserver.server import Server
from appserver.serverinfo import HomeBusy, HomeLock, HomeStarting, claim_for_turns, holder_text, read_live_server
from appserver.shown import shown

if TYPE_CHECKING:
    from appserver.client import ProtocolClient

T = TypeVar("T")

OPEN_TIMEOUT_S = 10.0  # for the connection and then for the server's welcome (each)
CANCEL_WAIT_S = 3.0  # how long a Ctrl-C waits for the server to confirm the cancel before leaving
ACK_WAIT_S = 30.0  # how long a submit waits for the server to confirm the input (or --timeout, if shorter)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
WORK_STOP_WAIT_S = 5.0  # how long a stop signal waits for the cancelled work to end (then leaves anyway)
WORK_STOP_POLL_S = 0.05  # how often it cancels the work again meanwhile
# How long `run` and `chat` wait for this home's server to exit when it refuses their first
# connection because it is stopping: its stop gives the requests in flight up to 8 s (serve's
# GRACE_S + DRAIN_S), then settles the running turns; a margin on top.
STOP_WAIT_S = 15.0
STOP_POLL_S = 0.05  # how often that wait reads server.json
START_WAIT_S = 20.0  # how long `run` and `chat` wait for this home's server to say where it listens as it starts


class Interrupted(Exception):
    """The command was stopped by a signal; `what` says what became of the turn."""

    def __init__(self, signum: int, what: str) -> None:
        super().__init__(what)
        self.signum, self.what = signum, what


class InputNotConfirmed(Exception):
    """The server never confirmed the submitted input (no ack within `waited` seconds): it may
    have taken it and started a turn, or not."""

    def __init__(self, waited: float, may_have_started: str) -> None:
        super().__init__(f"no ack within {waited:g} s")
        self.waited, self.may_have_started = waited, may_have_started


class TurnNotSettled(Exception):
    """The turn did not settle within --timeout (a TimeoutError of our own: asyncio's is an
    OSError, which the CLI's error handling would take for a file's)."""


async def until_signal(work: Awaitable[T], on_signal: Callable[[int], Awaitable[str]]) -> T:
    """Await `work`; SIGINT, SIGTERM or SIGHUP cancels it, then `on_signal(signum)` (which cancels
    the turn or not, and says so) runs and Interrupted is raised. A second signal meanwhile is
    ignored: the turn is being ended already. So is any signal after, to the end of the process:
    the in-process server is closing and settles the turn (Python's own SIGINT handler, put back
    here, raised KeyboardInterrupt inside that close and left the turn `running`).

    `work` runs as a task of its own and the signal is a future this task waits for beside it: a
    signal cancelled this task instead, and Python 3.11's `asyncio.wait_for` drops a cancel that
    lands as its inner awaitable completes (the server's reply to the submit arriving with the
    Ctrl-C): the work went on waiting for the turn, every later signal ignored (found by a flaky
    test). The work's cancel is sent again until it ends, for at most WORK_STOP_WAIT_S."""
    loop = asyncio.get_running_loop()
    job = asyncio.ensure_future(work)
    job.add_done_callback(_retrieved)
    signalled: asyncio.Future[int] = loop.create_future()

    def stop(signum: int) -> None:
        if not signalled.done():
            signalled.set_result(signum)

    for signum in STOP_SIGNALS:
        loop.add_signal_handler(signum, stop, signum)
    try:
        try:
            await asyncio.wait((job, signalled), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # this command's own cancel: the work ends with it
            job.cancel()
            raise
        if job.done():  # it ended first (or with the signal): what it came to stands
            return job.result()
        got = signalled.result()
        await cancel_until_done(job, WORK_STOP_WAIT_S, WORK_STOP_POLL_S)  # again and again: see above
        raise Interrupted(got, await on_signal(got))
    finally:
        for signum in STOP_SIGNALS:  # to the end of the process: the command is ending
            try:
                loop.remove_signal_handler(signum)
                signal.signal(signum, signal.SIG_IGN)
            except KeyboardInterrupt:
                # asyncio puts Python's own SIGINT handler back before SIG_IGN replaces it: a Ctrl-C
                # in that moment (a stop and a Ctrl-C a few ms apart) raised here, and the command
                # said "no turn was started" of a turn it had interrupted. Ignored like any other.
                signal.signal(signum, signal.SIG_IGN)


def _retrieved(job: asyncio.Future[Any]) -> None:
    """The work's exception is read (a cancelled or interrupted work's is not news)."""
    if not job.cancelled():
        job.exception()


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


@contextlib.contextmanager
def signals_end_the_wait(what: str = "no turn was started") -> Iterator[None]:
    """Around a wait outside an event loop (for this home's server while it starts, for another
    in-process run's turn): SIGINT, SIGTERM and SIGHUP end the command as `until_signal` ends a
    turn's work, with one error line (`interrupted by SIGINT: no turn was started`) and exit 128 +
    the signal. Python's own handling printed click's "Aborted!" (exit 1) for a Ctrl-C there, and
    SIGTERM/SIGHUP killed the process without a word. After the first signal all three are ignored
    (the command is ending); without one, the handlers from before are put back."""
    stopped: list[int] = []

    def stop(signum: int, frame: object) -> None:
        if stopped:
            return
        stopped.append(signum)
        for each in STOP_SIGNALS:
            signal.signal(each, signal.SIG_IGN)
        raise Interrupted(signum, what)

    before = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    for signum in STOP_SIGNALS:
        signal.signal(signum, stop)
    try:
        yield
    except Interrupted as exc:
        fail(f"interrupted by {signal_name(exc.signum)}: {exc.what}", 128 + exc.signum)
    finally:
        if not stopped:
            for signum, handler in before.items():
                signal.signal(signum, signal.SIG_DFL if handler is None else handler)


def tell_starting(wait_s: float) -> Callable[[dict[str, Any] | None], None]:
    """The one stderr line of a command that waits (longer than a moment) for this home's server
    while it starts: it holds the home but has not said where it listens yet (`find_live_server`)."""

    def tell(holder: dict[str, Any] | None) -> None:
        who = f": {holder_text(holder)}" if holder is not None else ""
        click.echo(f"[waiting up to {wait_s:g} s for the server starting on this home{who}]", err=True)

    return tell


class Seconds(click.ParamType[float]):
    """A finite number of seconds, at least 0 (`zero`) or more than 0: `-1`, `nan` and `inf` are
    usage errors (exit 2), not a wait that never ends or ends at once."""

    name = "seconds"

    def __init__(self, *, zero: bool) -> None:
        self.zero = zero

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            self.fail(f"{shown(value)} is not a number of seconds", param, ctx)
        if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not self.zero):
            self.fail(f"{shown(value)}: give a finite number of seconds {'≥ 0' if self.zero else '> 0'}", param, ctx)
        return seconds


def reconnect_wait_option() -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """`--reconnect-wait` of `run` and `chat`."""
    return click.option(
        "--reconnect-wait",
        default=30.0,
        show_default=True,
        type=Seconds(zero=True),
        help="Seconds to wait for the server (or a standby taking over) after the connection drops (0: do not wait).",
    )


def render(
    snapshot: TurnSnapshot,
    conversation_id: str,
    as_json: bool,
    agent: str,
    url: str | None = None,
    steps: int | None = None,
) -> int:
    """Print the turn; `agent` is how the user named the agent (the answer hint names it too, and
    the `--url` the user gave, so that it reaches the same server); `steps`, the agent's step limit
    when known.

    A turn stopped at max_steps completed (exit 0: what it said stands, and another message lets
    it go on) but says so on stderr, where `run` puts every note about the turn (tool lines, a
    failure), so that stdout stays the reply alone; `--json` has it as `stop_reason`.

    The plain text is for a person, on a terminal or through a pipe that often ends at one (`| less
    -R`, a log `cat` later): the model's, tools' and server's words go through `visible`/`exact`.
    `--json` keeps every value exact (for scripts)."""
    if as_json:
        print_json({**snapshot.to_dict(), "text": snapshot.text(), "conversation_id": conversation_id})
    else:
        for block in snapshot.blocks:
            if block["type"] == "tool_call" and block.get("output") is not None:
                click.echo(f"[{exact(block['name'])} {exact(block['status'])}] {visible(block['output'])}", err=True)
        text = snapshot.text()
        if text:
            click.echo(visible(text))
        if snapshot.status == "awaiting":
            for p in snapshot.pending:
                verb = "approval" if p["kind"] == "approval" else "a client result"
                click.echo(f"awaiting {verb}: {exact(p['call_id'])} {exact(p['name'])}({exact(p['arguments'])})")
            # The hint must work as printed, with or without a server: a conversation id alone
            # resolves only under its own agent.
            again = f"appserver run --agent {shlex.quote(agent)} --conversation {exact(conversation_id)}"
            if url is not None:
                again = f"{again} --url {shlex.quote(exact(url))}"
            click.echo(
                f"conversation: {exact(conversation_id)}  "
                f"(answer with: {again} --approve CALL_ID | {again} --deny CALL_ID --reason TEXT)"
            )
        elif snapshot.status == "completed" and snapshot.stop_reason == "max_steps":
            click.echo(max_steps_note(steps), err=True)
        elif snapshot.status != "completed":
            error = snapshot.error or {}
            label = {"interrupted": "interrupted", "unknown": "ended"}.get(str(error.get("kind")), snapshot.status)
            click.echo(f"turn {visible(label)}: {visible(error.get('message') or snapshot.stop_reason)}", err=True)
    return 0 if snapshot.status in ("completed", "awaiting") else 1


IDEMPOTENCY_KEY_MAX = 256  # as the protocol takes it (ws/frames.py SubmitInput)
# Who answered an approval with `--approve`/`--deny`, in-process and through a server alike (the
# client name a server records as `decided_by`): the model reads "denied … by appserver-run".
RUN_CLIENT = "appserver-run"


@click.command("run")
@click.option("--agent", default="assistant", show_default=True, help="Agent id or name.")
@click.option("--conversation", default="default", show_default=True, help="new, default or a conversation id.")
@click.option("--approve", "approve", multiple=True, help="Approve a pending call (repeatable).")
@click.option("--deny", "deny", multiple=True, help="Deny a pending call (repeatable).")
@click.option("--reason", default=None, help="Reason given with --deny.")
@click.option(
    "--idempotency-key",
    default=None,
    help="Up to 256 characters: a run sent again with the same key follows the first one's turn instead of "
    "running the input twice.",
)
@click.option(
    "--timeout", default=600.0, show_default=True, type=Seconds(zero=False), help="Seconds to wait for the turn."
)
@reconnect_wait_option()
@click.option(
    "--url",
    default=None,
    help="Server URL: run the turn there (default: the server running on this home, else in-process).",
)
@click.option("--token", default=None, envvar="APPSERVER_TOKEN", help="Bearer token when the server requires one.")
@click.option("--json", "as_json", is_flag=True, help="Print the outcome as one JSON object.")
@click.argument("text", required=False)
def run_command(
    agent: str,
    conversation: str,
    approve: tuple[str, ...],
    deny: tuple[str, ...],
    reason: str | None,
    idempotency_key: str | None,
    timeout: float,
    reconnect_wait: float,
    url: str | None,
    token: str | None,
    as_json: bool,
    text: str | None,
) -> None:
    """Run one turn of AGENT with TEXT and print the reply."""
    answering = bool(approve or deny)
    if answering and text:
        fail("give either TEXT or --approve/--deny, not both", 2)
    if not answering and not text:
        fail("nothing to send: give TEXT (or --approve/--deny CALL_ID)", 2)
    if reason is not None and not deny:
        fail("--reason goes with --deny CALL_ID (it is the reason the call was denied)", 2)
    if not conversation.strip():  # in-process it ran in `default`; a server refused it in pydantic's words
        fail("--conversation is empty: give new, default or a conversation id", 2)
    if answering and conversation.strip().lower() == "new":  # said alike in-process and through a server
        fail("'new' is not an existing conversation: --approve/--deny answer a waiting turn (give its conversation)", 2)
    if idempotency_key is not None:
        # as the server takes it over the protocol (`submit_input.idempotency_key`), also in-process
        if not idempotency_key or len(idempotency_key) > IDEMPOTENCY_KEY_MAX:
            fail(f"--idempotency-key takes 1 to {IDEMPOTENCY_KEY_MAX} characters (got {len(idempotency_key)})", 2)
        if any(c < " " or c == "\x7f" for c in idempotency_key):
            fail("--idempotency-key must not hold control characters", 2)

    def remote_turn(server_url: str, url_source: Callable[[], str | None] | None, home: HomeServer | None) -> NoReturn:
        snap, conversation_id = run_remote_or_fail(
            server_url,
            agent,
            conversation,
            text,
            approve,
            deny,
            reason,
            idempotency_key,
            timeout,
            reconnect_wait=reconnect_wait,
            url_source=url_source,
            token=token,
            token_how="give --token or set APPSERVER_TOKEN" if url is not None else "set APPSERVER_TOKEN",
            home=home,
        )
        sys.exit(render(snap, conversation_id, as_json, agent, url))

    if url is not None:
        # another server (or this home's, named): its home is not read, nothing runs in-process
        from appserver.client import ConnectError, check_url

        try:
            check_url(url)
        except ConnectError as exc:
            fail(f"--url: {exc.message}", 2)
        remote_turn(url, None, None)
    config = get_config()
    # a server owns this home: the turn runs through its WebSocket protocol (never beside it)
    lock: HomeLock | None = through_home_server(config.server_json, timeout, remote_turn)

    steps: int | None = None
    running: list[tuple[str, str]] = []  # (conversation, turn) once known: what a Ctrl-C cancels

    async def ended_by(s: Server, signum: int) -> str:
        """In-process: Ctrl-C cancels the turn; SIGTERM/SIGHUP leave it to the close that follows,
        which settles it as interrupted (as a stopping server does). Either way it ends here."""
        if signum == signal.SIGINT and running:
            if await s.kernel.cancel(*running[-1]):
                return "the turn was cancelled"
        return "the turn was interrupted" if running else "no turn was started"

    async def go(s: Server) -> tuple[TurnSnapshot, str]:
        return await until_signal(turn(s), lambda signum: ended_by(s, signum))

    async def turn(s: Server) -> tuple[TurnSnapshot, str]:
        if answering:
            rec = await s.kernel.resolve_agent(agent)
            conv = await s.kernel.resolve_conversation(rec, conversation, create=False)
            turn = await s.kernel.awaiting(conv.id)
            if turn is None:
                raise NotAwaiting(f"conversation {conv.id} has no turn waiting for an answer")
            handle = await s.kernel.handle_for(turn)
            running.append((conv.id, turn.id))
            before = handle.controller.revision
            decisions = [Decision(c, "approve", decided_by=RUN_CLIENT) for c in approve]
            decisions += [Decision(c, "deny", reason=reason, decided_by=RUN_CLIENT) for c in deny]
            results = await s.kernel.respond(conv.id, decisions)
            refused = [r for r in results if not r["accepted"]]
            if refused:
                raise InvalidInput("; ".join(r["message"] for r in refused))
            snap = await settled(handle.wait_settled(timeout, after_revision=before))
            await limit_of(s, snap)
            return snap, conv.id
        assert text is not None
        sub = await s.kernel.submit(
            SubmitRequest(
                agent=agent,
                input=text,
                conversation=conversation,
                idempotency_key=idempotency_key,
                source={"client": "cli"},
            )
        )
        running.append((sub.conversation_id, sub.turn_id))
        if sub.duplicate:  # as through a server (tell_waiting): the earlier input's turn, not this text's
            tell_duplicate(sub.turn_id)
        snap = await settled(sub.wait(timeout))
        await limit_of(s, snap)
        return snap, sub.conversation_id

    async def limit_of(s: Server, snap: TurnSnapshot) -> None:
        """The step limit a max_steps stop names (the agent's param, else the server's limit)."""
        nonlocal steps
        if snap.stop_reason == "max_steps":
            rec = await s.kernel.resolve_agent(snap.agent_id)
            steps = step_limit(rec.params.get("max_steps"), s.config.limits.max_steps)

    try:
        snap, conversation_id = with_server(go, config=config)
    except TurnNotSettled:
        fail(f"the turn did not settle within {timeout:g} s", 1)
    except Interrupted as exc:
        fail(f"interrupted by {signal_name(exc.signum)}: {exc.what}", 128 + exc.signum)
    except KeyboardInterrupt:  # a Ctrl-C before the turn was under way (opening the store)
        fail("interrupted by SIGINT: no turn was started", 128 + signal.SIGINT)
    finally:
        if lock is not None:
            lock.release()
    sys.exit(render(snap, conversation_id, as_json, agent, steps=steps))


async def settled(wait: Awaitable[TurnSnapshot]) -> TurnSnapshot:
    """The settled snapshot; a timeout as TurnNotSettled (see there)."""
    try:
        return await wait
    except TimeoutError:
        raise TurnNotSettled from None


def own_home_or_server(server_json: Path, wait_s: float) -> tuple[dict[str, Any] | None, HomeLock | None]:
    """The live server to run the turn through, or this home's lock, held, to run it in-process;
    another in-process run's turn is waited for (up to `wait_s`, the turn's --timeout)."""

    def waiting(holder: dict[str, Any]) -> None:
        click.echo(f"[waiting: {holder_text(holder)} is running a turn in-process on this home]", err=True)

    try:
        with signals_end_the_wait():
            return claim_for_turns(server_json, wait_s, waiting, START_WAIT_S, tell_starting(START_WAIT_S))
    except HomeBusy as exc:
        fail(str(exc), 3)
    except HomeStarting as exc:
        fail(f"{exc}; try again in a moment", 3)


def through_home_server(
    server_json: Path,
    wait_s: float,
    remote_turn: Callable[[str, Callable[[], str | None], HomeServer | None], NoReturn],
) -> HomeLock:
    """Run the turn through this home's live server (`remote_turn` exits), or return the home's lock,
    held, to run it in-process. A server that refuses the first connection as it stops is waited for
    once (`connect_first`); then the choice is made again: the server that replaced it (a restart, a
    standby), else in-process, since the home is free. Nothing was sent, so nothing runs twice."""
    home_wait = True
    while True:
        live, lock = own_home_or_server(server_json, wait_s)
        if live is None:
            assert lock is not None
            return lock
        home = HomeServer(server_json, str(live.get("identity") or "")) if home_wait else None
        try:
            remote_turn(str(live.get("url")), server_url_source(server_json), home)
        except ServerGone:
            home_wait = False
            signals_as_at_start()


def signals_as_at_start() -> None:
    """The stop signals' default actions again: `until_signal` ignores them once its work is over,
    as the command then ends, but after a server's stop the command goes on."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


@dataclass(frozen=True)
class HomeServer:
    """The server this home's server.json named (`identity`: its process), whose stop a refused first
    connection waits for."""

    server_json: Path
    identity: str


class ServerGone(Exception):
    """This home's server stopped (or was replaced) before it took anything from this command: its
    first connection was refused. The caller chooses anew where to go (`through_home_server`)."""


def refused_while_stopping(exc: BaseException) -> bool:
    """Whether opening the connection failed as a stopping server fails it: its listener is closed
    (refused, or reset while queued), or a 503 `server_shutting_down`. Nothing was sent."""
    from appserver.client import ConnectError

    if isinstance(exc, ConnectError):
        return exc.status == 503 and exc.code == "server_shutting_down"
    return isinstance(exc, OSError) and exc.errno in (errno.ECONNREFUSED, errno.ECONNRESET)


async def connect_first(url: str, home: HomeServer | None, **options: Any) -> ProtocolClient:
    """`ProtocolClient.connect(url, **options)` for `run` and `chat`. When this home's server (`home`)
    refuses it as it stops, wait for that server to go (up to STOP_WAIT_S, said on stderr), then raise
    ServerGone; one still there after that is the refusal, as before."""
    from appserver.client import ProtocolClient, ProtocolError

    try:
        return await ProtocolClient.connect(url, **options)
    except (OSError, ProtocolError) as exc:
        if home is None or not refused_while_stopping(exc):
            raise
        click.echo(
            f"[the server at {visible(url)} is stopping; waiting up to {STOP_WAIT_S:g} s for it to exit]", err=True
        )
        if await server_went(home, STOP_WAIT_S):
            raise ServerGone(url) from None
        raise


async def server_went(home: HomeServer, wait_s: float) -> bool:
    """True once server.json no longer names a live `home` server (its process ended, or another
    server took over); False when it still does after `wait_s`. Polled on the loop, so a signal ends
    the wait at once."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while True:
        live = read_live_server(home.server_json)
        if live is None or live.get("identity") != home.identity:
            return True
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(STOP_POLL_S)


def run_remote_or_fail(*args: Any, **kwargs: Any) -> tuple[TurnSnapshot, str]:
    """`run_remote`, a signal's end as one line and exit 128 + its number."""
    try:
        return run_remote(*args, **kwargs)
    except Interrupted as exc:
        fail(f"interrupted by {signal_name(exc.signum)}: {exc.what}", 128 + exc.signum)
    except KeyboardInterrupt:
        fail("interrupted by SIGINT", 128 + signal.SIGINT)


def step_limit(param: Any, default: int) -> int | None:
    """The agent's step limit: its `max_steps` param, else the server's `limits.max_steps`."""
    try:
        return int(param or default)
    except (TypeError, ValueError):
        return None


class RetryTeller:
    """One stderr line per provider retry of a turn run through a server (`phase` `retrying`, a
    new `attempt`), so `run` is not silent while the server waits out an upstream's 429 or 5xx
    (its Retry-After). In-process the server's own log line says it already."""

    def __init__(self) -> None:
        self.told = 0

    def see(self, snap: dict[str, Any]) -> None:
        attempt = snap.get("attempt")
        if snap.get("phase") != "retrying" or not isinstance(attempt, int) or attempt <= self.told:
            return
        self.told = attempt
        error = snap.get("error")
        if not isinstance(error, dict):
            error = {}
        why = " ".join(visible(x) for x in (error.get("kind"), error.get("status")) if x is not None)
        said = visible(error.get("message") or "")[:200]
        detail = f" ({why}{': ' + said if said else ''})" if why or said else ""
        click.echo(f"[the model's provider failed{detail}; retrying: attempt {attempt}]", err=True)


def snapshot_from_dict(d: dict[str, Any]) -> TurnSnapshot:
    return TurnSnapshot(
        turn_id=d["turn_id"],
        conversation_id=d["conversation_id"],
        agent_id=d["agent_id"],
        revision=d["revision"],
        status=d["status"],
        phase=d["phase"],
        stop_reason=d.get("stop_reason"),
        blocks=tuple(d.get("blocks") or ()),
        pending=tuple(d.get("pending") or ()),
        usage=dict(d.get("usage") or {}),
        error=d.get("error"),
        queue_position=d.get("queue_position", 0),
        attempt=d.get("attempt", 1),
        updated_at=d.get("updated_at", 0.0),
    )


USAGE_ERRORS = frozenset(
    {
        "bad_frame",
        "frame_too_large",
        "invalid_url",
        "invalid_request",
        "not_found",
        "agent_not_found",
        "conversation_not_found",
        "agent_ambiguous",
        "not_awaiting",
        "conflict",
        "forbidden",
        "unknown_call",
        "already_resolved",
    }
)


def server_url_source(server_json: Path) -> Callable[[], str | None]:
    """Where this home's server is now (a standby that took over may listen on another port)."""

    def url() -> str | None:
        live = read_live_server(server_json)
        return str(live["url"]) if live and live.get("url") else None

    return url


def tell_connection(frame: dict[str, Any]) -> None:
    """One stderr line per local connection event of a reconnecting client."""
    if frame.get("type") != "event" or not frame.get("local"):
        return
    data = frame.get("data") or {}
    if frame.get("name") == "connection_lost":
        click.echo(
            f"[connection lost ({visible(data.get('code'))} {visible(data.get('reason') or '')}".rstrip()
            + f"); waiting up to {data.get('reconnect_s'):g} s for the server or a standby]",
            err=True,
        )
    elif frame.get("name") == "reconnected":
        click.echo(f"[reconnected to {visible(data.get('url'))} after {visible(data.get('after_s'))} s]", err=True)


def tell_duplicate(turn_id: Any) -> None:
    """One stderr line when an earlier input had the same idempotency key: its turn is what is shown,
    not a reply to the text given now (in-process or through a server alike)."""
    click.echo(f"[an input with this idempotency key was sent before: following its turn {visible(turn_id)}]", err=True)


async def tell_waiting(client: Any, ack: dict[str, Any]) -> None:
    """One stderr line when the input will not run at once, instead of silence until it does: an
    earlier input with the same key (its turn is followed), or turns ahead of it, one of them maybe
    waiting for an approval (which only an answer or its timeout ends)."""
    if ack.get("duplicate"):
        tell_duplicate(ack.get("turn_id"))
        return
    ahead = ack.get("queue_position")
    if not isinstance(ahead, int) or ahead <= 0:
        return
    line = f"[queued behind {ahead} input(s)"
    try:
        state = await client.request({"type": "subscribe", "conversation": ack["conversation_id"]})
    except Exception:  # noqa: BLE001 - only a hint: the turn is followed all the same
        state = {}
    calls = [str(p.get("call_id")) for p in state.get("pending_approvals") or [] if isinstance(p, dict)]
    if state.get("state") == "awaiting" and calls:
        ids = " ".join(visible(c) for c in calls)
        line += f"; the turn ahead waits for an answer to {ids}: `appserver run --approve ID` or `--deny ID`"
    click.echo(line + "]", err=True)


def run_remote(
    url: str,
    agent: str,
    conversation: str,
    text: str | None,
    approve: tuple[str, ...],
    deny: tuple[str, ...],
    reason: str | None,
    idempotency_key: str | None,
    timeout: float,
    *,
    reconnect_wait: float = 30.0,
    url_source: Callable[[], str | None] | None = None,
    token: str | None = None,
    token_how: str = "give --token or set APPSERVER_TOKEN",
    home: HomeServer | None = None,
) -> tuple[TurnSnapshot, str]:
    """One turn (or the answers to a paused one) through a live server's /ws protocol; the outcome
    is awaited across a failover (the client reconnects, possibly to a standby elsewhere). `home`:
    the home's server, whose stop a refused first connection waits for (`connect_first`)."""
    from appserver.client import ProtocolError

    teller = RetryTeller()
    # this home's server (found through server.json) is the one `conversations list` reads
    may_have_started = MAY_HAVE_STARTED + (LISTED_HERE if url_source is not None else "")

    async def on_frame(frame: dict[str, Any]) -> None:
        tell_connection(frame)
        snap = frame.get("snapshot")
        if frame.get("type") == "turn_updated" and isinstance(snap, dict):
            teller.see(snap)

    running: list[tuple[str, str]] = []  # (conversation, turn) once known: what a Ctrl-C cancels
    clients: list[Any] = []
    # The submit in flight, a task of its own: a stop signal cancels the exchange (again and again,
    # until it ends), never the wait for the ack, so a turn the server took is known by its ack
    # (and a Ctrl-C cancels it) rather than said not started while it runs on.
    submitting: list[asyncio.Future[dict[str, Any]]] = []

    async def ended_by(signum: int) -> str:
        """Through a server, only Ctrl-C cancels the turn (as chat's first Ctrl-C does); SIGTERM and
        SIGHUP leave it running there: the command ends, not the turn."""
        if not running and submitting:
            said = await _submit_outcome(submitting[-1], running, may_have_started)
            if said is not None:
                return said
        if not running or not clients:
            return "no turn was started"
        conv_id, turn_id = running[-1]
        if signum != signal.SIGINT:
            return f"the turn goes on on the server (`appserver conversations history {conv_id}` shows it)"
        frame = {"type": "cancel", "conversation": conv_id, "turn_id": turn_id}
        try:
            ack = await asyncio.wait_for(clients[0].request(frame), CANCEL_WAIT_S)
        except Exception:  # noqa: BLE001 - not confirmed (the server is gone, or slow): say so, leave anyway
            return f"the server did not confirm the cancel of turn {turn_id}"
        return "the turn was cancelled" if ack.get("cancelled") else "the turn had ended already"

    async def go() -> tuple[TurnSnapshot, str]:
        try:
            return await until_signal(exchange(), ended_by)
        finally:
            if clients:
                await clients[0].close()

    async def exchange() -> tuple[TurnSnapshot, str]:
        client = await connect_first(
            url,
            home,
            token=token,
            client=RUN_CLIENT,
            open_timeout=min(OPEN_TIMEOUT_S, timeout),  # a short --timeout bounds the wait for the welcome too
            reconnect=reconnect_wait > 0,
            reconnect_s=reconnect_wait,
            url_source=url_source,
        )
        clients.append(client)
        if approve or deny:
            state = await client.request({"type": "subscribe", "conversation": conversation, "agent": agent})
            conv_id = state["conversation"]["id"]
            active = state.get("active_turn")
            if state["state"] != "awaiting" or not active:
                raise ProtocolError("not_awaiting", f"conversation {conv_id} has no turn waiting for an answer")
            running.append((conv_id, active["turn_id"]))
            decisions: list[dict[str, str | None]] = [{"call_id": c, "decision": "approve"} for c in approve]
            decisions += [{"call_id": c, "decision": "deny", "reason": reason} for c in deny]
            ack = await client.request({"type": "approval_response", "conversation": conv_id, "decisions": decisions})
            refused = [r for r in ack.get("results") or [] if not r.get("accepted")]
            if refused:
                raise ProtocolError(
                    refused[0].get("error") or "invalid_request", "; ".join(r.get("message", "") for r in refused)
                )
            snap = await wait_answered(client, active, {*approve, *deny}, timeout, on_frame)
            return snapshot_from_dict(snap), conv_id
        assert text is not None
        # a key of our own makes re-sending the input after a reconnect safe (it never runs twice)
        extra: dict[str, Any] = {
            "source": {"client": "cli"},
            "idempotency_key": idempotency_key or f"run-{uuid.uuid4().hex}",
        }
        frame = {"type": "submit_input", "agent": agent, "conversation": conversation, "input": text, **extra}
        ack_wait = min(ACK_WAIT_S, timeout)  # --timeout bounds the wait for the ack too
        submitting.append(asyncio.ensure_future(client.request(frame, timeout=ack_wait)))
        try:
            ack = await asyncio.shield(submitting[-1])
        except TimeoutError:
            raise InputNotConfirmed(ack_wait, may_have_started) from None
        running.append((ack["conversation_id"], ack["turn_id"]))
        await tell_waiting(client, ack)
        snap = await client.wait_turn(ack["turn_id"], timeout=timeout, on_frame=on_frame)
        return snapshot_from_dict(snap), ack["conversation_id"]

    return call_server(go, url, timeout, token_how)


async def _submit_outcome(
    submitted: asyncio.Future[dict[str, Any]], running: list[tuple[str, str]], may_have_started: str
) -> str | None:
    """A stop signal came while the submit waited for its ack: the ack, awaited a little longer,
    names the turn (added to `running`; None returned); a refusal means no turn; no ack in time, or
    a connection lost before it, is said as it is (the server may have taken the input)."""
    from appserver.client import Closed, ProtocolError

    try:
        ack = await asyncio.wait_for(asyncio.shield(submitted), CANCEL_WAIT_S)
    except TimeoutError:
        submitted.cancel()
        return f"the server did not confirm the input in time, so {may_have_started}"
    except Closed:  # the connection went before the ack: the server may have taken the input
        return f"the connection was lost before the server confirmed the input, so {may_have_started}"
    except ProtocolError:  # the server refused it: nothing was taken
        return "no turn was started"
    running.append((ack["conversation_id"], ack["turn_id"]))
    return None


MAY_HAVE_STARTED = "a turn may have started there"
# what lists this home's server's conversations (`conversations list` reads no --url)
LISTED_HERE = " (`appserver conversations list` shows it)"


async def wait_answered(
    client: Any,
    active: dict[str, Any],
    answered: set[str],
    timeout: float,
    on_frame: Callable[[dict[str, Any]], Coroutine[Any, Any, None]],
) -> dict[str, Any]:
    """The turn's next settled snapshot in which the answered calls no longer wait: a snapshot
    still awaiting them is the state before the answer landed, sent again (a server of a cluster
    that took the turn over re-sends it at a higher revision), not the outcome."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    after = active["revision"]
    while True:
        left = deadline - loop.time()
        if left <= 0:
            raise TimeoutError
        snap: dict[str, Any] = await client.wait_turn(
            active["turn_id"], after_revision=after, timeout=left, on_frame=on_frame
        )
        waiting = {p.get("call_id") for p in snap.get("pending") or [] if isinstance(p, dict)}
        if snap.get("status") != "awaiting" or not waiting & answered:
            return snap
        after = snap.get("revision", after)


def call_server(
    go: Callable[[], Coroutine[Any, Any, T]], url: str, timeout: float, token_how: str = "set APPSERVER_TOKEN"
) -> T:
    """Run one protocol exchange with the live server; every failure is a one-line CLI error."""
    from appserver.client import ProtocolError, shown_url

    try:
        return asyncio.run(go())
    except InputNotConfirmed as exc:
        fail(f"the server did not confirm the input within {exc.waited:g} s, so {exc.may_have_started}", 1)
    except TimeoutError:
        fail(f"the turn did not settle within {timeout:g} s", 1)
    except ProtocolError as exc:
        fail(exc.message + token_hint(exc.code, token_how), 2 if exc.code in USAGE_ERRORS else 1)
    except OSError as exc:
        fail(f"cannot reach the server at {shown_url(url)}: {exc}", 1)


def token_hint(code: str, how: str) -> str:
    """What to do about a server that wants a token the command did not send."""
    return f" ({how})" if code == "missing_api_key" else ""


def snapshot_summary(snapshot: TurnSnapshot) -> dict[str, Any]:
    return {"status": snapshot.status, "stop_reason": snapshot.stop_reason, "text": snapshot.text()}
