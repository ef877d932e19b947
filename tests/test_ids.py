"""Record ids (appserver/ids.py): unique, and in creation order so new rows append to indexes."""

from __future__ import annotations

import re
import time

from appserver.ids import new_id


def test_ids_are_unique_and_sort_in_creation_order() -> None:
    first = [new_id("conv") for _ in range(50_000)]
    assert len(set(first)) == len(first)
    time.sleep(0.002)
    later = new_id("conv")
    assert all(re.fullmatch(r"conv_[0-9a-f]{23}", i) for i in (*first[:100], later))
    assert later > max(first)  # a later millisecond sorts after every earlier id
    assert [i[:16] for i in first] == sorted(i[:16] for i in first)  # the time part never goes back
