"""The webhook signature scheme, shared by inbound verification, outbound signing, tests and docs.

`X-Webhook-Timestamp: <unix seconds>` and
`X-Webhook-Signature: sha256=<hex HMAC-SHA256(secret, f"{timestamp}." + raw body)>`.
"""

from __future__ import annotations

import hashlib
import hmac

TIMESTAMP_HEADER = "X-Webhook-Timestamp"
SIGNATURE_HEADER = "X-Webhook-Signature"
PREFIX = "sha256="


def sign(secret: str, timestamp: str, body: bytes) -> str:
    """The `X-Webhook-Signature` value for `body` sent at `timestamp`: `sha256=<hex>`."""
    mac = hmac.new(secret.encode("utf-8"), f"{timestamp}.".encode() + body, hashlib.sha256)
    return PREFIX + mac.hexdigest()


def verify(secret: str, timestamp: str, body: bytes, signature: str) -> bool:
    """Whether `signature` is the one `sign` gives, compared in constant time."""
    return hmac.compare_digest(sign(secret, timestamp, body).encode(), signature.strip().encode("utf-8", "replace"))
