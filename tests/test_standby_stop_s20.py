"""Session 20: a standby told to stop never takes the home over on its way out.

`systemctl stop`, `docker compose down` or `kill A B` send SIGTERM to the holder and its standby at
once. The standby probed the home lock with a blocking half-second wait inside its event loop, deaf
to the signal meanwhile: when the holder let go within that wait, the standby took over (kernel,
port, server.json, the cron lease) before it noticed the stop. Real processes, SQLite on disk.
"""

from __future__ import annotations

import signal
import time
from functools import partial
from pathlib import Path

import pytest

from tests.support.cli import cli_env
from tests.support.net import free_port
from tests.support.wait import wait_for
from tests.test_cron_failover import Serve

pytestmark = pytest.mark.timeout(120)

ROUNDS = 4


def test_a_standby_stopped_with_its_holder_never_takes_over(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    # a short poll: the standby spends most of its time probing the lock, where the signal was lost
    env = cli_env(home, APPSERVER_CRON_TICK_S="0.1")
    for round_ in range(ROUNDS):
        holder = Serve(home, free_port(), env=env)
        standby: Serve | None = None
        try:
            wait_for(partial(holder.said, "listening on"), 20, "the holder to listen")
            standby = Serve(home, free_port(), "--standby", env=env)
            wait_for(partial(standby.said, "appserver standby:"), 20, "the standby to wait")
            time.sleep(0.1 + 0.1 * round_)  # a different phase of the standby's poll each round
            holder.proc.send_signal(signal.SIGTERM)
            standby.proc.send_signal(signal.SIGTERM)
            assert holder.proc.wait(20) == 0
            assert standby.proc.wait(20) == 0
            time.sleep(0.1)  # the reader thread takes the last lines
            said = "\n".join(standby.lines)
            assert "taking over" not in said and "listening on" not in said, (round_, said)
        finally:
            for p in (holder, standby):
                if p is not None:
                    p.kill()
