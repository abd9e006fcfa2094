"""A session's events as server-sent events, for the HTTP gateway.

A stream is the session's stored events after a sequence (a reconnecting client's
`Last-Event-ID`), then each one as it is stored, with the model's text deltas
(`model.delta`, live only, never stored). Each stored event is one SSE event: `id` its
stream sequence, `event` its type, `data` its JSON as stored. Narrowed to one turn, it
holds that turn's events only and ends with its end.

Stored events are always read from the log, in order, after the last one sent; their
live copies only say how far to read before the deltas that came after them. So nothing
is skipped or sent twice, whatever NATS drops on the way, events and deltas go out in the
order they were published, and a slow reader holds no queue of events (only of deltas,
bounded). A stream quiet for `KEEPALIVE_S` sends an SSE comment, which also tells proxies
that the connection is alive, and reads the log again.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections import deque
from collections.abc import AsyncIterator
from typing import Any, Final

import anyio
import msgspec

from bus.connection import Bus
from bus.direct import direct_batch
from bus.headers import Header
from bus.subjects import EVENTS_STREAM, LIVE_PREFIX, session_filter
from schemas.errors import BusTimeoutError
from schemas.ids import turn_id_for

# Text deltas kept for a slow reader, per stream; more are dropped (they are live only).
MAX_DELTAS: Final = 1024
# A quiet stream says it is alive (and reads the log for what it was not woken for).
KEEPALIVE_S: Final = 15.0
# Stored events read per direct get, and how long one may take.
_PAGE: Final = 256
_READ_TIMEOUT_S: Final = 10.0
_TURN_ENDS: Final = frozenset({"turn.completed", "turn.failed", "turn.cancelled"})
_LINES = re.compile(rb"\r\n|\r|\n")


class _Ids(msgspec.Struct):
    """What a stream reads of each event: its type and whose it is."""

    type: str = ""
    turn_id: str | None = None
    call_id: str | None = None
    request_id: str | None = None


_ids = msgspec.json.Decoder(_Ids)


def _turn_of(ids: _Ids) -> str | None:
    if ids.turn_id is not None:
        return ids.turn_id
    if ids.call_id is not None:
        return ids.call_id.rsplit("-", 1)[0]  # call ids are `<turn_id>-<index>`
    if ids.request_id is not None:  # request.rejected
        return turn_id_for(ids.request_id)
    return None


def frame(event: str, data: bytes, seq: int | None = None) -> bytes:
    """One SSE event. `data` is JSON, one line as toolbus encodes it; a line break in it
    anyway becomes a `data:` line of its own, which readers join back with newlines."""
    head = f"id: {seq}\n" if seq is not None else ""
    body = b"".join(b"data: " + line + b"\n" for line in _LINES.split(data))
    return f"{head}event: {event}\n".encode() + body + b"\n"


class SessionStream:
    """The SSE events of one session: `open()` (subscribes), then iterate `frames()`;
    `close()` in any case."""

    def __init__(self, bus: Bus, session_id: str, *, after: int = 0,
                 turn_id: str | None = None, max_deltas: int = MAX_DELTAS,
                 keepalive_s: float | None = None) -> None:
        """`after`: the stream sequence the stream starts after (the session's stored
        events after it come first). `turn_id`: only that turn's events, and the stream
        ends with its end."""
        self._bus = bus
        self._sid = session_id
        self._last = after
        self._turn = turn_id
        self._keepalive_s = KEEPALIVE_S if keepalive_s is None else keepalive_s
        self._wake = asyncio.Event()
        # What came live, in order: a stored event's sequence (the log is read up to it)
        # or a delta's JSON. Bounded: adjacent sequences merge, deltas stop at the bound.
        self._queue: deque[int | bytes] = deque()
        self._deltas = 0
        self._max_deltas = max_deltas
        self._sub: Any = None
        self._ending = False
        self.ended = False  # the turn streamed has ended

    async def open(self) -> None:
        """Subscribe to the live events, and make sure the server has the subscription:
        anything stored after this returns wakes the stream."""
        self._sub = await self._bus.nc.subscribe(f"{LIVE_PREFIX}.{self._sid}.>",
                                                 cb=self._on_live)
        await self._bus.nc.flush(timeout=5)

    @property
    def last(self) -> int:
        """The stream sequence of the last event read (sent, or not this stream's)."""
        return self._last

    def end(self) -> None:
        """End the stream at its next step, with an `error` event saying that the gateway
        is stopping (reconnect later with Last-Event-ID)."""
        self._ending = True
        self._wake.set()

    def restart(self, after: int) -> None:
        """Start after `after` instead (before iterating `frames()`)."""
        self._last = after

    async def close(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            # Closed when the reader went away, inside a cancelled scope: shielded, or the
            # unsubscribe would be cancelled too and the subscription left behind.
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _on_live(self, msg: Any) -> None:
        seq_text = (msg.headers or {}).get(Header.SEQUENCE.value)
        if isinstance(seq_text, str) and seq_text.isdigit():
            # A stored event is read from the log, in order: its live copy only marks how
            # far the log is to be read before what came after it (one NATS dropped is
            # read all the same, at the next mark or tick).
            seq = int(seq_text)
            if self._queue and isinstance(self._queue[-1], int):
                self._queue[-1] = max(self._queue[-1], seq)
            else:
                self._queue.append(seq)
        elif self._deltas < self._max_deltas:
            # Live only (a text delta), kept up to a bound: its whole text is stored in
            # `model.responded` anyway.
            self._deltas += 1
            self._queue.append(msg.data)
        self._wake.set()

    async def frames(self) -> AsyncIterator[bytes]:
        """The stream's SSE bytes, until the turn streamed ends (if one is) or the reader
        goes away (the caller cancels). Stored events and deltas go out in the order they
        were published."""
        async for out in self._from_log(None):
            yield out
            if self.ended:
                return
        while True:
            while self._queue and not self._ending:
                item = self._queue.popleft()
                if isinstance(item, int):
                    async for out in self._from_log(item):
                        yield out
                        if self.ended:
                            return
                    continue
                self._deltas -= 1
                delta = self._frame(item, None)
                if delta is not None:
                    yield delta
            if self._ending:
                yield frame("error", msgspec.json.encode({
                    "code": "stopping", "error": "the gateway is stopping: reconnect "
                    f"later with Last-Event-ID {self._last}"}))
                return
            self._wake.clear()  # nothing can arrive between the loop above and this
            try:
                async with asyncio.timeout(self._keepalive_s):
                    await self._wake.wait()
            except TimeoutError:
                yield b": keep-alive\n\n"
                async for out in self._from_log(None):
                    yield out
                    if self.ended:
                        return

    async def _from_log(self, until: int | None) -> AsyncIterator[bytes]:
        """The stored events after the last one sent, up to `until` (None: all there are),
        read from the log by direct gets."""
        while until is None or self._last < until:
            try:
                async with asyncio.timeout(_READ_TIMEOUT_S):
                    batch, pending = await direct_batch(
                        self._bus, EVENTS_STREAM, session_filter(self._sid),
                        self._last + 1, _PAGE)
            except TimeoutError:
                raise BusTimeoutError(f"reading the events of session {self._sid}: no "
                                      f"answer in {_READ_TIMEOUT_S:g} s") from None
            for seq, _, data in batch:
                if until is not None and seq > until:
                    return
                if seq <= self._last:
                    continue
                out = self._frame(data, seq)
                if out is not None:
                    yield out
                    if self.ended:
                        return
            if not batch or pending == 0:
                return

    def _frame(self, data: bytes, seq: int | None) -> bytes | None:
        """The SSE event for one event (None: not this stream's), noting how far the
        stream got and whether the turn it streams ended."""
        if seq is not None:
            self._last = seq
        try:
            ids = _ids.decode(data)
        except msgspec.DecodeError:
            return None  # not an event: nothing toolbus wrote
        if not ids.type:
            return None
        if self._turn is not None:
            if _turn_of(ids) != self._turn:
                return None
            if ids.type in _TURN_ENDS or ids.type == "request.rejected":
                self.ended = True
        return frame(ids.type, data, seq)


__all__ = ["KEEPALIVE_S", "MAX_DELTAS", "SessionStream", "frame"]
