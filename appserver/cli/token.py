"""`appserver token create|list|revoke`: capability tokens for auth mode `token`.

The plaintext is shown once, at creation; the home only ever holds its sha256.
"""

from __future__ import annotations

import json
import time
from typing import Any

import click

from appserver.auth import (
    DEFAULT_TOKEN_SCOPES,
    SCOPES,
    TokenRecord,
    TokenStore,
    check_token_name,
    parse_agents,
    token_store_for,
)
from appserver.cli.common import echo_long, fail, get_config, prepare_store_schema, with_server
from appserver.cli.safetext import exact, visible
from appserver.fsutil import CorruptStateFile, set_aside_notice
from appserver.ids import AGENT_ID_PREFIX

START_NEW = "appserver token create --start-new-file"


def _store() -> TokenStore:
    """The token store, after a warning for each token file set aside as unreadable: its tokens
    are not in the list."""
    config = get_config()  # a config error: one line, exit 2
    for path in sorted(config.home.glob("auth/tokens.json.corrupt-*")):
        click.echo(f"warning: {visible(set_aside_notice(config.home, path))}", err=True)
    prepare_store_schema(config)  # a new PostgreSQL database: its tables first
    return token_store_for(config.home, config.store.url)


def _refuse_unusable(store: TokenStore, doing: str) -> None:
    """Stop (exit 1, one line) when tokens.json cannot be read. The file is left where it is:
    a running server refuses every token until the operator repairs it (docs/security.md), and a
    command that silently started a new file would turn auth back on with only the new token."""
    reason = store.unreadable()
    if reason is None:
        return
    fail(
        f"{visible(str(store.path))} cannot be read ({visible(' '.join(reason.split()))}); it was left in place "
        f"and a running server refuses every token until it is repaired. Nothing was {doing}. Repair it, "
        f"or start a new token file without the tokens it held: {START_NEW}",
        1,
    )


def _refuse_unrestored(store: TokenStore) -> None:
    """Stop (exit 1) when tokens.json was set aside as unreadable and nothing took its place:
    the operator has to choose between restoring it (its tokens work again) and a new file (only
    the new token works), never learn it from a token that stopped working."""
    config = get_config()
    if store.path != config.home / "auth" / "tokens.json" or store.path.exists():
        return  # a database store, or a token file (repaired, or started anew) is in place
    aside = sorted(config.home.glob("auth/tokens.json.corrupt-*"))
    if aside:
        fail(
            f"auth/tokens.json was set aside as unreadable ({visible(aside[-1].name)}) and not restored, so "
            "every token is refused; a new token would start a new file that admits only itself. Repair the "
            f"set-aside file and move it back over auth/tokens.json, or start a new file: {START_NEW}",
            1,
        )


def _when(ts: float | None) -> str:
    """An expiry for people. One stored beyond the dates a clock can show (written before lifetimes
    were capped, or by hand) is shown as such, so `list` and `revoke` still work on that token."""
    if ts is None:
        return "never"
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts))
    except (OverflowError, OSError, ValueError):
        if ts != ts:  # NaN: verification treats it as expired
            return "invalid"
        return "out of range (far future)" if ts > 0 else "out of range (far past)"


def _agents_cell(rec: TokenRecord) -> str:
    """The agents a token admits, each shown exactly: `--agents` takes any text, and tokens.json
    (or the tokens table) may have been written by hand or by another version."""
    return ",".join(exact(a) for a in rec.agents) if rec.agents is not None else "*"


def _describe(rec: TokenRecord) -> str:
    return (
        f"id={exact(rec.id)} name={exact(rec.name)} agents={_agents_cell(rec)} scopes={','.join(rec.scopes)} "
        f"expires={_when(rec.expires_at)}"
    )


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _check_agents(wanted: frozenset[str]) -> None:
    """`--agents` against the agents of this home. An unknown id is refused (exit 2): ids are
    never made again, so the token could admit nothing. An unknown name is only warned about: a
    name admits whichever agent carries it when a request comes (docs/security.md), so it may be
    an agent that is created or renamed later, but it is just as likely a typo."""
    agents = with_server(lambda s: s.store.list_agents())
    ids, names = {a.id for a in agents}, {a.name for a in agents}
    unknown_ids = sorted(a for a in wanted if a.startswith(AGENT_ID_PREFIX) and a not in ids)
    if unknown_ids:
        fail(f"--agents: no agent with id {', '.join(unknown_ids)}", 2)
    for name in sorted(a for a in wanted if not a.startswith(AGENT_ID_PREFIX) and a not in names):
        click.echo(
            f"warning: --agents: no agent is named '{exact(name)}' now; the token admits one that carries "
            "that name later (a typo admits nothing)",
            err=True,
        )


@click.group("token")
def token_group() -> None:
    """Create, list and revoke capability tokens (auth mode "token")."""


@token_group.command("create")
@click.option(
    "--name",
    default=None,
    help="A unique name (default: the token id); 'gateway' and 'gateway@…' are the channel gateway's.",
)
@click.option(
    "--agents",
    default=None,
    help="Comma-separated agent ids or names, or '*' (default: all agents). An empty value is refused.",
)
@click.option(
    "--scopes",
    default=",".join(DEFAULT_TOKEN_SCOPES),
    show_default=True,
    help=f"Comma-separated scopes among {', '.join(SCOPES)}.",
)
@click.option("--expires", default="never", show_default=True, help="Lifetime: 30d, 12h, 45m, 2w or never.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object (includes the token).")
@click.option(
    "--start-new-file",
    is_flag=True,
    help="When auth/tokens.json is unreadable or was set aside: start a new one holding only this token "
    "(an unreadable file is kept as tokens.json.corrupt-<time>).",
)
def create_cmd(
    name: str | None, agents: str | None, scopes: str, expires: str, as_json: bool, start_new_file: bool
) -> None:
    """Mint a token and print it once; only its hash is stored."""
    store = _store()
    if not start_new_file:
        _refuse_unusable(store, "created")
        _refuse_unrestored(store)
    try:
        if name is not None:
            check_token_name(name)  # a bad or reserved name (`gateway`): a usage error, before any lookup
        limited = parse_agents(agents)
    except ValueError as exc:  # empty, or `*` mixed with names: a usage error, before any lookup
        fail(str(exc), 2)
    if limited is not None:
        _check_agents(limited)
    if start_new_file:
        try:
            moved = store.set_aside_unreadable()
        except RuntimeError as exc:
            fail(_one_line(exc), 1)
        if moved is not None:
            click.echo(
                f"warning: {visible(str(moved.path))} could not be read; moved aside to "
                f"{visible(str(moved.moved_to))}; the new file holds only the new token",
                err=True,
            )
    try:
        rec, plaintext = store.create(name=name, agents=agents, scopes=scopes, expires=expires)
    except ValueError as exc:  # what was asked for is wrong (bad scope, expiry...): a usage error
        fail(str(exc), 2)
    except (RuntimeError, CorruptStateFile) as exc:
        fail(_one_line(exc), 1)
    if as_json:
        out: dict[str, Any] = rec.public()
        out["token"] = plaintext
        click.echo(json.dumps(out))
        return
    click.echo(plaintext)
    click.echo(f"created {_describe(rec)}", err=True)
    click.echo("This token is shown only once. Send it as: Authorization: Bearer <token>", err=True)


@token_group.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array.")
def list_cmd(as_json: bool) -> None:
    """List tokens (never the tokens themselves: only ids, names, scopes and fingerprints)."""
    store = _store()
    _refuse_unusable(store, "listed")  # a reader: it never moves the file
    try:
        records = store.list()
    except (RuntimeError, CorruptStateFile) as exc:
        fail(_one_line(exc), 1)
    if as_json:
        echo_long(json.dumps([r.public() for r in records]))
        return
    if not records:
        click.echo("no tokens (create one with `appserver token create`)")
        return
    rows = [("ID", "NAME", "AGENTS", "SCOPES", "EXPIRES", "FINGERPRINT")]
    now = time.time()
    for r in records:
        expires = _when(r.expires_at)
        if r.is_expired(now):
            expires += " (expired)"
        rows.append(
            (
                exact(r.id),
                exact(r.name),
                _agents_cell(r),
                ",".join(r.scopes),
                expires,
                "sha256:" + r.hash[:12],
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


@token_group.command("revoke")
@click.argument("id_or_name")
@click.option("--json", "as_json", is_flag=True, help="Print the revoked token's record as JSON.")
def revoke_cmd(id_or_name: str, as_json: bool) -> None:
    """Revoke a token by id or name; a running server refuses it from the next request."""
    store = _store()
    _refuse_unusable(store, "revoked")
    try:
        rec = store.revoke(id_or_name)
    except KeyError:  # exit 2, as `agents show` and `cron show` exit for an id they do not know
        fail(f"no token with id or name '{exact(id_or_name)}'", 2)
    except (RuntimeError, CorruptStateFile) as exc:
        fail(_one_line(exc), 1)
    if as_json:
        click.echo(json.dumps(rec.public()))
    else:
        click.echo(f"revoked {_describe(rec)}")
