"""Every frame of the WebSocket protocol (`/ws`), both directions, as pydantic v2 models.

`docs/protocol.md` shows one JSON example per frame; a test validates each example against these
models, so the document and the code cannot drift. Client frames ignore fields they do not know (a
newer client must not break an older server; DESIGN §13), while unknown frame *types* are refused.
Server frames are what the server sends, nothing more (extra fields forbidden, so the examples of
the document cannot carry fields the server never sends). Numbers and booleans are strict: `"1"`
is not the protocol number 1.
"""

from __future__ import annotations

import base64
import json
import math
import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, TypeAdapter, field_validator, model_validator
from pydantic import ValidationError as ValidationError  # what `client_frame` raises (ws/routes.py)

from appserver.http.fields import FUNCTION_NAME
from appserver.images import image_url_problem
from appserver.ws.codes import CLOSE_AUTH as CLOSE_AUTH
from appserver.ws.codes import CLOSE_PROTOCOL as CLOSE_PROTOCOL
from appserver.ws.codes import CLOSE_SLOW_CONSUMER as CLOSE_SLOW_CONSUMER
from appserver.ws.codes import CLOSE_TOO_BIG as CLOSE_TOO_BIG
from appserver.ws.codes import CLOSE_TOO_MANY as CLOSE_TOO_MANY
from appserver.ws.codes import CLOSE_TRY_AGAIN as CLOSE_TRY_AGAIN
from appserver.ws.codes import PROTOCOL_VERSION as PROTOCOL_VERSION


def _no_nul(value: str) -> str:
    """A NUL character cannot be stored as text (PostgreSQL refuses it, and `store copy` could not
    move a SQLite home holding one): refused in every string the server stores or looks up as is."""
    if "\x00" in value:
        raise ValueError("must not contain a NUL character (\\u0000)")
    return value


Text = Annotated[str, AfterValidator(_no_nul)]  # a string that is stored or looked up as it is


class _Frame(BaseModel):
    """A server → client frame: exactly these fields."""

    model_config = ConfigDict(extra="forbid")
    request_id: str | None = None


class _ClientFrame(BaseModel):
    """A client → server frame: unknown fields are ignored (forward compatibility)."""

    model_config = ConfigDict(extra="ignore")
    request_id: str | None = None


class _ClientShape(BaseModel):
    model_config = ConfigDict(extra="ignore")


# ───────────────────────────────────────────────────────────── shared shapes


class TextPart(_ClientShape):
    type: Literal["text"]
    text: str


class ImagePart(_ClientShape):
    """An image by URL: `https://…`, `http://…` (the provider fetches it, as OpenAI's API does) or
    a `data:image/…;base64,…` URL. Other schemes (`file:`, relative paths) are refused, and so is
    a URL with space before its scheme: it is stored and sent on as given, which no fetch takes."""

    type: Literal["image"]
    url: str = Field(min_length=1)
    detail: Literal["auto", "low", "high"] | None = None

    @field_validator("url")
    @classmethod
    def _scheme(cls, url: str) -> str:
        problem = image_url_problem(url)
        if problem is not None:
            raise ValueError(problem)
        return url


InputPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ClientTool(_ClientShape):
    """A tool the connection executes. Its name goes to the model's API as a function name, so it
    follows the rule of OpenAI's and Anthropic's APIs, the one the HTTP front end checks
    (`appserver.http.fields.FUNCTION_NAME`): 1-64 of a-z, A-Z, 0-9, `_` and `-`. A name the
    upstream refuses (`msg.send`) would fail the turn after it began instead of this frame."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = Field(default=None, strict=True)  # passed on to the model as OpenAI's `strict`

    @field_validator("name")
    @classmethod
    def _function_name(cls, name: str) -> str:
        if not FUNCTION_NAME.fullmatch(name):
            shown = repr(name) if len(name) <= 64 else repr(name[:64]) + "…"
            raise ValueError(
                f"{shown} does not match pattern. Expected a string that matches the pattern "
                f"'^{FUNCTION_NAME.pattern}$'."
            )
        return name


class ApprovalDecision(_ClientShape):
    call_id: Text = Field(min_length=1)
    decision: Literal["approve", "deny"]
    reason: Text | None = None


class Block(BaseModel):
    """One block of a turn snapshot: reasoning, text, tool_call or compaction."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["reasoning", "text", "tool_call", "compaction"]
    text: str | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    executor: str | None = None
    status: str | None = None
    output: str | None = None
    is_error: bool | None = None


class PendingCallView(BaseModel):
    model_config = ConfigDict(extra="forbid")
    call_id: str
    name: str
    arguments: str
    kind: Literal["approval", "client"]
    status: str
    expires_at: float | None = None


class Snapshot(BaseModel):
    """The whole presentation state of one turn (DESIGN §4.1). Idempotent: newest revision wins."""

    model_config = ConfigDict(extra="forbid")
    turn_id: str
    conversation_id: str
    agent_id: str
    revision: int
    status: Literal["running", "awaiting", "completed", "cancelled", "failed"]
    phase: str
    stop_reason: str | None = None
    blocks: list[Block]
    pending: list[PendingCallView]
    usage: dict[str, int]
    error: dict[str, Any] | None = None
    queue_position: int
    attempt: int
    updated_at: float


class AgentView(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    name: str
    model: str
    system: str
    tools: dict[str, str]
    params: dict[str, Any]
    created_at: float
    updated_at: float


class ConversationView(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    agent_id: str
    default: bool
    title: str
    user: str | None = None
    forked_from: str | None = None
    metadata: dict[str, Any]
    created_at: float
    updated_at: float


class MessageView(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: int | None
    turn_id: str | None = None
    role: str
    content: str | list[dict[str, Any]]
    completion_status: str
    created_at: float
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    is_error: bool | None = None
    reasoning: str | None = None
    refusal: str | None = None  # the part of the content (its end) that is the model's refusal
    source: dict[str, Any] | None = None
    meta: dict[str, Any] | None = None  # a compaction's numbers; a developer message's {"role": "developer"}


# ───────────────────────────────────────────────────────────── client → server


class Hello(_ClientFrame):
    type: Literal["hello"]
    protocol: int = Field(strict=True)
    client: Text | None = None
    token: str | None = None


class ListAgents(_ClientFrame):
    type: Literal["list_agents"]


# The most conversations `offset` skips. Each one skipped still costs an index entry, read on the
# event loop; a client pages further with `after` (keyset paging: a seek, what the first page costs).
MAX_LIST_OFFSET = 10_000
_CURSOR_MAX_CHARS = 512


def page_cursor(updated_at: float, conversation_id: str) -> str:
    """The opaque `next` of a `conversations` page: where its last conversation is in the list's
    order (updated_at, id). Floats survive JSON exactly (repr), so the seek lands on that row."""
    raw = json.dumps([updated_at, conversation_id], ensure_ascii=False).encode("utf-8")
    return base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _finite(number: float) -> bool:
    """A finite number a float holds: an integer of hundreds of digits is none (math.isfinite raises)."""
    try:
        return math.isfinite(number)
    except OverflowError:
        return False


def read_cursor(cursor: str) -> tuple[float, str]:
    """The (updated_at, id) a `page_cursor` holds; ValueError for anything else."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        value = json.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        value = None
    if (
        isinstance(value, list)
        and len(value) == 2
        and isinstance(value[0], int | float)
        and not isinstance(value[0], bool)
        and _finite(value[0])
        and isinstance(value[1], str)
        and "\x00" not in value[1]
        and not _LONE_SURROGATE.search(value[1])  # (a JSON escape of one: no text to bind)
    ):
        return float(value[0]), value[1]
    raise ValueError("not a cursor this server gave: send the `next` of the page before as it is")


class ListConversations(_ClientFrame):
    """`offset` is capped (`MAX_LIST_OFFSET`); `after`, the `next` of the page before, reaches any
    page at the cost of the first."""

    type: Literal["list_conversations"]
    agent: Text | None = None
    limit: int = Field(default=100, ge=1, le=1000, strict=True)
    offset: int = Field(default=0, ge=0, strict=True)
    after: str | None = Field(default=None, max_length=_CURSOR_MAX_CHARS)

    @field_validator("offset")
    @classmethod
    def _offset_capped(cls, value: int) -> int:
        if value > MAX_LIST_OFFSET:
            raise ValueError(
                f"at most {MAX_LIST_OFFSET}; page on with `after` (the `next` of the page before) instead of an offset"
            )
        return value

    @field_validator("after")
    @classmethod
    def _after_readable(cls, value: str | None) -> str | None:
        if value is not None:
            read_cursor(value)
        return value

    @model_validator(mode="after")
    def _one_way_to_page(self) -> ListConversations:
        if self.after is not None and self.offset:
            raise ValueError("give `after` or `offset`, not both: `after` is where the page starts")
        return self


TITLE_MAX_CHARS = 1000
METADATA_MAX_BYTES = 16 * 1024


class CreateConversation(_ClientFrame):
    """`title` and `metadata` are bounded: every `list_conversations` page carries them, and a page
    of 1,000 conversations with megabytes each would be gigabytes (DESIGN: every input bounded)."""

    type: Literal["create_conversation"]
    agent: Text = Field(min_length=1)
    title: Text | None = Field(default=None, max_length=TITLE_MAX_CHARS)
    metadata: dict[str, Any] | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata_small(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return _at_most(value, "metadata", METADATA_MAX_BYTES)


def _at_most(value: dict[str, Any] | None, name: str, max_bytes: int) -> dict[str, Any] | None:
    """`value` if it is at most `max_bytes` as JSON (UTF-8, as it is stored), else ValueError."""
    if value is not None and len(json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")) > max_bytes:
        raise ValueError(f"{name} is larger than {max_bytes} bytes as JSON")
    return value


class GetHistory(_ClientFrame):
    type: Literal["get_history"]
    conversation: Text = Field(min_length=1)
    agent: Text | None = None  # needed only with conversation "default"
    before: int | None = Field(default=None, strict=True)
    limit: int = Field(default=100, ge=1, le=1000, strict=True)


class Subscribe(_ClientFrame):
    type: Literal["subscribe"]
    conversation: Text = Field(min_length=1)
    agent: Text | None = None  # needed only with conversation "default"


class Unsubscribe(_ClientFrame):
    """Names its conversation as `subscribe` does: `default` with `agent` is the default
    conversation `subscribe` took (was: the literal id "default", acked while nothing changed)."""

    type: Literal["unsubscribe"]
    conversation: Text = Field(min_length=1)
    agent: Text | None = None  # needed only with conversation "default"


# `source` is stored with the turn and on its messages, and every `history` page carries it: bounded
# as `metadata` is, with room for what a channel gateway records (up to 1,000 batched message ids).
SOURCE_MAX_BYTES = 256 * 1024


class SubmitInput(_ClientFrame):
    type: Literal["submit_input"]
    agent: Text = Field(min_length=1)
    conversation: Text = Field(default="default", min_length=1)
    input: str | list[InputPart]
    # no control characters: the server's own keys (cron's, a namespace's prefix) are built with one
    idempotency_key: str | None = Field(default=None, max_length=256, pattern=r"^[^\x00-\x1f\x7f]*$")
    source: dict[str, Any] | None = None
    client_tools: list[ClientTool] = Field(default_factory=list)

    @field_validator("source")
    @classmethod
    def _source_small(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return _at_most(value, "source", SOURCE_MAX_BYTES)


class ApprovalResponse(_ClientFrame):
    type: Literal["approval_response"]
    conversation: Text = Field(min_length=1)
    decisions: list[ApprovalDecision] = Field(min_length=1)
    # The person the client answers for (a chat gateway: who pressed the button). Recorded as
    # `<person> (via <client>)`: the client vouches for it, and the record says which client did.
    # A display name as a platform gives it: controls (a NUL too) become spaces when it is recorded
    # (routes.py `_display_name`), never a refused answer.
    on_behalf_of: str | None = Field(default=None, max_length=4096)


class Cancel(_ClientFrame):
    """With `turn_id`, only that turn: a cancel meant for a turn that has ended never stops the one
    queued behind it (a re-sent cancel after a reconnect, a chat's /cancel racing the next turn)."""

    type: Literal["cancel"]
    conversation: Text = Field(min_length=1)
    turn_id: Text | None = Field(default=None, min_length=1)


class GetTurn(_ClientFrame):
    """One turn's current snapshot by id: how a client that followed a turn learns its outcome
    after a reconnect, also one that left nothing in the history (withdrawn from the queue)."""

    type: Literal["get_turn"]
    conversation: Text = Field(min_length=1)
    turn_id: Text = Field(min_length=1)


class ToolResult(_ClientFrame):
    type: Literal["tool_result"]
    call_id: Text = Field(min_length=1)
    output: Text
    is_error: bool = Field(default=False, strict=True)


class Ping(_ClientFrame):
    type: Literal["ping"]


class CronRun(_ClientFrame):
    """Fire a cron task now, in the server (what `appserver cron run` sends beside a live server).
    Needs the `admin` scope; answered like submit_input, and subscribes the connection."""

    type: Literal["cron_run"]
    task: Text = Field(min_length=1)  # task id or name
    agent: Text | None = None  # narrows a task name that several agents use


class PairingList(_ClientFrame):
    """Pending channel pairing codes (admin scope). Answered by `ack` with `results`."""

    type: Literal["pairing_list"]


class PairingDecide(_ClientFrame):
    """Approve or deny a channel pairing code (admin scope); the gateway acts on it within a second."""

    type: Literal["pairing_decide"]
    code: Text = Field(min_length=1, max_length=64)
    decision: Literal["approve", "deny"]


ClientFrame = Annotated[
    Hello
    | ListAgents
    | ListConversations
    | CreateConversation
    | GetHistory
    | Subscribe
    | Unsubscribe
    | SubmitInput
    | ApprovalResponse
    | Cancel
    | GetTurn
    | ToolResult
    | Ping
    | CronRun
    | PairingList
    | PairingDecide,
    Field(discriminator="type"),
]

# ───────────────────────────────────────────────────────────── server → client


class Welcome(_Frame):
    type: Literal["welcome"]
    protocol: int
    server: str
    connection_id: str
    subject: str | None = None
    max_frame_bytes: int | None = None  # the biggest client frame taken (`limits.ws_frame_max_bytes`)


class Ack(_Frame):
    """The reply to submit_input (turn_id, queue_position), and to frames that need no richer
    answer: unsubscribe, approval_response and tool_result (`results`), cancel (`cancelled`),
    cron_run (turn_id, conversation_id and `results` with the task and its occurrence)."""

    type: Literal["ack"]
    turn_id: str | None = None
    conversation_id: str | None = None
    queue_position: int | None = None
    duplicate: bool | None = None
    cancelled: bool | None = None
    results: list[dict[str, Any]] | None = None


class TurnUpdated(_Frame):
    type: Literal["turn_updated"]
    snapshot: Snapshot


class Turn(_Frame):
    """The reply to `get_turn`: the turn's current snapshot, as `turn_updated` would carry it."""

    type: Literal["turn"]
    snapshot: Snapshot


class ApprovalRequest(_Frame):
    type: Literal["approval_request"]
    conversation_id: str
    turn_id: str
    call_id: str
    name: str
    arguments: str
    expires_at: float | None = None


class ApprovalResolved(_Frame):
    type: Literal["approval_resolved"]
    conversation_id: str
    turn_id: str
    call_id: str
    status: str  # approved | denied | expired | cancelled
    decided_by: str | None = None


class ToolCallRequest(_Frame):
    type: Literal["tool_call_request"]
    conversation_id: str
    turn_id: str
    call_id: str
    name: str
    arguments: str
    timeout_s: float


class ConversationState(_Frame):
    type: Literal["conversation_state"]
    conversation: ConversationView
    state: Literal["idle", "active", "awaiting", "cancelling"]
    subscribed: bool
    active_turn: Snapshot | None = None
    pending_approvals: list[PendingCallView] = Field(default_factory=list)
    queued: int = 0


class Agents(_Frame):
    type: Literal["agents"]
    agents: list[AgentView]


class Conversations(_Frame):
    """`next` (when `has_more`): the `after` of the following page."""

    type: Literal["conversations"]
    conversations: list[ConversationView]
    has_more: bool
    next: str | None


class History(_Frame):
    type: Literal["history"]
    conversation_id: str
    messages: list[MessageView]
    has_more: bool = False  # older messages remain: ask again with `before` = the first one's id


class Event(_Frame):
    type: Literal["event"]
    name: str
    data: dict[str, Any] = Field(default_factory=dict)


class Error(_Frame):
    type: Literal["error"]
    code: str
    message: str
    param: str | None = None


class Pong(_Frame):
    type: Literal["pong"]


ServerFrame = Annotated[
    Welcome
    | Ack
    | TurnUpdated
    | Turn
    | ApprovalRequest
    | ApprovalResolved
    | ToolCallRequest
    | ConversationState
    | Agents
    | Conversations
    | History
    | Event
    | Error
    | Pong,
    Field(discriminator="type"),
]

client_frame: TypeAdapter[Any] = TypeAdapter(ClientFrame)
server_frame: TypeAdapter[Any] = TypeAdapter(ServerFrame)

CLIENT_TYPES = frozenset(m.model_fields["type"].annotation.__args__[0] for m in ClientFrame.__origin__.__args__)  # type: ignore[attr-defined]
SERVER_TYPES = frozenset(m.model_fields["type"].annotation.__args__[0] for m in ServerFrame.__origin__.__args__)  # type: ignore[attr-defined]
