"""The client side: submit requests, wait for their turn to end, read and query sessions."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec
import nats.errors

from bus.connection import Bus
from bus.eventlog import EventLog, decode_stored
from bus.headers import Header
from bus.subjects import LIVE_PREFIX, request_subject, state_subject
from schemas.errors import BusError, BusTimeoutError
from schemas.events import RequestRejected, TurnCompleted, TurnFailed
from schemas.ids import check_session_id, turn_id_for
from schemas.state import SessionState, decode_state

TurnEnd = TurnCompleted | TurnFailed | RequestRejected


@dataclass(frozen=True, slots=True)
class Submitted:
    request_id: str
    turn_id: str
    duplicate: bool


class _Watcher:
    """One subscription per session, routing turn ends to the callers waiting on them."""

    def __init__(self) -> None:
        self.waiting: dict[str, asyncio.Future[TurnEnd]] = {}
        self.subs: list[Any] = []

    async def on_msg(self, msg: Any) -> None:
        ev = decode_stored(0, msg.subject, msg.data).event
        if isinstance(ev, TurnCompleted | TurnFailed):
            key = ev.turn_id
        elif isinstance(ev, RequestRejected) and ev.request_id is not None:
            key = turn_id_for(ev.request_id)
        else:
            return
        fut = self.waiting.get(key)
        if fut is not None and not fut.done():
            fut.set_result(ev)


class ToolbusClient:
    def __init__(self, bus: Bus, *, max_watched_sessions: int = 1024) -> None:
        self.bus = bus
        self.log = EventLog(bus)
        self._watchers: dict[str, _Watcher] = {}
        self._max_watched = max_watched_sessions

    async def _watch(self, session_id: str) -> _Watcher:
        w = self._watchers.get(session_id)
        if w is not None:
            return w
        w = _Watcher()
        nc = self.bus.nc
        w.subs = [
            await nc.subscribe(f"{LIVE_PREFIX}.{session_id}.turn.*", cb=w.on_msg),
            await nc.subscribe(f"{LIVE_PREFIX}.{session_id}.request.rejected", cb=w.on_msg),
        ]
        self._watchers[session_id] = w
        if len(self._watchers) > self._max_watched:
            for sid, old in list(self._watchers.items()):
                if not old.waiting:
                    del self._watchers[sid]
                    for s in old.subs:
                        with contextlib.suppress(Exception):
                            await s.unsubscribe()
                    break
        return w

    async def call(
        self,
        session_id: str,
        calls: list[dict[str, Any]],
        *,
        request_id: str | None = None,
        agent: str | None = None,
        timeout: float = 60.0,
    ) -> TurnEnd:
        """Submit one request and wait (bounded) for how its turn ended."""
        check_session_id(session_id)
        request_id = request_id or uuid.uuid4().hex
        turn_id = turn_id_for(request_id)
        # Watch before publishing, so the end of the turn cannot slip past us.
        watcher = await self._watch(session_id)
        fut: asyncio.Future[TurnEnd] = asyncio.get_running_loop().create_future()
        watcher.waiting[turn_id] = fut
        try:
            async with asyncio.timeout(timeout):
                request: dict[str, Any] = {"request_id": request_id, "calls": calls}
                if agent is not None:
                    request["agent"] = agent
                body = msgspec.json.encode(request)
                sub = await self.submit(session_id, body, request_id=request_id)
                if sub.duplicate:
                    found = await self._find_end(session_id, turn_id)
                    if found is not None:
                        return found
                while True:
                    ev = await fut
                    if not (isinstance(ev, RequestRejected) and ev.reason == "duplicate_request"):
                        return ev
                    found = await self._find_end(session_id, turn_id)
                    if found is not None:
                        return found
                    fut = asyncio.get_running_loop().create_future()
                    watcher.waiting[turn_id] = fut
        except TimeoutError as exc:
            raise BusTimeoutError(
                f"no result for request {request_id} in session {session_id} within "
                f"{timeout:g} s: is `toolbus up` (or session, approval and executor actors) "
                "running? A call waiting for a human shows in `toolbus approvals`"
            ) from exc
        finally:
            watcher.waiting.pop(turn_id, None)

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
        try:
            ack = await self.bus.js.publish(
                request_subject(session_id), body, timeout=5.0,
                headers={Header.MSG_ID.value: f"{session_id}:{request_id}"},
            )
        except nats.errors.NoRespondersError as exc:
            raise BusError(
                f"no request stream on {self.bus.url}: start toolbus there with `toolbus up`"
            ) from exc
        return Submitted(request_id, turn_id_for(request_id), bool(ack.duplicate))

    async def _find_end(self, session_id: str, turn_id: str) -> TurnEnd | None:
        for stored in await self.log.read_session(session_id):
            ev = stored.event
            if isinstance(ev, TurnCompleted | TurnFailed) and ev.turn_id == turn_id:
                return ev
        return None

    async def live_state(self, session_id: str, timeout: float = 5.0) -> SessionState:
        """The session actor's in-memory state of a session."""
        check_session_id(session_id)
        try:
            msg = await self.bus.nc.request(state_subject(session_id), b"", timeout=timeout)
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError) as exc:
            raise BusTimeoutError(
                f"no session actor answered for {session_id}: is `toolbus up` running?"
            ) from exc
        if msg.data.startswith(b'{"error"'):
            raise BusError(msgspec.json.decode(msg.data)["error"])
        return decode_state(msg.data)
