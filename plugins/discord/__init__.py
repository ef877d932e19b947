"""The first-party `discord` channel: a Discord bot with the real discord.py (2.x) client, its gateway
WebSocket in and its REST API out. See docs/channels.md."""

from __future__ import annotations

from plugins.discord.adapter import MAX_LENGTH, DiscordAdapter, create_adapter, nonce_for
from plugins.discord.format import to_discord

__all__ = ["MAX_LENGTH", "DiscordAdapter", "create_adapter", "nonce_for", "to_discord"]
