"""docs/architecture.md stays true about the kernel: every runtime file it names exists, and every
file of the runtime is named there."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_architecture_names_the_runtime_files_as_they_are() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    named = set(re.findall(r"\bruntime/(\w+\.py)", doc))
    present = {p.name for p in (ROOT / "appserver" / "runtime").glob("*.py")}
    assert named - present == set(), "docs/architecture.md names runtime files that do not exist"
    assert present - named == set(), "runtime files docs/architecture.md does not mention"
