"""Session actor.

Consumes: requests on `toolbus.req.<sid>` (work queue) and every event of every session
(`toolbus.evt.>`), one session at a time, in stream order.
Emits: `turn.requested`, `call.requested`; `call.dispatched` for calls the approval actor
approved (or a human granted), under the parallel policy: at most `max_parallel` calls of
a turn at once, and calls with side effects alone and in order; `call.failed` for denied
calls; `turn.completed` / `turn.failed`; `request.rejected`.
Idempotency: every event has a deterministic message id derived from the session, the
turn or call id and the fact (`<sid>:<call_id>:dispatch`, `<sid>:<turn_id>:ended`; a
denied call's failure shares `<sid>:<call_id>:terminal` with the executor's outcomes).
A request without a `request_id` gets `auto-<stream seq>`, so its redelivery maps onto
the same ids.
Retry rule: decisions are appended with the per-session concurrency check on their first
event, the rest pipelined behind it in one round trip; a stale writer re-reads the session
and decides again (bounded). Events a failed decision may still have stored carry the
same ids as the re-decision's, so they are deduplicated, and the reducer folds any order.
Requests and events are acked only after what they caused is stored.

State is level-triggered: after each event is folded, `decide` answers "what is due now?"
from the state alone, so a crash between two appends is healed by the next delivery.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import msgspec

from bus.connection import Bus
from bus.consumer import Delivery, PullLoop
from bus.eventlog import Append, EventLog, decode_stored
from bus.rpc import Responder
from bus.streams import ConsumerSpec
from bus.subjects import (
    EVENTS_PREFIX,
    EVENTS_STREAM,
    REQUESTS_PREFIX,
    REQUESTS_STREAM,
    STATE_PREFIX,
    session_of,
)
from schemas.errors import ConcurrencyError, InvalidIdError, InvalidRequestError
from schemas.events import (
    CallApproved,
    CallDispatched,
    CallFailed,
    CallRejected,
    CallRequested,
    Event,
    RequestRejected,
    TurnCompleted,
    TurnFailed,
    TurnRequested,
)
from schemas.ids import (
    SYSTEM_SESSION,
    call_id_for,
    check_session_id,
    is_token,
    turn_id_for,
)
from schemas.requests import (
    DEFAULT_MAX_CALLS,
    DEFAULT_MAX_REQUEST_BYTES,
    Request,
    parse_request,
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

ACTOR = "session"
_DECIDE_ATTEMPTS = 8

# --- pure decisions -------------------------------------------------------------------


InlineApprover = Callable[[CallRequested], "CallApproved | CallRejected | None"]


class InlineApproval(Protocol):
    """The approval actor of this process, asked directly (see `accept_request`)."""

    def decide_inline(self, call: CallRequested) -> CallApproved | CallRejected | None: ...
    def stored_inline(self, keys: list[tuple[str, str]]) -> None: ...


def accept_request(state: SessionState, request: Request, request_id: str, *,
                   now: float, approver: InlineApprover | None = None,
                   max_parallel: int = 3) -> list[Append]:
    """The events that accept a new request: the turn and its calls. The approval actor
    decides each call next; this actor dispatches the approved ones.

    With an `approver` (the approval actor's own decision, when it runs in this process),
    calls it can settle without a human are decided here, and the ones that may start
    are dispatched, all in the same round trip: the events and their ids are exactly what
    the approval actor and `decide` would have written one hop later each."""
    sid = state.session_id
    turn_id = turn_id_for(request_id)
    call_ids = [call_id_for(turn_id, i) for i in range(len(request.calls))]
    out = [Append(TurnRequested(session_id=sid, at=now, actor=ACTOR, turn_id=turn_id,
                                request_id=request_id, call_ids=call_ids,
                                agent=request.agent),
                  f"{sid}:{turn_id}:requested")]
    for call_id, call in zip(call_ids, request.calls, strict=True):
        out.append(Append(CallRequested(session_id=sid, at=now, actor=ACTOR, call_id=call_id,
                                        turn_id=turn_id, tool=call.tool,
                                        arguments=call.arguments, reasoning=call.reasoning,
                                        output_path=call.output_path, delegate=call.delegate,
                                        instance=call.instance, agent=request.agent),
                          f"{sid}:{call_id}:requested"))
    if approver is None:
        return out
    decisions = []
    for item in out[1:]:
        assert isinstance(item.event, CallRequested)
        decision = approver(item.event)
        if decision is not None:
            decisions.append(Append(decision, f"{sid}:{item.event.call_id}:policy"))
    out += decisions
    # Dispatch from a scratch state holding only this turn: the parallel rules are per turn.
    scratch = SessionState(session_id=sid)
    for seq, item in enumerate(out, start=1):
        evolve(scratch, item.event, seq)
    return out + _due_in_turn(scratch, scratch.turns[turn_id], max_parallel, now)


def _dispatch(state: SessionState, call: CallState, now: float) -> Append:
    assert call.route is not None
    event = CallDispatched(session_id=state.session_id, at=now, actor=ACTOR,
                           call_id=call.call_id, turn_id=call.turn_id, tool=call.tool,
                           arguments=call.approved_arguments or {}, route=call.route,
                           timeout_ms=call.timeout_ms)
    return Append(event, f"{state.session_id}:{call.call_id}:dispatch", call.route)


def _due_in_turn(state: SessionState, turn: TurnState, max_parallel: int,
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
                f"{state.session_id}:{call.call_id}:terminal"))
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
        if turn_is_done(state, turn):
            outcomes = turn_outcomes(state, turn)
            if outcomes and all(o.status == "rejected" for o in outcomes):
                reasons = "; ".join(f"{o.call_id}: {o.error.message}" for o in outcomes
                                    if o.error is not None)
                ev: Event = TurnFailed(session_id=sid, at=now, actor=ACTOR, turn_id=turn_id,
                                       request_id=turn.request_id, reason="all_calls_rejected",
                                       message=reasons, outcomes=outcomes)
            else:
                ev = TurnCompleted(session_id=sid, at=now, actor=ACTOR, turn_id=turn_id,
                                   request_id=turn.request_id,
                                   ok=all(o.status == "succeeded" for o in outcomes),
                                   outcomes=outcomes)
            out.append(Append(ev, f"{sid}:{turn_id}:ended"))
            continue
        out.extend(_due_in_turn(state, turn, max_parallel, now))
    return out


# --- I/O loop -------------------------------------------------------------------------


@dataclass(eq=False)
class _Entry:
    state: SessionState
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Highest sequence this actor wrote without folding it yet; no decision is taken
    # until the state has caught up to it (the writes come back through the consumer).
    written_upto: int = 0
    caught_up: asyncio.Event = field(default_factory=asyncio.Event)

    def fold(self, seq: int, event: Event | None) -> None:
        if event is not None:
            evolve(self.state, event, seq)
        elif seq > self.state.last_seq:
            self.state.last_seq = seq  # unreadable event: skipped, but the position moves
        if self.state.last_seq >= self.written_upto:
            self.caught_up.set()

    @property
    def is_caught_up(self) -> bool:
        return self.state.last_seq >= self.written_upto


class SessionActor:
    def __init__(
        self,
        bus: Bus,
        *,
        max_parallel: int = 3,
        approval: InlineApproval | None = None,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        max_calls: int = DEFAULT_MAX_CALLS,
        cache_size: int = 10_000,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._bus = bus
        self._log = EventLog(bus)
        self._max_parallel = max_parallel
        self._approval = approval
        self._max_request_bytes = max_request_bytes
        self._max_calls = max_calls
        self._cache: OrderedDict[str, _Entry] = OrderedDict()
        self._cache_size = cache_size
        self._loading: dict[str, asyncio.Future[_Entry]] = {}
        self._clock = clock
        self._requests = PullLoop(
            bus, ConsumerSpec(REQUESTS_STREAM, "session-requests", (f"{REQUESTS_PREFIX}.>",)),
            self._on_request, key=session_of,
        )
        self._events = PullLoop(
            bus, ConsumerSpec(EVENTS_STREAM, "session-events", (f"{EVENTS_PREFIX}.>",)),
            self._on_event, key=session_of, max_in_flight=512,
        )
        self._state_rpc = Responder(bus, f"{STATE_PREFIX}.*", self._on_state_request,
                                    queue="session")

    async def start(self) -> None:
        await self._events.start()
        await self._requests.start()
        await self._state_rpc.start()

    async def stop(self, grace: float = 5.0) -> None:
        await self._state_rpc.stop()
        await self._requests.stop(grace)
        await self._events.stop(grace)

    # -- cache

    async def _entry(self, sid: str) -> _Entry:
        entry = self._cache.get(sid)
        if entry is not None:
            self._cache.move_to_end(sid)
            return entry
        loading = self._loading.get(sid)
        if loading is not None:
            return await asyncio.shield(loading)
        fut: asyncio.Future[_Entry] = asyncio.get_running_loop().create_future()
        self._loading[sid] = fut
        try:
            entry = _Entry(SessionState(session_id=sid))
            for stored in await self._log.read_session(sid):
                entry.fold(stored.seq, stored.event)
            entry.caught_up.set()
            self._cache[sid] = entry
            self._evict()
            fut.set_result(entry)
            return entry
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()  # mark retrieved: waiters re-raise it themselves
            raise
        finally:
            del self._loading[sid]

    def _evict(self) -> None:
        while len(self._cache) > self._cache_size:
            sid, entry = next(iter(self._cache.items()))
            if entry.lock.locked():
                self._cache.move_to_end(sid)
                return
            del self._cache[sid]

    async def _catch_up(self, entry: _Entry, timeout: float = 2.0) -> None:
        """Wait (lock released by the caller) until our own writes have come back."""
        if entry.is_caught_up:
            return
        entry.caught_up.clear()
        try:
            async with asyncio.timeout(timeout):
                while not entry.is_caught_up:
                    await entry.caught_up.wait()
                    entry.caught_up.clear()
        except TimeoutError:
            await self._reread(entry)

    async def _reread(self, entry: _Entry) -> None:
        for stored in await self._log.read_session(entry.state.session_id,
                                                   after=entry.state.last_seq):
            entry.fold(stored.seq, stored.event)
        entry.written_upto = min(entry.written_upto, entry.state.last_seq)
        entry.caught_up.set()

    # -- writing decisions

    async def _write(self, entry: _Entry, items: list[Append]) -> None:
        """Append a decision under the concurrency check, and fold it at once when that is
        provably in order; else wait for it to come back through the consumer."""
        results = await self._log.append_decision(items, expect_last=entry.state.last_seq)
        seqs = [r.seq for r in results]
        # The first event passed the check, so it directly follows `last_seq`. When the
        # stream sequences are contiguous, nothing at all was stored between them, so the
        # whole decision can be folded now instead of waiting for it to come back.
        if not any(r.duplicate for r in results) and seqs == list(
            range(seqs[0], seqs[0] + len(seqs))
        ):
            for r, item in zip(results, items, strict=True):
                entry.fold(r.seq, item.event)
        else:
            entry.written_upto = max(entry.written_upto, *(r.seq for r in results))
            if not entry.is_caught_up:
                entry.caught_up.clear()

    async def _decide_and_write(self, entry: _Entry) -> None:
        for _ in range(_DECIDE_ATTEMPTS):
            if not entry.is_caught_up:
                return  # the writes that are coming back will trigger the next decision
            items = decide(entry.state, now=self._clock(), max_parallel=self._max_parallel)
            if not items:
                return
            try:
                await self._write(entry, items)
            except ConcurrencyError:
                await self._reread(entry)
                continue
        log.warning("session %s: gave up deciding after %d conflicts",
                    entry.state.session_id, _DECIDE_ATTEMPTS)

    # -- handlers

    async def _on_event(self, delivery: Delivery) -> None:
        sid = session_of(delivery.subject)
        if not is_token(sid):
            await delivery.ack()
            return
        entry = await self._entry(sid)
        async with entry.lock:
            if delivery.stream_seq > entry.state.last_seq:
                stored = decode_stored(delivery.stream_seq, delivery.subject, delivery.data)
                if stored.event is None:
                    log.warning("session %s: unreadable event at seq %d: %s",
                                sid, stored.seq, stored.error)
                entry.fold(stored.seq, stored.event)
            await self._decide_and_write(entry)
        await delivery.ack()

    async def _on_request(self, delivery: Delivery) -> None:
        subject = delivery.subject
        sid = subject[len(REQUESTS_PREFIX) + 1:]
        now = self._clock()
        try:
            check_session_id(sid)
        except InvalidIdError as exc:
            rejected = RequestRejected(session_id=SYSTEM_SESSION, at=now, actor=ACTOR,
                                       reason="invalid_session_id", message=str(exc),
                                       subject=subject, excerpt=_excerpt(delivery.data))
            await self._log.append(Append(rejected, f"req:{delivery.stream_seq}:rejected"))
            await delivery.ack()
            return
        try:
            request = parse_request(delivery.data, max_bytes=self._max_request_bytes,
                                    max_calls=self._max_calls)
        except InvalidRequestError as exc:
            rejected = RequestRejected(session_id=sid, at=now, actor=ACTOR, reason=exc.reason,
                                       message=exc.message, subject=subject,
                                       request_id=_request_id_of(delivery.data),
                                       excerpt=_excerpt(delivery.data))
            await self._log.append(Append(rejected, f"req:{delivery.stream_seq}:rejected"))
            await delivery.ack()
            return
        request_id = request.request_id or f"auto-{delivery.stream_seq}"
        entry = await self._entry(sid)
        for _ in range(_DECIDE_ATTEMPTS):
            await self._catch_up(entry)
            async with entry.lock:
                if not entry.is_caught_up:
                    continue
                turn_id = turn_id_for(request_id)
                known = entry.state.turns.get(turn_id)
                missing = [] if known is None else \
                    [c for c in known.call_ids if c not in entry.state.calls]
                if known is not None and missing:
                    # The turn was stored but some of its calls were not (a crash in the
                    # middle of the batch): store the missing ones, same ids, and go on.
                    items = [i for i in accept_request(entry.state, request, request_id,
                                                       now=now)
                             if isinstance(i.event, CallRequested)
                             and i.event.call_id in missing]
                    log.warning("session %s: turn %s was missing %d call(s); restored",
                                sid, turn_id, len(items))
                    try:
                        await self._write(entry, items)
                    except ConcurrencyError:
                        await self._reread(entry)
                        continue
                    await self._decide_and_write(entry)
                    break
                if known is not None:
                    if known.request_id == request_id:
                        rejected = RequestRejected(
                            session_id=sid, at=now, actor=ACTOR, reason="duplicate_request",
                            request_id=request_id, subject=subject,
                            message=f"request {request_id!r} was already accepted as turn "
                                    f"{turn_id} ({known.status}); its calls do not run again",
                        )
                        await self._log.append(
                            Append(rejected, f"req:{delivery.stream_seq}:rejected"))
                        break
                items = accept_request(
                    entry.state, request, request_id, now=now,
                    approver=self._approval.decide_inline if self._approval else None,
                    max_parallel=self._max_parallel)
                try:
                    await self._write(entry, items)
                except ConcurrencyError:
                    await self._reread(entry)
                    continue
                if self._approval is not None:
                    self._approval.stored_inline([
                        (sid, i.event.call_id) for i in items
                        if isinstance(i.event, CallApproved | CallRejected)])
                # What the request made due at once (a turn whose calls were all
                # rejected ends now), in case its events were folded right away.
                await self._decide_and_write(entry)
                break
        else:
            # Never silently dropped: left unacked, it is redelivered and tried again.
            log.warning("session %s: request %s kept conflicting; will be redelivered",
                        sid, request_id)
            await delivery.nak(delay=1.0)
            return
        await delivery.ack()

    async def _on_state_request(self, subject: str, data: bytes) -> bytes:
        sid = subject[len(STATE_PREFIX) + 1:]
        check_session_id(sid)
        entry = await self._entry(sid)
        await self._catch_up(entry)
        async with entry.lock:
            return encode_state(entry.state)


def _excerpt(data: bytes, limit: int = 200) -> str:
    text = data[:limit].decode("utf-8", errors="replace")
    return text + ("…" if len(data) > limit else "")


def _request_id_of(data: bytes) -> str | None:
    try:
        body = msgspec.json.decode(data[:DEFAULT_MAX_REQUEST_BYTES])
    except (msgspec.DecodeError, ValueError):
        return None
    rid = body.get("request_id") if isinstance(body, dict) else None
    return rid if isinstance(rid, str) else None
