"""The chat as a place to steer: pairing prompts and decisions, commands, approvals (issue 16).

`pairing_prompt` answers an unknown sender (their code, or "try later"; once per burst);
`watch_pairings` ends a revoked sender's queued turns as soon as gateway.db changes, and acts on
the owner's decisions within a second (release the kept messages as one turn per chat and thread,
then tell the sender without holding up the next look); `command` answers `/new`, `/cancel`,
`/status`, `/help`, `/pair`, `/approve`, `/deny` without a turn; `on_approval` shows an approval
prompt for a paused turn and keeps it up to date, whoever answers.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from functools import partial
from typing import Any

from appserver.client import Closed, ProtocolError
from gateway.access import POSTED_AS_CHAT
from gateway.accounts import AccountRunner
from gateway.approvals import (
    NO_LONGER_WAITING,
    OUTCOME_LINES,
    ApprovalBoard,
    Prompt,
    code_span,
    in_old_chat,
    pressed_gone_text,
    room_of,
    shows_prompt_of,
)
from gateway.commands import HELP, Command, bot_name, parse_command
from gateway.delivery import DeliveryFailed, Outbox, Outboxes
from gateway.ledger import Entry, Ledger, notice_key
from gateway.link import ServerLink
from gateway.pairing import (
    EXPIRED_UNAPPROVED,
    REVOKED_UNRELEASED,
    TOO_MANY_PENDING,
    Pairing,
    PairingCode,
    shown_id,
)
from gateway.recent import Recent
from gateway.replies import Replies, answer_target, write_until_done
from gateway.routing import RouteKey, Router
from plugins.contract import Target

log = logging.getLogger("gateway.chatops")

PERSON_MAX = 200  # characters of a clicker's display name sent as `on_behalf_of` (the server keeps 100)
# gateway.db's `data_version` is asked this often (ten microseconds) while the gateway follows a turn
# a revoke may have to end: a revoke is acted on within it. With none, less often (an idle gateway
# wakes four times a second; `pairing revoke` waits at most that long). Approvals, denials and
# expiries are looked at every PAIRING_POLL_S.
PAIRING_LOOK_S = 0.05
PAIRING_IDLE_LOOK_S = 0.25
PAIRING_POLL_S = 1.0
PROMPT_EVERY_S = 60.0
PROMPT_SHOWN_WAIT_S = 10.0
# A click (or `/approve ID`) on a prompt gateway.db remembers whose request the server has not
# announced again yet (the gateway just started or reconnected) waits this long for it.
ANNOUNCE_WAIT_S = 45.0
FAILURE_SHOWN = 200  # characters of the reason a prompt could not be posted, in the notice saying so
REFUSE_EVERY_S = 60.0  # a person pressing someone else's button again and again is refused once a minute
NOT_YOURS = "Only the person who started this, or an admin, can answer it."
# A prompt of a turn no message of a group started (a scheduled run, another client's turn): the
# gateway cannot tell who in the group asked for it.
ONLY_ADMINS = "No message here started this, so only an admin of this bot can answer it."
# To a starter whose access was taken away (a revoked pairing, removed from `allow`) answering their
# own prompt, and to anyone whose command was allowed before that and is handled after it.
NOT_LET_IN = "You are no longer allowed to use this bot."
NOT_LET_IN_ANSWER = "You are no longer allowed to use this bot, so you cannot answer this request."
# To a group whose anonymous admin (or a channel posting there) addressed the bot; once per 10 minutes
AS_CHAT_EVERY_S = 600.0
AS_CHAT_NOTICE = (
    "I can't answer messages posted anonymously or as a channel: I only answer people the owner lets in, "
    "by their own account. Post as yourself, or ask the owner to add {sender} to allow."
)
# To a sender whose pairing was approved; the second when nothing routes the chat to an agent.
APPROVED = "✅ You're approved. Your messages are on their way to the assistant."
APPROVED_UNROUTED = (
    "✅ You're approved, but this chat is not connected to an agent yet: nothing you write here is "
    "answered until the owner connects it."
)
# To a sender approved while the account takes no direct messages (`dm_policy = "disabled"`, set
# after their code was given): what they wrote is refused, and they are told so, never "on its way".
APPROVED_NO_DMS = (
    "✅ You're approved, but this bot does not take direct messages right now: what you wrote here "
    "was not passed on and will not be answered."
)
# Why a message never became (or never started) a turn: its sender's `/cancel` dropped it while it
# waited (held by debounce: never submitted; queued on the server: withdrawn before it started).
DROPPED_BY_CANCEL = "dropped by the sender's /cancel before it was submitted"
WITHDRAWN_BY_CANCEL = "withdrawn by /cancel before its turn started"
NOT_YOURS_TO_CANCEL = "Only the person who started the running reply, or an admin, can cancel it."


def by_conversation(entries: list[Entry]) -> list[list[Entry]]:
    """Split a sender's kept messages by chat and thread (a thread is a conversation of its own),
    keeping arrival order inside each group and ordering the groups by their first message."""
    groups: dict[tuple[str, str | None], list[Entry]] = {}
    for entry in entries:
        groups.setdefault((entry.chat, entry.thread), []).append(entry)
    return list(groups.values())


class ChatOps:
    def __init__(
        self,
        ledger: Ledger,
        router: Router,
        pairing: Pairing,
        link: ServerLink,
        outboxes: Outboxes,
        replies: Replies,
        runners: Mapping[str, AccountRunner],
        enqueue: Callable[[Entry], None],
    ) -> None:
        self.ledger = ledger
        self.router = router
        self.pairing = pairing
        self.link = link
        self.outboxes = outboxes
        self.replies = replies
        self.runners = runners
        self.enqueue = enqueue
        self.approvals = ApprovalBoard(ledger.connection)
        self._prompted: Recent[str] = Recent(PROMPT_EVERY_S)  # sender -> what they were told lately
        self._refused: Recent[bool] = Recent(REFUSE_EVERY_S)  # account:chat:sender:call -> refused lately
        self._told_as_chat: Recent[bool] = Recent(AS_CHAT_EVERY_S)  # account:chat:sender -> told lately
        self._reconciling = asyncio.Lock()
        self._notices: dict[str, asyncio.Task[None]] = {}  # account:chat -> its last pairing notice on its way
        self._notifying: set[str] = set()  # codes whose notice is on its way (handled once it is out)
        self._released: set[str] = set()  # approved codes whose kept messages this process queued
        self._started_at = time.time()  # a decision older than this process may have been told by the last

    async def pairing_prompt(self, entry: Entry, runner: AccountRunner, since: float | None = None) -> None:
        """Tell an unknown sender how to get through: their code, or "try later" (not when silent).
        Said under the entry's notice key (`since`: owed from before a restart, `Outboxes.say_once`)."""
        answer = self._answer_refusal(entry, runner)
        if answer is not None:  # a press or `/approve ID` on a prompt: the refusal, never a new code
            if answer:
                await self._say_owed(runner, entry, answer, since)
            return
        key = entry.key
        code: PairingCode | None = None
        if entry.reason != TOO_MANY_PENDING:  # refused for want of a slot: "try later", even if one freed since
            code, _new = self.pairing.code_for(
                key.channel, key.account, entry.sender, display_name(entry.payload), entry.chat
            )
        if runner.policy.silent:
            return
        asked = f"{key.channel}:{key.account}:{entry.sender}"
        said = code.code if code is not None else "later"
        if self._prompted.get(asked) == said:
            return  # a burst of messages from one stranger gets one answer, not one each
        self._prompted.put(asked, said)
        if code is None:
            text = "Too many people are waiting to be let in right now; please try again later."
        else:
            pretty = f"{code.code[:4]}-{code.code[4:]}"
            text = (
                f"Hi! This assistant only talks to people its owner has approved. Your pairing code is {pretty} "
                f"(valid for an hour). Ask the owner to run: appserver pairing approve {code.code}"
            )
        await self._say_owed(runner, entry, text, since)

    async def _say_owed(self, runner: AccountRunner, entry: Entry, text: str, since: float | None) -> None:
        """A notice `entry`'s decision owes (`Entry.owes_notice`), said under its key, once where the
        platform can dedupe or look up (a restart's repeat, `since`)."""
        await self.outboxes.say_once(runner, replace(answer_target(entry), key=notice_key(entry.key)), text, since)

    async def watch_pairings(self) -> None:
        """Act on the owner's revokes (from the CLI or elsewhere) as soon as gateway.db shows a change
        (`Pairing.data_version`, asked every `PAIRING_LOOK_S` while a turn is followed), and on their
        decisions every `PAIRING_POLL_S`: a message its sender writes in that second after an
        approval still joins the kept ones as one turn (docs/channels.md, "Pairing"), and a code
        expires with time."""
        loop = asyncio.get_running_loop()
        seen: int | None = None
        due = 0.0
        try:
            while True:
                version = self.pairing.data_version()
                if loop.time() >= due:
                    seen, due = version, loop.time() + PAIRING_POLL_S
                    await self._act_on_pairings()
                elif version != seen:
                    seen = version
                    await self._enforce_revokes()
                await asyncio.sleep(PAIRING_LOOK_S if self.replies.turns else PAIRING_IDLE_LOOK_S)
        except asyncio.CancelledError:  # the gateway stops: a notice not out yet is sent at the next start
            for task in list(self._notices.values()):
                task.cancel()
            raise

    async def _enforce_revokes(self) -> None:
        """End the queued turns of senders access no longer lets in (a revoke), then note in
        gateway.db that every revoke counted before was acted on (`Pairing.mark_applied`: what
        `pairing revoke` waits for)."""
        made, applied = self.pairing.changes()
        try:
            await self.replies.refuse_queued()  # a revoke is seen only here: queued turns it ends never start
        except Exception:  # the decisions must go on: the next look tries again
            log.exception("could not look for queued turns of senders no longer let in")
            return  # not acted on: a waiting `pairing revoke` is not told it was
        if made > applied:
            await write_until_done("pairing revokes: applied", partial(self.pairing.mark_applied, made))

    async def _act_on_pairings(self) -> None:
        """A full look: revokes first (`_enforce_revokes`), then each decision not acted on yet.
        Nothing here waits on a chat: each notice goes out on its own (`_notify`)."""
        await self._enforce_revokes()
        for decided in self.pairing.decided_unhandled():
            if decided.code in self._notifying:
                continue  # acted on, its notice on its way: handled once it is out
            runner = self.runners.get(f"{decided.channel}:{decided.account}")
            if runner is None or runner.adapter is None or not runner.adapter.is_running:
                continue  # not configured or not running here: act on it once it runs
            acted, notice = self._act_on_decision(decided, runner)
            if not acted:
                continue  # revoked meanwhile: handled as `revoked` at the next look
            if notice is None:
                await write_until_done(
                    f"pairing {decided.code}: handled", partial(self.pairing.mark_handled, decided.code)
                )
            else:
                self._notify(runner, decided, notice)

    def _act_on_decision(self, decided: PairingCode, runner: AccountRunner) -> tuple[bool, str | None]:
        """Release or refuse what `decided` kept; returns whether it was acted on (not an approval
        revoked meanwhile) and what to tell its sender (None: nothing)."""
        held = self.ledger.held(decided.channel, decided.account, decided.sender)
        if decided.status == "expired":
            # never approved in time: what it kept can never be released (a later code keeps the
            # messages written after this one expired)
            self._refuse_kept(held, decided.expires_at, EXPIRED_UNAPPROVED)
            return True, None
        if decided.status == "revoked":
            # approved, then revoked before it was acted on: revoke wins, the stranger hears nothing
            self._refuse_kept(held, decided.expires_at, REVOKED_UNRELEASED)
            return True, None
        if decided.status == "approved":
            barred = self._barred(decided, runner)
            if barred is not None:
                self._refuse_kept(held, time.time(), f"pairing {decided.code} approved, but {barred}")
                return True, APPROVED_NO_DMS
            released = self._release(decided)
            return released, self._approved_notice(decided, runner) if released else None
        for entry in held:
            self.ledger.refuse(entry.key, f"pairing {decided.code} denied")
        notice = runner.settings.get("deny_notice")
        return True, notice if isinstance(notice, str) and notice.strip() else None

    def _notify(self, runner: AccountRunner, decided: PairingCode, text: str) -> None:
        """Tell `decided`'s sender in a task of its own, after the notices before it in the same chat,
        then mark the decision handled. A notice that waits out a rate limit or a slow platform (the
        outbox's budget, about a minute) holds up no look at the pairings, so no revoke either; while
        it is on its way the decision is skipped, so it is sent once (a gateway stopped before it went
        out sends it at its next start, as before)."""
        chat = f"{runner.spec.ref}:{decided.chat}"
        self._notifying.add(decided.code)
        task = asyncio.ensure_future(self._tell(self._notices.get(chat), runner, decided, text))
        self._notices[chat] = task
        task.add_done_callback(partial(self._told, chat, decided.code))

    async def _tell(
        self, before: asyncio.Task[None] | None, runner: AccountRunner, decided: PairingCode, text: str
    ) -> None:
        if before is not None:
            await asyncio.wait({before})  # the chat's earlier notice first (its failure is its own)
        # Under a key of its own: a notice the gateway before a restart may have sent (its decision
        # is older than this process) is deduped or looked up where the platform can, not said twice.
        decided_at = decided.decided_at
        since = decided_at if decided_at is not None and decided_at < self._started_at else None
        target = Target(decided.chat, key=f"{runner.spec.ref}:pairing:{decided.code}")
        await self.outboxes.say_once(runner, target, text, since)
        # its notice is out: a failed write here would send it again at the next look
        await write_until_done(f"pairing {decided.code}: handled", partial(self.pairing.mark_handled, decided.code))

    def _told(self, chat: str, code: str, task: asyncio.Task[None]) -> None:
        self._notifying.discard(code)
        if self._notices.get(chat) is task:
            del self._notices[chat]
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("the notice of pairing %s failed; it is tried again at the next look", code, exc_info=exc)

    def _approved_notice(self, decided: PairingCode, runner: AccountRunner) -> str:
        """What an approved sender is told: that their messages go to the agent, unless nothing
        routes the chat (no route, no `default_agent`), when none will answer them."""
        try:
            key = RouteKey.of(decided.channel, decided.account, decided.chat, None)
        except ValueError:  # a chat id no route can name: no route either
            return APPROVED_UNROUTED
        if self.router.resolve(key, runner.settings.get("default_agent")) is None:
            return APPROVED_UNROUTED
        return APPROVED

    def _barred(self, decided: PairingCode, runner: AccountRunner) -> str | None:
        """Why the account's policy *now* refuses the direct messages of `decided`'s sender, approved
        as they are (`dm_policy = "disabled"`, set after the code was given), or None. A code is
        given in a DM, so what it kept are DMs: released, they failed at once as "access taken
        away" after the sender was told they were on their way. Asked only while still approved (a
        revoke meanwhile is `_release`'s to settle: the sender hears nothing)."""
        channel, account, sender = decided.channel, decided.account, decided.sender
        if not self.pairing.is_approved(channel, account, sender):
            return None
        verdict, reason = runner.policy.decide(
            chat_type="dm", sender=sender, sender_is_bot=False, mentions_bot=True, approved=True
        )
        return None if verdict == "allow" else reason

    def _release(self, decided: PairingCode) -> bool:
        """Release an approved sender's kept messages as one turn per conversation, re-checking the
        approval in the same transaction: a `pairing revoke` that came after the approval (and before
        this) wins. False when the sender is no longer approved (nothing released)."""
        channel, account, sender = decided.channel, decided.account, decided.sender
        released = self.ledger.release_held(
            channel,
            account,
            sender,
            f"pairing {decided.code} approved",
            lambda: self.pairing.is_approved(channel, account, sender),
        )
        if released is None:
            now = self.pairing.get(decided.code)
            if now is None or now.status != "revoked":  # the approval went some other way: refuse what it kept
                self._refuse_kept(self.ledger.held(channel, account, sender), time.time(), REVOKED_UNRELEASED)
                self.pairing.mark_handled(decided.code)
            return False
        if decided.code in self._released:
            return True  # queued by this process already (its notice failed): not queued twice
        # An earlier run whose batch write failed (a lost session, a busy gateway.db) released them,
        # never queued: `release_held` run again returns them (allowed, by this approval), batched now.
        for kept in by_conversation(released):  # each where it was written, in order
            if len(kept) > 1:  # a conversation's kept messages are its first turn, together
                self.ledger.assign_batch([e.key for e in kept])
        for kept in by_conversation(released):
            self.enqueue(kept[0])
        self._released.add(decided.code)
        return True

    def _refuse_kept(self, held: list[Entry], until: float, reason: str) -> None:
        """Refuse the kept messages of a code that ended at `until` (later ones belong to a newer code)."""
        for entry in held:
            if entry.updated_at <= until:
                self.ledger.refuse(entry.key, reason)

    async def refuse_answer(self, entry: Entry, runner: AccountRunner, since: float | None = None) -> None:
        """A refused message that answers an approval prompt waiting in its chat (a button press, or
        `/approve ID` naming it) still gets the documented short refusal: the presser is someone access
        does not let in, and otherwise hears nothing (a button's own answer is neutral). Once a minute
        per person and prompt, so pressing again and again does not flood the chat."""
        if entry.reason == POSTED_AS_CHAT:
            await self._posted_as_chat(entry, runner, since)
            return
        refusal = self._answer_refusal(entry, runner)
        if refusal:
            await self._say_owed(runner, entry, refusal, since)

    def _answer_refusal(self, entry: Entry, runner: AccountRunner) -> str | None:
        """None when `entry` answers no prompt waiting in its chat (`/approve ID`, or a bare
        `/approve` where one waits); else the refusal to say ("" when said within the minute)."""
        if entry.payload.get("sender_is_bot"):
            return None
        command = parse_command(str(entry.payload.get("text") or ""), bot_name(runner.adapter))
        if command is None or command.name not in ("approve", "deny"):
            return None
        if command.args:
            prompt = self._open_or_remembered(runner, entry.chat, command.args[0])
        else:  # a bare one answers the prompt waiting here (its sender's, when several wait)
            here = self.approvals.open_in_chat(runner.spec.ref, entry.chat)
            prompt = next((p for p in here if p.starter == entry.sender), here[0] if here else None)
        if prompt is None:
            return None
        return self._refusal(entry, runner, prompt)

    async def _posted_as_chat(self, entry: Entry, runner: AccountRunner, since: float | None) -> None:
        """An anonymous admin or a channel addressed the bot where a person would be answered: say
        why nothing comes (they cannot pair), once per 10 minutes per chat and sender."""
        if runner.policy.silent or not entry.payload.get("mentions_bot"):
            return
        told = f"{runner.spec.ref}:{entry.chat}:{entry.sender}"
        if self._told_as_chat.get(told):
            return
        self._told_as_chat.put(told, True)
        await self._say_owed(runner, entry, AS_CHAT_NOTICE.format(sender=entry.sender), since)

    def _refusal(self, entry: Entry, runner: AccountRunner, prompt: Prompt) -> str:
        """Why `entry`'s sender cannot answer `prompt`, once a minute per person and prompt ("" within
        the minute): the truth for its own starter, whom access no longer lets in, else NOT_YOURS."""
        asked = f"{runner.spec.ref}:{entry.chat}:{entry.sender}:{prompt.call_id}"
        if self._refused.get(asked):
            return ""
        self._refused.put(asked, True)
        if entry.sender == prompt.starter and not self.lets_in(entry, runner):
            return NOT_LET_IN_ANSWER
        return NOT_YOURS if prompt.starter else ONLY_ADMINS

    def lets_in(self, entry: Entry, runner: AccountRunner) -> bool:
        """Whether the account's access lets `entry`'s sender in *now* (listed, paired, an admin, or
        open to all), as if the message were addressed to the bot: an answer or a command is acted
        on only for such a sender, also one allowed before a `pairing revoke` or a restart that took
        them out of `allow`, and also where a group's mention rule has an exception for answers."""
        key, p = entry.key, entry.payload
        verdict, _reason = runner.policy.decide(
            chat_type=str(p.get("chat_type") or ""),
            sender=entry.sender,
            sender_is_bot=bool(p.get("sender_is_bot")),
            mentions_bot=True,
            approved=self.pairing.is_approved(key.channel, key.account, entry.sender),
        )
        return verdict == "allow"

    def _open_or_remembered(self, runner: AccountRunner, chat: str, ref: str) -> Prompt | None:
        """The open prompt `ref` names in this chat, or one gateway.db remembers whose request has
        not come again yet (right after a start or a reconnect)."""
        found = self.approvals.find(runner.spec.ref, chat, ref)
        if isinstance(found, Prompt):
            return found
        return self.approvals.remembered(runner.spec.ref, chat, ref) if found is None else None

    def answers_own_prompt(self, entry: Entry, runner: AccountRunner) -> bool:
        """Whether `entry` is `/approve ID` or `/deny ID` naming an open prompt in its chat, from the
        person who may answer it and whom access still lets in: in a group that counts only
        mentions, typing it without one is still an answer (as the prompt says), not a message the
        bot ignores."""
        command = parse_command(str(entry.payload.get("text") or ""), bot_name(runner.adapter))
        if command is None or command.name not in ("approve", "deny") or not command.args:
            return False
        prompt = self._open_or_remembered(runner, entry.chat, command.args[0])
        if prompt is None or not (entry.sender == prompt.starter or runner.policy.is_admin(entry.sender)):
            return False
        return self.lets_in(entry, runner)  # a starter whose access was taken away answers nothing

    async def move_chat(self, channel: str, account: str, old: str, new: str) -> None:
        """A chat has a new id for good (an adapter's `move_chat`: a Telegram group upgraded to a
        supergroup): its routes, bound conversations, waiting approval prompts and messages not
        submitted yet follow it, in gateway.db (one transaction) and in the prompts this process
        shows, so the chat goes on with its history and a pending request is answerable from the
        new id. A message held in memory (a debounce buffer) is read again from its row as it is
        submitted (`Gateway._submit_batch`), so it too goes where the chat is now."""
        if old == new:
            return
        moved = self.ledger.move_chat(channel, account, old, new)
        shown = self.approvals.move_chat(f"{channel}:{account}", old, new)
        if moved or shown:
            log.info(
                "%s:%s: chat %s is now %s: moved %d route(s), %d conversation(s), %d approval prompt(s),"
                " %d waiting message(s)",
                channel, account, old, new, moved.routes, moved.conversations, max(moved.prompts, shown),
                moved.messages,
            )  # fmt: skip

    async def command(self, entry: Entry, runner: AccountRunner, command: Command, *, dropped: int = 0) -> str:
        """The gateway's answer to a chat command (gateway/commands.py); never a turn. `dropped`: how
        many of a `/cancel`'s sender's messages held by debounce the caller dropped (`Gateway._run_command`)."""
        route_key = RouteKey.of(entry.key.channel, entry.key.account, entry.chat, entry.thread)
        resolution = self.router.resolve(route_key, runner.settings.get("default_agent"))
        conversation = resolution.conversation if resolution is not None else None
        if not self.lets_in(entry, runner):  # allowed, then access was taken away before it was handled
            log.info(
                "%s: a /%s from %s, whom access no longer lets in: ignored", runner.spec.ref, command.name, entry.key
            )
            return NOT_LET_IN
        try:
            if command.name == "help":
                return HELP
            if command.name == "new":
                if resolution is None:
                    return "This chat is not connected to an agent yet."
                if resolution.pinned:  # the operator chose this chat's conversation; it is not ours to drop
                    return (
                        f"📌 This chat is pinned to conversation {conversation} by the operator, so it cannot start"
                        " a new one: your next message continues it."
                    )
                await write_until_done(f"/new: forget {route_key}", partial(self.router.forget, route_key))
                # A reply still being written goes on (it may be someone else's, whom /new must not
                # silence), but stays within reach: /cancel and /status here still find it.
                active = await self.active_turn(conversation) if conversation is not None else None
                if active is not None:
                    turn_id, paused = active
                    return "🆕 Your next message starts a new conversation. " + self._left_behind(
                        entry, runner, turn_id, paused
                    )
                return "🆕 Your next message starts a new conversation."
            if command.name == "cancel":
                return await self.cancel(entry, runner, conversation, dropped)
            if command.name == "status":
                text = await self.status_text(resolution.agent if resolution else None, conversation)
                for conv, turn_id, paused in await self._earlier_active(entry, runner, conversation):
                    text += " " + self._earlier_line(entry, runner, conv, turn_id, paused)
                return text
            if command.name == "pair":
                if not runner.policy.is_admin(entry.sender):
                    return "Only an admin of this bot can list pairing requests."
                if entry.payload.get("chat_type") != "dm":  # the codes and names are not for everyone here
                    return "/pair lists pairing requests only in a direct message with the bot: write it to me there."
                pending = [
                    p
                    for p in self.pairing.pending()
                    if (p.channel, p.account) == (entry.key.channel, entry.key.account)
                ]
                if not pending:
                    return "No pending pairing requests."
                lines = [self._pending_line(p) for p in pending]
                return "Pending pairing requests (approve with: appserver pairing approve CODE):\n" + "\n".join(lines)
            return await self.answer_approval(entry, runner, command)
        except (ProtocolError, Closed, TimeoutError) as exc:
            return f"⚠ The server did not answer: {exc}"

    @staticmethod
    def _pending_line(p: PairingCode) -> str:
        """A `/pair` line: the code, the sender's id exactly (hidden characters escaped, never cut: two
        senders called `alice` differ there) and the name they gave, if any."""
        sender = "`" + shown_id(p.sender).replace("`", "\\x60") + "`"
        named = f" {code_span(p.sender_name)}" if p.sender_name and p.sender_name != p.sender else ""
        return f"{p.code}  {sender}{named}"

    async def cancel(self, entry: Entry, runner: AccountRunner, conversation: str | None, dropped: int = 0) -> str:
        """`/cancel`: what its sender may stop that the agent has not finished. First what has not
        started: their messages held by debounce (`dropped` by the caller: never submitted) and the
        chat's turns still queued on the server (withdrawn: a `cancel` naming a turn that has not
        started drops it, nothing of it written to the history; queued first, as stopping the
        running turn would start the next). Then the running turn of the chat's conversation; when
        none runs there, the turns this chat started in a conversation it left with `/new` that still
        run (nobody could stop them from the chat otherwise). A turn only by the person who started
        it, or an admin: a message waiting behind someone's turn gives no say over it."""
        active: dict[str, str | None] = {}

        async def running_in(conv: str) -> str | None:
            if conv not in active:
                active[conv] = await self.running_turn(conv)
            return active[conv]

        for turn_id, ctx in self.replies.turns_in(runner.spec.ref, entry.chat, entry.thread):
            if ctx.conversation is None or not self._may_cancel(entry, runner, turn_id):
                continue
            if await running_in(ctx.conversation) != turn_id:
                dropped += await self.replies.withdraw(turn_id, WITHDRAWN_BY_CANCEL)
        targets: list[tuple[str, str]] = []
        if conversation is not None:
            running = await running_in(conversation)
            if running is not None:
                targets.append((conversation, running))
        earlier = False
        if not targets:
            targets = await self.earlier_running(entry, runner, conversation)
            earlier = bool(targets)
        allowed = [(conv, turn_id) for conv, turn_id in targets if self._may_cancel(entry, runner, turn_id)]
        cancelled = 0
        for conv, turn_id in allowed:
            # naming the turn: if it ended meanwhile, the next one (someone else's) runs on
            ack = await self.link.request({"type": "cancel", "conversation": conv, "turn_id": turn_id})
            cancelled += bool(ack.get("cancelled"))
        if cancelled:
            said = "⏹ Cancelled the reply from before /new." if earlier else "⏹ Cancelled."
        elif targets and not allowed:
            said = NOT_YOURS_TO_CANCEL
        else:
            said = "" if dropped else "Nothing is running."
        return f"{said} {_dropped_line(dropped)}".strip() if dropped else said

    def _may_cancel(self, entry: Entry, runner: AccountRunner, turn_id: str) -> bool:
        """Whether `entry`'s sender may cancel `turn_id`: an admin, or the person who started it; for
        a turn no message started (a scheduled run, another client's turn in the chat's
        conversation), whoever may answer its approvals here (`unstarted_answerer`)."""
        if runner.policy.is_admin(entry.sender):
            return True
        starter = self.replies.starter_of(turn_id)
        if starter is None:
            starter = self._unstarted_starter(entry, turn_id)
        return starter is not None and starter == entry.sender

    def _unstarted_starter(self, entry: Entry, turn_id: str) -> str | None:
        """Who besides admins may stop `turn_id`, which no message of this gateway started: the rule
        its approval prompt here was shown with, else the chat's (`unstarted_answerer`)."""
        shown = next((p for p in self.approvals.prompts.values() if p.turn_id == turn_id), None)
        if shown is not None:
            return shown.starter or None
        return unstarted_answerer(entry) or None

    def _left_behind(self, entry: Entry, runner: AccountRunner, turn_id: str, paused: bool) -> str:
        """What `/new` says of the reply it leaves behind in the previous conversation (it goes on),
        and who can stop it: "/cancel stops it" only to someone whose `/cancel` would."""
        if paused:
            waits = self._approval_ref(turn_id)
            said = f"The reply in the previous one waits for an approval{waits} and goes on once it is answered"
        else:
            said = "The reply still being written in the previous one goes on"
        if self._may_cancel(entry, runner, turn_id):
            return f"{said}: /cancel stops it."
        return f"{said}: {_WHO_CANCELS}."

    def _earlier_line(self, entry: Entry, runner: AccountRunner, conv: str, turn_id: str, paused: bool) -> str:
        """What `/status` says of a turn from before `/new` that still runs or waits for an approval."""
        what = "A reply from before /new waits for an approval" if paused else "Still writing a reply from before /new"
        who = "/cancel stops it" if self._may_cancel(entry, runner, turn_id) else _WHO_CANCELS
        return f"{what}: {turn_id} in conversation {conv}{self._approval_ref(turn_id)} ({who})."

    def _approval_ref(self, turn_id: str) -> str:
        """The open approval requests of `turn_id`, as ` (request `ID`)`, or ""."""
        waiting = [p for p in self.approvals.prompts.values() if p.turn_id == turn_id and p.decided is None]
        return f" (request {', '.join(code_span(p.short_id) for p in waiting)})" if waiting else ""

    async def earlier_running(
        self, entry: Entry, runner: AccountRunner, conversation: str | None
    ) -> list[tuple[str, str]]:
        """(conversation, turn id) of each turn started in this chat (and thread) in another
        conversation than its current one (left with `/new`) that still runs, oldest first."""
        return [(conv, turn_id) for conv, turn_id, _paused in await self._earlier_active(entry, runner, conversation)]

    async def _earlier_active(
        self, entry: Entry, runner: AccountRunner, conversation: str | None
    ) -> list[tuple[str, str, bool]]:
        """`earlier_running`, each with whether it is paused for an approval."""
        found: list[tuple[str, str, bool]] = []
        for turn_id, ctx in self.replies.turns_in(runner.spec.ref, entry.chat, entry.thread):
            if ctx.conversation is None or ctx.conversation == conversation:
                continue
            if any(conv == ctx.conversation and turn == turn_id for conv, turn, _ in found):
                continue
            active = await self.active_turn(ctx.conversation)
            if active is not None and active[0] == turn_id:
                found.append((ctx.conversation, turn_id, active[1]))
        return found

    async def running_turn(self, conversation: str) -> str | None:
        """The id of the conversation's running turn: `cancel` stops that one, so only its starter
        may ask (having a message queued behind it is no claim on it)."""
        active = await self.active_turn(conversation)
        return active[0] if active is not None else None

    async def active_turn(self, conversation: str) -> tuple[str, bool] | None:
        """The conversation's running turn (or one paused for an approval), and whether it is paused."""
        state = await self.link.request({"type": "subscribe", "conversation": conversation})
        active = state.get("active_turn") or {}
        turn_id = active.get("turn_id")
        if not turn_id:
            return None
        return str(turn_id), active.get("status") == "awaiting" or state.get("state") == "awaiting"

    async def status_text(self, agent: str | None, conversation: str | None) -> str:
        if agent is None:
            return "This chat is not connected to an agent yet."
        if conversation is None:
            return f"Agent: {agent}. No conversation yet: your next message starts one."
        state = await self.link.request({"type": "subscribe", "conversation": conversation})
        active = state.get("active_turn") or {}
        running = f"; running {active.get('turn_id')} ({active.get('phase')})" if active else ""
        return (
            f"Agent: {agent}. Conversation {conversation}: {state.get('state')}, "
            f"{int(state.get('queued') or 0)} queued{running}."
        )

    async def on_approval(self, frame: dict[str, Any]) -> None:
        call_id = str(frame.get("call_id") or "")
        if frame.get("type") == "approval_resolved":
            prompt = self.approvals.prompts.get(call_id)
            if prompt is not None and prompt.decided is None:
                who = frame.get("decided_by")
                line = OUTCOME_LINES.get(str(frame.get("status")), str(frame.get("status")))
                by = f" by {code_span(str(who))}" if who and frame.get("status") in ("approved", "denied") else ""
                await self.decided(prompt, f"{line}{by}")
            return
        ctx = await self.replies.context(str(frame.get("turn_id")))
        if ctx is None:  # not a turn this gateway started: a scheduled run, another client's turn
            await self._unstarted_approval(frame, call_id)
            return
        if ctx.conversation is None and not frame.get("conversation_id"):
            return
        if not self.replies.admits(ctx):
            return  # queued, and its sender was revoked meanwhile: cancelled, nothing is shown
        prompt = Prompt(
            call_id=call_id,
            conversation=str(frame.get("conversation_id") or ctx.conversation),
            turn_id=str(frame.get("turn_id")),
            account=ctx.runner.spec.ref,
            target=replace(ctx.here, reply_to=ctx.reply_to),  # it answers the turn's message
            starter=ctx.starter,
            name=str(frame.get("name") or "a tool"),
            arguments=str(frame.get("arguments") or ""),
        )
        await self._post_prompt(prompt, ctx.runner)

    async def _post_prompt(self, prompt: Prompt, runner: AccountRunner) -> None:
        """Show a new prompt in its chat, once per call (a re-sent request after a reconnect is not)."""
        if not self.approvals.add(prompt):
            return
        try:
            await self.show_prompt(prompt, runner)
        except Exception as exc:  # noqa: BLE001 - a prompt that cannot be shown leaves the CLI to answer
            log.warning("%s: could not show the approval prompt: %s", prompt.account, exc)
            # a database's error is the operator's (in the log), never quoted into a chat
            reason = "the gateway could not write it down" if isinstance(exc, sqlite3.Error) else str(exc)
            await self._prompt_failed(prompt, runner, reason)
        finally:
            prompt.shown.set()

    async def _unstarted_approval(self, frame: dict[str, Any], call_id: str) -> None:
        """An approval request of a turn no chat message started, in a conversation a chat of this
        gateway writes in (a run of a task the chat scheduled, a turn another client submitted
        there): shown in that chat, or the run waited unseen for its timeout while the chat's own
        messages queued behind it, and nobody there could answer or cancel it. Who may answer is
        the chat's rule for a turn with no starter (`unstarted_answerer`). A chat access no longer
        lets in (its last sender revoked) is shown nothing: the CLI can still answer."""
        conversation = str(frame.get("conversation_id") or "")
        chat = self.ledger.last_admitted_in(conversation) if conversation else None
        runner = self.runners.get(f"{chat.key.channel}:{chat.key.account}") if chat is not None else None
        if chat is None or runner is None or runner.adapter is None or not runner.adapter.is_running:
            return
        if not self.lets_in(chat, runner):
            log.info("%s: approval %s of a turn in %s: its chat's sender is no longer let in", runner.spec.ref,
                     call_id, conversation)  # fmt: skip
            return
        prompt = Prompt(
            call_id=call_id,
            conversation=conversation,
            turn_id=str(frame.get("turn_id")),
            account=runner.spec.ref,
            target=Target(chat.chat, chat.thread),
            starter=unstarted_answerer(chat),
            name=str(frame.get("name") or "a tool"),
            arguments=str(frame.get("arguments") or ""),
        )
        log.info("%s: approval %s of turn %s, which no message of %s started: shown there", runner.spec.ref,
                 call_id, prompt.turn_id, chat.chat)  # fmt: skip
        await self._post_prompt(prompt, runner)

    async def _prompt_failed(self, prompt: Prompt, runner: AccountRunner, reason: str) -> None:
        """A prompt the platform refused (or never answered): the chat hears that a request waits
        that it was not shown (it saw only "waiting for approval"), and `channels status` counts the
        failure. A bare `/approve` does not answer it (`ApprovalBoard.find`): nobody saw what it runs."""
        self.replies.send_failed(runner, f"approval prompt {prompt.short_id} not shown: {reason}")
        ref = code_span(prompt.short_id)
        notice = (
            f"⚠️ An approval request ({ref}, for {code_span(prompt.name)}) could not be shown here:"
            f" {code_span(reason[:FAILURE_SHOWN])}. Deny it with /deny {prompt.short_id}, or read the whole call"
            f" (`appserver conversations history`) before approving it with /approve {prompt.short_id}."
        )
        await self.outboxes.say(runner, prompt.target, notice)

    async def show_prompt(self, prompt: Prompt, runner: AccountRunner) -> None:
        """Post the prompt through the outbox, like every send, and only once: a prompt posted
        before a restart (gateway.db remembers it) is reused; one whose post was in flight at the
        crash is looked up or deduped by its key where the platform allows."""
        earlier = self.approvals.posted(prompt.call_id)
        if earlier is not None and earlier.message_ids:
            prompt.message_ids = list(earlier.message_ids)
            log.info("%s: reusing the approval prompt %s posted before", prompt.account, prompt.message_ids)
            return
        outbox = self.outboxes.of(runner)
        if earlier is None:
            key, since = f"{prompt.account}:approval:{prompt.call_id}", None
            await write_until_done(
                f"approval {prompt.call_id}: its post", partial(self.approvals.note_attempt, prompt, key, time.time())
            )
        else:
            key, since = earlier.key, earlier.attempted_at
        text = prompt.text(room_of(outbox.adapter))
        posted_in = prompt.target.chat
        sent = await outbox.prompt(replace(prompt.target, key=key), text, prompt.short_id, since=since)
        # The chat got a new id while the post was in flight (`move_chat`): its bare ids name
        # messages of the chat it was posted in, as the ids moved with the prompt do.
        moved = prompt.target.chat != posted_in
        prompt.message_ids = in_old_chat(sent.ids, posted_in) if moved else list(sent.ids)
        await write_until_done(
            f"approval {prompt.call_id}: posted", partial(self.approvals.note_shown, prompt.call_id, prompt.message_ids)
        )

    async def answer_approval(self, entry: Entry, runner: AccountRunner, command: Command) -> str:
        """`/approve ID` or `/deny ID`, typed or clicked. A click that finds nothing waiting (the
        second of a double click, a prompt decided meanwhile) gets no answer in the chat: the pressed
        prompt is edited to its decision (`_settle_pressed`), and the platform's own answer to the
        click is neutral."""
        pressed = bool(entry.payload.get("pressed"))
        ref = command.args[0] if command.args else None
        found = self.approvals.find(runner.spec.ref, entry.chat, ref, thread=entry.thread)
        if found is None and ref is not None:
            found = await self._announced(runner, entry.chat, ref)
        if found is None:
            if pressed:
                log.info("%s: a click on an answered approval prompt in %s", runner.spec.ref, entry.chat)
                if ref is not None and self.approvals.remembered(runner.spec.ref, entry.chat, ref) is None:
                    await self._settle_pressed(entry, runner, ref, None)
                return ""
            open_here = self.approvals.open_in_chat(runner.spec.ref, entry.chat) if ref is None else []
            unshown = [p for p in open_here if not p.message_ids and p.shown.is_set()]  # its post failed
            if unshown:  # a bare /approve does not answer it (nobody saw what it runs), but it waits
                return unshown_waiting(unshown)
            elsewhere = [p for p in open_here if p.message_ids]  # one never shown is not offered
            if elsewhere:  # in another thread or topic: named by its ID, it is answered from here too
                ids = ", ".join(code_span(p.short_id) for p in elsewhere)
                return f"No request waiting for an answer in this thread; in other threads of this chat: {ids}."
            return "No request waiting for an answer here" + (f" with ID {code_span(ref)}." if ref else ".")
        if isinstance(found, list):
            return "Several requests are waiting; answer with the ID: " + ", ".join(p.short_id for p in found)
        prompt = found
        may_answer = entry.sender == prompt.starter or runner.policy.is_admin(entry.sender)
        if not may_answer or not self.lets_in(entry, runner):
            # a member let in, pressing someone else's button again and again, hears it once a minute too;
            # access is asked again: waiting for the server's announcement may have taken a while
            return self._refusal(entry, runner, prompt)
        decision = "approve" if command.name == "approve" else "deny"
        person = str(entry.payload.get("sender_name") or entry.sender)[:PERSON_MAX]
        ack = await self.link.request(
            {
                "type": "approval_response",
                "conversation": prompt.conversation,
                "decisions": [{"call_id": prompt.call_id, "decision": decision}],
                # who decided, for the model's "denied … by" and other clients (docs/protocol.md)
                "on_behalf_of": person,
            }  # fmt: skip
        )
        result = (ack.get("results") or [{}])[0]
        if result.get("accepted") is False:
            if pressed:
                await self._settle_pressed(entry, runner, prompt.short_id, prompt)
            return "" if pressed else "That request was already answered."
        who = code_span(person)  # their name, shown literally
        await self.decided(prompt, f"{OUTCOME_LINES['approved' if decision == 'approve' else 'denied']} by {who}")
        if pressed:
            await self._settle_pressed(entry, runner, prompt.short_id, prompt)
        return ""

    async def _settle_pressed(self, entry: Entry, runner: AccountRunner, ref: str, prompt: Prompt | None) -> None:
        """A press on a prompt whose call no longer waits: the pressed message itself (the press
        names it) is edited to the decision, without buttons, also when this gateway never recorded
        that message as the call's prompt (a post whose answer was lost in a crash, posted again
        after the restart: `decided` edits only the recorded one). The decision is the one this
        process made or heard (else "no longer waiting"). Only a message that is verifiably a prompt
        of the call the press names is edited (`_prompt_of_call`): a modified client can send any
        button data for any bot message. Never an open prompt's, and a failed edit only logs: the
        press is handled either way."""
        message_id = _pressed_message(entry)
        outbox = self.outboxes.of(runner)
        if message_id is None or not outbox.can_edit:
            return
        if prompt is not None and prompt.decided is not None and message_id in prompt.message_ids:
            return  # the recorded prompt: `decided` edited it
        account = runner.spec.ref
        if any(message_id in p.message_ids for p in self.approvals.open_in_chat(account, entry.chat)):
            return  # a live prompt of another call (a button whose data names a call it does not show)
        known = (
            prompt
            if prompt is not None and prompt.decided is not None
            else self.approvals.outcome(account, entry.chat, ref)
        )
        if not self._prompt_of_call(entry, message_id, ref, [p for p in (prompt, known) if p is not None]):
            log.info(
                "%s: a press naming approval %s on message %s, no prompt of it: left as it is", account, ref, message_id
            )
            return
        text = known.text(room_of(outbox.adapter)) if known is not None else pressed_gone_text(ref)
        try:
            await outbox.edit_prompt(Target(entry.chat, entry.thread), message_id, text, None)
        except (DeliveryFailed, RuntimeError) as exc:
            log.warning("%s: could not update the pressed approval prompt %s: %s", account, message_id, exc)

    def _prompt_of_call(self, entry: Entry, message_id: str, ref: str, calls: list[Prompt]) -> bool:
        """Whether the pressed message is a prompt of the call `ref` names: one recorded as that call's
        prompt (`calls`: its prompt as this process knows it, and gateway.db's row), or, for a copy never
        recorded, one whose own content as the platform delivered it with the press shows that call's
        prompt (`shows_prompt_of`; Telegram and Slack deliver it, Discord does not)."""
        for call in calls:
            posted = self.approvals.posted(call.call_id)
            if message_id in call.message_ids or (posted is not None and message_id in posted.message_ids):
                return True
        return shows_prompt_of(entry.payload.get("pressed_message"), ref)

    async def _announced(self, runner: AccountRunner, chat: str, ref: str) -> Prompt | None:
        """An answer to a prompt gateway.db remembers but whose request this process has not been
        given yet (a click the platform held while the gateway restarted, redelivered the moment
        the adapter connected, before the server re-sent its pending requests): held until the
        server says whether the call still waits, at most `ANNOUNCE_WAIT_S`. The conversation is
        asked at once (`subscribe` re-sends a pending call's request; a call no longer pending is
        settled), so the wait is short. None when it no longer waits (or no answer came in time)."""
        remembered = self.approvals.remembered(runner.spec.ref, chat, ref)
        if remembered is None:
            return None
        log.info(
            "%s: an answer to approval %s, whose request has not come again since the gateway (re)connected; held"
            " until the server says whether it still waits",
            runner.spec.ref,
            remembered.call_id,
        )
        asking = asyncio.ensure_future(self._ask_again(remembered))
        try:
            prompt = await self.approvals.announced(remembered.call_id, ANNOUNCE_WAIT_S)
        finally:
            if not asking.done():
                asking.cancel()
                await asyncio.gather(asking, return_exceptions=True)
        if prompt is None:
            log.info("%s: approval %s no longer waits for an answer", runner.spec.ref, remembered.call_id)
        return prompt

    async def _ask_again(self, prompt: Prompt) -> None:
        """Ask the server about one remembered prompt's call, as `reconcile_prompts` does; a link
        that is down is waited for (its reconnect re-sends the requests too)."""
        while prompt.call_id not in self.approvals.prompts and self.approvals.posted(prompt.call_id) is not None:
            try:
                await self._reconcile_conversation(prompt.conversation, [prompt])
                return
            except (ProtocolError, Closed, TimeoutError, OSError) as exc:
                log.info("could not ask about approval %s yet: %s", prompt.call_id, exc)
                await asyncio.sleep(1.0)

    async def reconcile_prompts(self) -> None:
        """Settle the prompts gateway.db remembers whose call no longer waits: after a start, and
        after each reconnect, the server sends requests again only for calls still pending, so a
        call that was answered (from the CLI, say), timed out or was cancelled while this gateway
        was hung, restarting or disconnected would keep live buttons forever that do nothing. Each
        such prompt is edited to the outcome where the protocol shows it, else to "no longer
        waiting", without buttons. A prompt of an account not running now waits for the next time."""
        async with self._reconciling:
            by_conversation: dict[str, list[Prompt]] = {}
            for prompt in self.approvals.leftovers():
                runner = self.runners.get(prompt.account)
                if prompt.decided is not None or runner is None or runner.adapter is None:
                    continue
                if runner.adapter.is_running:
                    by_conversation.setdefault(prompt.conversation, []).append(prompt)
            for conversation, prompts in by_conversation.items():
                try:
                    await self._reconcile_conversation(conversation, prompts)
                except (ProtocolError, Closed, TimeoutError, OSError) as exc:
                    log.warning("could not check the approval prompts of %s: %s", conversation, exc)

    async def _reconcile_conversation(self, conversation: str, prompts: list[Prompt]) -> None:
        try:
            state = await self.link.request({"type": "subscribe", "conversation": conversation})
        except ProtocolError as exc:
            if exc.code != "conversation_not_found":
                raise
            for prompt in prompts:  # deleted with its paused turn: the request is void (as the server says)
                if prompt.decided is None:
                    await self.decided(prompt, OUTCOME_LINES["cancelled"])
            return
        active = state.get("active_turn") or None
        if state.get("state") == "awaiting" and active is None:
            return  # the server has not loaded the paused turn yet: which calls wait is unknown
        waiting = {
            str(p.get("call_id"))
            for p in state.get("pending_approvals") or []
            if isinstance(p, dict) and p.get("status", "pending") == "pending"
        }
        history: list[dict[str, Any]] | None = None
        for prompt in prompts:
            if prompt.call_id in waiting:
                continue  # still pending: its request came again (or comes), and the prompt is live
            line = _outcome_in_snapshot(active, prompt)
            if line is None:
                if history is None:
                    reply = await self.link.request({"type": "get_history", "conversation": conversation, "limit": 200})
                    history = [m for m in reply.get("messages") or [] if isinstance(m, dict)]
                line = _outcome_in_history(history, prompt)
            if prompt.decided is None:  # an `approval_resolved` may have come meanwhile
                log.info("%s: approval %s no longer waits: %s", prompt.account, prompt.call_id, line)
                await self.decided(prompt, line)

    async def decided(self, prompt: Prompt, line: str) -> None:
        """Show the decision on the prompt: edited in place where the platform can, else a line."""
        prompt.decided = line
        self.approvals.note_outcome(prompt)
        runner = self.runners.get(prompt.account)
        if runner is None:
            return
        try:  # a press can beat the platform's answer to the prompt's own send: wait for its id
            await asyncio.wait_for(prompt.shown.wait(), PROMPT_SHOWN_WAIT_S)
        except TimeoutError:
            pass
        try:
            outbox = self.outboxes.of(runner)
            shown_in = prompt.message_ids or await self._find_cut_off(prompt, outbox)
            if outbox.can_edit and shown_in:
                text = prompt.text(room_of(outbox.adapter))
                await outbox.edit_prompt(prompt.target, shown_in[0], text, None)
            else:
                await outbox.send(prompt.target, f"{code_span(prompt.name)}: {line}")
        except (DeliveryFailed, RuntimeError) as exc:
            log.warning("%s: could not update the approval prompt: %s", prompt.account, exc)
        finally:
            await write_until_done(
                f"approval {prompt.call_id}: settled", partial(self.approvals.settled, prompt.call_id)
            )
            if prompt.turn_id not in self.replies.turns:  # no follower forgets it (`forget_turn`)
                self.approvals.prompts.pop(prompt.call_id, None)

    async def _find_cut_off(self, prompt: Prompt, outbox: Outbox) -> list[str]:
        """The post of a prompt decided while no gateway ran whose id a crash kept from being noted
        (it was in flight at a kill -9): found where the platform can tell (`Outbox.find_left`:
        Discord's nonce repeat, or past its window a look for the prompt's text; Slack's lookup by
        the key), so the decision is edited into it, rather than posted as a line beside a prompt
        whose buttons would stay live for good. Within Discord's window, a post that never landed is
        answered by a "…" of the repeat's own, which then shows the decided prompt: the chat a prompt
        posted and decided without a crash leaves. Elsewhere (Telegram), or not found: [] (a line)."""
        posted = self.approvals.cut_off(prompt)
        if posted is None or not outbox.can_edit:
            return []
        pending = replace(prompt, decided=None).text(room_of(outbox.adapter))  # as it was posted
        try:
            found = await outbox.find_left(replace(prompt.target, key=posted.key), posted.attempted_at, pending)
        except DeliveryFailed as exc:
            log.warning(
                "%s: cannot look for the prompt of %s cut off by a crash: %s", prompt.account, prompt.call_id, exc
            )
            return []
        prompt.message_ids = list(found or [])  # a press on it later is known as this call's
        return prompt.message_ids


_WHO_CANCELS = "only the person who started it, or an admin, can cancel it"


def unstarted_answerer(chat: Entry) -> str:
    """Who besides the admins may answer (and `/cancel`) a turn no chat message started that runs in
    this chat's conversation, given the chat's newest message access let in: in a DM its sender (the
    only person there, let in by the account's access: paired, listed or open); in a group nobody
    (""): the gateway cannot tell which member asked for a scheduled run, and a member having
    written there gives no say over a turn someone else's task or client started."""
    return chat.sender if chat.payload.get("chat_type") == "dm" else ""


def _dropped_line(count: int) -> str:
    """What `/cancel` says of the waiting messages it dropped (held by debounce, queued on the server)."""
    if count == 1:
        return "Dropped 1 waiting message before its turn started: the agent never gets it."
    return f"Dropped {count} waiting messages before their turn started: the agent never gets them."


def unshown_waiting(prompts: list[Prompt]) -> str:
    """A bare `/approve` or `/deny` while only requests whose prompt could not be shown wait: they
    are named, with how to answer one (by its ID, after reading the call)."""
    named = ", ".join(f"{code_span(p.short_id)} (for {code_span(p.name)})" for p in prompts)
    first = prompts[0].short_id
    return (
        f"A request is waiting here whose prompt could not be shown: {named}. Answer it by its ID:"
        f" /approve {first} or /deny {first} (`appserver conversations history` shows the whole call)."
    )


def _pressed_message(entry: Entry) -> str | None:
    """The id of the message whose button was pressed, as the adapter gives it (`reply_to`: Telegram's
    `chat:id`, Slack's `channel:ts`, Discord's id), in the form its edits take (the last part)."""
    reply_to = entry.payload.get("reply_to")
    if not isinstance(reply_to, str) or not reply_to:
        return None
    return reply_to.rsplit(":", 1)[-1] or None


def _outcome_in_snapshot(active: dict[str, Any] | None, prompt: Prompt) -> str | None:
    """What the call's turn, still the active one, shows of it: only an approved call runs or
    completes; a denied one is marked so; one still marked pending in an ended turn was cancelled
    with it. None when the snapshot cannot tell (a failed call may have timed out or failed)."""
    if not active or active.get("turn_id") != prompt.turn_id:
        return None
    for block in active.get("blocks") or []:
        if block.get("type") != "tool_call" or block.get("call_id") != prompt.call_id:
            continue
        status = block.get("status")
        if status in ("approved", "running", "completed"):  # approved: answered, waiting on a sibling call
            return OUTCOME_LINES["approved"]
        if status == "denied":
            return OUTCOME_LINES["denied"]
        if status == "pending_approval" and active.get("status") == "cancelled":
            return OUTCOME_LINES["cancelled"]
    return None


def _outcome_in_history(messages: list[dict[str, Any]], prompt: Prompt) -> str:
    """A result without an error means the call ran, so it was approved; an error result reads the
    same whether the call was denied, timed out, was cancelled or failed: not guessed at."""
    for m in messages:
        if m.get("role") == "tool" and m.get("tool_call_id") == prompt.call_id and m.get("is_error") is False:
            return OUTCOME_LINES["approved"]
    return NO_LONGER_WAITING


def display_name(payload: Mapping[str, Any]) -> str | None:
    """The sender's display name a message carries, as pairing keeps it: free text from the
    platform, a NUL (U+0000) in it as U+FFFD (PostgreSQL's text holds no NUL; SQLite's the same)."""
    name = payload.get("sender_name")
    return name.replace("\x00", "\ufffd") if isinstance(name, str) else None
