"""The plugin loader (DESIGN §9, issue 15): first-party channels by name, user plugins from
`$home/channels/<id>/channel.json` with every rule enforced and every failure a named PluginError."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from plugins.contract import Account, Adapter, AdapterContext, InboundMessage, Target
from plugins.loader import FIRST_PARTY, Manifest, PluginError, discover, load_plugin

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "plugins" / "echo_room"

MINIMAL = """
from plugins.contract import Limits

class Adapter:
    limits = Limits(max_length=100)

    def __init__(self, account, context):
        self.account = account
        self.running = False

    @property
    def is_running(self):
        return self.running

    async def start(self):
        self.running = True

    async def stop(self):
        self.running = False

    async def send(self, target, text):
        return [MARK]

MARK = "v1"

def create_adapter(account, context):
    return Adapter(account, context)
"""


def write_plugin(
    home: Path,
    folder: str,
    manifest: dict[str, Any] | str | None = None,
    files: dict[str, str] | None = None,
) -> Path:
    """A plugin folder: `manifest` as an object (dumped), raw text, or None for the default."""
    path = home / "channels" / folder
    path.mkdir(parents=True, exist_ok=True)
    if manifest is None:
        manifest = {"id": folder, "entry": "plugin.py"}
    text = manifest if isinstance(manifest, str) else json.dumps(manifest)
    (path / "channel.json").write_text(text, encoding="utf-8")
    for name, content in (files if files is not None else {"plugin.py": MINIMAL}).items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(content, encoding="utf-8")
    return path


def context(tmp_path: Path, inbox: list[InboundMessage], states: list[tuple[str, str | None]]) -> AdapterContext:
    async def on_message(msg: InboundMessage) -> None:
        inbox.append(msg)

    return AdapterContext(
        on_message=on_message,
        report=lambda state, reason: states.append((state, reason)),
        data_dir=tmp_path / "data",
        log=logging.getLogger("test.plugins"),
    )


def account(channel: str, settings: dict[str, Any] | None = None) -> Account:
    return Account(channel=channel, name="main", settings=settings or {}, secrets={})


def error_of(home: Path, channel: str) -> PluginError:
    with pytest.raises(PluginError) as info:
        load_plugin(channel, home)
    return info.value


# good plugins


async def test_a_good_user_plugin_loads_under_a_private_name(tmp_path: Path) -> None:
    home = tmp_path / "home"
    write_plugin(home, "my-chat")
    create = load_plugin("my-chat", home)
    adapter = create(account("my-chat"), context(tmp_path, [], []))
    assert isinstance(adapter, Adapter)
    await adapter.start()
    assert adapter.is_running
    assert await adapter.send(Target(chat="c"), "hi") == ["v1"]
    await adapter.stop()
    assert create.__module__.startswith("appserver_channel_")
    assert "my-chat" not in sys.modules and "plugin" not in sys.modules
    found = discover(home)
    assert isinstance(found["my-chat"], Manifest)
    assert found["my-chat"].entry_path == (home / "channels" / "my-chat" / "plugin.py").resolve()


def test_ids_with_dash_and_underscore_do_not_collide(tmp_path: Path) -> None:
    home = tmp_path / "home"
    write_plugin(home, "a-b", files={"plugin.py": MINIMAL})
    write_plugin(home, "a_b", files={"plugin.py": MINIMAL.replace('MARK = "v1"', 'MARK = "other"')})
    one, two = load_plugin("a-b", home), load_plugin("a_b", home)
    assert one.__module__ != two.__module__
    assert sys.modules[one.__module__].MARK == "v1"
    assert sys.modules[two.__module__].MARK == "other"


@pytest.mark.parametrize("entry", ["pkg/mod.py", "pkg.mod", "pkg/mod"])
def test_entry_in_a_subpackage_with_relative_and_sibling_imports(tmp_path: Path, entry: str) -> None:
    home = tmp_path / "home"
    files = {
        "pkg/__init__.py": "",
        "pkg/helper.py": "VALUE = 42\n",
        "pkg/mod.py": "from .helper import VALUE\n\ndef create_adapter(account, context):\n    return VALUE\n",
    }
    write_plugin(home, "sub", {"id": "sub", "entry": entry, "packages": ["requests>=2"]}, files)
    create: Any = load_plugin("sub", home)
    assert create(account("sub"), None) == 42
    found = discover(home)["sub"]
    assert isinstance(found, Manifest) and found.packages == ("requests>=2",)


def test_modules_beside_the_entry_import_relatively_or_by_name(tmp_path: Path) -> None:
    home = tmp_path / "home"
    files = {
        "plugin.py": (
            "from . import rel_helper\nimport abs_helper_zq\n\n"
            "def create_adapter(account, context):\n    return rel_helper.A + abs_helper_zq.B\n"
        ),
        "rel_helper.py": "A = 1\n",
        "abs_helper_zq.py": "B = 2\n",
    }
    folder = write_plugin(home, "sibs", files=files)
    create: Any = load_plugin("sibs", home)
    assert create(account("sibs"), None) == 3
    assert str(folder.resolve()) not in sys.path  # only on sys.path during the import


def test_a_plugin_is_imported_afresh_on_each_load(tmp_path: Path) -> None:
    home = tmp_path / "home"
    folder = write_plugin(home, "fresh")
    first = load_plugin("fresh", home)
    (folder / "plugin.py").write_text(MINIMAL.replace('MARK = "v1"', 'MARK = "v2"'), encoding="utf-8")
    second = load_plugin("fresh", home)
    assert sys.modules[first.__module__].MARK == "v2"  # same private name, new module
    assert first is not second


# manifest rules


def test_id_must_equal_the_folder_name(tmp_path: Path) -> None:
    home = tmp_path / "home"
    folder = write_plugin(home, "mine", {"id": "other", "entry": "plugin.py"})
    err = error_of(home, "mine")
    assert "must equal the folder name" in str(err) and str(folder / "channel.json") in str(err)
    assert (folder / "channel.json").exists()  # well-formed JSON is never moved
    assert isinstance(discover(home)["mine"], PluginError)


@pytest.mark.parametrize("bad", ["Upper", "_lead", "-lead", "sp ace", "dot.ted"])
def test_bad_ids_are_refused(tmp_path: Path, bad: str) -> None:
    home = tmp_path / "home"
    write_plugin(home, bad)
    err = error_of(home, bad)
    assert "valid channel id" in str(err)
    found = discover(home)[bad]
    assert isinstance(found, PluginError) and "must match" in found.reason


@pytest.mark.parametrize("channel", ["../etc", "a/b", ""])
def test_a_channel_id_cannot_name_a_path(tmp_path: Path, channel: str) -> None:
    assert "valid channel id" in str(error_of(tmp_path, channel))


@pytest.mark.parametrize(
    ("manifest", "reason"),
    [
        ("[1, 2]", "must be a JSON object"),
        ('{"entry": "plugin.py"}', '"id" must be a string'),
        ('{"id": "wrong", "entry": 3}', '"entry" must be a non-empty string'),
        ('{"id": "wrong", "entry": "plugin.py", "packages": "requests"}', '"packages" must be a list'),
        ('{"id": "wrong", "entry": "plugin.py", "packages": [1]}', '"packages" must be a list'),
    ],
)
def test_wrong_fields_are_errors_and_the_file_stays(tmp_path: Path, manifest: str, reason: str) -> None:
    home = tmp_path / "home"
    folder = write_plugin(home, "wrong", manifest)
    err = error_of(home, "wrong")
    assert reason in err.reason and err.path == folder / "channel.json"
    assert (folder / "channel.json").read_text() == manifest
    assert err.moved_to is None


def test_corrupt_json_is_moved_aside_intact(tmp_path: Path) -> None:
    home = tmp_path / "home"
    text = '{"id": "broken", "entry": '
    folder = write_plugin(home, "broken", text)
    err = error_of(home, "broken")
    assert "not valid JSON" in str(err) and err.moved_to is not None
    assert err.moved_to.name.startswith("channel.json.corrupt-") and err.moved_to.name in str(err)
    assert err.moved_to.read_text() == text
    assert not (folder / "channel.json").exists()
    # a second corrupt file in the same second gets its own name; nothing is overwritten
    (folder / "channel.json").write_bytes(b"\xff\xfe not utf-8")
    found = discover(home)["broken"]
    assert isinstance(found, PluginError) and found.moved_to is not None and found.moved_to != err.moved_to
    assert found.moved_to.read_bytes() == b"\xff\xfe not utf-8"
    assert err.moved_to.read_text() == text


# the entry cannot leave its folder


@pytest.mark.parametrize("entry", ["../outside.py", "pkg/../../outside.py", "/tmp/outside.py", "..", "a\\b.py"])
def test_entry_cannot_escape_by_path(tmp_path: Path, entry: str) -> None:
    home = tmp_path / "home"
    (home / "channels").mkdir(parents=True)
    (home / "channels" / "outside.py").write_text(MINIMAL)
    write_plugin(home, "esc", {"id": "esc", "entry": entry})
    err = error_of(home, "esc")
    assert "entry" in err.reason


def test_entry_cannot_escape_by_symlink(tmp_path: Path) -> None:
    home = tmp_path / "home"
    outside = tmp_path / "outside.py"
    outside.write_text(MINIMAL)
    folder = write_plugin(home, "link", files={})
    (folder / "plugin.py").symlink_to(outside)
    err = error_of(home, "link")
    assert "outside" in err.reason
    # a symlinked directory on the way out is caught as well
    (folder / "plugin.py").unlink()
    (folder / "sub").symlink_to(tmp_path, target_is_directory=True)
    (folder / "channel.json").write_text(json.dumps({"id": "link", "entry": "sub/outside.py"}))
    assert "outside" in error_of(home, "link").reason


def test_a_symlink_that_stays_inside_is_fine(tmp_path: Path) -> None:
    home = tmp_path / "home"
    folder = write_plugin(home, "inside", files={"real.py": MINIMAL})
    (folder / "plugin.py").symlink_to(folder / "real.py")
    assert callable(load_plugin("inside", home))


def test_entry_must_exist(tmp_path: Path) -> None:
    home = tmp_path / "home"
    write_plugin(home, "none", {"id": "none", "entry": "missing.py"})
    assert "does not name a Python file" in error_of(home, "none").reason


# imports


def test_an_exception_in_the_module_is_named_with_its_frame(tmp_path: Path) -> None:
    home = tmp_path / "home"
    folder = write_plugin(home, "boom", files={"plugin.py": "import os\n\nraise RuntimeError('kaboom')\n"})
    err = error_of(home, "boom")
    text = str(err)
    assert "boom" in text and "RuntimeError: kaboom" in text
    assert f"{(folder / 'plugin.py').resolve()}:3" in text
    assert isinstance(err.__cause__, RuntimeError)
    assert not [m for m in sys.modules if m.startswith("appserver_channel_boom")]


def test_a_syntax_error_and_a_missing_library_are_named(tmp_path: Path) -> None:
    home = tmp_path / "home"
    write_plugin(home, "syn", files={"plugin.py": "def create_adapter(:\n"})
    assert "SyntaxError" in str(error_of(home, "syn")) and "plugin.py:1" in str(error_of(home, "syn"))
    write_plugin(home, "lib", files={"plugin.py": "import no_such_platform_library_xyz\n"})
    err = error_of(home, "lib")
    assert "ModuleNotFoundError" in str(err) and "no_such_platform_library_xyz" in str(err)


def test_sys_exit_in_a_plugin_does_not_end_the_loader(tmp_path: Path) -> None:
    home = tmp_path / "home"
    write_plugin(home, "quitter", files={"plugin.py": "import sys\nsys.exit(3)\n"})
    assert "SystemExit" in str(error_of(home, "quitter"))


def test_create_adapter_must_exist_and_be_callable(tmp_path: Path) -> None:
    home = tmp_path / "home"
    write_plugin(home, "empty", files={"plugin.py": "X = 1\n"})
    assert "defines no create_adapter" in str(error_of(home, "empty"))
    write_plugin(home, "notcall", files={"plugin.py": "create_adapter = 1\n"})
    assert "not callable" in str(error_of(home, "notcall"))


# first-party channels


def test_first_party_ids_cannot_be_shadowed(tmp_path: Path) -> None:
    home = tmp_path / "home"
    write_plugin(home, "webhook")
    found = discover(home)["webhook"]
    assert isinstance(found, PluginError) and "cannot shadow" in str(found)
    import plugins.webhook

    assert load_plugin("webhook", home) is plugins.webhook.create_adapter  # never the user's


@pytest.mark.parametrize("channel", ["telegram", "slack", "discord"])
def test_first_party_channels_not_built_yet_say_so(tmp_path: Path, channel: str) -> None:
    module_dir = ROOT / "plugins" / channel
    if module_dir.exists() or module_dir.with_suffix(".py").exists():
        assert callable(load_plugin(channel, tmp_path))  # built since: it must load
        return
    err = error_of(tmp_path, channel)
    assert str(err).endswith(f"channel '{channel}' is not built yet")
    assert FIRST_PARTY[channel] == f"plugins.{channel}"


def test_an_unknown_channel_is_an_error(tmp_path: Path) -> None:
    assert "unknown channel" in str(error_of(tmp_path, "nowhere"))


def test_discover_reports_every_folder_and_skips_only_non_plugins(tmp_path: Path) -> None:
    home = tmp_path / "home"
    write_plugin(home, "good")
    (home / "channels" / "no-manifest").mkdir()
    (home / "channels" / ".hidden").mkdir()
    (home / "channels" / "telegram").mkdir()  # adapter data of a first-party channel, not a plugin
    (home / "channels" / "gateway.db").write_bytes(b"")
    found = discover(home)
    assert set(found) == {"good", "no-manifest"}
    assert isinstance(found["good"], Manifest)
    assert isinstance(found["no-manifest"], PluginError) and "no channel.json" in str(found["no-manifest"])
    assert discover(tmp_path / "nothing") == {}


# the example plugin


async def test_the_example_plugin_loads_from_a_home_and_runs(tmp_path: Path) -> None:
    home = tmp_path / "home"
    shutil.copytree(EXAMPLE, home / "channels" / "echo_room", ignore=shutil.ignore_patterns("__pycache__"))
    assert isinstance(discover(home)["echo_room"], Manifest)
    create = load_plugin("echo_room", home)
    inbox: list[InboundMessage] = []
    states: list[tuple[str, str | None]] = []
    room = tmp_path / "room"
    settings = {"inbox": str(room / "in.txt"), "outbox": str(room / "out.txt"), "poll_s": 0.02}
    adapter = create(account("echo_room", settings), context(tmp_path, inbox, states))
    assert isinstance(adapter, Adapter)
    await adapter.start()
    try:
        assert adapter.is_running and states[-1] == ("running", None)
        with (room / "in.txt").open("a") as f:
            f.write("ann: hello there\nno sender here\npartial")
        for _ in range(200):
            if len(inbox) >= 2:
                break
            await asyncio.sleep(0.01)
        assert [(m.sender, m.text, m.message_id) for m in inbox] == [
            ("ann", "hello there", "0"),
            ("you", "no sender here", "17"),
        ]
        assert inbox[0].channel == "echo_room" and inbox[0].account == "main" and inbox[0].chat == "room"
        ids = await adapter.send(Target(chat="room"), "hi ann")
        assert ids == ["0"] and (room / "out.txt").read_text() == "[room] hi ann\n"
    finally:
        await adapter.stop()
    assert not adapter.is_running and states[-1] == ("stopped", None)
