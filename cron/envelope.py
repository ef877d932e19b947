"""The `cron_prompt` envelope: what the agent reads before the task's prompt.

A scheduled run has no user to ask, and the model cannot know on its own when it is running or
whether it is late; the envelope states the task, the intended and actual times in the task's
timezone, the occurrence number, and that nobody is watching.
"""

from __future__ import annotations

from datetime import datetime

from cron.schedule import ScheduleError, get_zone
from cron.store import CronTask, Occurrence

NO_USER_LINE = (
    "No user is watching this run: it was started by the scheduler, not by a person. "
    "Do the task on your own; do not ask questions or wait for confirmation."
)
MANUAL_LINE = (
    "Started by hand (run now), outside the schedule. Nobody will answer during this run: "
    "do the task on your own; do not ask questions or wait for confirmation."
)


def _fmt(dt: datetime, tz_name: str) -> str:
    try:
        local = dt.astimezone(get_zone(tz_name))
    except ScheduleError:
        local = dt
    return local.strftime("%Y-%m-%d %H:%M:%S %Z (UTC%z)").replace("(UTC+0000)", "(UTC)")


def _late(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def build_envelope(task: CronTask, occurrence: Occurrence, agent_name: str | None = None) -> str:
    """The full input text of the `cron_prompt` turn (the agent by name when it is known)."""
    tz = task.schedule.tz
    lines = [
        f'Scheduled task "{task.name}" (id {task.id}, agent {agent_name or task.agent})',
        f"Schedule: {task.schedule.describe()}",
        f"Scheduled for: {_fmt(occurrence.scheduled_for, tz)}",
        f"Current time: {_fmt(occurrence.fired_at, tz)}",
        f"Timezone: {tz}",
        f"Occurrence: #{occurrence.number}",
    ]
    if occurrence.catch_up and not occurrence.manual:
        lines.append(f"This is a late catch-up run ({_late(occurrence.late_s)} after its scheduled time).")
    if task.deliver:
        lines.append(f"Your final reply will be delivered to {task.deliver}.")
    lines.append(MANUAL_LINE if occurrence.manual else NO_USER_LINE)
    return "\n".join(lines) + "\n\n" + task.prompt
