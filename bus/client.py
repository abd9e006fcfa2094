"""The client side: submit requests, inject tool events, wait for their turn to end, read
and query sessions."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec
import nats.errors
import nats.js.errors

from bus import trace
from bus.artifacts import ArtifactStore
from bus.connection import Bus
from bus.eventlog import EventLog, decode_stored
from bus.feed import SessionFeed
from bus.headers import Header
from bus.rpc import check_reply
from bus.subjects import (
    LIVE_PREFIX,
    event_filter,
    request_subject,
    state_subject,
)
from bus.tasks import apart
from schemas.errors import BusError, BusTimeoutError, ConnectionLostError, InvalidRequestError
from schemas.events import (
    CallOutcome,
    CallSucceeded,
    Event,
    RequestRejected,
    ResultRef,
    ToolEventInjected,
    TurnCancelled,
    TurnCompleted,
    TurnFailed,
    TurnRequested,
)
from schemas.ids import check_session_id, client_request_id, tool_event_id, turn_id_for
from schemas.requests import MAX_REQUEST_ID_CHARS, parse_request, parse_tool_event
from schemas.state import SessionState, TurnState, decode_state, fold

TurnEnd = TurnCompleted | TurnFailed | TurnCancelled | RequestRejected
# How an injected tool event was taken, with the stream sequence of that event.
InjectEnd = tuple[int, ToolEventInjected | RequestRejected]



@dataclass(frozen=True, slots=True)
class Submitted:
    request_id: str
    turn_id: str
    duplicate: bool


@dataclass(frozen=True, slots=True)
class InjectResult:
    """A stored `tool_event.injected`: `created` is false when the idempotency key had
    already been injected (these are then the first event's ids)."""

    session_id: str
    event_id: str
    seq: int
    turn_id: str | None  # the turn it started (`trigger_processing`)
    created: bool


def _turn_of(call_id: str) -> str:
    return call_id.rsplit("-", 1)[0]


# The live events a watcher needs, each its own subscription: the others (model round
# trips, a call's steps) are never sent to it. Results first: the server sends them in
# stream order, so a result comes before the end of its turn; one handled after that end
# anyway is read from the log at the sequence the end references.
_WATCHED = ("call.succeeded", "turn.>", "request.rejected", "tool_event.injected.>")


def _same_request(state: SessionState, turn: TurnState, body: bytes, request_id: str) -> None:
    """Refuse (`InvalidRequestError`) a request sent again under a request id its session
    stored for another request: its stored end is that other request's, not this one's."""
    try:
        sent = parse_request(body, max_bytes=len(body), max_calls=len(body))
    except InvalidRequestError:
        return  # refused as it was stored, if it was: the stored refusal says so
    if sent.message is not None or turn.message is not None:
        # A turn the model plans: the calls in it are the model's, joined to it as it made
        # them, not the request's.
        same = sent.message == turn.message and sent.history == turn.history
    else:
        # Explicit calls, in the order sent; one not stored yet (a crash between the turn
        # and its calls, restored by the session actor) is not told apart.
        stored = [state.calls.get(c) for c in turn.call_ids]
        same = len(stored) == len(sent.calls) and all(
            c is None or (c.tool, c.arguments) == (s.tool, s.arguments)
            for s, c in zip(sent.calls, stored, strict=True))
    # An agent named differently is another request; none named is the same (the
    # session gave the turn its default one).
    if same and (sent.agent is None or sent.agent == turn.agent):
        return
    raise InvalidRequestError(
        "invalid_request", f"request id {request_id} was used in session {state.session_id} "
        f"for another request (turn {turn.turn_id}): this one was not run; give a request "
        "id of its own")


class _Watcher:
    """The subscriptions of one session on the live events that end turns (and on the
    results of their calls, which the turn's end only references), routing them to the
    callers waiting on them."""

    def __init__(self, session_id: str) -> None:
        # Callers waiting for how a turn (or a request) ended, by turn id: one client may
        # have several for one turn (a cancel beside the call it stops, the same request
        # sent again), and each is answered.
        self.waiting: dict[str, list[asyncio.Future[TurnEnd]]] = {}
        # Callers waiting for a running turn's own end (`turn_end`): a turn's events only,
        # never a request's refusal (a resubmitted request id's `duplicate_request`).
        self.ends: dict[str, asyncio.Future[TurnEnd]] = {}
        self.results: dict[str, CallSucceeded] = {}
        # Callers waiting for a tool event to be stored, by its id (one key may be
        # injected by several at once).
        self.injected: dict[str, list[asyncio.Future[InjectEnd]]] = {}
        self.subs: list[Any] = []
        # Turns waited for whose `turn.requested` came: accepted, so a timeout is not the
        # server's absence.
        self.started: set[str] = set()
        self.ready = asyncio.Event()
        self._prefix = f"{LIVE_PREFIX}.{session_id}."

    async def on_msg(self, msg: Any) -> None:
        kind = msg.subject[len(self._prefix):]
        if kind == "call.succeeded":
            ev = decode_stored(0, msg.subject, msg.data).event
            if isinstance(ev, CallSucceeded) and _turn_of(ev.call_id) in self.waiting:
                self.results[ev.call_id] = ev
            return
        if kind.startswith("tool_event.injected") or (
                kind == "request.rejected" and self.injected):
            self._on_tool_event(msg)
        if not (kind.startswith("turn.") or kind == "request.rejected"):
            return
        ev = decode_stored(0, msg.subject, msg.data).event
        if isinstance(ev, TurnCompleted | TurnFailed | TurnCancelled):
            key = ev.turn_id
            end = self.ends.get(key)
            if end is not None and not end.done():
                end.set_result(ev)
        elif isinstance(ev, RequestRejected) and ev.request_id is not None:
            key = turn_id_for(ev.request_id)
        elif isinstance(ev, TurnRequested):
            if ev.turn_id in self.waiting:
                self.started.add(ev.turn_id)
            return
        else:
            return
        for fut in self.waiting.get(key, ()):
            if not fut.done():
                fut.set_result(ev)

    def wait_for(self, key: str, fut: asyncio.Future[TurnEnd]) -> None:
        self.waiting.setdefault(key, []).append(fut)

    def stop_waiting(self, key: str, fut: asyncio.Future[TurnEnd]) -> bool:
        """Forget `fut`; whether no one waits for `key` any more."""
        futures = self.waiting.get(key, [])
        if fut in futures:
            futures.remove(fut)
        if futures:
            return False
        self.waiting.pop(key, None)
        return True

    def _on_tool_event(self, msg: Any) -> None:
        ev = decode_stored(0, msg.subject, msg.data).event
        if isinstance(ev, ToolEventInjected):
            key: str | None = ev.event_id
        elif isinstance(ev, RequestRejected):
            key = ev.request_id
        else:
            return
        seq = (msg.headers or {}).get(Header.SEQUENCE.value, "")
        if not (isinstance(seq, str) and seq.isdigit()):
            return
        for fut in self.injected.get(key or "", ()):
            if not fut.done():
                fut.set_result((int(seq), ev))


# How long a request is published again while a cluster elects a stream leader.
_FAILOVER_S = 15.0
# "duplicate message id is in process": a copy sent earlier is still being stored.
_IN_PROCESS = 10158
# How often a caller waiting for a turn's end looks whether its connection broke.
_RECONNECT_CHECK_S = 0.5
# A caller waiting for a turn gives up this long after its connection went away for good.
GIVE_UP_AWAY_S = 30.0
# Direct gets of an event a turn's end references, while it is not found: on a cluster
# a replica still behind answers "no such message" for a moment (0.05 s, 0.1 s, ...).
_BEHIND_ATTEMPTS = 8


class ToolbusClient:
    def __init__(self, bus: Bus, *, max_watched_sessions: int = 1024) -> None:
        self.bus = bus
        self.log = EventLog(bus)
        self._watchers: dict[str, _Watcher] = {}
        self._max_watched = max_watched_sessions

    async def _watch(self, session_id: str) -> _Watcher:
        w = self._watchers.get(session_id)
        if w is not None:
            await w.ready.wait()  # a concurrent first call is subscribing
            if self._watchers.get(session_id) is w:
                return w
            return await self._watch(session_id)  # that subscribe failed: try ourselves
        w = _Watcher(session_id)
        # Registered before the await, so concurrent first calls share one subscription.
        self._watchers[session_id] = w
        try:
            for kind in _WATCHED:
                w.subs.append(await self.bus.nc.subscribe(
                    f"{LIVE_PREFIX}.{session_id}.{kind}", cb=w.on_msg))
        except BaseException:
            del self._watchers[session_id]
            for s in w.subs:
                with contextlib.suppress(Exception):
                    await s.unsubscribe()
            raise
        finally:
            w.ready.set()
        if len(self._watchers) > self._max_watched:
            # The oldest idle one, found without copying the table (a new session each
            # call would copy all of it each time).
            idle = next((sid for sid, old in self._watchers.items()
                         if not old.waiting and not old.injected), None)
            if idle is not None:
                for s in self._watchers.pop(idle).subs:
                    with contextlib.suppress(Exception):
                        await s.unsubscribe()
        return w

    @contextlib.asynccontextmanager
    async def turn_end(self, session_id: str, turn_id: str
                       ) -> AsyncIterator[asyncio.Future[TurnEnd]]:
        """A future set with the end of a running turn (its `turn.completed`,
        `turn.failed` or `turn.cancelled`, nothing else) while inside: watched live, and
        looked up in the log on entry and again after each reconnect (an end republished
        while the connection was away never arrives). One waiter per turn in a client."""
        watcher = await self._watch(session_id)
        if turn_id in watcher.ends:
            raise ValueError(f"turn {turn_id} of {session_id} is waited for already")
        fut: asyncio.Future[TurnEnd] = asyncio.get_running_loop().create_future()
        watcher.ends[turn_id] = fut

        async def look() -> None:
            for stored in await self.log.read_session(
                    session_id, subject_filter=event_filter(session_id, "turn.>")):
                ev = stored.event
                if isinstance(ev, TurnCompleted | TurnFailed | TurnCancelled) and \
                        ev.turn_id == turn_id and not fut.done():
                    fut.set_result(ev)

        async def after_reconnects() -> None:
            nc = self.bus.nc
            seen = nc.stats["reconnects"]
            while not fut.done():
                await asyncio.sleep(_RECONNECT_CHECK_S)
                if nc.stats["reconnects"] != seen and nc.is_connected:
                    seen = nc.stats["reconnects"]
                    with contextlib.suppress(BusError):  # looked up at the next one
                        await look()

        watchdog = asyncio.create_task(after_reconnects())
        try:
            await look()
            yield fut
        finally:
            watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watchdog
            if watcher.ends.get(turn_id) is fut:
                del watcher.ends[turn_id]

    async def cancel(self, session_id: str, turn_id: str, *, reason: str | None = None,
                     timeout: float = 30.0) -> TurnEnd:
        """Stop a running turn and wait (bounded) for how it ended: its `turn.cancelled`,
        its own end if it ended first, or the `request.rejected` saying there was nothing
        to cancel (an unknown turn, one already ended)."""
        check_session_id(session_id)
        request_id = f"cancel-{uuid.uuid4().hex}"
        body: dict[str, Any] = {"request_id": request_id, "cancel": turn_id}
        if reason is not None:
            body["reason"] = reason
        watcher = await self._watch(session_id)
        loop = asyncio.get_running_loop()
        keys = (turn_id, turn_id_for(request_id))
        futures: dict[str, asyncio.Future[TurnEnd]] = {key: loop.create_future()
                                                       for key in keys}
        for key, fut in futures.items():
            watcher.wait_for(key, fut)
        try:
            async with asyncio.timeout(timeout):
                await self.submit(session_id, msgspec.json.encode(body), request_id=request_id)
                while True:
                    done, _ = await asyncio.wait(futures.values(),
                                                 return_when=asyncio.FIRST_COMPLETED)
                    for key, fut in list(futures.items()):
                        if fut not in done:
                            continue
                        ev = fut.result()
                        if not (isinstance(ev, RequestRejected) and
                                ev.request_id != request_id):
                            return ev
                        # The turn's own request sent again, refused as a duplicate: not
                        # how the turn ended.
                        watcher.stop_waiting(key, fut)
                        futures[key] = loop.create_future()
                        watcher.wait_for(key, futures[key])
        except TimeoutError as exc:
            raise BusTimeoutError(
                f"turn {turn_id} of session {session_id} did not end within {timeout:g} s "
                "of the request to cancel it: is the session actor running?") from exc
        finally:
            for key, fut in futures.items():
                watcher.stop_waiting(key, fut)

    async def check_resent(self, session_id: str, body: bytes, request_id: str) -> bool:
        """For a request sent before (the requests stream took it as a duplicate, or the
        session actor stored `duplicate_request`): `InvalidRequestError` if the turn stored
        under its request id is another request's (the end it would be answered with is
        not its own). Whether that turn is stored."""
        state = await self.fold_session(session_id)
        turn = state.turns.get(turn_id_for(request_id))
        if turn is not None:
            _same_request(state, turn, body, request_id)
        return turn is not None

    async def ask(self, session_id: str, message: str, *, request_id: str | None = None,
                  agent: str | None = None, timeout: float = 120.0) -> TurnEnd:
        """Send the agent a message and wait (bounded) for the end of its turn: the
        planner's answer is `TurnCompleted.text`."""
        return await self.call(session_id, [], request_id=request_id, agent=agent,
                               timeout=timeout, message=message)

    async def call(
        self,
        session_id: str,
        calls: list[dict[str, Any]],
        *,
        request_id: str | None = None,
        agent: str | None = None,
        timeout: float = 60.0,
        full: bool = False,
        message: str | None = None,
    ) -> TurnEnd:
        """Submit one request and wait (bounded) for how its turn ended.

        The outcomes of the turn's end carry their results (`result`, or `result_ref`
        for one too large for an event); with `full`, referenced results are fetched
        from the object store too (`result` then holds them)."""
        check_session_id(session_id)
        request_id = request_id or uuid.uuid4().hex
        if len(request_id) > MAX_REQUEST_ID_CHARS:
            # The session actor would refuse it without naming it, so nothing would ever
            # answer this request: refused here, before anything is published.
            raise InvalidRequestError(
                "invalid_request", f"request_id is longer than {MAX_REQUEST_ID_CHARS} "
                f"characters ({len(request_id)})")
        request: dict[str, Any] = {"request_id": request_id}
        if message is not None:
            request["message"] = message
        else:
            request["calls"] = calls
        if agent is not None:
            request["agent"] = agent
        try:
            body = msgspec.json.encode(request)
            turn_id = turn_id_for(request_id)
        except UnicodeEncodeError:  # text read as bytes that are not UTF-8 (surrogates)
            raise InvalidRequestError(
                "invalid_request", "the request holds text that is not valid UTF-8 (bytes "
                "that could not be decoded): send it as UTF-8") from None
        # Watch before publishing, so the end of the turn cannot slip past us.
        watcher = await self._watch(session_id)
        fut: asyncio.Future[TurnEnd] = asyncio.get_running_loop().create_future()
        watcher.wait_for(turn_id, fut)
        try:
            async with asyncio.timeout(timeout):
                sub = await self.submit(session_id, body, request_id=request_id)
                if sub.duplicate:
                    # Sent before: how it ended, or how it was refused, is stored already.
                    if await self.check_resent(session_id, body, request_id):
                        found = await self.find_end(session_id, turn_id, full=full)
                        if found is not None:
                            return found
                        watcher.started.add(turn_id)  # accepted, and still running
                    else:
                        refused = await self._stored_refusal(session_id, request_id)
                        if refused is not None and isinstance(refused[1], RequestRejected):
                            return refused[1]
                while True:
                    ev = await self._live_end(fut)
                    if ev is not None and not (isinstance(ev, RequestRejected)
                                               and ev.reason == "duplicate_request"):
                        return await self._with_results(ev, watcher.results, full=full)
                    if ev is not None:  # sent before, without the same message id
                        await self.check_resent(session_id, body, request_id)
                    found = await self.find_end(session_id, turn_id, full=full)
                    if found is not None:
                        return found
                    watcher.stop_waiting(turn_id, fut)
                    fut = asyncio.get_running_loop().create_future()
                    watcher.wait_for(turn_id, fut)
        except BusTimeoutError:
            raise  # said what timed out (the requests stream's acknowledgement, a read)
        except TimeoutError as exc:
            if turn_id in watcher.started:
                raise BusTimeoutError(
                    f"turn {turn_id} of session {session_id} was accepted but had not ended "
                    f"after {timeout:g} s (a slow model or tool, or a call waiting for a "
                    f"human: `toolbus approvals`); it goes on: follow it with `toolbus "
                    f"replay {session_id}`, or wait longer with a larger --timeout"
                ) from exc
            raise BusTimeoutError(
                f"no result for request {request_id} in session {session_id} within "
                f"{timeout:g} s: is `toolbus up` (or session, approval and executor actors) "
                "running? A call waiting for a human shows in `toolbus approvals`"
            ) from exc
        finally:
            if watcher.stop_waiting(turn_id, fut):  # the turn's last waiter here
                watcher.started.discard(turn_id)
                for call_id in [c for c in watcher.results if _turn_of(c) == turn_id]:
                    del watcher.results[call_id]

    async def _live_end(self, fut: asyncio.Future[TurnEnd]) -> TurnEnd | None:
        """The end `fut` is given from the live subject, or None once the connection came
        back after a break: what the server republished meanwhile never reaches us (the
        turn may have ended then), so the log is to be read."""
        nc = self.bus.nc
        reconnects = nc.stats["reconnects"]
        loop = asyncio.get_running_loop()
        away_since: float | None = None
        while True:
            done, _ = await asyncio.wait({fut}, timeout=_RECONNECT_CHECK_S)
            if done:
                return fut.result()
            if nc.stats["reconnects"] != reconnects and nc.is_connected:
                return None
            if nc.is_connected:
                away_since = None
            elif away_since is None:
                away_since = loop.time()
            elif loop.time() - away_since >= GIVE_UP_AWAY_S:
                # Not the whole --timeout (minutes) in silence: the turn goes on without us
                # if the server comes back, and its log says how it ended.
                raise ConnectionLostError(
                    f"lost the connection to NATS at {self.bus.url} "
                    f"{GIVE_UP_AWAY_S:g} s ago and could not reconnect; the turn goes on "
                    "once the server is back: `toolbus replay` of the session tells how "
                    "it ended")

    def follow(self, session_id: str, *, after: int = 0, turn_id: str | None = None
               ) -> SessionFeed:
        """A session's events after stream sequence `after`, then each one as it is
        stored, with the model's text deltas; with `turn_id`, that turn's only, ending
        with its end (bus/feed.py):

            async with client.follow(sid, turn_id=end.turn_id) as feed:
                async for item in feed.items():  # None: nothing came for a while
                    ...
        """
        return SessionFeed(self.bus, check_session_id(session_id), after=after,
                           turn_id=turn_id)

    @property
    def watched_sessions(self) -> list[str]:
        return list(self._watchers)

    async def close(self) -> None:
        for w in self._watchers.values():
            for s in w.subs:
                with contextlib.suppress(Exception):
                    await s.unsubscribe()
        self._watchers.clear()

    async def submit(self, session_id: str, body: bytes, *, request_id: str) -> Submitted:
        headers = {Header.MSG_ID.value: client_request_id(session_id, request_id),
                   **trace.headers_for_child(None)}
        # On a cluster, the requests stream answers nothing while it elects a new leader
        # (a node died): publish again, with the same message id, so the stream keeps one.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (_FAILOVER_S if self.bus.nc._server_info.get("cluster")
                                  else 0.0)
        while True:
            try:
                ack = await apart(self.bus.js.publish(request_subject(session_id), body,
                                                      timeout=5.0, headers=headers))
                break
            except nats.js.errors.APIError as exc:
                # The same request sent again while the stream is still storing the first
                # (a leader change): asked again, to learn how that one ended.
                if exc.err_code == _IN_PROCESS and loop.time() < deadline:
                    await asyncio.sleep(0.25)
                    continue
                raise BusError(f"the requests stream on {self.bus.url} refused the "
                               f"request: {exc.description} (code {exc.err_code})") from exc
            except (nats.errors.NoRespondersError, nats.js.errors.NoStreamResponseError,
                    nats.errors.TimeoutError) as exc:
                if loop.time() < deadline:
                    await asyncio.sleep(0.25)
                    continue
                if isinstance(exc, nats.errors.TimeoutError):
                    raise BusTimeoutError(f"the requests stream on {self.bus.url} did not "
                                          "acknowledge the request within 5 s") from exc
                raise BusError(f"no request stream on {self.bus.url}: start toolbus there "
                               "with `toolbus up`") from exc
        return Submitted(request_id, turn_id_for(request_id), bool(ack.duplicate))

    async def inject(
        self,
        session_id: str,
        tool_id: str,
        result: Any,
        *,
        arguments: dict[str, Any] | None = None,
        idempotency_key: str,
        trigger_processing: bool = False,
        timeout: float = 30.0,
    ) -> InjectResult:
        """Hand the agent data as if the tool `tool_id` (a `namespace:name` label) had
        returned `result` (seed 000), and wait (bounded) until it is stored.

        The same `idempotency_key` again stores nothing and returns the first event's ids
        (`created` false). The body is checked here first (`InvalidRequestError`, exactly
        as the session actor would reject it), so a bad one is never published; a tool
        event the session actor refuses (say `trigger_processing` with no planner) is an
        `InvalidRequestError` naming its reason."""
        check_session_id(session_id)
        body: dict[str, Any] = {"tool_id": tool_id,
                                "arguments": {} if arguments is None else arguments,
                                "result": result, "idempotency_key": idempotency_key,
                                "trigger_processing": trigger_processing}
        try:
            data = msgspec.json.encode(body)
        except (TypeError, ValueError) as exc:
            raise InvalidRequestError("invalid_request", f"the tool event is not JSON: {exc}"
                                      ) from exc
        # The event id comes from the key as the actor sees it: control characters removed.
        event_id = tool_event_id(session_id, parse_tool_event(data).idempotency_key)
        # Watch before looking and before publishing, so the stored event (or a rejection)
        # cannot slip between the read and the wait.
        watcher = await self._watch(session_id)
        fut: asyncio.Future[InjectEnd] = asyncio.get_running_loop().create_future()
        watcher.injected.setdefault(event_id, []).append(fut)
        try:
            async with asyncio.timeout(timeout):
                found = await self._stored_tool_event(session_id, event_id)
                if found is not None:
                    return found
                duplicate = await self._publish_tool_event(session_id, event_id, data)
                if duplicate:
                    # Taken already, inside the duplicate window: this copy is dropped, so
                    # if the first was refused, that refusal is the answer.
                    refused = await self._stored_refusal(session_id, event_id)
                    if refused is not None and not fut.done():
                        fut.set_result(refused)
                seq, ev = await fut
        except TimeoutError as exc:
            raise BusTimeoutError(
                f"tool event {event_id} (key {idempotency_key[:40]!r}) in session "
                f"{session_id} was not stored within {timeout:g} s: is `toolbus up` (or a "
                "session actor) running? Retrying with the same key is safe") from exc
        finally:
            waiting = watcher.injected.get(event_id, [])
            if fut in waiting:
                waiting.remove(fut)
            if not waiting:
                watcher.injected.pop(event_id, None)
        if isinstance(ev, RequestRejected):
            # A copy the stream dropped gets its first's refusal, even if this body differs.
            again = (" (a tool event with this idempotency_key was refused minutes ago: "
                     "retry with a new key)") if duplicate else ""
            raise InvalidRequestError(ev.reason, f"the session actor refused tool event "
                                                 f"{event_id}{again}: {ev.message}")
        return InjectResult(session_id, event_id, seq, ev.turn_id, created=not duplicate)

    async def _stored_tool_event(self, session_id: str, event_id: str
                                 ) -> InjectResult | None:
        # Each on its own subject (`...tool_event.injected.<event id>`): one read.
        stored = await self.log.read_session(session_id, subject_filter=event_filter(
            session_id, "tool_event.injected", event_id))
        for s in stored:
            if isinstance(s.event, ToolEventInjected) and s.event.event_id == event_id:
                return InjectResult(session_id, event_id, s.seq, s.event.turn_id,
                                    created=False)
        return None

    async def _stored_refusal(self, session_id: str, event_id: str) -> InjectEnd | None:
        stored = await self.log.read_session(
            session_id, subject_filter=event_filter(session_id, "request.rejected"))
        for s in reversed(stored):
            if isinstance(s.event, RequestRejected) and s.event.request_id == event_id:
                return s.seq, s.event
        return None

    async def _publish_tool_event(self, session_id: str, event_id: str, data: bytes) -> bool:
        """Publish to the requests stream; true if the stream already had it."""
        try:
            ack = await apart(self.bus.js.publish(
                request_subject(session_id), data, timeout=5.0,
                headers={Header.MSG_ID.value: client_request_id(session_id, event_id),
                         **trace.headers_for_child(None)},
            ))
        except nats.errors.NoRespondersError as exc:
            raise BusError(
                f"no request stream on {self.bus.url}: start toolbus there with `toolbus up`"
            ) from exc
        return bool(ack.duplicate)

    async def _with_results(self, end: TurnEnd, seen: dict[str, CallSucceeded], *,
                            full: bool) -> TurnEnd:
        """The turn's end with each succeeded outcome's result filled in: from the live
        events already seen, else read at the sequence the outcome references."""
        if isinstance(end, RequestRejected) or not end.outcomes:
            return end
        outcomes: list[CallOutcome] = []
        for o in end.outcomes:
            if o.status != "succeeded" or o.result is not None:
                outcomes.append(o)
                continue
            ev: Event | None = seen.get(o.call_id)
            if ev is None and o.result_seq is not None:
                ev = await self._stored_at(o.result_seq)
            if isinstance(ev, CallSucceeded) and ev.call_id == o.call_id and \
                    ev.session_id == end.session_id:
                o = msgspec.structs.replace(o, result=ev.result, result_ref=ev.result_ref)
            if full and o.result_ref is not None and o.result is None:
                o = msgspec.structs.replace(o, result=await self._fetch(o.result_ref))
            outcomes.append(o)
        return msgspec.structs.replace(end, outcomes=outcomes)

    async def _stored_at(self, seq: int) -> Event | None:
        """The event at `seq`, which a stored turn's end references: a direct get that
        a replica still behind serves finds nothing yet (a cluster), so it is asked
        again for a while, instead of the outcome's result being left empty."""
        for attempt in range(_BEHIND_ATTEMPTS):
            stored = await self.log.read_at(seq)
            if stored is not None:
                return stored.event
            if attempt < _BEHIND_ATTEMPTS - 1:
                await asyncio.sleep(0.05 * (attempt + 1))
        return None

    async def fold_session(self, session_id: str, *, until: int | None = None
                           ) -> SessionState:
        """The session's state, folded here from its log with the actors' reducer."""
        stored = await self.log.read_session(session_id, until=until)
        return fold(session_id, ((s.seq, s.event) for s in stored))

    async def resolve_references(self, state: SessionState) -> int:
        """Put each result stored as a reference into `state` (read from the object
        store); returns how many there were."""
        refs = [c for c in state.calls.values() if c.result_ref is not None]
        for call in refs:
            assert call.result_ref is not None
            call.result = await self._fetch(call.result_ref)
        return len(refs)

    async def _fetch(self, ref: ResultRef) -> Any:
        """A result stored as a reference, read back (size and sha256 checked)."""
        return msgspec.json.decode(await ArtifactStore(self.bus).read(ref))

    async def find_end(self, session_id: str, turn_id: str, *,
                       full: bool = False) -> TurnEnd | None:
        """How a turn ended, if it did: located through the session's folded state."""
        turn = (await self.fold_session(session_id)).turns.get(turn_id)
        if turn is None or turn.ended_seq is None:
            return None
        stored = await self.log.read_at(turn.ended_seq)
        ev = stored.event if stored is not None else None
        if not isinstance(ev, TurnCompleted | TurnFailed | TurnCancelled) or \
                ev.turn_id != turn_id or \
                ev.session_id != session_id:
            return None
        return await self._with_results(ev, {}, full=full)

    async def live_state_digest(self, session_id: str, timeout: float = 5.0
                                ) -> tuple[str, int]:
        """(sha256 of the encoded live state, its last sequence): to compare a state too
        large for one reply with a replay."""
        check_session_id(session_id)
        data = await self.bus.request(state_subject(session_id), b"digest", timeout=timeout,
                                      who="a session actor (`toolbus up`)")
        answer = msgspec.json.decode(check_reply(data))
        return str(answer["sha256"]), int(answer["last_seq"])

    async def live_state(self, session_id: str, timeout: float = 5.0) -> SessionState:
        """The session actor's in-memory state of a session."""
        check_session_id(session_id)
        try:
            msg = await apart(self.bus.nc.request(state_subject(session_id), b"",
                                                  timeout=timeout))
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError) as exc:
            raise BusTimeoutError(
                f"no session actor answered for {session_id}: is `toolbus up` running?"
            ) from exc
        return decode_state(check_reply(msg.data))
