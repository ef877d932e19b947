"""Independent scenarios side by side: each mostly waits (on a restart, a backoff, a quiet window),
so running them at once costs the suite one wait instead of several, and every check still runs."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any


def run_concurrently(*scenarios: Callable[[], Any], timeout: float = 120) -> list[Any]:
    """Run each scenario in a thread of its own; every one runs to its end, then the first failure
    (in the order given) is raised as if the scenario had run alone. Returns their results in order."""
    with ThreadPoolExecutor(max_workers=len(scenarios)) as pool:
        futures = [pool.submit(s) for s in scenarios]
        errors = [f.exception(timeout) for f in futures]
    for error in errors:
        if error is not None:
            raise error
    return [f.result() for f in futures]
