"""A cron run's `--deliver` reply still being sent when its server stops, on the default file store.

Before the fix the run log ended at `outcome … completed`: no `delivered`, no `delivery_failed`,
the claim stayed `delivering` in crons.json, and the next server (restarted, or a standby that took
the home over) did nothing about it. Now the server that takes over does what the stopped one left
undone, as on a cluster's database (cron/scheduler.py `_resume_orphan`): a reply that may already
have gone out (`delivering`) is recorded `delivery_failed` and not sent again (at most once); one
that had certainly not been sent yet (`settled`) is sent once the channels run.

Real `serve` processes, the real webhook channel and a loopback receiver of its replies, which
answers 503 while it is "down" (the gateway keeps retrying the reply: the window of the bug).
Also: `--at` with a date that does not exist says so (cron/schedule.py `parse_at`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import tomllib
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from cron.runlog import read_runs
from cron.runner import TurnOutcome
from cron.schedule import ScheduleError, ScheduleSpec, parse_at
from cron.scheduler import Scheduler
from cron.store import CronStore, CronTask, Occurrence, make_task
from tests.support.cli import ROOT, CLIResult, cli_env, run_cli
from tests.support.gateway import ChannelServer, gateway_children, start_channel_server, write_config
from tests.support.net import free_port
from tests.support.wait import wait_for
from tests.support.zygote_client import appserver_popen

pytestmark = pytest.mark.timeout(180)

SECRET = "s3cr3t-for-the-webhook"
TARGET = "webhook:home:kitchen"
NOT_SENT_AGAIN = "may or may not have arrived; it is not sent again"


class Receiver:
    """The app receiving the webhook channel's replies. While `down` it answers 503 (counted in
    `refused`), so the gateway keeps retrying; else 200, and the body is kept in `posts`."""

    def __init__(self) -> None:
        self.posts: list[dict[str, Any]] = []
        self.refused = 0
        self.down = True
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's API
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with outer.lock:
                    if outer.down:
                        outer.refused += 1
                        self.send_response(503)
                    else:
                        outer.posts.append(json.loads(body))
                        self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/replies"
        # polled every 0.05 s for the shutdown (the default 0.5 s is what each test's end would wait)
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def up(self) -> None:
        with self.lock:
            self.down = False

    def received(self) -> list[dict[str, Any]]:
        with self.lock:
            return list(self.posts)


@pytest.fixture()
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.server.shutdown()


@pytest.fixture()
def home(tmp_path: Path, receiver: Receiver) -> Path:
    home = tmp_path / "home"
    settings = {
        "listen": f"127.0.0.1:{free_port()}",
        "secret_env": "WH_SECRET",
        "reply_url": receiver.url,
        "default_agent": "assistant",
    }
    write_config(home, {"webhook": {"home": settings}}, ["webhook"])
    return home


def _env(home: Path) -> dict[str, str]:
    return cli_env(home, WH_SECRET=SECRET)


def _ok(home: Path, *args: str) -> CLIResult:
    r = run_cli(home, *args, env=_env(home))
    assert r.code == 0, (args, r.out, r.err)
    return r


def _records(home: Path, task_id: str) -> list[dict[str, Any]]:
    path = home / "cron-runs" / f"{task_id}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _events(home: Path, task_id: str) -> list[str]:
    return [str(r["event"]) for r in _records(home, task_id)]


def _claim(home: Path) -> dict[str, Any]:
    with contextlib.suppress(OSError, ValueError, IndexError, KeyError):
        found = json.loads((home / "crons.json").read_text())["tasks"][0]["last_claimed"]
        return found if isinstance(found, dict) else {}
    return {}


class Servers:
    """The `serve` processes a test starts, and their gateway children: all ended at its end."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.gateways: list[int] = []

    def channel_server(self, home: Path, while_it_starts: Callable[[], object] = lambda: None) -> ChannelServer:
        """A server of the home with its channels running; `while_it_starts` is called once it holds
        the home, while its channels start."""
        srv = start_channel_server(home, env=_env(home))
        self.procs.append(srv.proc)
        while_it_starts()
        srv.wait_channels_ready()
        self.gateways.append(srv.gateway_pid())
        return srv

    def kill9(self, proc: subprocess.Popen[bytes]) -> None:
        """SIGKILL the server and its gateway child (orphaned, it would go on retrying the reply)."""
        children = gateway_children(proc.pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def end(self) -> None:
        """SIGKILL the servers still running (the test's checks are done: a graceful stop would only
        cost the teardown its gateway's shutdown), then every gateway child seen."""
        for proc in self.procs:
            if proc.poll() is None:
                self.gateways += gateway_children(proc.pid)
                proc.kill()
                proc.wait(10)
        for pid in self.gateways:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture()
def servers() -> Iterator[Servers]:
    s = Servers()
    try:
        yield s
    finally:
        s.end()


def _reply_in_flight(
    home: Path, receiver: Receiver, servers: Servers, while_it_starts: Callable[[], object] = lambda: None
) -> tuple[ChannelServer, str]:
    """A server whose cron run's reply is being sent (the receiver refuses it, the gateway keeps
    trying): its outcome is recorded and its claim is at `delivering`."""
    srv = servers.channel_server(home, while_it_starts)
    task_id = str(
        _ok(home, "cron", "add", "--name", "dl", "--agent", "assistant", "--in", "1s", "--exact",
            "--prompt", "say dl", "--deliver", TARGET, "--json").json()["id"]
    )  # fmt: skip
    wait_for(lambda: "outcome" in _events(home, task_id), 30, "the run's outcome")
    wait_for(lambda: _claim(home).get("progress") == "delivering", 30, "the run's reply to be sent")
    wait_for(lambda: receiver.refused > 0, 30, "the gateway to try the reply")
    assert _events(home, task_id) == ["fired", "submitted", "outcome"], _records(home, task_id)
    return srv, task_id


def _assert_not_sent_again(home: Path, receiver: Receiver, task_id: str) -> None:
    wait_for(lambda: "delivery_failed" in _events(home, task_id), 30, "the reply's verdict")
    recs = _records(home, task_id)
    assert [r["event"] for r in recs] == ["fired", "submitted", "outcome", "delivery_failed"], recs
    assert recs[2]["status"] == "completed", recs
    verdict = recs[3]
    assert verdict["occurrence"] == 1 and verdict["target"] == TARGET, verdict
    assert NOT_SENT_AGAIN in verdict["error"], verdict
    claim = _claim(home)
    assert claim.get("progress") == "done" and "open" not in claim, claim
    assert receiver.received() == [], receiver.received()  # never sent again


def test_a_reply_in_flight_at_kill9_is_recorded_delivery_failed_after_a_restart(
    home: Path, receiver: Receiver, servers: Servers
) -> None:
    srv, task_id = _reply_in_flight(home, receiver, servers)
    servers.kill9(srv.proc)
    receiver.up()
    servers.channel_server(home)
    _assert_not_sent_again(home, receiver, task_id)


def test_a_reply_in_flight_at_sigterm_is_recorded_delivery_failed_after_a_restart(
    home: Path, receiver: Receiver, servers: Servers
) -> None:
    srv, task_id = _reply_in_flight(home, receiver, servers)
    srv.stop()  # a clean stop: the delivery is cancelled, the lease released
    assert _claim(home).get("progress") == "delivering", _claim(home)
    receiver.up()
    servers.channel_server(home)
    _assert_not_sent_again(home, receiver, task_id)


def test_a_standby_that_takes_the_home_over_records_the_reply_in_flight(
    home: Path, receiver: Receiver, servers: Servers, tmp_path: Path
) -> None:
    log_path = tmp_path / "standby.log"

    webhook = tomllib.loads((home / "config.toml").read_text())["channels"]["webhook"]["accounts"]["home"]
    port = free_port()
    while f":{port}" in webhook["listen"]:  # chosen before the webhook channel listens: not its port
        port = free_port()

    def start_standby() -> None:
        """Once the first server holds the home: the standby comes up while the run's reply is
        put in flight, and is waiting before that server is killed."""
        with open(log_path, "wb") as out:
            standby = appserver_popen(["serve", "--standby", "--listen", f"127.0.0.1:{port}"],
                                      env=_env(home), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
        servers.procs.append(standby)

    srv, task_id = _reply_in_flight(home, receiver, servers, start_standby)
    wait_for(lambda: "appserver standby:" in log_path.read_text(errors="replace"), 20, "the standby to wait")
    servers.kill9(srv.proc)
    receiver.up()
    _assert_not_sent_again(home, receiver, task_id)


def test_a_reply_not_yet_sent_when_the_server_stopped_is_delivered_once_after_a_restart(
    home: Path, receiver: Receiver, servers: Servers
) -> None:
    """A server stopped after it recorded the outcome but before it started sending the reply (a
    restarted server waits up to 30 s for its channels there): the claim says `settled`, so the
    reply was certainly not sent, and the next server sends it once its channels run."""
    srv, task_id = _reply_in_flight(home, receiver, servers)
    servers.kill9(srv.proc)
    state = json.loads((home / "crons.json").read_text())
    state["tasks"][0]["last_claimed"]["progress"] = "settled"  # stopped just before sending
    (home / "crons.json").write_text(json.dumps(state, indent=2) + "\n")
    receiver.up()
    servers.channel_server(home)
    wait_for(lambda: "delivered" in _events(home, task_id), 30, "the reply to be delivered")
    recs = _records(home, task_id)
    assert [r["event"] for r in recs] == ["fired", "submitted", "outcome", "delivered"], recs
    assert recs[3]["target"] == TARGET, recs
    posts = receiver.received()
    assert len(posts) == 1 and posts[0]["chat"] == "kitchen", posts
    assert "say dl" in posts[0]["text"], posts
    wait_for(lambda: _claim(home).get("progress") == "done", 10, "the run to be done")  # (saved after the record)


# ---------------------------------------------------------------- `--at` with a date that does not exist


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("2026-02-30 10:00", "2026-02-30 is not a date: February 2026 has 28 days"),
        ("2026-04-31 08:00", "2026-04-31 is not a date: April 2026 has 30 days"),
        ("2026-13-01 10:00", "2026-13-01 is not a date: there is no month 13"),
        ("2026-02-10 25:00", "no such time: the hour must be 00 to 23"),
        ("2026-02-10 10:61", "no such time: the minute must be 00 to 59"),
    ],
)
def test_at_names_the_date_or_time_that_does_not_exist(text: str, says: str) -> None:
    with pytest.raises(ScheduleError) as exc:
        parse_at(text, "UTC")
    assert says in str(exc.value) and "use YYYY-MM-DD" not in str(exc.value), str(exc.value)


@pytest.mark.parametrize("text", ["2026-02-30 10:0", "tomorrow", "30.02.2026 10:00", ""])
def test_at_keeps_the_format_hint_for_a_wrongly_written_time(text: str) -> None:
    with pytest.raises(ScheduleError, match="use YYYY-MM-DD HH:MM"):
        parse_at(text, "UTC")


def test_at_a_leap_day_is_a_date() -> None:
    assert parse_at("2028-02-29 10:00", "UTC").day == 29


def test_cron_add_at_a_day_that_does_not_exist_says_so(tmp_path: Path) -> None:
    home = tmp_path / "home"
    r = run_cli(home, "cron", "add", "--name", "x", "--agent", "assistant", "--at", "2026-02-30 10:00",
                "--prompt", "p", env=cli_env(home))  # fmt: skip
    assert r.code != 0, (r.out, r.err)
    assert "2026-02-30 is not a date: February 2026 has 28 days" in r.err, r.err
    assert "use YYYY-MM-DD" not in r.err, r.err


# ---------------------------------------------------------------- one home: the run log is checked against the claim

T0 = datetime(2026, 1, 1, 0, 0, tzinfo=UTC)


class _Fakes:
    """A fake kernel and gateway for a scheduler: every turn completed with a reply; what was sent."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str]] = []

    async def fire(self, task: CronTask, occ: Occurrence) -> str:
        return f"turn_{occ.number}"

    async def claimed_turn(self, task: CronTask, occ: Occurrence) -> str:
        return f"turn_{occ.number}"

    async def outcome(self, turn_id: str) -> TurnOutcome:
        return TurnOutcome("completed", reply=f"reply of {turn_id}")

    async def deliver(self, target: str, text: str) -> list[str]:
        self.sent.append((target, text))
        return ["m1"]


async def _stopped_after_submit(tmp_path: Path) -> tuple[CronStore, CronTask]:
    """A scheduler claimed and submitted run #1 of a delivering task, then stopped."""
    store = CronStore(tmp_path / "home")
    task = store.add(
        make_task(
            name="t",
            agent="echo",
            schedule=ScheduleSpec("every", "1h", "UTC"),
            prompt="p",
            now=T0,
            exact=True,
            deliver=TARGET,
        )  # fmt: skip
    )
    first = Scheduler(store, fire=_Fakes().fire, clock=lambda: T0 + timedelta(hours=1, seconds=1))
    assert [n for _, n, _ in (await first.tick()).fired] == [1]
    await first.close()
    return store, task


async def _take_over(store: CronStore, fakes: _Fakes) -> None:
    s = Scheduler(
        store,
        fire=fakes.fire,
        clock=lambda: T0 + timedelta(hours=1, seconds=30),
        await_outcome=fakes.outcome,
        deliver=fakes.deliver,
        claimed_turn=fakes.claimed_turn,
    )
    assert (await s.tick()).has_lease
    await s.wait_outcomes(10)
    await s.close()


def _progress(store: CronStore, task: CronTask) -> str | None:
    return CronStore(store.home).claim_progress(task.id, 1)[1]


async def test_an_outcome_the_run_log_has_but_the_claim_does_not_is_not_recorded_again(tmp_path: Path) -> None:
    """The claim's `settled` step was not saved (the store could not answer; `take_step` went on),
    the run log recorded the outcome: the run's reply is what is left, sent once, no second outcome."""
    store, task = await _stopped_after_submit(tmp_path)
    assert _progress(store, task) == "submitted"
    store.runlog.record(task.id, "outcome", occurrence=1, turn_id="turn_1", status="completed", error=None)
    fakes = _Fakes()
    await _take_over(store, fakes)
    assert [r["event"] for r in read_runs(store.runs_dir, task.id)] == ["fired", "submitted", "outcome", "delivered"]
    assert fakes.sent == [(TARGET, "reply of turn_1")]
    assert _progress(store, task) == "done"


async def test_a_delivery_the_run_log_has_but_the_claim_does_not_is_not_done_again(tmp_path: Path) -> None:
    """The reply was delivered and recorded; only the claim's `done` was not saved: nothing is sent
    or recorded again, and the claim is closed."""
    store, task = await _stopped_after_submit(tmp_path)
    assert store.advance(task.id, 1, "settled") and store.advance(task.id, 1, "delivering")
    store.runlog.record(task.id, "outcome", occurrence=1, turn_id="turn_1", status="completed", error=None)
    store.runlog.record(task.id, "delivered", occurrence=1, turn_id="turn_1", target=TARGET, remote_ids=["m0"])
    fakes = _Fakes()
    await _take_over(store, fakes)
    assert [r["event"] for r in read_runs(store.runs_dir, task.id)] == ["fired", "submitted", "outcome", "delivered"]
    assert fakes.sent == []
    assert _progress(store, task) == "done"
