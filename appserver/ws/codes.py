"""The protocol's version and close codes: plain numbers, importable without the pydantic frame
models of `ws/frames.py` (which re-exports them), so a module that only closes a socket does not
load pydantic when `serve` starts."""

from __future__ import annotations

PROTOCOL_VERSION = 1

# Close codes (4000-4999 are application codes)
CLOSE_AUTH = 4401
CLOSE_PROTOCOL = 4406
CLOSE_SLOW_CONSUMER = 4408
CLOSE_TOO_MANY = 4429  # `hello` named a credential whose connection slots are all taken
CLOSE_TOO_BIG = 1009
CLOSE_TRY_AGAIN = 1013  # `hello` could not be checked now (the token store's database did not answer)
