"""`cron.tick_s` is held to a sane range (a huge one used to kill the scheduler silently, a tiny one
busy-looped), the scheduler loop outlives its own errors, and /readyz's `cron` check fails when
the scheduler loop this server was meant to run is gone, instead of saying ok."""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from appserver.config import ConfigError, load_config
from appserver.server import Server
from cron.scheduler import Scheduler
from cron.service import CronService
from cron.store import CronStore, CronTask, Occurrence
from tests.support.cli import cli_env, run_cli
from tests.support.serve import serving
from tests.support.wait import wait_for


async def fire(task: CronTask, occ: Occurrence) -> str:
    return "turn"


@pytest.mark.parametrize("value", ["1e300", "86400", "1e-9", "0.01", "0", "-1", "nan", "inf"])
def test_a_tick_out_of_range_is_refused_naming_the_key(tmp_path: Path, value: str) -> None:
    with pytest.raises(ConfigError, match=r"tick_s"):
        load_config(tmp_path, environ={"APPSERVER_CRON_TICK_S": value})
    with pytest.raises(ConfigError, match=r"tick_s"):
        load_config(tmp_path, environ={"APPSERVER_CRON__TICK_S": value})


@pytest.mark.parametrize("value", ["0.1", "1", "60", "3600"])
def test_a_tick_in_range_is_taken(tmp_path: Path, value: str) -> None:
    assert load_config(tmp_path, environ={"APPSERVER_CRON_TICK_S": value}).cron.tick_s == float(value)


def test_serve_refuses_a_huge_tick_in_one_line(home: Path) -> None:
    r = run_cli(home, "serve", "--listen", "127.0.0.1:0", env=cli_env(home, APPSERVER_CRON_TICK_S="1e300"))
    assert r.code != 0 and "tick_s" in r.err and "Traceback" not in r.err, (r.code, r.err)


@pytest.mark.parametrize("tick", [1e300, 1e-9, float("nan"), float("inf"), 0.0])
def test_the_scheduler_refuses_a_tick_it_cannot_run_with(tmp_path: Path, tick: float) -> None:
    with pytest.raises(ValueError, match="tick_s"):
        Scheduler(CronStore(tmp_path), fire=fire, tick_s=tick)


async def test_the_loop_outlives_its_own_errors_and_says_so(tmp_path: Path) -> None:
    """A clock at the end of time makes the next wake-up overflow: the loop logs it, reports it and
    goes on, where it used to end silently."""
    end = datetime.max.replace(tzinfo=UTC) - timedelta(seconds=1)
    s = Scheduler(CronStore(tmp_path / "home"), fire=fire, clock=lambda: end, tick_s=60)
    stop = asyncio.Event()
    loop = asyncio.create_task(s.run(stop))
    for _ in range(100):
        if s.problem():
            break
        await asyncio.sleep(0.05)
    problem = s.problem()
    assert problem is not None and "scheduler loop failed" in problem and "OverflowError" in problem
    assert not loop.done()  # still running
    stop.set()
    await asyncio.wait_for(loop, 10)


async def test_readiness_fails_when_the_scheduler_loop_is_gone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = load_config(tmp_path / "home", environ={"APPSERVER_CRON_TICK_S": "0.2"})
    server = Server(config)
    await server.open()
    service = CronService(server)
    try:
        service.start()
        for _ in range(100):
            if service.scheduler.has_lease:
                break
            await asyncio.sleep(0.05)
        assert (await service.readiness()).status == "ok"
        assert service._task is not None
        service._task.cancel()  # the loop dies while the server keeps serving
        with caplog.at_level(logging.ERROR, logger="appserver.cron"):
            await asyncio.sleep(0.1)
        result = await service.readiness()
        assert result.status == "fail" and "scheduler stopped unexpectedly" in result.detail, result
        assert any("stopped unexpectedly" in r.getMessage() for r in caplog.records)
    finally:
        await service.stop()
        await server.close()


@pytest.mark.parametrize(
    ("value", "enabled"),
    [
        ("1", False),
        ("true", False),
        ("YES", False),
        ("on", False),
        ("0", True),
        ("false", True),
        ("off", True),
        ("", True),
    ],
)
def test_disable_cron_takes_every_boolean_spelling(tmp_path: Path, value: str, enabled: bool) -> None:
    assert load_config(tmp_path, environ={"APPSERVER_DISABLE_CRON": value}).cron.enabled is enabled


@pytest.mark.parametrize("value", ["maybe", "2", "disable"])
def test_disable_cron_refuses_anything_else_naming_it(tmp_path: Path, value: str) -> None:
    with pytest.raises(ConfigError, match=r"APPSERVER_DISABLE_CRON"):  # `true` was ignored: cron ran
        load_config(tmp_path, environ={"APPSERVER_DISABLE_CRON": value})


def test_a_server_with_cron_off_says_so(tmp_path: Path) -> None:
    home = tmp_path / "home"
    with serving(home, env=cli_env(home, APPSERVER_DISABLE_CRON="yes")) as sp:
        wait_for(lambda: sp.proc.stderr.seen("scheduler is off"), 15, "the line saying cron is off")  # type: ignore[union-attr]
        assert not sp.proc.stderr.seen("now runs the scheduler")  # type: ignore[union-attr]
