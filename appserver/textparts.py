"""Text that arrives in many small pieces (a streamed reply's deltas, a tool call's arguments), kept
compactly while it grows.

A list with one string per piece costs a string object per piece: ~50 bytes of header and a list
slot beside a delta of a few characters, so a reply of 4 million two-character deltas (an 8 MB
paste echoed back) held ~230 MB until its conversation was evicted. Here every `FOLD` pieces are
joined into one string (each character is copied once more, in steps of `FOLD` pieces), and
`text()` joins what is there and keeps the result, so later reads, and whoever holds the text it
returned (a snapshot), share that one string.

A long text (up to answer_max_bytes, 64 MiB) is copied a few times on its way (the reply, what
clients were shown, what the store binds): `map_big_allocations` and `release_freed_memory` make
the memory of those copies go back to the system once they are freed (glibc kept it).
"""

from __future__ import annotations

from typing import Any

FOLD = 64
# What glibc maps on its own (M_MMAP_THRESHOLD, as `mallopt` numbers it): see map_big_allocations.
BIG_ALLOCATION = 1024 * 1024
_M_MMAP_THRESHOLD = -3


class TextParts:
    __slots__ = ("_parts", "_loose")

    def __init__(self, first: str = "") -> None:
        self._parts: list[str] = [first] if first else []
        self._loose = 0  # pieces at the end of `_parts` not folded yet

    def add(self, piece: str) -> None:
        parts = self._parts
        parts.append(piece)
        self._loose += 1
        if self._loose >= FOLD:
            parts[-FOLD:] = ["".join(parts[-FOLD:])]
            self._loose = 0

    def text(self) -> str:
        parts = self._parts
        if len(parts) == 1:
            return parts[0]
        if not parts:
            return ""
        joined = "".join(parts)
        self._parts = [joined]
        self._loose = 0
        return joined

    def __bool__(self) -> bool:
        """Any text at all (pieces may be empty strings)."""
        return any(self._parts)


def _glibc() -> Any:
    """glibc's functions (`mallopt`, `malloc_trim`), or None with another C library (whose
    `mallopt` numbers its options otherwise, if it has one) or none ctypes can load."""
    import ctypes  # only where memory is handed back: most commands never need it

    try:
        libc = ctypes.CDLL(None)
    except (OSError, TypeError):
        return None
    return libc if hasattr(libc, "gnu_get_libc_version") else None


def map_big_allocations() -> None:
    """Have glibc map every allocation of BIG_ALLOCATION or more on its own, as it does at first:
    after the first such block is freed it raises that bound (up to 32 MiB), and the copies of a
    long answer (up to answer_max_bytes: the reply, what clients were shown, what the store binds)
    then came from the heap, which keeps what is freed in it: a finished turn's memory stayed with
    the process. Mapped, each block goes back to the system as it is freed. Nothing where there is
    no glibc. Once per process is enough; again changes nothing."""
    mallopt = getattr(_glibc(), "mallopt", None)
    if mallopt is not None:
        mallopt(_M_MMAP_THRESHOLD, BIG_ALLOCATION)


def release_freed_memory() -> None:
    """Give the heap memory freed so far back to the system (glibc's `malloc_trim`; elsewhere
    nothing). For a big write: the pieces of a long text, freed as they were joined into it,
    would otherwise stay with the process beside the copies the write makes."""
    trim = getattr(_glibc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


__all__ = ["BIG_ALLOCATION", "FOLD", "TextParts", "map_big_allocations", "release_freed_memory"]
