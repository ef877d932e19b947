"""The `appserver` command."""

from __future__ import annotations

import os

import click

from appserver.cli.agents import agents_group
from appserver.cli.chat import chat_command
from appserver.cli.conversations import conversations_group
from appserver.cli.cron import build_cron_group
from appserver.cli.cron_run import cron_run_command, validate_agent
from appserver.cli.run import run_command
from appserver.cli.serve import serve_command
from appserver.cli.token import token_group


@click.group()
@click.option("--home", type=click.Path(file_okay=False), default=None, help="Home directory (default $APPSERVER_HOME or ~/.appserver).")
def main(home: str | None) -> None:
    """A self-hosted agent app server."""
    if home:
        os.environ["APPSERVER_HOME"] = home


main.add_command(serve_command)
main.add_command(agents_group)
main.add_command(conversations_group)
main.add_command(run_command)
main.add_command(chat_command)
main.add_command(token_group)
_cron = build_cron_group(validate_agent=validate_agent)
_cron.add_command(cron_run_command)
main.add_command(_cron)

if __name__ == "__main__":
    main()
