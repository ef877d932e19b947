"""A logging filter that replaces secrets with their fingerprint before any handler writes them.

Catches known secrets (registered values, API keys read from the environment variables named in
config, the JWT HMAC secret) and secret-shaped text whatever its source: `Bearer …` values,
JWT-looking strings (`eyJ…`), capability tokens (`aps_…`) and credentials in URL queries
(`?token=…`, e.g. in uvicorn's access log).

Install it on *handlers*, not on a logger: a logger's filters do not see records propagated from
child loggers (`appserver.*`, `uvicorn.*`), while a handler's filters see every record it emits.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any
from urllib.parse import parse_qsl, quote, quote_plus, unquote, urlsplit

from appserver.auth import TOKEN_PREFIX, fingerprint
from appserver.config import Config

MIN_SECRET_LEN = 8
MAX_REMEMBERED = 1024

_SECRET_FIELD = r"(?i)[\"'](?:token|access_token|api_key|apikey|secret|password|authorization)[\"']\s*:\s*"
# A mask written by an earlier pattern (or an earlier pass over the same text) starts here: a value
# pattern must not take it for a secret, or it masks the mask's first word (`[redacted`) again.
_NOT_A_MASK = r"(?!\[redacted(?: sha256:[0-9a-f]{12})?\])"

# Each pattern matches a secret; when it has a group named `s`, only that group is replaced.
_PATTERNS: tuple[re.Pattern[str], ...] = (
    # Authorization: Bearer <token> / Basic <creds>
    re.compile(r"(?i)\b(?:bearer|basic)\s+(?P<s>[A-Za-z0-9\-._~+/]{8,}=*)"),
    # JWT / JWS compact serialisation: base64url JSON header starting with {"
    re.compile(r"\beyJ[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]*\.?[A-Za-z0-9_-]*"),
    # capability tokens minted by TokenStore
    re.compile(re.escape(TOKEN_PREFIX) + r"[A-Za-z0-9_-]{16,}"),
    # common provider key shapes (OpenAI, Anthropic, Slack, GitHub, Telegram)
    re.compile(r"\b(?:sk|rk)-[A-Za-z0-9_-]{16,}"),
    re.compile(r"\bxox[abposr]-[A-Za-z0-9-]{10,}"),
    re.compile(r"\bgh[pousr]_[A-Za-z0-9]{20,}"),
    re.compile(r"\b\d{6,12}:[A-Za-z0-9_-]{30,}"),
    # credentials in a URL query (the guard refuses them, but the access log already saw them)
    re.compile(
        r"(?i)[?&;](?:token|access_token|api_key|apikey|api-key|key|jwt)=" + _NOT_A_MASK + r"(?P<s>[^&;\s\"']+)"
    ),
    # an Authorization header's value under any scheme (`Token …`, `Key …`) or none (a raw key)
    re.compile(
        r"(?i)\b(?:proxy-)?authorization\s*[:=]\s*[\"']?(?>(?:[A-Za-z][A-Za-z0-9-]*\s+)?)"
        r"(?P<s>(?!\[redacted)[A-Za-z0-9\-._~+/]{8,}=*)"
    ),
    # `name=value` pairs named like secrets, as key=value logs and command lines write them
    re.compile(
        r"(?i)(?<![A-Za-z0-9_])(?:password|passwd|secret|client_secret|api_key|apikey|api-key"
        r"|access_token|refresh_token|token|jwt)=(?P<s>[^\s&;,\"'<>\[\]]{8,})"
    ),
    # JSON / repr fields named like secrets; the value runs to its closing quote, over escaped quotes
    # and backslashes inside it (`"Authorization": "Bearer k3y\"x\\y"`: all of it is the value)
    re.compile(_SECRET_FIELD + r'"(?P<s>(?:[^"\\]|\\.){8,})"'),
    re.compile(_SECRET_FIELD + r"'(?P<s>(?:[^'\\]|\\.){8,})'"),
)

ENV_SECRET_NAMES: tuple[str, ...] = (
    "OPENAI_API_KEY",
    "ANTHROPIC_API_KEY",
    "OPENROUTER_API_KEY",
    "TELEGRAM_BOT_TOKEN",
    "SLACK_BOT_TOKEN",
    "SLACK_APP_TOKEN",
    "DISCORD_BOT_TOKEN",
    "APPSERVER_TOKEN",
)


# A value that is a mask already, alone or after its scheme (`Bearer [redacted sha256:…]`).
_MASKED = re.compile(r"(?i)(?:(?:bearer|basic|token)\s+)?\[redacted[^\]]*\]")


def _mask(secret: str) -> str:
    return f"[redacted {fingerprint(secret)}]"


def _replace(m: re.Match[str]) -> str:
    if "s" not in m.re.groupindex:
        return _mask(m.group(0))
    if _MASKED.fullmatch(m.group("s")):
        return m.group(0)  # already masked by an earlier pattern (or a known secret)
    start, end = m.span("s")
    base = m.start(0)
    whole = m.group(0)
    return whole[: start - base] + _mask(m.group("s")) + whole[end - base :]


_UNICODE_ESCAPE = re.compile(r"\\u([0-9a-f]{4})")
_PERCENT = re.compile(r"%[0-9A-F]{2}")


def _json_escaped(secret: str) -> set[str]:
    """`secret` as the inside of a JSON string, as encoders write it: Python's json.dumps with and
    without `ensure_ascii`, `/` as `\\/` (PHP), `<`, `>`, `&` as `\\u003c`… (Go), `\\uXXXX` in
    upper-case hex (JavaScript, Java)."""
    forms: set[str] = set()
    for ensure_ascii in (True, False):
        inner = json.dumps(secret, ensure_ascii=ensure_ascii)[1:-1]
        forms.add(inner)
        forms.add(inner.replace("/", "\\/"))
        html = inner.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
        forms.add(html.replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))
    forms |= {_UNICODE_ESCAPE.sub(lambda m: "\\u" + m.group(1).upper(), f) for f in forms}
    return forms


def base64_forms(secret: str) -> set[str]:
    """The parts of any base64 text (standard and URL-safe alphabets, padded or not) that encode
    `secret` and nothing else, at each of the three byte offsets it may start at inside the encoded
    text (`Basic base64(user:secret)`, a token echoed base64-encoded): the characters before and
    after each core also carry bits of neighbouring bytes, so they are left as they are."""
    data = secret.encode("utf-8")
    forms: set[str] = set()
    for offset in range(3):
        encoded = base64.b64encode(b"\0" * offset + data).decode("ascii").rstrip("=")
        first = -(-8 * offset // 6)  # the first character made of the secret's bits only
        last = 8 * (offset + len(data)) // 6  # one past the last such character
        core = encoded[first:last]
        if len(core) >= MIN_SECRET_LEN:
            forms.add(core)
            forms.add(core.replace("+", "-").replace("/", "_"))
    return forms


def secret_forms(secret: str) -> set[str]:
    """Every form in which `secret` may come back quoted in an upstream's error: as it is, JSON-escaped
    (an upstream that quotes its request's headers as JSON, inside a JSON error body, so twice as
    well), and URL-encoded (a query or a path that quotes it). A secret of letters, digits and
    `-._~` has one form; one holding `"`, `\\`, `/`, `&`, a space or a non-ASCII character has several.
    Base64-encoded too (`base64_forms`: a `Basic` header quoted back, an echo that encodes).
    Each is at least MIN_SECRET_LEN long."""
    url = {quote(secret, safe=""), quote(secret, safe="/"), quote_plus(secret)}
    url |= {quote(u, safe="") for u in url}  # encoded twice: a URL quoted inside another's query
    url |= {_PERCENT.sub(lambda m: m.group(0).lower(), u) for u in url}
    forms = {secret, *url}
    for form in list(forms):
        forms |= _json_escaped(form)
    for once in _json_escaped(secret):
        forms.add(json.dumps(once)[1:-1])  # escaped twice: JSON text inside a JSON string
        forms.add(json.dumps(once, ensure_ascii=False)[1:-1])
    return forms | base64_forms(secret)


class SecretRedactor(logging.Filter):
    """Rewrites each record's message (and traceback text) with secrets replaced by fingerprints.

    Known secrets are remembered in a bounded LRU (so registering every verified token cannot
    grow memory without limit). Thread-safe: uvicorn and the app may log from several threads.
    """

    def __init__(
        self,
        secrets: Iterable[str] = (),
        env_names: Iterable[str] = (),
        environ: dict[str, str] | None = None,
    ) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._known: OrderedDict[str, tuple[str, frozenset[str]]] = OrderedDict()  # secret → mask, forms
        self._regex: re.Pattern[str] | None = None
        self._forms: dict[str, str] = {}  # each form of each known secret → the secret's mask
        env = os.environ if environ is None else environ
        for s in secrets:
            self.add_secret(s)
        for name in env_names:
            value = env.get(name)
            if value:
                self.add_secret(value)

    def add_secret(self, secret: str | None) -> None:
        """Remember a secret value (ignored when too short to redact without mangling text)."""
        if not secret:
            return
        secret = secret.strip()
        if len(secret) < MIN_SECRET_LEN:
            return
        with self._lock:
            if secret in self._known:
                self._known.move_to_end(secret)
                return
        entry = (_mask(secret), frozenset(secret_forms(secret)))  # outside the lock: the costly part
        with self._lock:
            if secret in self._known:
                self._known.move_to_end(secret)
                return
            self._known[secret] = entry
            while len(self._known) > MAX_REMEMBERED:
                self._known.popitem(last=False)
            self._regex = None

    def redact(self, text: str) -> str:
        """Return `text` with every known or secret-looking value replaced by its fingerprint: a
        known secret as it is and in each form an upstream may quote it in (JSON-escaped, URL-encoded:
        `secret_forms`), each form masked with the fingerprint of the secret itself."""
        with self._lock:
            regex, forms = self._regex, self._forms
            if regex is None and self._known:
                forms = {}
                for mask, secret_forms_ in self._known.values():
                    for form in secret_forms_:
                        forms.setdefault(form, mask)
                ordered = sorted(forms, key=len, reverse=True)
                regex = self._regex = re.compile("|".join(re.escape(s) for s in ordered))
                self._forms = forms
        if regex is not None:
            text = regex.sub(lambda m: forms.get(m.group(0), "[redacted]"), text)
        for pat in _PATTERNS:
            text = pat.sub(_replace, text)
        return text

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a bad format string must not hide the record
            message = str(record.msg)
        redacted = self.redact(message)
        if redacted != message:
            record.msg = redacted
            record.args = None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = self.redact(record.exc_text)
        if record.stack_info:
            record.stack_info = self.redact(record.stack_info)
        return True


def from_config(config: Config, extra_secrets: Iterable[str] = ()) -> SecretRedactor:
    """A redactor knowing the API keys of every configured provider (and what else of theirs is
    secret: `provider_secrets`) and well-known env names."""
    names = {p.api_key_env for p in config.providers.values() if p.api_key_env}
    names.update(ENV_SECRET_NAMES)
    return SecretRedactor(secrets=[*extra_secrets, *provider_secrets(config)], env_names=sorted(names))


def provider_secrets(config: Config, environ: dict[str, str] | None = None) -> list[str]:
    """What the configured providers send upstream that is secret: each API key's value, the
    values of extra headers (a custom auth header), and what a `base_url` carries (a password in
    its user part, the values of its query: `?api-key=…`). An upstream can echo any of them back
    in an error (a 401 that quotes the Authorization header, a 404 that quotes the path)."""
    env = os.environ if environ is None else environ
    found: list[str] = []
    for p in config.providers.values():
        if p.api_key_env:
            found.append(env.get(p.api_key_env, ""))
        for value in p.headers.values():
            if isinstance(value, str):
                found.append(value)
                scheme, _, rest = value.strip().partition(" ")
                if rest and scheme.lower() in ("bearer", "basic", "token"):
                    found.append(rest)
        try:
            url = urlsplit(p.base_url or "")
        except ValueError:
            continue
        for x in (url.username, url.password):
            if x:
                found.extend((x, unquote(x)))  # as written, and as sent (percent-decoded, in Basic auth)
        for key, value in parse_qsl(url.query, keep_blank_values=True):
            for secret in (value, key) if not value else (value,):  # `?KEY` alone: the key is the secret
                found.append(secret)
                found.append(quote(secret, safe=""))  # as a URL quotes it again
    return [s for s in found if s and len(s.strip()) >= MIN_SECRET_LEN]


def provider_error_redactor(config: Config) -> SecretRedactor:
    """The redactor for what an upstream says in an error before a client sees it or the store
    keeps it (agent/loop.py): the provider secrets of `config`, the well-known key variables and
    the secret shapes of the log filter. One per agent loop, built from its own Config."""
    return from_config(config)


def install(
    redactor: SecretRedactor,
    logger_names: Iterable[str] = ("", "uvicorn", "uvicorn.error", "uvicorn.access"),
) -> list[logging.Handler]:
    """Attach `redactor` to every handler of the named loggers (root = ""); returns them.

    Call after logging is configured (for uvicorn: after `uvicorn.Config(...)` is built, which
    applies its log config), and again if handlers are added later.
    """
    done: list[logging.Handler] = []
    for name in logger_names:
        for handler in logging.getLogger(name or None).handlers:
            if redactor not in handler.filters:
                handler.addFilter(redactor)
            done.append(handler)
    return done


def redact_value(value: Any, redactor: SecretRedactor) -> Any:
    """Redact strings inside a JSON-like value (for structured logs or error reports)."""
    if isinstance(value, str):
        return redactor.redact(value)
    if isinstance(value, dict):
        return {k: redact_value(v, redactor) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact_value(v, redactor) for v in value]
    return value
