"""Schedule parsing, next-fire times across DST (issue 6 check 7), jitter, the envelope."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

from cron.envelope import NO_USER_LINE, build_envelope
from cron.schedule import (
    ScheduleError,
    ScheduleSpec,
    due_time,
    jitter_fraction,
    next_occurrence,
    parse_at,
    parse_duration,
    upcoming,
    validate_new,
)
from cron.store import Occurrence, make_task

NY = ZoneInfo("America/New_York")


def local(tz: str, text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=ZoneInfo(tz))


def fires_on_day(expr: str, tz: str, day: str) -> list[datetime]:
    """Every fire whose local date is `day`, as aware local datetimes."""
    start = local(tz, day) - timedelta(days=1)
    spec = ScheduleSpec("cron", expr, tz)
    out = []
    for t in upcoming(spec, start, start, 200):
        lt = t.astimezone(ZoneInfo(tz))
        if lt.date().isoformat() > day:
            break
        if lt.date().isoformat() == day:
            out.append(lt)
    return out


# ------------------------------------------------------------------ check 7: the DST table


def test_fall_back_fixed_time_fires_once_new_york() -> None:
    fires = fires_on_day("30 1 * * *", "America/New_York", "2026-11-01")
    assert len(fires) == 1
    assert fires[0].astimezone(UTC) == datetime(2026, 11, 1, 5, 30, tzinfo=UTC)  # 01:30 EDT, first pass
    assert fires[0].utcoffset() == timedelta(hours=-4)


def test_spring_forward_skipped_time_fires_at_the_jump_new_york() -> None:
    fires = fires_on_day("30 2 * * *", "America/New_York", "2026-03-08")
    assert len(fires) == 1
    assert (fires[0].hour, fires[0].minute) == (3, 0)
    assert fires[0].astimezone(UTC) == datetime(2026, 3, 8, 7, 0, tzinfo=UTC)
    # and the next day it is back to 02:30
    nxt = fires_on_day("30 2 * * *", "America/New_York", "2026-03-09")
    assert [(f.hour, f.minute) for f in nxt] == [(2, 30)]


def test_hebron_midnight_that_does_not_exist() -> None:
    # Asia/Hebron jumped from 00:00 to 01:00 on 2022-03-27: midnight did not exist that day.
    assert fires_on_day("0 0 * * *", "Asia/Hebron", "2022-03-26")[0].hour == 0
    fires = fires_on_day("0 0 * * *", "Asia/Hebron", "2022-03-27")
    assert len(fires) == 1
    assert fires[0].hour == 1 and fires[0].utcoffset() == timedelta(hours=3)
    assert fires[0].astimezone(UTC) == datetime(2022, 3, 26, 22, 0, tzinfo=UTC)
    assert [f.hour for f in fires_on_day("0 0 * * *", "Asia/Hebron", "2022-03-28")] == [0]


def test_paris_spring_forward() -> None:
    fires = fires_on_day("30 2 * * *", "Europe/Paris", "2026-03-29")
    assert [(f.hour, f.minute) for f in fires] == [(3, 0)]
    assert fires[0].astimezone(UTC) == datetime(2026, 3, 29, 1, 0, tzinfo=UTC)
    # several wall times inside the gap collapse into one fire at the jump
    fires = fires_on_day("*/15 2 * * *", "Europe/Paris", "2026-03-29")
    assert [(f.hour, f.minute) for f in fires] == [(3, 0)]
    # a 03:00 job and a 02:xx job do not both fire at 03:00
    fires = fires_on_day("0 2,3 * * *", "Europe/Paris", "2026-03-29")
    assert [(f.hour, f.minute) for f in fires] == [(3, 0)]


def test_paris_fall_back_fixed_fires_once() -> None:
    fires = fires_on_day("30 2 * * *", "Europe/Paris", "2026-10-25")
    assert len(fires) == 1 and fires[0].utcoffset() == timedelta(hours=2)


def test_wildcard_job_follows_real_time_through_fall_back() -> None:
    # Vixie: a job with * in minute or hour runs in both passes of the repeated hour
    fires = fires_on_day("0 * * * *", "America/New_York", "2026-11-01")
    assert len(fires) == 25
    ones = [f for f in fires if f.hour == 1]
    assert [f.utcoffset() for f in ones] == [timedelta(hours=-4), timedelta(hours=-5)]
    fires = fires_on_day("*/20 1 * * *", "America/New_York", "2026-11-01")
    assert len(fires) == 6


def test_spring_forward_day_hourly_job_has_23_fires() -> None:
    assert len(fires_on_day("0 * * * *", "America/New_York", "2026-03-08")) == 23


def test_next_occurrence_from_inside_the_repeated_hour() -> None:
    fixed = ScheduleSpec("cron", "30 1 * * *", "America/New_York")
    first_pass = datetime(2026, 11, 1, 5, 45, tzinfo=UTC)  # 01:45 EDT
    second_pass = datetime(2026, 11, 1, 6, 10, tzinfo=UTC)  # 01:10 EST
    for after in (first_pass, second_pass):
        nxt = next_occurrence(fixed, after, after)
        assert nxt == datetime(2026, 11, 2, 6, 30, tzinfo=UTC)
    wild = ScheduleSpec("cron", "*/20 * * * *", "America/New_York")
    assert next_occurrence(wild, datetime(2026, 11, 1, 5, 50, tzinfo=UTC), first_pass) == datetime(
        2026, 11, 1, 6, 0, tzinfo=UTC
    )  # 01:00 EST, the second pass, right after 01:40 EDT
    assert next_occurrence(wild, second_pass, second_pass) == datetime(2026, 11, 1, 6, 20, tzinfo=UTC)


def test_unaffected_days_are_plain() -> None:
    spec = ScheduleSpec("cron", "0 8 * * 1-5", "Europe/Paris")
    start = local("Europe/Paris", "2026-06-05 09:00")  # a Friday
    got = [t.astimezone(ZoneInfo("Europe/Paris")) for t in upcoming(spec, start, start, 3)]
    assert [(t.day, t.hour) for t in got] == [(8, 8), (9, 8), (10, 8)]


# ------------------------------------------------------------------ parsing and refusals


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("30m", 1800), ("2h", 7200), ("1h30m", 5400), ("45s", 45), ("1d", 86400), (" 2 h ", 7200)],
)
def test_parse_duration(text: str, seconds: int) -> None:
    assert parse_duration(text).total_seconds() == seconds


@pytest.mark.parametrize("text", ["0m", "0s", "", "5", "2w", "-1h", "1.5h", "abc"])
def test_parse_duration_refuses(text: str) -> None:
    with pytest.raises(ScheduleError):
        parse_duration(text)


def test_every_is_anchored_at_creation() -> None:
    created = datetime(2026, 1, 1, 0, 0, 7, tzinfo=UTC)
    spec = ScheduleSpec("every", "30m", "UTC")
    assert next_occurrence(spec, created, created) == created + timedelta(minutes=30)
    later = created + timedelta(hours=5, minutes=1)
    assert next_occurrence(spec, later, created) == created + timedelta(hours=5, minutes=30)


def test_at_is_in_the_task_timezone_and_one_shot() -> None:
    spec = ScheduleSpec("at", "2026-12-01 08:00", "Europe/Paris")
    now = datetime(2026, 11, 1, tzinfo=UTC)
    first = validate_new(spec, now)
    assert first == datetime(2026, 12, 1, 7, 0, tzinfo=UTC)
    assert next_occurrence(spec, first, now) is None


def test_at_in_a_gap_fires_at_the_jump() -> None:
    assert parse_at("2026-03-08 02:30", "America/New_York") == datetime(2026, 3, 8, 7, 0, tzinfo=UTC)


def test_in_is_relative_to_creation() -> None:
    now = datetime(2026, 5, 5, 10, 0, 1, tzinfo=UTC)
    assert validate_new(ScheduleSpec("in", "2h", "UTC"), now) == now + timedelta(hours=2)


@pytest.mark.parametrize(
    "spec",
    [
        ScheduleSpec("cron", "61 * * * *", "UTC"),
        ScheduleSpec("cron", "* * * *", "UTC"),
        ScheduleSpec("cron", "0 0 * * * *", "UTC"),
        ScheduleSpec("cron", "0 0 30 2 *", "UTC"),  # valid syntax, never fires
        ScheduleSpec("cron", "0 8 * * *", "Not/AZone"),
        ScheduleSpec("cron", "0 8 * * *", "../../etc/passwd"),
        ScheduleSpec("every", "0m", "UTC"),
        ScheduleSpec("at", "2020-01-01 08:00", "UTC"),
        ScheduleSpec("at", "tomorrow", "UTC"),
        ScheduleSpec("in", "0s", "UTC"),
        ScheduleSpec("weekly", "x", "UTC"),
    ],
)
def test_validate_new_refuses(spec: ScheduleSpec) -> None:
    with pytest.raises(ScheduleError):
        validate_new(spec, datetime(2026, 1, 1, tzinfo=UTC))


# ------------------------------------------------------------------ jitter (DESIGN §10)


def test_jitter_is_stable_per_task_and_bounded() -> None:
    assert jitter_fraction("cron_a") == jitter_fraction("cron_a")
    assert jitter_fraction("cron_a") != jitter_fraction("cron_b")
    created = datetime(2026, 1, 1, tzinfo=UTC)
    hourly = ScheduleSpec("cron", "0 * * * *", "UTC")
    minutely = ScheduleSpec("every", "1m", "UTC")
    nominal = datetime(2026, 1, 2, 10, 0, tzinfo=UTC)
    lates_h, lates_m = [], []
    for i in range(300):
        tid = f"cron_{i}"
        lates_h.append(
            (due_time(hourly, nominal, task_id=tid, created_at=created, exact=False) - nominal).total_seconds()
        )
        lates_m.append(
            (due_time(minutely, nominal, task_id=tid, created_at=created, exact=False) - nominal).total_seconds()
        )
    assert 0 <= min(lates_h) and max(lates_h) <= 59 and max(lates_h) > 40  # min(10% of 1 h, 59 s)
    assert 0 <= min(lates_m) and max(lates_m) <= 6 and max(lates_m) > 4  # 10% of 60 s
    assert due_time(hourly, nominal, task_id="cron_1", created_at=created, exact=True) == nominal


def test_one_shot_jitter_is_early_on_round_times_never_before_creation() -> None:
    created = datetime(2026, 1, 1, 7, 0, tzinfo=UTC)
    on_hour = ScheduleSpec("at", "2026-01-01 08:00", "UTC")
    nominal = datetime(2026, 1, 1, 8, 0, tzinfo=UTC)
    earl = [
        (nominal - due_time(on_hour, nominal, task_id=f"t{i}", created_at=created, exact=False)).total_seconds()
        for i in range(300)
    ]
    assert 0 <= min(earl) and max(earl) <= 90 and max(earl) > 60
    odd = ScheduleSpec("at", "2026-01-01 08:17", "UTC")
    n2 = datetime(2026, 1, 1, 8, 17, tzinfo=UTC)
    assert due_time(odd, n2, task_id="t1", created_at=created, exact=False) == n2
    # created 10 s before the half hour: never earlier than creation
    created2 = datetime(2026, 1, 1, 8, 29, 50, tzinfo=UTC)
    n3 = datetime(2026, 1, 1, 8, 30, tzinfo=UTC)
    half = ScheduleSpec("at", "2026-01-01 08:30", "UTC")
    for i in range(100):
        assert due_time(half, n3, task_id=f"t{i}", created_at=created2, exact=False) >= created2


# ------------------------------------------------------------------ envelope


def test_envelope_states_everything() -> None:
    now = datetime(2026, 12, 1, 7, 0, 42, tzinfo=UTC)
    task = make_task(
        name="morning-brief",
        agent="echo",
        schedule=ScheduleSpec("cron", "0 8 * * *", "Europe/Paris"),
        prompt="Summarise my inbox.",
        now=now - timedelta(days=3),
        deliver="slack:acme:C42",
    )
    occ = Occurrence(
        task_id=task.id,
        number=4,
        scheduled_for=datetime(2026, 12, 1, 7, 0, tzinfo=UTC),
        due_at=datetime(2026, 12, 1, 7, 0, 30, tzinfo=UTC),
        fired_at=now,
    )
    text = build_envelope(task, occ)
    assert "morning-brief" in text
    assert "Scheduled for: 2026-12-01 08:00:00 CET" in text
    assert "Current time: 2026-12-01 08:00:42 CET" in text
    assert "Timezone: Europe/Paris" in text
    assert "#4" in text
    assert NO_USER_LINE in text and "No user is watching" in text
    assert "slack:acme:C42" in text
    assert text.endswith("\n\nSummarise my inbox.")
