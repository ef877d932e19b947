"""Image URLs a front end may pass to a model: `https:`/`http:` (the provider fetches them, as
OpenAI's API does) or a `data:image/…;base64,…` URL whose base64 is valid. Anything else (`file:`,
a relative path, broken base64) is refused where it arrives, in words, instead of failing later
at the upstream as a turn error, or being fetched from somewhere it should not."""

from __future__ import annotations

import binascii

IMAGE_URL_SCHEMES = ("https:", "http:", "data:image/")


def image_url_problem(url: str) -> str | None:
    """Why `url` cannot be passed on as an image, or None when it can."""
    head = url[:16].lower()
    if head.startswith(("https:", "http:")):
        return None
    if not head.startswith("data:image/"):
        spaced = " (without the space before it)" if url[:1].isspace() else ""
        return f"an image URL must start with https:, http: or data:image/{spaced}"
    header, comma, payload = url.partition(",")
    if not comma or not header.lower().endswith(";base64"):
        return "a data: image URL must be base64: data:image/<type>;base64,<data>"
    if not payload:
        return "the data: image URL holds no data"
    try:
        binascii.a2b_base64(payload, strict_mode=True)
    except (binascii.Error, ValueError):
        return "the data: image URL's base64 is not valid"
    return None
