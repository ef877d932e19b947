"""Replies back to chats: what a snapshot shows, the per-chat outbox, and the per-turn sink.

A turn's snapshots become the text a person sees (`visible_text`: reasoning never, tool use as one
compact status line while it runs, a failure or cancellation as one short line). The `Outbox` is
the one way out to a chat: every send and edit passes the per-chat rate limiter, honours the
platform's `retry_after`, retries transient errors with backoff and raises `DeliveryFailed` with
the reason in the end. A `ReplySink` grows one turn's reply in place where the platform can edit
(first send at the first visible text, then about one edit per `interval`, no-op edits skipped,
the last edit exact), splitting at the platform's limit without breaking code fences.

A send is never repeated where that could show it twice (DESIGN §8: once, never twice). When its
outcome is unknown (a timeout, a connection lost after the request went out, or a restart after a
crash in flight), the outbox sends again only where the platform dedupes by the part's key
(`dedupes_sends`: Discord's nonce) or, after looking the message up by its key (`find_sent`:
Slack's message metadata), reuses the one it finds. A platform with neither (Telegram) gets at most
once: an uncertain send is not repeated and the reply fails with the reason, logged as an error.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from gateway.ratelimit import LOOKUP, MESSAGE, REACTION, ChatRateLimiter, RetryAfter
from gateway.split import SOURCE_FACTOR, fences_on_own_lines, split_message
from plugins.contract import Adapter, DeliveryError, Target, shorten

if TYPE_CHECKING:
    from gateway.accounts import AccountRunner

log = logging.getLogger("gateway.delivery")
T = TypeVar("T")

# A transient failure (a 5xx the platform answered, a dropped connection, no answer in time) is
# retried for about a minute: a platform's brief outage (tens of seconds) costs a late reply, not a
# lost one. The minute is wall-clock from the first attempt, the attempts included: a target that
# never answers spends its whole send deadline in each attempt (15 s for a webhook), and counting
# only the sleeps kept one such reply, and its chat's later replies behind it, for three minutes.
# No retry is made once TRANSIENT_BUDGET_S have passed; at most TRANSIENT_ATTEMPTS in any case.
BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0)
TRANSIENT_ATTEMPTS = len(BACKOFF_S) + 1
TRANSIENT_BUDGET_S = sum(BACKOFF_S)
# A platform's "wait" answer (429/503 with retry_after) is retried after the longer of its wait and
# the transient backoff step, and given up only after this many such answers that together waited
# at least TRANSIENT_BUDGET_S: a short or zero retry_after retries like a transient error (about a
# minute, 8 attempts), a long one is honoured in full (5 answers of 300 s: 20 minutes). The time
# spent waiting on such answers does not count against the transient minute.
RATE_LIMIT_ATTEMPTS = 5
NO_REPLY = "(no reply)"
MAX_RETRY_AFTER_S = 300.0  # a platform's retry_after beyond this (or infinite) is read as this
# A send whose outcome is unknown may still be in the platform's hands (queued there when the
# connection dropped): a lookup that finds nothing sooner than this after it began looks once more
# then, before the part is sent again.
LOOKUP_SETTLE_S = 3.0
# A reaction the gateway makes on its own (the 👀 on a queued message) is cosmetic: one that cannot go
# within this (its kind rate limited in the chat, the chat's queue busy) is skipped, never queued
# behind minutes, and a "wait" answer to it is not retried.
REACT_WITHIN_S = 5.0
_SURROGATE_RE = re.compile("[\ud800-\udfff]")


class DeliveryFailed(Exception):
    """A reply or send that could not be delivered, with the platform's reason."""


class EditRefused(DeliveryFailed):
    """The platform answered that it will not do this edit (the message deleted, too old, not
    editable: a permanent `DeliveryError`): only then does a reply's final text go out as a new
    message."""


class EditUncertain(DeliveryFailed):
    """An edit given up after an attempt that may have been performed (no answer in time, a dropped
    connection, Slack's `internal_error`): it most likely landed, and an edit repeats harmlessly, so
    it is replaced by a new message only where the platform shows that it did not land
    (`Outbox.edit_landed`); a reply whose final edit the platform was asked about and could not
    vouch for is not `delivered`."""

    def __init__(self, message: str, began: float | None = None) -> None:
        super().__init__(message)
        self.began = began  # epoch seconds: when the last attempt that may have landed began


class SendRefused(DeliveryFailed):
    """A send the platform refused on every attempt with an answer that says it did nothing (a 4xx
    refusal for good, a "wait" answer): the part is not in the chat, so nothing is looked up or
    blanked for it later (a Discord nonce repeat of it would post a new message)."""


class SendUncertain(DeliveryFailed):
    """A send that may have reached the chat, on a platform that can neither dedupe nor be asked:
    not repeated, so the chat shows it at most once."""


@dataclass(frozen=True)
class Sent:
    """What a send left in the chat: its message ids; `found` when an earlier attempt had been
    performed and these are its messages (showing that attempt's text, not necessarily this one)."""

    ids: list[str]
    found: bool = False


Resend = Literal["dedupe", "lookup"]


def reply_body(snapshot: dict[str, Any]) -> str:
    """The text blocks of a snapshot (never reasoning), as one text."""
    blocks = snapshot.get("blocks") or []
    return "\n\n".join(str(b.get("text") or "").strip() for b in blocks if b.get("type") == "text" and b.get("text"))


def visible_text(snapshot: dict[str, Any], *, tool_status: bool = True) -> str:
    """The reply as a chat shows it: text blocks (never reasoning), plus a status line while a
    tool runs (when `tool_status`) and one short line when the turn failed or was cancelled."""
    blocks = snapshot.get("blocks") or []
    text = reply_body(snapshot)
    status = snapshot.get("status")
    lines = [text] if text else []
    if status in ("running", "awaiting") and tool_status:
        running = [b for b in blocks if b.get("type") == "tool_call" and b.get("status") not in ("completed", "failed")]
        if running:
            lines.append(f"⚙ {running[-1].get('name') or 'tool'}…")
    if status == "awaiting":
        waiting = [str(p.get("name")) for p in snapshot.get("pending") or [] if p.get("kind") == "approval"]
        if waiting:
            lines.append(f"⏸ waiting for approval of {', '.join(waiting)}")
    elif status in ("failed", "cancelled"):
        error = snapshot.get("error") or {}
        # a server stop shows as `cancelled` with an `interrupted` error: nobody cancelled it
        if error.get("kind") == "interrupted" or (status == "failed" and error.get("kind") == "unknown"):
            lines.append("⚠ The reply was interrupted (the server stopped while it was being written).")
        elif status == "failed":
            lines.append(f"⚠ The turn failed: {_short(str(error.get('message') or error.get('kind') or 'error'))}")
        else:
            lines.append("⏹ Cancelled.")
    elif status == "completed" and snapshot.get("stop_reason") == "content_filter":
        lines.append("⚠ The model provider's content filter stopped this reply.")
    return "\n\n".join(lines)


def encodable(text: str) -> str:
    """`text` with every lone surrogate (U+D800-U+DFFF, e.g. a tool's `"\\ud800"`) as U+FFFD and
    every split pair joined: no platform can encode half a character, and the failure was taken for
    a transient one and retried for a minute, holding the chat's later replies."""
    if not _SURROGATE_RE.search(text):
        return text
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


def refused_for_certain(error: DeliveryError) -> bool:
    """Whether the platform's answer says it did not perform the call: a refusal for good (a 4xx: no
    permission, a bad request) or a "wait" answer (rate limited). A 5xx is not: a platform can
    perform a post and still answer one."""
    return not error.uncertain and (error.permanent or error.retry_after is not None)


def plugin_failure(exc: Exception) -> DeliveryError:
    """A plugin's exception other than `DeliveryError`, as one. Transient (retried), except what
    building the request raises (bad text or arguments: `UnicodeError`, `ValueError`, `TypeError`),
    which every retry would raise again: permanent at once. A `JSONDecodeError` is a platform's
    unreadable answer (an HTML error page from a proxy), which a retry may well not see again."""
    reason = f"{type(exc).__name__}: {exc}"
    never = isinstance(exc, UnicodeError | TypeError) or (
        isinstance(exc, ValueError) and not isinstance(exc, json.JSONDecodeError)
    )
    return DeliveryError(reason, permanent=never)


def _short(text: str, limit: int = 200) -> str:
    return shorten(" ".join(text.split()), limit)


class Outbox:
    """All traffic to one account's chats: rate limited per chat, retried, never silently dropped,
    and a send never repeated where it could show twice."""

    def __init__(
        self,
        adapter: Adapter,
        limiter: ChatRateLimiter,
        sleep: Callable[[float], Awaitable[None]],
        wall: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.adapter = adapter
        self.limiter = limiter
        self._sleep = sleep
        self._wall = wall  # epoch seconds: a lookup asks the platform for messages since a time
        self._clock = clock  # the transient budget's time (monotonic)
        # What went wrong last and whether a call is out right now: a caller that gives up (cron's
        # delivery) says what happened, and whether the call it cut off may have been performed.
        self.last_error: str | None = None
        self.in_flight = False

    def format(self, text: str) -> str:
        """The platform's form of `text`. A code fence opening or closing mid-line is first moved to
        a line of its own, for every send and edit, however short: the formatters read fences by
        line, and a short reply with one (`Here it is: ```python`) showed stray backticks."""
        text = encodable(text)
        if "```" in text:
            text = fences_on_own_lines(text)
        fmt = getattr(self.adapter, "format", None)
        return str(fmt(text)) if callable(fmt) else text

    @property
    def can_edit(self) -> bool:
        return bool(self.adapter.limits.can_edit and callable(getattr(self.adapter, "edit", None)))

    @property
    def resend(self) -> Resend | None:
        """How a send whose outcome is unknown may be repeated without showing twice, if at all."""
        if getattr(self.adapter, "dedupes_sends", False) is True:
            return "dedupe"
        if callable(getattr(self.adapter, "find_sent", None)):
            return "lookup"
        return None

    async def send(self, target: Target, text: str) -> list[str]:
        return (await self.send_part(target, text)).ids

    async def prompt(self, target: Target, text: str, short_id: str, *, since: float | None = None) -> Sent:
        """An approval prompt: posted with the adapter's buttons (`prompt_approval`) where it has
        them, else as a plain message; either way like every send (rate limited, `retry_after`
        honoured, transient errors retried, never posted twice)."""
        return await self.send_part(target, text, since=since, buttons=short_id)

    async def send_part(
        self, target: Target, text: str, *, since: float | None = None, buttons: str | None = None
    ) -> Sent:
        """Send one message. `since` (epoch seconds): an earlier attempt at this same part (same
        `target.key`) began then and may have been performed (a restart after a crash in flight);
        where the platform can be asked, its message is looked up first and reused. `buttons`: the
        short id of an approval prompt, posted by the adapter's `prompt_approval` (which formats it).

        Within this call, an uncertain failure is retried only where that cannot post twice; on a
        platform that can neither dedupe nor be asked it raises `SendUncertain` at once."""
        text = encodable(text)  # `prompt_approval` gets it unformatted
        formatted = self.format(text)
        with_buttons = getattr(self.adapter, "prompt_approval", None) if buttons is not None else None
        resend = self.resend
        if target.key is None and resend is not None:
            target = replace(target, key=str(uuid.uuid4()))  # the same over this send's retries
        doubt = since  # when set, an earlier attempt may have been performed
        doubted_here = False  # ...by an uncertain failure seen in this call (not only before a restart)
        started: float | None = None

        past_window = False  # the dedupe window was found passed (and looked past) in this call
        refused = True  # every attempt of this call so far was refused without being performed

        async def attempt() -> Sent:
            nonlocal doubt, doubted_here, started, past_window, refused
            if doubt is not None and resend == "lookup":
                found = await self._find(target, doubt, doubted_here)
                settle = doubt + LOOKUP_SETTLE_S - self._wall()
                if not found and settle > 0:
                    await self._sleep(settle)
                    found = await self._find(target, doubt, doubted_here)
                if found:
                    log.info("%s: the message %s was sent before (%s); reusing it", target.chat, target.key, found)
                    return Sent(found, found=True)
            elif doubt is not None and resend == "dedupe" and not past_window:
                past_window = self._wall() - doubt >= self._dedupe_window()
                found = await self._find_posted(target, doubt, formatted) if past_window else None
                if found:
                    return Sent(found, found=True)
            elif since is not None and resend is None and started is None:
                log.warning(
                    "%s: sending part %s again: an attempt before the restart may have reached the chat, and"
                    " this platform cannot tell (the one window left, docs/channels.md)",
                    target.chat,
                    target.key,
                )
            if started is None:
                started = self._wall()
            # A repeat within the platform's dedupe window of an attempt before this call (a restart
            # after a crash in flight) is answered with that attempt's message if it was performed,
            # showing its text, maybe not this one (a reply's first part sent as "⏸ waiting for
            # approval", repeated as the final reply): `found`, so the caller edits it to this text.
            repeated = since is not None and resend == "dedupe" and not past_window
            try:
                if buttons is not None and callable(with_buttons):
                    return Sent(list(await with_buttons(target, text, buttons)), found=repeated)
                return Sent(await self.adapter.send(target, formatted), found=repeated)
            except DeliveryError as exc:
                error = exc
            except TimeoutError as exc:  # a plugin's own timeout: the request may have been performed
                error = DeliveryError(f"TimeoutError: {exc}", uncertain=True)
            except Exception as exc:  # noqa: BLE001 - a plugin may fail any way: transient, never lost
                error = plugin_failure(exc)
            refused = refused and refused_for_certain(error)
            if error.uncertain:
                if resend is None:
                    log.error(
                        "%s: a send failed after it may have reached the chat (%s); this platform can neither"
                        " dedupe nor be asked, so it is not sent again (at most once, never twice)",
                        target.chat,
                        error.reason,
                    )
                    raise SendUncertain(f"{error.reason} (it may have reached the chat; not sent again)") from error
                doubt = started if doubt is None else min(doubt, started)
                doubted_here = True
            raise error

        try:
            return await self._call(target.chat, attempt)
        except SendUncertain:
            raise
        except DeliveryFailed as exc:
            if refused and started is not None:
                raise SendRefused(str(exc)) from exc.__cause__
            raise

    async def find_left(self, target: Target, since: float, text: str | None = None) -> list[str] | None:
        """The message an earlier attempt at `target.key` (begun at `since`, before a restart) left
        in the chat, where the platform can tell without posting anything new that would stay: looked
        up ("lookup"), or repeated as "…" under the key within the dedupe window ("dedupe"), which
        answers that message if it was performed; past the window, looked for by `text`, what that
        attempt posted, when the caller knows it (`find_posted`). None where it cannot tell or it is
        not there. A dedupe repeat of an attempt that never landed posts a "…" of its own
        (`_blank_left`, `ChatOps.decided`)."""
        resend = self.resend
        if target.key is None or resend is None:
            return None
        if resend == "dedupe":
            if self._wall() - since < self._dedupe_window():
                return (await self.send_part(target, "…", since=since)).ids or None
            if text is None:
                return None  # a repeat would post anew, and the text to look for is unknown
            formatted = self.format(text)
            return await self._call(target.chat, lambda: self._look_posted(target, since, formatted), LOOKUP)

        async def lookup() -> list[str] | None:
            found = await self._find(target, since, False)
            settle = since + LOOKUP_SETTLE_S - self._wall()
            if not found and settle > 0:
                await self._sleep(settle)
                found = await self._find(target, since, False)
            return found

        return await self._call(target.chat, lookup, LOOKUP)

    def _dedupe_window(self) -> float:
        """How long the platform dedupes a repeated key (`dedupe_window_s`; unbounded when not said)."""
        window = getattr(self.adapter, "dedupe_window_s", None)
        if isinstance(window, int | float) and not isinstance(window, bool) and window > 0:
            return float(window)
        return math.inf

    async def _look_posted(self, target: Target, since: float, text: str) -> list[str] | None:
        """The message the adapter's `find_posted` finds for this part (its key, or `text` as
        posted) since `since`; None without one, when it is not there, or when it cannot tell."""
        find = getattr(self.adapter, "find_posted", None)
        if not callable(find):
            return None
        try:
            found = await find(target, since, text)
        except DeliveryError as exc:
            log.warning("%s: cannot look up part %s (%s)", target.chat, target.key, exc.reason)
            return None
        if not found:
            return None
        log.info("%s: the message %s was sent before (%s); reusing it", target.chat, target.key, found)
        return [str(i) for i in found]

    async def _find_posted(self, target: Target, since: float, text: str) -> list[str] | None:
        """A repeat past the platform's dedupe window (Discord's nonce holds a few minutes) would post
        again: the adapter's `find_posted` looks for the message first; without one, or when it
        cannot tell, the part is sent again, with a warning (as on a platform that cannot dedupe)."""
        found = await self._look_posted(target, since, text)
        if found:
            return found
        log.warning(
            "%s: sending part %s again %.0f s after an attempt that may have reached the chat: past the"
            " platform's dedupe window (%g s), so it may show twice",
            target.chat,
            target.key,
            self._wall() - since,
            self._dedupe_window(),
        )
        return None

    async def _find(self, target: Target, since: float, doubted_here: bool) -> list[str] | None:
        """The platform's answer to "was this part sent?"; a lookup the platform refuses for good
        means it cannot tell: at most once within this process, sent again after a restart."""
        find = getattr(self.adapter, "find_sent")  # noqa: B009 - optional method of the contract
        try:
            found = await find(target, since)
        except DeliveryError as exc:
            if exc.retry_after is not None and not exc.permanent:
                raise asked_to_wait(exc, LOOKUP) from exc  # holds back lookups, not the chat's sends
            if not exc.permanent:
                raise
            if doubted_here:
                log.error(
                    "%s: a send may have reached the chat and the lookup was refused (%s): not sent again",
                    target.chat,
                    exc.reason,
                )
                raise SendUncertain(f"{exc.reason} (the message may have reached the chat; not sent again)") from exc
            log.warning("%s: cannot look up part %s (%s); sending it again", target.chat, target.key, exc.reason)
            return None
        return [str(i) for i in found] if found else None

    async def edit(self, target: Target, message_id: str, text: str) -> None:
        """Edit a message, retried like every call (an edit repeats harmlessly). Given up, it raises
        `EditRefused` when the platform will not edit that message (its last answer), else
        `EditUncertain` when an attempt may have been performed, else `DeliveryFailed`."""
        formatted = self.format(text)
        edit = getattr(self.adapter, "edit")  # noqa: B009 - optional method of the contract
        uncertain: float | None = None  # when the last attempt that may have been performed began

        async def attempt() -> None:
            nonlocal uncertain
            began = self._wall()
            try:
                await edit(target, message_id, formatted)
            except TimeoutError:  # a plugin's own timeout: the edit may have been performed
                uncertain = began
                raise
            except DeliveryError as exc:
                uncertain = began if exc.uncertain else uncertain
                raise

        try:
            await self._call(target.chat, attempt)
        except DeliveryFailed as exc:
            # A refusal for good decides, even after an attempt that may have landed: the message is
            # gone (deleted by the user meanwhile) or can no longer be edited, so nothing shows the text.
            cause = exc.__cause__
            if isinstance(cause, DeliveryError) and cause.permanent and cause.retry_after is None:
                raise EditRefused(str(exc)) from cause
            if uncertain is not None:
                raise EditUncertain(str(exc), uncertain) from exc
            raise

    @property
    def shows_messages(self) -> bool:
        """Whether the platform can be asked what a message shows now (the adapter's `shown`)."""
        return callable(getattr(self.adapter, "shown", None))

    async def edit_landed(
        self, target: Target, message_id: str, text: str, before: str | None, since: float | None = None
    ) -> bool | None:
        """Whether an edit of `message_id` to `text` that may not have landed did: the message as
        the platform shows it now (the adapter's optional `shown`, Slack's history lookup) reads
        `text` (True) or still `before`, the text it had (False); None when it cannot tell (no
        `shown`, the lookup failed, or the message reads neither). An edit begun at `since` (epoch
        seconds) may still be in the platform's hands, as a send may: a message that still reads
        `before` is looked at again LOOKUP_SETTLE_S after it, before it counts as not landed."""
        shown = getattr(self.adapter, "shown", None)
        if not callable(shown):
            return None
        landed = await self._edit_shown(target, message_id, text, before)
        if landed is not False or since is None:
            return landed
        settle = since + LOOKUP_SETTLE_S - self._wall()
        if settle <= 0:
            return landed
        await self._sleep(settle)
        return await self._edit_shown(target, message_id, text, before)

    async def _edit_shown(self, target: Target, message_id: str, text: str, before: str | None) -> bool | None:
        """One look at `message_id`: reads `text` (True), `before` (False), or cannot tell (None)."""
        shown = getattr(self.adapter, "shown")  # noqa: B009 - optional method of the contract
        try:
            now = await self._call(target.chat, lambda: shown(target, message_id), LOOKUP)
        except DeliveryFailed as exc:
            log.warning("%s: cannot look up whether the edit of %s landed (%s)", target.chat, message_id, exc)
            return None
        if now is not None and now == self.format(text):
            return True
        if now is not None and before is not None and now == self.format(before):
            return False
        return None

    async def edit_prompt(self, target: Target, message_id: str, text: str, short_id: str | None) -> None:
        """Edit an approval prompt: with its buttons while `short_id` is pending, without them once
        decided (None). The gateway says which, so this holds for a prompt posted before a restart;
        an adapter without `edit_prompt` gets a plain edit."""
        edit_prompt = getattr(self.adapter, "edit_prompt", None)
        if not callable(edit_prompt):
            await self.edit(target, message_id, text)
            return
        formatted = self.format(text)
        await self._call(target.chat, lambda: edit_prompt(target, message_id, formatted, short_id))

    async def react(self, target: Target, message_id: str, emoji: str, *, best_effort: bool = False) -> None:
        """React to a message. Its rate limit holds back only the chat's reactions. `best_effort` (a
        reaction of the gateway's own): one attempt, skipped (`DeliveryFailed`) when it cannot go
        within `REACT_WITHIN_S` or the platform asks to wait."""
        react = getattr(self.adapter, "react", None)
        if not callable(react):
            raise DeliveryFailed("this channel cannot react to messages")
        if not best_effort:
            await self._call(target.chat, lambda: react(target, message_id, emoji), REACTION)
            return
        blocked = self.limiter.blocked_for(target.chat, REACTION)
        if blocked > REACT_WITHIN_S:
            raise DeliveryFailed(f"skipped: reactions in this chat wait {blocked:.0f} s more for the platform")
        try:
            await asyncio.wait_for(self.limiter.acquire(target.chat, REACTION), REACT_WITHIN_S)
        except TimeoutError:
            raise DeliveryFailed(f"skipped: it could not go within {REACT_WITHIN_S:g} s") from None
        try:
            await react(target, message_id, emoji)
        except DeliveryError as exc:
            if exc.retry_after is not None and not exc.permanent:
                wait = asked_to_wait(exc, REACTION)
                self.limiter.retry_after(target.chat, wait.seconds, REACTION, wait.scope)
                raise DeliveryFailed(f"skipped: {exc.reason} (asked to wait {wait.seconds:g} s)") from exc
            raise DeliveryFailed(exc.reason) from exc
        except Exception as exc:  # noqa: BLE001 - a plugin may fail any way: a cosmetic call, not retried
            raise DeliveryFailed(plugin_failure(exc).reason) from exc

    async def _call(self, chat: str, op: Callable[[], Awaitable[T]], kind: str = MESSAGE) -> T:
        """Run `op`, a call of `kind` to `chat`, through the limiter: a platform's "wait" answer
        holds back that kind of call there (or more, as the answer says), and is honoured and
        retried; a transient failure is retried with backoff for about a minute."""
        tries = 0

        async def attempt() -> T:
            nonlocal tries
            tries += 1
            self.in_flight = True
            try:
                return await op()
            except DeliveryError as exc:
                self.last_error = exc.reason
                if exc.retry_after is not None and not exc.permanent:
                    wait = asked_to_wait(exc)
                    self.last_error = f"{exc.reason} (asked to wait {wait.seconds:g} s)"
                    raise wait from exc
                raise
            except (RetryAfter, DeliveryFailed) as exc:
                self.last_error = str(exc)
                raise
            except Exception as exc:  # noqa: BLE001 - a plugin may fail any way: transient, never lost
                error = plugin_failure(exc)
                self.last_error = error.reason
                raise error from exc
            finally:
                self.in_flight = False

        began = self._clock()
        failures = 0  # of either kind: the backoff step
        waited = 0.0  # seconds of waiting this call imposed after its failures
        asked = 0.0  # ...of which after the platform's "wait" answers: outside the transient minute
        limited = 0  # "wait" answers (RetryAfter)
        while True:
            try:
                return await self.limiter.call(chat, attempt, attempts=1, kind=kind)
            except RetryAfter as exc:
                # The platform asked to wait: honoured, but never for less than the transient backoff
                # (a receiver's `Retry-After: 0` burnt every attempt in a blink), and given up only
                # after RATE_LIMIT_ATTEMPTS answers that together waited out the transient budget:
                # a reply is never lost sooner than with any other transient error.
                limited += 1
                if limited >= RATE_LIMIT_ATTEMPTS and waited >= TRANSIENT_BUDGET_S:
                    raise DeliveryFailed(
                        f"rate limited: the platform kept asking to wait ({exc.seconds:g} s)"
                        + _over(tries, self._clock() - began, exc.__cause__)
                    ) from exc
                wait = max(exc.seconds, BACKOFF_S[min(failures, len(BACKOFF_S) - 1)])
                limited_kind = exc.kind or kind
                if wait > exc.seconds:  # that kind of call waits the longer of the two
                    self.limiter.retry_after(chat, wait, limited_kind, exc.scope)
                failures += 1
                waited += wait
                asked += wait
                log.warning("%s call to %s was asked to wait; retrying in %g s", limited_kind, chat, wait)
                if limited_kind != kind:  # a lookup inside a send: the send waits for it, out of the queue
                    await self.limiter.wait_out(chat, limited_kind)
            except DeliveryError as exc:
                failures += 1
                elapsed = self._clock() - began
                if exc.permanent or failures >= TRANSIENT_ATTEMPTS or elapsed - asked >= TRANSIENT_BUDGET_S:
                    raise DeliveryFailed(exc.reason + _over(tries, elapsed)) from exc
                backoff = BACKOFF_S[min(failures - 1, len(BACKOFF_S) - 1)]
                log.warning("send to %s failed (%s); retrying in %g s", chat, exc.reason, backoff)
                waited += backoff
                await self._sleep(backoff)

    def gave_up(self, seconds: float) -> str:
        """Why a caller that stopped waiting after `seconds` got no delivery: the last error, and
        whether the call it cut off may still have reached the chat."""
        reason = f"gave up after {seconds:g} s"
        failing = f"the channel kept failing: {self.last_error}" if self.last_error else "the channel did not answer"
        reason += f"; {failing}"
        if self.in_flight:
            reason += "; the last attempt was cut off and may have reached the chat"
        return reason


def asked_to_wait(error: DeliveryError, kind: str | None = None) -> RetryAfter:
    """A platform's "wait" answer (`error.retry_after`, read as at most `MAX_RETRY_AFTER_S`) as the
    limiter's `RetryAfter` for calls of `kind` (None: the call being made), as far as it reaches."""
    seconds = error.retry_after if error.retry_after is not None and math.isfinite(error.retry_after) else None
    wait = MAX_RETRY_AFTER_S if seconds is None else min(max(seconds, 0.0), MAX_RETRY_AFTER_S)
    scope = error.retry_scope if error.retry_scope in ("chat", "account") else "call"
    return RetryAfter(wait, kind, scope)


def _over(tries: int, elapsed: float, cause: BaseException | None = None) -> str:
    """How long a call kept failing, for the reason it is given up with ("" for a first refusal)."""
    said = f": {cause}" if isinstance(cause, DeliveryError) else ""
    return f"{said} (after {tries} attempts over {elapsed:.0f} s)" if tries > 1 else said


@dataclass
class _Part:
    message_id: str
    text: str | None  # None: content unknown (sent before a restart, or found by a lookup): always re-edited


@dataclass
class ReplySink:
    """One turn's reply in one chat. `show(text)` while it runs, `finish(text)` once at the end;
    both return the platform ids of the messages the reply occupies so far."""

    outbox: Outbox
    target: Target
    stream: bool = True
    interval: float = 1.0
    parts: list[_Part] = field(default_factory=list)
    clock: Callable[[], float] = time.monotonic
    # Called with every id the reply occupies as soon as a new part was sent (no await in between), so
    # a restart continues in those messages instead of sending them again (the ledger notes them).
    on_sent: Callable[[list[str]], None] | None = None
    # Called with a part's key and the time (epoch seconds) before its first send goes out, so a
    # restart knows that part may exist although its id was never noted (a crash while the send was
    # in flight): it is then looked up where the platform can be asked, deduped where the platform
    # does that, and sent again only where it can do neither (Telegram). docs/channels.md, "Exactly once".
    on_attempt: Callable[[str, float], None] | None = None
    key: str | None = None  # the reply's identity; each part is sent with `key:index` (Target.key)
    attempted: dict[str, float] = field(default_factory=dict)  # part key -> when its first send began
    wall: Callable[[], float] = time.time
    _last: float = -1e9
    _doubtful: set[str] = field(default_factory=set)  # parts that may be in the chat: never sent again
    _tried_here: set[str] = field(default_factory=set)  # parts first attempted by this process
    # Parts first attempted by this process whose every attempt the platform refused without
    # performing it (`SendRefused`): not in the chat, so never looked up or blanked (`_blank_left`).
    _refused: set[str] = field(default_factory=set)
    # Why a final edit may not have landed, where the platform could not tell: the reply fails at
    # the end of `finish` (after its other parts went out), so the ledger never says `delivered`.
    _unsure: list[str] = field(default_factory=list)

    @classmethod
    def resumed(cls, outbox: Outbox, target: Target, remote_ids: tuple[str, ...], **kw: Any) -> ReplySink:
        return cls(outbox, target, parts=[_Part(i, None) for i in remote_ids], **kw)

    @property
    def ids(self) -> list[str]:
        return [p.message_id for p in self.parts]

    def due(self) -> float:
        """Seconds until the next in-place update may go (the sink's own ~1/s pace)."""
        return max(self._last + self.interval - self.clock(), 0.0)

    def final_due(self) -> float:
        """Seconds until the final update may go: the end of a turn waits at most half the pace,
        so a reply is exact quickly and edits stay at about one per second."""
        return max(self._last + self.interval / 2 - self.clock(), 0.0)

    async def show(self, text: str) -> list[str]:
        if not (self.stream and self.outbox.can_edit) or not text.strip():
            return self.ids
        await self._apply(text)
        return self.ids

    async def finish(self, text: str) -> list[str]:
        """The final text; raises `EditUncertain` when a final edit may not have landed and nothing
        could tell (every part went out the best it could)."""
        if not text.strip():
            text = NO_REPLY if self.parts else ""
        self._unsure.clear()
        if text:
            await self._apply(text, final=True)
        if self._unsure:
            raise EditUncertain("; ".join(self._unsure))
        return self.ids

    async def _apply(self, text: str, *, final: bool = False) -> None:
        self._last = self.clock()
        chunks = self._chunks(text)
        if not self.outbox.can_edit:
            chunks = chunks[len(self.parts) :] if final else []
        for i, chunk in enumerate(chunks):
            if self.outbox.can_edit and i < len(self.parts):
                await self._edit(i, chunk, final)
                continue
            index = len(self.parts)
            sent = await self._post(str(index), chunk)
            for message_id in sent.ids:
                self.parts.append(_Part(message_id, None if sent.found else chunk))
            self._sent()
            if sent.found and self.outbox.can_edit and index < len(self.parts):
                await self._edit(index, chunk, final)  # it shows the earlier attempt's text
        if self.outbox.can_edit and len(self.parts) > len(chunks) and final:
            # The reply shrank (a status line went away): blank the surplus rather than leave stale text.
            for part in self.parts[len(chunks) :]:
                if part.text != "…":
                    await self._blank(part.message_id)
                    part.text = "…"
        if self.outbox.can_edit and final:
            await self._blank_left()

    async def _blank(self, message_id: str) -> None:
        """Blank a message past the parts the final reply occupies. One that cannot be blanked (a
        moderator deleted it, too old to edit, the platform kept failing) is left as it is: the
        reply's final text is whole without it, so that is no reason to fail the reply."""
        try:
            await self.outbox.edit(self.target, message_id, "…")
        except EditUncertain as exc:  # most likely blanked
            log.warning("%s: blanking %s may not have landed (%s)", self.target.chat, message_id, exc)
        except DeliveryFailed as exc:  # EditRefused (deleted, no longer editable), or it kept failing
            log.warning(
                "%s: cannot blank %s past the end of the reply (%s); left as it is", self.target.chat, message_id, exc
            )

    async def _blank_left(self) -> None:
        """A part noted as attempted whose id was never noted (its post was in flight at a crash),
        past the parts the final reply occupies, is never posted again, so nothing else finds it: it
        would keep its text for good (a "⏸ waiting for approval" line). Where the platform can tell,
        it is found and blanked like any surplus part; where it cannot, it is left as it is.

        On a platform that dedupes, the repeat that finds it posts a "…" of its own when the attempt
        never landed (killed before it went out). That is accepted: it is the chat the reply leaves
        without a crash (the part posted, then blanked to "…" when the reply shrank), while skipping
        would leave a stale line for good whenever the attempt did land. The same holds for a part
        this process saw fail in a way that may have been performed (a 5xx on every attempt); a part
        it saw refused for certain (`_refused`: a 4xx, a "wait" answer) is not in the chat and is
        skipped, since a repeat would post a "…" where nothing was cut off."""
        if self.key is None:
            return
        prefix = f"{self.key}:"
        left: list[tuple[int, str, float]] = []
        for key, since in self.attempted.items():
            index = key[len(prefix) :] if key.startswith(prefix) else ""
            skip = key in self._doubtful or key in self._refused
            if index.isdigit() and int(index) >= len(self.parts) and not skip:
                left.append((int(index), key, since))
        for _, key, since in sorted(left):
            try:
                found = await self.outbox.find_left(replace(self.target, key=key), since)
                if not found:
                    log.info(
                        "%s: part %s of a shrunk reply is not in the chat, or cannot be found", self.target.chat, key
                    )
                    continue
                for message_id in found:
                    await self._blank(message_id)
            except DeliveryFailed as exc:  # a leftover of a reply that is whole: not a reason to fail it
                log.warning("%s: cannot blank part %s of a shrunk reply (%s)", self.target.chat, key, exc)
                continue
            self.parts.extend(_Part(message_id, "…") for message_id in found)
            self._sent()

    async def _edit(self, i: int, chunk: str, final: bool) -> None:
        part = self.parts[i]
        if part.text == chunk:
            return
        try:
            await self.outbox.edit(self.target, part.message_id, chunk)
        except EditUncertain as exc:
            if not final:
                raise
            # Retried by the outbox with backoff, and an attempt may have been performed: an edit is
            # idempotent and most likely landed (a slow platform applies it, then answers late), so
            # the text is posted anew only where the platform shows the message still reads what it
            # did before (posting it otherwise could show the reply twice). Where the platform cannot
            # be asked (Telegram, Discord) the message stays as it is; where it was asked and could
            # not tell (Slack's lookup refused), the reply is counted failed, not `delivered`.
            if not self.outbox.shows_messages:
                log.warning("%s: the final edit of %s may not have landed (%s)", self.target.chat, part.message_id, exc)
                part.text = None
                return
            landed = await self.outbox.edit_landed(self.target, part.message_id, chunk, part.text, exc.began)
            if landed is None:
                log.error("%s: the final edit of %s may not have landed (%s)", self.target.chat, part.message_id, exc)
                self._unsure.append(f"the final edit of {part.message_id} may not have landed: {exc}")
                part.text = None
                return
            if not landed:
                log.warning("%s: the final edit of %s did not land (%s); posting it anew", self.target.chat,
                            part.message_id, exc)  # fmt: skip
                await self._post_anew(i, chunk)
        except DeliveryFailed:
            if not final:
                raise
            # The platform will not edit this message (EditRefused: too old, deleted), or refused
            # every attempt without performing one: the final text goes out as a new message rather
            # than leave the chat with a partial reply.
            await self._post_anew(i, chunk)
        part.text = chunk

    async def _post_anew(self, i: int, chunk: str) -> None:
        """Part `i`'s final text as a new message, which the part is from then on."""
        part = self.parts[i]
        sent = await self._post(f"{i}:new", chunk)
        part.message_id = sent.ids[0] if sent.ids else part.message_id
        self._sent()
        if sent.found:
            await self.outbox.edit(self.target, part.message_id, chunk)

    async def _post(self, suffix: str, chunk: str) -> Sent:
        """Send one part as `key:suffix`: noted as attempted before it goes (`on_attempt`), looked up
        or deduped when an earlier attempt may have been performed, never repeated when doubtful."""
        if self.key is None:
            return await self.outbox.send_part(self.target, chunk)
        key = f"{self.key}:{suffix}"
        if key in self._doubtful:
            raise SendUncertain(f"part {key} may already be in the chat; not sent again")
        since = self.attempted.get(key)
        unsent = since is None or key in self._refused  # every earlier attempt (all here) refused for certain
        if since is None:
            self.attempted[key] = self.wall()
            self._tried_here.add(key)
            if self.on_attempt is not None:
                self.on_attempt(key, self.attempted[key])
        elif unsent or (key in self._tried_here and self.outbox.resend is None):
            # This process saw every earlier attempt refused, or (where nothing can tell) fail, for
            # certain: nothing to find (an uncertain failure is doubtful).
            since = None
        # Where the platform dedupes or can be asked, an attempt of this process that failed without
        # saying it did nothing (a 5xx) is repeated as one from before a restart: a platform can
        # perform a post and still answer an error, and its deduped repeat then shows that attempt's
        # text, not this one (edited to it).
        self._refused.discard(key)  # back only if the platform refuses this attempt too, for certain
        try:
            return await self.outbox.send_part(replace(self.target, key=key), chunk, since=since)
        except SendRefused:
            if unsent:
                self._refused.add(key)
            raise
        except SendUncertain:
            self._doubtful.add(key)
            raise

    def _sent(self) -> None:
        if self.on_sent is not None:
            self.on_sent(self.ids)

    def _chunks(self, text: str) -> list[str]:
        """The parts of `text`. `max_length` counts after `format` (markup and escapes can grow a
        part, link URLs and markup may not count at all), so a part whose formatted form is too long
        is made smaller, as large as still fits, one with room to spare larger (up to
        `SOURCE_FACTOR` times the limit in Markdown), and the next part goes on from there (greedy:
        no run of small parts, and no split where the platform would take the whole)."""
        limit = self.outbox.adapter.limits.max_length
        measure = getattr(self.outbox.adapter, "measure", None) or len  # e.g. Telegram counts UTF-16 units

        def fits(part: str) -> bool:
            return bool(measure(self.outbox.format(part)) <= limit)

        return split_message(text, limit, fits, most=limit * SOURCE_FACTOR)


class ChatOrder:
    """Replies under one key go out in the order their messages arrived: each sink waits for the
    previous sink of its key to finish before its first send. The gateway's key is a conversation
    of a chat and thread (`gateway.replies.order_key`), so a reply of the conversation a chat left
    with `/new` (paused for an approval, maybe for minutes) never holds back the new one's.

    A place given up without delivering (a turn refused after a `pairing revoke`, withdrawn by
    `/cancel`, a reply that failed) hands its wait on: it counts as done only once the place before
    it is, since each waits only for the one right before it (set at once, it let the next reply
    go out ahead of every earlier one still on its way)."""

    def __init__(self) -> None:
        self._tail: dict[str, asyncio.Event] = {}
        self._before: dict[asyncio.Event, asyncio.Event] = {}  # a place not released yet -> the one before it
        self._handed_on: dict[asyncio.Event, asyncio.Event] = {}  # a place not done -> the next, released early

    def ticket(self, key: str) -> tuple[asyncio.Event | None, asyncio.Event]:
        before = self._tail.get(key)
        mine = asyncio.Event()
        self._tail[key] = mine
        if before is not None:
            self._before[mine] = before
        return before, mine

    def release(self, key: str, mine: asyncio.Event) -> None:
        """`mine` is through (delivered, or given up): done now when the place before it is done
        too, else as soon as that one is."""
        before = self._before.pop(mine, None)
        if before is not None and not before.is_set():
            self._handed_on[before] = mine
            return
        event: asyncio.Event | None = mine
        while event is not None:  # `mine`, then each next place released early, in turn
            event.set()
            if self._tail.get(key) is event:
                del self._tail[key]
            event = self._handed_on.pop(event, None)


class Outboxes:
    """One `Outbox` per account, each with its per-chat limiter for the gateway's lifetime."""

    def __init__(self) -> None:
        self._limiters: dict[str, ChatRateLimiter] = {}

    def of(self, runner: AccountRunner) -> Outbox:
        adapter = runner.adapter
        if adapter is None or not adapter.is_running:
            raise RuntimeError(f"{runner.spec.ref} is not running")
        limiter = self._limiters.get(runner.spec.ref)
        if limiter is None:
            rate = float(runner.settings.get("chat_rate") or adapter.limits.edits_per_second)
            limiter = self._limiters[runner.spec.ref] = ChatRateLimiter(rate=rate, burst=max(3, int(rate)))
        return Outbox(adapter, limiter, asyncio.sleep)

    async def say(self, runner: AccountRunner, target: Target, text: str) -> list[str]:
        """A short line from the gateway itself (a notice, a command's answer); never raises."""
        try:
            ids = await self.of(runner).send(target, text)
            runner.live.last_outbound = time.time()
            return ids
        except (DeliveryFailed, RuntimeError) as exc:
            log.warning("%s: could not tell %s: %s", runner.spec.ref, target.chat, exc)
            return []

    async def say_once(self, runner: AccountRunner, target: Target, text: str, since: float | None) -> list[str]:
        """`say` under `target.key`, for a line the ledger owes (a command's answer, a notice): a
        restart's repeat (`since`, when it was first owed) is deduped or looked up where the platform
        can, instead of posted twice. Never raises."""
        try:
            sent = await self.of(runner).send_part(target, text, since=since)
        except (DeliveryFailed, RuntimeError) as exc:
            log.warning("%s: could not tell %s: %s", runner.spec.ref, target.chat, exc)
            return []
        runner.live.last_outbound = time.time()
        return sent.ids
