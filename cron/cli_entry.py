"""`python -m cron.cli_entry …` runs the `cron` command group alone (tests, and a fallback while
the main `appserver` CLI does not register it)."""

from __future__ import annotations

from appserver.cli.cron import cron_group


def main() -> None:
    cron_group(prog_name="appserver cron")


if __name__ == "__main__":
    main()
