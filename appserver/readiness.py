"""Readiness: named checks that `/readyz` runs, each cached briefly so probes stay cheap.

The store registers `store` (a real write and free disk: `Store.register_readiness`), the server
`kernel` and `state_files`; a service (the cron scheduler, the channel gateway) registers its own
with `Server.readiness.register(name, check)`. A check returns a `CheckResult`: `ok`, `warn`
(reported, still ready: something for the operator to look at) or `fail` (not ready, 503). A
check that raises fails with its message.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

STATUSES = ("ok", "warn", "fail")
DEFAULT_TTL_S = 1.5  # a load balancer probing every second costs one real check per 1.5 s
CHECK_TIMEOUT_S = 5.0  # a check that does not answer by then fails (a probe must not hang for the 40 s
# a store cut off from its database takes to give up)


@dataclass(frozen=True, slots=True)
class CheckResult:
    status: str  # ok | warn | fail
    detail: str = ""
    # what a tool reads besides the words (the channels check: each account's live state, which
    # `appserver channels status` shows over the last one the gateway recorded); a detail too
    data: dict[str, Any] | None = None

    def to_dict(self, name: str) -> dict[str, Any]:
        out: dict[str, Any] = {"name": name, "status": self.status}
        if self.detail:
            out["detail"] = self.detail
        if self.data:
            out["data"] = self.data
        return out


Check = Callable[[], Awaitable[CheckResult]]


class Readiness:
    """The registry of checks and their cached results (one per Server, never global)."""

    def __init__(self) -> None:
        self._checks: dict[str, tuple[Check, float]] = {}
        self._cache: dict[str, tuple[float, CheckResult]] = {}

    def register(self, name: str, check: Check, *, ttl_s: float = DEFAULT_TTL_S) -> None:
        """Add (or replace) the check `name`; its result is reused for `ttl_s` seconds."""
        self._checks[name] = (check, ttl_s)
        self._cache.pop(name, None)

    def amend(self, name: str, extra: Callable[[], CheckResult | None]) -> None:
        """Add a condition to the registered check `name`: `extra()` (cheap, not awaited) returns
        None while all is well, else a result reported with the check's own (the worse status)."""
        check, ttl = self._checks[name]

        async def amended() -> CheckResult:
            base = await check()
            more = extra()
            if more is None:
                return base
            status = max(base.status, more.status, key=STATUSES.index)
            return CheckResult(status, "; ".join(d for d in (base.detail, more.detail) if d))

        self._checks[name] = (amended, ttl)
        self._cache.pop(name, None)

    def unregister(self, name: str) -> None:
        self._checks.pop(name, None)
        self._cache.pop(name, None)

    @property
    def names(self) -> list[str]:
        return list(self._checks)

    async def run(self) -> list[tuple[str, CheckResult]]:
        now = time.monotonic()
        results = []
        for name, (check, ttl) in list(self._checks.items()):
            hit = self._cache.get(name)
            if hit is not None and now - hit[0] < ttl:
                results.append((name, hit[1]))
                continue
            try:
                async with asyncio.timeout(CHECK_TIMEOUT_S):
                    result = await check()
                if result.status not in STATUSES:
                    result = CheckResult("fail", f"check returned unknown status {result.status!r}")
            except TimeoutError:
                result = CheckResult("fail", f"no answer within {CHECK_TIMEOUT_S:g} s")
            except Exception as exc:  # a probe reports, it never raises
                result = CheckResult("fail", " ".join(str(exc).split()) or type(exc).__name__)
            self._cache[name] = (time.monotonic(), result)
            results.append((name, result))
        return results

    async def report(self) -> tuple[bool, dict[str, Any]]:
        """(ready, the /readyz body): ready unless a check failed; warnings listed with the rest."""
        results = await self.run()
        ready = all(r.status != "fail" for _, r in results)
        return ready, {
            "status": "ready" if ready else "not_ready",
            "checks": [r.to_dict(name) for name, r in results],
        }
