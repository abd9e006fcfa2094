"""Session state and the reducer that folds events into it.

`evolve(state, event, seq)` is the only way state changes, live and in replay, so a replay
rebuilds the live state byte for byte (`encode_state`). The state is a mutable projection
on purpose: copying every dict on every event would make a long session quadratic. The
reducer itself stays pure in the sense that matters: no I/O, no clock, no ids of its own;
the same events in the same order always give the same bytes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import msgspec

from schemas.defaults import OUTCOME_MESSAGE_CHARS
from schemas.events import (
    ApprovalDenied,
    ApprovalGranted,
    ApprovalRequested,
    CallApproved,
    CallDispatched,
    CallFailed,
    CallOutcome,
    CallRejected,
    CallRequested,
    CallStarted,
    CallSucceeded,
    ChatMessage,
    ErrorInfo,
    Event,
    ModelRequested,
    ModelResponded,
    ModelToolCall,
    OutputEmitted,
    OutputRejected,
    PoliciesMatched,
    RequestRejected,
    ResultCompressed,
    ResultRef,
    ThinkRequest,
    ToolEventInjected,
    TurnCancelled,
    TurnCompleted,
    TurnFailed,
    TurnReevaluated,
    TurnRequested,
    clip,
)

CallStatus = Literal["requested", "awaiting_approval", "approved", "denied", "rejected",
                     "dispatched", "running", "succeeded", "failed"]
TurnStatus = Literal["running", "completed", "failed", "cancelled"]
TERMINAL_CALL_STATUSES: frozenset[str] = frozenset({"rejected", "succeeded", "failed"})


# `gc=False` on the state structs: they hold plain data (JSON values, strings, numbers,
# other state structs) and never a reference back up, so they cannot form cycles; a
# session actor keeping 10,000 sessions in memory then adds nothing to the collector's
# full passes, which otherwise showed up as multi-millisecond pauses in the p99.
class CallState(msgspec.Struct, kw_only=True, gc=False):
    call_id: str
    turn_id: str
    tool: str
    arguments: Any
    status: CallStatus = "requested"
    reasoning: str | None = None
    output_path: str | None = None
    delegate: str | None = None
    instance: str | None = None
    agent: str | None = None
    # The policy's decision (call.approved / approval.requested / call.rejected), and a
    # human's (approval.granted / approval.denied).
    rule: str | None = None
    risk: int = 0
    side_effect: bool = False
    approved_arguments: dict[str, Any] | None = None
    route: str | None = None
    timeout_ms: int | None = None
    approval_reason: str | None = None
    approval_requested_at: float | None = None
    approval_expires_at: float | None = None
    decided_by: str | None = None  # set by a human decision (or its timeout) only
    decision_note: str | None = None
    human_decision: Literal["approved", "denied"] | None = None
    attempts: int = 0
    started_at: float | None = None  # when its latest attempt started
    executor: str | None = None
    result: Any = None
    result_ref: ResultRef | None = None
    result_seq: int | None = None  # the stream sequence of the terminal event
    error: ErrorInfo | None = None
    requested_at: float = 0.0
    finished_at: float | None = None
    # What the model reads of the result when not the whole (`result.compressed`): the
    # preview or the `_transform`'s value, and the key `recall` finds the whole under.
    transform: str | None = None
    view: str | None = None
    result_key: str | None = None

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL_CALL_STATUSES

    def outcome(self) -> CallOutcome:
        status: Literal["succeeded", "failed", "rejected"]
        if self.status == "succeeded":
            status = "succeeded"
        elif self.status == "rejected":
            status = "rejected"
        else:
            status = "failed"
        return CallOutcome(
            call_id=self.call_id,
            tool=self.tool,
            status=status,
            error=None if self.error is None else ErrorInfo(
                error_type=self.error.error_type, retryable=self.error.retryable,
                message=clip(self.error.message, OUTCOME_MESSAGE_CHARS)),
            result_seq=self.result_seq,
            result_ref=self.result_ref,
        )


class ModelStep(msgspec.Struct, kw_only=True, gc=False):
    """One model round trip of a planner turn, as `model.responded` stored it: a `chat`
    step of the agent loop, a `match` of the `when:` policies, or a `think` step."""

    iteration: int
    text: str
    tool_calls: list[ModelToolCall] = msgspec.field(default_factory=list)
    input_tokens: int = 0
    output_tokens: int = 0
    purpose: str = "chat"
    step: str | None = None
    round: int = 0
    output: Any = None
    violations: list[str] = msgspec.field(default_factory=list)


class Reevaluation(msgspec.Struct, kw_only=True, gc=False):
    """A `turn.reevaluated`: after which model iteration, set off by which calls, and
    whether the turn's limit had been reached (then nothing was decided again)."""

    round: int
    after_iteration: int
    trigger_call_ids: list[str]
    capped: bool = False


class OutputVerdict(msgspec.Struct, kw_only=True, gc=False):
    """What became of one `built-in:emit_output` call: emitted, or refused with why."""

    call_id: str
    ok: bool
    message: str = ""


class TurnState(msgspec.Struct, kw_only=True, gc=False):
    turn_id: str
    request_id: str
    call_ids: list[str]
    agent: str | None = None
    status: TurnStatus = "running"
    requested_at: float = 0.0
    finished_at: float | None = None
    ended_seq: int | None = None  # the stream sequence of turn.completed / turn.failed
    # A planner turn: the user's message, the model iterations asked for, and answered.
    message: str | None = None
    history: list[ChatMessage] = msgspec.field(default_factory=list)
    model_requested: int = 0
    steps: list[ModelStep] = msgspec.field(default_factory=list)
    text: str | None = None  # the answer the turn ended with
    # Behaviour policies (seed 000): the round the latest `policies.matched` judged (-1:
    # none yet), what applies, and the reevaluations (`round` counts those not capped).
    matched_round: int = -1
    policies: list[str] = msgspec.field(default_factory=list)
    reevaluations: list[Reevaluation] = msgspec.field(default_factory=list)
    round: int = 0
    # `built-in:emit_output`: each call's verdict, and the output emitted (the result).
    verdicts: list[OutputVerdict] = msgspec.field(default_factory=list)
    output: Any = None
    output_call_id: str | None = None
    seq: int = 0  # of its `turn.requested`: the tool events injected before it are seen
    trigger: str | None = None  # the injected tool event that started it
    think: list[ThinkRequest] = msgspec.field(default_factory=list)  # the request's


class InjectedToolEvent(msgspec.Struct, kw_only=True, gc=False):
    """A `tool_event.injected`, at stream sequence `seq`."""

    seq: int
    event_id: str
    tool_id: str
    arguments: Any
    result: Any
    result_ref: ResultRef | None = None
    turn_id: str | None = None


class SessionState(msgspec.Struct, kw_only=True, gc=False):
    session_id: str
    last_seq: int = 0
    event_count: int = 0
    turns: dict[str, TurnState] = msgspec.field(default_factory=dict)
    calls: dict[str, CallState] = msgspec.field(default_factory=dict)
    open_turns: list[str] = msgspec.field(default_factory=list)
    # Where the newest `turn.cancelled` that ended a turn is stored (0: none yet).
    last_cancelled_seq: int = 0
    # Calls of cancelled turns not ended yet, the session actor ends them once the
    # approval actor has decided (a call not decided is never failed, so that it cannot
    # end twice: its rejection is the approval actor's to store).
    orphans: list[str] = msgspec.field(default_factory=list)
    rejected_requests: int = 0
    # The session's state object: results of calls made with `_outputPath` land here.
    data: dict[str, Any] = msgspec.field(default_factory=dict)
    # Think steps' outputs (`built-in:reason`), by step id; a later run replaces one.
    step_outputs: dict[str, Any] = msgspec.field(default_factory=dict)
    # Tool events injected (seed 000), in order, and their ids by idempotency key.
    tool_events: list[InjectedToolEvent] = msgspec.field(default_factory=list)
    tool_event_keys: dict[str, str] = msgspec.field(default_factory=dict)
    # Results stored under a key by the compressor (`_tool_result_N` -> call id).
    result_keys: dict[str, str] = msgspec.field(default_factory=dict)


# Bumped whenever the shape of `SessionState` changes, or what folding makes of an event,
# so that older snapshots are ignored (and the session folded from the log) instead of
# misread. 9: `set_path` no longer writes into an earlier result (`p`, then `p.q`).
# 10: `last_rejected_seq` (a995e56, dropped since). 11: `orphans` (a version 10 snapshot
# lacks them: read as current, a cancelled turn's undecided call was never ended).
STATE_VERSION = 11


def evolve(state: SessionState, event: Event, seq: int) -> SessionState:
    """Fold one stored event (at stream sequence `seq`) into `state` and return it.

    Events at or below `state.last_seq` are already folded and change nothing, so
    redelivered or re-read events are harmless.
    """
    if seq <= state.last_seq:
        return state
    state.last_seq = seq
    state.event_count += 1
    calls = state.calls
    match event:
        case TurnRequested():
            if event.turn_id not in state.turns:
                state.turns[event.turn_id] = TurnState(
                    turn_id=event.turn_id,
                    request_id=event.request_id,
                    call_ids=list(event.call_ids),
                    agent=event.agent,
                    requested_at=event.at,
                    message=event.message,
                    history=list(event.history),
                    seq=seq,
                    trigger=event.trigger,
                    think=list(event.think),
                )
                state.open_turns.append(event.turn_id)
        case CallRequested():
            if event.call_id not in calls:
                calls[event.call_id] = CallState(
                    call_id=event.call_id,
                    turn_id=event.turn_id,
                    tool=event.tool,
                    arguments=event.arguments,
                    reasoning=event.reasoning,
                    output_path=event.output_path,
                    delegate=event.delegate,
                    instance=event.instance,
                    agent=event.agent,
                    requested_at=event.at,
                    transform=event.transform,
                )
                turn = state.turns.get(event.turn_id)
                # A planner's calls join the turn as the model asks for them.
                if turn is not None and event.call_id not in turn.call_ids:
                    turn.call_ids.append(event.call_id)
                if turn is not None and turn.status == "cancelled":
                    state.orphans.append(event.call_id)  # stored past its turn's end
        case CallRejected():
            call = calls.get(event.call_id)
            if call is not None and not call.terminal:
                _ended(state, event.call_id)
                call.status = "rejected"
                call.result_seq = seq
                call.rule = event.rule
                call.error = ErrorInfo(error_type=event.reason, message=event.message)
                call.finished_at = event.at
        case CallApproved() | ApprovalRequested():
            call = calls.get(event.call_id)
            if call is not None and call.status == "requested":
                call.status = "approved" if isinstance(event, CallApproved) else \
                    "awaiting_approval"
                call.rule = event.rule
                call.risk = event.risk
                call.side_effect = event.side_effect
                call.approved_arguments = event.arguments
                call.route = event.route
                call.timeout_ms = event.timeout_ms
                if isinstance(event, ApprovalRequested):
                    call.approval_reason = event.reason
                    call.approval_requested_at = event.at
                    call.approval_expires_at = event.expires_at
        case ApprovalGranted() | ApprovalDenied():
            call = calls.get(event.call_id)
            if call is not None and call.status == "awaiting_approval":
                decided: Literal["approved", "denied"] = (
                    "approved" if isinstance(event, ApprovalGranted) else "denied")
                call.status = decided
                call.human_decision = decided
                call.decided_by = event.by
                call.decision_note = event.note if isinstance(event, ApprovalGranted) else \
                    event.reason
        case CallDispatched():
            call = calls.get(event.call_id)
            if call is not None and call.status in ("requested", "approved"):
                call.status = "dispatched"
        case CallStarted():
            call = calls.get(event.call_id)
            if call is not None and not call.terminal:
                call.status = "running"
                if event.attempt >= call.attempts:
                    call.started_at = event.at
                call.attempts = max(call.attempts, event.attempt)
                call.executor = event.executor
        case CallSucceeded():
            call = calls.get(event.call_id)
            if call is not None and not call.terminal:
                _ended(state, event.call_id)
                call.status = "succeeded"
                call.result = event.result
                call.result_ref = event.result_ref
                call.result_seq = seq
                call.executor = event.executor
                call.finished_at = event.at
                if call.output_path:
                    set_path(state.data, call.output_path, event.result
                             if event.result_ref is None else {"$ref": event.result_ref.key})
        case CallFailed():
            call = calls.get(event.call_id)
            if call is not None and not call.terminal:
                _ended(state, event.call_id)
                call.status = "failed"
                call.result_seq = seq
                call.error = ErrorInfo(
                    error_type=event.error_type, message=event.message, retryable=event.retryable
                )
                if event.executor is not None:
                    call.executor = event.executor
                call.finished_at = event.at
        case ModelRequested():
            turn = state.turns.get(event.turn_id)
            if turn is not None:
                turn.model_requested = max(turn.model_requested, event.iteration)
        case ModelResponded():
            turn = state.turns.get(event.turn_id)
            if turn is not None and event.iteration == len(turn.steps) + 1:
                turn.steps.append(ModelStep(
                    iteration=event.iteration, text=event.text,
                    tool_calls=list(event.tool_calls), input_tokens=event.input_tokens,
                    output_tokens=event.output_tokens, purpose=event.purpose,
                    step=event.step, round=event.round, output=event.output,
                    violations=list(event.violations)))
                if event.purpose == "think" and event.step is not None and \
                        not event.violations:
                    state.step_outputs[event.step] = event.output
        case PoliciesMatched():
            turn = state.turns.get(event.turn_id)
            if turn is not None and event.round > turn.matched_round:
                turn.matched_round = event.round
                turn.policies = list(event.matched)
        case TurnReevaluated():
            turn = state.turns.get(event.turn_id)
            if turn is not None and all(r.after_iteration != event.after_iteration
                                        for r in turn.reevaluations):
                turn.reevaluations.append(Reevaluation(
                    round=event.round, after_iteration=event.after_iteration,
                    trigger_call_ids=list(event.trigger_call_ids), capped=event.capped))
                if not event.capped:
                    turn.round = max(turn.round, event.round)
        case OutputEmitted() | OutputRejected():
            turn = state.turns.get(event.turn_id)
            if turn is not None and all(v.call_id != event.call_id for v in turn.verdicts):
                ok = isinstance(event, OutputEmitted)
                turn.verdicts.append(OutputVerdict(
                    call_id=event.call_id, ok=ok,
                    message="" if isinstance(event, OutputEmitted) else event.message))
                if isinstance(event, OutputEmitted) and turn.output_call_id is None:
                    turn.output = event.output
                    turn.output_call_id = event.call_id
        case TurnCompleted() | TurnFailed():
            turn = state.turns.get(event.turn_id)
            if turn is not None and turn.status == "running":
                turn.status = "completed" if isinstance(event, TurnCompleted) else "failed"
                if isinstance(event, TurnCompleted):
                    turn.text = event.text
                    if event.output is not None:
                        turn.output = event.output
                turn.finished_at = event.at
                turn.ended_seq = seq
                if event.turn_id in state.open_turns:
                    state.open_turns.remove(event.turn_id)
        case TurnCancelled():
            turn = state.turns.get(event.turn_id)
            if turn is not None and turn.status == "running":
                turn.status = "cancelled"
                turn.finished_at = event.at
                turn.ended_seq = seq
                state.last_cancelled_seq = seq
                if event.turn_id in state.open_turns:
                    state.open_turns.remove(event.turn_id)
                state.orphans += [c for c in turn.call_ids
                                  if c in calls and not calls[c].terminal]
        case ResultCompressed():
            call = calls.get(event.call_id)
            if call is not None and call.view is None:
                call.view = event.view
                if event.key is not None and event.key not in state.result_keys:
                    call.result_key = event.key
                    state.result_keys[event.key] = event.call_id
        case ToolEventInjected():
            if event.idempotency_key not in state.tool_event_keys:
                state.tool_event_keys[event.idempotency_key] = event.event_id
                state.tool_events.append(InjectedToolEvent(
                    seq=seq, event_id=event.event_id, tool_id=event.tool_id,
                    arguments=event.arguments, result=event.result,
                    result_ref=event.result_ref, turn_id=event.turn_id))
        case RequestRejected():
            state.rejected_requests += 1
    return state


def _ended(state: SessionState, call_id: str) -> None:
    if state.orphans and call_id in state.orphans:
        state.orphans.remove(call_id)


def set_path(data: dict[str, Any], path: str, value: Any) -> None:
    """Write `value` at a dotted path, making objects on the way; a non-object in the way
    is replaced (the newest result wins, as it would in any later read of that path).

    Each object on the way is copied before it is written to: it may be an earlier call's
    result (`p`, then `p.q`), which its call and its stored event still hold as it came."""
    *parents, leaf = path.split(".")
    node = data
    for key in parents:
        child = node.get(key)
        child = node[key] = dict(child) if isinstance(child, dict) else {}
        node = child
    node[leaf] = value


def fold(session_id: str, events: Iterable[tuple[int, Event | None]]) -> SessionState:
    """Fold stored events in order. An event this version cannot read (None) changes
    nothing but the position, exactly as the actors fold it live."""
    state = SessionState(session_id=session_id)
    for seq, event in events:
        if event is not None:
            evolve(state, event, seq)
        elif seq > state.last_seq:
            state.last_seq = seq
    return state


def turn_outcomes(state: SessionState, turn: TurnState) -> list[CallOutcome]:
    return [state.calls[c].outcome() for c in turn.call_ids if c in state.calls]


def turn_is_done(state: SessionState, turn: TurnState) -> bool:
    """Every call of the turn has been requested and has reached a terminal status."""
    for call_id in turn.call_ids:
        call = state.calls.get(call_id)
        if call is None or not call.terminal:
            return False
    return True


_state_encoder = msgspec.json.Encoder(order="deterministic")
_state_decoder = msgspec.json.Decoder(SessionState)


def encode_state(state: SessionState) -> bytes:
    return _state_encoder.encode(state)


def decode_state(data: bytes) -> SessionState:
    return _state_decoder.decode(data)
