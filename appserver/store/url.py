"""The `[store] url` setting: which store a URL names, and the URL as it may be shown.

Empty (the default) is the SQLite file in the home; `postgresql://` (or `postgres://`) is a
PostgreSQL database. A URL may carry a password: anything shown to a person or written to a log
goes through `redact_url` first. So may a string that is not a URL at all (a libpq
`host=... password=...` keyword/value string is refused, but the refusal shows it). Imports
nothing of appserver, so the config can check a URL without loading a driver.
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

POSTGRES_SCHEMES = ("postgresql", "postgres")
REDACTED = "***"
_SECRET_PARAMS = ("password", "sslpassword")
# `scheme://`: only then is the string read as a URL; anything else may be a libpq keyword/value string.
_URL_WITH_AUTHORITY = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
# A libpq `password = value`: the value single-quoted (backslash escapes; unterminated runs to the
# end) or bare up to whitespace. Case-insensitive, whatever libpq accepts: redacting more is safe.
_KEYWORD_SECRET = re.compile(
    r"(?<![\w])((?:ssl)?password\s*=\s*)('(?:\\.|[^'\\])*'?|(?:\\.|\S)*)", re.IGNORECASE | re.DOTALL
)
# `user:secret@host`, written without `//` (so urlsplit sees no authority): the part after the first `:`.
_BARE_USERINFO = re.compile(r"^(\s*[^\s:@/]*):[^\s@]*@")


def _is_url(url: str) -> bool:
    """Whether `url` reads as `scheme://...`; urlsplit would take `host=h password=x` for a path."""
    return _URL_WITH_AUTHORITY.match(url.lstrip()) is not None


def _redact_keywords(text: str) -> str:
    """`text` with every `password=`/`sslpassword=` value replaced by ***."""
    return _KEYWORD_SECRET.sub(lambda m: m.group(1) + REDACTED, text)


def _keyword_secrets(text: str) -> list[str]:
    """The `password=`/`sslpassword=` values in `text`: as written, and unquoted/unescaped."""
    found: list[str] = []
    for match in _KEYWORD_SECRET.finditer(text):
        raw = match.group(2)
        inner = raw[1:-1] if len(raw) > 1 and raw.startswith("'") and raw.endswith("'") else raw.lstrip("'")
        found += [raw, inner, re.sub(r"\\(.)", r"\1", inner, flags=re.DOTALL)]
    return found


def redact_url(url: str) -> str:
    """`url` with its password (in the authority or a `password=` query parameter) replaced by ***;
    a string that is not a `scheme://` URL (e.g. a libpq keyword/value string) with its
    `password=`/`sslpassword=` values and any `user:secret@` replaced."""
    if not _is_url(url):
        return _BARE_USERINFO.sub(lambda m: f"{m.group(1)}:{REDACTED}@", _redact_keywords(url), count=1)
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable store URL>"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, hostport = netloc.rpartition("@")
        user, colon, _password = userinfo.partition(":")
        netloc = f"{user}{':' + REDACTED if colon else ''}@{hostport}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(k.lower() in _SECRET_PARAMS for k, _ in pairs):
            query = urlencode([(k, REDACTED if k.lower() in _SECRET_PARAMS else v) for k, v in pairs], safe="*")
    # keyword/value text pasted into the host or path (`postgresql://h password=x`) is not shown either
    netloc, path, fragment = _redact_keywords(netloc), _redact_keywords(parts.path), _redact_keywords(parts.fragment)
    if (netloc, path, query, fragment) == (parts.netloc, parts.path, parts.query, parts.fragment) and all(
        c.isprintable() for c in url
    ):
        return url  # nothing to hide: as given (urlunsplit would show `sqlite:///x` as `sqlite:/x`)
    # rebuilt by hand: urlunsplit drops the `//` of a URL without a host (`postgresql:///db?password=x`)
    return f"{parts.scheme}://{netloc}{path}" + (f"?{query}" if query else "") + (f"#{fragment}" if fragment else "")


def url_secrets(url: str) -> list[str]:
    """The secret parts of `url` (its passwords), to scrub from driver messages that might echo them."""
    if not _is_url(url):
        found = _keyword_secrets(url)
        bare = _BARE_USERINFO.match(url)
        if bare is not None:
            found.append(url[bare.end(1) + 1 : bare.end() - 1])  # `user:secret@` without `//`
        return _longest_first(found)
    try:
        parts = urlsplit(url)
    except ValueError:
        return [url]
    found = [s for piece in (parts.netloc, parts.path, parts.fragment) for s in _keyword_secrets(piece)]
    if parts.password:
        found += [parts.password, unquote(parts.password)]  # as written, and decoded
    found += [v for k, v in parse_qsl(parts.query, keep_blank_values=True) if k.lower() in _SECRET_PARAMS and v]
    return _longest_first(found)


def _longest_first(secrets: list[str]) -> list[str]:
    """Distinct, non-empty, longest first (so a secret containing another is replaced whole)."""
    return sorted((s for s in dict.fromkeys(secrets) if s), key=len, reverse=True)


SHORTEST_REDACTABLE = 4  # a shorter secret is found inside ordinary words ("e" in "server")


def scrub(text: str, url: str) -> str:
    """`text` (an error message) with every secret of `url` replaced by ***, and the URL redacted.
    A secret too short to replace without garbling the words around it (and showing, by the gaps,
    which letters it has) withholds the message, when it occurs in it, instead."""
    text = text.replace(url, redact_url(url))
    for secret in url_secrets(url):
        if secret not in text:
            continue
        if len(secret) < SHORTEST_REDACTABLE:
            return "the error's text is withheld: it may hold the password, which is too short to redact in it"
        text = text.replace(secret, REDACTED)
    return text


def store_kind(url: str) -> str:
    """`sqlite` (empty URL) or `postgresql`; ValueError saying what is wrong (the URL redacted)."""
    if not url.strip():
        return "sqlite"
    try:
        parts = urlsplit(url.strip())
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError as exc:
        raise ValueError(f"{redact_url(url)} is not a valid URL ({exc})") from None
    if parts.scheme.lower() not in POSTGRES_SCHEMES or not _is_url(url):
        # `postgres:secret@host/db` (no `//`) is no URL libpq reads: refused as having no scheme://
        shown = f"scheme {parts.scheme!r}" if parts.scheme and _is_url(url) else "no scheme"
        raise ValueError(
            f"{redact_url(url)} has {shown}: use postgresql://USER[:PASSWORD]@HOST[:PORT]/DATABASE, "
            "or leave it empty for the SQLite file in the home"
        )
    if not parts.path.strip("/"):
        raise ValueError(f"{redact_url(url)} names no database: add /DATABASE (e.g. postgresql://HOST/appserver)")
    return "postgresql"
