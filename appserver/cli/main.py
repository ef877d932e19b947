"""The `appserver` command."""

from __future__ import annotations

import gc
import os
import signal
import sys
from pathlib import Path
from typing import NoReturn

import click

from appserver.cli.common import DEBUG_ENV, fail, not_utf8, refuse_non_utf8_args, run_or_fail, shown_raw
from appserver.cli.lazy import LazyCommand, LazyGroup
from appserver.config import default_home
from appserver.shown import shown

# Each command imports its own dependencies (uvicorn, the kernel) only when it runs (see cli/lazy.py).
_COMMAND = "appserver.command"  # ctx.meta: the command named on the command line (parse_args)

COMMANDS = {
    "agents": LazyCommand("appserver.cli.agents:agents_group", "Manage agents."),
    "channels": LazyCommand(
        "appserver.cli.channels:channels_group", "Configure chat channels and their accounts, routes and status."
    ),
    "chat": LazyCommand(
        "appserver.cli.chat:chat_command", "Chat with an agent through the running server (WebSocket protocol)."
    ),
    "conversations": LazyCommand("appserver.cli.conversations:conversations_group", "Inspect conversations."),
    "cron": LazyCommand(
        "appserver.cli.cron:cron_group", "Schedule agent prompts: cron expressions, intervals and one-shot reminders."
    ),
    "pairing": LazyCommand(
        "appserver.cli.pairing:pairing_group",
        "Approve or deny people who asked to talk to an agent through a chat channel.",
    ),
    "run": LazyCommand("appserver.cli.run:run_command", "Run one turn of AGENT with TEXT and print the reply."),
    "serve": LazyCommand("appserver.cli.serve:serve_command", "Run the server (one per home; see --standby)."),
    "store": LazyCommand("appserver.cli.store:store_group", "Copy this home's SQLite store into PostgreSQL."),
    "token": LazyCommand(
        "appserver.cli.token:token_group", 'Create, list and revoke capability tokens (auth mode "token").'
    ),
}


class _Main(LazyGroup):
    """Every command: an operator's error is one line and exit code 2 (see cli/common.py)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        """All of the command line passes here first (the subcommands' arguments too)."""
        refuse_non_utf8_args(args)
        try:
            rest = super().parse_args(ctx, args)
        except KeyboardInterrupt:
            interrupted(args)
        # what is left is the command's own arguments, after its name (a group's options come first)
        ctx.meta[_COMMAND] = args[-len(rest) - 1] if len(args) > len(rest) else None
        return rest

    def invoke(self, ctx: click.Context) -> object:
        try:
            return run_or_fail(lambda: super(_Main, self).invoke(ctx))
        except KeyboardInterrupt:
            # a Ctrl-C that no command took over: while a command loads (its imports), reads the
            # home's config, or before `run`/`chat` install their signal handling. As they say
            # theirs, not click's "Aborted!" (exit 1).
            interrupted([ctx.meta.get(_COMMAND) or ""])


@click.group(cls=_Main, lazy=COMMANDS)
@click.option(
    "--home",
    type=click.Path(file_okay=False),
    default=None,
    help="Home directory (default $APPSERVER_HOME or ~/.appserver).",
)
@click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors.")
def main(home: str | None, debug: bool) -> None:
    """A self-hosted agent app server."""
    # Whatever this process creates under the home (store, WAL, state files) is the owner's alone.
    os.umask(0o077)
    if home is not None:
        _check_home(home)
        os.environ["APPSERVER_HOME"] = home
    else:
        _check_env_home(os.environ.get("APPSERVER_HOME", ""))
    _check_resolved_home("--home" if home is not None else "$APPSERVER_HOME")
    if debug:
        os.environ[DEBUG_ENV] = "1"


def _check_home(home: str) -> None:
    """An empty or blank --home is refused (exit 2): `--home "$UNSET"` ran on ~/.appserver, and a
    blank one would be a directory named by spaces in the working directory."""
    if not home.strip():
        what = "empty" if not home else "blank"
        fail(f"--home is {what}: give the home directory, or leave --home out for the default", 2)


def _check_env_home(env_home: str) -> None:
    """$APPSERVER_HOME as the home. Empty means unset (the default home), as for other variables
    naming a directory (XDG_CONFIG_HOME) and as config.default_home reads it: `APPSERVER_HOME=`
    is how a shell clears it for one command. Blank (only spaces) is no way to say either, and is
    refused like a blank --home; not UTF-8 is refused as an argument would be."""
    if env_home and not env_home.strip():
        fail("$APPSERVER_HOME is blank: set it to the home directory, or unset it for the default", 2)
    if not_utf8(env_home):
        fail(f"$APPSERVER_HOME ({shown_raw(env_home)}) is not valid UTF-8: give the home as UTF-8 text", 2)


def _check_resolved_home(option: str) -> None:
    """The home as load_config will use it (absolute, links followed) must be UTF-8 too, checked
    before anything is made there: a relative home in a working directory whose path is not UTF-8,
    the default home under such a $HOME, or a link to such a place, was a traceback at the first
    encode (after appserver.db and config.toml were made). Refused here, one line and exit code 2,
    as a --home that is not UTF-8 is. A home that cannot be reached is load_config's to say."""
    given = os.environ.get("APPSERVER_HOME", "")
    try:
        resolved = default_home().resolve()
    except (OSError, RuntimeError):  # no working directory, no $HOME, a loop of links
        return
    if not not_utf8(str(resolved)):
        return
    if not given and not_utf8(str(Path.home())):
        why = "the default home is $HOME/.appserver, and $HOME is not UTF-8"
    elif given.startswith("~") and not_utf8(str(Path(given).expanduser())):
        why = f"{option} {shown(given)} starts with ~, and $HOME is not UTF-8"
    elif given and not Path(given).is_absolute() and not_utf8(os.getcwd()):
        why = f"{option} {shown(given)} is relative to the current directory, whose path is not UTF-8"
    else:
        named = shown(given) if given else "~/.appserver (the default)"
        why = f"{option if given else 'the home'} {named} is a symbolic link, or under one, that leads there"
    fail(
        f"the home {shown_raw(str(resolved))} is not valid UTF-8 ({why}): give the home as a path "
        "whose absolute form is UTF-8 text (--home or $APPSERVER_HOME)",
        2,
    )


def interrupted(args: list[str]) -> NoReturn:
    """A Ctrl-C before the command took SIGINT over: one line and exit 130, as `run` and `chat`
    report a Ctrl-C while they connect (`args`: the command line, its command first if known)."""
    command = next((a for a in args if not a.startswith("-")), None)
    what = ": no turn was started" if command in ("run", "chat") else ""
    fail(f"interrupted by SIGINT{what}", 128 + signal.SIGINT)


def run() -> None:
    """The `appserver` executable. `serve` imports and builds most of the server before it has
    anything to collect: the cyclic collector stays off until serve freezes what it built
    (cli/serve.py), which spares the full collections an import-heavy start triggers."""
    if "serve" in sys.argv[1:4]:
        gc.disable()
    try:
        main()
    except KeyboardInterrupt:  # (click's own handling turns one into "Aborted!"; see _Main)
        interrupted(sys.argv[1:])
    finally:
        # CPython 3.11 marks a KeyboardInterrupt that passed through exec() of a string (dataclasses
        # build their methods so, while a command's modules import) as unhandled even when it was
        # handled, and `python -m appserver` then ends by killing itself with SIGINT whatever exit
        # code the command chose (130 and its one error line). An exec() that completes clears it.
        exec("")


if __name__ == "__main__":
    run()
