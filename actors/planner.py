"""Planner actor: the agent loop, event-sourced.

Consumes: `turn.requested`, `model.requested`, `model.responded` and the calls' terminal
events (`call.succeeded`, `call.failed`, `call.rejected`), one session at a time.
Emits: `model.requested` (concurrency-checked, like every decision), `model.responded`
(a fact: the model's answer), `call.requested` for the calls the model asked for (the
approval and session actors take them from there, as for explicit calls), and the end
of the turn: `turn.completed` with the answer, or `turn.failed` (a model error, the
iteration limit).

Level-triggered, as the session actor: after each event, `decide` answers "what is due?"
from the state alone. The model is called by whoever handles a `model.requested` that has
no answer yet, holding that message (in-progress acks) until the answer is stored: a
planner killed before `model.responded` leaves the message to be redelivered and the
model asked again (a model call has no side effects); killed after it, the answer is in
the log and nothing asks again. Replay reads the answers from the log and never calls a
model.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import httpx
import msgspec

from actors.kernel import Entry, Inbox, Kernel, SessionStates
from actors.llm import complete
from actors.llm.types import Message, ModelSettings, ToolCall
from bus.catalog import Catalog
from bus.connection import Bus
from bus.consumer import Delivery
from bus.eventlog import Append, decode_stored
from bus.streams import ConsumerSpec
from bus.subjects import EVENTS_PREFIX, EVENTS_STREAM, LIVE_PREFIX, session_of
from schemas.defaults import ACK_WAIT_S, DECIDE_ATTEMPTS
from schemas.errors import ModelError
from schemas.events import (
    CallRequested,
    ModelRequested,
    ModelResponded,
    ModelToolCall,
    TurnCompleted,
    TurnFailed,
    clip,
)
from schemas.ids import (
    call_id_for,
    call_requested_id,
    is_token,
    model_requested_id,
    model_responded_id,
    turn_ended_id,
)
from schemas.state import CallState, SessionState, TurnState, turn_outcomes
from schemas.tools import ToolSpec

log = logging.getLogger("toolbus.planner")

ACTOR = "planner"
DEFAULT_MAX_ITERATIONS = 25
_WHOLE_CALL_ATTEMPTS = 2  # a stream that broke after some text is asked again once


class _Deltas(Protocol):
    async def __call__(self, text: str, *, reset: bool = False) -> None: ...


@dataclass(frozen=True, slots=True)
class Offer:
    """What the model is offered this time: named in `model.requested`."""

    provider: str
    model: str
    tools: int
    tools_digest: str


# --- pure decisions -------------------------------------------------------------------


def decide(state: SessionState, offer: Offer, *, now: float,
           max_iterations: int = DEFAULT_MAX_ITERATIONS,
           max_tokens: int | None = None) -> list[Append]:
    """What is due in the session's planner turns: ask the model, request the calls it
    asked for, or end the turn."""
    out: list[Append] = []
    for turn_id in state.open_turns:
        turn = state.turns[turn_id]
        if turn.message is not None:
            out += _due(state, turn, offer, now=now, max_iterations=max_iterations,
                        max_tokens=max_tokens)
    return out


def _due(state: SessionState, turn: TurnState, offer: Offer, *, now: float,
         max_iterations: int, max_tokens: int | None) -> list[Append]:
    sid = state.session_id
    answered = len(turn.steps)
    if turn.model_requested > answered:
        return []  # the model is being asked
    if answered == 0:
        return [_ask(sid, turn, 1, offer, now)]
    used = sum(s.input_tokens + s.output_tokens for s in turn.steps)
    if max_tokens is not None and used > max_tokens:
        return [_fail(state, turn, "max_tokens", f"the turn used {used} tokens over "
                      f"{answered} model calls; the limit is {max_tokens} per turn", now)]
    last = turn.steps[-1]
    if not last.tool_calls:
        outcomes = turn_outcomes(state, turn)
        return [Append(TurnCompleted(session_id=sid, at=now, actor=ACTOR,
                                     turn_id=turn.turn_id, request_id=turn.request_id,
                                     ok=True, outcomes=outcomes, text=last.text),
                       turn_ended_id(sid, turn.turn_id))]
    missing = [c for c in last.tool_calls if c.call_id not in state.calls]
    if missing:
        return [Append(CallRequested(session_id=sid, at=now, actor=ACTOR, call_id=c.call_id,
                                     turn_id=turn.turn_id, tool=c.name,
                                     arguments=c.arguments, agent=turn.agent),
                       call_requested_id(sid, c.call_id)) for c in missing]
    if not all(state.calls[c.call_id].terminal for c in last.tool_calls):
        return []  # the calls are running (or waiting for a human)
    if answered >= max_iterations:
        return [_fail(state, turn, "max_iterations",
                      f"the model asked for tools {answered} times without answering; the "
                      f"limit is {max_iterations} iterations per turn", now)]
    return [_ask(sid, turn, answered + 1, offer, now)]


def _fail(state: SessionState, turn: TurnState, reason: str, message: str,
          now: float) -> Append:
    sid = state.session_id
    return Append(TurnFailed(session_id=sid, at=now, actor=ACTOR, turn_id=turn.turn_id,
                             request_id=turn.request_id, reason=reason, message=message,
                             outcomes=turn_outcomes(state, turn)),
                  turn_ended_id(sid, turn.turn_id))


def _ask(sid: str, turn: TurnState, iteration: int, offer: Offer, now: float) -> Append:
    return Append(ModelRequested(session_id=sid, at=now, actor=ACTOR, turn_id=turn.turn_id,
                                 iteration=iteration, provider=offer.provider,
                                 model=offer.model, tools=offer.tools,
                                 tools_digest=offer.tools_digest),
                  model_requested_id(sid, turn.turn_id, iteration))


def transcript(state: SessionState, turn: TurnState) -> list[Message]:
    """The conversation the model sees for `turn`: earlier planner turns of the session
    (the message and the answer), then this turn's message, and each of its model steps
    with the results of the calls it asked for."""
    out: list[Message] = []
    for other in state.turns.values():
        if other.turn_id == turn.turn_id:
            break
        if other.message is not None and other.status == "completed":
            out.append(Message(role="user", text=other.message))
            if other.text:
                out.append(Message(role="assistant", text=other.text))
    assert turn.message is not None
    out.append(Message(role="user", text=turn.message))
    for step in turn.steps:
        out.append(Message(role="assistant", text=step.text, tool_calls=[
            ToolCall(id=c.id, name=c.name,
                     arguments=c.arguments if isinstance(c.arguments, dict) else {},
                     extra=c.extra) for c in step.tool_calls]))
        for c in step.tool_calls:
            call = state.calls.get(c.call_id)
            text, is_error = _result_text(call)
            out.append(Message(role="tool", tool_call_id=c.id, name=c.name, text=text,
                               is_error=is_error))
    return out


_encode = msgspec.json.Encoder().encode


def _result_text(call: CallState | None) -> tuple[str, bool]:
    """What the model reads of a call's end: the result as JSON, or every word of why it
    failed (a rejection lists each argument violation, so the model can fix them)."""
    if call is None:
        return "the call was not recorded", True
    if call.status == "succeeded":
        if call.result_ref is not None:
            ref = call.result_ref
            return (f"(a result of {ref.size} bytes, stored as {ref.key}; it begins: "
                    f"{ref.preview})"), False
        return _encode(call.result).decode(), False
    error = call.error
    if error is None:
        return f"the call ended {call.status}", True
    return f"{error.error_type}: {error.message}", True


def tools_digest(specs: Sequence[ToolSpec]) -> str:
    names = ",".join(sorted(s.name for s in specs))
    return hashlib.sha256(names.encode()).hexdigest()[:16]


# --- effects ----------------------------------------------------------------------------


class Planner:
    def __init__(self, bus: Bus, catalog: Catalog, settings: ModelSettings, *,
                 instructions: str | None = None,
                 tools: Callable[[ToolSpec], bool] | None = None,
                 max_iterations: int = DEFAULT_MAX_ITERATIONS,
                 max_tokens: int | None = None,
                 ack_wait_s: float = ACK_WAIT_S * 10,
                 clock: Callable[[], float] = time.time) -> None:
        self._bus = bus
        self._kernel = Kernel(bus, ACTOR, clock=clock)
        self._states = SessionStates(bus, self._kernel.log)
        self._catalog = catalog
        self._settings = settings
        self._instructions = instructions
        self._offered = tools or (lambda spec: True)
        self._max_iterations = max_iterations
        self._max_tokens = max_tokens
        self._ack_wait_s = ack_wait_s
        self._clock = clock
        self._http: httpx.AsyncClient | None = None
        subjects = tuple(f"{EVENTS_PREFIX}.*.{t}" for t in (
            "turn.requested", "model.requested", "model.responded", "call.succeeded",
            "call.failed", "call.rejected"))
        self._kernel.add(Inbox(
            ConsumerSpec(EVENTS_STREAM, "planner", subjects, ack_wait_s=ack_wait_s),
            self._on_event, self._reject, max_in_flight=256))

    @property
    def kernel(self) -> Kernel:
        return self._kernel

    def describe(self) -> str:
        s = self._settings
        return f"{s.provider} {s.model}" + (f" at {s.base_url}" if s.base_url else "")

    async def start(self) -> None:
        self._http = httpx.AsyncClient(timeout=self._settings.timeout_s)
        await self._kernel.start()

    async def stop(self, grace: float = 5.0) -> None:
        await self._kernel.stop(grace)
        if self._http is not None:
            await self._http.aclose()

    def _tools(self) -> list[ToolSpec]:
        return [s for s in self._catalog.all() if self._offered(s)]

    def _offer(self, tools: Sequence[ToolSpec]) -> Offer:
        return Offer(provider=self._settings.provider, model=self._settings.model,
                     tools=len(tools), tools_digest=tools_digest(tools))

    def _reject(self, delivery: Delivery, reason: str, message: str) -> list[Append]:
        entry = self._states.peek(session_of(delivery.subject))
        if entry is None:
            return [self._kernel.generic_rejection(delivery, reason, message)]
        now = self._clock()
        return [Append(TurnFailed(session_id=entry.state.session_id, at=now, actor=ACTOR,
                                  turn_id=t.turn_id, request_id=t.request_id,
                                  reason="internal", message=message,
                                  outcomes=turn_outcomes(entry.state, t)),
                       turn_ended_id(entry.state.session_id, t.turn_id))
                for t in entry.state.turns.values()
                if t.status == "running" and t.message is not None] or \
            [self._kernel.generic_rejection(delivery, reason, message)]

    async def _on_event(self, delivery: Delivery) -> None:
        sid = session_of(delivery.subject)
        if not is_token(sid):
            await delivery.ack()
            return
        entry = await self._states.entry(sid)
        async with entry.lock:
            stored = None
            if delivery.stream_seq > entry.state.last_seq:
                stored = decode_stored(delivery.stream_seq, delivery.subject, delivery.data)
                self._states.fold(entry, stored.seq, stored.event)
            else:
                stored = decode_stored(delivery.stream_seq, delivery.subject, delivery.data)
            event = stored.event
            if isinstance(event, ModelRequested):
                await self._answer(entry, event, delivery)
            await self._settle(entry)
        await delivery.ack()

    async def _settle(self, entry: Entry) -> None:
        tools = self._tools()
        offer = self._offer(tools)

        def due(state: SessionState) -> list[Append]:
            return decide(state, offer, now=self._clock(), max_iterations=self._max_iterations,
                          max_tokens=self._max_tokens)

        if not await self._states.decide_and_write(entry, due, attempts=DECIDE_ATTEMPTS):
            log.warning("planner: session %s: gave up deciding after %d conflicts",
                        entry.state.session_id, DECIDE_ATTEMPTS)

    async def _answer(self, entry: Entry, asked: ModelRequested, delivery: Delivery) -> None:
        """Call the model for `asked`, unless it is answered (or its turn over) already,
        and store the answer (or end the turn with the model's error)."""
        await self._states.catch_up(entry)
        state = entry.state
        turn = state.turns.get(asked.turn_id)
        if turn is None or turn.status != "running" or len(turn.steps) >= asked.iteration:
            return
        sid = state.session_id
        tools = self._tools()
        messages = transcript(state, turn)
        base = len(turn.call_ids)
        keep_alive = asyncio.create_task(self._keep_alive(delivery))
        publish = self._delta_publisher(sid, asked)
        try:
            for attempt in range(1, _WHOLE_CALL_ATTEMPTS + 1):
                try:
                    reply = await complete(self._settings, system=self._instructions,
                                           messages=messages, tools=tools,
                                           on_delta=publish, client=self._http)
                    break
                except ModelError as exc:
                    if not exc.partial or attempt == _WHOLE_CALL_ATTEMPTS:
                        raise
                    # The stream broke after some text: the call is made again whole,
                    # and watchers are told to drop what they showed of this iteration.
                    log.warning("planner: session %s: %s; asking again", sid, exc)
                    await publish("", reset=True)
        except ModelError as exc:
            now = self._clock()
            failed = TurnFailed(session_id=sid, at=now, actor=ACTOR, turn_id=turn.turn_id,
                                request_id=turn.request_id, reason="model_error",
                                message=clip(str(exc)), outcomes=turn_outcomes(state, turn))
            await self._kernel.log.append(Append(failed, turn_ended_id(sid, turn.turn_id)))
            return
        finally:
            keep_alive.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keep_alive
        answer = ModelResponded(
            session_id=sid, at=self._clock(), actor=ACTOR, turn_id=turn.turn_id,
            iteration=asked.iteration, text=reply.text,
            tool_calls=[ModelToolCall(call_id=call_id_for(turn.turn_id, base + i), id=c.id,
                                      name=c.name, arguments=c.arguments, extra=c.extra)
                        for i, c in enumerate(reply.tool_calls)],
            finish_reason=reply.finish_reason, input_tokens=reply.usage.input_tokens,
            output_tokens=reply.usage.output_tokens, latency_ms=float(reply.latency_ms),
            response_id=reply.response_id)
        result = await self._kernel.log.append(
            Append(answer, model_responded_id(sid, turn.turn_id, asked.iteration)))
        await self._states.catch_up(entry)
        if not result.duplicate and result.seq > entry.state.last_seq:
            self._states.fold(entry, result.seq, answer)

    def _delta_publisher(self, sid: str, asked: ModelRequested) -> _Deltas:
        """Text deltas, live and not stored: `toolbus.live.<sid>.model.delta`; `reset`
        says to drop the text shown so far of this iteration (it is asked again)."""
        subject = f"{LIVE_PREFIX}.{sid}.model.delta"
        nc = self._bus.nc

        async def publish(text: str, *, reset: bool = False) -> None:
            body = _encode({"type": "model.delta", "turn_id": asked.turn_id,
                            "iteration": asked.iteration, "text": text,
                            **({"reset": True} if reset else {})})
            await nc.publish(subject, body)

        return publish

    async def _keep_alive(self, delivery: Delivery) -> None:
        while True:
            await asyncio.sleep(max(self._ack_wait_s / 3, 0.05))
            with contextlib.suppress(Exception):
                await delivery.in_progress()


__all__ = ["ACTOR", "Offer", "Planner", "decide", "transcript"]
