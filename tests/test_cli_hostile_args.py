"""The CLI given what a tester types to break it: one `error: …` line (or click's usage error) and an
exit code ≠ 0, never a traceback, and nothing done with the bad value.

* An argument that is not UTF-8 (`appserver run $'\\xff\\xfe'`) reaches Python as lone surrogates
  (surrogateescape) and was a UnicodeEncodeError traceback wherever it was first encoded (SQLite, the
  home's server.json check), or, sent to a running server, its misleading "lone UTF-16 surrogate"
  refusal. The top-level group now refuses it before any command parses it, naming the argument
  (appserver/cli/main.py `_Main.parse_args`); a non-UTF-8 `$APPSERVER_HOME` likewise.
* `--limit`/`--count` take 1 to a documented maximum (appserver/cli/common.py `Count`): `--limit -1`
  listed everything (SQLite's "no limit") and a huge one was an OverflowError traceback.
* A second agent under a name already taken was created with only a note about OpenAI clients: the
  warning now says the name is ambiguous for `--agent` too and how to address the agents (ids).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from appserver.cli.common import MAX_COUNT
from tests.support.cli import CLIResult, cli_env, run_cli
from tests.support.serve import serving

pytestmark = pytest.mark.timeout(120)

FFFE = os.fsdecode(b"\xff\xfe")  # what Python makes of those argv bytes: '\udcff\udcfe'


def one_error_line(r: CLIResult, code: int, *needles: str) -> str:
    assert r.code == code, (r.code, r.out, r.err)
    assert "Traceback" not in r.err + r.out, r.err
    lines = [line for line in r.err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.err
    assert all(n in lines[0] for n in needles), (needles, r.err)
    return lines[0]


@pytest.mark.parametrize(
    ("args", "position", "shown"),
    [
        (("conversations", "history", FFFE), 3, r"'\xff\xfe'"),
        (("conversations", "show", FFFE), 3, r"'\xff\xfe'"),
        (("run", FFFE), 2, r"'\xff\xfe'"),  # in-process: no server runs on this home
        (("run", "--conversation", os.fsdecode(b"\xff"), "hi"), 3, r"'\xff', after --conversation"),
        (("run", "--conversation=" + os.fsdecode(b"\xff"), "hi"), 2, r"'--conversation=\xff'"),
        (("agents", "create", "--name", os.fsdecode(b"caf\xe9")), 4, r"'caf\xe9', after --name"),
        (("cron", "list", "--agent", FFFE), 4, r"'\xff\xfe', after --agent"),
        # a whole prompt: one line, shown around its first byte that is not UTF-8
        (("run", "x" * 500 + FFFE + "\n" * 9), 2, "'..." + "x" * 20 + r"\xff\xfe" + r"\n" * 9 + "'"),
    ],
)
def test_an_argument_that_is_not_utf8_is_one_line_naming_it(
    home: Path, args: tuple[str, ...], position: int, shown: str
) -> None:
    r = run_cli(home, *args)
    one_error_line(r, 2, f"argument {position} ({shown})", "is not valid UTF-8")
    assert not home.exists(), "the command ran before refusing its argument"  # no store, no agent


def test_a_home_that_is_not_utf8_is_refused_as_an_argument_or_from_the_environment(tmp_path: Path) -> None:
    bad = str(tmp_path) + "/" + FFFE  # absolute: a refused home must not be created anywhere
    r = run_cli(tmp_path, "--home", bad, "agents", "list")
    # a long path is cut, but never the bytes that are not UTF-8
    one_error_line(r, 2, "argument 2 ('", r"/\xff\xfe', after --home)", "is not valid UTF-8")
    r = run_cli(tmp_path, "agents", "list", env=cli_env(tmp_path, APPSERVER_HOME=bad))
    one_error_line(r, 2, "$APPSERVER_HOME ('", r"/\xff\xfe') is not valid UTF-8")
    assert os.listdir(tmp_path) == []
    # --home wins over the environment, as for any other home
    good = tmp_path / "good"
    r = run_cli(tmp_path, "--home", str(good), "agents", "list", env=cli_env(tmp_path, APPSERVER_HOME=bad))
    assert r.code == 0 and "assistant" in r.out, (r.code, r.err)


def test_a_running_server_never_gets_the_bad_text(tmp_path: Path) -> None:
    """Through the server the text used to be sent and refused as "a lone UTF-16 surrogate", a
    message that says nothing of what the user typed."""
    home = tmp_path / "home"
    with serving(home) as sp:
        r = run_cli(home, "run", os.fsdecode(b"caf\xe9"))
        line = one_error_line(r, 2, r"argument 2 ('caf\xe9') is not valid UTF-8")
        assert "surrogate" not in line, line
        assert run_cli(home, "run", "café").out.strip() == "echo: café"  # UTF-8 goes through
        history = run_cli(
            home, "conversations", "history", "--json", run_cli(home, "run", "--json", "x").json()["conversation_id"]
        ).json()
        assert [m["content"] for m in history if m["role"] == "user"] == ["café", "x"], history
        assert sp.proc.poll() is None


LIMITS = [
    ("conversations", "list", "--limit"),
    ("conversations", "history", "conv_x", "--limit"),
    ("cron", "logs", "some-task", "--limit"),
    ("cron", "preview", "some-task", "--count"),
]


@pytest.mark.parametrize("option", LIMITS, ids=lambda o: " ".join(o))
@pytest.mark.parametrize("value", ["0", "-1", "99999999999999999999999", str(MAX_COUNT + 1)])
def test_limits_are_range_checked(home: Path, option: tuple[str, ...], value: str) -> None:
    r = run_cli(home, *option, value)
    assert r.code == 2, (r.code, r.out, r.err)
    assert f"Invalid value for '{option[-1]}': {value} is not in the range 1<=x<=" in r.err, r.err
    assert "Traceback" not in r.err and r.out == "", (r.out, r.err)


def test_limits_within_the_range_work_and_the_help_says_the_maximum(home: Path) -> None:
    convs = [
        run_cli(home, "run", "--conversation", "new", "--json", f"turn {i}").json()["conversation_id"] for i in (1, 2)
    ]
    for n, expected in ((1, 1), (MAX_COUNT, 2)):
        listed = run_cli(home, "conversations", "list", "--limit", str(n), "--json")
        assert listed.code == 0 and len(listed.json()) == expected, (listed.out, listed.err)
        hist = run_cli(home, "conversations", "history", convs[0], "--limit", str(n), "--json")
        assert hist.code == 0 and len(hist.json()) == expected, (hist.out, hist.err)  # user, assistant
    for option in LIMITS:
        helped = run_cli(home, *option[:2], "--help")
        assert helped.code == 0 and "1<=x<=" in helped.out, helped.out
    assert f"1 to {MAX_COUNT}" in run_cli(home, "conversations", "list", "--help").out


def test_a_second_agent_under_a_taken_name_warns_that_the_name_is_ambiguous(home: Path) -> None:
    """On a fresh home `assistant` comes with it: creating another one exits 0 (names may repeat, by
    design) but says on stderr that `--agent assistant` now fails and which ids to use."""
    first = run_cli(home, "agents", "create", "--name", "ops", "--json")
    assert first.code == 0 and first.err == "", (first.code, first.err)  # a new name: nothing to say
    made = run_cli(home, "agents", "create", "--name", "assistant", "--json")
    assert made.code == 0, made.err
    new_id = made.json()["id"]
    (old_id,) = [
        a["id"]
        for a in run_cli(home, "agents", "list", "--json").json()
        if a["name"] == "assistant" and a["id"] != new_id
    ]
    lines = [line for line in made.err.splitlines() if line.strip()]
    assert len(lines) == 1, made.err
    warning = lines[0]
    assert warning.startswith("warning: ") and f"{old_id} is also named 'assistant'" in warning, warning
    assert "ambiguous" in warning and "--agent assistant" in warning and f"{new_id} for this one" in warning, warning
    # what it says is what happens, and what it advises works
    ran = run_cli(home, "run", "hi")
    assert ran.code == 2 and "ambiguous" in ran.err, (ran.code, ran.err)
    assert run_cli(home, "run", "--agent", new_id, "hi").out.strip() == "echo: hi"
    # renaming one into the name warns the same way
    renamed = run_cli(home, "agents", "update", "ops", "--name", "assistant")
    assert renamed.code == 0 and "warning: " in renamed.err and "ambiguous" in renamed.err, renamed.err
