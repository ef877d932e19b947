"""The `fakechat` channel plugin: a user plugin (loaded from `$APPSERVER_HOME/channels/fakechat/`) for the
loopback fake platform in tests/fakes/fakechat.py. httpx plays the part of the platform's client library.

Account settings: `base_url` (required), `poll_timeout` (seconds, default 10), `max_length` (default 4096),
`can_edit` (default true), `edits_per_second` (default 1.0). Secret: `token` (sent as a Bearer token).

Receiving is Telegram-style long polling and ledger-first: each update is handed to `context.on_message`
in order, and the poll offset moves past an update only once its `ack` ran (after the gateway's ledger
committed it). If `on_message` raises or returns without the ack, the rest of that batch waits and the
update is redelivered by the next poll (after a short, growing pause). A getUpdates answer carrying
`"crash": true` makes this process SIGKILL itself before handing the update on (the kill -9 test).

Imports only the standard library, `plugins.contract` and httpx.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Mapping
from typing import Any

import httpx

from plugins.contract import (
    Account,
    AccountError,
    AccountState,
    AdapterContext,
    DeliveryError,
    InboundMessage,
    Limits,
    Target,
)

CHANNEL = "fakechat"
BACKOFF_MIN = 0.2
BACKOFF_MAX = 5.0


class _ApiError(Exception):
    """A call the fake refused (`status` >= 400) or could not reach (`status` 0)."""

    def __init__(self, status: int, error: str, retry_after: float | None = None) -> None:
        super().__init__(error)
        self.status = status
        self.error = error
        self.retry_after = retry_after


class FakeChatAdapter:
    username = "bot"  # addressed as `@bot`: `/status@bot` and `@bot /cancel` are this bot's commands

    def __init__(self, account: Account, context: AdapterContext) -> None:
        self.account = account
        self.context = context
        self._log = context.log
        self._config_error: str | None = None
        settings = account.settings
        base_url = settings.get("base_url")
        self._base_url = base_url if isinstance(base_url, str) else ""
        if not self._base_url.startswith(("http://", "https://")):
            self._config_error = "setting base_url is required (the fake platform's http:// URL)"
        self._poll_timeout = self._number(settings, "poll_timeout", 10.0)
        max_length = int(self._number(settings, "max_length", 4096))
        edits_per_second = self._number(settings, "edits_per_second", 1.0)
        can_edit = settings.get("can_edit", True)
        if not isinstance(can_edit, bool):
            self._config_error = "setting can_edit must be true or false"
            can_edit = True
        self.limits = Limits(
            max_length=max_length, can_edit=can_edit, can_react=True, edits_per_second=edits_per_second
        )
        token = account.secrets.get("token")
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._client: httpx.AsyncClient | None = None
        self._task: asyncio.Task[None] | None = None
        self._offset = 0  # first update id not yet acknowledged by the gateway
        self._sent_offset = 0  # the offset the platform is known to have received
        self._state: AccountState = "stopped"

    def _number(self, settings: Mapping[str, Any], key: str, default: float) -> float:
        value = settings.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            self._config_error = f"setting {key} must be a positive number"
            return default
        return float(value)

    # ------------------------------------------------------------------ lifecycle

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def start(self) -> None:
        if self._config_error is not None:
            raise AccountError(self._config_error)
        if self.is_running:
            return
        self._client = httpx.AsyncClient(base_url=self._base_url, headers=self._headers, timeout=10.0)
        self._report("starting", None)
        try:
            await self._call("getMe", {}, timeout=5.0)
        except _ApiError as e:
            if e.status in (401, 403):
                await self._client.aclose()
                self._client = None
                raise AccountError(f"fakechat refused the token: {e.error}") from None
            self._report("backoff", f"getMe failed: {e.error}")  # the poll loop retries
        else:
            self._report("running", None)
        self._task = asyncio.create_task(self._poll_loop(), name=f"fakechat-poll-{self.account.name}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        client, self._client = self._client, None
        if client is not None:
            if self._offset > self._sent_offset:  # confirm what the gateway acknowledged (Telegram does the same)
                with contextlib.suppress(Exception):
                    await client.post("/getUpdates", json={"offset": self._offset, "timeout": 0}, timeout=2.0)
            await client.aclose()
        self._report("stopped", None)

    def _report(self, state: AccountState, reason: str | None) -> None:
        self._state = state
        try:
            self.context.report(state, reason)
        except Exception:
            self._log.exception("fakechat: report(%s) failed", state)

    # ------------------------------------------------------------------ wire

    async def _call(self, method: str, payload: dict[str, Any], *, timeout: float | None = None) -> dict[str, Any]:
        """POST one method; the whole answer body when ok, else `_ApiError`."""
        assert self._client is not None, "adapter not started"
        try:
            if timeout is None:
                r = await self._client.post(f"/{method}", json=payload)
            else:
                r = await self._client.post(f"/{method}", json=payload, timeout=timeout)
        except httpx.HTTPError as e:
            raise _ApiError(0, f"{type(e).__name__}: {e}".rstrip(": ")) from e
        try:
            body = r.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            body = {}
        if r.status_code == 200 and body.get("ok") is True:
            return body
        error = str(body.get("error") or body.get("description") or f"HTTP {r.status_code}")
        retry_after: Any = body.get("retry_after")
        if retry_after is None and isinstance(body.get("parameters"), dict):
            retry_after = body["parameters"].get("retry_after")
        if retry_after is None:
            retry_after = r.headers.get("retry-after")
        try:
            retry = float(retry_after) if retry_after is not None else None
        except ValueError:
            retry = None
        raise _ApiError(r.status_code or 500, error, retry)

    async def _deliver(self, method: str, payload: dict[str, Any]) -> dict[str, Any]:
        try:
            return await self._call(method, payload)
        except _ApiError as e:
            raise _delivery_error(e) from None

    # ------------------------------------------------------------------ inbound

    async def _poll_loop(self) -> None:
        delay = BACKOFF_MIN  # connection / platform errors
        redeliver = BACKOFF_MIN  # the gateway did not take an update
        while True:
            offset = self._offset
            try:
                body = await self._call(
                    "getUpdates", {"offset": offset, "timeout": self._poll_timeout}, timeout=self._poll_timeout + 10.0
                )
            except _ApiError as e:
                if e.status in (401, 403):
                    self._report("error", f"fakechat refused the token: {e.error}")
                    return
                state: AccountState = "conflict" if e.status == 409 else "backoff"
                wait = max(delay, e.retry_after or 0.0)
                self._report(state, f"getUpdates: {e.error}; retrying in {wait:.1f} s")
                await asyncio.sleep(wait)
                delay = min(delay * 2, BACKOFF_MAX)
                continue
            self._sent_offset = max(self._sent_offset, offset)
            delay = BACKOFF_MIN
            if self._state != "running":
                self._report("running", None)
            updates = body.get("result")
            if not isinstance(updates, list) or not updates:
                continue
            if body.get("crash"):
                # The kill -9 test: the platform delivered, the ledger never heard of it.
                os.kill(os.getpid(), signal.SIGKILL)
            if await self._hand_over(updates):
                redeliver = BACKOFF_MIN
            else:
                await asyncio.sleep(redeliver)
                redeliver = min(redeliver * 2, BACKOFF_MAX)

    async def _hand_over(self, updates: list[Any]) -> bool:
        """Give a batch of updates to the gateway together (its ledger records them in one group
        commit), then move the offset over the acknowledged prefix, in order: an update that was not
        acknowledged is redelivered, and so is everything after it. False when one was not."""
        passed: set[int] = set()  # acknowledged by the gateway, or not a message at all
        handed: list[tuple[int, InboundMessage]] = []
        for update in updates:
            try:
                update_id = int(update["update_id"])
            except (TypeError, KeyError, ValueError):
                self._log.warning("fakechat: ignoring a malformed update %r", update)
                continue
            if update_id < self._offset:
                continue  # already acknowledged
            message = update.get("message")
            if not isinstance(message, dict):
                passed.add(update_id)  # not a message: nothing for the ledger
                continue
            handed.append((update_id, self._inbound(update, message, update_id, passed)))
        results = await asyncio.gather(*(self.context.on_message(m) for _, m in handed), return_exceptions=True)
        for (_, inbound), result in zip(handed, results, strict=True):
            if isinstance(result, asyncio.CancelledError):
                raise result
            if isinstance(result, BaseException):
                self._log.error(
                    "fakechat: on_message failed for %s (%s); it will be redelivered", inbound.message_id, result
                )
        ids = sorted(passed | {update_id for update_id, _ in handed})
        for update_id in ids:
            if update_id not in passed:
                self._log.warning("fakechat: update %d was not acknowledged; it will be redelivered", update_id)
                return False
            self._offset = max(self._offset, update_id + 1)
        return True

    def _inbound(self, update: dict[str, Any], m: dict[str, Any], update_id: int, passed: set[int]) -> InboundMessage:
        async def ack() -> None:
            passed.add(update_id)

        ts = m.get("ts")
        return InboundMessage(
            channel=CHANNEL,
            account=self.account.name,
            chat=str(m.get("chat")),
            chat_type="group" if m.get("chat_type") == "group" else "dm",
            sender=str(m.get("sender")),
            message_id=str(m.get("message_id") or f"m{update_id}"),
            text=str(m.get("text") or ""),
            thread=_opt_str(m.get("thread")),
            sender_name=_opt_str(m.get("sender_name")),
            mentions_bot=bool(m.get("mentions_bot")),
            reply_to=_opt_str(m.get("reply_to")),
            sender_is_bot=bool(m.get("sender_is_bot")),
            ts=float(ts) if isinstance(ts, int | float) else None,
            raw=update,
            ack=ack,
        )

    # ------------------------------------------------------------------ outbound

    async def send(self, target: Target, text: str) -> list[str]:
        body = await self._deliver(
            "sendMessage", {"chat": target.chat, "thread": target.thread, "reply_to": target.reply_to, "text": text}
        )
        result = body.get("result")
        if not isinstance(result, dict) or "message_id" not in result:
            raise DeliveryError("fakechat: sendMessage answered without a message_id")
        return [str(result["message_id"])]

    async def edit(self, target: Target, message_id: str, text: str) -> None:
        try:
            await self._call("editMessageText", {"chat": target.chat, "message_id": message_id, "text": text})
        except _ApiError as e:
            if "message is not modified" in e.error:
                return
            raise _delivery_error(e) from None

    async def react(self, target: Target, message_id: str, emoji: str) -> None:
        await self._deliver("setReaction", {"chat": target.chat, "message_id": message_id, "emoji": emoji})

    async def typing(self, target: Target) -> None:
        await self._deliver("sendChatAction", {"chat": target.chat, "thread": target.thread, "action": "typing"})

    def format(self, text: str) -> str:
        return text


def _delivery_error(e: _ApiError) -> DeliveryError:
    if e.status == 429:
        return DeliveryError(e.error, retry_after=e.retry_after if e.retry_after is not None else 1.0)
    if 400 <= e.status < 500:
        return DeliveryError(e.error, permanent=True)
    return DeliveryError(e.error)  # 5xx, network: retryable


def _opt_str(value: Any) -> str | None:
    return None if value is None else str(value)


def create_adapter(account: Account, context: AdapterContext) -> FakeChatAdapter:
    return FakeChatAdapter(account, context)
