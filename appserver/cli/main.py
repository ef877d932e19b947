"""The `appserver` command."""

from __future__ import annotations

import os

import click

from appserver.cli.agents import agents_group
from appserver.cli.chat import chat_command
from appserver.cli.common import DEBUG_ENV, run_or_fail
from appserver.cli.conversations import conversations_group
from appserver.cli.cron import build_cron_group
from appserver.cli.cron_run import agent_names, cron_run_command, validate_agent
from appserver.cli.run import run_command
from appserver.cli.serve import serve_command
from appserver.cli.token import token_group


class _Main(click.Group):
    """Every command: an operator's error is one line and exit code 2 (see cli/common.py)."""

    def invoke(self, ctx: click.Context) -> object:
        return run_or_fail(lambda: super(_Main, self).invoke(ctx))


@click.group(cls=_Main)
@click.option("--home", type=click.Path(file_okay=False), default=None, help="Home directory (default $APPSERVER_HOME or ~/.appserver).")
@click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors.")
def main(home: str | None, debug: bool) -> None:
    """A self-hosted agent app server."""
    # Whatever this process creates under the home (store, WAL, state files) is the owner's alone.
    os.umask(0o077)
    if home:
        os.environ["APPSERVER_HOME"] = home
    if debug:
        os.environ[DEBUG_ENV] = "1"


main.add_command(serve_command)
main.add_command(agents_group)
main.add_command(conversations_group)
main.add_command(run_command)
main.add_command(chat_command)
main.add_command(token_group)
_cron = build_cron_group(validate_agent=validate_agent, agent_names=agent_names)
_cron.add_command(cron_run_command)
main.add_command(_cron)

if __name__ == "__main__":
    main()
