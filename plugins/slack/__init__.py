"""The first-party `slack` channel: a Slack app in Socket Mode (no public URL), with the real
slack_sdk clients (`AsyncWebClient` for the Web API, the aiohttp `SocketModeClient` for events).
See docs/channels.md."""

from __future__ import annotations

from plugins.slack.adapter import MAX_LENGTH, SlackAdapter, create_adapter
from plugins.slack.format import escape, to_mrkdwn

__all__ = ["MAX_LENGTH", "SlackAdapter", "create_adapter", "escape", "to_mrkdwn"]
