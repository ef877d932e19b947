"""CLI input and output at its edges (fix 23, an outside tester's findings):

* `agents show|create|update` printed the system prompt raw: an ESC/OSC/BEL/C1 sequence in it acted
  on the terminal. It is shown like every stored text (`visible`: lines and tabs kept), and
  `token list|create|revoke` show ids, names and agents exactly too; `--json` keeps values exact.
* tokens.json entries with wrong-typed fields were converted (`"id": null` became the token
  "None" that `token revoke None` matched, `"agents": [5]` admitted an agent "5", `"expires_at":
  true` expired in 1970): every field is checked, and such a file is damage, refused by the CLI
  with a line naming the file, the entry and the field, and set aside (every token refused) by a
  server, as any unreadable token file is.
* `--home ""` (`--home "$UNSET"`) was ignored and the command ran on ~/.appserver: refused, as is
  a blank one; an empty $APPSERVER_HOME still means unset.
* Piped `chat` sent a line that was not UTF-8 with U+FFFD in place of its bytes and dropped NUL
  bytes, exit 0: such a line is refused (`error:`, not sent, exit 1 at the end).
* A crons.json task with a bad schedule, an empty prompt or an empty name was "scheduled" in
  `cron list`, and `cron run`/`enable` took it: it is shown invalid, with the reason, and refused.
"""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from appserver.auth import TokenStore
from appserver.cli.chat import LineEditor, Screen
from tests.support.cli import ROOT, CLIResult, cli_env, run_cli
from tests.support.serve import ServeProcess, serving
from tests.support.zygote_client import appserver_popen

pytestmark = pytest.mark.timeout(120)

EVIL = "A\x1b]0;PWNED-TITLE\x07B\x1b[2JC\u009b31mD"
EVIL_SHOWN = r"A\x1b]0;PWNED-TITLE\x07B\x1b[2JC\x9b31mD"


def ok(home: Path, *args: str, env: dict[str, str] | None = None) -> CLIResult:
    r = run_cli(home, *args, env=env)
    assert r.code == 0, (args, r.code, r.out, r.err)
    return r


def no_controls(text: str) -> None:
    assert not re.search("[\x00-\x08\x0b-\x1f\x7f-\x9f]", text), ascii(text)


# ------------------------------------------------------------------ 1. the system prompt is shown safely


def test_agents_show_create_and_update_escape_the_system_prompt(tmp_path: Path) -> None:
    home = tmp_path / "home"
    created = ok(home, "agents", "create", "--name", "esc", "--system", EVIL + "\nsecond\tline")
    shown = ok(home, "agents", "show", "esc")
    updated = ok(home, "agents", "update", "esc", "--system", EVIL)
    for r in (created, shown, updated):
        no_controls(r.out)
        assert f"system: {EVIL_SHOWN}" in r.out, r.out
    assert "second\tline" in shown.out  # its lines and tabs are kept
    assert ok(home, "agents", "show", "esc", "--json").json()["system"] == EVIL  # exact


# ------------------------------------------------------------------ 2. tokens.json: strict types

WRONG = [
    ("id", None, "field 'id' must be a non-empty string, not null"),
    ("name", 7, "field 'name' must be a non-empty string, not the number 7"),
    ("expires_at", True, "field 'expires_at' must be a number of seconds since the epoch or null, not true"),
    ("agents", [5], "field 'agents' must be a list of agent ids or names, or null, not a list holding the number 5"),
    ("scopes", "ws", "field 'scopes' must be a list of scopes, not the string 'ws'"),
    ("created_at", "now", "field 'created_at' must be a number"),
    ("name", "", "field 'name' must be a non-empty string, not the string ''"),
]


def _damage(path: Path, key: str, value: object) -> None:
    data = json.loads(path.read_text())
    if value is KeyError:
        del data["tokens"][0][key]
    else:
        data["tokens"][0][key] = value
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(("key", "value", "said"), WRONG + [("name", KeyError, "field 'name' is missing")])
def test_a_wrong_typed_token_entry_is_refused_naming_file_entry_and_field(
    tmp_path: Path, key: str, value: object, said: str
) -> None:
    home = tmp_path / "home"
    ok(home, "token", "create", "--name", "t1", "--agents", "assistant")
    path = home / "auth" / "tokens.json"
    _damage(path, key, value)
    before = path.read_bytes()
    for args in (("token", "list"), ("token", "revoke", "None"), ("token", "create", "--name", "t2")):
        r = run_cli(home, *args)
        assert r.code == 1 and r.out == "", (args, r.code, r.out, r.err)
        assert r.err.count("\n") == 1 and r.err.startswith("error: "), r.err
        assert str(path) in r.err and "token #1" in r.err and said in r.err, r.err
    assert path.read_bytes() == before  # a reader's refusal: left in place, nothing written


def test_a_server_never_grants_what_a_wrong_typed_entry_says(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`"agents": [5]` admitted an agent named "5", `"id": null` a token "None": the file is set
    aside loudly and every token refused, as for any unreadable token file."""
    for key, value, said in WRONG:
        home = tmp_path / key / str(abs(hash(repr(value))))
        store = TokenStore(home)
        _, token = store.create(name="t1", agents="assistant")
        assert store.verify(token) is not None
        _damage(store.path, key, value)
        caplog.clear()
        assert TokenStore(home).verify(token) is None, (key, value)
        assert not store.path.exists() and list(store.dir.glob("tokens.json.corrupt-*")), (key, value)
        assert said in caplog.text and "token #1" in caplog.text, caplog.text
        listed = run_cli(home, "token", "list")  # the operator is told why every token stopped working
        assert "set aside" in listed.err or "corrupt" in listed.err, listed.err


def test_a_copied_token_entry_is_damage_not_a_token_revoke_leaves_working(tmp_path: Path) -> None:
    store = TokenStore(tmp_path)
    store.create(name="t1")
    data = json.loads(store.path.read_text())
    data["tokens"].append(dict(data["tokens"][0]))
    store.path.write_text(json.dumps(data))
    reason = store.unreadable()
    assert reason is not None and "token #2" in reason and "same id" in reason, reason


def test_well_typed_entries_still_read_nan_and_huge_expiries_included(tmp_path: Path) -> None:
    store = TokenStore(tmp_path)
    store.create(name="t1", agents="assistant,agt_x")
    data = json.loads(store.path.read_text())
    data["tokens"][0]["expires_at"] = 10**30  # an integer, far future
    del data["tokens"][0]["created_at"]  # absent in older files: the epoch
    store.path.write_text(json.dumps(data))
    rec = store.list()[0]
    assert rec.expires_at == 1e30 and rec.created_at == 0.0 and rec.agents == ("agt_x", "assistant")


def test_token_list_and_revoke_show_names_and_agents_exactly(tmp_path: Path) -> None:
    home = tmp_path / "home"
    ok(home, "token", "create", "--name", "t1", "--agents", "assistant")
    path = home / "auth" / "tokens.json"
    data = json.loads(path.read_text())
    data["tokens"][0]["name"] = EVIL  # a hand edit, another version
    data["tokens"][0]["agents"] = [EVIL]
    path.write_text(json.dumps(data))
    listed = ok(home, "token", "list")
    no_controls(listed.out)
    assert listed.out.count(EVIL_SHOWN) == 2, listed.out
    assert ok(home, "token", "list", "--json").json()[0]["name"] == EVIL
    revoked = ok(home, "token", "revoke", EVIL)
    no_controls(revoked.out)
    assert EVIL_SHOWN in revoked.out, revoked.out


# ------------------------------------------------------------------ 3. an empty or blank home


def test_an_empty_or_blank_home_is_refused_and_the_default_home_is_not_touched(tmp_path: Path) -> None:
    fake_home = tmp_path / "user"
    fake_home.mkdir()
    env = cli_env(tmp_path / "unused", HOME=str(fake_home))
    env.pop("APPSERVER_HOME")
    for given, word in (("", "empty"), ("  ", "blank")):
        r = run_cli(tmp_path, "--home", given, "agents", "create", "--name", "made", env=env)
        assert r.code == 2 and r.out == "", (given, r.code, r.out, r.err)
        assert r.err == f"error: --home is {word}: give the home directory, or leave --home out for the default\n"
    blank = run_cli(tmp_path, "agents", "list", env={**env, "APPSERVER_HOME": " "})
    assert blank.code == 2 and blank.err.startswith("error: $APPSERVER_HOME is blank"), blank.err
    assert not (fake_home / ".appserver").exists()
    # an empty $APPSERVER_HOME means unset (as config.default_home reads it): the default home
    unset = run_cli(tmp_path, "agents", "list", env={**env, "APPSERVER_HOME": ""})
    assert unset.code == 0, unset.err
    assert (fake_home / ".appserver").is_dir()


# ------------------------------------------------------------------ 4. piped chat: bytes that are not text


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, str], ServeProcess]]:
    home = tmp_path_factory.mktemp("cli_s23_io") / "home"
    env = cli_env(home)
    with serving(home, env=env) as sp:
        yield home, env, sp


def _piped_chat(env: dict[str, str], stdin: bytes) -> tuple[int, str, str]:
    with appserver_popen(
        ["chat", "--conversation", "new"],
        env=env,
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    ) as proc:
        out, err = proc.communicate(stdin, timeout=60)
    return proc.returncode, out.decode(), err.decode()


def _user_texts(home: Path, out: str) -> list[str]:
    found = re.search(r"in conversation (conv_\w+)", out)
    assert found, out
    db = sqlite3.connect(f"file:{home / 'appserver.db'}?mode=ro", uri=True, timeout=5)
    try:
        rows = db.execute(
            "SELECT content FROM messages WHERE conversation_id=? AND role='user' ORDER BY id", (found.group(1),)
        ).fetchall()
    finally:
        db.close()
    return [json.loads(r[0]) for r in rows]


@pytest.mark.parametrize(
    ("line", "said"),
    [
        (b"a\xff\x00b", r"error: the line 'a\xff\x00b' is not valid UTF-8 and holds a NUL byte; it was not sent"),
        (b"caf\xe9", r"error: the line 'caf\xe9' is not valid UTF-8; it was not sent"),
        (b"x\x00y", r"error: the line 'x\x00y' holds a NUL byte; it was not sent"),
    ],
)
def test_a_piped_line_that_is_not_utf8_or_holds_nul_is_refused_not_changed(
    server: tuple[Path, dict[str, str], ServeProcess], line: bytes, said: str
) -> None:
    home, env, _ = server
    code, out, err = _piped_chat(env, b"first\n" + line + b"\nlast\n")
    assert code == 1, (code, out, err)
    assert said in out, out
    no_controls(out.replace("\n", ""))
    assert _user_texts(home, out) == ["first", "last"]  # the others ran, in order
    assert "Traceback" not in err, err


def test_a_terminal_line_with_bytes_that_are_not_utf8_is_echoed_readably(capsys: pytest.CaptureFixture[str]) -> None:
    from appserver.cli.chat import unsendable  # (new in fix 23)

    editor = LineEditor(Screen(color=False, ansi=False), echo=True)
    editor.visible = True
    editor.add(b"ok \xe9\r")
    kind, text = editor.take() or ("", "")
    assert kind == "line" and unsendable(text) == "is not valid UTF-8"
    assert capsys.readouterr().out == "ok \ufffd\n"  # shown as U+FFFD; the line is refused at Enter
    editor.add(b"caf\xc3\xa9\r")
    assert editor.take() == ("line", "café") and unsendable("café") is None


# ------------------------------------------------------------------ 5. cron tasks that cannot run


def _cron_home(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    home = tmp_path / "home"
    env = cli_env(home, APPSERVER_DISABLE_CRON="1")
    for name in ("good", "badsched", "noprompt", "noname"):
        ok(home, "cron", "add", "--name", name, "--agent", "assistant", "--every", "1h", "--prompt", "hi", env=env)
    path = home / "crons.json"
    data = json.loads(path.read_text())
    for t in data["tasks"]:
        if t["name"] == "badsched":
            t["schedule"]["expr"] = "banana"
        elif t["name"] == "noprompt":
            t["prompt"] = "  "
        elif t["name"] == "noname":
            t["name"] = ""
    path.write_text(json.dumps(data))
    return home, env


def test_cron_list_and_show_mark_a_task_that_cannot_run_invalid_with_the_reason(tmp_path: Path) -> None:
    home, env = _cron_home(tmp_path)
    listed = ok(home, "cron", "list", env=env)
    states = {
        name: line for line in listed.out.splitlines() for name in ("good", "badsched", "noprompt") if name in line
    }
    assert " scheduled " in states["good"], listed.out
    assert " invalid " in states["badsched"] and "invalid schedule: invalid duration 'banana'" in states["badsched"]
    assert " invalid " in states["noprompt"] and "its prompt is empty" in states["noprompt"], listed.out
    assert sum(" invalid " in line for line in listed.out.splitlines()) == 3, listed.out
    assert "its name is empty" in listed.out and listed.err.count("is invalid and cannot run") == 3, listed.err
    as_json = {t["id"]: t for t in ok(home, "cron", "list", "--json", env=env).json()}
    problems = sorted(t.get("problem", "") for t in as_json.values())
    assert [t["state"] for t in as_json.values()].count("invalid") == 3, as_json
    assert problems[0] == "" and "its name is empty" in problems and "its prompt is empty" in problems
    shown = ok(home, "cron", "show", "badsched", env=env)
    assert re.search(r"^state\s+invalid$", shown.out, re.M) and "problem " in shown.out, shown.out


def test_cron_run_and_enable_refuse_a_task_that_cannot_run(tmp_path: Path) -> None:
    home, env = _cron_home(tmp_path)
    for ref, why in (("badsched", "invalid schedule"), ("noprompt", "its prompt is empty")):
        ran = run_cli(home, "cron", "run", ref, env=env)
        assert ran.code == 1 and why in ran.err and "is invalid and cannot run" in ran.err, ran.err
        assert ran.err.count("\n") == 1, ran.err
        ok(home, "cron", "disable", ref, env=env)  # disabling (and removing) still works
        enabled = run_cli(home, "cron", "enable", ref, env=env)
        assert enabled.code == 1 and "cannot be enabled" in enabled.err and why in enabled.err, enabled.err
    runs = home / "cron-runs"
    assert not runs.exists() or not any(runs.iterdir())  # nothing was claimed
    tasks = {t["name"]: t for t in json.loads((home / "crons.json").read_text())["tasks"]}
    assert tasks["badsched"]["enabled"] is False and tasks["noprompt"]["enabled"] is False
