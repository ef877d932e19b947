"""Atomic state files: write to a temp file, fsync, rename; move unreadable files aside loudly."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import stat
import tempfile
import time
from pathlib import Path
from typing import Any, BinaryIO

from appserver.procid import identity_alive, process_start_ticks
from appserver.sqlitewal import side_link_problem

log = logging.getLogger("appserver.fs")


class CorruptStateFile(Exception):
    """A state file could not be parsed; it was moved aside to `moved_to`."""

    def __init__(self, path: Path, moved_to: Path, reason: str) -> None:
        super().__init__(f"{path} could not be read ({reason}); moved aside to {moved_to}")
        self.path = path
        self.moved_to = moved_to
        self.reason = reason


MIB = 1024 * 1024
# How much one state file may hold before it is refused as not appserver's (a link to /dev/zero, a
# sparse file, a wrong file copied in): reading it whole would use memory without bound. Far above
# what appserver writes (a token is ~300 bytes, a cron task ~1 KB with a long prompt).
CONFIG_MAX_BYTES = 4 * MIB
TOKENS_MAX_BYTES = 16 * MIB
CRONS_MAX_BYTES = 64 * MIB
SERVER_JSON_MAX_BYTES = 1 * MIB
POSITION_MAX_BYTES = 64 * 1024  # appserver.db.position: one small JSON object


class StateFileRefused(OSError):
    """A state file appserver will not read, left where it is (never moved aside): not a regular file
    (a FIFO would block every reader forever, a device never ends), a symbolic link to nothing (an
    unmounted disk: never "missing"), or a newer format. An OSError, so that every command's
    error handler shows it as one line naming the file."""

    def __init__(self, path: Path | str, problem: str, code: int = errno.EINVAL) -> None:
        super().__init__(code, problem, str(path))
        self.path = Path(path)
        self.problem = problem

    def __str__(self) -> str:
        return f"{self.path}: {self.problem}"


class StateFileTooLarge(StateFileRefused):
    """A regular state file larger than its limit. Files whose damage is handled by moving them aside
    catch this and move it aside like unparseable content; the others refuse it."""

    def __init__(self, path: Path | str, size: int, limit: int) -> None:
        self.size = size
        self.limit = limit
        super().__init__(
            path,
            f"{size} bytes, more than the {_amount(limit)} this file may hold (not a file appserver wrote: "
            "a damaged, sparse or wrong file)",
            errno.EFBIG,
        )

    @property
    def reason(self) -> str:
        """The reason given when the file is moved aside."""
        return f"{self.size} bytes, more than the {_amount(self.limit)} limit"


def _amount(n: int) -> str:
    return f"{n // MIB} MiB" if n >= MIB and n % MIB == 0 else f"{n} bytes"


def os_error_line(exc: OSError) -> str | None:
    """One line for an OSError reading or writing a named file (a full disk, a quota, a file size
    limit, permissions, a read-only file system): what, where and what to do, as every command and
    the server's log and error frames say it. None for an error that names no file (a connection's,
    a library's bare errno): the caller says those its own way."""
    where = exc.filename
    if where is None or exc.errno is None:
        return None
    if exc.errno == errno.ENOSPC:
        return f"no space left on the device holding {where}: free some space there and try again"
    if exc.errno == errno.EDQUOT:
        return f"disk quota exceeded on the device holding {where}: free some space or raise the quota, and try again"
    if exc.errno == errno.EFBIG and not isinstance(exc, StateFileRefused):
        return (
            f"{where} could not be written: file too large for the file system or this process's file "
            "size limit (ulimit -f); raise the limit and try again"
        )
    if exc.errno in (errno.EACCES, errno.EPERM):
        return f"permission denied: {where}: it must be readable and writable by the user running appserver"
    if exc.errno == errno.EROFS:
        return f"read-only file system: {where}: the home directory must be writable"
    if exc.errno == errno.ENOENT:
        return f"no such file or directory: {where}"
    return f"{where}: {exc.strerror or exc}"


def error_text(exc: BaseException) -> str:
    """An exception for a log line: a file's OSError as `os_error_line` says it, anything else as
    its message ("[Errno 28] No space left on device: '…'" was how a full disk read)."""
    said = os_error_line(exc) if isinstance(exc, OSError) else None
    return said if said is not None else str(exc) or type(exc).__name__


def file_kind(mode: int) -> str:
    """What a file that is not a regular file is, for an error line."""
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISFIFO(mode):
        return "FIFO (named pipe)"
    if stat.S_ISCHR(mode):
        return "character device"
    if stat.S_ISBLK(mode):
        return "block device"
    if stat.S_ISSOCK(mode):
        return "socket"
    return "special file"


def _check_regular(path: Path, st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise StateFileRefused(
            path,
            f"a {file_kind(st.st_mode)}, not a regular file: appserver reads its state only from regular files "
            "and left this one in place (never moved aside): replace it with the file, or remove it",
        )


def _unreachable(exc: OSError) -> bool:
    """Is this the error of a path that is not there, or that can never be reached (a loop of
    symbolic links, ELOOP)? Either way the nearest component that is there tells why."""
    return isinstance(exc, FileNotFoundError) or exc.errno == errno.ELOOP


def _dangling_component(path: Path) -> tuple[Path, str, bool] | None:
    """The link, its target, and whether it is a loop, when `path`, or the nearest of its
    directories that is there, is a symbolic link to nothing or a loop of links (ELOOP: following
    it never ends); else None (`path` exists, or is simply missing). Only the nearest existing
    component counts: everything below it is missing (or unreachable) because of it."""
    for part in (path, *path.parents):
        try:
            st = os.lstat(part)
        except OSError as exc:
            if _unreachable(exc):
                continue  # missing, or under a loop: look at the directory it would be in
            return None
        if not stat.S_ISLNK(st.st_mode):
            return None
        try:
            os.stat(part)
            return None  # a link to something: `path` below it is simply missing
        except OSError as exc:
            if not _unreachable(exc):
                return None
            loop = exc.errno == errno.ELOOP
        try:
            return part, os.readlink(part), loop
        except OSError:  # gone meanwhile
            return None
    return None


def _leads_nowhere(target: str, loop: bool) -> str:
    """How a link that is broken is said: a loop, or a link to nothing."""
    if loop:
        return f"a symbolic link loop (it points to {target}, and following it never ends)"
    return f"a symbolic link to {target}, which does not exist"


def dangling_link(path: Path, what: str = "file") -> StateFileRefused | None:
    """The error for `path` when it, or a directory on its way (`auth/`, the home itself), is a
    symbolic link to nothing (its target's disk not mounted, a restore that missed the target) or
    a loop of links, else None: such a file is never read as missing, nor made anew where the link
    points. Names the link."""
    found = _dangling_component(path)
    if found is None:
        return None
    link, target, loop = found
    code = errno.ELOOP if loop else errno.EINVAL
    if loop:
        fix = "point the link at what it should reach, or remove it"
    elif link == path:
        fix = f"make the {what} it points to available (is its disk mounted?), or remove the link"
    else:
        fix = "make the directory it points to available (is its disk mounted?), or remove the link"
    if link == path:
        return StateFileRefused(path, f"{_leads_nowhere(target, loop)}: {fix}", code)
    return StateFileRefused(link, f"{_leads_nowhere(target, loop)}, so {path} cannot be reached: {fix}", code)


def state_file_stat(path: Path) -> os.stat_result | None:
    """stat(2) through links; None when there is no file, StateFileRefused for a link to nothing
    or a loop of links."""
    try:
        return os.stat(path)
    except OSError as exc:
        if not _unreachable(exc):
            raise
        err = dangling_link(path)
        if err is not None:
            raise err from None
        if not isinstance(exc, FileNotFoundError):
            raise
        return None


# The files SQLite keeps beside a database (beside the file itself, for one reached through a link)
SQLITE_SIDE_FILES = (("-wal", "write-ahead log"), ("-shm", "shared-memory index"), ("-journal", "rollback journal"))


def check_sqlite_side_files(db: Path) -> None:
    """Refuse, before SQLite opens `db`, a `-wal`, `-shm` or `-journal` beside it that is not a
    regular file or is a symbolic link (to anything, or to nothing: SQLite opens none through a link
    and says only "unable to open database file"): SQLite would open the database read-only without
    a word, its first write failing with "attempt to write a readonly database" naming no file (a
    directory `-shm`), or create the link's target. StateFileRefused naming it; left in place."""
    real = Path(os.path.realpath(db))
    for suffix, role in SQLITE_SIDE_FILES:
        side = real.with_name(real.name + suffix)
        link = side_link_problem(side, real.name, role)  # said as for gateway.db's (appserver/sqlitewal.py)
        if link is not None:
            raise StateFileRefused(side, link)
        st = state_file_stat(side)
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise StateFileRefused(
                side,
                f"a {file_kind(st.st_mode)}, not a regular file: SQLite keeps {real.name}'s {role} here and cannot "
                "use this one; it was left in place (never moved aside): move it away, then start again",
            )


def open_state_file(path: Path) -> BinaryIO:
    """Open a state file for reading, only if it is a regular file (through symbolic links).

    Checked before opening (opening a device can itself act) and again on the open descriptor, which
    is opened non-blocking: a FIFO swapped in between the two is refused instead of blocking the
    reader forever. A missing file raises FileNotFoundError; a link to nothing StateFileRefused."""
    st = state_file_stat(path)
    if st is None:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))
    _check_regular(path, st)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        if not _unreachable(exc):
            raise
        err = dangling_link(path)
        if err is not None:
            raise err from None
        raise
    try:
        _check_regular(path, os.fstat(fd))
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_state_bytes(path: Path, limit: int) -> bytes:
    """The whole content of a state file of at most `limit` bytes (see `open_state_file`).
    Larger: StateFileTooLarge, without reading more than `limit` + 1 bytes (it may grow meanwhile)."""
    with open_state_file(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise StateFileTooLarge(path, size, limit)
        data = f.read(limit + 1)
    if len(data) > limit:
        raise StateFileTooLarge(path, len(data), limit)
    return data


# The directories appserver keeps in its home: each read as empty when it is missing
HOME_DIRS = ("auth", "cron-runs", "channels", "workspaces")


def dangling_home_link(home: Path) -> StateFileRefused | None:
    """The error when the home (as given, before it is resolved), a directory on its way, or one of
    its HOME_DIRS is a symbolic link to nothing, else None. Checked by every command before it reads
    or makes anything: a home on a disk that is not mounted must never be made anew with the default
    config (auth off), and an `auth/` there never read as "no tokens" (nor `cron-runs/` as no runs)."""
    found = _dangling_component(home)
    if found is not None:
        link, target, loop = found
        where = "the home" if link == home else f"a directory on the way to the home {home}"
        fix = "point the link at the directory it should reach"
        if not loop:
            fix = "make the directory it points to available (is its disk mounted?)"
        return StateFileRefused(
            link,
            f"{where} is {_leads_nowhere(target, loop)}: {fix}, or point APPSERVER_HOME (--home) elsewhere; "
            "nothing was made there",
            errno.ELOOP if loop else errno.EINVAL,
        )
    for name in HOME_DIRS:
        err = dangling_link(home / name, "directory")
        if err is not None:
            return err
    return None


def ensure_private_dir(path: Path) -> Path:
    """Make the directory (0700). A file in its place is named as such, not "File exists"."""
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
    except FileExistsError:
        if path.is_dir():  # made by someone else meanwhile
            return path
        dangling = dangling_link(path)
        if dangling is not None:
            raise dangling from None
        raise NotADirectoryError(
            errno.ENOTDIR,
            "exists but is not a directory; appserver keeps its state in a directory here: move the file away, "
            "or point APPSERVER_HOME (--home) at a directory",
            str(path),
        ) from None
    except OSError as exc:  # under a loop of symbolic links (ELOOP): named, as a link to nothing is
        if exc.errno != errno.ELOOP:
            raise
        loop = dangling_link(path, "directory")
        if loop is not None:
            raise loop from None
        raise
    return path


def _write_target(path: Path) -> Path:
    """Where an atomic write of `path` goes: `path` itself, or the existing regular file a symbolic
    link points to (the rename happens there, so the link is kept: a state file on another disk
    stays there). A link to nothing or to a non-regular file is refused: replacing the link would
    hide the real file, as writing a new one beside an unmounted disk would."""
    if not path.is_symlink():
        return path
    st = state_file_stat(path)  # StateFileRefused when the link leads nowhere
    if st is None:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))
    _check_regular(path, st)
    return Path(os.path.realpath(path))


# A temporary file of an atomic write is `.<name>.<pid>-<start>.<random>.tmp` beside its target: the
# writer's pid and start time (clock ticks since boot, 0 off Linux) say whose it is. A writer killed
# between creating it and the rename (kill -9, a power cut) leaves it behind, a copy of what it was
# writing (0600). The next atomic write of the same target (at most once a minute per target and
# process) and every start (`tighten_home`) remove those older than STALE_TEMP_S whose writer no
# longer runs; one of a live writer is never touched (it may be writing now). Temporaries of older
# versions (`.<name>.<random>.tmp`, no writer named) go once older than STALE_TEMP_S: a write takes
# far less, and one stalled that long fails at its rename (its file is gone) rather than losing data.
STALE_TEMP_S = 60.0
_TEMP_RANDOM = r"[a-z0-9_]{8}"  # tempfile's names: 8 of a-z, 0-9, _
_swept_at: dict[str, float] = {}  # target -> monotonic time of this process's last sweep of it


def _writer_tag() -> str:
    """`<pid>-<start ticks>` of this process (asked at every write: a forked child is another writer)."""
    pid = os.getpid()
    return f"{pid}-{process_start_ticks(pid) or 0}"


def _temp_pattern(name: str) -> re.Pattern[str]:
    return re.compile(rf"\.{re.escape(name)}\.(?:([1-9][0-9]{{0,9}})-([0-9]{{1,20}})\.)?{_TEMP_RANDOM}\.tmp")


def remove_stale_temporaries(path: Path, *, now: float | None = None) -> list[Path]:
    """Remove the temporaries that atomic writes of `path` (the file written: a symbolic link's
    target) left behind: older than STALE_TEMP_S and written by a process that no longer runs (or by
    an older version, which did not name its writer). Best effort: a file that cannot be looked at or
    removed is left. Returns what was removed."""
    pattern = _temp_pattern(path.name)
    now = time.time() if now is None else now
    removed: list[Path] = []
    try:
        entries = list(os.scandir(path.parent))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(f".{path.name}.") or not entry.name.endswith(".tmp"):
            continue
        found = pattern.fullmatch(entry.name)
        if found is None:
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode) or now - st.st_mtime < STALE_TEMP_S:
            continue  # (a fresh one may be written right now, whoever its writer is)
        pid, start = found.group(1), found.group(2)
        if pid is not None and identity_alive(f"{pid}:{start}"):
            continue
        try:
            os.unlink(entry.path)
        except OSError:
            continue
        removed.append(Path(entry.path))
    if removed:
        log.info(
            "removed %d temporary file(s) left by interrupted writes of %s: %s",
            len(removed),
            path,
            ", ".join(p.name for p in removed),
        )
    return removed


def _sweep_before_write(path: Path) -> None:
    """`remove_stale_temporaries(path)`, at most once per STALE_TEMP_S per target in this process
    (a state file written at every tick need not list its folder every time)."""
    key = str(path)
    now = time.monotonic()
    last = _swept_at.get(key)
    if last is not None and now - last < STALE_TEMP_S:
        return
    _swept_at[key] = now
    remove_stale_temporaries(path)


def atomic_write_bytes(path: Path, data: bytes, mode: int = 0o600, *, exclusive: bool = False) -> bool:
    """Write `data` to a temporary file, fsync, rename over `path` (through a symbolic link: see
    `_write_target`). Temporaries that interrupted writes of `path` left are removed first (see
    `remove_stale_temporaries`). `exclusive`: only if `path` does not exist (hard-linked into place,
    so a file another process made meanwhile is never replaced); False when it did. Else True."""
    named = path
    path = _write_target(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError:  # a directory on the way is a link to nothing (or a file): say which
        dangling = dangling_link(path)
        if dangling is not None:
            raise dangling from None
        raise
    _sweep_before_write(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{_writer_tag()}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if exclusive and not _link_into_place(tmp, path):
            return False
        if not exclusive:
            os.replace(tmp, path)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(exc, OSError) and exc.errno is not None:
            # name the file the caller writes, not the temporary (a new random name at every try,
            # which would make a lasting problem look like a new one each time it is logged)
            raise OSError(exc.errno, exc.strerror, str(named)) from exc
        raise
    fsync_dir(path.parent)
    return True


def _link_into_place(tmp: str, path: Path) -> bool:
    """Hard-link `tmp` to `path` unless `path` exists (then False); `tmp` is gone either way. On a
    file system without hard links, a check then a rename (a narrow window, as before)."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        os.unlink(tmp)
        return False
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
            raise
        if path.exists() or path.is_symlink():
            os.unlink(tmp)
            return False
        os.replace(tmp, path)
        return True
    os.unlink(tmp)
    return True


def fsync_dir(path: Path) -> None:
    """Make a rename in `path` durable (best effort: some file systems refuse directory fsync)."""
    try:
        dir_fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass


def atomic_write_text(path: Path, text: str, mode: int = 0o600, *, exclusive: bool = False) -> bool:
    return atomic_write_bytes(path, text.encode("utf-8"), mode, exclusive=exclusive)


def atomic_write_json(path: Path, value: Any, mode: int = 0o600, *, indent: int | None = 2) -> None:
    """`indent=None` for a file written often by a machine: the indenting encoder is pure Python
    and leaves cyclic garbage (its nested closures) at every call; the compact one is C."""
    atomic_write_text(path, json.dumps(value, indent=indent, sort_keys=False) + "\n", mode)


def move_aside(path: Path, reason: str, *, quiet: bool = False) -> CorruptStateFile:
    """Rename an unreadable state file to `<name>.corrupt-<timestamp>` and return the error to raise
    (logged unless `quiet`: the caller reports it in its own words)."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    target = path.with_name(f"{path.name}.corrupt-{stamp}")
    n = 1
    while target.exists():
        target = path.with_name(f"{path.name}.corrupt-{stamp}-{n}")
        n += 1
    os.replace(path, target)
    err = CorruptStateFile(path, target, reason)
    if not quiet:
        log.error("%s", err)
    return err


def read_json_or_move_aside(path: Path, limit: int) -> dict[str, Any] | None:
    """Parse a JSON state file holding an object. Missing → None (and only then: a JSON `null`, a
    list or a number is no state file of appserver's). Unparseable, not an object or over `limit`
    bytes → moved aside, CorruptStateFile raised. Not a regular file or a link to nothing →
    StateFileRefused, left in place."""
    try:
        raw = read_state_bytes(path, limit)
    except FileNotFoundError:
        return None
    except StateFileTooLarge as exc:
        raise move_aside(path, exc.reason) from None
    try:
        value = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        reason = "invalid JSON: nested too deeply" if isinstance(exc, RecursionError) else f"invalid JSON: {exc}"
        raise move_aside(path, reason) from None
    if not isinstance(value, dict):
        raise move_aside(path, f"expected a JSON object, got {_json_kind(value)}")
    return value


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "a list" if isinstance(value, list) else type(value).__name__


# Names appserver keeps in its home (top level); `tighten_home` leaves anything else alone.
HOME_ENTRIES = (
    "config.toml*",
    "appserver.db*",
    ".appserver.db*",
    "server.json",
    "serve.lock",
    "crons.json*",
    ".crons.json*",
    "auth",
    "cron-runs",
    "channels",
    "workspaces",
)
_RECURSE = ("auth", "cron-runs", "channels")  # workspaces: the directory is closed, its files are the agent's
# The home's files written by atomic writes, whose interrupted writes' temporaries every start removes
ATOMIC_STATE_FILES = ("config.toml", "crons.json", "server.json", "appserver.db.position", "auth/tokens.json")


def _tighten(path: Path, changed: list[Path]) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode) or st.st_uid != os.geteuid():
        return
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        os.chmod(path, mode & 0o700)
        changed.append(path)


def tighten_home(home: Path) -> list[Path]:
    """Remove group/other access from the home and appserver's files in it (umask 077 keeps new
    ones private; this fixes what an older version or a copy left open). Returns what changed.
    Also removes the temporaries interrupted atomic writes of the home's state files left
    (`remove_stale_temporaries`)."""
    changed: list[Path] = []
    try:
        st = os.stat(home)
    except FileNotFoundError:
        return changed
    for name in ATOMIC_STATE_FILES:
        try:
            remove_stale_temporaries(_write_target(home / name))
        except OSError:  # a link to nothing or no regular file: whoever reads it says so
            continue
    if st.st_mode & stat.S_ISVTX or st.st_uid != os.geteuid():
        log.warning("%s is shared (sticky or owned by another user): its permissions are left alone", home)
        return changed
    _tighten(home, changed)
    for pattern in HOME_ENTRIES:
        for entry in home.glob(pattern):
            _tighten(entry, changed)
            if entry.name in _RECURSE and entry.is_dir() and not entry.is_symlink():
                for root, dirs, files in os.walk(entry):
                    for name in (*dirs, *files):
                        _tighten(Path(root) / name, changed)
            elif entry.name == "workspaces" and entry.is_dir() and not entry.is_symlink():
                for agent_dir in entry.iterdir():
                    _tighten(agent_dir, changed)
    return changed


def set_aside_files(home: Path) -> list[Path]:
    """State files moved aside as unreadable (`<name>.corrupt-*`) that are still in the home:
    reported at every start and by /readyz until the operator restores or deletes them."""
    if not home.is_dir():
        return []
    found = [*home.glob("*.corrupt-*"), *home.glob("auth/*.corrupt-*"), *home.glob("channels/*.corrupt-*")]
    return sorted(found)


def set_aside_notice(home: Path, path: Path) -> str:
    """What to tell the operator about a state file that was moved aside as unreadable."""
    original = path.name.split(".corrupt-", 1)[0]
    rel = path.relative_to(home)
    return (
        f"{rel} was set aside as unreadable ({original} lost what it held): repair it and move it back "
        f"over {original}, or delete it once nothing in it is needed"
    )
