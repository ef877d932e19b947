"""A proxy URL of the environment that websockets cannot read is one masked line, never a traceback
quoting it: a password holding a character NFKC turns into a delimiter (urllib's ValueError named
the whole user part), a port that is no number, an IPv6 host without its bracket, a SOCKS proxy
without python-socks. A server URL whose user part ends in a fullwidth @ is masked too. Real CLI."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from appserver.client.auth import shown_url
from tests.support.cli import cli_env, run_cli

pytestmark = pytest.mark.timeout(60)

SECRET = "S3CR3TPW"
PROXIES = [
    f"http://alice:{SECRET}\uff0fx@127.0.0.1:9",  # a fullwidth solidus in the password
    f"http://alice:{SECRET}@127.0.0.1:abc",
    f"http://alice:{SECRET}@[::1",
]
if importlib.util.find_spec("python_socks") is None:
    PROXIES.append(f"socks5://alice:{SECRET}@127.0.0.1:9")


@pytest.mark.parametrize("proxy", PROXIES)
@pytest.mark.parametrize("command", ["run", "chat"])
def test_a_bad_proxy_of_the_environment_is_one_masked_line(home: Path, proxy: str, command: str) -> None:
    env = {**cli_env(home), "http_proxy": proxy, "https_proxy": proxy, "all_proxy": proxy}
    args = ["run", "--url", "http://127.0.0.1:9", "hi"] if command == "run" else ["chat", "--url", "http://127.0.0.1:9"]
    r = run_cli(home, *args, env=env, stdin="")
    assert r.code != 0, r
    assert "Traceback" not in r.err and "invalid proxy URL" in r.err, r.err
    assert SECRET not in r.err + r.out, r.err


@pytest.mark.parametrize("at", ["\uff20", "\ufe6b"])
def test_a_user_part_ending_in_a_fullwidth_at_is_masked(home: Path, at: str) -> None:
    url = f"http://alice:{SECRET}{at}127.0.0.1:9"
    assert SECRET not in shown_url(url)
    r = run_cli(home, "run", "--url", url, "hi")
    assert r.code != 0 and "Traceback" not in r.err, r
    assert SECRET not in r.err + r.out, r.err
