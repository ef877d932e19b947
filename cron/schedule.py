"""Schedule parsing and next-fire computation, with DST rules we own rather than croniter's.

croniter is used only to match the five cron fields against *naive local wall times*. Mapping a wall
time to an instant is done here, because croniter 7 gets the fall-back day wrong (a fixed-time
`30 1 * * *` in America/New_York fires twice on 2026-11-01). Our rules (Vixie cron semantics):

* a wall time skipped by spring-forward fires at the jump (the first instant after the gap), once;
* a repeated wall time (fall-back) fires once, at its first pass, for a *fixed-time* job; a
  *wildcard* job (minute or hour field starting with `*`) follows real time and fires in both passes.
"""

from __future__ import annotations

import calendar
import hashlib
import heapq
import os
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterBadCronError, CroniterBadDateError, CroniterError, croniter

from appserver.shown import shown

KINDS = ("cron", "every", "at", "in")
MAX_LOOKAHEAD = 20_000  # wall-time candidates examined before a cron expression is called dead
RECURRING_JITTER_MAX_S = 59.0
ONESHOT_JITTER_EARLY_S = 90.0
MAX_DURATION_S = 36500 * 86400  # 100 years: `in`, `every` and max lateness stay datetime-safe

_MACROS = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
_FIELDS = ("minute", "hour", "day-of-month", "month", "day-of-week")
_BOUNDS = ((0, 59), (0, 23), (1, 31), (1, 12), (0, 6))
_NAMES: tuple[dict[str, int], ...] = (
    {},
    {},
    {},
    {
        m: i + 1
        for i, m in enumerate(("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"))
    },
    {d: i for i, d in enumerate(("sun", "mon", "tue", "wed", "thu", "fri", "sat"))},
)
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION_RE = re.compile(r"(\d+)\s*([smhd])", re.ASCII)
# More digits than this is beyond MAX_DURATION_S in any unit, and past a few thousand int() itself
# refuses with Python's own message: a longer number is refused here, in words, before int().
MAX_NUMBER_DIGITS = 12
# The longest cron expression read, whitespace collapsed. Every value of every field listed one by
# one (`0,1,…,59 0,1,…,23 1,2,…,31 jan,…,dec sun,…,sat`) is 391 characters, and a field lists each
# of its values once at most (`_check_field`), so no expression that means something reaches it.
# A longer one is refused before croniter reads it: croniter's cost grows with the text (a 480 KB
# list took seconds at every fire, in every `cron list`), and the scheduler parses it each time.
MAX_CRON_CHARS = 512
# The longest `every`/`in` duration or `at` time a new task may have: `36500d`, `1d23h59m59s`,
# `2026-12-01 08:00:00.000000+05:30` are far shorter, so a longer text (twenty thousand leading
# zeros, which still read as a small number) is refused when the task is made. (Reading one costs
# little, unlike a long cron expression: a task that already has one keeps working.)
MAX_TIME_CHARS = 64


class ScheduleError(ValueError):
    """A schedule cannot be used; the message says why in words a user can act on."""


@dataclass(frozen=True, slots=True)
class ScheduleSpec:
    """What the user asked for: `kind` cron|every|at|in, the expression text, an IANA timezone."""

    kind: str
    expr: str
    tz: str

    def to_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "expr": self.expr, "tz": self.tz}

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> ScheduleSpec:
        kind, expr, tz = data.get("kind"), data.get("expr"), data.get("tz")
        if not isinstance(kind, str) or not isinstance(expr, str) or not isinstance(tz, str):
            raise ValueError("schedule needs string kind, expr and tz")
        if kind not in KINDS:  # a hand edit: the task is kept as invalid, the others go on
            raise ValueError(f"unknown schedule kind {kind[:40]!r} (one of {', '.join(KINDS)})")
        return cls(kind, expr, tz)

    @property
    def recurring(self) -> bool:
        return self.kind in ("cron", "every")

    def describe(self) -> str:
        expr = shown_expr(self.expr)
        if self.kind == "cron":
            return f"cron '{expr}' ({self.tz})"
        return f"{self.kind} {expr}" + ("" if self.kind == "every" else f" ({self.tz})")


def shown_expr(expr: str) -> str:
    """A schedule's expression as a line shows it: whole, unless it is longer than any the
    scheduler reads (MAX_CRON_CHARS: a hand edit, an older version's task), then its start and length."""
    return expr if len(expr) <= MAX_CRON_CHARS else f"{expr[:60]}… ({len(expr)} characters)"


# ---------------------------------------------------------------- parsing helpers


def parse_duration(text: str, *, allow_zero: bool = False) -> timedelta:
    """`30m`, `2h`, `1h30m`, `45s`, `1d` → timedelta. Zero is refused unless `allow_zero`."""
    s = text.strip().lower().replace(" ", "")
    quoted = shown(text)
    if not s or _DURATION_RE.sub("", s):
        raise ScheduleError(f"invalid duration {quoted}: use a number with s, m, h or d, e.g. 30m or 1h30m")
    parts = _DURATION_RE.findall(s)
    if any(len(n.lstrip("0")) > MAX_NUMBER_DIGITS for n, _ in parts):
        raise ScheduleError(f"invalid duration {quoted}: at most {MAX_DURATION_S // 86400}d")
    total = sum(int(n.lstrip("0") or "0") * _UNIT_S[u] for n, u in parts)
    if total == 0 and not allow_zero:
        raise ScheduleError(f"invalid duration {quoted}: must be greater than zero")
    if total > MAX_DURATION_S:  # beyond this, date arithmetic overflows (or nobody means it)
        raise ScheduleError(f"invalid duration {quoted}: at most {MAX_DURATION_S // 86400}d")
    return timedelta(seconds=total)


VARIANT_TREES = ("right", "posix")  # copies of the zones in /usr/share/zoneinfo, not zones
# Files of /usr/share/zoneinfo that are no zone of their own: `localtime` is the distro's link to
# /etc/localtime (whatever zone the machine that fires has then), `posixrules` the zone the C
# library takes a POSIX TZ rule's DST dates from (a copy of America/New_York), `Factory` the
# placeholder of a machine whose zone was never set ("-00").
NOT_ZONES = frozenset({"localtime", "posixrules", "Factory"})


def get_zone(name: str) -> ZoneInfo:
    """An IANA zone, or a ScheduleError naming the bad zone (not a bare KeyError)."""
    shown = repr(name) if len(name) <= 64 else f"{name[:40]!r}… ({len(name)} characters)"
    unknown = f"unknown timezone {shown}: use an IANA name such as Europe/Paris"
    if not name or len(name) > 255 or name.startswith(("/", ".")) or ".." in name:
        raise ScheduleError(unknown)
    variant, _, plain = name.partition("/")
    if variant in VARIANT_TREES and plain:
        # zoneinfo reads the leap-second files of `right/` with a wrong offset (summer time all
        # winter): a task would fire an hour off without a word
        raise ScheduleError(f"timezone {shown} names a variant tree of the tz database, not a zone: use {plain!r}")
    if name in NOT_ZONES:
        # stored literally, a task's wall time would follow whatever the firing machine's file says
        raise ScheduleError(
            f"timezone {shown} is a file of the tz database that stands for another zone, not a zone: "
            "use an IANA zone name such as Europe/Paris, America/New_York or UTC"
        )
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        raise ScheduleError(unknown) from None


def local_zone_name() -> str:
    """The machine's IANA zone name: TZ when set, else /etc/localtime's or /etc/timezone's, else
    UTC. A TZ that names no IANA zone (a POSIX rule such as `CET-1CEST,M3.5.0,M10.5.0/3`, which the
    C library follows) is a ScheduleError asking for --tz: the system's zone would be another one
    than this process's local time, and a task would fire hours off without a word."""
    tz_env = os.environ.get("TZ", "").lstrip(":")
    if tz_env:
        named = _tz_env_zone(tz_env)
        if named is not None:
            return named
    candidates: list[str] = []
    try:
        target = os.path.realpath("/etc/localtime")
        if "zoneinfo/" in target:
            candidates.append(target.split("zoneinfo/", 1)[1])
    except OSError:
        pass
    try:
        candidates.append(Path("/etc/timezone").read_text("utf-8").strip())
    except OSError:
        pass
    for name in candidates:
        variant, _, plain = name.partition("/")
        name = plain if variant in VARIANT_TREES and plain else name  # the zone the variant is of
        try:
            get_zone(name)
            return name
        except ScheduleError:
            continue
    return "UTC"


def _tz_env_zone(value: str) -> str | None:
    """The IANA zone a TZ value names: a zone name, or a zoneinfo file's path; None for a path to
    /etc/localtime itself (`TZ=:/etc/localtime`: the system's zone, found as without TZ). Anything
    else is a ScheduleError: never quietly another zone than the one the process runs in."""
    name = value
    if value.startswith("/"):
        target = os.path.realpath(value)
        if target == os.path.realpath("/etc/localtime"):
            return None
        name = target.split("zoneinfo/", 1)[1] if "zoneinfo/" in target else ""
    variant, _, plain = name.partition("/")
    if variant in VARIANT_TREES and plain:
        raise ScheduleError(
            f"TZ={shown(value, 64)} names a variant tree of the tz database, not a zone: give --tz {plain}"
        )
    if name in NOT_ZONES:
        raise ScheduleError(
            f"TZ={shown(value, 64)} names no IANA timezone but a file standing for another zone, so this "
            "machine's timezone cannot be told: give --tz with an IANA name such as Europe/Paris"
        )
    try:
        get_zone(name)
    except ScheduleError:
        raise ScheduleError(
            f"TZ={shown(value, 64)} names no IANA timezone (a POSIX TZ rule or an unknown zone), so "
            "this machine's timezone cannot be told: give --tz with an IANA name such as Europe/Paris"
        ) from None
    return name


def normalize_cron(expr: str) -> str:
    """Collapse whitespace, expand @macros, insist on exactly five fields, and refuse what croniter
    accepts but a schedule must not mean: `R` (a random value, drawn anew whenever the expression
    is parsed, so every restart and every host would fire at another time) and reversed ranges
    such as `5-1` (croniter wraps them around; standard cron refuses them), and the day fields
    croniter misreads together (`_check_days`). A range of one value such as `5-5` is written as
    that value: croniter 7 reads it as the whole field (`0 0 3-3 * *` would fire every day),
    standard cron as the value. A value listed again in a field (`1,1`) is dropped; the whole
    expression is at most MAX_CRON_CHARS long (checked first, before anything parses it)."""
    e = " ".join(expr.split())
    if len(e) > MAX_CRON_CHARS:
        raise ScheduleError(
            f"invalid cron expression {shown(expr, 40)}: {len(e)} characters, at most {MAX_CRON_CHARS} (no "
            "schedule needs more: list a value once, write a range such as 1-5 or a step such as */15)"
        )
    e = _MACROS.get(e.lower(), e)
    fields = e.split(" ")
    if len(fields) != 5:
        raise ScheduleError(
            f"invalid cron expression {shown(expr)}: need 5 fields (minute hour day-of-month month day-of-week)"
        )
    fields = [_check_field(expr, index, text) for index, text in enumerate(fields)]
    e = " ".join(fields)
    try:
        croniter.expand(e)
    except CroniterError:
        raise ScheduleError(f"invalid cron expression {shown(expr)}{_croniter_problem(fields)}") from None
    _check_days(expr, fields[2], fields[4])
    return e


_CRONITER_EXPR = re.compile(r"\[[^\]]*\]\s*")  # croniter's messages repeat the expression in brackets


def _croniter_problem(fields: list[str]) -> str:
    """Why croniter refuses an expression, in words (": day-of-month field '5L': …"): the first
    field it refuses alone (the others `*`), with croniter's own reason when it gives one beyond
    "is not acceptable"; "" when no field alone is refused."""
    for index, text in enumerate(fields):
        probe = ["*"] * 5
        probe[index] = text
        try:
            croniter.expand(" ".join(probe))
        except CroniterError as exc:
            return f": {_FIELDS[index]} field {shown(text, 40)}: {_croniter_reason(index, str(exc))}"
    return ""


def _croniter_reason(index: int, message: str) -> str:
    """croniter's reason for refusing a field, without the expression it repeats."""
    lo, hi = _BOUNDS[index]
    if message.endswith("out of range"):
        return f"a value out of range (the field takes {lo}-{7 if index == 4 else hi})"
    reason = message.split(" Cron: ", 1)[0]  # (the unsupported-syntax message then quotes the expression)
    reason = _CRONITER_EXPR.sub("", reason, count=1).strip().rstrip(".")
    reason = re.sub(r" in field \d+", "", reason)
    if reason in ("", "is not acceptable"):
        return "not a value, range, step or list cron can read"
    return reason


_ANY_DAY = ("*", "?")


def _check_days(expr: str, dom: str, dow: str) -> None:
    """Refuse a day-of-week given as the nth or the last weekday of the month (`MON#2`, `L5`)
    beside a day-of-month that is not `*`, and a day-of-month given as the weekday nearest a day
    (`15W`) beside a day-of-week that is not `*`. Standard cron fires on a day either field
    matches (`0 0 13 * MON` on the 13th and on Mondays), but croniter then reads one field alone
    (`0 0 13 * MON#2`: second Mondays, never the 13th), or both together (`0 0 13 * L5`: never)."""
    where = f"invalid cron expression {shown(expr)}"
    if dom not in _ANY_DAY:
        for item in dow.split(","):
            if "#" in item or "l" in item.lower():  # (no day name holds an L)
                what = "an nth weekday of the month" if "#" in item else "a last weekday of the month"
                raise ScheduleError(
                    f"{where}: day-of-week {shown(item, 40)} ({what}) cannot be combined with a day-of-month "
                    f"({shown(dom, 40)}): it would not fire on a day either field matches, as cron does; write * "
                    "for the day-of-month, or make a second task for it"
                )
    if dow not in _ANY_DAY:
        for item in dom.split(","):
            if "w" in item.lower():
                raise ScheduleError(
                    f"{where}: day-of-month {shown(item, 40)} (the weekday nearest a day) cannot be combined with "
                    f"a day-of-week ({shown(dow, 40)}): it would not fire on a day either field matches, as cron "
                    "does; write * for the day-of-week, or make a second task for it"
                )


def _check_field(expr: str, index: int, text: str) -> str:
    """Refuse random values, reversed ranges and a list longer than the field has values in one
    field (the rest is croniter's to judge); the field with each item once (`1,1` is `1`) and each
    range of one value (`5-5`, `mon-mon`, `1-1/3`) written as that value."""
    where = f"invalid cron expression {shown(expr)}: {_FIELDS[index]} field {shown(text, 40)}"
    items = list(dict.fromkeys(item.strip() for item in text.split(",")))  # `1,1`: the value once
    lo, hi = _BOUNDS[index]
    values = hi - lo + 1 + (index == 4)  # (day 7 is Sunday too)
    if len(items) > values:
        raise ScheduleError(
            f"{where}: {len(items)} items in its list, more than the {values} values the field has; "
            "list each value once, or write a range"
        )
    for pos, item in enumerate(items):
        base = item.split("/", 1)[0].strip()
        if base.upper() == "R" or base.upper().startswith("R("):
            raise ScheduleError(f"{where}: random values (R) are not supported; give the value")
        low, sep, high = base.partition("-")
        if not sep:
            continue
        a, b = _field_value(index, low), _field_value(index, high)
        if a is not None and b is not None and a == b:
            items[pos] = low.strip()  # standard cron's one value, not croniter's whole field
        if a is not None and b is not None and a > b:
            lo, hi = _BOUNDS[index]
            if index == 4 and a == 7:  # day 7 is Sunday, as 0 is: `7-1` means `0-1`, no wrap at all
                wrap = f"e.g. {_span(0, b)}"
            elif _number(low) and _number(high):
                wrap = f"e.g. {_span(a, hi)},{_span(lo, b)}"
            else:
                wrap = "one range per part"
            raise ScheduleError(
                f"{where}: range {base} runs backwards; ranges run low-high, so list a range that wraps "
                f"around as two ({wrap})"
            )
    return ",".join(items)


def _span(a: int, b: int) -> str:
    """`a-b` for a hint, or `a` alone when the ends meet (croniter would read `a-a` as the whole field)."""
    return str(a) if a == b else f"{a}-{b}"


def _number(text: str) -> bool:
    """ASCII digits only (`str.isdigit` also takes `٥` and `²`, which cron does not read), and few
    enough for int(): a longer run is no field value, and croniter refuses it as such."""
    return text.isascii() and text.isdigit() and len(text) <= MAX_NUMBER_DIGITS


def _field_value(index: int, token: str) -> int | None:
    """A plain number or a month/day name as a number; None for anything else (L, W, #, …)."""
    t = token.strip().lower()
    if _number(t):
        return int(t)
    return _NAMES[index].get(t)


def is_wildcard_cron(expr: str) -> bool:
    """Vixie's rule: a job whose minute or hour field starts with `*` follows real time across DST."""
    minute, hour = normalize_cron(expr).split(" ")[:2]
    return minute.startswith("*") or hour.startswith("*")


def parse_at(text: str, tz: str) -> datetime:
    """`2026-12-01 08:00` (wall time in `tz`; an explicit offset wins) → aware instant."""
    written = text.strip().replace("/", "-")
    try:
        naive = datetime.fromisoformat(written)
    except ValueError as exc:
        raise ScheduleError(f"invalid time {shown(text)}: {_at_problem(written, str(exc))}") from None
    try:
        if naive.tzinfo is not None:
            return naive.astimezone(UTC)
        return wall_to_instants(naive, get_zone(tz), both_passes=False)[0]
    except OverflowError:
        raise ScheduleError(f"invalid time {shown(text)}: outside the dates a schedule can use") from None


_AT_DATE = re.compile(r"([0-9]{4})-([0-9]{2})-([0-9]{2})")
_AT_FIELD = re.compile(r"(year|month|day|hour|minute|second|microsecond) (?:\d+ )?(?:must be|is out of range)")


def _at_problem(written: str, reason: str) -> str:
    """Why `written` (an `--at` time) is no time, from fromisoformat's `reason`: the format hint
    when it is written wrongly; the date or the field that does not exist when the format is
    right (`2026-02-30 is not a date: February 2026 has 28 days`)."""
    hint = "use YYYY-MM-DD HH:MM (in the task's timezone)"
    if reason.startswith("Invalid isoformat string"):
        return hint
    found = _AT_DATE.match(written)
    if found is not None:
        year, month, day = (int(g) for g in found.groups())
        date = found.group(0)
        if not 1 <= year <= 9999:
            return f"{date} is not a date: years go from 0001 to 9999"
        if not 1 <= month <= 12:
            return f"{date} is not a date: there is no month {found.group(2)} (months are 01 to 12)"
        days = calendar.monthrange(year, month)[1]
        if not 1 <= day <= days:
            return f"{date} is not a date: {calendar.month_name[month]} {year} has {days} days"
    if "offset" in reason:
        return "the UTC offset must be less than 24 hours"
    field = _AT_FIELD.search(reason)
    if field is not None:
        limits = {"hour": "00 to 23", "minute": "00 to 59", "second": "00 to 59"}
        name = field.group(1)
        return f"no such time: the {name} must be {limits[name]}" if name in limits else f"no such time: {reason}"
    return f"{reason}; {hint}"


# ---------------------------------------------------------------- wall time → instants


def _transition_instant(lo: datetime, hi: datetime, tz: ZoneInfo) -> datetime:
    """First instant in (lo, hi] whose UTC offset equals hi's; transitions are on whole seconds."""
    target = hi.astimezone(tz).utcoffset()
    a, b = int(lo.timestamp()), int(hi.timestamp())
    while b - a > 1:
        mid = (a + b) // 2
        if datetime.fromtimestamp(mid, tz).utcoffset() == target:
            b = mid
        else:
            a = mid
    return datetime.fromtimestamp(b, UTC)


def wall_to_instants(wall: datetime, tz: ZoneInfo, *, both_passes: bool) -> list[datetime]:
    """UTC instants at which naive local `wall` happens: one normally; in a gap the jump instant;
    in a repeated hour the first pass, plus the second when `both_passes` (wildcard jobs)."""
    first = wall.replace(tzinfo=tz, fold=0).astimezone(UTC)
    second = wall.replace(tzinfo=tz, fold=1).astimezone(UTC)
    if first == second:
        return [first]
    if first < second:  # repeated wall time (fall-back)
        return [first, second] if both_passes else [first]
    # skipped wall time (spring-forward): fold=1 used the new offset, so it lies before the gap
    return [_transition_instant(second, first, tz)]


# ---------------------------------------------------------------- next fire


def _validate_expr(spec: ScheduleSpec) -> None:
    if spec.kind not in KINDS:
        raise ScheduleError(f"unknown schedule kind {shown(spec.kind)}")
    get_zone(spec.tz)
    if spec.kind == "cron":
        normalize_cron(spec.expr)
    elif spec.kind in ("every", "in"):
        parse_duration(spec.expr)
    else:
        parse_at(spec.expr, spec.tz)


def _next_cron(expr: str, tz: ZoneInfo, after: datetime) -> datetime:
    norm = normalize_cron(expr)
    both = is_wildcard_cron(norm)
    local = after.astimezone(tz)
    wall = local.replace(tzinfo=None, fold=0)
    if local.fold == 0:
        # `after` is in a first pass; walls since the start of the repeated hour may still have
        # their second pass ahead, so look back by the size of the fold.
        other = wall.replace(tzinfo=tz, fold=1).astimezone(UTC)
        if other > after:
            wall -= other - after
    try:
        it = croniter(norm, wall - timedelta(seconds=1), day_or=True)
    except (CroniterBadCronError, CroniterError) as exc:
        raise ScheduleError(f"invalid cron expression {shown(expr)}: {exc}") from None
    pending: list[datetime] = []  # second-pass instants seen so far (wildcard jobs only)
    for _ in range(MAX_LOOKAHEAD):
        try:
            cand = it.get_next(datetime)
        except CroniterBadDateError:
            break
        instants = wall_to_instants(cand, tz, both_passes=both)
        for extra in instants[1:]:
            if extra > after:
                heapq.heappush(pending, extra)
        primary = instants[0]
        if primary > after:
            # primaries are non-decreasing in wall time and every later second pass follows its
            # primary, so nothing later can beat this candidate or an earlier pending second pass
            return min(primary, pending[0]) if pending else primary
    if pending:
        return pending[0]
    raise ScheduleError(f"cron expression {shown(expr)} never fires")


def next_occurrence(spec: ScheduleSpec, after: datetime, created_at: datetime) -> datetime | None:
    """The first nominal occurrence strictly after `after` (aware), or None when a one-shot is over."""
    _validate_expr(spec)
    if spec.kind == "cron":
        return _next_cron(spec.expr, get_zone(spec.tz), after)
    try:
        if spec.kind == "every":
            step = parse_duration(spec.expr)
            if after < created_at:
                return created_at + step
            k = (after - created_at) // step + 1
            return created_at + k * step
        when = created_at + parse_duration(spec.expr) if spec.kind == "in" else parse_at(spec.expr, spec.tz)
    except OverflowError:  # past the year 9999: there is no next occurrence
        return None
    return when if when > after else None


def first_occurrence(spec: ScheduleSpec, created_at: datetime) -> datetime | None:
    """The first nominal occurrence of a task created at `created_at` (a one-shot may be exactly now)."""
    if spec.kind in ("at", "in"):
        return next_occurrence(spec, created_at - timedelta(microseconds=1), created_at)
    return next_occurrence(spec, created_at, created_at)


def validate_new(spec: ScheduleSpec, now: datetime) -> datetime:
    """Everything `add` must refuse: bad syntax, unknown zone, zero interval, a time already past,
    an expression that never fires, a duration or time longer than MAX_TIME_CHARS (a cron
    expression longer than MAX_CRON_CHARS is refused by `normalize_cron`). Returns the first occurrence."""
    if spec.kind != "cron" and len(spec.expr) > MAX_TIME_CHARS:
        what = "time" if spec.kind == "at" else "interval" if spec.kind == "every" else "duration"
        example = "YYYY-MM-DD HH:MM" if spec.kind == "at" else "e.g. 30m or 1h30m"
        raise ScheduleError(
            f"invalid {what} {shown(spec.expr)}: {len(spec.expr)} characters, at most {MAX_TIME_CHARS} ({example})"
        )
    _validate_expr(spec)
    if spec.kind == "at":
        when = parse_at(spec.expr, spec.tz)
        if when <= now:
            local = when.astimezone(get_zone(spec.tz))
            raise ScheduleError(f"time {shown(spec.expr)} ({local.isoformat()}) is in the past")
    first = first_occurrence(spec, now)
    if first is None:
        raise ScheduleError(f"schedule {spec.describe()} has no future occurrence")
    return first


def upcoming(spec: ScheduleSpec, after: datetime, created_at: datetime, count: int) -> list[datetime]:
    """The next `count` nominal occurrences strictly after `after` (for `cron preview`)."""
    out: list[datetime] = []
    cur = after
    for _ in range(count):
        nxt = next_occurrence(spec, cur, created_at)
        if nxt is None:
            break
        out.append(nxt)
        cur = nxt
    return out


# ---------------------------------------------------------------- jitter


def jitter_fraction(task_id: str) -> float:
    """A stable number in [0, 1) per task id, so a task's jitter is the same on every host and run."""
    digest = hashlib.sha256(task_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def due_time(
    spec: ScheduleSpec,
    nominal: datetime,
    *,
    task_id: str,
    created_at: datetime,
    exact: bool,
    period: timedelta | None = None,
) -> datetime:
    """When the scheduler actually fires `nominal`: recurring up to min(10 % of period, 59 s) late;
    a one-shot on the hour or half hour up to 90 s early but never before creation."""
    if exact:
        return nominal
    frac = jitter_fraction(task_id)
    if spec.recurring:
        if period is None:
            nxt = next_occurrence(spec, nominal, created_at)
            period = (nxt - nominal) if nxt is not None else timedelta(0)
        max_late = min(period.total_seconds() * 0.1, RECURRING_JITTER_MAX_S)
        return nominal + timedelta(seconds=round(frac * max_late, 3))
    local = nominal.astimezone(get_zone(spec.tz))
    if local.minute in (0, 30) and local.second == 0 and local.microsecond == 0:
        early = nominal - timedelta(seconds=round(frac * ONESHOT_JITTER_EARLY_S, 3))
        return max(early, created_at)
    return nominal
