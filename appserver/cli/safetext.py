"""Text from elsewhere (the model, tools, the server, other clients), made safe to print.

Printed raw, such text controls the reader's terminal: ESC and C1 sequences set the window title,
write the clipboard (OSC 52), clear or redraw the screen, recolour; a bare CR or a backspace draws
over what is already on the line. So every CLI line holding such text goes through `visible`: each
C0 control but newline and tab, DEL and each C1 control (U+0080-U+009F, the 8-bit CSI among them)
becomes its escape `\\xNN` (`\\x1b`, `\\x0d`, `\\x9b`; a bidi control `\\uNNNN`): readable, one
form everywhere, and no longer a control. Only what the client adds itself (its own dimming,
erase-line) stays a control.

`exact` is for what a person must read exactly as it is (a tool call's name and arguments at an
approval prompt, ids): newlines and tabs are escaped too, and every character that shows as nothing
or as a plain space, or makes text read in another order than it is: format characters (zero-width
space and joiners, word joiner, BOM, soft hyphen, the bidi overrides, embeddings, isolates and marks,
tags), line and paragraph separators, spaces other than U+0020, fillers. `alice` and `alice\\u200b`
(a zero-width space after it) are two senders; printed raw they were one name. A text not in NFC
shows its marks (and the few other characters NFC changes) escaped: `jose\\u0301` is not `josé`,
which prints as it is (`appserver.client.hidden`).

`exact_id` is for an id a person may type back (`appserver pairing revoke SENDER`): `exact` with each
backslash doubled, so the shown form names one id, which `typed_id` reads back.
"""

from __future__ import annotations

import re
import unicodedata

from appserver.client.hidden import escape as _escape
from appserver.client.hidden import hidden as _hidden
from appserver.client.hidden import shown as _shown

# C0 controls but \t and \n, DEL, C1: what a terminal acts on instead of showing.
_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")  # and lone surrogates: not printable
_TYPED_ESCAPE = re.compile(r"\\(\\|x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8})")


def _escaped(match: re.Match[str]) -> str:
    return _escape(match.group())


def visible(value: object) -> str:
    """`value` as text that cannot act on a terminal: controls shown as escapes, newlines and tabs
    kept (so a reply keeps its lines). A CRLF line end is a line end, not a control."""
    return _CONTROLS.sub(_escaped, str(value).replace("\r\n", "\n"))


def exact(value: object) -> str:
    """`value` as one line to be read exactly: every control, newline, tab, bidi control, invisible
    character and unusual space shown as an escape, so nothing can hide, reorder or move what is
    around it, and two different values never print the same (but for a backslash: `exact_id`;
    `jose\\u0301`, not in NFC, is not shown as the NFC `josé`)."""
    return _shown(str(value))


def exact_id(value: str) -> str:
    """An id as `exact` shows it, each backslash doubled: an id holding the six characters
    `\\u200b` prints as `\\\\u200b`, one holding a zero-width space as `\\u200b`, and `typed_id`
    reads either back to its id."""
    return exact(value.replace("\\", "\\\\"))


def typed_id(text: str) -> str:
    """The id `exact_id` showed as `text`: `\\\\` is a backslash, `\\xNN`, `\\uNNNN` and `\\UNNNNNNNN`
    the character; any other backslash stays as it is (an id typed as it is, with no escape)."""

    def char(match: re.Match[str]) -> str:
        escape = match.group(1)
        if escape == "\\":
            return "\\"
        code = int(escape[1:], 16)
        return chr(code) if code <= 0x10FFFF else match.group()  # beyond Unicode: not an escape

    return _TYPED_ESCAPE.sub(char, text)


def unseen(value: str) -> str:
    """`value` as a reader sees it printed raw: hidden characters gone, every space a plain one,
    in NFC (`jose\\u0301` and `josé` print the same). Two ids with the same `unseen` differ
    only by what nobody can see (look-alikes)."""
    seen = "".join(" " if unicodedata.category(c) == "Zs" else "" if _hidden(c) else c for c in value)
    return unicodedata.normalize("NFC", seen)


def json_text(text: str) -> str:
    """JSON text (as `json.dumps(ensure_ascii=False)` writes it) with DEL and the C1 controls as
    `\\u` escapes: the same JSON value, but no raw 8-bit CSI on a terminal. (JSON already escapes
    the C0 controls; these can only occur inside strings, where `\\u00XX` is the same character.)"""
    # and a lone surrogate (a damaged stored text): valid as a JSON escape, unprintable as it is
    return re.sub("[\x7f-\x9f\ud800-\udfff]", lambda m: f"\\u{ord(m.group()):04x}", text)
