"""The `[store] url` setting: which store a URL names, and the URL as it may be shown.

Empty (the default) is the SQLite file in the home; `postgresql://` (or `postgres://`) is a
PostgreSQL database. A URL may carry a password: anything shown to a person or written to a log
goes through `redact_url` first. Imports nothing of appserver, so the config can check a URL
without loading a driver.
"""

from __future__ import annotations

from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

POSTGRES_SCHEMES = ("postgresql", "postgres")
REDACTED = "***"
_SECRET_PARAMS = ("password", "sslpassword")


def redact_url(url: str) -> str:
    """`url` with its password (in the authority or a `password=` query parameter) replaced by ***."""
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
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def url_secrets(url: str) -> list[str]:
    """The secret parts of `url` (its passwords), to scrub from driver messages that might echo them."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return [url]
    found = [parts.password, unquote(parts.password)] if parts.password else []  # as written, and decoded
    found += [v for k, v in parse_qsl(parts.query, keep_blank_values=True) if k.lower() in _SECRET_PARAMS and v]
    return sorted((s for s in dict.fromkeys(found) if s), key=len, reverse=True)  # longest first


def scrub(text: str, url: str) -> str:
    """`text` (an error message) with every secret of `url` replaced by ***, and the URL redacted."""
    text = text.replace(url, redact_url(url))
    for secret in url_secrets(url):
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
    if parts.scheme.lower() not in POSTGRES_SCHEMES:
        shown = f"scheme {parts.scheme!r}" if parts.scheme else "no scheme"
        raise ValueError(
            f"{redact_url(url)} has {shown}: use postgresql://USER[:PASSWORD]@HOST[:PORT]/DATABASE, "
            "or leave it empty for the SQLite file in the home"
        )
    if not parts.path.strip("/"):
        raise ValueError(f"{redact_url(url)} names no database: add /DATABASE (e.g. postgresql://HOST/appserver)")
    return "postgresql"
