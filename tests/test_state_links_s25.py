"""State links (session 25): a home that is a symbolic link to nothing (its disk not mounted) is
refused by every command, naming the link and its target, and nothing is made where it points (it
was made anew there with the default config, auth off, and served); a state directory of the home
(`auth/`, `cron-runs/`, `channels/`, `workspaces/`) that is a link to nothing is refused the same
way, never read as empty ("no tokens", "no runs yet", every token refused without a word), also
when it goes away under a running server. A fresh home, and a home linked to a directory that is
there, work as before."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest

from appserver.fsutil import StateFileRefused, atomic_write_text, ensure_private_dir, state_file_stat
from tests.support.cli import CLIResult, cli_env, run_cli
from tests.support.net import SSL
from tests.support.serve import serving
from tests.support.wait import eventually

pytestmark = pytest.mark.timeout(60)


def _refused(r: CLIResult, link: Path, target: Path) -> str:
    """The one `error:` line of a refused command, which names the link and its target."""
    assert r.code != 0, (r.code, r.out, r.err)
    assert "Traceback" not in r.err, r.err
    lines = [line for line in r.err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, r.err
    assert str(link) in lines[0] and str(target) in lines[0] and "does not exist" in lines[0], lines[0]
    return lines[0]


def _serve_refused(home: Path, *args: str, env: dict[str, str] | None = None) -> CLIResult:
    """`serve` that must refuse to start (a start that serves ends the test with a timeout)."""
    return run_cli(home, "serve", "--listen", "127.0.0.1:0", *args, timeout=10, env=env)


def _token(home: Path) -> str:
    r = run_cli(home, "token", "create", "--name", "t", "--json")
    assert r.code == 0, r.err
    return str(r.json()["token"])


# ── the home itself ─────────────────────────────────────────────────────────────────────────────


def test_a_home_linked_to_an_unmounted_disk_is_refused_and_nothing_is_made_there(tmp_path: Path) -> None:
    real = tmp_path / "disk" / "home"  # the configured home, on the disk while it was mounted
    assert run_cli(real, "token", "create", "--name", "t").code == 0
    (real / "config.toml").write_text('[auth]\nmode = "token"\n')
    target = tmp_path / "unmounted" / "home"  # the mount point's path: the disk is not mounted
    link = tmp_path / "home-link"
    link.symlink_to(target)
    line = _refused(_serve_refused(link), link, target)
    assert "the home" in line
    for args in (("token", "list"), ("agents", "list"), ("cron", "list")):
        _refused(run_cli(link, *args), link, target)
    assert not (tmp_path / "unmounted").exists()
    assert link.is_symlink()


def test_a_home_under_a_directory_linked_to_nothing_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "unmounted"
    mount = tmp_path / "mnt"
    mount.symlink_to(target)
    home = mount / "appserver"
    _refused(run_cli(home, "agents", "list"), mount, target)
    assert not target.exists()


def test_a_fresh_home_and_a_home_linked_to_a_directory_still_work(tmp_path: Path) -> None:
    fresh = tmp_path / "new" / "home"
    r = run_cli(fresh, "token", "list")
    assert r.code == 0 and "no tokens" in r.out, r.err
    assert (fresh / "config.toml").is_file()

    real = tmp_path / "disk" / "home"
    real.mkdir(parents=True)
    link = tmp_path / "home-link"
    link.symlink_to(real)
    token = _token(link)
    assert (real / "auth" / "tokens.json").is_file()
    with serving(link, "--auth", "token") as sp:
        r2 = httpx.get(sp.url + "/v1/models", headers={"authorization": f"Bearer {token}"}, timeout=5, verify=SSL)
        assert r2.status_code == 200, r2.text


# ── a state directory of the home ───────────────────────────────────────────────────────────────


@pytest.fixture
def used_home(tmp_path: Path) -> Path:
    """A home with a token, a cron task with a run, and a webhook channel."""
    home = tmp_path / "home"
    _token(home)
    r = run_cli(home, "cron", "add", "--name", "c", "--agent", "assistant", "--every", "1h", "--prompt", "p")
    assert r.code == 0, r.err
    run_cli(home, "cron", "run", "c")
    args = ["channels", "add", "webhook", "main", "--set", "listen=127.0.0.1:0", "--secret", "secret=env:S"]
    assert run_cli(home, *args, env=cli_env(home, S="x")).code == 0
    return home


def _unmount(home: Path, name: str, tmp_path: Path) -> tuple[Path, Path]:
    """Move `home/name` to a disk and leave a link to where the disk would be mounted (it is not)."""
    link = home / name
    if link.exists():
        disk = tmp_path / "disk"
        disk.mkdir(exist_ok=True)
        shutil.move(str(link), str(disk / name))
    target = tmp_path / "unmounted" / name
    link.symlink_to(target)
    return link, target


COMMANDS = {
    "auth": [("token", "list")],
    "cron-runs": [("cron", "logs", "c")],
    "channels": [("channels", "status"), ("pairing", "list")],
    "workspaces": [("agents", "list")],
}


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_a_state_directory_linked_to_nothing_is_refused_never_read_as_empty(
    used_home: Path, tmp_path: Path, name: str
) -> None:
    link, target = _unmount(used_home, name, tmp_path)
    for args in COMMANDS[name]:
        r = run_cli(used_home, *args)
        assert "no tokens" not in r.out and "no runs yet" not in r.out and "does not exist yet" not in r.out
        _refused(r, link, target)
    assert not (tmp_path / "unmounted").exists()
    assert link.is_symlink()


def test_serve_with_auth_linked_to_nothing_refuses_to_start(used_home: Path, tmp_path: Path) -> None:
    link, target = _unmount(used_home, "auth", tmp_path)
    env = cli_env(used_home, APPSERVER_AUTH__MODE="token")
    _refused(_serve_refused(used_home, env=env), link, target)
    assert not (tmp_path / "unmounted").exists()


def test_a_running_server_names_auth_gone_to_nothing_when_it_refuses_tokens(tmp_path: Path) -> None:
    home = tmp_path / "home"
    token = _token(home)
    with serving(home, "--auth", "token") as sp:
        headers = {"authorization": f"Bearer {token}"}
        assert httpx.get(sp.url + "/v1/models", headers=headers, timeout=5, verify=SSL).status_code == 200
        link, target = _unmount(home, "auth", tmp_path)  # the disk goes away under the server
        r = httpx.get(sp.url + "/v1/models", headers=headers, timeout=5, verify=SSL)
        assert r.status_code == 401, r.text
        assert sp.proc.stderr is not None
        named = f"{link}: a symbolic link to {target}"
        assert eventually(lambda: sp.proc.stderr.seen(named), 5), sp.proc.stderr.so_far()  # type: ignore[union-attr]
    assert not (tmp_path / "unmounted").exists()


# ── the shared helper, on real files ────────────────────────────────────────────────────────────


def test_the_state_file_helpers_name_a_directory_on_the_way_linked_to_nothing(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    target = tmp_path / "unmounted" / "auth"
    (home / "auth").symlink_to(target)
    tokens, sub = home / "auth" / "tokens.json", home / "auth" / "sub"
    for act, reached in (
        (lambda: state_file_stat(tokens), tokens),
        (lambda: ensure_private_dir(sub), sub),
        (lambda: atomic_write_text(tokens, "{}"), tokens),
    ):
        with pytest.raises(StateFileRefused) as info:
            act()
        assert info.value.path == home / "auth"
        assert str(target) in str(info.value) and str(reached) in str(info.value), info.value
    assert not (tmp_path / "unmounted").exists()
    # a missing file in a directory that is there, or behind a link to one, is simply missing
    (home / "auth").unlink()
    (home / "auth").symlink_to(tmp_path / "there", target_is_directory=True)
    (tmp_path / "there").mkdir()
    assert state_file_stat(home / "auth" / "tokens.json") is None
    assert state_file_stat(home / "cron-runs" / "x.jsonl") is None
