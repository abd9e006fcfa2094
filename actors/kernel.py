"""The actor kernel: the one runtime under every actor.

An actor module is a pure `decide` plus the effects only it has (running a tool, talking
MCP). The kernel does everything else, the same way for all of them:

- **Pull.** Each inbox is a durable pull consumer (`bus.consumer.PullLoop`): batches of
  pull requests stay outstanding, one session's messages are handled in stream order
  while different sessions run concurrently, and the work in flight is bounded.
- **State.** `SessionStates` keeps each session's state folded in memory (LRU). A cold
  session is loaded from its snapshot in `toolbus_snapshots` plus the log after it, never
  the whole history per message; every read of session history goes through the reducer.
- **Decide and append.** `SessionStates.write` appends a decision's events under the
  session's concurrency check, pipelined in one round trip, and folds them at once when
  the stream proves nothing came between; a stale writer re-reads and re-decides.
- **Ack** only after what a message caused is stored.
- **Poison.** A message that cannot be decoded, fails validation or makes `decide` raise
  becomes a stored rejection naming the error at its first delivery (`request.rejected`,
  or `call.failed` with `internal` for a call), and is terminated. A message that fails
  for a passing reason (the bus timed out) is retried with backoff and rejected the same
  way after `max_deliveries`. So no consumer's ack window fills up with poison, one
  session never waits for another, and a restart comes back clean.
- **Traces.** Each message is handled in a span that continues the `traceparent` it
  carries; events appended inside it carry the span's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field

from actors import metrics
from bus import trace
from bus.connection import Bus, as_bus_error
from bus.consumer import Delivery, PullLoop
from bus.eventlog import Append, AppendResult, EventLog
from bus.snapshots import SnapshotStore, encode_snapshot
from bus.streams import ConsumerSpec
from bus.subjects import partition, session_of
from schemas.defaults import (
    MAX_DELIVERIES,
    SESSION_CACHE_SIZE,
)
from schemas.errors import (
    AppendError,
    BusError,
    BusTimeoutError,
    ConcurrencyError,
    EventTooLargeError,
    ToolbusError,
)
from schemas.events import (
    CallRejected,
    Event,
    RequestRejected,
    TurnCancelled,
    TurnCompleted,
    TurnFailed,
)
from schemas.ids import SYSTEM_SESSION, is_token, message_rejected_id
from schemas.state import SessionState, decode_state, encode_state, evolve

log = logging.getLogger("toolbus.kernel")
# How long a reader waits for the first write of a session taken as new (its own
# process's, or the peer's), before it reads the session from the bus instead.
_PEER_WAIT_S = 0.5
# Folded sequences each session remembers, to notice one delivered after a read skipped it.
_RECENT_SEQS = 256

# The trace headers of the message being handled, per task (each delivery has its own):
# what the events it causes carry on, also when this process exports no spans.
_parent: ContextVar[Mapping[str, str] | None] = ContextVar("toolbus_parent", default=None)


def outgoing_headers() -> dict[str, str]:
    """Trace headers for an event appended now, on behalf of the message being handled."""
    return trace.headers_for_child(_parent.get())


class PoisonError(ToolbusError):
    """A message that can never be handled, however often it is delivered: it cannot be
    decoded, or it is not what this consumer takes. Rejected at its first delivery."""

    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason
        self.message = message
        super().__init__(f"{reason}: {message}")


Reject = Callable[[Delivery, str, str], Sequence[Append]]
"""`(delivery, reason, message)` -> the events that record the rejection."""


@dataclass(frozen=True, slots=True)
class Inbox:
    """One durable consumer of an actor and what to do with its messages."""

    consumer: ConsumerSpec
    handle: Callable[[Delivery], Awaitable[None]]
    reject: Reject
    ordered: bool = True  # one session's messages in stream order
    max_in_flight: int = 256
    # Told of each message as it arrives, before it waits behind its session's (PullLoop).
    arrived: Callable[[Delivery], None] | None = None
    # Off a turn's critical path: each message first lets everything else ready on the
    # event loop run (one turn of it), so that the model call another actor of this
    # process started in the same moment goes out before these are handled, not after.
    yields: bool = False


def _is_passing(exc: BaseException) -> bool:
    """Worth another delivery: the bus, not the message, was the problem (a nats-py
    error that escaped, such as JetStream's 503 while a cluster elects a leader, too)."""
    if isinstance(exc, EventTooLargeError):
        return False
    return isinstance(exc, BusError | TimeoutError | ConnectionError) or \
        as_bus_error(exc) is not None


def _backoff_s(delivered: int) -> float:
    return float(min(0.25 * 2 ** max(delivered - 1, 0), 10.0))


def _clip(text: str, limit: int = 500) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def excerpt(data: bytes, limit: int = 200) -> str:
    text = data[:limit].decode("utf-8", errors="replace")
    return text + ("…" if len(data) > limit else "")


class Kernel:
    """Runs the inboxes of one actor; see the module docstring."""

    def __init__(self, bus: Bus, actor: str, *, max_deliveries: int = MAX_DELIVERIES,
                 clock: Callable[[], float] = time.time) -> None:
        self.bus = bus
        self.actor = actor
        self.log = EventLog(bus)
        self.clock = clock
        self._max_deliveries = max_deliveries
        self._loops: list[PullLoop] = []
        self.rejected = 0  # messages turned into stored rejections (stats and tests)
        # The attributes of this actor's metrics (an executor adds its pool).
        self.attributes: dict[str, str] = {metrics.ACTOR: actor}
        self._metering: list[Callable[[], None]] = []

    def add(self, inbox: Inbox) -> None:
        """An inbox for as long as the actor runs (started by `start`)."""
        self._loops.append(self._pull_loop(inbox))

    async def attach(self, inbox: Inbox) -> PullLoop:
        """An inbox from now on, until `detach`: a partition this process took."""
        loop = self._pull_loop(inbox)
        await loop.start()
        self._loops.append(loop)
        return loop

    async def detach(self, loop: PullLoop, grace: float = 5.0) -> None:
        """Stop pulling, let the messages in hand finish (up to `grace`); the rest go to
        whoever attaches the consumer next, after its ack wait."""
        if loop in self._loops:
            self._loops.remove(loop)
        await loop.stop(grace)

    def _pull_loop(self, inbox: Inbox) -> PullLoop:
        # Built once per consumer: a redelivery adds to a counter with these, no more.
        attrs = {**self.attributes, metrics.CONSUMER: inbox.consumer.durable}

        async def deliver(delivery: Delivery) -> None:
            if delivery.num_delivered > 1:
                metrics.redelivered(attrs)
            await self._deliver(inbox, delivery)

        return PullLoop(self.bus, inbox.consumer, deliver, max_in_flight=inbox.max_in_flight,
                        key=session_of if inbox.ordered else None, arrived=inbox.arrived)

    async def start(self) -> None:
        for loop in self._loops:
            await loop.start()
        if metrics.enabled():
            self.log.observer = self._stored
            if self.actor == "session":
                self._metering.append(metrics.watch("sessions", self._active_sessions))

    async def stop(self, grace: float = 10.0) -> None:
        for unwatch in self._metering:
            unwatch()
        self._metering.clear()
        await asyncio.gather(*(loop.stop(grace) for loop in self._loops))

    def _active_sessions(self) -> list[tuple[dict[str, str], float]]:
        active: set[str] = set()
        for states in _STATES_OF_LOG.get(self.log, ()):
            active.update(states.active())
        return [(self.attributes, float(len(active)))]

    def _stored(self, event: Event, result: AppendResult) -> None:
        """The log stored `event` and it was not a duplicate (see actors/metrics.py for why
        calls are counted here, from the end of their turn)."""
        if type(event) in metrics.TURN_ENDS:
            assert isinstance(event, TurnCompleted | TurnFailed | TurnCancelled)
            for states in _STATES_OF_LOG.get(self.log, ()):
                entry = states.peek(event.session_id)
                if entry is not None and event.turn_id in entry.state.turns:
                    metrics.turn_ended(event, entry.state)
                    return
            metrics.turn_ended(event, None)
        elif type(event) in metrics.REJECTIONS:
            assert isinstance(event, RequestRejected | CallRejected)
            metrics.rejected(event.actor, event.reason)

    async def _deliver(self, inbox: Inbox, delivery: Delivery) -> None:
        if inbox.yields:
            await asyncio.sleep(0)
        _parent.set(delivery.headers)
        if delivery.num_delivered > 2 * self._max_deliveries:
            # Delivered again and again without an ack or an error: whoever handled it
            # died each time (it may kill the process). Stored as rejected, not retried.
            await self._reject(inbox, delivery, "redelivered", _clip(
                f"the {self.actor} actor received this message {delivery.num_delivered} "
                "times without finishing it (its process may have died on it each time); "
                "it is not handled again"))
            return
        try:
            if trace.enabled():
                with trace.span(f"{self.actor} {inbox.consumer.durable}", kind="consumer",
                                parent=delivery.headers,
                                attributes={"messaging.destination.name": delivery.subject}):
                    await inbox.handle(delivery)
            else:
                await inbox.handle(delivery)
            return
        except asyncio.CancelledError:
            raise
        except PoisonError as exc:
            reason, message = exc.reason, exc.message
        except Exception as exc:
            detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            if _is_passing(exc) and delivery.num_delivered < self._max_deliveries:
                log.warning("%s: %s (delivery %d of %s); retrying", self.actor, detail,
                            delivery.num_delivered, delivery.subject)
                with contextlib.suppress(Exception):
                    await delivery.nak(delay=_backoff_s(delivery.num_delivered))
                return
            if not _is_passing(exc):
                log.exception("%s failed on %s (seq %d)", self.actor, delivery.subject,
                              delivery.stream_seq)
            reason = "internal"
            message = _clip(f"the {self.actor} actor failed on this message after "
                            f"{delivery.num_delivered} deliveries: {detail}")
        await self._reject(inbox, delivery, reason, message)

    async def _reject(self, inbox: Inbox, delivery: Delivery, reason: str,
                      message: str) -> None:
        # Clipped: a rejection quotes what was wrong, and the wrong thing can be large.
        message = _clip(message)
        try:
            items = inbox.reject(delivery, reason, message)
        except Exception:  # the rejection builder itself choked on this message
            log.exception("%s: building the rejection of seq %d failed", self.actor,
                          delivery.stream_seq)
            items = [self.generic_rejection(delivery, reason, message)]
        try:
            for item in items:
                try:
                    await self.log.append(item)
                except EventTooLargeError:
                    # Cannot happen with clipped texts; if it does, the short generic
                    # form is stored rather than retrying forever.
                    await self.log.append(self.generic_rejection(delivery, reason,
                                                                 message[:200]))
        except AppendError as exc:
            # The rejection could not be stored (the bus is down): the message stays,
            # and comes back after the backoff. Nothing is lost.
            log.warning("%s: could not store the rejection of seq %d: %s", self.actor,
                        delivery.stream_seq, exc)
            with contextlib.suppress(Exception):
                await delivery.nak(delay=_backoff_s(delivery.num_delivered))
            return
        self.rejected += 1
        if not any(type(item.event) in metrics.REJECTIONS for item in items):
            # Stored as another fact (`call.failed` internal): counted here, once per
            # message. A `request.rejected` is counted where it is stored (`_stored`).
            metrics.rejected(self.actor, reason)
        log.info("%s: rejected %s (seq %d): %s", self.actor, delivery.subject,
                 delivery.stream_seq, message)
        with contextlib.suppress(Exception):
            await delivery.term()

    def generic_rejection(self, delivery: Delivery, reason: str, message: str) -> Append:
        """A `request.rejected` in the message's session (or the system session when the
        subject names none) for a message nothing more specific can be said of."""
        sid = session_of(delivery.subject)
        own = is_token(sid)
        event = RequestRejected(session_id=sid if own else SYSTEM_SESSION,
                                at=self.clock(), actor=self.actor, reason=reason,
                                message=message,
                                subject=delivery.subject[:300],
                                excerpt=excerpt(delivery.data) if own
                                else f"({len(delivery.data)} bytes)")
        return Append(event, message_rejected_id(self.actor, delivery.stream_seq))


# --- session states ---------------------------------------------------------------------

# Sessions a `SessionStates` remembers having dropped from memory, per session it holds.
_DROPPED_PER_HELD = 4

# The session states folded from each log, so the end of a turn stored through it finds
# when the turn was requested (its duration) without another read.
_STATES_OF_LOG: weakref.WeakKeyDictionary[EventLog, weakref.WeakSet[SessionStates]] = \
    weakref.WeakKeyDictionary()


@dataclass(eq=False)
class Entry:
    """One session's folded state, and what its writer is waiting for."""

    state: SessionState
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Highest sequence this process wrote without folding it yet; a consumer-fed entry
    # takes no decision until the state has caught up to it.
    written_upto: int = 0
    caught_up: asyncio.Event = field(default_factory=asyncio.Event)
    folded_since_snapshot: int = 0
    # True once a decision was taken on the state as it is (nothing was due, or what was
    # due is written); False after a cold load, so redeliveries decide again.
    settled: bool = False
    # The sequences folded lately, oldest first (see `missed`).
    recent: deque[int] = field(default_factory=lambda: deque(maxlen=_RECENT_SEQS))
    # The last sequence of the state a decision found nothing due on (-1: none since it
    # was loaded or rebuilt); while the state is still there, a delivery of an event
    # folded before it can make nothing new due (the planner's own writes coming back).
    decided_at: int = -1
    # The highest sequence of an event of the session handed back unfolded (whether this
    # process still owned its partition was in doubt): until the state reaches it, the
    # events after it are not folded in its place; the log is read past it first.
    handed_back_at: int = 0

    @property
    def is_caught_up(self) -> bool:
        return self.state.last_seq >= self.written_upto

    @property
    def behind(self) -> bool:
        """An event handed back unfolded is missing from the state (see `handed_back`)."""
        return self.handed_back_at > self.state.last_seq

    def missed(self, seq: int) -> bool:
        """Whether `seq`, at or behind the state, was never folded: it came first to a
        read that skipped it (on a cluster, around a leader change) and is delivered only
        now. Known for the last `_RECENT_SEQS` folded; older ones are taken as folded."""
        recent = self.recent
        return bool(recent) and recent[0] < seq <= self.state.last_seq and seq not in recent


class SessionStates:
    """Session states folded in memory: an LRU of `Entry`, cold-loaded from a snapshot
    plus the log tail.

    An actor that consumes every event of its sessions (the session actor) feeds them
    with `fold`; an actor that does not (approval, executor, janitor) asks `current`,
    which folds whatever was stored since it last looked: one direct-get round trip."""

    def __init__(self, bus: Bus, log: EventLog, *, size: int = SESSION_CACHE_SIZE,
                 snapshot_every: int | None = None) -> None:
        self._log = log
        self._bus = bus
        self._snapshots = SnapshotStore(bus)
        self._cache: OrderedDict[str, Entry] = OrderedDict()
        self._size = size
        self._loading: dict[str, asyncio.Future[Entry]] = {}
        self._snapshot_every = snapshot_every
        self._saving: set[asyncio.Task[None]] = set()
        # The states of another actor of this process that folds every event of its
        # sessions (the session actor's): a session cold here is copied from there when
        # that already holds the event being handled, instead of read from the bus.
        self.peer: SessionStates | None = None
        # Sessions taken as new (`assume_new`) whose first write is on its way.
        self._new: dict[str, asyncio.Future[None]] = {}
        # Sessions being loaded when an event of theirs was handed back (`handed_back`).
        self._handed_back_loading: dict[str, int] = {}
        # Sessions dropped from memory (evicted, or forgotten with a partition), by hash:
        # never taken as new again (`assume_new`), since they have a past. Their first
        # write would conflict, and a planner turn planned on the assumption would have
        # asked the model a question without the conversation, then dropped it.
        self._dropped: OrderedDict[int, None] = OrderedDict()
        _STATES_OF_LOG.setdefault(log, weakref.WeakSet()).add(self)

    async def entry(self, sid: str, *, at_least: int = 0) -> Entry:
        """The session's entry; `at_least`: the sequence of the event being handled, which
        a cold entry copied from the peer must hold."""
        entry = self._cache.get(sid)
        if entry is not None:
            self._cache.move_to_end(sid)
            return entry
        writing = self._new.get(sid)
        if writing is not None:
            # Its first write, taken as new (`assume_new`), is on its way: the event
            # being handled may be that very write, delivered before its acknowledgement.
            await asyncio.wait({writing}, timeout=_PEER_WAIT_S)  # never cancels it
            entry = self._cache.get(sid)
            if entry is not None:
                self._cache.move_to_end(sid)
                return entry
        loading = self._loading.get(sid)
        if loading is not None:
            return await asyncio.shield(loading)
        fut: asyncio.Future[Entry] = asyncio.get_running_loop().create_future()
        self._loading[sid] = fut
        try:
            entry = await self._copy_of_peer(sid, at_least) or await self._load(sid)
            await self._complete(entry)
            entry.handed_back_at = self._handed_back_loading.pop(sid, 0)
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
            self._handed_back_loading.pop(sid, None)

    async def _load(self, sid: str) -> Entry:
        """The session folded from its snapshot and the log after it. The snapshot and
        the head of the log are read at once: a new or short session (the head is all of
        it) costs one round trip of latency, and no second read."""
        snapshot = asyncio.ensure_future(self._trusted_snapshot(sid))
        try:
            head, whole = await self._log.read_head(sid)
            # Awaited even then: the log's head may have been trimmed (limits, a purge),
            # and the snapshot is what holds what came before it.
            state = await snapshot or SessionState(session_id=sid)
        finally:
            if not snapshot.done():
                snapshot.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await snapshot
        if whole:
            stored_events = [e for e in head if e.seq > state.last_seq]
        else:
            stored_events = await self._log.read_session(sid, after=state.last_seq)
        entry = Entry(state)
        for stored in stored_events:
            self._fold(entry, stored.seq, stored.event)
        return entry

    def assume_new(self, sid: str) -> Entry | None:
        """An empty entry for a session this process knows nothing of (not in memory, not
        being loaded), not read from the bus, or None. Its first write, checked against
        "no event of the session yet", proves it new: one round trip less for a new
        session. Then `adopt` it; on a conflict (the session has a past) `abandon` it and
        load the session with `entry`. Single server only (see `_copy_of_peer`)."""
        if sid in self._cache or sid in self._loading or sid in self._new or \
                self._log.replicated or hash(sid) in self._dropped:
            return None
        entry = Entry(SessionState(session_id=sid))
        entry.caught_up.set()
        self._new[sid] = asyncio.get_running_loop().create_future()
        return entry

    def adopt(self, entry: Entry) -> None:
        """Keep an entry from `assume_new` once written, unless another handler loaded the
        session meanwhile (that one catches up with the write through the consumer)."""
        sid = entry.state.session_id
        if sid not in self._cache and sid not in self._loading:
            self._cache[sid] = entry
            self._evict()
        self.abandon(entry)

    def abandon(self, entry: Entry) -> None:
        """Done with an entry from `assume_new` (adopted or not): whoever waits for it
        goes on."""
        waiting = self._new.pop(entry.state.session_id, None)
        if waiting is not None and not waiting.done():
            waiting.set_result(None)

    async def _copy_of_peer(self, sid: str, at_least: int) -> Entry | None:
        """The peer's state of the session, copied, if it holds `at_least`. Single server
        only: there the peer's state is the session's log up to its last sequence, folded
        in order (on a cluster a read may have gone past an event still to come). A new
        session whose first write the peer is still finishing (the event being handled
        may be delivered here before the peer has its acknowledgement) is waited for:
        sooner than a read of the bus."""
        peer = self.peer
        if peer is None or at_least <= 0 or self._log.replicated:
            return None
        found = peer.peek(sid)
        waiting = peer._new.get(sid)
        if found is None and waiting is not None:
            await asyncio.wait({waiting}, timeout=_PEER_WAIT_S)
            found = peer.peek(sid)
        if found is None or found.behind or found.state.last_seq < at_least:
            return None
        return Entry(decode_state(encode_state(found.state)))

    async def _trusted_snapshot(self, sid: str) -> SessionState | None:
        """The session's snapshot, if the log still agrees with it: its last event
        exists and is this session's. A snapshot that outlived its stream (restored,
        recreated) would otherwise make every decision wrong."""
        state = await self._snapshots.load(sid)
        if state is None or state.last_seq == 0:
            return None
        at = await self._log.read_at(state.last_seq)
        if at is None or session_of(at.subject) != sid:
            log.warning("snapshot of %s ends at seq %d, which the log does not hold for "
                        "it; folding the log instead", sid, state.last_seq)
            return None
        return state

    def active(self) -> list[str]:
        """The sessions in memory with a turn running."""
        # Copied in one step: an OTLP export collects from its own thread.
        return [sid for sid, entry in list(self._cache.items()) if entry.state.open_turns]

    def forget(self, keep: Callable[[str], bool]) -> None:
        """Drop the cached sessions `keep` refuses (those of a partition given up: another
        process writes them now), but for any being decided right now."""
        for sid in [s for s in self._cache if not keep(s)]:
            if not self._cache[sid].lock.locked():
                self._drop(sid)

    def forget_partition(self, part: int) -> None:
        """`forget` the sessions of partition `part`."""
        n = self._bus.partitions
        self.forget(lambda sid: partition(sid, n) != part)

    def handed_back(self, sid: str, seq: int) -> None:
        """The event at `seq` of `sid` was left unacknowledged unfolded, to come again
        after its ack wait: the state in memory, or the one being loaded (its read may
        have been before the event was stored), is `behind` until it holds `seq`."""
        entry = self._cache.get(sid)
        if entry is not None:
            entry.handed_back_at = max(entry.handed_back_at, seq)
        if sid in self._loading:
            self._handed_back_loading[sid] = max(self._handed_back_loading.get(sid, 0), seq)

    async def read_past_handed_back(self, entry: Entry, *, attempts: int = 20) -> None:
        """Fold what was stored after the state, up to and past the events handed back
        unfolded (call with the lock, when `entry.behind`). Read in the log's order, the
        state stays a prefix of the log. Raises `BusError` when the read does not reach
        them (a replica behind, on a cluster): the delivery is handed back, with backoff."""
        for _ in range(attempts):
            await self.reread(entry)
            if not entry.behind:
                # Events came into the state by this read: a decision is due again.
                entry.settled = False
                entry.decided_at = -1
                return
            await asyncio.sleep(0.05)
        raise BusError(f"the log of session {entry.state.session_id} read back does not "
                       f"reach seq {entry.handed_back_at} yet")

    def peek(self, sid: str) -> Entry | None:
        """The cached entry, if the session is in memory."""
        return self._cache.get(sid)

    async def current(self, sid: str) -> Entry:
        """The entry with everything stored so far folded in."""
        entry = await self.entry(sid)
        async with entry.lock:
            await self.reread(entry)
        return entry

    def _evict(self) -> None:
        while len(self._cache) > self._size:
            sid, entry = next(iter(self._cache.items()))
            if entry.lock.locked():
                self._cache.move_to_end(sid)
                return
            self._drop(sid)

    def _drop(self, sid: str) -> None:
        """Take the session out of memory, remembering it had a past (bounded: a session
        forgotten there, or a hash shared, is read before its first write, as ever)."""
        del self._cache[sid]
        self._dropped[hash(sid)] = None
        self._dropped.move_to_end(hash(sid))
        while len(self._dropped) > _DROPPED_PER_HELD * self._size:
            self._dropped.popitem(last=False)

    def fold(self, entry: Entry, seq: int, event: Event | None) -> None:
        self._fold(entry, seq, event)
        if entry.is_caught_up:
            entry.caught_up.set()

    def _fold(self, entry: Entry, seq: int, event: Event | None) -> None:
        state = entry.state
        if seq <= state.last_seq:
            return
        if event is not None:
            evolve(state, event, seq)
        else:
            state.last_seq = seq  # an unreadable event: skipped, but the position moves
        entry.recent.append(seq)
        entry.folded_since_snapshot += 1
        every = self._snapshot_every
        # Further apart as the session grows (an eighth of its events): a snapshot encodes
        # the whole state, so a fixed interval would cost each event more and more.
        if every is not None and entry.folded_since_snapshot >= max(
                every, state.event_count >> 3):
            entry.folded_since_snapshot = 0
            self._save_snapshot(state)

    def _save_snapshot(self, state: SessionState) -> None:
        # Encoded now: the live state keeps changing while the put is on the wire.
        data = encode_snapshot(state)
        sid = state.session_id

        async def save() -> None:
            try:
                await self._snapshots.save_encoded(sid, data)
            except Exception as exc:  # an optimisation only: the log is the truth
                log.debug("snapshot of %s not saved: %s", sid, exc)

        if len(self._saving) < 64:
            task = asyncio.get_running_loop().create_task(save())
            self._saving.add(task)
            task.add_done_callback(self._saving.discard)

    async def _complete(self, entry: Entry) -> None:
        """On a replicated store, read on until the state reaches the session's last event
        as the stream's leader knows it: reads are direct gets, which a replica that is
        behind may answer, and an event missed here may never be delivered again."""
        if not self._log.replicated:
            return
        sid = entry.state.session_id
        target = await self._log.last_seq_of(sid)
        if entry.state.last_seq >= target:
            return
        for stored in await self._log.read_from_leader(sid, after=entry.state.last_seq,
                                                       until=target):
            self._fold(entry, stored.seq, stored.event)
        if entry.state.last_seq < target:
            log.warning("session %s: its log could not be read up to seq %d", sid, target)

    async def reread(self, entry: Entry) -> None:
        """Fold what was stored after the entry's last sequence (call with its lock)."""
        for stored in await self._log.read_session(entry.state.session_id,
                                                   after=entry.state.last_seq):
            self._fold(entry, stored.seq, stored.event)
        await self._complete(entry)
        entry.written_upto = min(entry.written_upto, entry.state.last_seq)
        entry.caught_up.set()

    async def rebuild(self, entry: Entry, *, attempts: int = 40) -> None:
        """Fold the session's whole log again, from its first event (call with the lock):
        for an event delivered late, after later ones were folded (a redelivery across a
        cluster's leader change), which folding skips. Never goes back: a read from a
        replica that is behind is tried again (bounded); past that, `BusTimeoutError`, so
        that the message that needed it is delivered again later (a passing error) instead
        of being decided on a state known to lack an event."""
        sid = entry.state.session_id
        for _ in range(attempts):
            fresh = Entry(SessionState(session_id=sid))
            for stored in await self._log.read_session(sid):
                self._fold(fresh, stored.seq, stored.event)
            await self._complete(fresh)
            if fresh.state.last_seq >= entry.state.last_seq:
                entry.state = fresh.state
                entry.recent = fresh.recent
                entry.written_upto = min(entry.written_upto, entry.state.last_seq)
                entry.caught_up.set()
                entry.settled = False
                entry.decided_at = -1
                return
            await asyncio.sleep(0.05)
        raise BusTimeoutError(f"session {sid}: its log could not be read again up to seq "
                              f"{entry.state.last_seq} (a replica behind?)")

    async def catch_up(self, entry: Entry, timeout: float = 2.0) -> None:
        """Wait (lock not held) until this process's own writes have come back through
        the consumer; after `timeout`, read them instead."""
        if entry.is_caught_up:
            return
        entry.caught_up.clear()
        try:
            async with asyncio.timeout(timeout):
                while not entry.is_caught_up:
                    await entry.caught_up.wait()
                    entry.caught_up.clear()
        except TimeoutError:
            async with entry.lock:
                await self.reread(entry)

    async def write(self, entry: Entry, items: Sequence[Append]) -> list[AppendResult]:
        """Append a decision under the session's concurrency check (call with the lock).

        Raises `ConcurrencyError` when another writer stored something first: re-read
        (`reread`) and decide again. When the stored sequences are contiguous right after
        the state's last one, nothing else was stored in between, so the decision is
        folded now; otherwise the entry waits for it to come back (`written_upto`)."""
        with trace.span("append", attributes={"toolbus.events": len(items)}):
            results = await self._log.append_decision(
                items, expect_last=entry.state.last_seq, headers=outgoing_headers())
        seqs = [r.seq for r in results]
        if self._log.replicated:
            # On a cluster the check does not prove that nothing of the session came
            # between (see Bus.replicated): read the log in its order instead.
            entry.written_upto = max(entry.written_upto, *seqs)
            await self.reread(entry)
        elif not any(r.duplicate for r in results) and seqs == list(
                range(seqs[0], seqs[0] + len(seqs))):
            for r, item in zip(results, items, strict=True):
                self._fold(entry, r.seq, item.event)
        else:
            entry.written_upto = max(entry.written_upto, *seqs)
            if not entry.is_caught_up:
                entry.caught_up.clear()
        return results

    async def decide_and_write(self, entry: Entry,
                               decide: Callable[[SessionState], Sequence[Append]], *,
                               attempts: int) -> bool:
        """Decide from the state and write, re-reading and re-deciding on every conflict,
        up to `attempts` times (call with the lock). True when the state is settled:
        nothing left to do, or waiting for its own writes to come back."""
        for _ in range(attempts):
            if not entry.is_caught_up:
                return True  # the writes coming back will trigger the next decision
            with trace.span("decide"):
                items = decide(entry.state)
            if not items:
                return True
            try:
                results = await self.write(entry, items)
            except ConcurrencyError:
                await self.reread(entry)
                continue
            if all(r.duplicate for r in results):
                # All of it is stored already, under the same message ids: a decision the
                # state keeps no trace of (a refusal) would only be written again, and
                # again, until the attempts ran out and the message was redelivered.
                return True
        return False


__all__ = [
    "Entry",
    "Inbox",
    "Kernel",
    "PoisonError",
    "SessionStates",
    "excerpt",
    "outgoing_headers",
]
