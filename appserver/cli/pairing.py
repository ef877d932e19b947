"""`appserver pairing list|approve|deny|revoke|approved`: the owner's side of channel pairing.

It works on `$APPSERVER_HOME/channels/gateway.db` directly, whether or not a server runs; a running
gateway acts on a decision within about a second (tells the sender, releases the messages it kept)
and on a revoke within a tenth of a second (ends the sender's turns queued on the server), which
`revoke` waits for, a few seconds at most (`_await_gateway`), also while the server's gateway child
is down between restarts (the server's queue still runs): it warns when no gateway acted in time.
`revoke` also disables the cron tasks the sender had the agent schedule from a chat of the revoked
accounts (`appserver.cli.cron.disable_sender_tasks`: kept, and their queued runs dropped, as `cron
disable` does), and lists them; and records the revoke with the tasks (`CronStore.revoke_sender`), so
a turn of the sender's still running then cannot schedule another (the `schedule` tool is refused).
"""

from __future__ import annotations

import json
import shlex
import sqlite3
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING

import click

from appserver.cli.channels import Refused, _errors, _gateway_db, _live_channels
from appserver.cli.common import echo_long, get_config, quoted
from appserver.cli.safetext import exact, exact_id, typed_id, unseen
from appserver.config import Config
from appserver.serverinfo import read_live_server
from gateway.db import default_path, gateway_running
from gateway.pairing import Pairing, PairingCode, PairingError, normalize
from gateway.sqlstore import CommitUnknown

if TYPE_CHECKING:
    from cron.store import CronTask

# how long `revoke` waits for a gateway to act on it (a restarting one: slow to start on a small or busy machine)
APPLIED_WAIT_S = 10.0
APPLIED_LOOK_S = 0.02


def _ago(t: float) -> str:
    seconds = max(0, int(time.time() - t))
    return f"{seconds}s ago" if seconds < 120 else f"{seconds // 60}m ago"


def _pairing(create: bool = True) -> AbstractContextManager[sqlite3.Connection | None]:
    config = get_config()
    return _gateway_db(config.home, create=create, store_url=config.store.url)


@click.group("pairing")
def pairing_group() -> None:
    """Approve or deny people who asked to talk to an agent through a chat channel."""


@pairing_group.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@_errors
def list_cmd(as_json: bool) -> None:
    """Pending pairing codes (valid for an hour each)."""
    with _pairing(create=False) as conn:
        pending = Pairing(conn).pending() if conn is not None else []
    if as_json:
        echo_long(json.dumps([p.to_json() for p in pending], indent=2))
        return
    if not pending:
        click.echo("No pending pairing codes.")
        return
    rows = [("CODE", "CHANNEL", "ACCOUNT", "SENDER", "NAME", "ASKED", "EXPIRES IN")]
    for p in pending:
        left = max(0, int(p.expires_at - time.time()))
        rows.append(
            (
                p.code,
                p.channel,
                p.account,
                exact_id(p.sender),  # what a chat platform says of a stranger: never a control, nothing hidden
                exact(p.sender_name or "-"),
                _ago(p.created_at),
                f"{left // 60}m",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())


def _await_gateway(conn: sqlite3.Connection, sender: str, accounts: set[str]) -> None:
    """Wait (at most `APPLIED_WAIT_S`) until a gateway on this home says it acted on the revoke just
    written (`Pairing.changes`): once `revoke` returns, the sender's turns queued on the server are
    withdrawn, so ending the turn ahead of them from another client starts none of them. Waited for
    the gateway that runs, and, when none does but the home's server runs one of `accounts` (its
    gateway child between restarts, while the server's queue goes on), for the restarted one, which
    acts on it before anything else. Not acted on in time is said, not failed: gateway.db holds the
    change, and the gateway acts on it when it next looks (or starts). Acted on by a restarted
    gateway is said too: a turn the server started before it was back was no longer queued."""
    config = get_config()
    ledger = default_path(config.home)
    deadline = time.monotonic() + APPLIED_WAIT_S
    down = not gateway_running(ledger)
    if down and not _server_runs_any(config.server_json, accounts):
        return  # no gateway, no server running one of them: nothing queued on a server to withdraw
    if not _applied_by(Pairing(conn), deadline):
        _warn_not_applied(ledger, sender)
    elif down:
        click.echo(
            f"note: the gateway was down (restarting) when the revoke was made; it has acted on it since,"
            f" but a turn of {exact_id(sender)} the server started meanwhile may have run (the agent read the"
            " message): none of its reply is delivered",
            err=True,
        )


def _applied_by(pairing: Pairing, deadline: float) -> bool:
    """Whether a gateway says it acted on every revoke made so far (`Pairing.changes`) by `deadline`."""
    made, applied = pairing.changes()
    while applied < made:
        if time.monotonic() >= deadline:
            return False
        time.sleep(APPLIED_LOOK_S)
        applied = pairing.changes()[1]
    return True


def _server_runs_any(server_json: Path, accounts: set[str]) -> bool:
    """Whether the server running on this home runs one of `accounts` (`channel:account`) in its
    gateway, by the `channels` check of its /readyz (absent: it runs no channels). A server that
    cannot be asked, or whose gateway does not say its accounts yet, is taken to: a revoke said to
    be done while its queue runs the sender's turns is what `_await_gateway` is there to prevent."""
    try:
        live = read_live_server(server_json)
    except OSError:  # server.json refused (a FIFO, a link to nothing): who runs is not known
        return True
    if live is None:
        return False
    url = live.get("url")
    if not isinstance(url, str) or not url:
        return True
    seen = _live_channels(url)
    if not seen["reachable"] or seen["error"]:
        return True
    check = seen["channels"]
    if check is None:
        return False
    running = set(check["accounts"])
    return not running or bool(running & accounts)


def _warn_not_applied(ledger: Path, sender: str) -> None:
    """The stderr warning of a revoke no gateway said it acted on within `APPLIED_WAIT_S`."""
    if gateway_running(ledger):
        click.echo(
            f"warning: the running gateway has not acted on the revoke within {APPLIED_WAIT_S:g} s;"
            " gateway.db holds it and the gateway acts on it when it next looks",
            err=True,
        )
        return
    click.echo(
        f"warning: the server runs, but its gateway is down (restarting) and did not come back within"
        f" {APPLIED_WAIT_S:g} s to act on the revoke: messages of {exact_id(sender)} already queued on the"
        " server may still be answered by the agent (it reads them, its tools may run) until the gateway is"
        " back; gateway.db holds the revoke, and the restarted gateway refuses them first, delivering none of"
        " their replies",
        err=True,
    )


def _decide(code: str, approve: bool) -> PairingCode:
    with _pairing() as conn:
        assert conn is not None
        pairing = Pairing(conn)
        try:
            try:
                return pairing.approve(code) if approve else pairing.deny(code)
            except CommitUnknown:
                # PostgreSQL's answer to the COMMIT was lost: read back whether the decision was made
                found = pairing.get(normalize(code))
                if found is not None and found.status == ("approved" if approve else "denied"):
                    return found
                return pairing.approve(code) if approve else pairing.deny(code)
        except PairingError as exc:
            raise Refused(str(exc)) from None


@pairing_group.command("approve")
@click.argument("code")
@_errors
def approve_cmd(code: str) -> None:
    """Let the sender of CODE talk to the agent; the messages they sent meanwhile are answered."""
    p = _decide(code, True)
    click.echo(
        f"Approved {exact_id(p.sender)}"
        + (f" ({exact(p.sender_name)})" if p.sender_name else "")
        + f" on {p.channel}:{p.account}."
    )
    _warn_no_dms(p)


def _warn_no_dms(p: PairingCode) -> None:
    """Say on stderr when the account takes no direct messages now (`dm_policy = "disabled"`, set
    after the code was given): the approval stands (it lets the sender in where the account still
    answers: a group), but the messages the code kept are refused, and the sender is told that,
    not that they are on their way."""
    account = get_config().channels.accounts.get(p.channel, {}).get(p.account)
    if account is None or account.settings.get("dm_policy") != "disabled":
        return
    click.echo(
        f'warning: the configuration gives {p.channel}:{p.account} dm_policy = "disabled": a server running'
        f" with it takes no direct messages, so the messages {exact_id(p.sender)} sent with this code are not"
        " answered; they are told they are approved but that direct messages are off (they can still reach the"
        " bot in a group it is in). A server started before the change runs with the policy it started with"
        " until it restarts, and answers them",
        err=True,
    )


@pairing_group.command("deny")
@click.argument("code")
@_errors
def deny_cmd(code: str) -> None:
    """Refuse the sender of CODE; they hear nothing more (unless the account has a deny_notice)."""
    p = _decide(code, False)
    click.echo(f"Denied {exact_id(p.sender)} on {p.channel}:{p.account}.")


@pairing_group.command("approved")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@_errors
def approved_cmd(as_json: bool) -> None:
    """Senders approved by pairing."""
    with _pairing(create=False) as conn:
        rows = Pairing(conn).approved_senders() if conn is not None else []
    if as_json:
        echo_long(json.dumps([{"channel": c, "account": a, "sender": s, "approved_at": t} for c, a, s, t in rows]))
        return
    for c, a, s, t in rows:
        click.echo(f"{c}:{a}  {exact_id(s)}  approved {_ago(t)}")
    if not rows:
        click.echo("No approved senders.")


@pairing_group.command("revoke")
@click.argument("sender")
@click.option("--channel", default=None, help="Only this channel.")
@click.option("--account", default=None, help="Only this account.")
@_errors
def revoke_cmd(sender: str, channel: str | None, account: str | None) -> None:
    """Reset SENDER's pairing: an approval is removed, a denial forgotten (their next message
    needs a new pairing). SENDER as `pairing approved` shows it (`alice\\u200b` is alice with a
    zero-width space, `jose\\u0301` josé written as e and a combining accent; a backslash shown
    doubled) or as the id itself."""
    disabled: list[CronTask] = []
    problem: str | None = None
    with _pairing() as conn:
        assert conn is not None
        pairing = Pairing(conn)
        revocable = pairing.revocable(channel, account)
        target = _target(sender, {s for _, _, s, _ in revocable})
        accounts = {f"{c}:{a}" for c, a, s, _ in revocable if s == target}
        try:
            removed = pairing.revoke(target, channel, account)
        except CommitUnknown:
            # PostgreSQL's answer to the COMMIT was lost: made if none of the sender's rows is left
            left = [r for r in pairing.revocable(channel, account) if r[2] == target]
            removed = pairing.revoke(target, channel, account) if left else len(accounts)
        alike = _look_alikes(target, pairing.revocable(channel, account))
        if removed:
            # at once: before a run of theirs comes due, and recorded, so a turn of theirs running
            # now schedules nothing more (cron.store `CronStore.revoke_sender`); a home without
            # tasks gets a crons.json holding the record
            disabled, problem = _disable_sender_tasks(get_config(), accounts, target)
            _await_gateway(conn, target, accounts)
            # again once the gateway acted: a turn of theirs it let in meanwhile may have made one,
            # and one still running is held to the later time
            more, problem = _disable_sender_tasks(get_config(), accounts, target)
            disabled += more
    if not removed:
        note = f". {_alike_note(target, alike)}" if alike else ""
        raise Refused(f"{quoted(sender)} is neither an approved nor a denied sender{note}", 1)
    click.echo(f"Revoked {exact_id(target)} ({removed} account{'s' if removed != 1 else ''}).")
    if alike:
        click.echo(_alike_note(target, alike))
    if disabled or problem is not None:
        from appserver.cli.cron import say_sender_tasks_disabled

        say_sender_tasks_disabled(get_config(), disabled, target, problem)


def _disable_sender_tasks(config: Config, accounts: set[str], sender: str) -> tuple[list[CronTask], str | None]:
    """`appserver.cli.cron.disable_sender_tasks`, imported when a revoke has tasks to look at."""
    from appserver.cli.cron import disable_sender_tasks as disable

    return disable(config, accounts, sender)


def _target(given: str, known: set[str]) -> str:
    """The sender SENDER names: the id its shown form reads back to, else the id as typed (an id
    from `--json`, or one with a backslash that starts no escape)."""
    typed = typed_id(given)
    return typed if typed in known or given not in known else given


def _look_alikes(target: str, rows: list[tuple[str, str, str, str]]) -> list[tuple[str, str, str, str]]:
    """Senders still approved or denied that differ from `target` only by what does not show (a
    zero-width space, a no-break space) or by Unicode normalization (`jose\\u0301` and `josé`):
    printed raw they pass for the same person."""
    return [row for row in rows if row[2] != target and unseen(row[2]) == unseen(target)]


def _alike_note(target: str, alike: list[tuple[str, str, str, str]]) -> str:
    shown = ", ".join(f"{exact_id(s)} ({how} on {c}:{a})" for c, a, s, how in alike)
    hint = shlex.quote(exact_id(alike[0][2]))
    return (
        f"Not revoked, differing from {exact_id(target)} only by invisible characters or by the"
        f" Unicode form of the same letters: {shown}."
        f" Revoke one with: appserver pairing revoke {hint}"
    )
