"""Session actor.

Consumes: requests on `toolbus.req.<sid>` (work queue), tool events injected on
`toolbus.req.<sid>.tool_events`, and every event of every session (`toolbus.events.>`),
one session at a time, in stream order.
Emits: `turn.requested`, `call.requested`; `call.dispatched` for calls the approval actor
approved (or a human granted), under the parallel policy: at most `max_parallel` calls of
a turn at once, and calls with side effects alone and in order; `call.failed` for denied
calls; `turn.completed` / `turn.failed`; `request.rejected`; `tool_event.injected` (with
`trigger_processing`, also `turn.cancelled` for the planner turn in flight, `call.failed`
`cancelled` for its calls not dispatched yet, and the turn it starts).
Idempotency: every event has a deterministic message id from `schemas/ids.py`, derived
from the session, the turn or call id and the fact (a denied call's failure shares the
call's terminal id with the executor's outcomes).
A request without a `request_id` gets `auto-<stream seq>`, so its redelivery maps onto
the same ids.
Retry rule: decisions are appended with the per-session concurrency check on their first
event, the rest pipelined behind it in one round trip; a stale writer re-reads the session
and decides again (bounded). Events a failed decision may still have stored carry the
same ids as the re-decision's, so they are deduplicated, and the reducer folds any order.
Requests and events are acked only after what they caused is stored. A request that
cannot be decoded or validated is a stored `request.rejected` at its first delivery (the
kernel, actors/kernel.py); an event whose decision raises ends the session's open turns
`turn.failed` (`internal`).

State is level-triggered: after each event is folded, `decide` answers "what is due now?"
from the state alone, so a crash between two appends is healed by the next delivery.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import msgspec

from actors import compress
from actors.kernel import Entry, Inbox, Kernel, PoisonError, SessionStates, excerpt
from bus.artifacts import ArtifactStore
from bus.connection import Bus
from bus.consumer import Delivery, PullLoop
from bus.eventlog import Append, decode_stored
from bus.headers import Header
from bus.partitions import PartitionOwner, member_name
from bus.rpc import Responder
from bus.streams import ConsumerSpec, delete_consumers
from bus.subjects import (
    EVENTS_STREAM,
    REQUESTS_PREFIX,
    REQUESTS_STREAM,
    STATE_PREFIX,
    partition,
    partition_filter,
    request_subject,
    requests_filter,
    session_of,
)
from bus.tasks import stop_tasks
from schemas.defaults import (
    DECIDE_ATTEMPTS,
    PARTITION_ACK_WAIT_S,
    SESSION_CACHE_SIZE,
    SNAPSHOT_EVERY,
)
from schemas.errors import ConcurrencyError, InvalidIdError, InvalidRequestError, RpcError
from schemas.events import (
    CallApproved,
    CallDispatched,
    CallFailed,
    CallRejected,
    CallRequested,
    Event,
    RequestRejected,
    ResultRef,
    ToolEventInjected,
    TurnCancelled,
    TurnCompleted,
    TurnFailed,
    TurnRequested,
    clip,
)
from schemas.ids import (
    AUTO_REQUEST_PREFIX,
    SYSTEM_SESSION,
    TOOL_EVENT_PREFIX,
    call_id_for,
    call_requested_id,
    call_terminal_id,
    check_session_id,
    dispatch_id,
    is_token,
    policy_decision_id,
    request_rejected_id,
    tool_event_id,
    tool_event_msg_id,
    turn_ended_id,
    turn_id_for,
    turn_requested_id,
)
from schemas.policy import DEFAULT_AGENT
from schemas.requests import (
    DEFAULT_MAX_CALLS,
    DEFAULT_MAX_REQUEST_BYTES,
    MAX_IDEMPOTENCY_KEY_CHARS,
    Request,
    ToolEventInput,
    decode_json,
    is_tool_event,
    parse_request,
    parse_tool_event,
    strip_controls,
)
from schemas.state import (
    CallState,
    SessionState,
    TurnState,
    encode_state,
    evolve,
    turn_is_done,
    turn_outcomes,
)

log = logging.getLogger("toolbus.session")

# How long the session actor waits for the rest of a decision whose first events came
# (`Toolbus-More`) before deciding without it.
_MORE_WAIT_S = 1.0

# An injected result larger than this goes to the object store, its event holding a
# reference (`result_ref`), as a large tool result does.
INLINE_TOOL_EVENT_BYTES = 64 * 1024
MAX_TOOL_EVENTS = 1000  # injected into one session

ACTOR = "session"

# --- pure decisions -------------------------------------------------------------------


InlineApprover = Callable[[CallRequested], "CallApproved | CallRejected | None"]


class EarlyTurn(Protocol):
    """The planner of this process, told of a planner turn as it is stored (see
    `Planner.early_turn`): returns what to call with its stream sequence once stored, or
    None if it was not; or None when it leaves the turn to its delivery."""

    def __call__(self, state: SessionState, event: TurnRequested
                 ) -> Callable[[int | None], None] | None: ...


def _not_planned(seq: int | None) -> None:
    pass


class InlineApproval(Protocol):
    """The approval actor of this process, asked directly (see `accept_request`)."""

    def decide_inline(self, call: CallRequested) -> CallApproved | CallRejected | None: ...
    def stored_inline(self, keys: list[tuple[str, str]]) -> None: ...
    def storing_inline(self, keys: list[tuple[str, str]]) -> Callable[[bool], None]: ...


def accept_request(state: SessionState, request: Request, request_id: str, *,
                   now: float, approver: InlineApprover | None = None,
                   max_parallel: int = 3, default_agent: str = DEFAULT_AGENT) -> list[Append]:
    """The events that accept a new request: the turn and its calls. The approval actor
    decides each call next; this actor dispatches the approved ones. A request that names
    no agent is `default_agent`'s, and its events say so: the grants applied are the
    ones a replay shows.

    With an `approver` (the approval actor's own decision, when it runs in this process),
    calls it can settle without a human are decided here, and the ones that may start
    are dispatched, all in the same round trip: the events and their ids are exactly what
    the approval actor and `decide` would have written one hop later each."""
    sid = state.session_id
    turn_id = turn_id_for(request_id)
    call_ids = [call_id_for(turn_id, i) for i in range(len(request.calls))]
    agent = request.agent or default_agent
    out = [Append(TurnRequested(session_id=sid, at=now, actor=ACTOR, turn_id=turn_id,
                                request_id=request_id, call_ids=call_ids, agent=agent,
                                message=request.message, history=request.history,
                                think=request.think),
                  turn_requested_id(sid, turn_id))]
    for call_id, call in zip(call_ids, request.calls, strict=True):
        out.append(Append(CallRequested(session_id=sid, at=now, actor=ACTOR, call_id=call_id,
                                        turn_id=turn_id, tool=call.tool,
                                        arguments=call.arguments, reasoning=call.reasoning,
                                        output_path=call.output_path, delegate=call.delegate,
                                        instance=call.instance, agent=agent,
                                        transform=call.transform),
                          call_requested_id(sid, call_id)))
    if approver is None:
        return out
    decisions = []
    for item in out[1:]:
        assert isinstance(item.event, CallRequested)
        decision = approver(item.event)
        if decision is not None:
            decisions.append(Append(decision, policy_decision_id(sid, item.event.call_id)))
    out += decisions
    # Dispatch from a scratch state holding only this turn: the parallel rules are per turn.
    scratch = SessionState(session_id=sid)
    for seq, item in enumerate(out, start=1):
        evolve(scratch, item.event, seq)
    return out + due_in_turn(scratch, scratch.turns[turn_id], max_parallel, now)


async def _release(deliveries: Sequence[Delivery], *, decided: bool) -> None:
    """Ack deliveries a decision was taken after, or have them delivered again."""
    for held in deliveries:
        with contextlib.suppress(Exception):  # a lost ack or nak is a redelivery
            if decided:
                await held.ack()
            else:
                await held.nak()


def _dispatch(state: SessionState, call: CallState, now: float) -> Append:
    assert call.route is not None
    event = CallDispatched(session_id=state.session_id, at=now, actor=ACTOR,
                           call_id=call.call_id, turn_id=call.turn_id, tool=call.tool,
                           arguments=call.approved_arguments or {}, route=call.route,
                           timeout_ms=call.timeout_ms)
    return Append(event, dispatch_id(state.session_id, call.call_id), call.route)


def due_in_turn(state: SessionState, turn: TurnState, max_parallel: int,
                 now: float) -> list[Append]:
    """Dispatches due in one turn, and failures of denied calls.

    Calls start in the order requested. At most `max_parallel` run at once. A call with
    side effects runs alone: it starts once every call before it has ended, and no call
    after it starts before it ends. A call the policy has not decided yet holds back the
    calls after it, since it may turn out to have side effects.
    """
    out: list[Append] = []
    calls = [state.calls[c] for c in turn.call_ids if c in state.calls]
    for call in calls:
        if call.status == "denied":
            reason = call.decision_note or "denied"
            out.append(Append(CallFailed(
                session_id=state.session_id, at=now, actor=ACTOR, call_id=call.call_id,
                turn_id=call.turn_id, error_type="approval_denied",
                message=f"{call.tool} was not approved: {reason} (by {call.decided_by})"),
                call_terminal_id(state.session_id, call.call_id)))
    in_flight = sum(1 for c in calls if c.status in ("dispatched", "running"))
    all_ended_before = True
    for call in calls:
        if call.terminal:
            continue
        if call.status == "requested":
            break  # not decided yet: it may be a barrier
        if call.side_effect:
            if call.status == "approved" and all_ended_before:
                out.append(_dispatch(state, call, now))
            break  # nothing after a side effect starts before it ends
        if call.status == "approved" and in_flight < max_parallel:
            out.append(_dispatch(state, call, now))
            in_flight += 1
        all_ended_before = False
    return out


def decide(state: SessionState, *, now: float, max_parallel: int = 3) -> list[Append]:
    """What is due now for this session: dispatch what may run, fail denied calls, end
    finished turns."""
    sid = state.session_id
    out: list[Append] = []
    for turn_id in state.open_turns:
        turn = state.turns[turn_id]
        if turn.message is not None:
            # A planner turn: its calls are dispatched here, but only the planner knows
            # when it is over (the model may ask for more).
            out.extend(due_in_turn(state, turn, max_parallel, now))
            continue
        if turn_is_done(state, turn):
            outcomes = turn_outcomes(state, turn)
            if outcomes and all(o.status == "rejected" for o in outcomes):
                reasons = "; ".join(f"{o.call_id}: {o.error.message}" for o in outcomes
                                    if o.error is not None)
                ev: Event = TurnFailed(session_id=sid, at=now, actor=ACTOR, turn_id=turn_id,
                                       request_id=turn.request_id, reason="all_calls_rejected",
                                       message=clip(reasons), outcomes=outcomes)
            else:
                ev = TurnCompleted(session_id=sid, at=now, actor=ACTOR, turn_id=turn_id,
                                   request_id=turn.request_id,
                                   ok=all(o.status == "succeeded" for o in outcomes),
                                   outcomes=outcomes)
            out.append(Append(ev, turn_ended_id(sid, turn_id)))
            continue
        out.extend(due_in_turn(state, turn, max_parallel, now))
    if state.orphans:
        out.extend(orphans_due(state, now=now))
    return out


def decide_request(state: SessionState, request: Request, request_id: str, *, now: float,
                   subject: str, request_seq: int, approver: InlineApprover | None = None,
                   max_parallel: int = 3, default_agent: str = DEFAULT_AGENT,
                   accept_messages: bool = False) -> list[Append]:
    """The events a request makes due in its session: a new turn, the calls a crash left
    out of a stored turn, or a `duplicate_request` rejection."""
    sid = state.session_id
    if request.cancel is not None:
        return decide_cancel(state, request.cancel, request_id, reason=request.reason,
                             now=now, subject=subject, request_seq=request_seq)
    turn_id = turn_id_for(request_id)
    known = state.turns.get(turn_id)
    if known is None and request.message is not None and not accept_messages:
        return [Append(RequestRejected(
            session_id=sid, at=now, actor=ACTOR, reason="no_planner",
            request_id=request_id, subject=subject,
            message="this toolbus runs no planner, so nothing can answer a message: give "
                    "the manifest an agent_config.model, or send explicit calls"),
            request_rejected_id(request_seq))]
    if known is None:
        return accept_request(state, request, request_id, now=now, approver=approver,
                              max_parallel=max_parallel, default_agent=default_agent)
    missing = [c for c in known.call_ids if c not in state.calls]
    if missing:
        # The turn was stored but some of its calls were not (a crash in the middle of
        # the batch): store the missing ones, with their ids, and go on.
        log.warning("session %s: turn %s was missing %d call(s); restored", sid, turn_id,
                    len(missing))
        return [i for i in accept_request(state, request, request_id, now=now,
                                          default_agent=default_agent)
                if isinstance(i.event, CallRequested) and i.event.call_id in missing]
    rejected = RequestRejected(
        session_id=sid, at=now, actor=ACTOR, reason="duplicate_request",
        request_id=request_id, subject=subject,
        message=f"request {request_id!r} was already accepted as turn {turn_id} "
                f"({known.status}); its calls do not run again")
    return [Append(rejected, request_rejected_id(request_seq))]


# Decided, not dispatched: a call still `requested` is the approval actor's to decide.
CANCELLABLE = frozenset({"awaiting_approval", "approved"})


def cancel_turn(state: SessionState, turn: TurnState, *, now: float, reason: str, by: str,
                why: str) -> list[Append]:
    """A running turn ended early: `turn.cancelled`, then its calls not yet dispatched
    `call.failed` `cancelled` ("<tool> did not run: its turn was <why>"). Calls already
    running finish and are recorded, but nothing acts on them. A call the approval actor
    has not decided yet is failed once it has (`orphans_due`): failed now, it could end
    twice, rejected there too. The turn's end comes first, so that the planner never takes
    the failures for the end of an iteration and asks its model again."""
    sid = state.session_id
    # The calls' outcomes as they stand: the ones cancelled here are not terminal yet.
    outcomes = [state.calls[c].outcome() for c in turn.call_ids
                if c in state.calls and state.calls[c].terminal]
    out = [Append(TurnCancelled(
        session_id=sid, at=now, actor=ACTOR, turn_id=turn.turn_id, request_id=turn.request_id,
        reason=reason, by=by, message=f"{why}; calls already running finish and are "
        "recorded, nothing acts on them", outcomes=outcomes),
        turn_ended_id(sid, turn.turn_id))]
    for call_id in turn.call_ids:
        call = state.calls.get(call_id)
        if call is not None and call.status in CANCELLABLE:
            out.append(_cancelled(state, call, why, now=now))
    return out


def _cancelled(state: SessionState, call: CallState, why: str, *, now: float) -> Append:
    # The terminal id every writer of a decided call's end shares (an executor, the
    # approval actor's timeout, a denial): whoever is first, the call ends once.
    return Append(CallFailed(
        session_id=state.session_id, at=now, actor=ACTOR, call_id=call.call_id,
        turn_id=call.turn_id, error_type="cancelled",
        message=f"{call.tool} did not run: its turn was {why}"),
        call_terminal_id(state.session_id, call.call_id))


def orphans_due(state: SessionState, *, now: float) -> list[Append]:
    """The calls of cancelled turns the approval actor has decided since: failed
    `cancelled` (a cancellation stored on a state that missed a call leaves it to this)."""
    return [_cancelled(state, call, "cancelled", now=now) for call in
            (state.calls[c] for c in state.orphans if c in state.calls)
            if call.status in CANCELLABLE or call.status == "denied"]


def decide_cancel(state: SessionState, turn_id: str, request_id: str, *,
                  reason: str | None, now: float, subject: str,
                  request_seq: int) -> list[Append]:
    """A request to stop a running turn: `turn.cancelled` (`cancelled`, `by` the request),
    its calls not yet dispatched `call.failed` `cancelled` (one waiting for a human
    included); calls already running finish and are recorded, nothing acts on them. A
    turn unknown or already ended is a `request.rejected` saying so."""
    sid = state.session_id
    turn = state.turns.get(turn_id)
    if turn is None or turn_id not in state.open_turns:
        why = "unknown_turn" if turn is None else "turn_ended"
        said = (f"session {sid} has no turn {turn_id}" if turn is None else
                f"turn {turn_id} already ended ({turn.status})")
        return [Append(RequestRejected(
            session_id=sid, at=now, actor=ACTOR, reason=why, request_id=request_id,
            subject=subject, message=f"nothing to cancel: {said}"),
            request_rejected_id(request_seq))]
    return cancel_turn(state, turn, now=now, reason="cancelled", by=request_id,
                       why=f"cancelled by request {request_id}"
                       + (f": {reason}" if reason else ""))


def decide_tool_event(state: SessionState, tool_event: ToolEventInput, *, now: float,
                      request_seq: int, result_ref: ResultRef | None = None,
                      default_agent: str = DEFAULT_AGENT,
                      accept_messages: bool = False) -> list[Append]:
    """The events an injected tool event makes due (seed 000): `tool_event.injected`
    (nothing at all when its idempotency key was seen: the first event stands), and with
    `trigger_processing` the planner turns in flight cancelled (`turn.cancelled`,
    `superseded`; their calls not yet dispatched `call.failed` `cancelled`) and a new turn
    that starts from it."""
    sid = state.session_id
    if tool_event.idempotency_key in state.tool_event_keys:
        return []
    event_id = tool_event_id(sid, tool_event.idempotency_key)
    if len(state.tool_events) >= MAX_TOOL_EVENTS:
        return [Append(RequestRejected(
            session_id=sid, at=now, actor=ACTOR, reason="too_many_tool_events",
            request_id=event_id, subject=request_subject(sid),
            message=f"session {sid} holds {len(state.tool_events)} injected tool events, "
                    f"the limit (each is read by every later turn): start a new session"),
            request_rejected_id(request_seq))]
    if tool_event.trigger_processing and not accept_messages:
        return [Append(RequestRejected(
            session_id=sid, at=now, actor=ACTOR, reason="no_planner", request_id=event_id,
            subject=request_subject(sid),
            message="trigger_processing needs a planner to start a turn, and this toolbus "
                    "runs none; inject without it, or give the manifest an "
                    "agent_config.model"), request_rejected_id(request_seq))]
    turn_id = turn_id_for(event_id) if tool_event.trigger_processing else None
    out = [Append(ToolEventInjected(
        session_id=sid, at=now, actor=ACTOR, event_id=event_id, tool_id=tool_event.tool_id,
        arguments=tool_event.arguments,
        result=None if result_ref is not None else tool_event.result,
        idempotency_key=tool_event.idempotency_key,
        trigger_processing=tool_event.trigger_processing, turn_id=turn_id,
        result_ref=result_ref), tool_event_msg_id(sid, event_id),
        # On its own subject, so a client finds one by its id in one read.
        route=event_id)]
    if turn_id is None:
        return out
    for open_id in state.open_turns:
        turn = state.turns[open_id]
        if turn.message is None:
            continue  # explicit calls a client asked for: not the agent's to drop
        if open_id == turn_id:
            # Its own turn, stored behind a first decision whose concurrency check failed
            # (the events pipelined behind the first may be stored): decided again, the
            # event does not supersede the turn it starts.
            continue
        out += cancel_turn(state, turn, now=now, reason="superseded", by=event_id,
                           why=f"superseded by tool event {event_id} "
                               f"({tool_event.tool_id}), injected with trigger_processing")
    out.append(Append(TurnRequested(
        session_id=sid, at=now, actor=ACTOR, turn_id=turn_id, request_id=event_id,
        call_ids=[], agent=default_agent, message="", trigger=event_id),
        turn_requested_id(sid, turn_id)))
    return out


def reject_request(subject: str, data: bytes, request_seq: int, reason: str, message: str,
                   *, now: float, headers: Mapping[str, str] | None = None) -> Append:
    """The stored rejection of a request that cannot be accepted. It names the request's
    id, from its body, or (a body too large or too broken to read it from) from the
    message id a client publishes it with (`client_request_id`), so that the client
    waiting for it hears of it at once."""
    rest = subject[len(REQUESTS_PREFIX) + 1:]
    sid, _, part = rest.rpartition(".")
    if part.isdigit():
        subject = request_subject(sid)  # as it was published, without its partition
    else:
        sid = rest  # not as the stream stores requests: the whole rest is quoted
    own = is_token(sid)
    # A tool event's rejection names the event its key would have made, for its sender.
    rid = (_tool_event_id_of(sid, data) if is_tool_event(data) else
           _request_id_of(data) or _request_id_of_header(sid, headers)) if own else None
    # The system session is shared: a body that names no usable session is not quoted
    # there (it may hold someone's secrets), only measured.
    event = RequestRejected(session_id=sid if own else SYSTEM_SESSION, at=now,
                            actor=ACTOR, reason=reason, message=message,
                            subject=subject[:300],
                            request_id=rid,
                            excerpt=excerpt(data) if own else f"({len(data)} bytes)")
    return Append(event, request_rejected_id(request_seq))


def fail_open_turns(state: SessionState, message: str, *, now: float) -> list[Append]:
    """End every open turn `internal`: what deciding for this session raised on."""
    return [Append(TurnFailed(session_id=state.session_id, at=now, actor=ACTOR,
                              turn_id=t, request_id=state.turns[t].request_id,
                              reason="internal", message=message,
                              outcomes=turn_outcomes(state, state.turns[t])),
                   turn_ended_id(state.session_id, t))
            for t in state.open_turns]


# --- effects ----------------------------------------------------------------------------


class SessionActor:
    def __init__(
        self,
        bus: Bus,
        *,
        max_parallel: int = 3,
        approval: InlineApproval | None = None,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        max_calls: int = DEFAULT_MAX_CALLS,
        cache_size: int = SESSION_CACHE_SIZE,
        default_agent: str = DEFAULT_AGENT,
        accept_messages: bool = False,
        instance: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`accept_messages`: a planner runs (actors/planner.py), so a request with a
        `message` starts a turn; without one it is refused (`no_planner`). `instance`
        names this process among those sharing the partitions."""
        self._kernel = Kernel(bus, ACTOR, clock=clock)
        self._accept_messages = accept_messages
        self._states = SessionStates(bus, self._kernel.log, size=cache_size,
                                     snapshot_every=SNAPSHOT_EVERY)
        self._max_parallel = max_parallel
        self._approval = approval
        # The planner of this process, if any: a turn it plans is handed to it as it is
        # stored, not one delivery later (set by whoever runs both).
        self.early_turn: EarlyTurn | None = None
        # Sessions whose last event so far said more of its decision follows: decided
        # anyway if nothing comes within `_MORE_WAIT_S` (its writer failed half way). Their
        # deliveries are held, not acked, until a decision is taken after them: killed
        # meanwhile, they are delivered again to whoever owns the session then.
        self._awaiting_rest: dict[str, tuple[asyncio.TimerHandle, list[Delivery]]] = {}
        self._late: set[asyncio.Task[None]] = set()
        self._max_request_bytes = max_request_bytes
        self._max_calls = max_calls
        self._default_agent = default_agent
        self._clock = clock
        self._artifacts = ArtifactStore(bus)
        # The partitions this process consumes (bus/partitions.py): the requests and
        # the events of their sessions, each through the partition's own consumers.
        self.instance = instance or member_name()
        self._owner = PartitionOwner(bus, ACTOR, self.instance, on_acquire=self._take,
                                     on_release=self._give_up)
        self._partition_loops: dict[int, list[PullLoop]] = {}
        self._kernel.log.writer = self.instance
        self._state_rpc = Responder(bus, f"{STATE_PREFIX}.*", self._on_state_request,
                                    queue="session")

    @property
    def kernel(self) -> Kernel:
        return self._kernel

    @property
    def partitions(self) -> list[int]:
        """The partitions this process consumes now."""
        return sorted(self._partition_loops)

    @property
    def states(self) -> SessionStates:
        """The sessions this actor keeps folded (read-only for others)."""
        return self._states

    async def start(self) -> None:
        await self._kernel.start()
        # Consumers of the single-process layout (before partitions): the requests one
        # would overlap the partitions' on its work-queue stream.
        await delete_consumers(self._kernel.bus, REQUESTS_STREAM, ("session-requests",))
        await delete_consumers(self._kernel.bus, EVENTS_STREAM, ("session-events",))
        await self._owner.start()
        await self._state_rpc.start()

    async def stop(self, grace: float = 5.0) -> None:
        for timer, held in self._awaiting_rest.values():
            timer.cancel()
            await _release(held, decided=False)
        self._awaiting_rest.clear()
        await stop_tasks(self._late)  # cancelled again while they run (one can be lost)
        await self._state_rpc.stop()
        await self._owner.stop()
        await self._kernel.stop(grace)

    async def _take(self, part: int) -> None:
        # A session of this partition still in memory is from an earlier turn at it (kept
        # then because it was being decided): it lacks what the owner since decided.
        self._states.forget_partition(part)
        self._partition_loops[part] = [
            await self._kernel.attach(Inbox(
                ConsumerSpec(EVENTS_STREAM, f"session-events-p{part}",
                             (partition_filter(part),), ack_wait_s=PARTITION_ACK_WAIT_S),
                self._on_event, self._reject_event, max_in_flight=512, yields=True)),
            await self._kernel.attach(Inbox(
                ConsumerSpec(REQUESTS_STREAM, f"session-requests-p{part}",
                             (requests_filter(part),), ack_wait_s=PARTITION_ACK_WAIT_S),
                self._on_request, self._reject_request)),
        ]
        log.info("session %s: consuming partition %d", self.instance, part)

    async def _give_up(self, part: int) -> None:
        for loop in self._partition_loops.pop(part, []):
            await self._kernel.detach(loop)
        self._states.forget_partition(part)
        log.info("session %s: gave partition %d up", self.instance, part)

    def _owns(self, sid: str) -> bool:
        return partition(sid, self._kernel.bus.partitions) in self._partition_loops

    def _decide(self, state: SessionState) -> list[Append]:
        return decide(state, now=self._clock(), max_parallel=self._max_parallel)

    async def _settle(self, entry: Entry) -> None:
        entry.settled = await self._states.decide_and_write(entry, self._decide,
                                                            attempts=DECIDE_ATTEMPTS)
        if not entry.settled:
            log.warning("session %s: gave up deciding after %d conflicts",
                        entry.state.session_id, DECIDE_ATTEMPTS)

    # -- every event of every session

    async def _on_event(self, delivery: Delivery) -> None:
        sid = session_of(delivery.subject)
        if not is_token(sid):
            await delivery.ack()
            return
        part = partition(sid, self._kernel.bus.partitions)
        if not self._owner.holds(part) and not await self._owner.surely_holds(part):
            # Maybe another process's now (this one was stopped or starved past its
            # lease): left unacknowledged, it goes to the owner, whose state must fold it.
            # If that is still this process, the session's next events, delivered before
            # this one comes back, must not be folded in its place.
            self._states.handed_back(sid, delivery.stream_seq)
            return
        waiting = self._awaiting_rest.pop(sid, None)
        held: list[Delivery] = []
        if waiting is not None:
            waiting[0].cancel()
            held = waiting[1]
        try:
            await self._on_session_event(delivery, sid, held)
        except BaseException:
            await _release(held, decided=False)
            raise

    async def _on_session_event(self, delivery: Delivery, sid: str,
                                held: list[Delivery]) -> None:
        entry = await self._states.entry(sid)
        async with entry.lock:
            seq = delivery.stream_seq
            read_to_it = False
            if entry.behind:
                # An earlier event of the session was handed back unfolded (`handed_back`):
                # not this one in its place; the log is read past it, to this one.
                await self._states.read_past_handed_back(entry)
                read_to_it = seq == entry.state.last_seq
            elif seq <= entry.state.last_seq and (
                    delivery.num_delivered > 1 or entry.missed(seq)):
                # Delivered after later events were folded: if it is one this state never
                # saw (its first delivery was lost with a node, or a read went past it),
                # fold the log again so it is in its place.
                await self._states.rebuild(entry)
            elif seq <= entry.state.last_seq and entry.settled and entry.is_caught_up:
                # Already folded (mostly our own writes coming back): the state has not
                # changed since the last decision, so nothing new can be due.
                await _release([*held, delivery], decided=True)
                return
            if seq > entry.state.last_seq or read_to_it:
                stored = decode_stored(seq, delivery.subject, delivery.data)
                if stored.event is None:
                    log.warning("session %s: unreadable event at seq %d: %s",
                                sid, stored.seq, stored.error)
                self._states.fold(entry, stored.seq, stored.event)  # (none if read_to_it)
                if isinstance(stored.event, RequestRejected) and \
                        stored.event.actor == ACTOR and stored.event.reason == "internal":
                    # Our own record that deciding for this session raised: deciding
                    # again on it would raise again and record again, forever.
                    await _release([*held, delivery], decided=True)
                    return
                headers = delivery.headers
                if headers and Header.MORE.value in headers:
                    # More of another actor's decision follow right behind: decided on
                    # once whole (deciding on a part races its rest), or after a while
                    # if the rest never comes. Held unacked until then.
                    held.append(delivery)
                    self._awaiting_rest[sid] = (asyncio.get_running_loop().call_later(
                        _MORE_WAIT_S, self._decide_late, sid, stored.seq), held)
                    return
            await self._settle(entry)
        await _release([*held, delivery], decided=True)

    def _decide_late(self, sid: str, seq: int) -> None:
        waiting = self._awaiting_rest.pop(sid, None)
        held = waiting[1] if waiting is not None else []

        async def settle() -> None:
            entry = self._states.peek(sid)
            if entry is None or not self._owns(sid):
                # Not ours any more (or no longer in memory): delivered again, to whoever
                # owns the session now, and decided there.
                await _release(held, decided=False)
                return
            try:
                async with entry.lock:
                    if entry.behind:  # the rest of the decision was handed back
                        await self._states.read_past_handed_back(entry)
                    await self._settle(entry)
            except Exception as exc:
                log.warning("session %s: deciding after an unfinished decision failed: "
                            "%s; its events are delivered again", sid, exc)
                await _release(held, decided=False)
                return
            await _release(held, decided=True)

        task = asyncio.get_running_loop().create_task(settle())
        self._late.add(task)
        task.add_done_callback(self._late.discard)

    def _reject_event(self, delivery: Delivery, reason: str, message: str) -> list[Append]:
        entry = self._states.peek(session_of(delivery.subject))
        failed = [] if entry is None else fail_open_turns(entry.state, message,
                                                          now=self._clock())
        return failed or [self._kernel.generic_rejection(delivery, reason, message)]

    # -- requests

    async def _on_request(self, delivery: Delivery) -> None:
        subject = delivery.subject
        # Stored as `toolbus.req.<sid>.<partition>` (the stream's subject transform).
        sid, _, part = subject[len(REQUESTS_PREFIX) + 1:].rpartition(".")
        try:
            check_session_id(sid)
        except InvalidIdError as exc:
            raise PoisonError("invalid_session_id", str(exc)) from exc
        if part != str(partition(sid, self._kernel.bus.partitions)):
            raise PoisonError("invalid_subject", f"{subject[:200]}: a request is published "
                              f"on {REQUESTS_PREFIX}.<session_id>; NATS stores it under its "
                              "partition")
        if is_tool_event(delivery.data):
            await self._on_tool_event(delivery, sid)
            return
        if sid == SYSTEM_SESSION:
            raise PoisonError("reserved_session", f"{sid} is toolbus's own session (it keeps "
                              "the rejections of requests that name no usable session): "
                              "send requests to a session of yours")
        try:
            request = parse_request(delivery.data, max_bytes=self._max_request_bytes,
                                    max_calls=self._max_calls)
        except InvalidRequestError as exc:
            raise PoisonError(exc.reason, exc.message) from exc
        request_id = request.request_id or f"{AUTO_REQUEST_PREFIX}{delivery.stream_seq}"
        # A session not in memory is taken as new, and its first write proves it (or
        # conflicts, and the session is loaded): the message that starts a conversation.
        provisional = self._states.assume_new(sid)
        entry = provisional or await self._states.entry(sid)
        approver = self._approval.decide_inline if self._approval else None

        def decide_this(state: SessionState) -> list[Append]:
            return decide_request(state, request, request_id, now=self._clock(),
                                  subject=subject, request_seq=delivery.stream_seq,
                                  approver=approver, max_parallel=self._max_parallel,
                                  default_agent=self._default_agent,
                                  accept_messages=self._accept_messages)

        try:
            for _ in range(DECIDE_ATTEMPTS):
                await self._states.catch_up(entry)
                async with entry.lock:
                    if not entry.is_caught_up:
                        continue
                    items = decide_this(entry.state)
                    if entry is provisional and len(items) != 1:
                        # Only the first event of a decision is checked: the calls stored
                        # behind it would be stored (and run) even if the check failed.
                        # One event or none: else the session is read first.
                        self._states.abandon(provisional)
                        provisional = None
                        entry = await self._states.entry(sid)
                        continue
                    planned = self._plan_early(entry.state, items)
                    try:
                        results = await self._states.write(entry, items)
                        if entry is provisional and results[0].duplicate:
                            # Stored before (a server that answers a repeated message id
                            # before the check): not new, whatever the check said.
                            raise ConcurrencyError(subject, 0, "a repeated first event")
                    except ConcurrencyError:
                        planned(None)
                        if entry is provisional:  # the session has a past after all
                            self._states.abandon(provisional)
                            provisional = None
                            entry = await self._states.entry(sid)
                        else:
                            await self._states.reread(entry)
                        continue
                    except BaseException:
                        planned(None)
                        raise
                    planned(None if results[0].duplicate else results[0].seq)
                    if entry is provisional:
                        self._states.adopt(entry)
                        provisional = None
                    if self._approval is not None:
                        self._approval.stored_inline([
                            (sid, i.event.call_id) for i in items
                            if isinstance(i.event, CallApproved | CallRejected)])
                    # What the request made due at once (a turn whose calls were all
                    # rejected ends now), in case its events were folded right away.
                    await self._settle(entry)
                    break
            else:
                # Never silently dropped: a passing error, so the kernel redelivers it.
                raise ConcurrencyError(subject, entry.state.last_seq,
                                       f"request {request_id} kept conflicting")
        finally:
            if provisional is not None:  # not written (an error, a cancellation)
                self._states.abandon(provisional)
        await delivery.ack()

    def _plan_early(self, state: SessionState, items: Sequence[Append]
                    ) -> Callable[[int | None], None]:
        """The planner of this process told of a decision that is a planner turn alone."""
        if self.early_turn is None or len(items) != 1:
            return _not_planned
        event = items[0].event
        if not isinstance(event, TurnRequested) or event.message is None:
            return _not_planned
        try:
            return self.early_turn(state, event) or _not_planned
        except Exception:  # a shortcut only: the delivery plans the turn
            log.exception("session %s: handing turn %s to the planner failed",
                          state.session_id, event.turn_id)
            return _not_planned

    async def _on_tool_event(self, delivery: Delivery, sid: str) -> None:
        if sid == SYSTEM_SESSION:
            raise PoisonError("reserved_session", f"{sid} is toolbus's own session: inject "
                              "tool events into a session of yours")
        try:
            tool_event = parse_tool_event(delivery.data, max_bytes=self._max_request_bytes)
        except InvalidRequestError as exc:
            raise PoisonError(exc.reason, exc.message) from exc
        entry = await self._states.entry(sid)
        await self._states.catch_up(entry)
        if tool_event.idempotency_key in entry.state.tool_event_keys:
            await delivery.ack()  # the first event with this key stands; nothing more
            return
        result_ref: ResultRef | None = None
        encoded = msgspec.json.encode(tool_event.result)
        if len(encoded) > INLINE_TOOL_EVENT_BYTES:
            # Large data goes by reference (the rule of every large result): the event
            # stays small, the whole is in the object store, read on demand. Named by
            # its content too: a later body under the same key never overwrites it.
            digest = hashlib.sha256(encoded).hexdigest()[:16]
            event_id = tool_event_id(sid, tool_event.idempotency_key)
            result_ref = await self._artifacts.put(sid, f"{event_id}-{digest}", 0, encoded)
            # Its preview, the structured one a tool's large result gets (type, fields,
            # first items), made now: the planner has only the reference later.
            result_ref = msgspec.structs.replace(result_ref, preview=compress.preview(
                tool_event.result, key=event_id, tool=tool_event.tool_id))

        def decide_this(state: SessionState) -> list[Append]:
            return decide_tool_event(state, tool_event, now=self._clock(),
                                     request_seq=delivery.stream_seq, result_ref=result_ref,
                                     default_agent=self._default_agent,
                                     accept_messages=self._accept_messages)

        await self._states.catch_up(entry)
        async with entry.lock:
            if not await self._states.decide_and_write(entry, decide_this,
                                                       attempts=DECIDE_ATTEMPTS):
                raise ConcurrencyError(delivery.subject, entry.state.last_seq,
                                       "the tool event kept conflicting")
            await self._settle(entry)
        await delivery.ack()

    def _reject_request(self, delivery: Delivery, reason: str, message: str) -> list[Append]:
        return [reject_request(delivery.subject, delivery.data, delivery.stream_seq, reason,
                               message, now=self._clock(), headers=delivery.headers)]

    # -- state queries

    async def _on_state_request(self, subject: str, data: bytes) -> bytes:
        sid = subject[len(STATE_PREFIX) + 1:]
        check_session_id(sid)
        # Any process may answer: one that does not consume the session's partition
        # folds it from the log as it is now (its cached state may be old).
        entry = await (self._states.entry(sid) if self._owns(sid)
                       else self._states.current(sid))
        await self._states.catch_up(entry)
        async with entry.lock:
            encoded = encode_state(entry.state)
            if data == b"digest":
                # A state too large for one reply can still be compared with a replay.
                return msgspec.json.encode({"sha256": hashlib.sha256(encoded).hexdigest(),
                                            "last_seq": entry.state.last_seq,
                                            "size": len(encoded)})
            limit = min(MAX_STATE_REPLY_BYTES, self._kernel.bus.nc.max_payload - 4096)
            if len(encoded) > limit:
                raise RpcError("too_large", f"the state of {sid} is {len(encoded)} bytes, "
                               f"over the {limit}-byte reply limit; fold "
                               f"it from the log (`toolbus state` does) up to sequence "
                               f"{entry.state.last_seq}")
            return encoded


# A reply must fit the server's max payload with room to spare.
MAX_STATE_REPLY_BYTES = 4 * 1024 * 1024


def _tool_event_id_of(sid: str, data: bytes) -> str | None:
    try:
        body = decode_json(data[:DEFAULT_MAX_REQUEST_BYTES], what="tool event")
    except InvalidRequestError:
        return None
    key = body.get("idempotency_key") if isinstance(body, dict) else None
    if not isinstance(key, str) or not 0 < len(key) <= MAX_IDEMPOTENCY_KEY_CHARS:
        return None
    clean = strip_controls(key)
    return tool_event_id(sid, clean) if clean.strip() else None


def _request_id_of_header(sid: str, headers: Mapping[str, str] | None) -> str | None:
    """The request id in a message id `<sid>:<request_id>` (as `ToolbusClient.submit`
    sends it), if it is one a body could have given."""
    msg_id = (headers or {}).get(Header.MSG_ID.value)
    if not isinstance(msg_id, str) or not msg_id.startswith(f"{sid}:"):
        return None
    rid = msg_id[len(sid) + 1:]
    ok = 0 < len(rid) <= 256 and strip_controls(rid) == rid and rid.strip() == rid and \
        not rid.startswith((AUTO_REQUEST_PREFIX, TOOL_EVENT_PREFIX))
    return rid if ok else None


def _request_id_of(data: bytes) -> str | None:
    try:
        body = decode_json(data[:DEFAULT_MAX_REQUEST_BYTES], what="request")
    except InvalidRequestError:
        return None
    rid = body.get("request_id") if isinstance(body, dict) else None
    return rid if isinstance(rid, str) and len(rid) <= 256 else None
