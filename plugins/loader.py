"""Find and import channel plugins: the first-party ones by module name, user plugins from
`$APPSERVER_HOME/channels/<id>/channel.json` (DESIGN §9).

A user plugin's manifest is `{"id": "<folder name>", "entry": "plugin.py", "packages": [...]}`:
`entry` is a file (`plugin.py`, `pkg/mod.py`) or a module name (`plugin`, `pkg.mod`) inside the
folder and cannot leave it (no `..`, no absolute path, symlinks resolved); `packages` is
informational and never installed at run time. Every problem is a `PluginError` naming the channel,
the file and the reason: nothing is skipped silently. A manifest that is not JSON at all is moved
aside to `channel.json.corrupt-<UTC timestamp>` (never emptied or overwritten).

The loader imports only `plugins.contract`, `plugins.statefile` and the standard library; the gateway
calls it.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import json
import logging
import re
import sys
import traceback
import types
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, cast

from plugins.contract import CreateAdapter
from plugins.statefile import atomic_write_text as atomic_write_text  # the gateway's small records
from plugins.statefile import move_aside as move_aside  # the gateway sets gateway.db aside with it

log = logging.getLogger(__name__)

FIRST_PARTY = {
    "webhook": "plugins.webhook",
    "telegram": "plugins.telegram",
    "slack": "plugins.slack",
    "discord": "plugins.discord",
}
ID_RE = re.compile(r"[a-z0-9][a-z0-9_-]*")
MANIFEST = "channel.json"
MODULE_PREFIX = "appserver_channel_"


class PluginError(Exception):
    """A channel plugin that cannot be loaded: a bad manifest, an entry outside its folder, a failing
    import, no `create_adapter`. `moved_to` is where an unparseable manifest was moved aside."""

    def __init__(self, channel: str, reason: str, *, path: Path | None = None, moved_to: Path | None = None) -> None:
        where = f" ({path})" if path is not None else ""
        super().__init__(f"channel '{channel}'{where}: {reason}")
        self.channel = channel
        self.reason = reason
        self.path = path
        self.moved_to = moved_to


@dataclass(frozen=True, slots=True)
class Manifest:
    """A validated `channel.json`; `entry_path` is the resolved file inside the resolved `folder`."""

    id: str
    entry: str
    packages: tuple[str, ...]
    folder: Path
    entry_path: Path


def channels_dir(home: Path) -> Path:
    return home / "channels"


def load_plugin(channel_id: str, home: Path) -> CreateAdapter:
    """The `create_adapter` of channel `channel_id`: first-party when the id is one (a user folder
    with that id is refused by `discover`, never used), else the user plugin in `$home/channels/<id>/`.
    Each call imports the user plugin afresh. Raises `PluginError`."""
    if channel_id in FIRST_PARTY:
        return _load_first_party(channel_id)
    if not ID_RE.fullmatch(channel_id):
        raise PluginError(channel_id, f"not a valid channel id (must match {ID_RE.pattern})")
    folder = channels_dir(home) / channel_id
    if not (folder / MANIFEST).is_file():
        raise PluginError(channel_id, f"unknown channel: not first-party and no {folder / MANIFEST}")
    return import_manifest(read_manifest(folder))


def discover(home: Path) -> dict[str, Manifest | PluginError]:
    """Every user plugin folder under `$home/channels/`, by folder name, with its manifest or the
    reason it cannot be used. Plain files there (gateway.db) are not plugins; hidden folders are
    ignored, and so is a first-party id's folder without a manifest (adapter data may live there)."""
    found: dict[str, Manifest | PluginError] = {}
    root = channels_dir(home)
    if not root.is_dir():
        return found
    for folder in sorted(root.iterdir()):
        name = folder.name
        if name.startswith(".") or not folder.is_dir():
            continue
        has_manifest = (folder / MANIFEST).is_file()
        if name in FIRST_PARTY:
            if has_manifest:
                found[name] = PluginError(
                    name, "a user plugin cannot shadow the first-party channel of that id", path=folder / MANIFEST
                )
            continue
        if not has_manifest:
            found[name] = PluginError(name, f"folder has no {MANIFEST}", path=folder)
            continue
        try:
            found[name] = read_manifest(folder)
        except PluginError as exc:
            found[name] = exc
    return found


def read_manifest(folder: Path) -> Manifest:
    """Parse and validate `<folder>/channel.json`. Unparseable JSON is moved aside; a well-formed
    file with a wrong field is an error left in place."""
    name = folder.name
    path = folder / MANIFEST
    if name in FIRST_PARTY:
        raise PluginError(name, "a user plugin cannot shadow the first-party channel of that id", path=path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise PluginError(name, f"cannot read manifest: {exc}", path=path) from exc
    try:
        data: Any = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # also: too many digits, too deep
        moved_to = move_aside(path)
        log.error("channel '%s': %s is not valid JSON (%s); moved aside to %s", name, path, exc, moved_to)
        raise PluginError(
            name, f"not valid JSON ({exc}); moved aside to {moved_to.name}", path=path, moved_to=moved_to
        ) from exc
    if not isinstance(data, dict):
        raise PluginError(name, f"manifest must be a JSON object, not {type(data).__name__}", path=path)
    plugin_id = data.get("id")
    if not isinstance(plugin_id, str):
        raise PluginError(name, '"id" must be a string', path=path)
    if not ID_RE.fullmatch(plugin_id):
        raise PluginError(name, f'"id" {plugin_id!r} must match {ID_RE.pattern}', path=path)
    if plugin_id != name:
        raise PluginError(name, f'"id" {plugin_id!r} must equal the folder name {name!r}', path=path)
    entry = data.get("entry")
    if not isinstance(entry, str) or not entry:
        raise PluginError(name, '"entry" must be a non-empty string', path=path)
    packages = data.get("packages", [])
    if not isinstance(packages, list) or not all(isinstance(p, str) for p in packages):
        raise PluginError(name, '"packages" must be a list of requirement strings', path=path)
    return Manifest(plugin_id, entry, tuple(packages), folder.resolve(), _entry_path(name, folder, entry, path))


def _entry_path(name: str, folder: Path, entry: str, manifest: Path) -> Path:
    """The file `entry` names: a path (`plugin.py`, `pkg/mod.py`, `pkg/`) or a module (`pkg.mod`),
    resolved and required to stay inside the resolved folder."""
    if "\\" in entry or entry.startswith("/") or PurePosixPath(entry).is_absolute():
        raise PluginError(name, f'"entry" {entry!r} must be a relative path inside the folder', path=manifest)
    if entry.endswith(".py") or "/" in entry:
        rel = PurePosixPath(entry)
    else:
        if not all(part.isidentifier() for part in entry.split(".")):
            raise PluginError(name, f'"entry" {entry!r} is neither a .py file nor a module name', path=manifest)
        rel = PurePosixPath(*entry.split("."))
    if ".." in rel.parts:
        raise PluginError(name, f'"entry" {entry!r} must not contain ".."', path=manifest)
    base = folder.resolve()
    candidates = [rel] if rel.suffix == ".py" else [rel.with_suffix(".py"), rel / "__init__.py"]
    for candidate in candidates:
        target = (base / candidate).resolve()
        if not target.is_relative_to(base):
            raise PluginError(name, f'"entry" {entry!r} resolves to {target}, outside {base}', path=manifest)
        if target.is_file():
            return target
    raise PluginError(name, f'"entry" {entry!r} does not name a Python file in {base}', path=manifest)


def import_manifest(manifest: Manifest) -> CreateAdapter:
    """Import a user plugin's entry under the private package `appserver_channel_<id>` (so modules
    beside it can be imported relatively, or absolutely while the folder is on `sys.path` for the
    import) and return its `create_adapter`."""
    root = MODULE_PREFIX + _mangle(manifest.id)
    for key in [k for k in sys.modules if k == root or k.startswith(root + ".")]:
        del sys.modules[key]  # a fresh import each time: a changed plugin is picked up
    package = types.ModuleType(root, f"channel plugin {manifest.id!r}")
    package.__path__ = [str(manifest.folder)]
    package.__file__ = None
    package.__package__ = root
    sys.modules[root] = package
    parts = list(manifest.entry_path.relative_to(manifest.folder).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    name = ".".join([root, *parts])
    added = str(manifest.folder) not in sys.path
    if added:
        sys.path.insert(0, str(manifest.folder))
    try:
        if len(parts) > 1:
            importlib.import_module(".".join([root, *parts[:-1]]))
        is_package = manifest.entry_path.name == "__init__.py"
        spec = importlib.util.spec_from_file_location(
            name,
            manifest.entry_path,
            loader=_SourceOnlyLoader(name, str(manifest.entry_path)),
            submodule_search_locations=[str(manifest.entry_path.parent)] if is_package else None,
        )
        if spec is None or spec.loader is None:
            raise ImportError(f"no loader for {manifest.entry_path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:  # a plugin calling sys.exit() must not end the gateway
        for key in [k for k in sys.modules if k == root or k.startswith(root + ".")]:
            del sys.modules[key]
        raise PluginError(manifest.id, f"import failed: {_describe(exc)}", path=manifest.entry_path) from exc
    finally:
        if added:
            try:
                sys.path.remove(str(manifest.folder))
            except ValueError:
                pass
    return _create_adapter_of(manifest.id, module, manifest.entry_path)


class _SourceOnlyLoader(importlib.machinery.SourceFileLoader):
    """Compiles the entry from its source every time: a cached .pyc is trusted by mtime and size at
    one-second resolution, so an edited plugin could otherwise load stale; nothing is written into
    the user's plugin folder either."""

    def path_stats(self, path: str) -> Mapping[str, Any]:
        raise OSError("channel plugins are compiled from source")


def _load_first_party(channel_id: str) -> CreateAdapter:
    module_name = FIRST_PARTY[channel_id]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            raise PluginError(channel_id, f"channel '{channel_id}' is not built yet") from exc
        raise PluginError(channel_id, f"import failed: {_describe(exc)}") from exc
    except Exception as exc:
        raise PluginError(channel_id, f"import failed: {_describe(exc)}") from exc
    return _create_adapter_of(channel_id, module, None)


def _create_adapter_of(channel_id: str, module: types.ModuleType, path: Path | None) -> CreateAdapter:
    create = getattr(module, "create_adapter", None)
    if create is None:
        raise PluginError(channel_id, f"module {module.__name__} defines no create_adapter", path=path)
    if not callable(create):
        raise PluginError(channel_id, f"create_adapter in {module.__name__} is not callable", path=path)
    return cast(CreateAdapter, create)


def _describe(exc: BaseException) -> str:
    """`Type: message at file:line in function` with the traceback's last frame (a syntax error's
    own location)."""
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{text} at {exc.filename}:{exc.lineno}"
    frames = traceback.extract_tb(exc.__traceback__)
    if frames:
        last = frames[-1]
        text += f" at {last.filename}:{last.lineno} in {last.name}"
    return text


def _mangle(plugin_id: str) -> str:
    """An identifier for an id, one to one (`_` → `__`, `-` → `_h`)."""
    return plugin_id.replace("_", "__").replace("-", "_h")
