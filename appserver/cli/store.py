"""`appserver store copy --to URL`: this home's SQLite store into an empty PostgreSQL database.

Everything the store holds moves (agents, conversations, messages, turns, pending calls, stored
responses, idempotency keys, history points) and the home's cron tasks and capability tokens
(crons.json and auth/tokens.json, which a PostgreSQL store keeps in the database, so that every
server sharing it sees them), in one PostgreSQL transaction from one SQLite
snapshot: a copy that fails leaves the target as empty as it was. Then serve with
`[store] url` (or `serve --store URL`) set to the target. docs/scale-out.md.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import click

from appserver.cli.common import fail, get_config, print_json, run_or_fail
from appserver.serverinfo import claim_home, home_lock_path
from appserver.store.url import redact_url, store_kind


@click.group("store")
def store_group() -> None:
    """Copy this home's SQLite store into PostgreSQL."""


def _cron_doc(home: Path) -> tuple[str | None, int]:
    """The home's cron tasks as the database keeps them (no scheduler owner), and how many."""
    from appserver.store.base import StoreError
    from cron.store import CronStore, CronStoreError

    try:
        state = CronStore(home).read()  # an unreadable crons.json refuses the copy, left in place
    except CronStoreError as exc:
        raise StoreError(f"cannot copy the cron tasks: {exc}") from None
    if not state.tasks:
        return None, 0
    state.scheduler_owner = None
    return CronStore(home).render(state), len(state.tasks)


def _tokens(home: Path) -> list[dict[str, object]]:
    """The home's capability tokens (hashes only), which a database store keeps in `tokens`."""
    from appserver.auth import TokenStore
    from appserver.store.base import StoreError

    store = TokenStore(home)
    problem = store.unreadable()
    if problem is not None:  # copying none would leave the database with no token: refused, left in place
        raise StoreError(f"cannot copy the tokens: {store.path} cannot be read ({problem}); restore it first")
    return [r.to_json() for r in store.list()]


async def _copy(db_path: Path, url: str, home: Path, replaced: dict[str, list[str]]) -> dict[str, int]:
    from appserver.store.postgres import PostgresStore  # the driver: only for this command
    from appserver.store.sqlite import SQLiteStore

    cron_doc, cron_tasks = _cron_doc(home)
    tokens = _tokens(home)
    source = SQLiteStore(db_path)
    target = PostgresStore(url)
    source.open_sync()  # refuses a damaged store, brings an old one to the current schema
    try:
        await target.open()
        try:
            counts = await target.copy_from_sqlite(source.db, cron_doc, tokens, replaced)
            return {**counts, "cron_tasks": cron_tasks}
        finally:
            await target.close()
    finally:
        await source.close()


@store_group.command("copy")
@click.option(
    "--to",
    "to_url",
    required=True,
    metavar="URL",
    help="The empty PostgreSQL database: postgresql://USER[:PASSWORD]@HOST[:PORT]/DB.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the rows copied per table as JSON.")
def copy_command(to_url: str, as_json: bool) -> None:
    """Copy this home's SQLite store into an empty PostgreSQL database."""
    config = get_config()
    try:
        kind = store_kind(to_url)
    except ValueError as exc:
        fail(f"--to: {exc}", 2)
    if kind != "postgresql":
        fail("--to: give the PostgreSQL database to copy into (postgresql://USER[:PASSWORD]@HOST[:PORT]/DB)", 2)
    if not config.db_path.exists():
        fail(f"no SQLite store at {config.db_path}: nothing to copy", 2)
    # The home's serve lock, held for the whole copy: a `serve` started meanwhile is refused (what it
    # wrote would be in SQLite only), and a running or starting one refuses the copy.
    lock, live = claim_home(config.server_json)
    if lock is None:
        who = (
            f"a server runs on this home ({live.get('url')}, pid {live.get('pid')})"
            if live
            else (
                f"another process holds this home ({home_lock_path(config.server_json)}: a `serve` starting, "
                "or another `store copy`)"
            )
        )
        fail(f"{who}: what it writes after the copy would not be in PostgreSQL; stop it first", 3)
    try:
        replaced: dict[str, list[str]] = {}
        counts = run_or_fail(lambda: asyncio.run(_copy(config.db_path, to_url.strip(), config.home, replaced)))
    finally:
        lock.release()
    if replaced:  # PostgreSQL text cannot hold NUL (older versions stored a client's as sent)
        for column, ids in replaced.items():
            shown_ids = ", ".join(ids[:5]) + (f" and {len(ids) - 5} more" if len(ids) > 5 else "")
            click.echo(
                f"warning: {column}: {len(ids)} value(s) held NUL characters, which PostgreSQL cannot store; "
                f"copied with each NUL replaced by U+FFFD (row {shown_ids})",
                err=True,
            )
    if as_json:
        nul = {column: len(ids) for column, ids in replaced.items()}
        print_json({"from": str(config.db_path), "to": redact_url(to_url), "copied": counts, "nul_replaced": nul})
        return
    shown = ", ".join(f"{n} {table.replace('_', ' ')}" for table, n in counts.items())
    click.echo(f"copied {config.db_path} into {redact_url(to_url)}: {shown}")
    click.echo(f"serve from it with: appserver serve --store '{redact_url(to_url)}' (or [store] url in config.toml)")
