"""A store "URL" that is not a `scheme://` URL (a libpq `host=... password=...` string, or
`user:secret@host` without `//`) is refused, and the refusal never shows its password: from
`--store`, `APPSERVER_STORE__URL`, config.toml and `store copy --to` alike."""

from __future__ import annotations

from pathlib import Path

import pytest

from appserver.config import ConfigError, load_config
from appserver.store.url import redact_url, scrub, store_kind, url_secrets
from tests.support.cli import cli_env, run_cli

SECRET = "hunter2secret"

# (given, shown): every form keeps what is not secret, so the person sees what they typed
NOT_URLS = [
    (f"host=127.0.0.1 password={SECRET} dbname=x", "host=127.0.0.1 password=*** dbname=x"),
    (f"host=h password = '{SECRET} with spaces' dbname=x", "host=h password = *** dbname=x"),
    (f"host=h password='{SECRET}\\' quoted' port=5", "host=h password=*** port=5"),
    (f"host=h sslpassword={SECRET} user=u", "host=h sslpassword=*** user=u"),
    (f"host=h PASSWORD={SECRET}", "host=h PASSWORD=***"),
    (f"host=h password='{SECRET} never closed", "host=h password=***"),
    (f"postgres:{SECRET}@db/app", "postgres:***@db/app"),
]


@pytest.mark.parametrize(("given", "shown"), NOT_URLS)
def test_a_string_that_is_not_a_url_is_shown_without_its_password(given: str, shown: str) -> None:
    assert redact_url(given) == shown
    with pytest.raises(ValueError) as refused:
        store_kind(given)
    assert str(refused.value).startswith(shown) and SECRET not in str(refused.value)
    # a driver message echoing the string, or the password alone (as libpq reads it), is scrubbed too
    password = next(s for s in url_secrets(given) if s.startswith(SECRET))
    assert SECRET not in scrub(f"failed: {given} / {password}", given)


def test_a_quoted_password_is_a_secret_as_libpq_reads_it() -> None:
    assert f"{SECRET} it's" in url_secrets(f"host=h password='{SECRET} it\\'s' dbname=x")


def test_keyword_values_pasted_into_a_url_are_redacted() -> None:
    url = f"postgresql://h password={SECRET}/db"
    assert redact_url(url) == "postgresql://h password=***/db"
    assert SECRET in url_secrets(url)


def test_url_forms_are_shown_as_before() -> None:
    assert (
        redact_url(f"postgresql://u:{SECRET}@h:5432/db?sslmode=require")
        == "postgresql://u:***@h:5432/db?sslmode=require"
    )
    assert redact_url(f"postgresql://u@h/db?sslmode=bogus&password={SECRET}") == (
        "postgresql://u@h/db?sslmode=bogus&password=***"
    )
    assert redact_url("postgresql://postgres@127.0.0.1:5432/app") == "postgresql://postgres@127.0.0.1:5432/app"
    assert url_secrets(f"postgresql://u:{SECRET}@h/db") == [SECRET]
    assert store_kind(f"postgresql://u:{SECRET}@h/db") == "postgresql"
    assert store_kind("") == "sqlite"


def test_config_refuses_a_keyword_string_without_its_password(tmp_path: Path) -> None:
    given, shown = NOT_URLS[0]
    with pytest.raises(ConfigError) as from_env:
        load_config(tmp_path / "envhome", environ={"APPSERVER_STORE__URL": given})
    assert shown in str(from_env.value) and SECRET not in str(from_env.value)
    home = tmp_path / "filehome"
    home.mkdir()
    (home / "config.toml").write_text(f'[store]\nurl = "{given}"\n')
    with pytest.raises(ConfigError) as from_file:
        load_config(home, environ={})
    assert shown in str(from_file.value) and SECRET not in str(from_file.value)


def test_the_cli_refuses_a_keyword_string_without_its_password(tmp_path: Path) -> None:
    given = f"host=127.0.0.1 password={SECRET} dbname=x"
    home = tmp_path / "home"
    runs = [
        run_cli(home, "serve", "--listen", "127.0.0.1:0", "--store", given),
        run_cli(home, "agents", "list", env=cli_env(home, APPSERVER_STORE__URL=given)),
        run_cli(home, "store", "copy", "--to", given),
    ]
    for r in runs:
        assert r.code == 2, (r.out, r.err)
        assert "password=***" in r.err and "no scheme" in r.err, r.err
        assert SECRET not in r.out + r.err and "Traceback" not in r.err


def test_a_short_password_never_garbles_or_spells_out_a_message() -> None:
    """Password `e`: every `e` of the message became ***, so `server` read `s***rv***r` and the
    gaps showed which letters the password has. A secret that short withholds the message."""
    from appserver.store.url import scrub

    said = scrub("connection to server at 127.0.0.1 failed", "postgresql://u:e@127.0.0.1/db")
    assert "***" not in said and "server" not in said and "withheld" in said
    assert scrub("connection to server failed", "postgresql://u:longer-secret@h/db") == "connection to server failed"
    assert scrub('missing "=" after "longer-secret"', "postgresql://u:longer-secret@h/db") == 'missing "=" after "***"'
