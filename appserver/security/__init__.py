"""The guards in front of every HTTP request and WebSocket, one idea per module.

`SecurityGuard` (guard.py) is the one middleware `serve` mounts; it runs the checks of hostcheck.py,
origin.py, authentication.py and limits.py, answers refusals through refusals.py, and keeps a live
WebSocket under ws_session.py. edge.py polices connections and request heads before a request
exists.
"""

from appserver.security.guard import SecurityGuard
from appserver.security.ws_session import ClientGone

__all__ = ["ClientGone", "SecurityGuard"]
