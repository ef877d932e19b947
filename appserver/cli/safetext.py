"""Text from elsewhere (the model, tools, the server, other clients), made safe to print.

Printed raw, such text controls the reader's terminal: ESC and C1 sequences set the window title,
write the clipboard (OSC 52), clear or redraw the screen, recolour; a bare CR or a backspace draws
over what is already on the line. So every CLI line holding such text goes through `visible`: each
C0 control but newline and tab, DEL and each C1 control (U+0080-U+009F, the 8-bit CSI among them)
becomes its escape `\\xNN` (`\\x1b`, `\\x0d`, `\\x9b`; a bidi control `\\uNNNN`): readable, one
form everywhere, and no longer a control. Only what the client adds itself (its own dimming,
erase-line) stays a control.

`exact` is for what a person must read exactly as it is (a tool call's name and arguments at an
approval prompt, ids): newlines and tabs are escaped too, and the Unicode bidi controls that can
make text read in another order than it is (overrides, embeddings, isolates, marks).
"""

from __future__ import annotations

import re

# C0 controls but \t and \n, DEL, C1: what a terminal acts on instead of showing.
_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")  # and lone surrogates: not printable
# The same and \t, \n, and the bidi formatting characters (ALM, LRM, RLM, LRE…RLO, LRI…PDI).
_EXACT = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def _escaped(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def visible(value: object) -> str:
    """`value` as text that cannot act on a terminal: controls shown as escapes, newlines and tabs
    kept (so a reply keeps its lines). A CRLF line end is a line end, not a control."""
    return _CONTROLS.sub(_escaped, str(value).replace("\r\n", "\n"))


def exact(value: object) -> str:
    """`value` as one line to be read exactly: every control, newline, tab and bidi control shown
    as an escape, so nothing can hide, reorder or move what is around it."""
    return _EXACT.sub(_escaped, str(value))


def json_text(text: str) -> str:
    """JSON text (as `json.dumps(ensure_ascii=False)` writes it) with DEL and the C1 controls as
    `\\u` escapes: the same JSON value, but no raw 8-bit CSI on a terminal. (JSON already escapes
    the C0 controls; these can only occur inside strings, where `\\u00XX` is the same character.)"""
    # and a lone surrogate (a damaged stored text): valid as a JSON escape, unprintable as it is
    return re.sub("[\x7f-\x9f\ud800-\udfff]", lambda m: f"\\u{ord(m.group()):04x}", text)
