"""`appserver pairing list|approve|deny|revoke|approved`: the owner's side of channel pairing.

It works on `$APPSERVER_HOME/channels/gateway.db` directly, whether or not a server runs; a running
gateway acts on a decision within about a second (tells the sender, releases the messages it kept)
and on a revoke within a tenth of a second (ends the sender's turns queued on the server), which
`revoke` waits for, a few seconds at most (`_await_gateway`).
"""

from __future__ import annotations

import json
import shlex
import sqlite3
import time
from contextlib import AbstractContextManager

import click

from appserver.cli.channels import Refused, _errors, _gateway_db
from appserver.cli.common import echo_long, get_config, quoted
from appserver.cli.safetext import exact, exact_id, typed_id, unseen
from gateway.db import default_path, gateway_running
from gateway.pairing import Pairing, PairingCode, PairingError

APPLIED_WAIT_S = 5.0  # how long `revoke` waits for a running gateway to act on it
APPLIED_LOOK_S = 0.02


def _ago(t: float) -> str:
    seconds = max(0, int(time.time() - t))
    return f"{seconds}s ago" if seconds < 120 else f"{seconds // 60}m ago"


def _pairing(create: bool = True) -> AbstractContextManager[sqlite3.Connection | None]:
    return _gateway_db(get_config().home, create=create)


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


def _await_gateway(conn: sqlite3.Connection) -> None:
    """With a gateway running on this home, wait (at most `APPLIED_WAIT_S`) until it says it acted on
    the change just written (`Pairing.changes`): once `revoke` returns, the sender's turns queued on
    the server are withdrawn, so ending the turn ahead of them from another client starts none of
    them. A gateway that does not answer is said, not failed: gateway.db holds the change, and the
    gateway acts on it when it next looks."""
    if not gateway_running(default_path(get_config().home)):
        return
    pairing = Pairing(conn)
    made, applied = pairing.changes()
    deadline = time.monotonic() + APPLIED_WAIT_S
    while applied < made:
        if time.monotonic() >= deadline:
            click.echo(
                f"warning: the running gateway has not acted on the revoke within {APPLIED_WAIT_S:g} s;"
                " gateway.db holds it and the gateway acts on it when it next looks",
                err=True,
            )
            return
        time.sleep(APPLIED_LOOK_S)
        applied = pairing.changes()[1]


def _decide(code: str, approve: bool) -> PairingCode:
    with _pairing() as conn:
        assert conn is not None
        try:
            return Pairing(conn).approve(code) if approve else Pairing(conn).deny(code)
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
    with _pairing() as conn:
        assert conn is not None
        pairing = Pairing(conn)
        target = _target(sender, {s for _, _, s, _ in pairing.revocable(channel, account)})
        removed = pairing.revoke(target, channel, account)
        alike = _look_alikes(target, pairing.revocable(channel, account))
        if removed:
            _await_gateway(conn)
    if not removed:
        note = f". {_alike_note(target, alike)}" if alike else ""
        raise Refused(f"{quoted(sender)} is neither an approved nor a denied sender{note}", 1)
    click.echo(f"Revoked {exact_id(target)} ({removed} account{'s' if removed != 1 else ''}).")
    if alike:
        click.echo(_alike_note(target, alike))


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
