"""Following a session: its stored events after a sequence, then each one as it is
stored, with the model's text deltas (`model.delta`, live only, never stored); or one
turn's, ending with its end. What the HTTP gateway's event streams, `toolbus replay
--follow` and `ToolbusClient.follow` read.

Stored events are always read from the log, in order, after the last one read; their
live copies (`toolbus.live.<sid>.>`) only say how far to read before the deltas that came
after them. So nothing is skipped or given twice, whatever NATS drops on the way, events
and deltas come in the order they were published, and a slow reader holds no queue of
events (only of deltas, bounded). A feed that gives nothing for `QUIET_S` reads the log
again, and says so (a reader may tell its own reader that it is alive).
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Final

import anyio
import msgspec

from bus.connection import Bus
from bus.direct import direct_batch
from bus.headers import Header
from bus.subjects import EVENTS_STREAM, LIVE_PREFIX, session_filter
from bus.tasks import apart
from schemas.errors import BusTimeoutError
from schemas.ids import turn_id_for

# Text deltas kept for a slow reader, per feed; more are dropped (they are live only).
MAX_DELTAS: Final = 1024
# A feed that gives nothing this long reads the log again (for a live copy NATS dropped).
QUIET_S: Final = 15.0
# The largest stream sequence a feed starts after: NATS's are 64-bit, and it answers a
# read from 2**64 on with nothing at all.
MAX_SEQ: Final = 2**63 - 1
# Stored events read per direct get (and about how many bytes of them, at least one
# event), and how long one may take. A feed holds a page while its reader is slow.
_PAGE: Final = 256
_PAGE_BYTES: Final = 1024 * 1024
_READ_TIMEOUT_S: Final = 10.0
# Pages read at once by the feeds of one process (its event loop). They come on one
# connection (the gateway's, for all its streams), and NATS cuts off a connection with
# more than 64 MB waiting to be sent to it as a slow consumer: every feed on it ends.
READS_AT_ONCE: Final = 8
_READING: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = \
    weakref.WeakKeyDictionary()
# How long a feed waits for a lost connection to come back before it gives up.
AWAY_S: Final = 30.0
_TURN_ENDS: Final = frozenset({"turn.completed", "turn.failed", "turn.cancelled"})


@dataclass(frozen=True, slots=True)
class FeedItem:
    """A stored event (`seq` its stream sequence, `subject` where it is stored), or a
    text delta (`seq` None, `subject` "")."""

    seq: int | None
    type: str
    data: bytes  # the event's JSON, as stored (or the delta's, as published)
    subject: str


class _Ids(msgspec.Struct):
    """What a stream reads of each event: its type and whose it is."""

    type: str = ""
    turn_id: str | None = None
    call_id: str | None = None
    request_id: str | None = None
    reason: str | None = None  # request.rejected's


_ids = msgspec.json.Decoder(_Ids)


def _turn_of(ids: _Ids) -> str | None:
    if ids.turn_id is not None:
        return ids.turn_id
    if ids.call_id is not None:
        return ids.call_id.rsplit("-", 1)[0]  # call ids are `<turn_id>-<index>`
    if ids.request_id is not None:  # request.rejected
        return turn_id_for(ids.request_id)
    return None


def _reading_bound(loop: asyncio.AbstractEventLoop) -> asyncio.Semaphore:
    """The bound on pages read at once in this event loop (a semaphore belongs to one)."""
    bound = _READING.get(loop)
    if bound is None:
        bound = _READING[loop] = asyncio.Semaphore(READS_AT_ONCE)
    return bound


class SessionFeed:
    """One session followed: `async with feed:` (subscribes), then `async for item in
    feed.items()`."""

    def __init__(self, bus: Bus, session_id: str, *, after: int = 0,
                 turn_id: str | None = None, max_deltas: int = MAX_DELTAS,
                 quiet_s: float | None = None) -> None:
        """`after`: the stream sequence the feed starts after (the session's stored
        events after it come first). `turn_id`: only that turn's events, and the feed
        ends with its end. `quiet_s` (default `QUIET_S`): how long the feed waits for
        something before it reads the log again, and says so (`items()` gives None)."""
        if not 0 <= after <= MAX_SEQ:
            raise ValueError(f"after={after}: a stream sequence is 0 to {MAX_SEQ}")
        self._bus = bus
        self._sid = session_id
        self._last = after
        self._turn = turn_id
        self._quiet_s = QUIET_S if quiet_s is None else quiet_s
        self._wake = asyncio.Event()
        # What came live, in order: a stored event's sequence (the log is read up to it)
        # or a delta's JSON. Bounded: adjacent sequences merge, deltas stop at the bound.
        self._queue: deque[int | bytes] = deque()
        self._deltas = 0
        self._max_deltas = max_deltas
        self._sub: Any = None
        self.stopped = False  # by `stop()`
        self.ended = False  # the turn followed has ended
        self._first_live: int | None = None  # the sequence of the first event heard live
        self._began = False  # its `turn.requested` was read
        self._rewind = False  # to read the log from its start (and `_rewound`, it did)
        self._rewound = False
        self._quiet_at = 0.0  # when `items()` says it is quiet, if it gave nothing since

    async def open(self) -> None:
        """Subscribe to the live events, and make sure the server has the subscription:
        anything stored after this returns wakes the feed."""
        self._sub = await self._bus.nc.subscribe(f"{LIVE_PREFIX}.{self._sid}.>",
                                                 cb=self._on_live)
        await apart(self._bus.nc.flush(timeout=5))

    async def __aenter__(self) -> SessionFeed:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def last(self) -> int:
        """The stream sequence of the last event read (given, or not this feed's): where
        a reader that comes back starts after."""
        return self._last

    def stop(self) -> None:
        """End `items()` at its next step (`stopped` is then true)."""
        self.stopped = True
        self._wake.set()

    def restart(self, after: int) -> None:
        """Start after `after` instead (before iterating `items()`)."""
        self._last = after

    async def close(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            # Closed when the reader went away, maybe inside a cancelled anyio scope (an
            # HTTP answer's): shielded, or the unsubscribe would be cancelled too and the
            # subscription left behind.
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _on_live(self, msg: Any) -> None:
        seq_text = (msg.headers or {}).get(Header.SEQUENCE.value)
        if isinstance(seq_text, str) and seq_text.isdigit():
            # A stored event is read from the log, in order: its live copy only marks how
            # far the log is to be read before what came after it (one NATS dropped is
            # read all the same, at the next mark or tick).
            seq = int(seq_text)
            if self._first_live is None:
                self._first_live = seq
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

    async def items(self) -> AsyncIterator[FeedItem | None]:
        """The session's events and deltas, in the order they were published, until the
        turn followed ends (if one is), `stop()`, or the caller stops iterating. None
        when nothing came for `quiet_s` (the log was read again meanwhile)."""
        loop = asyncio.get_running_loop()
        self._quiet_at = loop.time() + self._quiet_s
        async for item in self._items():
            # Quiet is what the reader hears: a turn followed in a busy session hears of
            # the other turns' events, but is given none of them.
            self._quiet_at = loop.time() + self._quiet_s
            yield item

    async def _items(self) -> AsyncIterator[FeedItem | None]:
        # What was stored before the subscription, from the log; from the first event
        # heard live on, in the order heard (the deltas heard meanwhile in their place).
        async for item in self._from_log(None, before_live=True):
            yield item
            if self.ended:
                return
        while True:
            while self._queue and not self.stopped:
                queued = self._queue.popleft()
                if isinstance(queued, int):
                    async for item in self._from_log(queued):
                        yield item
                        if self.ended:
                            return
                    continue
                self._deltas -= 1
                delta = self._item(queued, None, "")
                if delta is not None:
                    yield delta
            if self.stopped:
                return
            self._wake.clear()  # nothing can arrive between the loop above and this
            try:
                async with asyncio.timeout_at(self._quiet_at):
                    await self._wake.wait()
            except TimeoutError:
                yield None
                async for item in self._from_log(None):
                    yield item
                    if self.ended:
                        return

    async def _from_log(self, until: int | None, *, before_live: bool = False
                        ) -> AsyncIterator[FeedItem]:
        """The stored events after the last one read, up to `until` (None: all there
        are; `before_live`: up to the first heard live), read from the log by direct
        gets."""
        while until is None or self._last < until:
            batch, pending = await self._page()
            for seq, subject, data in batch:
                if until is not None and seq > until:
                    return
                if before_live and self._first_live is not None and \
                        seq >= self._first_live:
                    return
                if seq <= self._last:
                    continue
                item = self._item(data, seq, subject)
                if item is not None:
                    yield item
                    if self.ended:
                        return
                if self._rewind:
                    break
            if self._rewind:
                self._rewind, self._rewound, self._last = False, True, 0
                continue
            if not batch or pending == 0:
                return

    async def _page(self) -> tuple[list[tuple[int, str, bytes]], int]:
        """The next page of the log. Fails (BusTimeoutError) when nothing of it comes for
        the timeout from a server still connected; with the connection away, waits for it
        to come back (at most `AWAY_S`) and reads again: a feed outlives a restart of the
        server (what was published live meanwhile is read from the log)."""
        nc = self._bus.nc
        loop = asyncio.get_running_loop()
        away_since: float | None = None
        while True:
            try:
                async with _reading_bound(loop):
                    return await direct_batch(
                        self._bus, EVENTS_STREAM, session_filter(self._sid),
                        self._last + 1, _PAGE, timeout=_READ_TIMEOUT_S,
                        max_bytes=_PAGE_BYTES)
            except BusTimeoutError:
                if (nc.is_connected and away_since is None) or nc.is_closed:
                    raise  # a server gone quiet, or a connection closed for good
            away_since = loop.time() if away_since is None else away_since
            while True:
                if loop.time() - away_since >= AWAY_S:
                    raise BusTimeoutError(
                        f"lost the connection to NATS at {self._bus.url}, and the log of "
                        f"{self._sid} could not be read again within {AWAY_S:g} s")
                if nc.is_closed:
                    raise BusTimeoutError(f"the connection to NATS at {self._bus.url} "
                                          f"closed while the log of {self._sid} was read")
                if nc.is_connected and not nc.is_reconnecting:
                    break
                await asyncio.sleep(0.25)

    def _item(self, data: bytes, seq: int | None, subject: str) -> FeedItem | None:
        """The item of one event (None: not this feed's), noting how far the feed got
        and whether the turn it follows ended."""
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
            if ids.type == "turn.requested":
                self._began = True
            elif ids.type in _TURN_ENDS:
                self.ended = True
            elif ids.type == "request.rejected" and ids.reason == "duplicate_request":
                # The same request sent again (past NATS's duplicate window), refused as a
                # duplicate: its turn is in the log, maybe still going on. A feed that did
                # not see it begin reads the log again from the start, once, for it.
                if self._began:
                    return None
                if not self._rewound:
                    self._rewind = True
                    return None
                self.ended = True
            elif ids.type == "request.rejected":
                self.ended = True
        return FeedItem(seq, ids.type, data, subject)


__all__ = ["MAX_DELTAS", "MAX_SEQ", "QUIET_S", "READS_AT_ONCE", "FeedItem", "SessionFeed"]
