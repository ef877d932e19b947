"""Retry policy: one pure function of (error, attempt) -> wait in ms, or None to give up."""

from __future__ import annotations

import datetime
import email.utils
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass

from appserver.providers.base import ProviderError, is_retryable_kind


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    max_attempts: int = 4  # total attempts including the first
    base_ms: int = 500
    cap_ms: int = 20_000
    max_retry_after_ms: int = 60_000


def retry_delay_ms(
    error: ProviderError,
    attempt: int,
    policy: RetryPolicy = RetryPolicy(),
    *,
    output_shown: bool = False,
) -> int | None:
    """Milliseconds to wait before attempt `attempt + 1`, or None to give up.

    `attempt` counts from 1 (the attempt that just failed). Nothing retries after output reached a
    client: the client has already seen part of an answer that a retry would contradict.

    A `Retry-After` longer than `max_retry_after_ms` gives up at once: retrying sooner than the
    upstream asked only meets the same refusal, so waiting the cap once per attempt (4 × 60 s for
    `Retry-After: 3600`) held the request for minutes before the same error. The error's message
    then says so, naming the wait the upstream asked for (the only change made to `error`).
    """
    if output_shown or not is_retryable_kind(error.kind) or attempt >= policy.max_attempts:
        return None
    if error.retry_after_s is not None and error.retry_after_s >= 0:
        wanted_ms = error.retry_after_s * 1000
        if wanted_ms > policy.max_retry_after_ms:
            _say_not_retried(error, policy)
            return None
        return int(wanted_ms)
    return int(min(policy.base_ms * (2 ** (attempt - 1)), policy.cap_ms))


RETRY_AFTER_NOTE = "not retried: the upstream asks to retry after"


def _say_not_retried(error: ProviderError, policy: RetryPolicy) -> None:
    """Add to the error's message why it was not retried (once, however often it is asked)."""
    if RETRY_AFTER_NOTE in error.message:
        return
    assert error.retry_after_s is not None
    note = (
        f"{RETRY_AFTER_NOTE} {error.retry_after_s:g} s (Retry-After), longer than this server waits "
        f"({policy.max_retry_after_ms / 1000:g} s)"
    )
    error.message = f"{error.message} ({note})" if error.message else note
    error.args = (error.message,)


def parse_retry_after(headers: Mapping[str, str], *, now: float | None = None) -> float | None:
    """Seconds to wait as the upstream asked, from `retry-after-ms` or `Retry-After`.

    `Retry-After` may be delta-seconds or an HTTP date; `retry-after-ms` (OpenAI, Azure) is more
    precise and wins. Unparseable or negative values are ignored rather than trusted. `headers`
    must be case-insensitive (httpx.Headers) or use lower-case keys.
    """
    ms = headers.get("retry-after-ms")
    if ms is not None:
        try:
            value = float(ms) / 1000.0
        except ValueError:
            value = -1.0
        if value >= 0 and math.isfinite(value):
            return value
    raw = headers.get("retry-after")
    if raw is None:
        return None
    raw = raw.strip()
    try:
        value = float(raw)
    except ValueError:
        return _seconds_until(raw, time.time() if now is None else now)
    return value if value >= 0 and math.isfinite(value) else None


def _seconds_until(raw: str, now: float) -> float | None:
    """Seconds from `now` to the HTTP date `raw`, or None when it is no date a datetime can hold:
    an upstream's year 10000000000 raised OverflowError, which failed the turn as an internal
    error instead of leaving the retry to the default backoff."""
    try:
        when = email.utils.parsedate_to_datetime(raw)
        if when is None:
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=datetime.UTC)  # HTTP dates are GMT
        return max(0.0, when.timestamp() - now)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
