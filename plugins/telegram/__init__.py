"""The first-party `telegram` channel: a Telegram bot through python-telegram-bot, long polling with
ledger-first acknowledgement, replies as Telegram HTML that grow by edits, approvals as inline buttons.
See docs/channels.md."""

from __future__ import annotations

from plugins.telegram.adapter import TelegramAdapter, create_adapter
from plugins.telegram.format import plain, to_html

__all__ = ["TelegramAdapter", "create_adapter", "plain", "to_html"]
