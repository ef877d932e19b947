"""Shared pieces of the OpenAI routes: request parsing, model ids, idempotency keys, driving a turn."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from appserver import fastjson
from appserver.auth import REVOCATION_POLL_S, Principal, conversation_namespace, namespace_allows, namespace_of
from appserver.errors import AgentGone, InvalidInput, KernelError, NotAwaiting
from appserver.http.bodies import json_bodies
from appserver.http.conversation_match import HEADER, Placement, answer_at_round, by_name, legacy_name, repeats_answer
from appserver.http.credential_end import CredentialCheck, credential_check
from appserver.http.credential_end import ended as credential_ended
from appserver.http.errors import (
    ApiError,
    agent_deleted,
    error_body,
    error_response,
    from_kernel,
    new_request_id,
    turn_failure,
)
from appserver.http.requestid import current_request_id
from appserver.http.sse import line_safe
from appserver.http.stopping import Stopping, shutting_down
from appserver.runtime import (
    TERMINAL_STATUSES,
    Decision,
    DeltaTap,
    Quiet,
    Submission,
    SubmitRequest,
    TurnHandle,
    TurnSnapshot,
)
from appserver.runtime import max_steps_note as steps_note
from appserver.runtime.kernel import COUNTED_FOR
from appserver.runtime.restore import controller_from_store
from appserver.runtime.snapshot import TurnController, answered_unrun
from appserver.security.guard import GUARD_ANSWERED
from appserver.security.limits import TOO_MANY_OPEN_TURNS, TurnPlaces, open_turns_key
from appserver.store.base import StoreUnavailable, StoreValueRefused, WriteRefused
from appserver.store.records import AgentRecord, HttpIdempotency, PendingCall, TurnRecord, TurnSettings

if TYPE_CHECKING:
    from appserver.http.metrics import Metrics
    from appserver.server import Server

log = logging.getLogger("appserver.http")
T = TypeVar("T")

IDEMPOTENCY_WAIT_S = 120.0
DISCONNECT_WATCH_DELAY_S = 0.05  # a client gone sooner is noticed this much later


def principal_of(request: Request) -> Principal:
    p = getattr(request.state, "principal", None)
    return p if isinstance(p, Principal) else Principal.local()


async def read_body(request: Request) -> bytes:
    """`request.body()` without its async generator, which costs more than the rest of reading a
    body that arrives in one message (the usual case). Leaves the request as `body()` would."""
    if hasattr(request, "_body") or getattr(request, "_stream_consumed", True):
        return await request.body()
    chunks: list[bytes] = []
    while True:
        message = await request.receive()
        if message["type"] == "http.request":
            chunk = message.get("body", b"")
            if chunk:
                chunks.append(chunk)
            if not message.get("more_body", False):
                break
        elif message["type"] == "http.disconnect":
            request._is_disconnected = True
            raise ClientDisconnect()
    request._stream_consumed = True
    body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    request._body = body
    return body


# The request headers these routes give a meaning to, each of which a request may send once:
# with two, which one counts would be a guess (the first, silently), and an intermediary that
# added its own would pick the conversation or the key without a word. Refused as a second
# Content-Length is: 400, naming the header, with the code its malformed value gets.
SINGLE_HEADERS = {
    b"idempotency-key": ("Idempotency-Key", "invalid_idempotency_key"),
    HEADER.lower().encode(): (HEADER, "invalid_conversation_id"),
}


def refuse_repeated_headers(request: Request) -> None:
    """400 for a header of SINGLE_HEADERS sent more than once, before anything is read or run.
    (One pass over the raw headers, which the server gives lower-cased: on every request.)"""
    seen = [name for name, _ in request.scope["headers"] if name in SINGLE_HEADERS]
    for raw in seen if len(seen) > 1 else ():
        count = seen.count(raw)
        if count > 1:
            name, code = SINGLE_HEADERS[raw]
            raise ApiError(400, f"the request has {count} {name} headers; send it once", code=code, param=name)


def content_codings(request: Request) -> list[str]:
    """Every coding the request's Content-Encoding headers name, in order (several headers are one
    list, as HTTP has it): a coding named in a second header is no less applied."""
    values = [v.decode("latin-1") for name, v in request.scope["headers"] if name == b"content-encoding"]
    return [c.strip().lower() for v in values for c in v.split(",") if c.strip()]


async def read_json(request: Request) -> tuple[dict[str, Any], bytes]:
    refuse_repeated_headers(request)
    encoding = next((c for c in content_codings(request) if c != "identity"), "")
    if encoding:
        # Read as it is, a gzip body failed as "not valid UTF-8"; a plain body sent under a label
        # it does not have was read as if the label were not there.
        raise ApiError(
            415,
            f"request bodies with Content-Encoding {encoding[:40]!r} are not accepted; send the JSON as it is",
            code="unsupported_content_encoding",
            param="Content-Encoding",
        )
    try:
        raw = await read_body(request)
    except ClientDisconnect:
        raise ApiError(400, "the client went away while sending the body", code="client_disconnected") from None
    if not raw.strip():
        raise ApiError(400, "the request body is empty; send a JSON object", code="invalid_json")
    data = await json_bodies(request).parse(raw)  # limits and checks: appserver/http/bodies.py
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    return data, raw


def json_int(value: Any) -> int | None:
    """An integer as JSON Schema counts one (2025.0 is an integer there), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def json_type(value: Any) -> str:
    """The JSON name of a value's type, for messages ("a number", not "int")."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


# ---------------------------------------------------------------- models


def advertised_ids(agents: Sequence[AgentRecord]) -> dict[str, str]:
    """agent id → advertised model id: the name when unique and no agent's id, else the agent id."""
    ids = {a.id for a in agents}
    counts: dict[str, int] = {}
    for a in agents:
        counts[a.name] = counts.get(a.name, 0) + 1
    return {a.id: (a.name if counts[a.name] == 1 and a.name not in ids else a.id) for a in agents}


async def visible_agents(server: Server, principal: Principal) -> list[AgentRecord]:
    return [a for a in await server.store.list_agents() if principal.allows_agent(a.id, a.name)]


async def resolve_model(
    server: Server, principal: Principal, model: Any, *, lookup: bool = False
) -> tuple[AgentRecord, str]:
    """The agent a `model` value names, and its advertised id; 404 model_not_found otherwise. A name
    several agents share is 400 model_ambiguous for a request, and (`lookup`: GET /v1/models/{id},
    where a name that is no advertised id is simply not found) 404 saying so."""
    if model is None:
        raise ApiError(
            400, "'model' is required: use one of the ids from GET /v1/models", code="missing_model", param="model"
        )
    if not isinstance(model, str):
        raise ApiError(
            400,
            f"'model' must be a string (got {json_type(model)}): use one of the ids from GET /v1/models",
            code="invalid_type",
            param="model",
        )
    if not model.strip():
        raise ApiError(
            400, "'model' is empty: use one of the ids from GET /v1/models", code="missing_model", param="model"
        )
    agents = await server.store.agents_to_read()
    adv = advertised_ids(agents)
    found = [a for a in agents if a.id == model] or [a for a in agents if adv[a.id] == model]
    agent = found[0] if len(found) == 1 else None  # read only, as every route and turn uses it
    if agent is None:
        named = [a.id for a in agents if a.name == model and principal.allows_agent(a.id, a.name)]
        if len(named) > 1:  # several agents share the name: it advertises none of them (DESIGN §5)
            raise ApiError(
                404 if lookup else 400,
                f"The model '{model}' names several agents ({', '.join(named)}); use one of these ids "
                "(GET /v1/models lists them)",
                code="model_not_found" if lookup else "model_ambiguous",
                param="model",
            )
    if agent is None or not principal.allows_agent(agent.id, agent.name):
        raise ApiError(
            404,
            f"The model '{model}' does not exist or you do not have access to it.",
            code="model_not_found",
            param="model",
        )
    return agent, adv[agent.id]


def interrupted(snap: TurnSnapshot) -> bool:
    """The turn ended because the server running it stopped (a cluster's survivor closed it for a
    server killed mid-turn): nobody's cancel, so answered as a failure (503 `turn_interrupted`),
    never as a short `stop` or a `turn_cancelled` the client did not ask for."""
    return snap.status == "cancelled" and (snap.error or {}).get("kind") == "interrupted"


def failed_answer(snap: TurnSnapshot) -> bool:
    """The turn's end is answered with an error: it failed, or it was interrupted."""
    return snap.status == "failed" or interrupted(snap)


async def turn_error(server: Server, agent_id: str, error: dict[str, Any] | None) -> ApiError:
    """The OpenAI error for a failed turn. A turn whose rows could not be saved because its agent
    was deleted while it ran ends as that model not existing, as the next request for it does."""
    if (error or {}).get("kind") == "store" and await server.store.get_agent(agent_id) is None:
        return agent_deleted()
    if (error or {}).get("input_saved"):
        # Its input was saved before the reply was refused (a full disk): the message says where,
        # and an SDK must not send it again by itself (runtime/finish.py `_reply_unsaved`).
        why = str((error or {}).get("message") or "the turn's reply could not be saved")
        return ApiError(503, why, code="store_unavailable", headers={"x-should-retry": "false"})
    if (error or {}).get("kind") == "store_unavailable":
        # Not the agent's failure: the database could not take the turn's writes (a restart, a lock
        # another process holds). Nothing of it was saved; a retry may go through (docs/openai.md).
        why = str((error or {}).get("message") or "the store could not save the turn")
        return ApiError(503, why, code="store_unavailable", headers={"Retry-After": "1"})
    return turn_failure(error)


def model_object(agent: AgentRecord, model_id: str) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": int(agent.created_at), "owned_by": "appserver"}


# ---------------------------------------------------------------- idempotency


def _canon_numbers(value: Any) -> Any:
    """Integral floats as integers (1.0 → 1, -0.0 → 0), as canonical JSON (RFC 8785) writes them:
    a serialiser that writes 1 and one that writes 1.0 sent the same JSON."""
    if isinstance(value, float):
        return int(value) if value.is_integer() else value
    if isinstance(value, dict):
        return {k: _canon_numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_canon_numbers(v) for v in value]
    return value


def canonical_hash(route: str, body: dict[str, Any], pinned: str | None = None) -> str:
    """Hash of (route, body) that ignores key order, whitespace, escapes and number spelling
    (1, 1.0, 1e0): equal JSON, equal hash. `pinned`: the conversation the request's
    X-Conversation-Id names, part of the request (the same body sent to another conversation is
    another request); without it the hash is the one servers made before it counted."""
    parts: list[Any] = [route, _canon_numbers(body)]
    if pinned is not None:
        parts.append({HEADER: pinned})
    canon = json.dumps(parts, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canon.encode("utf-8", "surrogatepass")).hexdigest()


def hidden_key() -> ApiError:
    """A key whose earlier request went into a conversation the caller may not see: refused, as the
    WebSocket refuses such a key. Keys belong to a credential's name, and a token rotated under it
    without `admin` (or limited to other agents) keeps them; neither the stored answer nor its
    conversation id may reach it, and nothing runs (a retry gets this again)."""
    return ApiError(
        409,
        "this Idempotency-Key was used for a conversation this credential may not see; use another key",
        code="idempotency_key_reused",
        param="Idempotency-Key",
    )


async def may_see(server: Server, principal: Principal, conversation_id: str) -> bool:
    """Whether `principal` may see the conversation a key's earlier request used: its namespace
    (`namespace_allows`) and its agent. `admin` and the local owner see every conversation, also
    one deleted since; anyone else sees only one that still exists."""
    ns = conversation_namespace(principal)
    if ns is None and principal.agents is None:
        return True
    conv = await server.store.get_conversation(conversation_id)
    if conv is None:
        return ns is None
    if not namespace_allows(ns, conv.namespace):
        return False
    if principal.agents is None:
        return True
    agent = await server.store.get_agent(conv.agent_id)
    return agent is not None and principal.allows_agent(agent.id, agent.name)


def any_pause(snap: TurnSnapshot) -> bool:
    """A reply that ends at every pause of its turn (Responses: client calls and approvals alike)."""
    return True


@dataclass(slots=True)
class Idempotency:
    server: Server
    scope: str
    key: str
    body_hash: str
    principal: Principal | None = None  # who asks: a turn the key names must be one it may see

    @classmethod
    async def begin(
        cls, server: Server, request: Request, principal: Principal, route: str, body: dict[str, Any]
    ) -> tuple[Idempotency | None, Response | None]:
        """(a claim to finish later, or a stored reply to send now).

        One key scope per credential across both POST routes: the route is part of the hashed
        request, so a key reused on the other route is a different request (409). The hash covers
        the canonical JSON (sorted keys, no spacing), so the same JSON re-serialised replays."""
        key = request.headers.get("idempotency-key")
        if key is None:
            return None, None
        key = key.strip()  # an empty one is the client's mistake, not "no key": below, a 400
        if not key or len(key) > 255:
            raise ApiError(
                400,
                "Idempotency-Key must be 1 to 255 characters",
                code="invalid_idempotency_key",
                param="Idempotency-Key",
            )
        body_hash = canonical_hash(route, body, request.headers.get(HEADER) or None)
        scope = namespace_of(principal)
        store = server.store  # an expired key is no key: the claim replaces it (store/base.py IDEMPOTENCY_TTL_S)
        deadline = time.monotonic() + IDEMPOTENCY_WAIT_S
        while True:
            existing = await store.claim_http_idempotency(HttpIdempotency(scope, key, body_hash))
            if existing is None:
                return cls(server, scope, key, body_hash, principal), None
            if existing.body_hash != body_hash:
                raise ApiError(
                    409,
                    "this Idempotency-Key was already used with a different request body (or X-Conversation-Id)",
                    code="idempotency_key_reused",
                    param="Idempotency-Key",
                )
            if existing.state == "done":
                if existing.conversation_id and not await may_see(server, principal, existing.conversation_id):
                    raise hidden_key()
                answered = answered_response(existing)
                if answered is not None and answered[1]:
                    kept = await store.get_response(answered[0])
                    if kept is None or not kept.stored:  # deleted, while its request still ran
                        existing = await forget_answer(server, existing, answered[0])
                headers = {"Idempotent-Replayed": "true"}
                if existing.conversation_id:
                    headers["X-Conversation-Id"] = existing.conversation_id
                return None, Response(
                    existing.body or "",
                    status_code=existing.status_code or 200,
                    media_type=existing.content_type,
                    headers=headers,
                )
            if time.monotonic() > deadline:
                raise ApiError(
                    409,
                    "a request with this Idempotency-Key is still in progress",
                    code="idempotency_key_in_progress",
                    param="Idempotency-Key",
                )
            await asyncio.sleep(0.05)

    @property
    def turn_scope(self) -> str:
        """The kernel's idempotency scope for this key: the turn it starts is recorded under it in
        the same transaction as its accept, so a retry finds it even when this claim was lost."""
        return f"http:{self.scope}"

    @property
    def turn_key(self) -> str:
        """The kernel's key for the turn this request starts: the key and the request's body
        hash. So a key's turn is followed only by a repeat of the request that started it: another
        body under the key (its claim gone: dropped after an error, or expired) runs anew, never
        gets that turn's reply. The separator is a control character, which no client key holds."""
        return f"{self.key}\x1f{self.body_hash}"

    async def earlier(
        self,
        answered: Sequence[str] = (),
        approvals: Sequence[str] = (),
        ends: Callable[[TurnSnapshot], bool] = any_pause,
    ) -> tuple[TurnRun | None, TurnKey | None]:
        """What an earlier attempt with this key left: (its turn to follow, None) when that turn is
        still the answer — queued, running, paused or completed: a server killed before the reply
        was stored released the claim, but the turn ran or runs on; else (None, the (key, scope)
        the new turn is to be accepted under). A cancelled, failed or interrupted earlier turn (the
        client went away, the model failed, the server died while it ran) is not the answer: the
        request runs again, and its new turn takes the key (`forget_idempotency`: only this claim's
        holder gets here), so a repeat after a second crash follows the new turn instead of running
        the request a third time. Landing right after that turn (its conversation pinned, or
        found again for a request naming none: `ConversationMatcher.by_rerun`), the new turn
        re-runs that turn's input, kept in the history once (`TurnKey.rerun`). Keys older
        than IDEMPOTENCY_TTL_S name no turn (the store ignores them, purged or not).

        `answered`: the ids of the calls the request answers (`approvals`: those of them it
        approved or denied): its turn is the paused one it resumed (`keep_answers_key`), and it
        follows what came after those calls. Its reply ends where the first one did: at the turn's
        first pause after its start that `ends` (the route's rule for the pauses a reply ends at),
        shown as it was then when the turn has moved on since (`past_pause`)."""
        store = self.server.store
        named = self.turn_key
        turn = await store.lookup_idempotency(self.turn_scope, named)
        if turn is None:
            # a turn an older server (a rolling upgrade) accepted under the key alone, for at most
            # the key's 48 h
            named = self.key
            turn = await store.lookup_idempotency(self.turn_scope, named)
        if turn is not None and not http_turn(turn):
            # The scope is a conversation's id to a WebSocket submit: a conversation named like it
            # holds that credential's WebSocket keys (the local owner's are unprefixed). Never this
            # key's turn, and never forgotten by it.
            turn = None
        if turn is None:
            return None, TurnKey(self.turn_key, self.turn_scope)
        gone = turn.status == "running" and not await self.server.kernel.owner_alive(turn.owner, strict=True)
        # Cancelled, failed, or interrupted by a crash; or running on a server that died (settled as
        # interrupted once that is noticed; a queued turn of a dead server still runs elsewhere):
        # not the answer, the request runs again, re-running that turn's input where it lands
        # right after it (`TurnKey.rerun`).
        if turn.status not in ("queued", "running", "awaiting", "completed") or gone:
            await store.forget_idempotency(self.turn_scope, named, turn.id)
            return None, TurnKey(self.turn_key, self.turn_scope, rerun=turn.id)
        if self.principal is not None and not await may_see(self.server, self.principal, turn.conversation_id):
            raise hidden_key()  # never followed (its claim, taken by this request, is dropped by the caller)
        handle = await self.server.kernel.handle_for(turn)
        blocks = handle.controller.snapshot().blocks
        base = after_calls(blocks, answered) if answered else 0
        if answered and not base:  # the turn shows none of the calls: followed as it is
            return TurnRun(self.server, turn.conversation_id, handle, resolved_calls=list(approvals)), None
        then = await past_pause(self.server, turn, blocks[base - 1]["call_id"] if base else None, ends)
        if then is not None:
            handle = then
            base = after_calls(then.controller.snapshot().blocks, answered) if answered else 0
        return TurnRun(
            self.server,
            turn.conversation_id,
            handle,
            base_blocks=base,
            resolved_calls=list(approvals),
            moved_on=then is not None,
        ), None

    async def note_start(self, response_id: str, conversation_id: str) -> None:
        """A stream told its client the id of the response it makes: kept with the pending key, so
        that deleting that response forgets it even when this request never ends (a crash)."""
        body = fastjson.dumps({"object": "response", "id": response_id, "store": True})
        await self.server.store.note_http_idempotency(self.scope, self.key, "application/json", body, conversation_id)

    async def finish(self, status: int, content_type: str, body: str, conversation_id: str | None) -> None:
        await self.server.store.finish_http_idempotency(
            self.scope, self.key, status, content_type, body, conversation_id
        )

    async def abandon(self) -> None:
        """Let the key go after the request failed (or its turn gave no answer to keep). A drop the
        store refuses (a full disk) leaves the request's own answer standing, never this write's
        "nothing of this request was written" (its input may have been saved): the claim stays,
        pending under this server but no longer worked on, and a repeat of the request takes it
        over once the store takes writes (it follows the key's turn or runs anew, as after a
        crash: the store's `claim_http_idempotency`)."""
        try:
            await self.server.store.drop_http_idempotency(self.scope, self.key)
        except WriteRefused as exc:
            log.warning("Idempotency-Key %r could not be let go: %s", self.key, exc.cause)


HTTP_SOURCES = ("openai_chat", "openai_responses")


class TurnKey(tuple[str, str]):
    """(key, scope) a request's new turn is accepted under (`Idempotency.earlier`), and `rerun`:
    the turn an earlier attempt with the key ran that answered nothing (a stop, a crash, a failure,
    a cancel). The new turn re-runs that turn's input when it lands right after it in its
    conversation (`Kernel._rerun`): the retry leaves the input there once, not twice."""

    rerun: str | None

    def __new__(cls, key: str, scope: str, rerun: str | None = None) -> TurnKey:
        made = super().__new__(cls, (key, scope))
        made.rerun = rerun
        return made


def rerun_unnamed(key: TurnKey | None, named: str | None) -> str | None:
    """The turn a keyed repeat re-runs (`TurnKey.rerun`) when it names no conversation (`named`:
    its `X-Conversation-Id` or `conversation`, None or `new`): it goes to that turn's conversation
    (`ConversationMatcher.by_rerun`), new input and answers alike. A request whose answers resumed
    a turn has its key filed under that turn (`keep_answers_key`): its repeat re-runs it there
    (`rerun_answers`), the answers held once, instead of answering them again in a fork (the
    cut-off reply after them no longer matches the transcript or previous response). None for
    any other request, which is placed as ever."""
    if key is None or key.rerun is None:
        return None
    if named is not None and named.strip() and named.strip().lower() != "new":
        return None
    return key.rerun


def http_turn(turn: TurnRecord) -> bool:
    """A turn an OpenAI-surface request started. A WebSocket submit's source always names its
    connection (whatever kind its client wrote there)."""
    source = turn.source or {}
    return source.get("kind") in HTTP_SOURCES and "connection" not in source


def after_calls(blocks: Sequence[dict[str, Any]], answered: Sequence[str]) -> int:
    """The index after the last of a turn's calls that `answered` names (a legacy `function`
    answer names its function): where the reply of the request that answered them starts; 0
    when the turn shows none of them."""
    names = {n for n in map(legacy_name, answered) if n}
    at = [
        i
        for i, b in enumerate(blocks)
        if b["type"] == "tool_call" and (b.get("call_id") in answered or b.get("name") in names)
    ]
    return max(at) + 1 if at else 0


async def keep_answers_key(server: Server, idempotency: tuple[str, str] | None, run: TurnRun) -> None:
    """A request whose answers resumed a paused turn started none: its key (the kernel's, as
    `Idempotency.earlier` gave it) is filed under the turn it resumed, so a repeat after a crash
    follows that turn instead of answering the calls again in a fork. Best effort: the answers
    are applied, and the reply goes out whether or not the key was kept."""
    if idempotency is None:
        return
    try:
        await server.store.remember_idempotency(idempotency[1], idempotency[0], run.turn_id, run.conversation_id)
    except Exception as exc:
        log.warning("could not keep Idempotency-Key of the answers to turn %s: %r", run.turn_id, exc)


async def past_pause(
    server: Server, turn: TurnRecord, after_call: str | None, ends: Callable[[TurnSnapshot], bool]
) -> TurnHandle | None:
    """The turn as it was at its first pause after call `after_call` (None: after its start) that
    `ends`, rebuilt from the store, when the turn has moved on since (another request answered
    that pause): what a reply that started there showed, for it ended at that pause. None when the
    turn has not paused there yet, or still waits there: its live handle shows that.

    A pause is a round (one assistant message) with calls the turn waited for (its pending calls:
    client calls, approvals); the round's server calls ran before it, so their results are shown."""
    store = server.store
    waited = {p.call_id: p for p in await store.list_pending(turn.id)}
    if not waited:
        return None
    messages = [m for m in await store.list_messages(turn.conversation_id) if m.turn_id == turn.id]
    start = 0
    if after_call is not None:
        start = next(
            (
                i + 1
                for i, m in enumerate(messages)
                if m.role == "assistant" and any(c.get("id") == after_call for c in m.tool_calls)
            ),
            len(messages),
        )
    for j in range(start, len(messages)):
        asked = [waited[c["id"]] for c in messages[j].tool_calls if c.get("id") in waited]
        if messages[j].role != "assistant" or not asked:
            continue
        shown = messages[: j + 1]
        for m in messages[j + 1 :]:
            if m.role != "tool":
                break
            if m.tool_call_id not in waited:  # a server call of the round: it ran before the pause
                shown.append(m)
        pending = [
            dataclasses.replace(p, status="pending", output=None, is_error=False, reason=None, decided_by=None)
            for p in asked
        ]
        controller = TurnController(turn.id, turn.conversation_id, turn.agent_id)
        controller.load_messages(shown)
        controller.usage = dict(turn.usage)
        controller.last_message_id = shown[-1].id  # the reply's history point: the pause
        controller.mark_pending_blocks(pending)
        approval = any(p.kind == "approval" for p in pending)
        controller.pause("requires_approval" if approval else "requires_client_tool", pending)
        if not ends(controller.snapshot()):
            continue  # a pause this route's reply waits through (chat: an approval)
        if all(p.status == "pending" for p in asked):
            return None  # still waiting there
        return TurnHandle(turn.id, turn.conversation_id, controller)
    return None


def answered_response(entry: HttpIdempotency) -> tuple[str, bool] | None:
    """(id, `store`) of the Response object a key's stored answer carries (a `/v1/responses`
    JSON body, or its stream's `response.created` event); None for any other answer."""
    body = entry.body or ""
    try:
        if (entry.content_type or "").startswith("text/event-stream"):
            first = next((line for line in body.splitlines() if line.startswith("data:")), "")
            event = json.loads(first.removeprefix("data:"))
            obj = event.get("response") if isinstance(event, dict) else None
        else:
            obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("object") != "response" or not isinstance(obj.get("id"), str):
        return None
    return obj["id"], obj.get("store") is not False


def deleted_answer(response_id: str) -> ApiError:
    return ApiError(
        404,
        f"The response this Idempotency-Key answered with ('{response_id}') was deleted.",
        code="response_not_found",
        param="Idempotency-Key",
    )


async def forget_answer(server: Server, entry: HttpIdempotency, response_id: str) -> HttpIdempotency:
    """A deleted response is not served again by a replay: the key's stored answer becomes the
    404 its GET answers (the key stays taken, so a retry does not run the request twice)."""
    err = deleted_answer(response_id)
    body = fastjson.dumps(error_body(err.status, err.message, code=err.code, param=err.param))
    await server.store.finish_http_idempotency(
        entry.scope, entry.key, err.status, "application/json", body, entry.conversation_id
    )
    return dataclasses.replace(entry, status_code=err.status, content_type="application/json", body=body, state="done")


async def forget_answers_of(server: Server, conversation_id: str, response_id: str) -> None:
    """DELETE /v1/responses/{id}: every key whose stored answer is that response forgets it."""
    for entry in await server.store.answered_http_idempotency(conversation_id):
        answered = answered_response(entry)
        if answered is not None and answered[0] == response_id:
            await forget_answer(server, entry, response_id)


# Turns whose reply is no answer to keep under an Idempotency-Key: a repeat runs again (docs/openai.md).
NOT_ANSWERS = ("cancelled", "failed", "interrupted")


async def keep_or_free(idem: Idempotency, snap: TurnSnapshot, body: str, conversation_id: str) -> None:
    """A 200 JSON reply: kept for replay when its turn answered, else the key is freed (a cancelled
    turn's partial text, a failed one's)."""
    if snap.status in NOT_ANSWERS:
        await idem.abandon()
    else:
        await idem.finish(200, "application/json", body, conversation_id)


def stream_replay(
    idem: Idempotency | None, conversation_id: str, finished: Callable[[], bool]
) -> Callable[[bool, list[str]], Awaitable[None]] | None:
    """The SSE `on_close` of an idempotent stream: store the whole stream (its frames, as sent) for
    replay when it ran to its end, else release the key so a retry runs again. None without a key:
    then nothing keeps the frames. A store refusing that write (a full disk, an outage) is one
    log line: the client has its stream; the key, left pending but no longer worked on, is taken
    over by a repeat once the store takes writes (`Idempotency.abandon`)."""
    if idem is None:
        return None

    async def on_close(completed: bool, payloads: list[str]) -> None:
        try:
            if completed and finished():
                await idem.finish(200, "text/event-stream; charset=utf-8", "".join(payloads), conversation_id)
            else:
                await idem.abandon()
        except StoreUnavailable as exc:
            log.warning(
                "Idempotency-Key %r: the end of its stream in conversation %s could not be kept: %s",
                idem.key,
                conversation_id,
                exc.cause if isinstance(exc, WriteRefused) else exc,
            )

    return on_close


# ---------------------------------------------------------------- driving a turn


@dataclass(slots=True)
class TurnRun:
    """One turn this request drives: a new submission, or an awaiting turn resumed with answers."""

    server: Server
    conversation_id: str
    handle: TurnHandle
    base_blocks: int = 0  # blocks before this request (a resumed turn shows only what follows)
    # Characters of the last of those blocks (text or reasoning) shown before: a resumed turn's
    # new text joins that block when the model's reply ended with text after its calls.
    base_text: int = 0
    after_revision: int = -1
    resolved_calls: list[str] = field(default_factory=list)  # server calls answered by this request
    started: bool = True
    # The turn's usage when this request resumed it (its earlier model calls, which the responses
    # of the earlier requests reported): this request reports only what it adds (`request_usage`).
    base_usage: dict[str, int] = field(default_factory=dict)
    # A repeat's view of the turn as it paused (`past_pause`): the turn has moved on, and nothing
    # the repeat does (its client leaving) cancels it.
    moved_on: bool = False

    @property
    def turn_id(self) -> str:
        return self.handle.turn_id

    async def snapshots(
        self, keepalive_s: float | None, stopping: Stopping | None = None, tap: DeltaTap | None = None
    ) -> AsyncIterator[TurnSnapshot | None]:
        """Newer snapshots (latest-wins), None when nothing changed for `keepalive_s`. With
        `stopping`, the server's stop ends the iteration early (the last snapshot yielded is not
        terminal then, and `stopping.stopped` is true), and so does the end of the request's
        credential (`stopping.ended`, credential_end.py): the stream ends with its error event.
        With `tap` (and a keepalive): while the consumer waits, having shown all of the last
        snapshot, the text deltas that only continue a block are offered to `tap` as the turn
        applies them (`TurnController.next_snapshot_tapped`): the ones it shows yield nothing."""
        controller = self.handle.controller
        seen = self.after_revision
        quiet = Quiet(keepalive_s) if keepalive_s else None
        me = asyncio.current_task() if stopping is not None else None
        unread = Unread(self.handle)
        try:
            while True:
                task = None
                if unread.given_up:
                    return  # its end cannot be read here: `self.handle.unreadable`, the caller answers so
                if stopping is not None:
                    if stopping.stopped or stopping.ended(me):
                        return
                    task = stopping.enter(me)
                got: TurnSnapshot | None
                try:
                    unread.inside = True
                    if quiet is None:
                        got = await controller.next_snapshot(seen)
                    elif tap is not None:
                        got, seen = await controller.next_snapshot_tapped(seen, quiet, tap)
                    else:
                        got = await controller.next_snapshot_or_quiet(seen, quiet)
                except asyncio.CancelledError:
                    if stopping is not None and stopping.caught(task):
                        return
                    if unread.caught():
                        return
                    raise
                finally:
                    unread.inside = False
                    if stopping is not None:
                        stopping.leave(task)
                if got is None:
                    yield None
                    continue
                snap = got
                seen = snap.revision
                yield snap
                if snap.status in TERMINAL_STATUSES:
                    return
        finally:
            unread.close()
            if quiet is not None:
                quiet.close()

    async def withdraw_if_queued(self) -> None:
        """The request ends before its turn started (the server stops): drop the turn from the
        queue, as when its client leaves, so that the retry the answer asks for is no duplicate.
        A turn already running is left to the kernel's stop (interrupted, its text kept)."""
        if self.handle.controller.phase == "queued":
            await self.cancel()

    async def cancel(self) -> None:
        """The client went away: cancel this turn if it is the conversation's current one, or drop
        it from the queue if it has not started (nobody is left to read its answer)."""
        if self.moved_on:
            return
        try:
            await self.server.kernel.cancel(self.conversation_id, self.turn_id, client_left=True)
        except StoreUnavailable as exc:
            log.warning("could not cancel turn %s after a disconnect: %s", self.turn_id, exc)
        except Exception:
            log.exception("could not cancel turn %s after a disconnect", self.turn_id)


class Unread:
    """A wait of a request's task on its turn, ended when the turn's end cannot be read here
    (`TurnHandle.give_up_reading`: this server, cut off from its cluster, let the turn go unsaved
    and could not read its end in time). Only a wait marked `inside` is cancelled, never the
    consumer's own work between two snapshots; `caught` tells that cancel from any other."""

    def __init__(self, handle: TurnHandle) -> None:
        self._handle = handle
        self._task = asyncio.current_task()
        self._woke = False
        self.inside = False
        handle.add_reader(self._wake)

    @property
    def given_up(self) -> bool:
        return self._handle.unreadable

    def _wake(self) -> None:
        if self.inside and self._task is not None and not self._woke:
            self._woke = True
            self._task.cancel()

    def caught(self) -> bool:
        """The cancel being handled is this one's (it is taken back)."""
        if not self._woke or self._task is None:
            return False
        self._woke = False
        self._task.uncancel()
        return True

    def close(self) -> None:
        self._handle.remove_reader(self._wake)


def unread_answer(run: TurnRun) -> ApiError:
    """503 for a request whose turn's end this server could not read in time, cut off from its
    cluster (docs/scale-out.md): no failure, which the turn may not have had (another server may
    have run it), but an outcome unknown here; the same request with its Idempotency-Key, on
    another server, follows that turn or runs it anew."""
    return ApiError(
        503,
        "this server lost the database while the turn was running and could not read how it ended (it may "
        "have run on another server of the cluster); send the request again with the same Idempotency-Key, "
        "to another server if this one is still unavailable",
        code="store_unavailable",
        headers={"Retry-After": "1", HEADER: run.conversation_id},
    )


class TurnSeat:
    """The open-turn place (`[limits] open_turns_per_client`, in the count the WebSocket's turns
    take too: `TurnPlaces`) an HTTP request takes for its turn, held from the accept until the
    turn ends, however late: a reply with client tool calls or an approval request returns while
    its turn stays open, paused, holding no `connections_per_client` slot.

    Taken before anything is written (`take`): a request with new input past the cap is refused
    429 `too_many_open_turns`. One answering calls may need no place (the paused turn it resumes
    holds one), so it goes on without one when all are taken; should its answers need a turn
    written paused for them (a fork, a seeded history), it is refused the same way just before
    that conversation would be written (`admit_written`, the matcher's `Answers.before_write`),
    nothing written. `settle` keeps the place with the turn the request ended up with, or gives
    it back."""

    def __init__(self, places: TurnPlaces, principal: Principal) -> None:
        self.places = places
        self.key = open_turns_key(principal)
        self.taken = False

    @property
    def counted(self) -> bool:
        return self.key is not None and self.places.open_turns.per_client > 0

    def refusal(self) -> ApiError:
        # a place frees when a turn ends (a paused one: answered, cancelled or timed out), not in
        # the seconds an SDK's retries wait
        return ApiError(
            429,
            self.places.open_turns.refusal(),
            code=TOO_MANY_OPEN_TURNS,
            headers={"x-should-retry": "false"},
        )

    def take(self, options: dict[str, Any], *, answering: bool) -> None:
        """Take a place before the request writes anything; `options` (the turn's) then name its
        credential (`COUNTED_FOR`: a restart counts the turn again). Never awaits."""
        self.places.count_restored()
        if not self.counted:
            return
        if self.places.open_turns.take(self.key):
            self.taken = True
            options[COUNTED_FOR] = self.key
        elif not answering:
            raise self.refusal()

    def admit_written(self) -> None:
        """Just before a conversation paused at the calls this request answers is written for
        them (a fork, a seeded history): its turn would be open past the cap when the request
        holds no place (all were taken), so it is refused 429 then, with nothing written (no
        conversation, no turn for a refused request to leave behind). Never awaits."""
        if not self.taken and self.counted:
            raise self.refusal()

    def settle(self, run: TurnRun | None) -> None:
        """The request placed its input: `run` (None: it failed). The place taken is held by the
        turn until it ends, or given back when nothing new needs it (no turn, or one that holds a
        place already: a paused turn answered, an idempotent repeat's). Never awaits."""
        if not self.taken:
            return
        self.taken = False
        if run is None or run.moved_on or self.places.open_turns.holds(run.turn_id):
            self.places.open_turns.give_back(self.key)
        else:
            self.places.hold(self.key, run.handle)


def max_steps_note(server: Server, agent: AgentRecord) -> str:
    """The text a client sees when the server's loop stopped a turn at its step limit."""
    return steps_note(int(agent.params.get("max_steps") or server.config.limits.max_steps))


def client_pending(snap: TurnSnapshot) -> list[dict[str, Any]]:
    return [p for p in snap.pending if p.get("kind") == "client"]


def approval_pending(snap: TurnSnapshot) -> list[dict[str, Any]]:
    return [p for p in snap.pending if p.get("kind") == "approval"]


async def pending_call_ids(server: Server, conversation_id: str) -> list[str]:
    """Ids (as clients see them: `mcpr_…` for approvals) of the calls a paused turn waits for."""
    awaiting = await server.kernel.awaiting(conversation_id)
    if awaiting is None:
        return []
    pending = [p for p in await server.store.list_pending(awaiting.id) if p.status == "pending"]
    return [p.call_id if p.kind == "client" else f"mcpr_{p.call_id}" for p in pending]


async def named_answers(
    server: Server, place: Placement, decisions: list[Decision], shown: list[dict[str, str]]
) -> list[Decision]:
    """Legacy `function` results answer a call by its function's name (the legacy API shows no
    call id): each becomes an answer to the call the transcript showed, of the round made at the
    point it continues (`answer_at_round`: `shown` are the calls its legacy replies showed), or,
    placed elsewhere (a fork or a new conversation, paused at those calls), to the first waiting
    call of that name. Not the point's first waiting call: once another request (on another server)
    answered it, none waits, and the answer, naming no call, could not fork as a racing one does."""
    if not any(legacy_name(d.call_id) for d in decisions):
        return decisions
    if place.round_calls:
        return [dataclasses.replace(d, call_id=answer_at_round(d.call_id, place.round_calls, shown)) for d in decisions]
    conversation_id = place.conversation_id
    awaiting = await server.kernel.awaiting(conversation_id)
    if awaiting is None:
        return decisions
    waiting = [(p.call_id, p.name) for p in await server.store.list_pending(awaiting.id) if p.status == "pending"]
    return [dataclasses.replace(d, call_id=by_name(d.call_id, waiting)) for d in decisions]


def already_given(p: PendingCall | None, d: Decision) -> bool:
    """`d` repeats the answer call `p` already has (a stateless client resending its history)."""
    return repeats_answer(p, d)


def answered_approvals(before: TurnSnapshot, given: dict[str, PendingCall], decisions: list[Decision]) -> list[str]:
    """The approvals of this pause the response that resumes it shows as `mcp_call`s: answered now,
    or answered by an earlier request of a round answered in parts (their calls have not run: no
    result in `before` yet), in the order the calls were made."""
    now = {d.call_id for d in decisions if d.action in ("approve", "deny")}
    # "result" on an approval: approved in a fork, the result it had where it ran reused
    earlier = {cid for cid, p in given.items() if p.kind == "approval" and p.status in ("approved", "denied", "result")}
    return [
        b["call_id"]
        for b in before.blocks
        if b["type"] == "tool_call"
        and (
            b["call_id"] in now
            or (b["call_id"] in earlier and (b.get("status") in ("pending_approval", "streaming") or answered_unrun(b)))
        )
    ]


@dataclass
class PausedTurn:
    """A turn waiting for answers, as a request that answers it finds it: its handle, what it
    showed (`before`, taken before the answers apply) and the answers it already has (`given`)."""

    handle: TurnHandle
    before: TurnSnapshot
    given: dict[str, PendingCall]

    @classmethod
    async def load(cls, server: Server, awaiting: TurnRecord) -> PausedTurn:
        handle = await server.kernel.handle_for(awaiting)
        given = {p.call_id: p for p in await server.store.list_pending(awaiting.id) if p.status != "pending"}
        return cls(handle, handle.controller.snapshot(), given)

    def fresh(self, decisions: list[Decision]) -> list[Decision]:
        """The answers that are new: a stateless client resends every answer it gave, and one this
        turn already has (the same answer) is history, not new input."""
        return [d for d in decisions if not already_given(self.given.get(d.call_id), d)]

    async def run(
        self, server: Server, conversation_id: str, applied: list[Decision], shown_before: bool = False
    ) -> TurnRun:
        """The request's view of the turn resumed by `applied`; `shown_before`: nothing was new,
        and the answer shows the turn as it is now (it still waits for the rest)."""
        before = self.before
        still = await self.waiting_elsewhere(server)
        if still is not None:  # nothing more to wait for: the reply shows the calls still open
            snap = still.controller.snapshot()
            return TurnRun(
                server,
                conversation_id,
                still,
                base_blocks=len(snap.blocks),
                base_text=shown_text(snap),
                after_revision=snap.revision - 1,
                resolved_calls=answered_approvals(before, self.given, applied) if applied else [],
                base_usage=dict(snap.usage),
            )
        return TurnRun(
            server,
            conversation_id,
            self.handle,
            base_blocks=len(before.blocks),
            base_text=shown_text(before),
            after_revision=before.revision - 1 if shown_before else before.revision,
            resolved_calls=answered_approvals(before, self.given, applied) if applied else [],
            base_usage=dict(before.usage),
        )

    async def waiting_elsewhere(self, server: Server) -> TurnHandle | None:
        """The turn as it waits now, read from the store, when another server of the cluster holds
        it and a client call of its round is still open (the answers given left it waiting). That
        server publishes no new snapshot of a turn that stays paused, so this server's mirror of it
        shows neither the answers nor anything newer to wait for: a reply waiting for it never
        came. None when this server holds the turn (its runtime shows the change) or the round was
        answered whole (the turn resumes there, and the mirror follows it)."""
        if server.kernel.holds(self.handle.conversation_id):
            return None
        turn = await server.store.get_turn(self.handle.turn_id)
        if turn is None or turn.status != "awaiting":
            return None
        pending = await server.store.list_pending(turn.id)
        if not any(p.status == "pending" and p.kind == "client" for p in pending):
            return None
        controller = await controller_from_store(server.store, turn, pending, follower=True)
        return TurnHandle(turn.id, turn.conversation_id, controller)


def answer_settings(options: dict[str, Any], client_tools: Sequence[Any]) -> TurnSettings:
    """What a request answering a paused turn brings for the turn's model calls after its answers
    (OpenAI's rule: every request is its own model call, with its own parameters): its options
    (sampling, max tokens, format, tool_choice, parallel_tool_calls, reasoning effort,
    instructions, the agent tool scope) and client tools (`ToolSpec`s), in place of those of the
    request that started the turn (`Kernel.respond`)."""
    return TurnSettings(dict(options), [t.to_record() for t in client_tools])


async def answer_paused(
    server: Server,
    conversation_id: str,
    turn_id: str,
    decisions: list[Decision],
    settings: TurnSettings | None = None,
    idempotency: tuple[str, str] | None = None,
) -> TurnRun | None:
    """Paused turn `turn_id` (the one a request's point or previous response shows) resumed with
    the answers it has not yet, and the request's `settings` for its model calls after them
    (`answer_settings`): start_turn's answering, the check and the answer as one step.
    None when there is nothing of it to do here: the conversation waits on no such turn, nothing
    is new, or the answer was refused (start_turn then answers as ever), or another request
    answered the calls first. On one server the matcher's claim makes that request fork; across
    the servers of a cluster each claim is one server's, and the answer itself (all or none)
    decides which request continues (see `round_answered`)."""
    kernel = server.kernel
    awaiting = await kernel.awaiting(conversation_id)
    if awaiting is None or awaiting.id != turn_id:
        return None
    paused = await PausedTurn.load(server, awaiting)
    fresh = paused.fresh(decisions)
    if not fresh:
        return None
    try:
        results = await kernel.respond(conversation_id, fresh, whole=True, settings=settings)
    except (InvalidInput, NotAwaiting):
        # answers contradicting each other (start_turn refuses them in its words), or the turn
        # resumed meanwhile (by another request's answers)
        return None
    except KernelError as exc:
        raise from_kernel(exc) from None
    if not all(r.get("accepted") for r in results):
        return None  # nothing applied (all or none): answered meanwhile, or start_turn's refusal
    run = await paused.run(server, conversation_id, fresh)
    await keep_answers_key(server, idempotency, run)
    return run


async def round_answered(server: Server, turn_id: str, decisions: list[Decision]) -> bool:
    """Did other requests answer every call of turn `turn_id`'s round, these answers' calls among
    them, so that the turn moved on without this request? Answering them again forks from the
    point before, as the second of two requests racing on one server does (docs/openai.md
    "Racing requests")."""
    if not decisions:
        return False
    calls = {p.call_id: p for p in await server.store.list_pending(turn_id)}
    answered = ("result", "approved", "denied")
    return all(c.status != "pending" for c in calls.values()) and all(
        d.call_id in calls and calls[d.call_id].status in answered for d in decisions
    )


USAGE_KEYS = ("input_tokens", "output_tokens", "cached_tokens", "reasoning_tokens")


def request_usage(usage: dict[str, int] | None, base: dict[str, int] | None = None) -> dict[str, int]:
    """The usage of one request's model calls: the turn's running total (`usage`) less what it was
    when the request resumed the turn (`base`: a request answering tool calls continues a turn
    whose earlier calls the earlier responses reported), as OpenAI reports each request's own.
    Never negative."""
    u, b = usage or {}, base or {}
    return {k: max(0, int(u.get(k, 0) or 0) - int(b.get(k, 0) or 0)) for k in USAGE_KEYS}


def shown_text(snap: TurnSnapshot) -> int:
    """The length of the snapshot's last block when it is text or reasoning (else 0): what of it
    was shown before the turn resumes (`TurnRun.base_text`)."""
    last = snap.blocks[-1] if snap.blocks else None
    return len(last["text"]) if last is not None and last["type"] in ("text", "reasoning") else 0


def new_blocks(snap: TurnSnapshot, run: TurnRun) -> list[tuple[int, dict[str, Any]]]:
    """(block index, block) of what the request's turn added: the blocks after `base_blocks`, led
    by the text the resumed turn added to the last block before (`base_text`), when it did. A
    reply that ends with text after its calls leaves a text block last; the snapshot joins the
    resumed turn's first text to it, and the answer would otherwise show nothing of the reply."""
    out: list[tuple[int, dict[str, Any]]] = []
    if run.base_text and 0 < run.base_blocks <= len(snap.blocks):
        i = run.base_blocks - 1
        last = snap.blocks[i]
        if last["type"] in ("text", "reasoning") and len(last["text"]) > run.base_text:
            out.append((i, {**last, "text": last["text"][run.base_text :]}))
    out.extend((i, snap.blocks[i]) for i in range(run.base_blocks, len(snap.blocks)))
    return out


async def refuse_closed_calls(server: Server, conversation_id: str, decisions: list[Decision], param: str) -> None:
    """No turn of the conversation waits for answers: ones to calls its history already closed
    are a 400 `already_resolved` on every route (chat and Responses alike), not "nothing waits"
    (409), saying what closed each (another request's answer, its deadline, or the end of its turn:
    a call the token limit cut off, say, which the reply showed)."""
    wanted = {d.call_id for d in decisions}
    closed = {
        m.tool_call_id: m.turn_id
        for m in await server.store.list_messages(conversation_id)
        if m.role == "tool" and m.tool_call_id in wanted
    }
    if closed:
        why = [await why_closed(server, cid, turn_id) for cid, turn_id in sorted(closed.items())]
        raise ApiError(400, "; ".join(why), code="already_resolved", param=param)


async def why_closed(server: Server, call_id: str, turn_id: str | None) -> str:
    """Why call `call_id` of turn `turn_id` can no longer be answered."""
    store = server.store
    p = next((p for p in await store.list_pending(turn_id) if p.call_id == call_id), None) if turn_id else None
    if p is not None and p.status in ("result", "approved", "denied"):
        return f"call {call_id} can no longer be answered: another request answered it first"
    if p is not None and p.status == "expired":
        waited = f" after {p.expires_at - p.created_at:.0f} s" if p.expires_at and p.created_at else ""
        return f"call {call_id} can no longer be answered: it expired unanswered{waited}"
    turn = await store.get_turn(turn_id) if turn_id else None
    cut = {"max_tokens": "the token limit", "content_filter": "the content filter"}.get(
        (turn.stop_reason or "") if turn is not None else ""
    )
    if turn is not None and turn.status == "completed" and cut is not None:
        return (
            f"call {call_id} can no longer be answered: {cut} cut the reply off before the call was complete; "
            "its turn ended and closed it (it never ran)"
        )
    how = {
        "cancelled": "was cancelled",
        "failed": "failed",
        "interrupted": "was interrupted by a server stop",
    }.get(turn.status if turn is not None else "", "ended (cancelled, failed, or interrupted by a server stop)")
    return f"call {call_id} can no longer be answered: its turn {how} and closed it"


async def start_turn(
    server: Server,
    agent: AgentRecord,
    conversation_id: str,
    *,
    content: str | list[dict[str, Any]] | None,
    decisions: list[Decision],
    client_tools: list[Any],
    options: dict[str, Any],
    source: dict[str, Any],
    system: list[dict[str, str]] | None = None,
    overlap_accept: bool = False,
    while_pending: Callable[[list[str]], ApiError] | None = None,
    idempotency: tuple[str, str] | None = None,
    answers_param: str = "input",
    request: Request | None = None,
) -> TurnRun:
    """`system`: system/developer messages the conversation keeps with the new input, before its
    user message ([{"role", "text"}]: a Responses request's input items; SubmitRequest.system).
    `overlap_accept`: the caller answers only once the turn settled (see SubmitRequest).
    `request`: the HTTP request whose credential may end while its input waits to be accepted
    (the store slow or locked): see `_accept_watched`.
    `while_pending`: the error for new input while the conversation waits for answers to calls
    (their client-visible ids); HTTP answers at once instead of queueing (DESIGN §13).
    `answers_param`: the field that carried the answers, named by a refusal of them.
    `options`, `client_tools`: the new turn's; with `decisions`, the paused turn's from its answers on
    (`answer_settings`)."""
    kernel = server.kernel
    new_turn = SubmitRequest(
        agent=agent.id,
        input=content or "",
        system=list(system or ()),
        conversation=conversation_id,
        source=source,
        client_tools=client_tools,
        options=options,
        resolved=agent,
        overlap_accept=overlap_accept,
        idempotency_key=idempotency[0] if idempotency else None,
        idempotency_scope=idempotency[1] if idempotency else None,
        rerun_of=idempotency.rerun if isinstance(idempotency, TurnKey) else None,
    )
    try:
        if decisions:
            if content:
                raise ApiError(
                    400,
                    "send tool results (or approval answers) and new user input in separate requests",
                    code="mixed_input",
                )
            awaiting = await kernel.awaiting(conversation_id)
            if awaiting is None:
                again = await rerun_answers(server, new_turn, decisions, request)
                if again is not None:
                    return again
                await refuse_closed_calls(server, conversation_id, decisions, answers_param)
                raise ApiError(
                    409, "this conversation has no turn waiting for tool results or approvals", code="not_awaiting"
                )
            paused = await PausedTurn.load(server, awaiting)
            decisions = paused.fresh(decisions)
            if not decisions:  # nothing new: the turn still waits for the rest, as it shows now
                return await paused.run(server, conversation_id, [], shown_before=True)
            # one request: all or none; its options and client tools are those of the model calls after them
            settings = answer_settings(options, client_tools)
            results = await kernel.respond(conversation_id, decisions, whole=True, settings=settings)
            refused = [r for r in results if not r.get("accepted")]
            if refused:
                raise ApiError(
                    400,
                    "; ".join(str(r.get("message")) for r in refused),
                    # the code the transcript's own check uses for the same mistake (conversation_match)
                    code={"unknown_call": "unknown_tool_call"}.get(str(refused[0].get("error")), "already_resolved"),
                    param=answers_param,  # the request's field that carries the answers
                )
            run = await paused.run(server, conversation_id, decisions)
            await keep_answers_key(server, idempotency, run)
            return run
        if not content:
            raise ApiError(400, "there is no new user input to answer", code="missing_input", param="messages")
        if while_pending is not None:
            lookup = pending_call_ids(server, conversation_id)  # a read: it may wait for the writer
            waiting = await (until_credential_ends(request, lookup) if request is not None else lookup)
            if waiting:
                raise while_pending(waiting)
        submit = kernel.submit(new_turn)
        return await accepted(server, submit, request)
    except AgentGone:  # deleted between finding it and accepting the turn: that model is gone
        raise agent_deleted() from None
    except InvalidInput as exc:
        if not decisions:
            raise from_kernel(exc) from None
        # answers that contradict each other (one call answered twice, differently) or the call
        raise ApiError(400, exc.message, code="invalid_input", param=answers_param) from None
    except KernelError as exc:
        raise from_kernel(exc) from None


async def accepted(server: Server, submit: Awaitable[Submission], request: Request | None) -> TurnRun:
    """The run of the turn `submit` accepts, its accept watched for the request's credential
    ending (`_accept_watched`) when it can end."""
    check = credential_check(request) if request is not None else None
    if check is None:
        sub = await submit
        return TurnRun(server, sub.conversation_id, sub.handle)
    return await _accept_watched(server, submit, check)


async def rerun_answers(
    server: Server, new_turn: SubmitRequest, decisions: list[Decision], request: Request | None
) -> TurnRun | None:
    """A keyed repeat of a request whose tool results (or approval answers) resumed a paused turn
    (`keep_answers_key`) that then answered nothing (a stop, a crash, a failure, the client leaving: `TurnKey.rerun`,
    here `new_turn.rerun_of`): the results in the history are this request's own (the same key,
    the same body, each stored as given), not another request's. So the resumption runs again, as
    a new turn (`new_turn`: the request's) re-running that turn's input (`Kernel._rerun`,
    `SubmitRequest.rerun_only`): the input and results kept once, the cut-off reply out of the
    model's view. None when it is not that (other answers, another key, anything said or run
    since): the answers are refused as ever (`refuse_closed_calls`)."""
    store = server.store
    conversation_id = new_turn.conversation or ""
    earlier = await store.get_turn(new_turn.rerun_of) if new_turn.rerun_of else None
    if earlier is None or earlier.conversation_id != conversation_id or "input" in earlier.damaged:
        return None
    wrote = earlier.input.get("rerun_of")
    wrote = wrote if isinstance(wrote, str) else earlier.id  # the turn whose input it ran
    for d in decisions:
        p = await store.get_pending(conversation_id, d.call_id)
        if not answered_as_given(p, d):
            return None  # not these answers, stored as given
        assert p is not None
        asked = earlier if p.turn_id == earlier.id else await store.get_turn(p.turn_id)
        if asked is None or wrote not in (asked.id, asked.input.get("rerun_of")):
            return None  # a call of another input's turn
    system = earlier.input.get("system")
    again = dataclasses.replace(
        new_turn,
        input=earlier.input.get("content") or "",
        system=list(system) if isinstance(system, list) else [],
        rerun_only=True,
    )
    try:
        return await accepted(server, server.kernel.submit(again), request)
    except NotAwaiting:  # not re-runnable after all (`Kernel._rerun`): refused as ever
        return None


def answered_as_given(p: PendingCall | None, d: Decision) -> bool:
    """Call `p` holds answer `d` as that answer left it: a client tool's result (and its error
    flag) as given, an approval's approve or deny (the approved call ran then: its result is in
    the history, which a re-run keeps, never runs it again)."""
    if p is None:
        return False
    if d.action == "result":
        return (p.status, p.output or "", p.is_error) == ("result", d.output or "", d.is_error)
    return p.kind == "approval" and repeats_answer(p, d)


def until_credential_ends(request: Request, work: Awaitable[T]) -> Awaitable[T]:
    """`work` (the reads and writes that place a request's input: finding or making its
    conversation), cancelled once the request's credential ends (credential_end.py) and answered
    with its 401: the store may keep them waiting for many seconds (a lock, an outage). The poll
    starts only after REVOCATION_POLL_S: most requests are placed long before, and never pay for it.
    A credential that cannot end (auth mode none): `work` itself, no wrapper on the hot path.
    The accept itself is watched by `start_turn` (given the request), which never cancels it."""
    check = credential_check(request)
    if check is None:
        return work
    return _until_ended(check, work)


async def _until_ended(check: CredentialCheck, work: Awaitable[T]) -> T:
    me = asyncio.current_task()
    if me is None:
        return await work
    ended: ApiError | None = None
    poller: asyncio.Task[None] | None = None

    async def poll(check: CredentialCheck) -> None:
        nonlocal ended
        while (err := check()) is None:
            await asyncio.sleep(REVOCATION_POLL_S)
        ended = err
        me.cancel()

    def start() -> None:
        nonlocal poller
        poller = loop.create_task(poll(check))

    loop = asyncio.get_running_loop()
    timer = loop.call_later(REVOCATION_POLL_S, start)
    try:
        return await work
    except asyncio.CancelledError:
        if ended is None:
            raise  # cancelled from outside (the server stops)
        me.uncancel()
        raise ended from None
    finally:
        timer.cancel()
        if poller is not None and not poller.done():
            poller.cancel()


async def _accept_watched(server: Server, submit: Awaitable[Any], check: CredentialCheck) -> TurnRun:
    """`submit` (kernel.submit) while the request's credential is watched (credential_end.py): an
    accept may wait on the store (a lock, an outage) for many seconds, and a credential revoked or
    expired meanwhile must not get its turn run and answered once the accept goes through.

    The accept is never cancelled half-way for it (it may have committed already, and a turn
    accepted with nobody holding its handle would run unseen): the request answers 401 within
    about a second of the revoke (REVOCATION_POLL_S), and its turn, should the accept still go
    through, is cancelled as soon as it returns. The credential is checked once more right after
    the accept returned, before the turn's answer is waited for."""
    task: asyncio.Future[Any] = asyncio.ensure_future(submit)
    try:
        while True:
            done, _ = await asyncio.wait((task,), timeout=REVOCATION_POLL_S)
            if done:
                break
            err = check()
            if err is not None:
                task.add_done_callback(lambda t: _cancel_late(server, t))
                raise err
    except asyncio.CancelledError:  # the request is cancelled from outside (the server stops)
        task.cancel()
        raise
    sub = task.result()  # the accept's own error, as before
    run = TurnRun(server, sub.conversation_id, sub.handle)
    err = check()
    if err is not None:  # ended while the accept waited, or just as it returned
        await _cancel_within(run, REVOCATION_POLL_S)
        err.headers.setdefault(HEADER, run.conversation_id)
        raise err
    return run


def _cancel_late(server: Server, task: asyncio.Future[Any]) -> None:
    """The accept of a request that already answered 401 (its credential ended) went through:
    cancel that turn, nobody is left to read it (as when a client leaves)."""
    if task.cancelled() or task.exception() is not None:
        return  # nothing accepted (the error was the store's; nobody waits for it)
    sub = task.result()
    run = TurnRun(server, sub.conversation_id, sub.handle)
    server.kernel.keep_until_done(asyncio.ensure_future(run.cancel()))


async def _cancel_within(run: TurnRun, limit_s: float) -> None:
    """Cancel `run`'s turn, waiting for that at most `limit_s` (the rest goes on in the background)."""
    cancelling = asyncio.ensure_future(run.cancel())
    run.server.kernel.keep_until_done(cancelling)
    await asyncio.wait((cancelling,), timeout=limit_s)


async def wait_or_disconnect(request: Request, coro: Awaitable[Any]) -> tuple[bool | ApiError, Any]:
    """Await `coro` unless the client disconnects first, or the request's credential ends
    (credential_end.py): (why it ended early — True for a disconnect, the error to answer with
    for a credential — else False, result).

    `coro` runs in this task; a listener task cancels it when the client goes away (and a poller,
    when the credential ends). They start only after DISCONNECT_WATCH_DELAY_S: most turns are done
    by then, and never pay for them.
    """
    me = asyncio.current_task()
    assert me is not None
    gone: bool | ApiError = False
    watchers: list[asyncio.Task[None]] = []

    async def listen() -> None:
        nonlocal gone
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                if not gone:
                    gone = True
                    me.cancel()
                return

    async def poll(check: CredentialCheck) -> None:
        nonlocal gone
        err = await credential_ended(check)
        if not gone:
            gone = err
            me.cancel()

    def start() -> None:
        watchers.append(loop.create_task(listen()))
        check = credential_check(request)
        if check is not None:
            watchers.append(loop.create_task(poll(check)))

    loop = asyncio.get_running_loop()
    timer = loop.call_later(DISCONNECT_WATCH_DELAY_S, start)
    try:
        return False, await coro
    except asyncio.CancelledError:
        if not gone:
            raise  # cancelled from outside (shutdown), not by the listener
        me.uncancel()
        return gone, None
    finally:
        timer.cancel()
        for watcher in watchers:
            if not watcher.done():
                watcher.cancel()


def watch_credential(request: Request, stopping: Stopping) -> asyncio.Task[None] | None:
    """For a stream (its producer's task): end it through `stopping` once the request's credential
    ends (credential_end.py); the caller cancels the returned poller when the stream is over."""
    check = credential_check(request)
    me = asyncio.current_task()
    if check is None or me is None:
        return None

    async def poll(check: CredentialCheck) -> None:
        stopping.end(me, await credential_ended(check))

    return asyncio.get_running_loop().create_task(poll(check))


# Where a request notes the conversation its turn went into, for an answer made outside its
# handler (the server's stop).
CONVERSATION_SCOPE_KEY = "appserver.conversation_id"


# ---------------------------------------------------------------- route wrapper

Handler = Callable[[Request], Awaitable[Response]]


def after_turn_refused(exc: StoreUnavailable, conversation_id: str) -> ApiError:
    """A write after the request's turn ended (its reply's place, the answer kept under its key,
    its Response object) refused by the store (a full disk; a stream's, the database away too):
    what the turn saved stays, so the error says that, never "nothing of this request was
    written", and an SDK does not send the input again by itself (it would be stored a second
    time)."""
    cause = exc.cause if isinstance(exc, WriteRefused) else str(exc)
    return ApiError(
        503,
        f"the request's turn ended and what it saved stays in conversation {conversation_id}, but a write after "
        f"it could not be made: {cause}. Do not send the input again (it would be stored a second time): "
        "once the store takes writes again, continue the conversation",
        code="store_unavailable",
        headers={"x-should-retry": "false", HEADER: conversation_id},
    )


def api_route(
    metrics: Metrics,
    route: str,
    methods: dict[str, Handler],
    stopping: Stopping | None = None,
    on_failure: Callable[[BaseException], None] | None = None,
) -> Handler:
    """One endpoint: dispatch by method (405 otherwise), errors as OpenAI objects, metrics. A
    handler still running when the server stops answers 503 `server_shutting_down` (stopping.py)."""

    if "GET" in methods and "HEAD" not in methods:  # as HTTP has it (uvicorn sends no body for HEAD)
        methods = {**methods, "HEAD": methods["GET"]}
    allow = ", ".join(sorted(methods))

    async def guarded(handler: Handler, request: Request) -> Response:
        if stopping is None:
            return await handler(request)
        if stopping.stopped:
            raise shutting_down()
        task = stopping.enter()
        try:
            return await handler(request)
        except asyncio.CancelledError:
            if stopping.caught(task):
                err = shutting_down()
                conversation = request.scope.get(CONVERSATION_SCOPE_KEY)
                if conversation:  # the request's input went into it (what ran of its turn is kept)
                    err.headers.setdefault(HEADER, conversation)
                raise err from None
            raise
        finally:
            stopping.leave(task)

    async def endpoint(request: Request) -> Response:
        handler = methods.get(request.method)
        response: Response
        if handler is None and request.method == "OPTIONS":  # what may I send here? (not an error)
            response = Response(status_code=204, headers={"Allow": f"{allow}, OPTIONS"})
        elif handler is None:
            response = error_response(
                405,
                f"method {request.method} is not allowed on {route}; use {allow}",
                code="method_not_allowed",
                headers={"Allow": allow},
            )
        else:
            try:
                response = await guarded(handler, request)
            except ApiError as exc:
                response = error_response(exc.status, exc.message, code=exc.code, param=exc.param, headers=exc.headers)
            except KernelError as exc:
                e = from_kernel(exc)
                response = error_response(e.status, e.message, code=e.code, param=e.param)
            except StoreValueRefused as exc:  # the client's value (a NUL the database cannot hold)
                response = error_response(400, str(exc), code="invalid_value")
            except StoreUnavailable as exc:  # the database's doing (a restart, a terminated session)
                log.warning("request on %s failed: %s", route, exc)
                conversation = request.scope.get(CONVERSATION_SCOPE_KEY)
                if isinstance(exc, WriteRefused) and conversation:
                    e = after_turn_refused(exc, conversation)
                    response = error_response(e.status, e.message, code=e.code, headers=e.headers)
                else:
                    response = error_response(503, str(exc), code="store_unavailable", headers={"Retry-After": "1"})
            except Exception as exc:
                rid = current_request_id() or new_request_id()  # the x-request-id of this response
                log.exception("request %s on %s failed", rid, route)
                if on_failure is not None:
                    on_failure(exc)  # the store's damage shows in /readyz
                response = error_response(
                    500,
                    f"The server had an error while processing your request (request id {rid}).",
                    code="internal_error",
                    headers={"X-Request-Id": rid},
                )
        if not request.scope.get("state", {}).get(GUARD_ANSWERED):  # else the guard's 413 went out, counted
            metrics.observe_request(
                route, request.method, response.status_code if hasattr(response, "status_code") else 200
            )
        return response

    endpoint.__dict__[_API_ROUTE] = route
    return endpoint


_API_ROUTE = "appserver_api_route"


def is_api_route(endpoint: object) -> bool:
    """Made by `api_route`: answers every method and turns every error into a response itself."""
    return bool(getattr(endpoint, _API_ROUTE, False))


def api_route_label(endpoint: object) -> str | None:
    """The fixed `route` label of an endpoint made by `api_route` in the metrics, else None."""
    label = getattr(endpoint, _API_ROUTE, None)
    return label if isinstance(label, str) else None


class JSONReply(Response):
    """An `application/json` reply of already-encoded JSON, with the head Starlette's `Response`
    writes for it (the caller's headers, then content-length and content-type), built directly."""

    media_type = "application/json"

    def __init__(self, data: str, headers: dict[str, str]) -> None:
        self.status_code = 200
        self.background = None
        self.body = data.encode("utf-8")
        self.raw_headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        self.raw_headers += [(b"content-length", b"%d" % len(self.body)), (b"content-type", b"application/json")]


def json_response(body: Any, *, status: int = 200, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(body, status_code=status, headers=headers)


def dumps(body: Any) -> str:
    return line_safe(fastjson.dumps(body))


async def settle_or_cancel(request: Request, run: TurnRun, settled: Callable[[TurnSnapshot], bool]) -> TurnSnapshot:
    """A non-stream request: the first snapshot that `settled` accepts (or the last one). A client
    that disconnects first cancels the turn it started and gets 499; a request whose credential
    ended first (credential_end.py) cancels it too and answers 401."""

    async def wait() -> TurnSnapshot | None:
        # Wake on pauses and the end only, not on every delta: a non-stream reply needs the outcome.
        # None: its end cannot be read here (`Unread`).
        controller = run.handle.controller
        seen = run.after_revision
        unread = Unread(run.handle)
        try:
            while not unread.given_up:
                unread.inside = True
                try:
                    snap = await controller.wait_settled(after_revision=seen)
                except asyncio.CancelledError:
                    if unread.caught():
                        return None
                    raise
                finally:
                    unread.inside = False
                if snap.terminal or settled(snap):
                    return snap
                seen = snap.revision  # paused for something this request does not end on: wait on
            return None
        finally:
            unread.close()

    request.scope[CONVERSATION_SCOPE_KEY] = run.conversation_id  # a stop's 503 names it too
    try:
        gone, outcome = await wait_or_disconnect(request, wait())
    except asyncio.CancelledError:  # the server stops (or uvicorn gives up on the request)
        await run.withdraw_if_queued()
        raise
    if gone:
        if isinstance(gone, ApiError):  # the credential ended (credential_end.py)
            # Answered within about a second of the revoke even when the cancel has to wait for
            # the store (a lock held elsewhere): it goes on without the request.
            await _cancel_within(run, REVOCATION_POLL_S)
            gone.headers.setdefault(HEADER, run.conversation_id)
            raise gone
        await run.cancel()
        raise ApiError(499, "the client closed the request", code="client_closed")
    if outcome is None:
        raise unread_answer(run)
    snap: TurnSnapshot = outcome
    return snap
