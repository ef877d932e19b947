"""`[server] event_loop`: which event loop `serve` runs on."""

from __future__ import annotations

from pathlib import Path

import pytest
import uvloop

from appserver.cli.serve import event_loop_factory
from appserver.config import ConfigError, load_config


def test_auto_and_uvloop_choose_uvloop_and_asyncio_the_standard_loop() -> None:
    assert event_loop_factory("auto") is uvloop.new_event_loop
    assert event_loop_factory("uvloop") is uvloop.new_event_loop
    assert event_loop_factory("asyncio") is None


def test_an_unknown_loop_is_refused_naming_the_choices(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / "home", environ={"APPSERVER_SERVER__EVENT_LOOP": "tokio"})
    assert "event_loop" in str(err.value) and "asyncio" in str(err.value)
