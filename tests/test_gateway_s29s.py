"""A long reply cut for a platform's limit keeps its inline markup balanced (session 29, S): a cut
inside a `||spoiler||`, `**bold**` or `` `code` `` span used to leave the marker open in one part and
the closer alone in the next, so Discord showed most of a spoiler in the clear. Now the open spans
are closed at the end of a part and reopened, in order, at the start of the next, within the limit;
a marker nothing closes is left alone, and code fences are cut as before.

`split_message` itself, and end to end through `appserver serve --channels discord` (the real
discord.py against the loopback fake of Discord)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from gateway.split import split_message
from plugins.discord import MAX_LENGTH
from tests.fakes.discord_api import FakeDiscord
from tests.support.gateway import discord_server

pytestmark = pytest.mark.timeout(120)

LIMIT = 1990
MARKERS = re.compile(r"\|\||\*\*|`")


def words(prefix: str, n: int) -> str:
    return " ".join(f"{prefix}{i}" for i in range(n))


def unwrapped(parts: list[str], marker: str) -> str:
    """The parts joined as the text they came from: the markers the split added taken off."""
    inner = [p.removeprefix(marker) if k else p for k, p in enumerate(parts)]
    inner = [p.removesuffix(marker) if k < len(parts) - 1 else p for k, p in enumerate(inner)]
    return " ".join(inner)


@pytest.mark.parametrize("marker", ["||", "**", "__", "~~", "`"])
def test_a_span_cut_is_closed_and_reopened(marker: str) -> None:
    text = f"echo: {marker}{words('secret', 700)}{marker} done"
    parts = split_message(text, LIMIT)
    assert len(parts) >= 3
    for part in parts:
        assert len(part) <= LIMIT
        assert part.count(marker) == 2 if marker != "`" else part.count("`") == 2, part[:40]
    assert parts[0].startswith(f"echo: {marker}secret0 ")
    assert all(p.startswith(f"{marker}secret") for p in parts[1:])
    assert all(p.endswith(marker) for p in parts[:-1])
    assert unwrapped(parts, marker) == text


def test_nested_spans_reopen_in_order() -> None:
    text = f"**bold ||{words('s', 600)}|| tail** and `code`"
    parts = split_message(text, LIMIT)
    assert len(parts) == 2
    assert parts[0].endswith("||**") and parts[1].startswith("**||s")
    assert all(len(p) <= LIMIT for p in parts)


def test_a_limit_full_part_leaves_room_for_the_markers() -> None:
    text = "||" + "x" * (LIMIT - 2) + " " + "y" * 100 + "||"  # the first cut falls right at the limit
    parts = split_message(text, LIMIT)
    assert all(len(p) <= LIMIT and p.count("||") == 2 for p in parts), [len(p) for p in parts]


def test_an_unpaired_marker_is_left_alone() -> None:
    for lone in ("||", "**", "`"):
        text = f"a {lone}start " + words("w", 700)
        parts = split_message(text, LIMIT)
        assert len(parts) >= 2
        assert sum(p.count(lone) for p in parts) == 1, lone
    closed_later = "x ** y " + words("w", 700)  # `**` between spaces is no delimiter
    assert sum(p.count("**") for p in split_message(closed_later, LIMIT)) == 1


def test_markers_inside_code_are_code() -> None:
    fenced = "```py\n" + "\n".join(f"x{i} = '||**'  # `{i}" for i in range(200)) + "\n```"
    parts = split_message(fenced, LIMIT)
    assert len(parts) >= 2
    assert all(p.endswith("\n```") and p.startswith("```py\n") for p in parts)
    assert "".join(parts).count("||**") == 200  # nothing added
    inline = "`" + " ".join(f"**c{i}" for i in range(700)) + "`"
    parts = split_message(inline, LIMIT)
    assert all(p.count("`") == 2 for p in parts) and "".join(parts).count("**") == 700


def test_a_paragraph_boundary_ends_a_span() -> None:
    text = "**open\n\n" + words("p", 600) + "\n\nclose**"
    parts = split_message(text, LIMIT)
    assert sum(p.count("**") for p in parts) == 2  # in different paragraphs: no span


def test_fits_is_respected_with_the_markers() -> None:
    text = "||" + words("s", 700) + "||"
    parts = split_message(text, LIMIT, lambda part: len(part.replace("||", "<tg-spoiler>")) <= LIMIT)
    assert len(parts) >= 2
    assert all(len(p.replace("||", "<tg-spoiler>")) <= LIMIT and p.count("||") == 2 for p in parts)


@pytest.fixture
def fake() -> Iterator[FakeDiscord]:
    with FakeDiscord() as f:
        yield f


def test_a_long_spoiler_stays_hidden_on_discord(tmp_path: pytest.TempPathFactory, fake: FakeDiscord) -> None:
    home = tmp_path / "home"  # type: ignore[operator]
    text = "||" + words("secret", 400) + "||"
    with discord_server(home, fake):
        fake.inject_dm("701", text)
        dm = fake.dm_channel("701")
        fake.wait_for_text(dm, lambda t: "secret399||" in t, timeout=60)
        posted = [m.content for m in fake.messages(dm)]
    assert len(posted) >= 2
    for content in posted:
        assert len(content) <= MAX_LENGTH and content.count("||") == 2, content[:30]
    assert posted[0].startswith("echo: ||secret0 ")
    assert unwrapped(posted, "||") == f"echo: {text}"
