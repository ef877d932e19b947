"""`appserver chat`: a terminal client of the /ws protocol of the server running on this home.

What a person sees, and why it is built this way:
* The reply grows in place. Reasoning is hidden unless `--show-reasoning`, and then labelled and
  dimmed, never like reply text. Tool calls are one compact line each.
* The terminal is in cbreak mode (no kernel echo) so this client alone decides what is on screen:
  keys typed while a reply streams are kept, not echoed into it, and shown at the next prompt; a
  whole line typed meanwhile is sent after the turn (as the server would queue it).
* `approve? [y/N]` waits for the answer *and* for the conversation: it disappears as soon as another
  client answers (`approval_resolved`). Ctrl-C cancels the running turn at once, at that prompt
  too, without answering the approval; a second Ctrl-C exits.
* `/help`, `/new`, `/cancel`, `/quit` are commands of this client, never sent to the model
  (`//text` sends `/text`). `/cancel` and Ctrl-C cancel the turn on screen by its id: at an idle
  prompt there is none, and nothing is sent (a cancel naming no turn would stop another client's).
* A paste (bracketed paste) is one input however many lines it holds, sent by the Enter after it,
  never a command. A prompt and the line typed after it are erased and drawn again whole when they
  wrap over several rows of the terminal.
* A server stop or failover to a standby is ridden out: the protocol client reconnects, resubscribes
  and resumes the turn on screen (see appserver/client/connection.py). Started while the home's
  server stops, chat waits for it to exit and goes to the server that replaced it (run.connect_first).
* A line is sent without stalling the session: while its ack is outstanding (a stalled server, a
  network that keeps the connection open but carries nothing), SIGTERM/SIGHUP, Ctrl-C and `/quit`
  act at once and lines typed meanwhile wait their turn behind it (`/new` too, which Ctrl-C calls
  off: chat stays in its conversation). A line the server does not
  confirm within `SUBMIT_TIMEOUT` is said to be unconfirmed (it may or may not have been taken; it
  is not sent again), like a refused line, and the session goes on.
* Nothing from elsewhere (the model, tools, the server, other clients) controls the terminal: its
  controls are shown as escapes (appserver/cli/safetext.py); a tool call at an approval prompt is
  shown exactly, bidi controls included. Only this client's own styling is sent as escapes.
"""

from __future__ import annotations

import asyncio
import codecs
import os
import re
import signal
import sys
import termios
import threading
import time
import unicodedata
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import click

from appserver.cli.common import (
    cancel_until_done,
    exit_stdout_closed,
    fail,
    get_config,
    not_utf8,
    shown_raw,
    stdout_closed,
)
from appserver.cli.run import (
    START_WAIT_S,
    USAGE_ERRORS,
    WORK_STOP_POLL_S,
    WORK_STOP_WAIT_S,
    HomeServer,
    Interrupted,
    ServerGone,
    connect_first,
    reconnect_wait_option,
    server_url_source,
    signal_name,
    signals_as_at_start,
    signals_end_the_wait,
    tell_starting,
    token_hint,
    until_signal,
)
from appserver.cli.safetext import exact, visible
from appserver.client import TERMINAL, ConnectError, ProtocolClient, ProtocolError, check_url, shown_url
from appserver.serverinfo import HomeStarting, find_live_server

DIM, RESET = "\x1b[2m", "\x1b[0m"
ERASE_LINE = "\r\x1b[K"
PROMPT = "you> "
COMMANDS = (
    ("/help", "show this help"),
    ("/new", "start a new conversation"),
    ("/cancel", "cancel the running turn (or Ctrl-C)"),
    ("/quit", "leave (or Ctrl-D)"),
)
TRAILING_SGR = re.compile(r"(\x1b\[[0-9;]*m)+$")
SGR = re.compile(r"\x1b\[[0-9;]*m")
PASTE_ON, PASTE_OFF = "\x1b[?2004h", "\x1b[?2004l"  # bracketed paste: a paste arrives between the two marks below
PASTE_START, PASTE_END = "\x1b[200~", "\x1b[201~"
# Marks `LineEditor.add` puts between reads for `take`, in order with the keys. Lone surrogates the
# UTF-8 decoder never yields (its surrogateescape gives only U+DC80-U+DCFF), so never a key.
_ESC_TIMED_OUT = "\ud800"  # the read before ended in ESC, and this one came too late to continue it
_QUIET = "\ud801"  # this read came `PASTE_QUIET` seconds or more after the one before it
# Runs of keys `LineEditor.take` applies at once (one write to echo them, not one per character):
# inside a paste, everything up to the next ESC or read mark; typed, text up to the next control.
_PASTE_RUN = re.compile(f"[^\x1b{_ESC_TIMED_OUT}{_QUIET}]+")
_PASTE_DROPPED = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # controls of a paste (not tab, nor LF)
_TYPED_RUN = re.compile(f"[^\x00-\x08\x0a-\x1f\x7f-\x9f{_ESC_TIMED_OUT}{_QUIET}]+")
SUBMIT_TIMEOUT = 30.0  # seconds a line waits for the server's ack before it is reported unconfirmed
CLOSE_WAIT = 1.0  # seconds the connection's closing handshake may take when chat leaves
STOP_GRACE = 0.5  # seconds a session has to end after SIGTERM/SIGHUP before its wait is cancelled
TAKEOVER_WAIT_S = 2.0  # seconds chat looks for a server taking over one that stopped (a standby checks every second)

Events = asyncio.Queue[tuple[str, Any]]


class Keys:
    """Key bytes from stdin on a daemon thread (a blocked read never keeps the process alive).

    On a terminal, cbreak mode: no kernel echo and no line buffering, so nothing typed lands in the
    middle of a reply; ISIG stays on, so Ctrl-C still arrives at once as SIGINT. Bracketed paste is
    on meanwhile (a paste comes marked, `LineEditor`), and off again with the modes (`restore`)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, events: Events, cbreak: bool) -> None:
        self.fd = sys.stdin.fileno()
        self.tty = cbreak and os.isatty(self.fd)  # we echo to stdout, so only when it is the terminal too
        self.saved: list[Any] | None = None
        if self.tty:
            self.saved = termios.tcgetattr(self.fd)
            mode = termios.tcgetattr(self.fd)
            mode[3] &= ~(termios.ECHO | termios.ICANON)
            mode[6][termios.VMIN] = 1
            mode[6][termios.VTIME] = 0
            termios.tcsetattr(self.fd, termios.TCSADRAIN, mode)
            os.write(sys.stdout.fileno(), PASTE_ON.encode())
        self.loop, self.events = loop, events
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                data = os.read(self.fd, 1024)
            except OSError:
                data = b""
            try:
                self.loop.call_soon_threadsafe(self.events.put_nowait, ("keys", (data, time.monotonic())))
            except RuntimeError:  # the loop is gone: we are exiting
                return
            if not data:
                return

    def restore(self) -> None:
        """The terminal as it was: its modes, and no bracketed paste (a shell left with it on would
        get the marks of the next paste as typed text)."""
        if self.saved is not None:
            saved, self.saved = self.saved, None
            try:
                os.write(sys.stdout.fileno(), PASTE_OFF.encode())
            finally:
                termios.tcsetattr(self.fd, termios.TCSADRAIN, saved)


class Screen:
    """stdout, knowing whether the cursor is at the start of a line."""

    def __init__(self, color: bool, ansi: bool) -> None:
        self.color, self.ansi = color, ansi
        self.col0 = True

    def write(self, text: str) -> None:
        if text:
            sys.stdout.write(text)
            sys.stdout.flush()
            self.col0 = TRAILING_SGR.sub("", text).endswith("\n")

    def fresh_line(self) -> None:
        if not self.col0:
            self.write("\n")

    def line(self, text: str) -> None:
        self.fresh_line()
        self.write(text + "\n")

    def dim(self, text: str) -> str:
        return f"{DIM}{text}{RESET}" if self.color and text else text

    def columns(self) -> int:
        """The terminal's width now (0: not known). Asked at each use rather than kept, so a resized
        terminal is followed without a SIGWINCH handler."""
        if not self.ansi:
            return 0
        try:
            return os.get_terminal_size(sys.stdout.fileno()).columns
        except (OSError, ValueError):
            return 0

    def erase_line(self, shown: str = "") -> None:
        """Remove the line being typed (a prompt) so a notice or the next prompt replaces it.
        `shown`: what that line holds (the prompt and the keys echoed), written from the start of
        a row: the terminal may have wrapped it over several rows, all of which go."""
        if self.ansi:
            row, _ = cursor_after(shown, self.columns())
            self.write(f"\r\x1b[{row}A\x1b[J" if row else ERASE_LINE)
            self.col0 = True
        else:
            self.fresh_line()


def is_text(ch: str) -> bool:
    """Whether a character typed (or piped) is text to send, not a key for the editor: everything
    but the C0 controls (tab is text), DEL and the C1 controls. Invisible characters are text:
    ZWNJ and ZWJ (Persian words, emoji sequences), no-break and other spaces, bidi marks,
    combining marks, private use: what is typed is sent exactly."""
    return ch == "\t" or not ("\x00" <= ch <= "\x1f" or "\x7f" <= ch <= "\x9f")


def cell_width(ch: str) -> int:
    """Columns a terminal gives `ch` as echoed (an estimate: what Backspace must rub out)."""
    if ch == "\t":
        return 1  # echoed as one space
    if unicodedata.category(ch) in ("Mn", "Me", "Cf"):
        return 0
    return 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1


def cursor_after(text: str, columns: int) -> tuple[int, int]:
    """Where the cursor is (row, column) once `text` is written from the start of a row of a
    terminal `columns` wide (0: not known, nothing wraps). A column equal to the width is the end
    of a full row, where the terminal waits to wrap until the next character; a wide character
    that does not fit goes to the next row whole. Our styling (SGR) takes no room."""
    row = col = 0
    text = SGR.sub("", text)
    at, end = 0, len(text)
    while at < end:
        plain = _PLAIN_RUN.match(text, at)
        if plain is not None:  # printable ASCII, a column each: counted, not walked (a paste can be megabytes)
            run, at = plain.end() - at, plain.end()
            room = max(0, columns - col)
            if columns <= 0 or run <= room:
                col += run
            else:
                row, col = row + 1 + (run - room - 1) // columns, (run - room - 1) % columns + 1
            continue
        ch = text[at]
        at += 1
        if ch == "\n":
            row, col = row + 1, 0
            continue
        width = cell_width(ch)
        if columns > 0 and col + width > columns:
            row, col = row + 1, 0
        col += width
    return row, col


_PLAIN_RUN = re.compile("[ -~]+")


class LineEditor:
    """The line being typed. Text keys, Backspace, Ctrl-U, Ctrl-W, Enter, Ctrl-D; escape
    sequences (arrows, function keys) are swallowed, other controls dropped (`is_text`). Keys are
    echoed only while `visible` (a prompt is on screen) and stdin is a terminal (`echo`); otherwise
    they are kept silently for the next prompt.

    At a terminal, CR is Enter and Ctrl-D on an empty line leaves. From a pipe (no `echo`) a line
    ends at LF (or CRLF): a CR inside a line is part of its text, and only the end of the input
    ends it (a Ctrl-D byte there is no key: it is dropped like the other controls). A NUL byte
    from a pipe is kept in its line, and bytes that are not UTF-8 are kept as what Python calls
    them (lone surrogates, shown as U+FFFD when echoed): such a line is refused whole
    (`unsendable`), never sent with its bytes dropped or replaced.

    An escape sequence is ESC and one character (Alt-x), `ESC O` and one character (SS3), or
    `ESC [`, parameter and intermediate bytes and a final byte (CSI). It is abandoned at the first
    character that cannot be part of it (a control such as LF, CR or ESC, DEL, anything non-ASCII,
    and in a CSI anything outside 0x20-0x7E), which is then taken as itself: a LF still ends the
    line, so a stray ESC never merges lines nor eats the next one. At a terminal an ESC that ends
    a read is the Escape key alone (dropped), unless the next read comes within `ESC_WAIT` seconds
    and begins with `[` or `O` (an arrow key split across reads); but while a paste is open an ESC
    is never the Escape key (the rest of its end marker comes however late), and an Escape key
    followed, however late, by the rest of `PASTE_START` was the start of a paste (nobody types
    `[200~` after Escape): a marker split across reads on a slow link is still the marker.

    A paste at a terminal (bracketed paste: between `PASTE_START` and `PASTE_END`) is text of the
    line: its line ends (CR, LF, CRLF) stay in the line as newlines and its controls are dropped,
    so a paste of several lines is one input, sent by the Enter after it. A line holding pasted
    text is taken as `("pasted", text)`: input for the model, never a chat command. Ctrl-C
    (`discard`) drops the rest of a paste still arriving, up to its end marker.

    Echoed, the line may wrap over several rows of the terminal (or hold pasted newlines): keys
    that remove text then draw again what follows the last newline left in it (with `prompt`,
    what precedes the line on screen, when there is none), as `\\b` does not go back to the row
    above; the rows above that newline do not change."""

    ESC_WAIT = 0.05
    # A paste dropped at Ctrl-C whose end marker has not come after this many seconds without
    # input: the terminal dropped it (a kernel flushes unread input at Ctrl-C), so what comes next
    # is typed. A terminal writes a paste at once: such a pause is a person, not the paste.
    PASTE_QUIET = 1.0

    def __init__(self, screen: Screen, echo: bool) -> None:
        self.screen, self.echo = screen, echo
        self.buf: list[str] = []
        self.visible = False
        self._decoder = codecs.getincrementaldecoder("utf-8")("surrogateescape")
        self._pending = ""
        self._at = 0  # where `take` is in `_pending` (consumed by index: a paste can be megabytes)
        self._esc = ""
        self._esc_read_at: float | None = None  # when a read that ended in ESC came (a terminal)
        self._esc_alone = False  # `_esc` began with an ESC whose wait timed out: the paste start, or the Escape key
        self._read_at: float | None = None  # when the last read came (a terminal)
        self._last = ""
        self.prompt = ""  # the prompt the typed keys follow on screen (set as it is drawn)
        self._paste = False  # between the marks of a paste
        self._pasted = False  # the line holds pasted text
        self._drop = False  # the open paste is dropped up to its end (Ctrl-C)
        self._ended = False  # the input ended: "eof" once what is pending is taken
        self._eof_said = False

    def add(self, data: bytes, read_at: float | None = None) -> None:
        """Keys of one read (`read_at`: when it was read, by `time.monotonic()`)."""
        text = self._decoder.decode(data)
        if self.echo:
            now = time.monotonic() if read_at is None else read_at
            if self._read_at is not None and now - self._read_at >= self.PASTE_QUIET:
                text = _QUIET + text
            if self._esc_read_at is not None and (
                now - self._esc_read_at > self.ESC_WAIT or not text.startswith(("[", "O"))
            ):
                text = _ESC_TIMED_OUT + text  # the last read's ESC may be the Escape key alone (`take`)
            self._esc_read_at = now if text.endswith("\x1b") else None
            self._read_at = now
        self._queue(text)

    def end(self) -> None:
        """The input ended: an unfinished last line still counts (`take`), then end-of-file."""
        self._queue(self._decoder.decode(b"", final=True))
        self._ended = True

    def _queue(self, text: str) -> None:
        """Keys after those pending (what `take` applied already is let go)."""
        self._pending, self._at = self._pending[self._at :] + text, 0

    @property
    def text(self) -> str:
        return "".join(self.buf)

    @property
    def display(self) -> str:
        """The line as echoed (a tab as one space, so Backspace rubs out what it shows)."""
        return _echoed(self.text.replace("\t", " "))

    @property
    def shown(self) -> str:
        """What the prompt's rows hold on screen: the prompt and the keys echoed after it (nothing
        while no prompt is shown)."""
        if not self.visible:
            return ""
        return self.prompt + (self.display if self.echo else "")

    def set_aside(self) -> tuple[str, bool]:
        """Take the line typed so far off the editor (an approval prompt asks meanwhile): its text,
        and whether it holds pasted text (`put_back`)."""
        kept = (self.text, self._pasted)
        self.buf, self._pasted = [], False
        return kept

    def put_back(self, kept: tuple[str, bool]) -> None:
        self.buf, self._pasted = list(kept[0]), kept[1]

    @property
    def pasting(self) -> bool:
        """A paste is arriving (Ctrl-C drops it, rather than leave at an empty prompt): open, and
        not one already dropped whose end marker is overdue (`PASTE_QUIET`)."""
        if not self._paste:
            return False
        quiet = self._read_at is not None and time.monotonic() - self._read_at >= self.PASTE_QUIET
        return not (self._drop and quiet)

    def discard(self) -> None:
        """Drop the line being typed (Ctrl-C), and the rest of a paste still arriving up to its end
        marker: its lines were never typed, so they never run as lines or commands."""
        self.buf, self._pasted = [], False
        self._drop = self._paste

    def _line(self) -> tuple[str, str]:
        line, pasted = self.text, self._pasted
        self.buf, self._pasted = [], False
        self._show("\n")
        return ("pasted" if pasted else "line", line)

    def take(self) -> tuple[str, str] | None:
        """Apply pending keys up to the next finished line (`("line", text)`, `("pasted", text)`
        when it holds pasted text) or `("eof", "")`."""
        while self._at < len(self._pending):
            if not self._esc and self._take_run():
                continue
            ch = self._pending[self._at]
            self._at += 1
            if ch == _ESC_TIMED_OUT:
                # an ESC alone ending the read before, too long ago: the Escape key, unless a paste
                # is open (the rest of its end marker is still to come) or the paste start follows
                self._esc_alone = self._esc == "\x1b" and not self._paste
                continue
            if ch == _QUIET:
                if self._drop:  # the dropped paste's end marker was lost: what comes now is typed
                    self._paste = self._drop = self._esc_alone = False
                    self._esc = ""
                continue
            last, self._last = self._last, ch
            if self._esc:
                if self._esc_alone and not PASTE_START.startswith(self._esc + ch):
                    # it was the Escape key: what followed it is typed (this character too)
                    self._pending, self._at = self._esc[1:] + ch + self._pending[self._at :], 0
                    self._esc, self._esc_alone, self._last = "", False, last
                    continue
                if not " " <= ch <= "~":
                    self._esc = ""  # abandoned: this character is taken as itself, below
                else:
                    self._esc += ch
                    if len(self._esc) == 2 and ch in "[O":
                        continue  # CSI or SS3: more follows
                    if self._esc[1] == "[" and ch < "@":
                        continue  # a CSI's parameter or intermediate byte
                    if self.echo and self._esc == PASTE_START:
                        self._paste = True
                    elif self.echo and self._esc == PASTE_END:
                        self._paste = self._drop = False
                    self._esc, self._esc_alone = "", False  # its last character
                    continue
            if ch == "\x1b":
                self._esc = ch
            elif self._paste and self._drop:
                continue  # the rest of a paste dropped at Ctrl-C
            elif self._paste:
                self._pasted = True
                if ch == "\n" and last == "\r":
                    continue  # a CRLF: one newline
                if ch in "\r\n" or is_text(ch):
                    text = "\n" if ch == "\r" else ch
                    self.buf.append(text)
                    self._show(" " if ch == "\t" else text)
            elif ch == "\n" or (ch == "\r" and self.echo):
                if ch == "\n" and last == "\r":
                    if self.echo:
                        continue  # CRLF: one Enter
                    if self.buf and self.buf[-1] == "\r":
                        self.buf.pop()  # a CRLF line end
                return self._line()
            elif ch == "\x04" and self.echo:
                if not self.buf:
                    return ("eof", "")
            elif ch in "\x7f\x08":
                if self.buf:
                    self._rub_last()
            elif ch == "\x15":
                self._rub(len(self.buf))
            elif ch == "\x17":
                n = len(self.buf)
                while n and self.buf[n - 1] in " \t":
                    n -= 1
                while n and self.buf[n - 1] not in " \t":
                    n -= 1
                self._rub(len(self.buf) - n)
            elif ch == "\x00" and not self.echo:  # from a pipe: kept, so the line is refused, not changed
                self.buf.append(ch)
            elif ch == "\r" or is_text(ch):  # (a CR here is from a pipe: text, unless LF follows)
                self.buf.append(ch)
                self._show(" " if ch == "\t" else ch)
        self._pending, self._at = "", 0
        if self._ended and not self._eof_said:
            self._esc, self._esc_alone = "", False
            if self.buf:  # an unfinished last line (a CR at its end is text: no LF follows it)
                return self._line()
            self._eof_said = True
            return ("eof", "")
        return None

    def _take_run(self) -> bool:
        """Apply the run of keys at `_at` that `take` would apply one by one to the same effect, if
        one is there (no escape sequence open): a paste's text up to its next ESC, or typed text up
        to the next control, echoed with one write (a write and a flush per character made a
        megabyte's paste take 15 s)."""
        run = (_PASTE_RUN if self._paste else _TYPED_RUN).match(self._pending, self._at)
        if run is None:
            return False
        self._at = run.end()
        text, last = run.group(), self._last
        self._last = text[-1]
        if not self._paste:  # typed: text only (a CR from a pipe, NUL, line ends go one by one)
            self.buf.extend(text)
            self._show(text.replace("\t", " "))
        elif not self._drop:  # (the rest of a paste dropped at Ctrl-C: nothing)
            self._pasted = True
            self._take_pasted(text[1:] if last == "\r" and text[0] == "\n" else text)
        return True

    def _take_pasted(self, text: str) -> None:
        """Pasted text: its line ends (CR, LF, CRLF) as newlines, its controls dropped (tab kept)."""
        text = _PASTE_DROPPED.sub("", text.replace("\r\n", "\n").replace("\r", "\n"))
        self.buf.extend(text)
        self._show(text.replace("\t", " "))

    def _rub(self, count: int) -> None:
        """Remove the last `count` characters, and what they took on screen."""
        if count <= 0:
            return
        before = self.shown
        removed, self.buf = self.buf[-count:], self.buf[:-count]
        self._pasted = self._pasted and bool(self.buf)  # all rubbed out: what is typed next is typed
        before = self._last_line(before)
        widths = [cell_width(c) for c in removed]
        if not self._one_row(before) or not all(widths):  # (a zero-width one changed the cell before it)
            self._redraw(before)
            return
        width = sum(widths)
        self._show("\b" * width + " " * width + "\b" * width)

    def _last_line(self, before: str) -> str:
        """What `before` (the rows shown before keys removed text) holds from the start of the line
        the text now ends in: the prompt's row, or the row after the last newline still typed
        (pasted). Rows above it are unchanged, and are neither measured nor drawn again: a
        Backspace after a megabyte's paste of many lines draws its last line, not the megabyte."""
        if not (self.visible and self.echo):
            return ""
        return before[self.shown.rfind("\n") + 1 :]

    def _one_row(self, shown: str) -> bool:
        """Whether `shown` (the prompt and the keys echoed) is on one row with the cursor inside
        it, where `\\b` can rub out the end of it (at the end of a full row terminals differ)."""
        columns = self.screen.columns()
        row, col = cursor_after(shown, columns)
        return row == 0 and (columns == 0 or col < columns)

    def _redraw(self, before: str) -> None:
        """Draw the line's end again over `before`, what its rows held from the start of the line
        the text now ends in (`_last_line`)."""
        if self.visible and self.echo:
            shown = self.shown
            self.screen.erase_line(before)
            self.screen.write(shown[shown.rfind("\n") + 1 :])

    def _rub_last(self) -> None:
        """Backspace: one character. A zero-width one (a combining mark, ZWJ) changed the cell
        before it: that cell is drawn again without it."""
        before = self.shown
        ch = self.buf.pop()
        self._pasted = self._pasted and bool(self.buf)
        before = self._last_line(before)
        if not self._one_row(before):
            self._redraw(before)
            return
        if cell_width(ch):
            self._show("\b" * cell_width(ch) + " " * cell_width(ch) + "\b" * cell_width(ch))
            return
        start = len(self.buf)
        while start and not cell_width(self.buf[start - 1]):
            start -= 1
        if not start or self.buf[start - 1] == "\n":  # it was on the prompt's last cell, or first on its row
            self._redraw(before)
            return
        width = cell_width(self.buf[start - 1])
        cell = "".join(self.buf[start - 1 :]).replace("\t", " ")
        self._show("\b" * width + " " * width + "\b" * width + cell)

    def _show(self, text: str) -> None:
        if self.visible and self.echo:
            self.screen.write(_echoed(text))


_NOT_UTF8 = re.compile("[\udc80-\udcff]")  # a byte the UTF-8 decoder could not read (surrogateescape)


def _echoed(text: str) -> str:
    """Text typed as the terminal shows it: a byte that is not UTF-8 as U+FFFD (the line is
    refused at Enter; written as it is, the surrogate would end the session)."""
    return _NOT_UTF8.sub("\ufffd", text)


def typed(text: str) -> str:
    """A line read from a pipe, shown after its prompt: controls as escapes (`visible`), and a
    byte that is not UTF-8 as the byte it is (`\\xff`), as the error refusing the line shows it."""
    return visible(_NOT_UTF8.sub(lambda m: f"\\x{ord(m.group()) - 0xDC00:02x}", text))


def unsendable(text: str) -> str | None:
    """Why a line read from the input cannot be sent as it is, else None: bytes that are not UTF-8
    (text is sent exactly; replaced, it would be another text) or a NUL byte (which a PostgreSQL
    store cannot keep, and which a terminal could not have typed into a line)."""
    problems = [p for p, bad in (("is not valid UTF-8", not_utf8(text)), ("holds a NUL byte", "\x00" in text)) if bad]
    return " and ".join(problems) or None


class Renderer:
    """Turns successive whole snapshots of one turn into terminal output (only what is new)."""

    def __init__(self, screen: Screen, show_reasoning: bool) -> None:
        self.screen, self.show_reasoning = screen, show_reasoning
        # What is on screen of each text or reasoning block, by (kind, its number among the blocks
        # of that kind): a turn rebuilt from the store after a restart has no reasoning blocks
        # before its text, so a block's index alone could name another block.
        self.shown: dict[tuple[str, int], str] = {}
        self.tool_status: dict[str, str] = {}
        self.kind: str | None = None
        # Called once before a snapshot's first output: an open approval prompt is taken off its
        # line first (`Chat.render`), so what the snapshot says goes above it, not after it.
        self.before_output: Callable[[], None] | None = None

    def _output(self) -> None:
        if self.before_output is not None:
            clear, self.before_output = self.before_output, None
            clear()

    def snapshot(self, snap: dict[str, Any]) -> None:
        s = self.screen
        blocks = snap.get("blocks") or []
        ordinal: dict[str, int] = {}
        for i, block in enumerate(blocks):
            kind = block.get("type")
            if kind in ("text", "reasoning"):
                key = (kind, ordinal.setdefault(kind, 0))
                ordinal[kind] += 1
                if kind == "reasoning" and not self.show_reasoning:
                    continue
                text = block.get("text") or ""
                shown = self.shown.get(key)
                if shown and not text.startswith(shown):
                    shown = self.cut(kind, shown, text)
                    self.shown[key] = shown
                done = len(shown or "")
                if len(text) <= done:
                    continue
                new = text[done:]
                if new.endswith("\r") and i == len(blocks) - 1 and snap.get("status") not in TERMINAL:
                    new = new[:-1]  # perhaps half a CRLF (a line end): decided with the next snapshot
                    if not new:
                        continue
                self._output()
                if self.kind != kind or not shown:
                    s.fresh_line()
                    if kind == "reasoning":
                        s.write(s.dim("thinking: "))
                if kind == "reasoning":  # labelled, indented and dimmed: never like reply text
                    s.write(s.dim(visible(new).replace("\n", "\n  ")))
                else:
                    s.write(visible(new))
                self.shown[key] = text[: done + len(new)]
                self.kind = kind
            elif kind == "tool_call":
                status = block.get("status") or ""
                call = str(block.get("call_id") or f"#{i}")
                if status == "streaming" or self.tool_status.get(call) == status:
                    continue
                self.tool_status[call] = status
                name = exact(block.get("name"))
                line = f"[{name}({exact(block.get('arguments') or '')}) {exact(status)}]"
                if block.get("output") is not None:
                    output = str(block["output"]).replace("\r\n", " ").replace("\n", " ")[:120]
                    line = f"[{name} {exact(status)}: {exact(output)}]"
                self._output()
                s.line(s.dim(line))
                self.kind = None

    def cut(self, kind: str, shown: str, text: str) -> str:
        """The server holds less of a block than this screen shows (a crash lost what it had not
        kept yet; README: an interrupted turn is reported "with the text the server kept"): say
        so, plainly, rather than leave text on screen that is in no history. Returns the part of
        what is shown that the server kept (what follows is printed after this line)."""
        kept = 0
        while kept < min(len(shown), len(text)) and shown[kept] == text[kept]:
            kept += 1
        what = "reply" if kind == "text" else "reasoning"
        if kept == 0:
            line = f"[the server kept none of the {what} text shown above: it was lost]"
        else:
            tail = text[:kept]
            tail = visible(tail if len(tail) <= 40 else "…" + tail[-39:]).replace("\n", " ")
            line = (
                f"[the server kept only the first {kept} characters of this {what}, "
                f'up to "{tail}"; the rest shown above was lost]'
            )
        self.screen.line(line)
        self.kind = None  # what follows starts on a line of its own
        return text[:kept]

    def end(self, snap: dict[str, Any]) -> None:
        error = snap.get("error") or {}
        if snap["status"] == "cancelled":
            self.screen.line(
                f"[interrupted: {visible(error.get('message'))}]"
                if error.get("kind") == "interrupted"
                else "[cancelled]"
            )
        elif snap["status"] == "failed":
            self.screen.line(f"[failed: {visible(error.get('message') or snap.get('stop_reason'))}]")
        else:
            self.screen.fresh_line()


def did_not_complete(snap: dict[str, Any]) -> bool:
    """A finished turn that a script must hear about: failed, or interrupted by a server stop or crash
    (`cancelled` with the error kind `interrupted`, as `appserver run` exits 1 for it). A turn
    somebody cancelled on purpose (Ctrl-C, /cancel) has no error and is no failure."""
    error = snap.get("error") or {}
    return snap["status"] == "failed" or (snap["status"] == "cancelled" and error.get("kind") == "interrupted")


class Chat:
    """One chat session: a single event loop over keys, frames and Ctrl-C, so output never interleaves."""

    def __init__(
        self,
        client: ProtocolClient,
        agent: str,
        agent_id: str,
        conv_id: str,
        screen: Screen,
        editor: LineEditor,
        show_reasoning: bool,
        events: Events,
    ) -> None:
        self.client, self.agent, self.agent_id, self.conv_id = client, agent, agent_id, conv_id
        self.screen, self.editor, self.show_reasoning, self.events = screen, editor, show_reasoning, events
        self.turn: str | None = None
        self.renderer = Renderer(screen, show_reasoning)
        self.cancelling = False
        self.asking: dict[str, Any] | None = None
        self.approvals: list[dict[str, Any]] = []
        # Calls whose prompt went away because a snapshot showed them settled, before this client
        # heard how (the server sends `approval_resolved` after that snapshot): the outcome is
        # shown when it arrives, never guessed.
        self.unexplained: dict[str, None] = {}
        self.stash: tuple[str, bool] = ("", False)  # the line typed before an approval prompt (set_aside)
        self.held: list[tuple[str, bool]] = []  # lines typed meanwhile, each with whether it holds pasted text
        self.eof = False
        self.exit_code: int | None = None
        self.turns_failed = 0  # from a pipe, the exit code says whether a turn of its own failed or was interrupted
        # The turns this session's lines started (until they end): from a pipe only these are
        # followed and asked about; another client's turn and its approvals are left to it
        self.mine: set[str] = set()
        self.left_to_others: dict[str, None] = {}  # calls of other clients' turns said to wait for them
        self.refusals = 0  # … or whether a line was refused (too long for a frame, refused by the server): lost input
        self.lost = False  # the connection is gone for good (said once; exit 1)
        self.tasks: set[asyncio.Task[None]] = set()
        # The line whose submit awaits its ack (None: none does). Meanwhile keys, signals and Ctrl-C
        # are handled; lines typed wait in `held`, and frames that depend on the turn are kept in
        # `deferred` (the ack names the turn, and the server sends it before the turn's first
        # snapshot: they are handled once the ack is).
        self.sending: str | None = None
        self.deferred: list[dict[str, Any]] = []
        self.switching = False  # a `/new` awaits the server (`new_conversation`): lines typed wait

    # ------------------------------------------------------------ screen

    def banner(self) -> None:
        self.screen.line(f"chatting with {exact(self.agent)} in conversation {exact(self.conv_id)}")
        reasoning = "" if self.show_reasoning else "; reasoning hidden (--show-reasoning shows it)"
        self.screen.line(
            self.screen.dim(f"commands: {' '.join(c for c, _ in COMMANDS)}; Ctrl-C cancels a running turn{reasoning}")
        )

    def prompt(self) -> None:
        self.screen.fresh_line()
        self.show_prompt(PROMPT)

    def show_prompt(self, prompt: str) -> None:
        """`prompt` and the keys typed so far, from the start of a row."""
        self.editor.prompt = prompt
        self.screen.write(prompt + (self.editor.display if self.editor.echo else ""))
        self.editor.visible = True

    def erase_prompt(self) -> None:
        """Take the prompt and what is typed after it off the screen, every row of it."""
        self.screen.erase_line(self.editor.shown)

    def approval_prompt(self, frame: dict[str, Any]) -> str:
        """The call exactly as it is: no control, newline or bidi override may hide or reorder it."""
        call = f"{exact(frame['name'])}({exact(frame['arguments'])})"
        return f"{self.screen.dim('[' + exact(frame['call_id']) + ']')} {call} wants to run. approve? [y/N] "

    def render(self, snap: dict[str, Any]) -> None:
        """A snapshot's news; while an approval prompt is open (a call of its step answered, by this
        client or another, while this one asks of the next), above the prompt, which is drawn again."""
        if not (self.editor.visible and self.asking is not None):
            self.renderer.snapshot(snap)
            return
        cleared = False

        def clear() -> None:
            nonlocal cleared
            self.erase_prompt()
            cleared = True

        self.renderer.before_output = clear
        try:
            self.renderer.snapshot(snap)
        finally:
            self.renderer.before_output = None
        if cleared:
            self.show_prompt(self.approval_prompt(self.asking))

    def notice(self, text: str) -> None:
        """A line of information that must not tear the line being typed."""
        if self.editor.visible:
            self.erase_prompt()
            self.screen.line(text)
            self.show_prompt(self.approval_prompt(self.asking) if self.asking else PROMPT)
        else:
            self.screen.line(text)

    # ------------------------------------------------------------ loop

    async def run(self, active: dict[str, Any] | None) -> int:
        self.banner()
        if active is not None and active.get("status") not in TERMINAL and not self.foreign(active["turn_id"]):
            self.follow(active["turn_id"])
            self.renderer.snapshot(active)
        else:
            if active is not None and active.get("status") not in TERMINAL:
                self.screen.line(
                    self.screen.dim(f"[another client's turn {exact(active['turn_id'])} runs: lines queue behind it]")
                )
            self.prompt()
        while self.exit_code is None:
            kind, value = await self.events.get()
            if kind == "keys":
                await self.on_keys(*value)
            elif kind == "frame":
                if self.sending is not None and value.get("type") not in ("error", "event"):
                    self.deferred.append(value)  # (an error or a notice is said at once)
                else:
                    await self.handle_frame(value)
            elif kind == "submitted":
                await self.submitted(value)
            elif kind == "renewed":
                await self.renewed(value)
            elif kind == "interrupt":
                self.on_interrupt()
            elif kind == "notice":
                self.notice(value)
            elif kind == "closed":
                self.gone(value)
            elif kind == "signal":  # SIGTERM/SIGHUP: the terminal is already restored (see chat())
                self.exit_code = 128 + int(value)
        try:
            if self.sending is not None:  # leaving before the server confirmed the last line
                self.unconfirmed("chat left before the server confirmed", self.sending)
            self.not_sent()
            self.screen.fresh_line()
        except OSError:  # the terminal hung up (SIGHUP): nothing left to tidy on it
            pass
        return self.exit_code

    async def handle_frame(self, frame: dict[str, Any]) -> None:
        try:
            await self.on_frame(frame)
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            # a server (or something posing as one) sent a frame of the wrong shape
            self.notice(
                f"error: ignored a malformed {visible(frame.get('type'))} frame from the server "
                f"({type(exc).__name__}: {visible(str(exc))})"
            )

    def foreign(self, turn_id: str) -> bool:
        """A turn a script (input from a pipe) leaves alone: one it did not start. Its approvals
        wait for the client that started it (a script's next line is its own input, no answer to
        a call it never caused), its lines queue behind it, and its outcome is not the script's."""
        return not self.editor.echo and turn_id not in self.mine

    def leave(self) -> None:
        """End the session on purpose (/quit, end of input). A script that pipes its input reads
        the outcome from the exit code, however its input ends (`/quit` or end of file): 1 when a
        turn of its own failed or was interrupted, or a line of it was refused (`error: line too long: …`, a
        submit or command the server refused: that input never ran). A person at the terminal saw
        each `[failed: …]` and `error:` line and went on: 0."""
        self.exit_code = 1 if (self.turns_failed or self.refusals) and not self.editor.echo else 0

    def gone(self, why: str) -> None:
        """The connection is gone for good (no server to reconnect to): say why once, leave with 1."""
        if not self.lost:
            self.lost = True
            self.screen.fresh_line()
            click.echo(f"error: {visible(why)}", err=True)
        self.exit_code = 1

    def refused(self, exc: ProtocolError, what: str = "") -> None:
        """A request failed: the server said no (shown; the session goes on), or the connection is
        gone for good (the session ends, exit 1: lines typed after it would be lost silently)."""
        if exc.code == "connection_closed" or self.client.gone:
            self.gone(exc.message)
        else:
            self.refusals += 1
            self.screen.line(f"error: {what}{visible(exc.message)}")

    def follow(self, turn_id: str) -> None:
        self.turn, self.cancelling = turn_id, False
        self.renderer = Renderer(self.screen, self.show_reasoning)
        self.editor.visible = False

    def background(
        self, frame: dict[str, Any], report: Callable[[dict[str, Any]], str | None], quiet: bool = False
    ) -> None:
        """Send a request without stalling the screen; its outcome comes back as a notice (`quiet`:
        a refusal or no answer is not said either)."""

        async def go() -> None:
            try:
                text = report(await self.client.request(frame))
            except ProtocolError as exc:
                if exc.code == "connection_closed" or self.client.gone:
                    self.events.put_nowait(("closed", exc.message))
                    return
                text = None if quiet else f"error: {visible(exc.message)}"
            except TimeoutError:
                text = None if quiet else f"error: the server did not answer {visible(frame.get('type'))} in time"
            if text:
                self.events.put_nowait(("notice", text))

        task = asyncio.get_running_loop().create_task(go())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # ------------------------------------------------------------ input

    async def on_keys(self, data: bytes, read_at: float | None = None) -> None:
        if data:
            self.editor.add(data, read_at)
        else:  # stdin closed: finish what was typed, then leave
            self.editor.end()
        while self.exit_code is None and (event := self.editor.take()) is not None:
            kind, text = event
            pasted = kind == "pasted"
            command = "" if pasted else text.strip()  # a line holding pasted text is never a command
            if kind == "eof":  # Ctrl-D on an empty line: leave once nothing runs (at an approval: deny)
                self.eof = True
                if self.asking is not None:
                    self.answer("")
            elif self.asking is not None:
                self.at_approval(text, pasted)
            elif self.busy and not self.editor.echo and command != "/cancel":
                # piped: a script's lines run in order, its /quit too (acting now dropped the replies
                # of the lines before it); its /cancel acts now, on the reply streaming
                self.held.append((text, pasted))
            elif self.busy:  # a reply is streaming (or a line awaits its ack): commands act now, other lines wait
                if command == "/cancel":
                    self.cancel()
                elif command in ("/quit", "/exit"):
                    self.leave()
                else:
                    self.held.append((text, pasted))
            else:
                if not self.editor.echo:  # piped: nothing was echoed; show the line after its prompt
                    self.screen.write(typed(text) + "\n")  # (a CR in it is text, not a control)
                await self.line(text, pasted)
        await self.drain()

    async def drain(self) -> None:
        """Between turns: run the lines typed meanwhile, then leave (stdin ended) or prompt."""
        while not self.busy and self.asking is None and self.exit_code is None:
            if self.held:
                text, pasted = self.held.pop(0)
                self.screen.fresh_line()
                self.screen.write(PROMPT + typed(text) + "\n")
                await self.line(text, pasted)
            elif self.eof:
                if self.client.gone:  # the input ended as the connection did: that is no success
                    self.gone(self.client.closed_message())
                else:
                    self.leave()
            else:
                if not self.editor.visible:
                    self.prompt()
                return

    async def line(self, text: str, pasted: bool = False) -> None:
        """A line entered at the prompt: a client command, or input for the model (always, when it
        holds pasted text: sent exactly as it is)."""
        self.editor.visible = False
        problem = unsendable(text)
        if problem is not None:  # as a line too long: refused, not sent; piped, exit 1 at the end
            self.refusals += 1
            self.screen.line(f"error: the line {shown_raw(text)} {problem}; it was not sent")
            return
        cmd = text.strip()
        if not cmd:
            return
        if pasted:
            self.submit(text)
            return
        if cmd in ("/quit", "/exit"):
            self.leave()
            return
        if cmd == "/help":
            for name, what in (
                *COMMANDS,
                ("//text", "send /text to the model (other /words, e.g. the echo model's /slow, go as typed)"),
            ):
                self.screen.line(f"  {name:<8} {what}")
            return
        if cmd == "/cancel":
            # Nothing of this client runs or is on screen (a /cancel then acts as it is typed, in
            # on_keys). A cancel naming no turn would stop whatever turn of the conversation runs,
            # another client's that this screen never showed: nothing is sent.
            self.screen.line(self.screen.dim("[nothing to cancel]"))
            return
        if cmd == "/new":
            self.new_conversation()
            return
        self.submit(text[1:] if text.startswith("//") else text)

    @property
    def busy(self) -> bool:
        """A reply is on screen, or a line awaits its ack (or `/new` its answers): lines typed now wait."""
        return self.turn is not None or self.sending is not None or self.switching

    def new_conversation(self) -> None:
        """`/new` without stalling the session, as `submit`: a conversation is created and
        subscribed to, and only then is the one chat was in left, so a failure leaves chat where it
        was. Meanwhile Ctrl-C (or `/cancel`) calls it off, a second Ctrl-C, `/quit` and signals act
        at once, and lines typed wait for it. The outcome comes back as a `renewed` event."""
        self.switching, self.cancelling = True, False

        async def go() -> None:
            outcome: str | Exception
            try:
                async with asyncio.timeout(SUBMIT_TIMEOUT):
                    created = await self.client.request(
                        {"type": "create_conversation", "agent": self.agent_id}, timeout=None
                    )
                    conv_id = conversation_of(created)[1]
                    await self.client.request({"type": "subscribe", "conversation": conv_id}, timeout=None)
                outcome = conv_id
            except (ProtocolError, TimeoutError) as exc:
                outcome = exc
            self.events.put_nowait(("renewed", outcome))

        task = asyncio.get_running_loop().create_task(go())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def renewed(self, outcome: str | Exception) -> None:
        """`/new` was answered (or not in time): chat is in the new conversation, or says why not."""
        if not self.switching:
            return
        self.switching = False
        cancel, self.cancelling = self.cancelling, False
        old = self.conv_id
        if isinstance(outcome, ProtocolError) and (outcome.code == "connection_closed" or self.client.gone):
            self.gone(outcome.message)
        elif cancel:  # Ctrl-C or /cancel meanwhile: chat stays where it was
            if isinstance(outcome, str):
                self.background({"type": "unsubscribe", "conversation": outcome}, lambda ack: None, quiet=True)
            self.screen.line(self.screen.dim(f"[/new called off: still in conversation {exact(old)}]"))
        elif isinstance(outcome, str):
            self.conv_id = outcome
            self.background({"type": "unsubscribe", "conversation": old}, lambda ack: None, quiet=True)
            self.screen.line(f"new conversation {exact(outcome)}")
        else:  # refused, or no answer in time (piped: exit 1 at the end, as for a refused line)
            self.refusals += 1
            why = (
                visible(outcome.message)
                if isinstance(outcome, ProtocolError)
                else f"the server did not answer within {SUBMIT_TIMEOUT:g} s"
            )
            self.screen.line(f"error: /new: {why}; still in conversation {exact(old)}")
        await self.drain()

    def submit(self, text: str) -> None:
        """Send a line for the model without stalling the session: the outcome comes back as a
        `submitted` event (the ack, or the ProtocolError or TimeoutError the request ended with)."""
        self.sending, self.cancelling = text, False
        frame = {
            "type": "submit_input",
            "agent": self.agent_id,
            "conversation": self.conv_id,
            "input": text,
            "source": {"client": "chat"},
            "idempotency_key": f"chat-{uuid.uuid4().hex}",
        }

        async def go() -> None:
            outcome: dict[str, Any] | Exception
            try:
                outcome = await self.client.request(frame, timeout=SUBMIT_TIMEOUT)
            except (ProtocolError, TimeoutError) as exc:
                outcome = exc
            self.events.put_nowait(("submitted", outcome))

        task = asyncio.get_running_loop().create_task(go())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def submitted(self, outcome: dict[str, Any] | Exception) -> None:
        """The line being sent was answered (or not in time): follow its turn, or say why not."""
        text, self.sending = self.sending, None
        cancel, self.cancelling = self.cancelling, False
        if text is None:
            return
        if isinstance(outcome, ProtocolError):
            self.refused(outcome, "line too long: " if outcome.code == "frame_too_large" else "")
        elif isinstance(outcome, Exception) or not isinstance(outcome.get("turn_id"), str):
            # TimeoutError: no answer at all (or an ack naming no turn). Piped, exit 1 at the end,
            # as for a refused line: this input may never have run.
            self.refusals += 1
            self.unconfirmed(
                "the server did not confirm",
                text,
                f"within {SUBMIT_TIMEOUT:g} s" if isinstance(outcome, Exception) else "(its ack named no turn)",
            )
        else:
            self.mine.add(outcome["turn_id"])
            self.follow(outcome["turn_id"])
            if outcome.get("queue_position"):
                self.screen.line(self.screen.dim(f"[queued behind {visible(outcome['queue_position'])} input(s)]"))
            if cancel:  # Ctrl-C or /cancel while the line awaited its ack
                self.cancel()
        while self.deferred and self.sending is None and self.exit_code is None:
            await self.handle_frame(self.deferred.pop(0))
        await self.drain()

    def not_sent(self) -> None:
        """Leaving (the connection lost for good, a signal, Ctrl-C twice, `/quit` while a reply
        streams) with lines typed at the terminal that never ran: each is named, so it can be typed
        again (they were never echoed). From a pipe the exit code says it, and the input still has them."""
        if not self.editor.echo:
            return
        typed_lines = [text for text, _ in self.held]
        unfinished = self.stash[0] if self.asking is not None else ("" if self.editor.visible else self.editor.text)
        for text in [*typed_lines, unfinished]:
            if text.strip():
                shown = visible(text if len(text) <= 60 else text[:59] + "…")
                self.screen.line(f'not sent: "{shown}"')
        self.held = []

    def unconfirmed(self, head: str, text: str, tail: str = "") -> None:
        """A line the server never confirmed: it may or may not have been taken (it is not sent again)."""
        shown = visible(text if len(text) <= 60 else text[:59] + "…")
        self.screen.line(
            f'error: {head} "{shown}" {tail}'.rstrip()
            + ": it may or may not have been taken (it is not sent again); if it was, it is in the "
            f"conversation's history (appserver conversations history {exact(self.conv_id)}), "
            "else type it again"
        )

    def at_approval(self, text: str, pasted: bool = False) -> None:
        """A line entered at the approval prompt: its answer, or a command (never one holding pasted text)."""
        command = "" if pasted else text.strip()
        if not self.editor.echo and command in ("/cancel", "/quit", "/exit"):
            self.screen.write(typed(text) + "\n")  # piped: shown after its prompt, as an answer is
        if command == "/cancel":  # cancels the turn, like Ctrl-C; the call is not answered
            self.on_interrupt()
        elif command in ("/quit", "/exit"):  # leaves; the call is not answered
            self.leave()
        else:
            self.answer(text)

    def answer(self, text: str) -> None:
        frame, self.asking = self.asking, None
        assert frame is not None
        self.editor.visible = False
        self.editor.put_back(self.stash)
        if not self.editor.echo:  # piped: nothing was echoed; show the answer after its prompt
            self.screen.write(typed(text) + "\n")
        decision = "approve" if text.strip().lower() in ("y", "yes") else "deny"

        def report(ack: dict[str, Any]) -> str | None:
            refused = [r for r in ack.get("results") or [] if not r.get("accepted")]
            return (
                "; ".join(
                    f"[{exact(r.get('call_id'))}: not {decision}d: {visible(r.get('message') or r.get('error'))}]"
                    for r in refused
                )
                or None
            )

        self.background(
            {
                "type": "approval_response",
                "conversation": frame["conversation_id"],
                "decisions": [{"call_id": frame["call_id"], "decision": decision}],
            },
            report,
        )
        self.next_approval()

    def ask(self, frame: dict[str, Any]) -> None:
        self.asking = frame
        self.stash = self.editor.set_aside()
        self.screen.fresh_line()
        self.show_prompt(self.approval_prompt(frame))
        if not self.editor.echo and self.held:  # a script on stdin answers in order (its /quit
            # leaves, as typed at the prompt); a person at a terminal never approves with keys typed
            # before the prompt
            self.at_approval(*self.held.pop(0))
        elif self.eof:  # stdin ended: nobody here can answer
            self.screen.write("(no input left: deny)")
            self.answer("")

    def withdraw(self, why: str | None) -> None:
        """Take the approval prompt off the screen: somebody else answered, it expired, or the
        turn was cancelled. `why` None: not known yet (`approval_resolved` will say)."""
        self.erase_prompt()
        self.asking = None
        self.editor.visible = False
        self.editor.put_back(self.stash)
        if why is not None:
            self.screen.line(self.screen.dim(why))
        self.next_approval()

    def remember_unexplained(self, call_id: str) -> None:
        self.unexplained[call_id] = None
        while len(self.unexplained) > 64:  # a server that never says: keep only the latest
            del self.unexplained[next(iter(self.unexplained))]

    def next_approval(self) -> None:
        if self.approvals and self.asking is None:
            self.ask(self.approvals.pop(0))

    def cancel(self) -> None:
        """Cancel the turn on screen, named (never the one queued behind it, nor a turn of another
        client that this screen does not show)."""
        self.cancelling = True
        if self.turn is None:
            return  # the turn is not known yet: cancelled once the server confirms the line (`submitted`)
        self.background({"type": "cancel", "conversation": self.conv_id, "turn_id": self.turn}, lambda ack: None)

    def on_interrupt(self) -> None:
        if self.asking is not None:  # cancel at once; the approval is not answered
            self.erase_prompt()
            self.asking, self.approvals = None, []
            self.editor.visible = False
            self.editor.put_back(self.stash)
            self.screen.line("^C cancelling (Ctrl-C again to exit)")
            self.cancel()
        elif self.turn is not None or self.sending is not None or self.switching:
            # a reply runs, a line awaits its ack, or /new its answers
            if self.cancelling:
                self.exit_code = 130
                return
            self.screen.line(
                "^C calling /new off (Ctrl-C again to exit)"
                if self.switching and self.sending is None and self.turn is None
                else "^C cancelling (Ctrl-C again to exit)"
            )
            self.renderer.kind = None
            self.cancel()
        elif self.editor.buf or self.editor.pasting:
            self.editor.discard()
            self.screen.write("^C\n")
            self.prompt()
        else:
            self.leave()

    # ------------------------------------------------------------ frames

    async def on_frame(self, frame: dict[str, Any]) -> None:
        kind = frame.get("type")
        if kind == "turn_updated":
            snap = frame["snapshot"]
            if snap.get("turn_id") != self.turn:
                return
            if self.asking is not None and self.asking["turn_id"] == snap["turn_id"]:
                open_calls = (
                    {p.get("call_id") for p in snap.get("pending") or []} if snap["status"] == "awaiting" else set()
                )
                # the call's own block says it was settled (a cancel shows `failed` one snapshot
                # before the turn leaves `awaiting`): the prompt goes before that line is drawn
                settled = {
                    b.get("call_id")
                    for b in snap.get("blocks") or []
                    if b.get("type") == "tool_call" and b.get("status") not in (None, "streaming", "pending_approval")
                }
                if (
                    self.asking["call_id"] not in open_calls or self.asking["call_id"] in settled
                ):  # settled (answered, expired, cancelled): how, approval_resolved says next
                    self.remember_unexplained(self.asking["call_id"])
                    self.withdraw(None)
            self.render(snap)
            if snap["status"] in TERMINAL:
                self.renderer.end(snap)
                self.turns_failed += did_not_complete(snap) and snap["turn_id"] in self.mine
                self.mine.discard(snap["turn_id"])
                await self.turn_ended()
        elif kind == "approval_request" and frame.get("conversation_id") == self.conv_id:
            if self.foreign(frame["turn_id"]):
                self.leave_to_others(frame)
                return
            if self.turn is None:  # a turn of this conversation needs an answer: show it
                if self.editor.visible:
                    self.erase_prompt()
                self.follow(frame["turn_id"])
            if self.asking is not None and self.asking["call_id"] == frame["call_id"]:
                return  # asked again after a reconnect: already on screen
            if self.asking is None:
                self.ask(frame)
            elif all(a["call_id"] != frame["call_id"] for a in self.approvals):
                self.approvals.append(frame)
        elif kind == "approval_resolved" and frame.get("conversation_id") == self.conv_id:
            self.approvals = [a for a in self.approvals if a["call_id"] != frame["call_id"]]
            by = f" by {exact(frame['decided_by'])}" if frame.get("decided_by") else ""
            outcome = f"[{exact(frame['call_id'])} {exact(frame.get('status'))}{by}]"
            if self.asking is not None and self.asking["call_id"] == frame["call_id"]:
                self.withdraw(outcome)
            elif frame["call_id"] in self.unexplained:  # its prompt went when the snapshot settled it
                del self.unexplained[frame["call_id"]]
                self.notice(self.screen.dim(outcome))
        elif kind == "event" and frame.get("local") is True:  # the client library's own, never the server's
            data = frame.get("data") or {}
            if frame.get("name") == "connection_lost":
                self.notice(
                    self.screen.dim(
                        f"[connection lost ({visible(data.get('code'))} {visible(data.get('reason') or '')}".rstrip()
                        + f"); reconnecting for up to {data.get('reconnect_s'):g} s]"
                    )
                )
            elif frame.get("name") == "reconnected":
                self.notice(self.screen.dim(f"[reconnected to {visible(data.get('url'))}]"))
        elif kind == "event" and frame.get("name") == "server_stopping":
            self.notice(self.screen.dim("[the server is stopping; a standby may take over]"))
        elif kind == "error":
            self.notice(f"error: {visible(frame.get('message'))}")

    def leave_to_others(self, frame: dict[str, Any]) -> None:
        """Say (once per call) that another client's call waits for its approval, unanswered here."""
        if frame["call_id"] in self.left_to_others:
            return
        self.left_to_others[frame["call_id"]] = None
        while len(self.left_to_others) > 64:
            del self.left_to_others[next(iter(self.left_to_others))]
        call = f"{exact(frame['name'])}({exact(frame['arguments'])})"
        self.notice(
            self.screen.dim(f"[{exact(frame['call_id'])}] {call} of another client's turn waits for its approval")
        )

    async def turn_ended(self) -> None:
        self.turn, self.cancelling = None, False
        self.asking, self.approvals = None, []
        await self.drain()


async def chat(
    url: str,
    agent: str,
    conversation: str,
    token: str | None,
    show_reasoning: bool,
    reconnect_wait: float,
    url_source: Callable[[], str | None] | None,
    home: HomeServer | None = None,
    started: list[bool] | None = None,
) -> int:
    """The session; `started` gets True once it has begun (a Ctrl-C that escapes after that is no
    "no turn was started")."""
    loop = asyncio.get_running_loop()
    client = await connect_or_interrupted(
        connect_first(
            url,
            home,
            token=token,
            client="appserver-chat",
            reconnect=reconnect_wait > 0,
            reconnect_s=reconnect_wait,
            url_source=url_source,
        )
    )
    events: Events = asyncio.Queue()

    async def pump() -> None:
        async for frame in client.frames():
            events.put_nowait(("frame", frame))
        events.put_nowait(("closed", client.closed_message()))

    frames = loop.create_task(pump())
    keys: Keys | None = None
    session: Chat | None = None
    signalled: list[int] = []
    # The session runs as a task of its own (`work`), stopped by cancelling it until it ends: a
    # signal cancelled this task once, and Python 3.11's `asyncio.wait_for` drops a cancel that
    # lands as its inner awaitable completes (the server's reply to `subscribe` arriving with a
    # SIGHUP): chat went on into a session on a terminal that was gone (cli/common.py).
    stop_work: asyncio.Future[None] = loop.create_future()

    def stop_now() -> None:
        if not stop_work.done():
            stop_work.set_result(None)

    def stopped(signum: int) -> None:
        """SIGTERM or SIGHUP (the terminal closed, `kill`): give the terminal its modes back at
        once, before anything else can go wrong, then leave with 128 + the signal number, as a
        shell reports a process the signal ended. Without this the default action killed the
        process with the terminal left without echo."""
        if keys is not None:
            try:
                keys.restore()
            except (termios.error, OSError):  # a terminal that hung up has no modes to restore
                keys.saved = None
        signalled.append(signum)
        if session is not None:
            session.exit_code = 128 + signum
            events.put_nowait(("signal", signum))
            # a session stuck in a step of its own (no request is awaited inline any more: `/new`
            # runs beside it, as a submit does) handles no event until it returns: stop it if
            # it has not ended by then
            loop.call_later(STOP_GRACE, stop_now)
        else:  # still connecting: stop that
            stop_now()

    stop_signals = (signal.SIGTERM, signal.SIGHUP)
    for signum in stop_signals:
        loop.add_signal_handler(signum, stopped, signum)

    async def work() -> int:
        nonlocal conversation, keys, session
        if conversation == "new":  # as `appserver run --conversation new`
            created = await client.request({"type": "create_conversation", "agent": agent})
            conversation = conversation_of(created)[1]
        state = await client.request({"type": "subscribe", "conversation": conversation, "agent": agent})
        agent_id, conversation = conversation_of(state)
        tty_out = sys.stdout.isatty()
        screen = Screen(color=tty_out and not os.environ.get("NO_COLOR"), ansi=tty_out)
        keys = Keys(loop, events, cbreak=tty_out)
        loop.add_signal_handler(signal.SIGINT, events.put_nowait, ("interrupt", None))
        if started is not None:
            started.append(True)
        session = Chat(
            client,
            agent,
            agent_id,
            conversation,
            screen,
            LineEditor(screen, echo=keys.tty),
            show_reasoning,
            events,
        )
        return await session.run(state.get("active_turn"))

    try:
        job = loop.create_task(work())
        try:
            await asyncio.wait((job, stop_work), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # chat's own cancel (Ctrl-C while connecting): the session ends with it
            job.cancel()
            raise
        if not job.done():  # a signal, and the session did not end by itself in time
            await cancel_until_done(job, WORK_STOP_WAIT_S, WORK_STOP_POLL_S)
        if signalled and (not job.done() or job.cancelled()):
            if session is None:  # stopped while creating or subscribing: said as while connecting
                raise Interrupted(signalled[0], "no turn was started")
            return 128 + signalled[0]
        return job.result()
    finally:
        if keys is not None:
            try:
                keys.restore()
            except (termios.error, OSError):  # the terminal hung up
                keys.saved = None
        frames.cancel()
        try:  # a stalled server never answers the closing handshake: do not wait for it long
            await asyncio.wait_for(client.close(), CLOSE_WAIT)
        except TimeoutError:
            transport = getattr(client.ws, "transport", None)
            if transport is not None:
                transport.abort()
        finally:
            # only now: a Ctrl-C (or signal) during that close, after the session decided how it
            # ends (`/quit`), changes nothing; it was a KeyboardInterrupt that said "no turn was
            # started" and exit 130
            loop.remove_signal_handler(signal.SIGINT)
            for signum in stop_signals:
                loop.remove_signal_handler(signum)


def conversation_of(reply: dict[str, Any]) -> tuple[str, str]:
    """(agent id, conversation id) of a `create_conversation` or `subscribe` reply; a reply without
    them (a broken or foreign server) is a ProtocolError, one error line as for any refusal, not a
    traceback: no session can start without them."""
    conv = reply.get("conversation")
    agent_id = conv.get("agent_id") if isinstance(conv, dict) else None
    conv_id = conv.get("id") if isinstance(conv, dict) else None
    if not isinstance(agent_id, str) or not isinstance(conv_id, str) or not conv_id:
        raise ProtocolError(
            "malformed_reply",
            f"the server's {visible(reply.get('type'))} reply names no conversation (a malformed frame)",
        )
    return agent_id, conv_id


async def connect_or_interrupted(connecting: Awaitable[ProtocolClient]) -> ProtocolClient:
    """The first connection, which a stop signal ends as it ends `appserver run`'s (Interrupted: one
    error line, 128 + the signal), not with click's "Aborted!". The signals' usual actions come back
    after (until_signal leaves them ignored), for the session to install its own."""

    async def nothing_started(signum: int) -> str:
        return "no turn was started"

    try:
        client = await until_signal(connecting, nothing_started)
    except Interrupted:
        raise
    except BaseException:
        signals_as_at_start()
        raise
    signals_as_at_start()
    return client


@click.command("chat")
@click.option("--agent", default="assistant", show_default=True, help="Agent id or name.")
@click.option("--conversation", default="default", show_default=True, help="default, new, or a conversation id.")
@click.option("--url", default=None, help="Server URL (default: the server running on this home).")
@click.option("--token", default=None, envvar="APPSERVER_TOKEN", help="Bearer token when the server requires one.")
@click.option("--show-reasoning", is_flag=True, help="Show the model's reasoning (dimmed); hidden by default.")
@reconnect_wait_option()
def chat_command(
    agent: str, conversation: str, url: str | None, token: str | None, show_reasoning: bool, reconnect_wait: float
) -> None:
    """Chat with an agent through the running server (WebSocket protocol)."""
    url_source = None
    home: HomeServer | None = None
    if url is None:
        server_json = get_config().server_json
        url, home = home_server_or_fail(server_json)
        url_source = server_url_source(server_json)
    else:
        try:
            check_url(url)
        except ConnectError as exc:
            fail(f"--url: {exc.message}", 2)
    started: list[bool] = []
    try:
        try:
            code = asyncio.run(
                chat(url, agent, conversation, token, show_reasoning, reconnect_wait, url_source, home, started)
            )
        except ServerGone:  # it stopped before taking anything: the server that replaced it, once
            assert home is not None
            url, _ = home_server_or_fail(home.server_json, stopped=url)
            code = asyncio.run(
                chat(url, agent, conversation, token, show_reasoning, reconnect_wait, url_source, started=started)
            )
    except Interrupted as exc:  # a stop signal while connecting, as `appserver run` reports it
        fail(f"interrupted by {signal_name(exc.signum)}: {exc.what}", 128 + exc.signum)
    except KeyboardInterrupt:
        if started:  # as the session ended (after its own handling of Ctrl-C was gone): nothing to say
            sys.exit(128 + signal.SIGINT)
        fail("interrupted by SIGINT: no turn was started", 128 + signal.SIGINT)  # subscribing
    except ProtocolError as exc:  # ConnectError too: a refused upgrade (401/403 …), a bad URL
        fail(
            exc.message + token_hint(exc.code, "give --token or set APPSERVER_TOKEN"),
            2 if exc.code in USAGE_ERRORS else 1,
        )
    except TimeoutError:  # before OSError, of which it is a kind
        fail(f"the server at {shown_url(url)} did not answer in time", 1)
    except OSError as exc:
        if stdout_closed(exc):  # `appserver chat | head -1`: the reader left, the server did not
            exit_stdout_closed()
        fail(f"cannot reach the server at {shown_url(url)}: {exc}", 1)
    sys.exit(code)


def home_server_or_fail(server_json: Path, stopped: str | None = None) -> tuple[str, HomeServer]:
    """The URL of this home's live server (waiting while one starts), and where to wait for its stop;
    without one, exit 3. `stopped`: the URL of the server that stopped meanwhile, and one taking over
    is looked for a while (TAKEOVER_WAIT_S)."""
    deadline = time.monotonic() + (TAKEOVER_WAIT_S if stopped else 0.0)
    with signals_end_the_wait():  # a stop signal meanwhile: one error line and 128 + it, as later
        while (live := starting_or_live(server_json)) is None and time.monotonic() < deadline:
            time.sleep(0.05)
    if live is None:
        gone = f" (the one at {visible(stopped)} stopped)" if stopped else ""
        fail(f"no server is running on this home{gone}: start `appserver serve` (or give --url)", 3)
    return str(live["url"]), HomeServer(server_json, str(live.get("identity") or ""))


def starting_or_live(server_json: Path) -> dict[str, Any] | None:
    """The live server of this home, waited for (and the wait said) while one starts; exit 3 when
    it does not say where it listens in time."""
    try:
        return find_live_server(server_json, START_WAIT_S, tell_starting(START_WAIT_S))
    except HomeStarting as exc:
        fail(f"{exc}; try again in a moment", 3)
