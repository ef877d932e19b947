"""A `token_file` is read on the gateway's event loop (gateway/accounts.py `read_secret_file`): a FIFO
with no writer froze every account, and `/dev/zero` ate memory. Now only a small regular file is
read, without blocking, and anything else puts only its own account into `error`, saying why."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import pytest

from gateway.accounts import SECRET_FILE_MAX, AccountSpec, resolve_secrets
from plugins.contract import AccountError
from tests.test_gateway_accounts import Harness, spec, write_plugin

pytestmark = pytest.mark.timeout(30)


def refused_within(spec_: AccountSpec, home: Path, seconds: float = 3.0) -> str:
    """The AccountError's message; fails (and unblocks a FIFO reader) when it does not come in time."""
    outcome: list[BaseException | dict[str, str]] = []

    def read() -> None:
        try:
            outcome.append(resolve_secrets(spec_, home, {}))
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(seconds)
    if reader.is_alive():
        fifo = home / "tok.fifo"
        if fifo.exists():  # let the blocked read end, so the test run does not hang
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"reading the secret blocked for {seconds} s")
    [result] = outcome
    assert isinstance(result, AccountError), result
    return str(result)


def test_a_fifo_is_refused_at_once(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "tok.fifo")
    s = AccountSpec("toy", "main", {}, {"token": {"file": "tok.fifo"}})
    assert refused_within(s, tmp_path) == f"token_file: cannot read {tmp_path / 'tok.fifo'}: not a regular file"


def test_a_device_is_refused_without_reading_it(tmp_path: Path) -> None:
    s = AccountSpec("toy", "main", {}, {"token": {"file": "/dev/zero"}})
    assert refused_within(s, tmp_path) == "token_file: cannot read /dev/zero: not a regular file"


def test_a_huge_file_is_refused_and_a_small_one_read(tmp_path: Path) -> None:
    with open(tmp_path / "big", "wb") as big:
        big.truncate(1 << 30)  # sparse: a gigabyte that costs nothing on disk
    s = AccountSpec("toy", "main", {}, {"token": {"file": "big"}})
    assert "1,073,741,824 bytes, more than a secret's" in refused_within(s, tmp_path)
    (tmp_path / "ok").write_text("x" * (SECRET_FILE_MAX - 1) + "\n")
    assert resolve_secrets(AccountSpec("toy", "main", {}, {"token": {"file": "ok"}}), tmp_path, {}) == {
        "token": "x" * (SECRET_FILE_MAX - 1)
    }
    (tmp_path / "binary").write_bytes(b"\xff\xfe")
    bad = AccountSpec("toy", "main", {}, {"token": {"file": "binary"}})
    assert refused_within(bad, tmp_path).endswith("not UTF-8 text")


async def test_the_account_with_a_fifo_is_error_and_the_others_run(tmp_path: Path) -> None:
    write_plugin(tmp_path)
    os.mkfifo(tmp_path / "tok.fifo")
    bad, _, bad_events = spec(token={"file": "tok.fifo"})
    good, _, good_events = spec(token={"env": "TOY_TOKEN"})
    hb, hg = Harness(tmp_path, bad), Harness(tmp_path, good, {"TOY_TOKEN": "t0k"})
    try:
        hb.start()
        hg.start()
        await hb.until(lambda: hb.runner.ready.is_set() and hg.runner.ready.is_set())
        assert hb.states[-1] == ("error", f"token_file: cannot read {tmp_path / 'tok.fifo'}: not a regular file")
        assert hg.states[-1] == ("running", None) and good_events == [("start", "run", {"token": "t0k"})]
        assert bad_events == []
    finally:
        os.close(os.open(tmp_path / "tok.fifo", os.O_RDWR | os.O_NONBLOCK))  # never leave a reader blocked
        await asyncio.wait_for(asyncio.gather(hb.close(), hg.close()), 5)
