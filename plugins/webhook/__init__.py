"""The first-party `webhook` channel: signed JSON `POST`s in, signed JSON `POST`s out, for anyone
without a chat platform (n8n, Home Assistant, a custom app). See docs/channels.md."""

from __future__ import annotations

from plugins.webhook.adapter import WebhookAdapter, WebhookSettings, create_adapter
from plugins.webhook.signing import SIGNATURE_HEADER, TIMESTAMP_HEADER, sign, verify

__all__ = [
    "SIGNATURE_HEADER",
    "TIMESTAMP_HEADER",
    "WebhookAdapter",
    "WebhookSettings",
    "create_adapter",
    "sign",
    "verify",
]
