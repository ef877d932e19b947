"""The parts of the cron CLI that need the kernel: `appserver cron run N` (its command is declared in
`cli/cron.py`, which imports this module only when it runs) and the agent lookups of `cron add`."""

from __future__ import annotations

import asyncio
import shlex
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import click

from appserver.cli.common import fail, get_config, print_json
from appserver.cli.run import own_home_or_server
from appserver.cli.safetext import exact, visible
from appserver.config import Config
from appserver.errors import Conflict, KernelError
from appserver.server import Server
from cron.adapter import KernelAdapter
from cron.runner import run_task_now
from cron.store import CorruptStateFile, CronNotFound, CronStoreError
from cron.stores import cron_store_for

if TYPE_CHECKING:
    from appserver.client import ProtocolClient


def validate_agent(config: Config, agent: str) -> str:
    """The id of an existing agent (by id or unique name); LookupError otherwise."""

    async def go() -> str:
        server = Server(config)
        await server.open()  # the first use of a home creates `assistant`
        try:
            return (await server.kernel.resolve_agent(agent)).id
        except KernelError as exc:
            raise LookupError(exc.message) from None
        finally:
            await server.close()

    return asyncio.run(go())


def agent_names(config: Config) -> dict[str, str]:
    """Agent id → name, for cron output (read from the store only; no SQLite store yet: none)."""
    if not config.store.url and not config.db_path.exists():
        return {}

    async def go() -> dict[str, str]:
        store = Server(config).store
        await store.open()
        try:
            return {a.id: a.name for a in await store.list_agents()}
        finally:
            await store.close()

    return asyncio.run(go())


def run_now(task: str, agent: str | None, timeout: float, as_json: bool, reconnect_wait: float = 30.0) -> None:
    """Run TASK now: through the live server when one owns the home, else in this process."""
    config = get_config()
    # the home's lock, held while this process runs the turn, as `appserver run` and `serve` hold it
    live, _lock = own_home_or_server(config.server_json, timeout)
    if live is not None:
        # a server owns this home: it runs the turn (the `cron_run` frame), never this process
        report(run_remote(config, str(live.get("url")), task, agent, timeout, reconnect_wait), as_json)
    agent_id = validate_agent(config, agent) if agent else None

    async def go() -> dict[str, Any]:
        server = Server(config)
        await server.open()
        try:
            if not server.kernel.runs_turns:
                # before the claim: a run claimed here could never be submitted (no lease)
                raise Conflict(
                    "turns of a PostgreSQL store run only in its servers (appserver serve), and none runs on this "
                    "home: run `appserver cron run` on the home of a running server, which submits it"
                )
            adapter = KernelAdapter(server.kernel, server.store)
            store = cron_store_for(config.home, config.store.url)
            store.runlog.retries = False  # this process ends with the run: what is not written is said at the end
            result = await run_task_now(
                store,
                task,
                agent=agent_id,
                fire=adapter.fire,
                await_outcome=adapter.outcome,
                outcome_timeout_s=timeout,
            )
            snapshot = (await server.kernel.turn_snapshot(result.turn_id)).to_dict() if result.turn_id else None
            unwritten, why = await asyncio.to_thread(store.runlog.unwritten)
        finally:
            await server.close()
        runlog_error = None
        if unwritten:
            runlog_error = (
                f"its run log in {store.runs_dir} could not be written ({why}): {unwritten} record(s) of this run "
                "are lost, so `appserver cron logs` will not show it; fix the run log (free space, or remove "
                "what is in its place)"
            )
        return {
            "runlog_error": runlog_error,
            "task": result.task.to_dict(),
            "occurrence": result.occurrence.to_dict(),
            "turn_id": result.turn_id,
            "outcome": result.outcome.status if result.outcome else None,
            "error": result.outcome.error if result.outcome else result.error,
            "snapshot": snapshot,
        }

    try:
        out = asyncio.run(go())
    except CronNotFound as exc:
        fail(str(exc), 2)
    except KernelError as exc:
        fail(exc.message, 2)
    except (CronStoreError, CorruptStateFile) as exc:
        fail(" ".join(str(exc).split()), 1)
    report(out, as_json)


def report(out: dict[str, Any], as_json: bool) -> None:
    """Print the run (the same shape in-process and through a server) and exit with its status."""
    # The task's name (written by the agent's schedule tool), the model's text and the reasons are
    # from elsewhere: shown with their controls escaped, never obeyed by the terminal.
    run = f"run #{out['occurrence']['occurrence']} of {exact(out['task']['name'])}"
    if as_json:
        print_json(out)
    elif out["turn_id"] is None:  # claimed, but the kernel refused it: say why, never "None"
        why = " ".join(str(out.get("error") or "the kernel gave no reason").split())
        click.echo(f"error: {run} could not be submitted: {visible(why)}", err=True)
    else:
        text = "".join(b.get("text", "") for b in (out["snapshot"] or {}).get("blocks", []) if b["type"] == "text")
        status = exact(out["outcome"] or "unknown (no outcome was reported)")
        failed = out.get("error") and out["outcome"] not in ("completed", "awaiting")
        why = f": {visible(out['error'])}" if failed else ""
        click.echo(f"{run}: {status}{why} (turn {exact(out['turn_id'])})")
        if text:
            click.echo(visible(text))
    if out.get("runlog_error"):  # the run happened, its record did not: never a silent success
        click.echo(f"error: {run}: {visible(out['runlog_error'])}", err=True)
        sys.exit(1)
    sys.exit(0 if out["outcome"] in ("completed", "awaiting") else 1)


def run_remote(
    config: Config, url: str, task: str, agent: str | None, timeout: float, reconnect_wait: float = 30.0
) -> dict[str, Any]:
    """Ask the live server to fire TASK (`cron_run` frame, admin scope) and follow the turn. A
    connection lost after the ack is regained as `appserver run` regains it (the client's reconnect
    for `reconnect_wait` seconds, to the server server.json names then); a turn with no outcome in
    time, or followed no more, is the `unknown` outcome of that run, said with its number and turn
    (as in-process): it started, and running the task again to retry it would run it twice."""
    from appserver.cli.run import ACK_WAIT_S, InputNotConfirmed, call_server, server_url_source
    from appserver.client import ProtocolClient

    logs = f"`appserver cron logs {shlex.join([task, *(['--agent', agent] if agent else [])])}`"
    hint = f"{logs} shows its outcome; do not run it again to retry it"

    async def go() -> tuple[dict[str, Any], Followed]:
        client = await ProtocolClient.connect(
            url,
            client="appserver-cron-run",
            reconnect=reconnect_wait > 0,
            reconnect_s=reconnect_wait,
            url_source=server_url_source(config.server_json),
        )
        try:
            frame: dict[str, Any] = {"type": "cron_run", "task": task}
            if agent:
                frame["agent"] = agent
            ack_wait = min(ACK_WAIT_S, timeout)  # --timeout bounds the wait for the ack too
            try:
                ack = await client.request(frame, timeout=ack_wait)
            except TimeoutError:
                raise InputNotConfirmed(ack_wait, f"a run may have started there ({logs} shows it)") from None
            return ack, await follow(client, ack["turn_id"], timeout, hint)
        finally:
            await client.close()

    ack, followed = call_server(go, url, timeout)
    occurrence = dict((ack.get("results") or [{}])[0])
    task_id = str(occurrence.get("task_id"))
    stored = cron_store_for(config.home, config.store.url).read().get(task_id)
    return {
        "task": stored.to_dict() if stored else {"id": task_id, "name": occurrence.get("task_name")},
        "occurrence": {k: v for k, v in occurrence.items() if k not in ("task_id", "task_name", "agent_id")},
        "turn_id": ack["turn_id"],
        "outcome": followed.status,
        "error": followed.error,
        "snapshot": followed.snapshot,
        "server": url,
    }


@dataclass(frozen=True)
class Followed:
    """What following a run's turn came to: its status (`unknown` when no outcome was seen), the
    error said with it, and the last snapshot of the turn seen (None: none)."""

    status: str
    error: str | None
    snapshot: dict[str, Any] | None


async def follow(client: ProtocolClient, turn_id: str, timeout: float, hint: str) -> Followed:
    """The turn's settled snapshot; else `unknown` saying why: no outcome within `timeout`, or the
    connection gone for good (the client reconnects meanwhile, saying so on stderr as `run` does)."""
    from appserver.cli.run import tell_connection
    from appserver.client import ProtocolError

    seen: list[dict[str, Any]] = []

    async def on_frame(frame: dict[str, Any]) -> None:
        tell_connection(frame)
        snap = frame.get("snapshot")
        if frame.get("type") == "turn_updated" and isinstance(snap, dict) and snap.get("turn_id") == turn_id:
            seen[:] = [snap]  # the last one only: a long turn sends thousands, each with the text so far

    try:
        snap = await client.wait_turn(turn_id, timeout=timeout, on_frame=on_frame)
    except TimeoutError:
        why = f"no outcome within {timeout:g} s; the run goes on in the server"
    except (ProtocolError, OSError):  # gone for good: no server came back within the reconnect wait
        why = f"{client.closed_message()}; the run may go on, and the server on this home records its outcome"
    else:
        failed = snap["status"] != "completed"
        return Followed(snap["status"], (snap.get("error") or {}).get("message") if failed else None, snap)
    return Followed("unknown", f"{why} ({hint})", seen[-1] if seen else None)
