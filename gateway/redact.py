"""The channel secrets kept out of the gateway child's log, whoever writes the line.

A platform library logs what it was answered: python-telegram-bot's `telegram.request` logger
writes a non-JSON answer as it came, and an HTML error page echoes the request path
`/bot<TOKEN>/getMe`. The adapters redact their own reasons, but not a library's records, and the
supervisor copies the child's stderr into the server log. So `SecretMask` sits on the root
handlers before any plugin starts and replaces every configured secret of every account (bot and
app tokens, signing secrets: each `<name>_env` / `<name>_file` reference) in each record's final
message, traceback and stack text with `<name>` (`/bot<token>/getMe`). It never logs a secret.

A platform's error also becomes a *reason* (Slack's `invalid_auth (Authorization: Bearer xoxb-…)`,
a Discord 400 echoing `Authorization: Bot …`): an account's state, a failed row. The same mask is
applied where such text leaves the child's memory, once for every writer: gateway.db's reason
columns (`mask_stored`), the control lines to the supervisor and the frames to the server
(`redact_all`, given to `ControlWriter` and `ServerLink`).
"""

from __future__ import annotations

import json
import logging
import re
import sqlite3
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote, quote_plus

from gateway.accounts import AccountSpec, resolve_secrets
from gateway.sqlstore import is_pg
from plugins.contract import AccountError

# A shorter value would mangle ordinary text wherever it occurs; a platform's token is far longer.
MIN_SECRET_LEN = 8
# The gateway.db columns whose text may quote a platform's answer: an account's state reason, a
# message's decision or failure reason (`delivery failed: slack chat.postMessage: …`), the last
# failed send of an account. A payload is the sender's own words and a reply the agent's: left as they are.
MASKED_COLUMNS = (("ledger", "reason"), ("account_status", "reason"), ("account_status", "last_failure_reason"))


def secret_forms(secret: str) -> set[str]:
    """`secret` as it may come back quoted: as it is, URL-encoded (a path or query that quotes
    it: Telegram's `:` as `%3A`) and JSON-escaped (an error body that quotes its request)."""
    forms = {secret, quote(secret, safe=""), quote(secret, safe=":/"), quote_plus(secret)}
    forms |= {f.replace("%3A", "%3a").replace("%2F", "%2f") for f in forms}
    forms |= {json.dumps(f)[1:-1] for f in list(forms)}
    forms |= {f.replace("/", "\\/") for f in list(forms)}
    return {f for f in forms if len(f) >= MIN_SECRET_LEN}


class SecretMask(logging.Filter):
    """A handler filter replacing each known secret (in each of its forms) with `<name>`.

    On a *handler*: a logger's own filters do not see the records its children propagate, a
    handler's see every record it writes. Thread-safe: a library may log from its own threads."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._masks: dict[str, str] = {}  # each form of each secret -> its mask
        self._regex: re.Pattern[str] | None = None

    def add(self, name: str, secret: str) -> None:
        """Remember one secret value under its name (ignored when too short to redact safely)."""
        secret = secret.strip()
        if len(secret) < MIN_SECRET_LEN:
            return
        mask = f"<{name}>"
        with self._lock:
            for form in secret_forms(secret):
                self._masks.setdefault(form, mask)
            self._regex = None

    def add_all(self, secrets: Mapping[str, str] | Iterable[tuple[str, str]]) -> None:
        """Remember each `name -> value` (an account's resolved secrets) or `(name, value)` pair."""
        pairs = secrets.items() if isinstance(secrets, Mapping) else secrets
        for name, value in pairs:
            self.add(name, value)

    def redact(self, text: str) -> str:
        with self._lock:
            if self._regex is None and self._masks:
                longest_first = sorted(self._masks, key=len, reverse=True)
                self._regex = re.compile("|".join(re.escape(f) for f in longest_first))
            regex, masks = self._regex, self._masks
        if regex is None:
            return text
        return regex.sub(lambda m: masks.get(m.group(0), "<secret>"), text)

    def redact_all(self, value: Any) -> Any:
        """`value` (a frame, a control line's payload) with every string in it redacted, keys too."""
        if isinstance(value, str):
            return self.redact(value)
        if isinstance(value, Mapping):
            return {self.redact_all(k): self.redact_all(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.redact_all(v) for v in value]
        return value

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format string must not hide the record
            message = str(record.msg)
        redacted = self.redact(message)
        if redacted != message:
            record.msg, record.args = redacted, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = self.redact(record.exc_text)
        if record.stack_info:
            record.stack_info = self.redact(record.stack_info)
        return True

    def install(self) -> None:
        """Attach to every handler of the root logger (configure logging first)."""
        for handler in logging.getLogger().handlers:
            if self not in handler.filters:
                handler.addFilter(self)


def known_secrets(specs: Iterable[AccountSpec], home: Path, environ: Mapping[str, str]) -> list[tuple[str, str]]:
    """(name, value) of every secret of `specs` that resolves now, each on its own: one that is
    missing (its account's own error, reported when it starts) does not hide the others."""
    found: list[tuple[str, str]] = []
    for spec in specs:
        for name, ref in spec.secrets.items():
            one = AccountSpec(spec.channel, spec.name, {}, {name: ref})
            try:
                value = resolve_secrets(one, home, dict(environ)).get(name)
            except AccountError:
                continue
            if value:
                found.append((name, value))
    return found


def account_mask(specs: Iterable[AccountSpec], home: Path, environ: Mapping[str, str]) -> SecretMask:
    """A mask of every secret of `specs` that resolves now (for a reader of gateway.db, such as
    `channels status`, whose rows an older gateway wrote unmasked)."""
    mask = SecretMask()
    mask.add_all(known_secrets(specs, home, environ))
    return mask


def mask_stored(conn: sqlite3.Connection, mask: SecretMask) -> None:
    """Mask every text written to a `MASKED_COLUMNS` column through `conn`, whoever writes it (the
    ledger, the status board, a future writer): one temporary trigger per column and statement
    (INSERT, UPDATE, an upsert's update), this connection's only, rewrites the new value with the
    mask as it stands then (an account hands over its secrets at each start) in the same
    transaction, so no reader ever sees a secret there. The rewrite fires no trigger again: its
    value no longer differs from its mask (and `recursive_triggers` is off). On PostgreSQL
    (`gateway/sqlstore.py`) the same columns are masked in Python before a statement goes out."""
    if is_pg(conn):
        conn.mask = mask.redact  # type: ignore[attr-defined]
        return
    conn.create_function("gateway_mask", 1, lambda v: mask.redact(v) if isinstance(v, str) else v)
    for table, column in MASKED_COLUMNS:
        for event, when in (("insert", "INSERT"), ("update", f"UPDATE OF {column}")):
            conn.execute(
                f"CREATE TEMP TRIGGER IF NOT EXISTS mask_{table}_{column}_{event} AFTER {when} ON main.{table}"
                f" WHEN NEW.{column} IS NOT gateway_mask(NEW.{column})"
                f" BEGIN UPDATE {table} SET {column} = gateway_mask(NEW.{column}) WHERE rowid = NEW.rowid; END"
            )
