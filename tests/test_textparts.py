"""`appserver.textparts.TextParts`: streamed pieces kept folded, read back exactly as joined."""

from __future__ import annotations

import tracemalloc

from hypothesis import given
from hypothesis import strategies as st

from appserver.textparts import FOLD, TextParts


@given(st.lists(st.text(max_size=5), max_size=3 * FOLD + 5), st.integers(min_value=0, max_value=3 * FOLD + 5))
def test_the_text_is_the_pieces_joined_whenever_it_is_read(pieces: list[str], read_at: int) -> None:
    parts = TextParts()
    for n, piece in enumerate(pieces):
        if n == read_at:
            assert parts.text() == "".join(pieces[:n])
        parts.add(piece)
    whole = parts.text()
    assert whole == "".join(pieces)
    assert bool(parts) == bool(whole)
    assert parts.text() is whole  # read again: the same string, not another copy


def test_many_small_pieces_cost_about_their_characters() -> None:
    tracemalloc.start(1)
    try:
        parts = TextParts()
        for i in range(100_000):
            parts.add(" " + "ab"[i % 2])  # a new two-character string per piece, as a stream delivers
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    # A string per piece: ~60 bytes each (6 MB); folded: a few bytes over the 200,000 characters.
    assert held < 400_000, held
    assert parts.text() == " a b" * 50_000
