"""The frames of the `/ws` protocol as the client sees them: TypedDicts, both directions.

They are plain dicts at run time (what `json.loads` gives), typed for callers and checkers; the
server validates with its own pydantic models (`appserver/ws/frames.py`), and
tests/test_client_package.py keeps the two lists of frame types equal. Servers may add fields
(DESIGN §13), so read optional ones with `.get`.
"""

from __future__ import annotations

from typing import Any, Literal, NotRequired, TypedDict

PROTOCOL_VERSION = 1
TurnStatus = Literal["running", "awaiting", "completed", "cancelled", "failed"]
TERMINAL: tuple[TurnStatus, ...] = ("completed", "cancelled", "failed")

# ───────────────────────────────────────────────────────────── shapes inside frames


class TextPart(TypedDict):
    type: Literal["text"]
    text: str


class ImagePart(TypedDict):
    type: Literal["image"]
    url: str
    detail: NotRequired[Literal["auto", "low", "high"]]


class ClientTool(TypedDict):
    name: str
    description: NotRequired[str]
    parameters: NotRequired[dict[str, Any]]


class Decision(TypedDict):
    call_id: str
    decision: Literal["approve", "deny"]
    reason: NotRequired[str | None]


class Block(TypedDict, total=False):
    type: Literal["reasoning", "text", "tool_call", "compaction"]
    text: str | None
    call_id: str | None
    name: str | None
    arguments: str | None
    executor: str | None
    status: str | None
    output: str | None
    is_error: bool | None


class PendingCall(TypedDict):
    call_id: str
    name: str
    arguments: str
    kind: Literal["approval", "client"]
    status: str
    expires_at: NotRequired[float | None]


class Snapshot(TypedDict):
    """The whole presentation state of one turn; the newest revision wins."""

    turn_id: str
    conversation_id: str
    agent_id: str
    revision: int
    status: TurnStatus
    phase: str
    stop_reason: str | None
    blocks: list[Block]
    pending: list[PendingCall]
    usage: dict[str, int]
    error: dict[str, Any] | None
    queue_position: int
    attempt: int
    updated_at: float
    resumed_from: NotRequired[str]  # set by the client on a snapshot rebuilt after a reconnect


# ───────────────────────────────────────────────────────────── client → server


class Hello(TypedDict):
    type: Literal["hello"]
    protocol: int
    client: NotRequired[str | None]
    token: NotRequired[str | None]
    request_id: NotRequired[str]


class ListAgents(TypedDict):
    type: Literal["list_agents"]
    request_id: NotRequired[str]


class ListConversations(TypedDict):
    type: Literal["list_conversations"]
    agent: NotRequired[str | None]
    limit: NotRequired[int]
    offset: NotRequired[int]  # at most 10,000; page further with `after`
    after: NotRequired[str]  # the `next` of the page before
    request_id: NotRequired[str]


class CreateConversation(TypedDict):
    type: Literal["create_conversation"]
    agent: str
    title: NotRequired[str | None]
    metadata: NotRequired[dict[str, Any] | None]
    request_id: NotRequired[str]


class GetHistory(TypedDict):
    type: Literal["get_history"]
    conversation: str
    agent: NotRequired[str | None]
    before: NotRequired[int | None]
    limit: NotRequired[int]
    request_id: NotRequired[str]


class Subscribe(TypedDict):
    type: Literal["subscribe"]
    conversation: str
    agent: NotRequired[str | None]
    request_id: NotRequired[str]


class Unsubscribe(TypedDict):
    type: Literal["unsubscribe"]
    conversation: str
    agent: NotRequired[str | None]
    request_id: NotRequired[str]


class SubmitInput(TypedDict):
    type: Literal["submit_input"]
    agent: str
    conversation: NotRequired[str]
    input: str | list[TextPart | ImagePart]
    idempotency_key: NotRequired[str | None]
    source: NotRequired[dict[str, Any] | None]
    client_tools: NotRequired[list[ClientTool]]
    request_id: NotRequired[str]


class ApprovalResponse(TypedDict):
    type: Literal["approval_response"]
    conversation: str
    decisions: list[Decision]
    request_id: NotRequired[str]


class Cancel(TypedDict):
    type: Literal["cancel"]
    conversation: str
    turn_id: NotRequired[str]
    request_id: NotRequired[str]


class GetTurn(TypedDict):
    type: Literal["get_turn"]
    conversation: str
    turn_id: str
    request_id: NotRequired[str]


class ToolResult(TypedDict):
    type: Literal["tool_result"]
    call_id: str
    output: str
    is_error: NotRequired[bool]
    request_id: NotRequired[str]


class Ping(TypedDict):
    type: Literal["ping"]
    request_id: NotRequired[str]


class CronRun(TypedDict):
    type: Literal["cron_run"]
    task: str
    agent: NotRequired[str | None]
    request_id: NotRequired[str]


class PairingList(TypedDict):
    type: Literal["pairing_list"]
    request_id: NotRequired[str]


class PairingDecide(TypedDict):
    type: Literal["pairing_decide"]
    code: str
    decision: Literal["approve", "deny"]
    request_id: NotRequired[str]


ClientFrame = (
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
    | PairingDecide
)

# ───────────────────────────────────────────────────────────── server → client


class Welcome(TypedDict):
    type: Literal["welcome"]
    protocol: int
    server: str
    connection_id: str
    subject: NotRequired[str | None]
    max_frame_bytes: NotRequired[int | None]
    request_id: NotRequired[str | None]


class Ack(TypedDict, total=False):
    type: Literal["ack"]
    turn_id: str | None
    conversation_id: str | None
    queue_position: int | None
    duplicate: bool | None
    cancelled: bool | None
    results: list[dict[str, Any]] | None
    request_id: str | None


class TurnUpdated(TypedDict):
    type: Literal["turn_updated"]
    snapshot: Snapshot
    request_id: NotRequired[str | None]


class Turn(TypedDict):
    """The reply to `get_turn`."""

    type: Literal["turn"]
    snapshot: Snapshot
    request_id: NotRequired[str | None]


class ApprovalRequest(TypedDict):
    type: Literal["approval_request"]
    conversation_id: str
    turn_id: str
    call_id: str
    name: str
    arguments: str
    expires_at: NotRequired[float | None]
    request_id: NotRequired[str | None]


class ApprovalResolved(TypedDict):
    type: Literal["approval_resolved"]
    conversation_id: str
    turn_id: str
    call_id: str
    status: str
    decided_by: NotRequired[str | None]
    request_id: NotRequired[str | None]


class ToolCallRequest(TypedDict):
    type: Literal["tool_call_request"]
    conversation_id: str
    turn_id: str
    call_id: str
    name: str
    arguments: str
    timeout_s: float
    request_id: NotRequired[str | None]


class ConversationState(TypedDict):
    type: Literal["conversation_state"]
    conversation: dict[str, Any]
    state: Literal["idle", "active", "awaiting", "cancelling"]
    subscribed: bool
    active_turn: NotRequired[Snapshot | None]
    pending_approvals: NotRequired[list[PendingCall]]
    queued: NotRequired[int]
    request_id: NotRequired[str | None]


class Agents(TypedDict):
    type: Literal["agents"]
    agents: list[dict[str, Any]]
    request_id: NotRequired[str | None]


class Conversations(TypedDict):
    type: Literal["conversations"]
    conversations: list[dict[str, Any]]
    has_more: NotRequired[bool]
    next: NotRequired[str | None]  # the `after` of the following page, while `has_more`
    request_id: NotRequired[str | None]


class History(TypedDict):
    type: Literal["history"]
    conversation_id: str
    messages: list[dict[str, Any]]
    has_more: NotRequired[bool]
    request_id: NotRequired[str | None]


class Event(TypedDict):
    """A server event, or a local one (`local: True`): `connection_lost`, `reconnected`."""

    type: Literal["event"]
    name: str
    data: NotRequired[dict[str, Any]]
    local: NotRequired[bool]
    request_id: NotRequired[str | None]


class Error(TypedDict):
    type: Literal["error"]
    code: str
    message: str
    param: NotRequired[str | None]
    local: NotRequired[bool]
    request_id: NotRequired[str | None]


class Pong(TypedDict):
    type: Literal["pong"]
    request_id: NotRequired[str | None]


ServerFrame = (
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
    | Pong
)

# Close codes the server uses (4000-4999 are application codes)
CLOSE_AUTH = 4401
CLOSE_PROTOCOL = 4406
CLOSE_SLOW_CONSUMER = 4408
CLOSE_TOO_MANY = 4429
CLOSE_TOO_BIG = 1009
