"""Issues 14.11 and 14.13: what a newcomer meets first. `make serve LISTEN=…` serves on that address;
`make test` without the conformance data says so loudly in its summary; examples/ws_client.py tells
how to create the agent it is pointed at instead of a bare error."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.support.cli import ROOT, cli_env
from tests.support.net import SSL, free_port
from tests.support.serve import start_serve

pytestmark = pytest.mark.timeout(60)


def test_make_serve_takes_listen(tmp_path: Path) -> None:
    venv = Path(sys.executable).parent.parent
    port = free_port()
    env = cli_env(tmp_path / "home")
    # -o: treat the install stamp as up to date (this venv is the one running the tests)
    make = subprocess.Popen(
        [
            "make",
            "-s",
            "-C",
            str(ROOT),
            f"VENV={venv}",
            "-o",
            f"{venv}/.installed-stamp",
            "serve",
            f"LISTEN=127.0.0.1:{port}",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1, verify=SSL)
                break
            except httpx.HTTPError:
                if make.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(
                        f"make serve LISTEN=127.0.0.1:{port} did not serve there: "
                        f"{make.stdout.read() if make.stdout else ''}"
                    ) from None
                time.sleep(0.05)
        assert r.status_code == 200
    finally:
        os.killpg(make.pid, signal.SIGTERM)
        make.wait(15)


def test_missing_conformance_data_is_loud_in_the_summary(tmp_path: Path) -> None:
    probe = tmp_path / "test_probe.py"
    probe.write_text(
        "from pathlib import Path\n"
        "from tests import openai_schema\n\n"
        "def test_needs_conformance(monkeypatch):\n"
        "    monkeypatch.setattr(openai_schema, 'CONFORMANCE', Path('/nonexistent/conformance'))\n"
        "    openai_schema.require_conformance()\n\n"
        "def test_other():\n"
        "    pass\n"
    )
    # the project's conftest (its summary hook) as a plugin, on a probe that skips like the real ones
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}  # no third-party plugins: a fast start
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider", str(probe)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    warning = [line for line in out.stdout.splitlines() if "WARNING" in line]
    assert (
        len(warning) == 1
        and "1 tests skipped: conformance data not found" in warning[0]
        and "NOT validated" in warning[0]
    ), out.stdout


def test_ws_client_example_says_how_to_create_the_agent(tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = cli_env(home)
    sp = start_serve(home, env=env)
    try:
        out = subprocess.run(
            [
                sys.executable,
                "examples/ws_client.py",
                "--url",
                sp.url,
                "--agent",
                "careful",
                "--approve",
                "/call clock {}",
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        )
    finally:
        sp.stop()
    assert out.returncode != 0
    assert (
        "agent_not_found" in out.stderr and "appserver agents create --name careful --tool clock=ask" in out.stderr
    ), out.stderr
    doc = (ROOT / "examples" / "ws_client.py").read_text()
    assert "appserver agents create --name careful --tool clock=ask" in doc
