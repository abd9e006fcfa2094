"""Event types: immutable facts, JSON on the wire, one msgspec tagged struct each.

Events only grow: a new field gets a default; a breaking change is a new type. Every
event carries the session it belongs to, the time it was decided (`at`, Unix seconds,
passed in by the caller) and the actor that decided it.
"""

from __future__ import annotations

from typing import Any, Final, Literal

import msgspec

from schemas.defaults import MAX_MESSAGE_CHARS


# `gc=False`: an event is immutable plain data and can never be part of a reference
# cycle, so the cyclic collector need not track it; replaying 10,000 events then costs no
# collector passes over them.
class Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", gc=False):
    session_id: str
    at: float
    actor: str


class ErrorInfo(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    error_type: str
    message: str
    retryable: bool = False


class ResultRef(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A result too large for an event: its JSON is in the `toolbus_artifacts` object
    store under `key`, `size` bytes with this `sha256` (hex); `preview` is its first
    characters."""

    key: str
    size: int
    sha256: str
    preview: str = ""


OutcomeStatus = Literal["succeeded", "failed", "rejected"]


class CallOutcome(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """How one call of a turn ended. A reference, never a copy of the result: the result
    is in the call's terminal event at `result_seq` (or, when large, in the object store
    under `result_ref`). Readers resolve it on request; `result` is only filled in by
    clients that did (and in events written before references)."""

    call_id: str
    tool: str
    status: OutcomeStatus
    result: Any = None
    error: ErrorInfo | None = None
    result_seq: int | None = None
    result_ref: ResultRef | None = None


class ChatMessage(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One earlier message of a conversation a client gives with its request."""

    role: Literal["user", "assistant"]
    content: str


class ThinkRequest(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A think step a request gives (`built-in:reason`, seed 000): run before the turn's
    first answer, its output, valid against `output_schema`, kept as `step_outputs[id]`."""

    id: str
    instruction: str
    output_schema: dict[str, Any]


class TurnRequested(Event, frozen=True, tag="turn.requested"):
    turn_id: str
    request_id: str
    call_ids: list[str]
    agent: str | None = None  # who asks: tool grants are per agent
    # A planner turn: the user's message; the model decides the calls (none given).
    message: str | None = None
    # The conversation before `message`, when the client keeps it (`messages`).
    history: list[ChatMessage] = []
    # The injected tool event (`trigger_processing`) that started it; its message is "".
    trigger: str | None = None
    think: list[ThinkRequest] = []  # think steps the request gave, after the agent's


class ModelToolCall(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One tool call a model asked for: its toolbus call id (assigned when the response
    is stored), the provider's id for it, and what the provider needs echoed."""

    call_id: str
    id: str
    name: str
    arguments: Any
    extra: dict[str, Any] = {}


ModelPurpose = Literal["chat", "match", "think"]


class ModelRequested(Event, frozen=True, tag="model.requested"):
    """The planner is calling the model for a turn. Never the history again: the turn's
    events are it. The digests say what was offered.

    `purpose`: `chat`, the agent loop (the model answers or asks for calls); `match`, one
    structured judgement of which `when:` policies apply, for reevaluation `round`;
    `think`, the think step `step` (`built-in:reason`). Iterations count every purpose:
    they number the turn's model round trips."""

    turn_id: str
    iteration: int
    provider: str
    model: str
    tools: int  # how many tools were offered
    tools_digest: str
    settings: dict[str, Any] = {}
    purpose: ModelPurpose = "chat"
    step: str | None = None  # the think step's id
    round: int = 0  # the reevaluation round a `match` judges for


class ModelResponded(Event, frozen=True, tag="model.responded"):
    turn_id: str
    iteration: int
    text: str
    tool_calls: list[ModelToolCall] = []
    finish_reason: str | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    latency_ms: float = 0.0
    response_id: str | None = None
    purpose: ModelPurpose = "chat"
    step: str | None = None
    round: int = 0
    # A structured reply (`match`, `think`): the JSON it parsed to, and every way it
    # breaks the schema asked for (none: the output counts).
    output: Any = None
    violations: list[str] = []


class PoliciesMatched(Event, frozen=True, tag="policies.matched"):
    """Which of the agent's behaviour policies apply in a turn: at its start (`round` 0)
    and after each reevaluation (`round` n). `by_model` are the `when:` policies the
    model judged to apply (its judgement is the `match` round trip at `model_iteration`);
    the others in `matched` were judged locally (`when_state:`, or no condition).
    `notes` say what was set aside (a `when_state` that raised, an id the model made up)."""

    turn_id: str
    round: int
    matched: list[str]
    by_model: list[str] = []
    model_iteration: int | None = None
    notes: list[str] = []


class TurnReevaluated(Event, frozen=True, tag="turn.reevaluated"):
    """Calls of model iteration `after_iteration` that change what the agent should do
    succeeded (`trigger_call_ids`, of `tools`): the policies are decided again (round
    `round`) and the turn goes on. `capped`: the turn had used its `limit` of
    reevaluations, so nothing is decided again."""

    turn_id: str
    round: int
    after_iteration: int
    trigger_call_ids: list[str]
    tools: list[str]
    limit: int
    capped: bool = False


class OutputEmitted(Event, frozen=True, tag="output.emitted"):
    """The model's `built-in:emit_output` call `call_id` matched the agent's
    `output_schema`: `output` is the turn's result (it ends with `turn.completed`)."""

    turn_id: str
    call_id: str
    output: Any


class OutputRejected(Event, frozen=True, tag="output.rejected"):
    """The model's `built-in:emit_output` call `call_id` broke the output schema:
    `message` lists every violation and goes back to the model as the call's result."""

    turn_id: str
    call_id: str
    message: str
    violations: list[str] = []


class Refusal(msgspec.Struct, frozen=True, kw_only=True):
    """Why the writer of a `call.requested` refuses it already (the planner: a tool not
    offered to the model, an unusable `_transform`): the rejection whoever decides the
    call stores, word for word."""

    reason: str
    rule: str
    message: str


class CallRequested(Event, frozen=True, tag="call.requested"):
    call_id: str
    turn_id: str
    tool: str
    arguments: Any
    reasoning: str | None = None  # `_reasoningForCall`
    output_path: str | None = None  # `_outputPath`: where the result goes in `state.data`
    delegate: str | None = None  # `_delegate`: the executor pool asked for
    instance: str | None = None  # `_instance`: the executor instance asked for
    agent: str | None = None
    transform: str | None = None  # `_transform`: a JMESPath expression over the result
    # Refused by its writer, which stores the `call.rejected` right behind it: the approval
    # actor, deciding first (another process, a cluster), stores the same refusal, never
    # an approval.
    refused: Refusal | None = None


class CallRejected(Event, frozen=True, tag="call.rejected"):
    call_id: str
    turn_id: str
    tool: str
    reason: str
    message: str
    rule: str | None = None  # the policy rule that decided it


class CallApproved(Event, frozen=True, tag="call.approved"):
    """The policy lets the call run. Carries what the dispatch needs: the checked
    arguments (defaults filled in), the route, and whether it has side effects."""

    call_id: str
    turn_id: str
    tool: str
    rule: str
    arguments: dict[str, Any]
    route: str
    timeout_ms: int | None = None
    side_effect: bool = False
    risk: int = 0


class ApprovalRequested(Event, frozen=True, tag="approval.requested"):
    """A human must decide (`toolbus approve|deny`, or a message on
    `toolbus.approval.<sid>.<call_id>`) before `expires_at`."""

    call_id: str
    turn_id: str
    tool: str
    rule: str
    reason: str
    arguments: dict[str, Any]
    route: str
    expires_at: float
    timeout_ms: int | None = None
    side_effect: bool = False
    risk: int = 0


class ApprovalGranted(Event, frozen=True, tag="approval.granted"):
    call_id: str
    turn_id: str
    by: str
    note: str | None = None
    rule: str = "human"
    # Who decided as NATS authenticated them (the subject's last token); `by` is the name
    # they gave. None for a timeout.
    principal: str | None = None


class ApprovalDenied(Event, frozen=True, tag="approval.denied"):
    call_id: str
    turn_id: str
    by: str
    reason: str
    rule: str = "human"  # or "timeout"
    principal: str | None = None


class CallDispatched(Event, frozen=True, tag="call.dispatched"):
    call_id: str
    turn_id: str
    tool: str
    arguments: dict[str, Any]
    route: str
    timeout_ms: int | None = None


class CallStarted(Event, frozen=True, tag="call.started"):
    call_id: str
    turn_id: str
    executor: str
    attempt: int = 1


class CallSucceeded(Event, frozen=True, tag="call.succeeded"):
    """`result` is the tool's result, or None when it was too large for an event: then
    `result_ref` says where it is."""

    call_id: str
    turn_id: str
    result: Any
    executor: str
    duration_ms: float = 0.0
    result_ref: ResultRef | None = None


class CallFailed(Event, frozen=True, tag="call.failed"):
    call_id: str
    turn_id: str
    error_type: str
    message: str
    retryable: bool = False
    executor: str | None = None
    duration_ms: float = 0.0


class TurnCompleted(Event, frozen=True, tag="turn.completed"):
    turn_id: str
    request_id: str
    ok: bool
    outcomes: list[CallOutcome]
    text: str | None = None  # a planner turn's answer
    output: Any = None  # a planner turn's structured result (`output.emitted`)


class TurnFailed(Event, frozen=True, tag="turn.failed"):
    turn_id: str
    request_id: str
    reason: str
    message: str
    outcomes: list[CallOutcome] = []


class TurnCancelled(Event, frozen=True, tag="turn.cancelled"):
    """A turn ended before its time: `superseded` by a tool event injected with
    `trigger_processing` (`by`, its event id). Its calls not yet dispatched were cancelled;
    those already running finish and are recorded, but nothing acts on them."""

    turn_id: str
    request_id: str
    reason: str
    message: str
    by: str | None = None
    outcomes: list[CallOutcome] = []


class ResultCompressed(Event, frozen=True, tag="result.compressed"):
    """What the model reads of a call's result when the whole would not do (the
    compressor, actors/compressor.py): over the budget, a structured preview of it under
    a stable `key` (`_tool_result_N`, for `built-in:recall`); asked for with `_transform`,
    the JMESPath expression's value (or, if it failed, the preview and `transform_error`).
    The result itself stays where the call's end put it (event or object store)."""

    call_id: str
    turn_id: str
    tool: str
    chars: int  # the whole result's length, as the text the model would have read
    budget: int
    view: str  # what the model reads instead
    key: str | None = None
    transform: str | None = None
    transform_error: str | None = None


class ToolEventInjected(Event, frozen=True, tag="tool_event.injected"):
    """Data an integration handed the agent as if a tool had fetched it (seed 000):
    `tool_id` is a `namespace:name` label, not necessarily a real tool. Seen by the model
    from the next turn on (or at once, in the turn it starts, with `trigger_processing`).
    Every string in it had its control characters removed (tab and newline kept). A
    result too large for an event is in the object store (`result_ref`)."""

    event_id: str
    tool_id: str
    arguments: Any
    result: Any
    idempotency_key: str
    trigger_processing: bool = False
    turn_id: str | None = None  # the turn it started (`trigger_processing`)
    result_ref: ResultRef | None = None


class RequestRejected(Event, frozen=True, tag="request.rejected"):
    reason: str
    message: str
    request_id: str | None = None
    subject: str | None = None
    excerpt: str | None = None


AnyEvent = (
    TurnRequested
    | ModelRequested
    | ModelResponded
    | PoliciesMatched
    | TurnReevaluated
    | OutputEmitted
    | OutputRejected
    | CallRequested
    | CallRejected
    | CallApproved
    | ApprovalRequested
    | ApprovalGranted
    | ApprovalDenied
    | CallDispatched
    | CallStarted
    | CallSucceeded
    | CallFailed
    | TurnCompleted
    | TurnFailed
    | TurnCancelled
    | ResultCompressed
    | ToolEventInjected
    | RequestRejected
)

EVENT_TYPES: Final[tuple[type[Event], ...]] = (
    TurnRequested,
    CallRequested,
    CallRejected,
    CallApproved,
    ApprovalRequested,
    ApprovalGranted,
    ApprovalDenied,
    CallDispatched,
    CallStarted,
    CallSucceeded,
    CallFailed,
    TurnCompleted,
    TurnFailed,
    TurnCancelled,
    ResultCompressed,
    ToolEventInjected,
    RequestRejected,
)

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(AnyEvent)


def event_type(event: Event) -> str:
    tag = type(event).__struct_config__.tag
    assert isinstance(tag, str)
    return tag


def encode_event(event: Event) -> bytes:
    return _encoder.encode(event)


def decode_event(data: bytes) -> AnyEvent:
    """Decode one event; raises `msgspec.DecodeError` (or `ValidationError`) if it is not one."""
    event: AnyEvent = _decoder.decode(data)
    return event


def _as(principal: str | None) -> str:
    """Who NATS says decided, when it differs from the name given."""
    return f" (as {principal})" if principal else ""


def summarize(event: Event) -> str:
    """One human line about an event, for timelines."""
    match event:
        case ModelRequested() if event.purpose == "match":
            return (f"turn {event.turn_id}: {event.provider}/{event.model}, iteration "
                    f"{event.iteration}: which policies apply (round {event.round})")
        case ModelRequested() if event.purpose == "think":
            return (f"turn {event.turn_id}: {event.provider}/{event.model}, iteration "
                    f"{event.iteration}: built-in:reason {event.step}")
        case ModelRequested():
            return (f"turn {event.turn_id}: {event.provider}/{event.model}, iteration "
                    f"{event.iteration}, {event.tools} tool(s) offered")
        case ModelResponded() if event.purpose != "chat":
            what = f"built-in:reason {event.step}" if event.purpose == "think" else \
                f"policies round {event.round}"
            out = _encoder.encode(event.output).decode()
            bad = f"; {len(event.violations)} violation(s): {_clip('; '.join(event.violations))}" \
                if event.violations else ""
            return (f"turn {event.turn_id} iteration {event.iteration} ({what}): {_clip(out)}"
                    f"{bad} [{event.input_tokens}+{event.output_tokens} tokens, "
                    f"{event.latency_ms:.0f} ms]")
        case PoliciesMatched():
            which = ", ".join(event.matched) or "none"
            notes = f" ({_clip('; '.join(event.notes))})" if event.notes else ""
            return (f"turn {event.turn_id}: policies that apply (round {event.round}): "
                    f"{which}{notes}")
        case TurnReevaluated():
            calls = ", ".join(f"{t} ({c})" for t, c in zip(event.tools, event.trigger_call_ids,
                                                             strict=False))
            if event.capped:
                return (f"turn {event.turn_id}: after {calls}: not reevaluated, the limit of "
                        f"{event.limit} per turn is used")
            return f"turn {event.turn_id}: reevaluated (round {event.round}) after {calls}"
        case OutputEmitted():
            return (f"turn {event.turn_id}: output {event.call_id} "
                    f"{_clip(_encoder.encode(event.output).decode())}")
        case OutputRejected():
            return f"turn {event.turn_id}: output {event.call_id} refused: {_clip(event.message)}"
        case ModelResponded():
            calls = ", ".join(f"{c.name} ({c.call_id})" for c in event.tool_calls)
            said = f" {_clip(event.text)!r}" if event.text else ""
            # A composed answer that broke its schema: why, as the model was told.
            bad = f"; refused, {len(event.violations)} violation(s): " \
                f"{_clip('; '.join(event.violations))}" if event.violations else ""
            return (f"turn {event.turn_id} iteration {event.iteration}:{said}"
                    + (f" calls {calls}" if calls else "") + bad
                    + f" [{event.input_tokens}+{event.output_tokens} tokens, "
                    f"{event.latency_ms:.0f} ms]")
        case TurnRequested():
            n = len(event.call_ids)
            by = f", agent {event.agent}" if event.agent else ""
            if event.message is not None:
                return (f"turn {event.turn_id} (request {event.request_id}{by}): message "
                        f"{_clip(event.message)!r}")
            return f"turn {event.turn_id} (request {event.request_id}{by}): {n} call(s)"
        case CallRequested():
            why = f"  reason: {event.reasoning}" if event.reasoning else ""
            meta = "".join(f"  {label}{value}" for label, value in (
                ("-> state.", event.output_path), ("pool: ", event.delegate),
                ("instance: ", event.instance), ("transform: ", event.transform)) if value)
            args = _encoder.encode(event.arguments).decode()
            return f"{event.call_id} {event.tool} {_clip(args)}{why}{meta}"
        case CallRejected():
            rule = f" [rule {event.rule}]" if event.rule else ""
            return (f"{event.call_id} {event.tool} rejected ({event.reason}): "
                    f"{_clip(event.message)}{rule}")
        case CallApproved():
            fx = ", side effects: runs alone" if event.side_effect else ""
            return (f"{event.call_id} {event.tool} approved [rule {event.rule}] "
                    f"risk {event.risk}{fx}")
        case ApprovalRequested():
            return (f"{event.call_id} {event.tool} needs a human [rule {event.rule}] risk "
                    f"{event.risk}: {_clip(event.reason)}")
        case ApprovalGranted():
            note = f": {_clip(event.note)}" if event.note else ""
            return f"{event.call_id} approved by {event.by}{_as(event.principal)}{note}"
        case ApprovalDenied():
            return (f"{event.call_id} denied by {event.by}{_as(event.principal)} "
                    f"[{event.rule}]: {_clip(event.reason)}")
        case CallDispatched():
            return f"{event.call_id} {event.tool} -> {event.route}"
        case CallStarted():
            return f"{event.call_id} on {event.executor} (attempt {event.attempt})"
        case CallSucceeded():
            if event.result_ref is not None:
                ref = event.result_ref
                res = f"{ref.size} bytes stored as {ref.key}: {ref.preview}"
            else:
                res = _encoder.encode(event.result).decode()
            return f"{event.call_id} {_clip(res)} in {event.duration_ms:.2f} ms"
        case CallFailed():
            return f"{event.call_id} {event.error_type}: {_clip(event.message)}"
        case TurnCompleted():
            ok = sum(1 for o in event.outcomes if o.status == "succeeded")
            answer = f"; answer {_clip(event.text)!r}" if event.text is not None else ""
            return (f"turn {event.turn_id}: {ok}/{len(event.outcomes)} call(s) "
                    f"succeeded{answer}")
        case TurnFailed():
            return f"turn {event.turn_id} failed ({event.reason}): {_clip(event.message)}"
        case TurnCancelled():
            by = f" by {event.by}" if event.by else ""
            return (f"turn {event.turn_id} cancelled ({event.reason}{by}): "
                    f"{_clip(event.message)}")
        case ResultCompressed():
            what = f"stored as {event.key}, " if event.key else ""
            how = f"_transform {_clip(event.transform, 60)!r}" if event.transform else "preview"
            bad = f" (failed: {_clip(event.transform_error, 80)}; preview shown)" \
                if event.transform_error else ""
            return (f"{event.call_id} {event.tool}: {event.chars} chars, {what}the model "
                    f"reads {len(event.view)} ({how}{bad})")
        case ToolEventInjected():
            res = (f"{event.result_ref.size} bytes stored as {event.result_ref.key}"
                   if event.result_ref is not None else _encoder.encode(event.result).decode())
            starts = f"; starts turn {event.turn_id}" if event.turn_id else ""
            return (f"tool event {event.event_id} {event.tool_id} injected (key "
                    f"{_clip(event.idempotency_key, 40)!r}): {_clip(res)}{starts}")
        case RequestRejected():
            rid = event.request_id or "?"
            return f"request {rid} rejected ({event.reason}): {_clip(event.message)}"
    return ""


def _clip(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def clip(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """Free text bound for an event, cut to `limit` characters (saying how much was cut):
    messages quote what was wrong, and what was wrong can be large."""
    if len(text) <= limit:
        return text
    return f"{text[: limit - 40]}… ({len(text) - limit + 40} more characters)"
