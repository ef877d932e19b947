"""Approval prompts in the chat: what the gateway shows for a paused turn and who may answer.

When a channel turn pauses for an `ask` tool, the chat gets a prompt naming the tool and its
arguments (literally, in a code block, long runs of padding as counts; long ones cut in the
middle, saying so; for `shell`, the command is never cut to fit the other arguments: it is shown
whole, or said to be too long to judge from the prompt), answered with `/approve ID` /
`/deny ID` (or a plugin's buttons, which send the same). Only the sender who started the turn
or an admin may answer; for a turn no message of the chat started (a scheduled run, another
client's turn in the chat's conversation), the DM's sender or an admin, in a group an admin
only. The prompt is updated when the call is decided here, elsewhere (CLI, desktop) or times out.
"""

from __future__ import annotations

import asyncio
import json
import re
import sqlite3
import time
import unicodedata
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from gateway.db import transaction
from gateway.recent import Recent
from gateway.sqlstore import in_scope
from plugins.contract import Target, is_grapheme_boundary, shorten

SHORT_ID = 8
FORGET_POSTED_S = 7 * 24 * 3600.0  # a remembered prompt post older than this is dropped at start
ARGS_SHOWN = 300  # longer arguments show their first ARGS_HEAD and last ARGS_TAIL characters
ARGS_HEAD = 200
ARGS_TAIL = 80

OUTCOME_LINES = {
    "approved": "✅ Approved",
    "denied": "❌ Denied",
    "expired": "⌛ Timed out (not run)",
    "cancelled": "⏹ Cancelled",
}
# A prompt whose call ended while no gateway (or no connection) was there to hear how: the server
# told nobody here, and the protocol shows only whether the call still waits (and, while its turn
# runs, whether it ran or was denied).
NO_LONGER_WAITING = (
    "⏹ No longer waiting for an answer (answered elsewhere, timed out or cancelled while the gateway was away)"
)
# A pressed prompt whose call no longer waits and whose outcome this process never saw (decided
# before it started, say): its own message is edited to this, as the press names only the call's ID.
PRESSED_GONE = "⏹ No longer waiting for an answer."
NAME_SHOWN = 100  # a person's (or the server's) name in a decision line is cut here
# Invisible but not of category Cf: fillers and joiners that render as nothing.
INVISIBLE = frozenset("\u034f\u115f\u1160\u17b4\u17b5\u3164\uffa0")


@dataclass
class Prompt:
    """One pending approval as shown in one chat."""

    call_id: str
    conversation: str
    turn_id: str
    account: str  # channel:account of the chat
    target: Target
    starter: str  # the sender whose message started the turn (or may answer for none: "" is nobody)
    name: str
    arguments: str
    message_ids: list[str] = field(default_factory=list)
    decided: str | None = None
    shown: asyncio.Event = field(default_factory=asyncio.Event)  # set once the prompt's send returned

    @property
    def short_id(self) -> str:
        return self.call_id[-SHORT_ID:]

    def text(self, room: Room | None = None) -> str:
        """The prompt as Markdown. The arguments are the model's: shown literally in a code block no
        text can close (rendered as Markdown, Discord hid `||…||` as a spoiler and `[x](url)` behind
        its label), and a cut says so outside the block, where the model cannot forge it. In `room`
        (the chat's limit, measured as the platform counts the posted text: escapes and `\\u200b`s
        included) the shown arguments are cut in the middle until the whole prompt fits, so neither
        the end of a command nor the last line (`Reply /approve ID`, or the decision) is cut off."""
        # Literally, whitespace included (`printf "a    b"` must read as what will run), except that
        # long runs of one whitespace or hidden character, and of combining marks, are shown as a
        # count (`compact`): as padding they pushed the end of a command out of sight.
        args = self.arguments if self.arguments.strip() else "{}"
        name = visible(self.name.replace("`", "'"))
        last = self.decided or f"Reply /approve {self.short_id} or /deny {self.short_id}"
        shown, hidden = cut_middle(args)
        if not hidden:
            whole = f"{_args_head(name, args, shown, 0)}\n{last}"
            if _fits(whole, room):
                return whole
        command = shell_command(self.name, args)
        if command is not None:  # never cut inside the command only to fit the others: it is what is decided on
            build, most = _shell_builder(name, args, *command), COMMAND_SHOWN
        else:
            build, most = _args_builder(name, args), ARGS_SHOWN
        fitted = _largest_fitting(build, last, most, room)
        if fitted is not None:
            return fitted
        return _squeezed(args, self.name, last, room)


@dataclass(frozen=True)
class Room:
    """How long a prompt may be in one chat, counted as the platform counts the posted message
    (`measure` of the Markdown prompt): Slack's section holds 3,000 characters of mrkdwn, where an
    `&` is `&amp;`; Discord takes 2,000; Telegram 4,096 UTF-16 units."""

    limit: int
    measure: Callable[[str], int]


def room_of(adapter: object) -> Room | None:
    """The adapter's room for a prompt: its `prompt_max_length` and `prompt_length` when it has them,
    else its message limit (`limits.max_length`) over its own `measure` of its `format`; None when
    it says neither (the prompt is then only held to its own sizes)."""
    limit = getattr(adapter, "prompt_max_length", None)
    measure = getattr(adapter, "prompt_length", None)
    if isinstance(limit, int) and callable(measure):
        return Room(limit, measure)
    limits = getattr(adapter, "limits", None)
    fallback = getattr(limits, "max_length", None)
    format_ = getattr(adapter, "format", None)
    if not isinstance(fallback, int) or not callable(format_):
        return None
    count = getattr(adapter, "measure", None) or len
    return Room(fallback, lambda text: int(count(format_(text))))


def _fits(text: str, room: Room | None) -> bool:
    return room is None or room.measure(text) <= room.limit


Builder = Callable[[int], str]  # a prompt's head with at most this many characters of arguments shown
LEAST_SHOWN = 24  # below this many characters of a command the prompt says it is too long to show at all


def _largest_fitting(build: Builder, last: str, most: int, room: Room | None) -> str | None:
    """The head `build` makes with the largest budget (at most `most`) whose prompt fits `room`, with
    `last` as its last line; None when not even `LEAST_SHOWN` characters fit. A bisection: a longer
    budget shows more, and the prompt is measured after the platform's escapes, not guessed."""
    whole = f"{build(most)}\n{last}"
    if _fits(whole, room):
        return whole
    return _bisect_fitting(LEAST_SHOWN, most - 1, lambda n: f"{build(n)}\n{last}", room)


def _bisect_fitting(low: int, high: int, make: Callable[[int], str], room: Room | None) -> str | None:
    """`make(n)` for the largest n in [low, high] whose text fits `room` (a longer n makes a longer
    text: a bisection); None when not even `make(low)` fits."""
    best: str | None = None
    while low <= high:
        middle = (low + high) // 2
        text = make(middle)
        if _fits(text, room):
            best, low = text, middle + 1
        else:
            high = middle - 1
    return best


def _args_head(name: str, args: str, shown: str, hidden: int) -> str:
    cut = f" ({hidden:,} of {len(args):,} characters not shown, at the …)" if hidden else ""
    return f"🔐 The agent wants to use `{name}` with these arguments{cut}:\n```\n{literal(shown)}\n```"


def _args_builder(name: str, args: str) -> Builder:
    def build(budget: int) -> str:
        head, tail = _shares(budget, ARGS_SHOWN, ARGS_HEAD, ARGS_TAIL)
        return _args_head(name, args, *cut_middle(args, budget, head, tail))

    return build


def _shell_builder(name: str, args: str, command: str, others: dict[str, object]) -> Builder:
    def build(budget: int) -> str:
        return _shell_head(name, args, command, dict(others), budget)

    return build


def _shares(budget: int, shown: int, head: int, tail: int) -> tuple[int, int]:
    """Where a `budget` smaller than `shown` cuts: the head and the tail in the same proportion."""
    return budget * head // shown, budget * tail // shown


def _squeezed(args: str, name: str, last: str, room: Room | None) -> str:
    """A prompt in which not even the least of the arguments fits (a long name, a long decision
    line): no arguments at all, saying so; the last line cut at its end only when that too is too
    long (a decision's name: the `/approve` line is short)."""
    lead = (
        f"🔐 The agent wants to use {code_span(name)} with arguments of {len(args):,} characters, too long to"
        " show here. ⚠️ It cannot be judged from this prompt: deny it, or read the whole call"
        " (`appserver conversations history`) before approving"
    )
    text = f"{lead}\n{last}"
    if _fits(text, room):
        return text
    return _bisect_fitting(0, len(last) - 1, lambda n: f"{lead}\n{shorten(last, n)}", room) or f"{lead}\n…"


# A shell command up to this long (as shown: `compact`) is shown whole when the prompt, as the platform
# renders it, fits its chat (`Room`); else less of its middle is shown, until it fits.
COMMAND_SHOWN = 1200
COMMAND_HEAD = 800
COMMAND_TAIL = 350
OTHER_KEYS_SHOWN = 5


def shell_command(name: str, arguments: str) -> tuple[str, dict[str, object]] | None:
    """The command a `shell` call runs and its other arguments, or None when `arguments` are not an
    object with a string `command` (or repeat a key: the server refuses such a call unrun)."""
    if name != "shell":
        return None

    def pairs(items: list[tuple[str, object]]) -> dict[str, object]:
        found = dict(items)
        if len(found) != len(items):
            raise ValueError("a repeated key")
        return found

    try:
        parsed = json.loads(arguments, object_pairs_hook=pairs)
    except (ValueError, RecursionError):
        return None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("command"), str):
        return None
    return parsed.pop("command"), parsed


def _shell_head(name: str, args: str, command: str, others: dict[str, object], budget: int = COMMAND_SHOWN) -> str:
    """A `shell` prompt whose arguments are too long to show whole: the command it runs shown by
    itself, whole (as it runs: line breaks as line breaks), and if even the command is too long for
    a chat message (`budget` characters as shown), cut in the middle with a warning that the call
    cannot be judged from it."""
    shown, hidden = cut_middle(command, budget, *_shares(budget, COMMAND_SHOWN, COMMAND_HEAD, COMMAND_TAIL))
    if hidden:
        lead = (
            f"🔐 The agent wants to use `{name}` with a command of {len(command):,} characters, too long to show "
            f"whole here ({hidden:,} characters not shown, at the …). ⚠️ It cannot be judged from this "
            "prompt: deny it, or read the whole call (`appserver conversations history`) before approving"
        )
    else:
        lead = (
            f"🔐 The agent wants to use `{name}` to run this command (shown whole; its arguments are "
            f"{len(args):,} characters long)"
        )
    notes = []
    timeout = others.pop("timeout_s", None)
    if timeout is not None:
        notes.append(f"timeout_s: {code_span(json.dumps(timeout, ensure_ascii=False))}")
    if others:
        keys = ", ".join(code_span(k) for k in list(others)[:OTHER_KEYS_SHOWN])
        more = f" and {len(others) - OTHER_KEYS_SHOWN:,} more" if len(others) > OTHER_KEYS_SHOWN else ""
        notes.append(f"also given, not used by the tool: {keys}{more}")
    extra = f"\n({'; '.join(notes)})" if notes else ""
    return f"{lead}:\n```\n{literal(shown)}\n```{extra}"


RUN_SHOWN = 8  # a run of this many identical whitespace (or hidden) characters, or combining marks, is counted
CUT_BACK = 16  # a cut moves back at most this far to a grapheme boundary (else it cuts inside the cluster)
MARK_OPEN, MARK_CLOSE = "⟨", "⟩"  # around a count; the model's own are shown escaped, so none is forged
RUN_NAMES = {" ": "spaces", "\t": "tabs", "\n": "line breaks"}


@dataclass(frozen=True)
class Compacted:
    """Arguments as shown before a cut: `text`, with `weight[i]` the characters of the arguments
    that `text[i]` stands for (a count marker's run on its first character, 0 on the rest) and
    `inside[i]` true where `text[i]` is inside a marker but not its start (no cut there)."""

    text: str
    weight: tuple[int, ...]
    inside: tuple[bool, ...]


def _combining(char: str) -> bool:
    return unicodedata.category(char) in ("Mn", "Me")


def _tag(char: str) -> bool:
    return 0xE0020 <= ord(char) <= 0xE007F


def _run_kind(text: str, i: int) -> tuple[int, str] | None:
    """The run of `RUN_SHOWN` or more characters starting at `text[i]` that is shown as a count: its
    end and its marker's words; None when `text[i]` starts none."""
    char = text[i]
    if _combining(char) or _tag(char):  # marks on one base, tag characters: not necessarily identical
        same = _combining if _combining(char) else _tag
        end = i
        while end < len(text) and same(text[end]):
            end += 1
        what = "combining marks" if same is _combining else "tag characters"
    elif char.isspace() or _hidden(char):  # identical whitespace, controls, format characters
        end = i
        while end < len(text) and text[end] == char:
            end += 1
        what = RUN_NAMES.get(char) or f"× U+{ord(char):04X}"
    else:
        return None
    return (end, what) if end - i >= RUN_SHOWN else None


def compact(text: str) -> Compacted:
    """`text` with every run of `RUN_SHOWN` or more identical whitespace characters (or identical
    hidden ones: controls, format characters), combining marks (categories Mn/Me) or tag characters
    shown as a count, `⟨250 spaces⟩`, `⟨40 tabs⟩`, `⟨100 combining marks⟩`, `⟨9 × U+200B⟩`; shorter
    runs stay literal. The model's own ⟨ and ⟩ are shown as escapes, so a marker cannot be forged."""
    parts: list[str] = []
    weight: list[int] = []
    inside: list[bool] = []
    i = 0
    while i < len(text):
        run = _run_kind(text, i)
        if run is not None:
            end, what = run
            marker = f"{MARK_OPEN}{end - i:,} {what}{MARK_CLOSE}"
            parts.append(marker)
            weight += [end - i] + [0] * (len(marker) - 1)
            inside += [False] + [True] * (len(marker) - 1)
            i = end
            continue
        char = text[i]
        shown = _escaped(char) if char in (MARK_OPEN, MARK_CLOSE) else char
        parts.append(shown)
        weight += [1] + [0] * (len(shown) - 1)
        inside += [False] + [True] * (len(shown) - 1)
        i += 1
    return Compacted("".join(parts), tuple(weight), tuple(inside))


def _cut_at(shown: Compacted, k: int) -> int:
    """Where to cut `shown` near `k`, never after it: at a grapheme boundary at most `CUT_BACK`
    characters back (else at `k`, inside the cluster: a 101-character cluster moved the end's cut
    past everything it was to show), and never inside a count marker (moved back to its start)."""
    text = shown.text
    cut = next((c for c in range(k, max(0, k - CUT_BACK) - 1, -1) if is_grapheme_boundary(text, c)), k)
    while 0 < cut < len(text) and shown.inside[cut]:
        cut -= 1
    return cut


def cut_middle(
    text: str, limit: int = ARGS_SHOWN, head_at: int = ARGS_HEAD, tail_at: int = ARGS_TAIL
) -> tuple[str, int]:
    """`text` as shown (`compact`), or its start and end around " … " when that is longer than
    `ARGS_SHOWN`, and how many characters of `text` were left out (a marker's run counts as its
    length). The end of a command is where the danger tends to be, so the end shows at least
    `ARGS_TAIL` characters and padding cannot push it out of sight."""
    shown = compact(text)
    if len(shown.text) <= limit:
        return shown.text, 0
    head = _cut_at(shown, head_at)
    tail = _cut_at(shown, len(shown.text) - tail_at)
    if tail <= head:  # one marker spans both cuts: a little over the limit, nothing left out
        return shown.text, 0
    return f"{shown.text[:head]} … {shown.text[tail:]}", sum(shown.weight[head:tail])


def literal(text: str) -> str:
    """`text` for the inside of a ``` block: every invisible or direction-changing character shown
    as its escape (`visible`; line breaks and tabs stay what they are, as the code block shows them),
    then a zero-width space after every backtick followed by another, so no run of backticks can
    close the block (Discord closes it at any ```). The only invisible characters left are those
    spaces: one the model wrote shows as `\\u200b`."""
    return re.sub("`(?=`)", "`\u200b", "\n".join(visible(line, keep="\t") for line in text.split("\n")))


def visible(text: str, keep: str = "") -> str:
    """`text` with every character that renders as nothing or reorders what follows (bidi overrides,
    isolates and marks, zero-width and other format characters, controls, line separators) written
    as its `\\u202e` escape: `ls \\u202e; rm -rf ~ #\\u202c` displayed reversed looked harmless."""
    return "".join(_escaped(c) if _hidden(c) and c not in keep else c for c in text)


def _hidden(char: str) -> bool:
    return unicodedata.category(char) in ("Cc", "Cf", "Zl", "Zp", "Cs") or char in INVISIBLE


def _escaped(char: str) -> str:
    code = ord(char)
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def code_span(text: str) -> str:
    """A name someone else chose (a chat display name, the server's `decided_by`, an ID typed in a
    command) for a bot message rendered as Markdown: in an inline code span it cannot become a link,
    bold or a mention (`[Verify your account](http://…)` as a Slack name was a masked link in the
    bot's own message); its backticks turn into quotes so it cannot close the span, its whitespace
    is collapsed, hidden characters are escaped, and a long one is cut."""
    flat = " ".join(text.split()).replace("`", "'") or "?"
    if len(flat) > NAME_SHOWN:
        cut = NAME_SHOWN
        while cut > 0 and not is_grapheme_boundary(flat, cut):
            cut -= 1
        flat = flat[:cut] + "…"
    return f"`{visible(flat)}`"


@dataclass(frozen=True)
class Posted:
    """A prompt's post as gateway.db remembers it: its key (`Target.key`), when its first attempt
    began, and its message ids once the platform answered (empty: the post may be in the chat)."""

    key: str
    attempted_at: float
    message_ids: tuple[str, ...]


class ApprovalBoard:
    """The pending prompts of this gateway, by call id. Their posts are remembered in gateway.db
    (`approval_prompts`), so a restarted gateway, to which the server sends the pending request
    again, reuses (and later edits) the prompt already in the chat instead of posting another."""

    def __init__(self, conn: sqlite3.Connection, now: float | None = None) -> None:
        self.prompts: dict[str, Prompt] = {}
        self._conn = conn
        self._change = asyncio.Event()  # set (and replaced) when a prompt is added or settled
        self._outcomes: Recent[Prompt] = Recent(FORGET_POSTED_S)  # account:chat:short id -> decided prompt
        # A call decided while no gateway ran is never settled here: its row goes after a week.
        with transaction(conn, durable=False) as c:
            c.execute("DELETE FROM approval_prompts WHERE attempted_at < ?", ((now or time.time()) - FORGET_POSTED_S,))

    def posted(self, call_id: str) -> Posted | None:
        row = self._conn.execute(
            "SELECT part_key, attempted_at, message_ids FROM approval_prompts WHERE call_id=?", (call_id,)
        ).fetchone()
        return Posted(row[0], float(row[1]), tuple(str(i) for i in json.loads(row[2]))) if row else None

    def note_attempt(self, prompt: Prompt, key: str, at: float) -> None:
        """Before the post goes out: after a crash in flight the prompt may be in the chat. The call,
        its chat and what the prompt shows are kept too, so a gateway that starts after the call
        ended (no request comes again for it) can still edit that prompt (`leftovers`)."""
        t = prompt.target
        with transaction(self._conn, durable=False) as c:
            c.execute(
                "INSERT OR IGNORE INTO approval_prompts (call_id, account, part_key, attempted_at, conversation,"
                " turn_id, chat, thread, reply_to, starter, name, arguments) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                (
                    prompt.call_id,
                    prompt.account,
                    key,
                    at,
                    prompt.conversation,
                    prompt.turn_id,
                    t.chat,
                    t.thread,
                    t.reply_to,
                    prompt.starter,
                    prompt.name,
                    prompt.arguments,
                ),  # fmt: skip
            )

    def leftovers(self) -> list[Prompt]:
        """The prompts gateway.db remembers that this process has not (yet) taken up again, rebuilt
        as shown (with the message ids of their post; none when its outcome is unknown). Rows of
        an older gateway, which kept no conversation, are left to expire."""
        rows = self._conn.execute(
            "SELECT call_id, account, conversation, turn_id, chat, thread, reply_to, starter, name, arguments,"
            " message_ids FROM approval_prompts WHERE conversation IS NOT NULL AND chat IS NOT NULL"
            " ORDER BY attempted_at"
        ).fetchall()
        found: list[Prompt] = []
        for row in rows:
            if not in_scope(self._conn, *(str(row[1]).partition(":")[::2])):
                continue  # a database other servers' gateways share: a prompt of an account run elsewhere
            if row[0] in self.prompts:
                found.append(self.prompts[row[0]])
                continue
            prompt = Prompt(
                call_id=row[0], conversation=row[2], turn_id=str(row[3] or ""), account=row[1],
                target=Target(row[4], row[5], row[6]), starter=str(row[7] or ""), name=str(row[8] or "a tool"),
                arguments=str(row[9] or ""), message_ids=[str(i) for i in json.loads(row[10] or "[]")],
            )  # fmt: skip
            prompt.shown.set()  # its post is done (or lost): nothing to wait for
            found.append(prompt)
        return found

    def cut_off(self, prompt: Prompt) -> Posted | None:
        """The post of a prompt this process did not take up (rebuilt by `leftovers`: its call was
        decided while no gateway ran) whose outcome is unknown: attempted, its id never noted (a crash
        while it was in flight). None for any other prompt: one of this process went through its own
        send, whose outcome it knows."""
        if prompt.message_ids or self.prompts.get(prompt.call_id) is prompt:
            return None
        posted = self.posted(prompt.call_id)
        return posted if posted is not None and not posted.message_ids else None

    def note_shown(self, call_id: str, message_ids: list[str]) -> None:
        with transaction(self._conn, durable=False) as c:
            c.execute("UPDATE approval_prompts SET message_ids=? WHERE call_id=?", (json.dumps(message_ids), call_id))

    def settled(self, call_id: str) -> None:
        """The call was decided: nothing more to reuse or edit after a restart."""
        with transaction(self._conn, durable=False) as c:
            c.execute("DELETE FROM approval_prompts WHERE call_id=?", (call_id,))
        self._changed()

    def note_outcome(self, prompt: Prompt) -> None:
        """Keep a decided prompt (for a week, in this process): a press on a copy of it the gateway
        never recorded (a post whose answer was lost in a crash, then posted again) shows its decision."""
        self._outcomes.put(_outcome_key(prompt.account, prompt.target.chat, prompt.short_id), prompt)

    def outcome(self, account: str, chat: str, ref: str) -> Prompt | None:
        """The decided prompt of this chat that `ref` names (as `find` matches it), if this process
        decided or heard the decision of its call; else None."""
        found = self._outcomes.get(_outcome_key(account, chat, ref.strip()[-SHORT_ID:]))
        return found if found is not None and _names(found, ref) else None

    def add(self, prompt: Prompt) -> bool:
        """False when this call already has a prompt (a re-sent request after a reconnect)."""
        if prompt.call_id in self.prompts:
            return False
        self.prompts[prompt.call_id] = prompt
        self._changed()
        return True

    def _changed(self) -> None:
        self._change.set()
        self._change = asyncio.Event()

    def remembered(self, account: str, chat: str, ref: str | None) -> Prompt | None:
        """The prompt in this chat that `ref` names (as `find` matches it) which gateway.db remembers
        as posted and not settled, but whose request this process has not been given (again) yet:
        after a start or a reconnect the server re-sends the requests of the calls still pending
        only once the gateway subscribes, and a click Slack (or any platform) held meanwhile is
        redelivered as soon as the adapter connects, before that. None when there is none."""
        if ref is None:
            return None
        for prompt in self.leftovers():
            if prompt.call_id in self.prompts or prompt.decided is not None:
                continue
            if prompt.account == account and prompt.target.chat == chat and _names(prompt, ref):
                return prompt
        return None

    async def announced(self, call_id: str, timeout: float) -> Prompt | None:
        """Wait (at most `timeout` s) until the server has (re)announced the request of `call_id`:
        its open prompt, or None once the call was settled (gateway.db forgot it: it was answered,
        timed out or cancelled meanwhile) or the wait ran out."""
        deadline = time.monotonic() + timeout
        while True:
            prompt = self.prompts.get(call_id)
            if prompt is not None:
                return prompt if prompt.decided is None else None
            if self.posted(call_id) is None:
                return None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            change = self._change
            try:
                await asyncio.wait_for(change.wait(), remaining)
            except TimeoutError:
                pass

    def find(self, account: str, chat: str, ref: str | None, thread: str | None = None) -> Prompt | None | list[Prompt]:
        """The open prompt in this chat that `ref` names, case-insensitively: by the ID the prompt
        shows (its short id) or its whole call id, nothing shorter (any suffix would let `/approve 1`
        answer whichever call happens to end in 1); when `ref` is None, the only open one of this
        `thread` (a bare `/approve` typed in another thread or forum topic answered a prompt its
        sender could not see from there), among the prompts that were posted (one whose post failed
        or is still in flight was never seen: a bare answer approved a call nobody was shown); a
        list when several match."""
        open_here = self.open_in_chat(account, chat)
        if ref is None:
            here = [p for p in open_here if (p.target.thread or None) == (thread or None)]
            in_thread = [p for p in here if p.message_ids]
            return in_thread[0] if len(in_thread) == 1 else (in_thread or None)
        hits = [p for p in open_here if _names(p, ref)]
        if not hits:
            return None
        return hits[0] if len(hits) == 1 else hits

    def open_in_chat(self, account: str, chat: str) -> list[Prompt]:
        """The open prompts of a chat, in every thread of it."""
        prompts = self.prompts.values()
        return [p for p in prompts if p.account == account and p.target.chat == chat and p.decided is None]

    def move_chat(self, account: str, old: str, new: str) -> int:
        """The prompts of chat `old` (of `account`, `channel:account`) now belong to chat `new`
        (gateway.db's rows were moved with `move_prompt_rows`): an answer from there finds them. Their
        posts stay in the old chat (`in_old_chat`). Returns how many were moved."""
        moved = [p for p in self.prompts.values() if p.account == account and p.target.chat == old]
        for prompt in moved:
            prompt.target = replace(prompt.target, chat=new)
            prompt.message_ids = in_old_chat(prompt.message_ids, old)
        return len(moved)

    def forget_turn(self, turn_id: str) -> None:
        for call_id in [c for c, p in self.prompts.items() if p.turn_id == turn_id]:
            del self.prompts[call_id]


def move_prompt_rows(c: sqlite3.Connection, account: str, old: str, new: str) -> int:
    """Inside the caller's transaction (`Ledger.move_chat`): the remembered prompts of chat `old` (of
    `account`, `channel:account`) belong to chat `new`, for a gateway that starts later; their posts
    stay in the old chat (`in_old_chat`). Returns how many."""
    rows = c.execute("SELECT call_id, message_ids FROM approval_prompts WHERE account=? AND chat=?", (account, old))
    moved = [(new, json.dumps(in_old_chat(json.loads(ids or "[]"), old)), call) for call, ids in rows.fetchall()]
    c.executemany("UPDATE approval_prompts SET chat=?, message_ids=? WHERE call_id=?", moved)
    return len(moved)


def in_old_chat(message_ids: list[str], old: str) -> list[str]:
    """The ids of a prompt's post made in chat `old` before the chat got a new id, as `<old>:<id>`
    (the form of an inbound message's id, which names its chat): the message is still there, and
    its bare number would name another message in the new chat. An id naming its chat stays."""
    return [i if ":" in str(i) else f"{old}:{i}" for i in map(str, message_ids)]


def pressed_gone_text(short_id: str) -> str:
    """A pressed prompt whose call no longer waits, for which this process knows no outcome."""
    return f"🔐 Approval request {code_span(short_id)}\n{PRESSED_GONE}"


PRESSED_TEXT_KEPT = 8000  # characters of a pressed message's text kept with the press (a prompt is shorter)


def pressed_message_of(raw: Mapping[str, Any]) -> dict[str, Any] | None:
    """What the pressed message shows, from the press as the platform delivered it (`InboundMessage.raw`):
    its text and its buttons' data, for `shows_prompt_of`. The platform fills it in, not the presser
    (a modified client chooses only the message and the data). Telegram: `callback_query.message`;
    Slack: `block_actions`' `message`. None when the press does not carry the message (Discord)."""
    query = raw.get("callback_query")
    if isinstance(query, Mapping):
        message = query.get("message")
        if not isinstance(message, Mapping):
            return None
        markup = message.get("reply_markup")
        rows = markup.get("inline_keyboard") if isinstance(markup, Mapping) else None
        buttons = [b.get("callback_data") for row in _list(rows) for b in _list(row) if isinstance(b, Mapping)]
        return _shown(message.get("text") or message.get("caption"), buttons)
    message = raw.get("message")
    if raw.get("type") == "block_actions" and isinstance(message, Mapping):
        blocks = [b for b in _list(message.get("blocks")) if isinstance(b, Mapping)]
        texts = [message.get("text")] + [_dict(b.get("text")).get("text") for b in blocks if b.get("type") == "section"]
        actions = [e for b in blocks if b.get("type") == "actions" for e in _list(b.get("elements"))]
        buttons = [e.get("value") for e in actions if isinstance(e, Mapping)]
        return _shown("\n".join(t for t in texts if isinstance(t, str)), buttons)
    return None


def shows_prompt_of(shown: object, ref: str) -> bool:
    """Whether a pressed message (`pressed_message_of`) is an approval prompt of exactly the call `ref`
    names: its text asks `Reply /approve <ref>` and it has approve/deny buttons, every one of them
    for `ref`. A bot's ordinary answer has no such buttons, and a prompt of another call names another ID."""
    if not isinstance(shown, Mapping) or not ref.strip():
        return False
    wanted = ref.strip().lower()
    text, buttons = shown.get("text"), shown.get("buttons")
    if not isinstance(text, str) or not isinstance(buttons, list):
        return False
    answers = [str(b).lower().partition(":") for b in buttons if str(b).lower().startswith(("approve:", "deny:"))]
    if not answers or any(named != wanted for _, _, named in answers):
        return False
    return re.search(rf"Reply /approve {re.escape(wanted)}(?!\w)", text, re.IGNORECASE) is not None


def _shown(text: object, buttons: list[Any]) -> dict[str, Any]:
    kept = text[:PRESSED_TEXT_KEPT] if isinstance(text, str) else ""
    return {
        "text": kept.encode("utf-16", "surrogatepass").decode("utf-16", "replace"),  # storable in SQLite
        "buttons": [b for b in buttons if isinstance(b, str)],
    }


def _list(value: object) -> list[Any]:
    return value if isinstance(value, list) else []


def _dict(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _outcome_key(account: str, chat: str, short_id: str) -> str:
    return f"{account}\n{chat}\n{short_id.lower()}"


def _names(prompt: Prompt, ref: str) -> bool:
    """`ref` is the prompt's short id or its whole call id (case-insensitively)."""
    wanted = ref.strip().lower()
    return wanted in (prompt.short_id.lower(), prompt.call_id.lower())
