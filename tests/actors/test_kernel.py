"""The actor kernel against a real server: a flood of poison requests becomes stored
rejections without blocking anyone, a `decide` that raises is a stored rejection, racing
writers of one session re-read and never hold an unstored fact, and an unreadable event
stops no actor."""

from __future__ import annotations

import asyncio
import collections
import os
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import nats
from nats.js.api import ConsumerInfo

from actors.kernel import Inbox, Kernel, PoisonError, SessionStates, excerpt
from bus.client import ToolbusClient
from bus.connection import Bus, connect
from bus.consumer import Delivery
from bus.eventlog import Append, EventLog, StoredEvent, decode_stored
from bus.headers import Header
from bus.streams import ConsumerSpec
from bus.subjects import (
    EVENTS_STREAM,
    LIVE_PREFIX,
    REQUESTS_STREAM,
    event_subject,
    request_subject,
)
from schemas.defaults import DECIDE_ATTEMPTS, MAX_REQUEST_BYTES
from schemas.errors import ConcurrencyError
from schemas.events import Event, RequestRejected, TurnCompleted, TurnRequested
from schemas.state import SessionState, encode_state, fold
from tests.conftest import EventWatch

# --- helpers ----------------------------------------------------------------------------


async def _consumer_drained(bus: Bus, stream: str, durable: str,
                            timeout: float = 10.0) -> ConsumerInfo:
    """The consumer's info once nothing is pending or awaiting an ack (bounded): acks and
    terms are fire-and-forget, so the server may count them a moment after the fact they
    follow was stored."""
    info = await bus.js.consumer_info(stream, durable)
    try:
        async with asyncio.timeout(timeout):
            while info.num_ack_pending or info.num_pending:
                await bus.nc.flush()
                info = await bus.js.consumer_info(stream, durable)
    except TimeoutError:
        pass  # the assertion below shows what was left
    return info


def _folds_of_prefixes(session_id: str, stored: Sequence[StoredEvent]) -> dict[int, bytes]:
    """For every position of the log (0 and each event's sequence), the encoded fold of
    the log up to it: what a state at that `last_seq` must be, byte for byte."""
    state = SessionState(session_id=session_id)
    out = {0: encode_state(state)}
    for s in stored:
        out[s.seq] = encode_state(fold(session_id, ((x.seq, x.event) for x in stored
                                                    if x.seq <= s.seq)))
    return out


async def _assert_is_a_fold_of_the_log(bus: Bus, state: SessionState) -> None:
    """`state` holds exactly the log up to its last sequence: no fact the log lacks."""
    stored = await EventLog(bus).read_session(state.session_id)
    prefix = fold(state.session_id, ((s.seq, s.event) for s in stored
                                     if s.seq <= state.last_seq))
    assert encode_state(state) == encode_state(prefix)


# --- 1. a flood of poison -----------------------------------------------------------------

_BIG_SIZE = 5 * 1024 * 1024


def _big_body(size: int) -> bytes:
    head = b'{"calls": [{"tool": "built-in:echo", "arguments": {"blob": "'
    tail = b'"}}]}'
    return head + b"x" * (size - len(head) - len(tail)) + tail


def _poison_kinds() -> list[tuple[bytes, str, str]]:
    """(body, expected reason, a fragment of the expected message)."""
    return [
        (b"\xff\xfe", "malformed_json", "not valid JSON (UTF-8)"),
        (b'{"calls": [{"tool": "\xff"}]}', "malformed_json", "not valid JSON (UTF-8)"),
        (b"[" * 10_000, "nested_too_deep", "nests deeper than 64 levels"),
        (b'{"calls": 5}', "invalid_request", "calls must be a list of calls, got a number"),
        (b'{"calls": [{"tool": 7}]}', "invalid_request",
         "calls[0].tool must be a string, got a number"),
        # 64 random bytes are never JSON, and too short to nest 65 deep.
        (os.urandom(64), "malformed_json", "not valid JSON (UTF-8)"),
    ]


async def test_a_flood_of_poison_requests_gets_stored_rejections_and_blocks_nobody(
    bus: Bus, nats_url: str, client: ToolbusClient, sid: str
) -> None:
    # A client of its own, the way any NATS program would publish requests.
    raw = await nats.connect(nats_url, name="poison-publisher",
                             pending_size=32 * 1024 * 1024)
    try:
        run = uuid.uuid4().hex[:8]
        # More sessions than the requests consumer's ack window (1024), plus a few
        # sessions with many poison requests each, queued behind one another.
        singles = [f"flood-{run}-s{i}" for i in range(1_200)]
        crowded = [f"flood-{run}-m{i}" for i in range(50)]
        targets = singles + [s for s in crowded for _ in range(16)]
        assert len(targets) == 2_000

        kinds = _poison_kinds()
        # The embedded server's max payload decides whether a 5 MB request can be sent
        # at all; below it the largest body it takes stands in (still over the limit).
        big_size = _BIG_SIZE if raw.max_payload >= _BIG_SIZE + 1024 else \
            raw.max_payload - 1024
        assert big_size > MAX_REQUEST_BYTES
        print(f"\nserver max_payload {raw.max_payload}; oversized requests are "
              f"{big_size} bytes" + ("" if big_size == _BIG_SIZE else
                                     " (5 MB does not fit: the server's max payload is lower)"))
        big = (_big_body(big_size), "payload_too_large", f"request is {big_size} bytes")
        plan: list[tuple[str, tuple[bytes, str, str]]] = []
        for i, target in enumerate(targets):
            kind = big if i in (1_250, 1_700, 1_999) else kinds[i % len(kinds)]
            plan.append((target, kind))

        expected: dict[str, collections.Counter[tuple[str, str]]] = collections.defaultdict(
            collections.Counter)
        fragment: dict[tuple[str, str], str] = {}
        for target, (body, reason, frag) in plan:
            expected[target][(reason, excerpt(body))] += 1
            fragment[(reason, excerpt(body))] = frag

        # Every stored rejection of these sessions, as the server republishes it.
        loop = asyncio.get_running_loop()
        seen = 0
        all_seen = asyncio.Event()
        last_at = 0.0

        async def on_rejection(msg: Any) -> None:
            nonlocal seen, last_at
            event = decode_stored(0, msg.subject, msg.data).event
            if isinstance(event, RequestRejected) and event.session_id in expected:
                seen += 1
                last_at = loop.time()
                if seen >= len(plan):
                    all_seen.set()

        sub = await raw.subscribe(f"{LIVE_PREFIX}.*.request.rejected", cb=on_rejection)
        js = raw.jetstream()
        limit = asyncio.Semaphore(128)

        async def publish(target: str, body: bytes) -> None:
            async with limit:
                await js.publish(request_subject(target), body, timeout=10)

        started = loop.time()
        # The large bodies one at a time (they fill the outbound buffer), the rest at once.
        for target, (body, _, _) in plan:
            if len(body) > MAX_REQUEST_BYTES:
                await publish(target, body)
        await asyncio.gather(*(publish(target, body) for target, (body, _, _) in plan
                               if len(body) <= MAX_REQUEST_BYTES))
        published = loop.time()
        try:
            async with asyncio.timeout(30):
                await all_seen.wait()
        finally:
            await sub.unsubscribe()
        took = last_at - started
        print(f"flood: {len(plan)} poison requests published in {published - started:.2f} s; "
              f"all {seen} rejections stored {took:.2f} s after the first publish "
              f"({last_at - published:.2f} s after the last)")
        assert seen == len(plan)

        # Read back from the log: each request got exactly its rejection, naming the error.
        log = EventLog(bus)
        reads = asyncio.Semaphore(64)

        async def stored_of(target: str) -> list[StoredEvent]:
            async with reads:
                return await log.read_session(target)

        stored = await asyncio.gather(*(stored_of(t) for t in expected))
        for target, events in zip(expected, stored, strict=True):
            rejections = [s.event for s in events]
            assert all(isinstance(e, RequestRejected) for e in rejections), target
            got = collections.Counter((e.reason, e.excerpt) for e in rejections
                                      if isinstance(e, RequestRejected))
            assert got == expected[target], target
            for e in rejections:
                assert isinstance(e, RequestRejected)
                assert e.actor == "session" and e.session_id == target
                assert e.subject == request_subject(target)
                assert fragment[(e.reason, e.excerpt)] in e.message, e.message

        # Nobody was blocked: a valid call in a fresh session, published after the flood.
        end = await client.call(sid, [{"tool": "built-in:echo", "arguments": {"text": "hi"}}],
                                timeout=10)
        assert isinstance(end, TurnCompleted) and end.ok
        assert end.outcomes[0].result == {"text": "hi"}

        # Nothing is left to be redelivered after a restart, in any partition.
        for part in range(bus.partitions):
            info = await _consumer_drained(bus, REQUESTS_STREAM, f"session-requests-p{part}")
            assert (info.num_ack_pending, info.num_pending) == (0, 0), info
    finally:
        await raw.close()


# --- 2. a decide that raises ----------------------------------------------------------------

_ACTOR = "kernel-test"


def _decide_turn(state: list[str], message: TurnRequested, *, now: float) -> list[Append]:
    """The test actor's pure decision: it cannot decide a turn whose request is "boom"."""
    if message.request_id == "boom":
        raise ValueError(f"turn {message.turn_id} of request boom cannot be decided")
    return []


class _TurnRecorder:
    """A minimal actor on the kernel: one inbox of one session's `turn.requested`."""

    def __init__(self, bus: Bus, session_id: str) -> None:
        self.kernel = Kernel(bus, _ACTOR)
        self.durable = f"kernel-test-{uuid.uuid4().hex[:12]}"
        self.seen: list[str] = []  # request ids handled, in order
        self.order: list[tuple[str, str]] = []  # ("handled" | "rejected", request id)
        self.rejected_before: dict[str, int] = {}  # request id -> rejections stored then
        self.handled = asyncio.Event()
        self.kernel.add(Inbox(
            ConsumerSpec(EVENTS_STREAM, self.durable,
                         (event_subject(session_id, "turn.requested",
                                        partitions=bus.partitions),), ack_wait_s=30),
            self._handle, self._reject))

    async def _handle(self, delivery: Delivery) -> None:
        event = decode_stored(delivery.stream_seq, delivery.subject, delivery.data).event
        if not isinstance(event, TurnRequested):
            raise PoisonError("unreadable_event", "not a turn.requested")
        _decide_turn(self.seen, event, now=self.kernel.clock())
        self.seen.append(event.request_id)
        self.order.append(("handled", event.request_id))
        self.rejected_before[event.request_id] = self.kernel.rejected
        self.handled.set()
        await delivery.ack()

    def _reject(self, delivery: Delivery, reason: str, message: str) -> list[Append]:
        event = decode_stored(delivery.stream_seq, delivery.subject, delivery.data).event
        self.order.append(("rejected", event.request_id if isinstance(event, TurnRequested)
                           else "?"))
        return [self.kernel.generic_rejection(delivery, reason, message)]


async def test_a_decide_that_raises_is_a_stored_rejection_and_the_session_goes_on(
    bus: Bus, client: ToolbusClient, sid: str
) -> None:
    actor = _TurnRecorder(bus, sid)
    await actor.kernel.start()
    try:
        echo = [{"tool": "built-in:echo", "arguments": {"text": "hi"}}]
        for request_id in ("boom", "fine"):
            end = await client.call(sid, echo, request_id=request_id, timeout=10)
            assert isinstance(end, TurnCompleted) and end.ok  # the system is unaffected
        async with asyncio.timeout(10):
            while "fine" not in actor.seen:
                actor.handled.clear()
                await actor.handled.wait()
        async with EventWatch(bus, sid) as w:
            events = await w.until(lambda evs: any(
                isinstance(e, RequestRejected) and e.actor == _ACTOR for e in evs))
        ours = [e for e in events if isinstance(e, RequestRejected) and e.actor == _ACTOR]
        assert len(ours) == 1
        rej = ours[0]
        assert rej.reason == "internal" and rej.session_id == sid
        assert "ValueError: turn " in rej.message
        assert "of request boom cannot be decided" in rej.message
        assert rej.subject == event_subject(sid, "turn.requested", partitions=bus.partitions)
        assert rej.excerpt is not None and '"request_id":"boom"' in rej.excerpt
        # "fine" came after the rejection of "boom" was stored, and only "fine" was handled.
        assert actor.order == [("rejected", "boom"), ("handled", "fine")]
        assert actor.rejected_before["fine"] == 1
        assert actor.seen == ["fine"]
        assert actor.kernel.rejected == 1
        info = await _consumer_drained(bus, EVENTS_STREAM, actor.durable)
        assert (info.num_ack_pending, info.num_pending) == (0, 0), info
    finally:
        await actor.kernel.stop()
        await bus.js.delete_consumer(EVENTS_STREAM, actor.durable)


# --- 3. racing writers --------------------------------------------------------------------


def _fact(session_id: str, writer: str, n: int) -> Append:
    event = RequestRejected(session_id=session_id, at=1.0, actor=f"writer-{writer}",
                            reason="test", message=f"decision {n} of {writer}")
    return Append(event, f"{session_id}:race:{writer}:{n}")


async def test_racing_writers_on_one_session_re_read_and_never_show_an_unstored_fact(
    bus: Bus, nats_url: str, sid: str
) -> None:
    buses = [await connect(nats_url, name=f"writer-{w}") for w in "ab"]
    try:
        states = {w: SessionStates(b, EventLog(b)) for w, b in zip("ab", buses, strict=True)}
        entries = {w: await states[w].entry(sid) for w in "ab"}
        fresh = encode_state(SessionState(session_id=sid))
        assert encode_state(entries["a"].state) == encode_state(entries["b"].state) == fresh

        async def write(w: str) -> Any:
            async with entries[w].lock:
                return await states[w].write(entries[w], [_fact(sid, w, 0)])

        # Both decide at the same expected sequence (0: nothing stored yet).
        results = dict(zip("ab", await asyncio.gather(write("a"), write("b"),
                                                      return_exceptions=True), strict=True))
        won = [w for w, r in results.items() if not isinstance(r, BaseException)]
        lost = [w for w, r in results.items() if isinstance(r, BaseException)]
        assert len(won) == 1 and len(lost) == 1, results
        winner, loser = won[0], lost[0]
        assert isinstance(results[loser], ConcurrencyError), results[loser]

        stored = await EventLog(bus).read_session(sid)
        messages = [s.event.message for s in stored if isinstance(s.event, RequestRejected)]
        assert messages == [f"decision 0 of {winner}"]  # the loser's fact is not stored
        # Neither state holds the loser's unstored fact: each is a fold of the log.
        assert entries[loser].state.last_seq == 0
        for w in "ab":
            await _assert_is_a_fold_of_the_log(bus, entries[w].state)

        # The loser re-reads: its state is the log's fold, byte for byte.
        async with entries[loser].lock:
            await states[loser].reread(entries[loser])
        log_fold = encode_state(fold(sid, ((s.seq, s.event) for s in stored)))
        assert encode_state(entries[loser].state) == log_fold

        # ...and decides again, from what is stored.
        def decide_again(state: SessionState) -> list[Append]:
            return [_fact(sid, loser, 1)] if state.rejected_requests == 1 else []

        async with entries[loser].lock:
            assert await states[loser].decide_and_write(entries[loser], decide_again,
                                                        attempts=DECIDE_ATTEMPTS)
        stored = await EventLog(bus).read_session(sid)
        messages = [s.event.message for s in stored if isinstance(s.event, RequestRejected)]
        assert messages == [f"decision 0 of {winner}", f"decision 1 of {loser}"]
        log_fold = encode_state(fold(sid, ((s.seq, s.event) for s in stored)))
        assert encode_state(entries[loser].state) == log_fold
        # The winner has not looked since: behind, but holding nothing the log lacks.
        await _assert_is_a_fold_of_the_log(bus, entries[winner].state)
        assert encode_state((await states[winner].current(sid)).state) == log_fold
    finally:
        for b in buses:
            await b.close()


async def test_racing_decide_and_write_loops_store_exactly_n_facts_and_agree_with_the_log(
    bus: Bus, nats_url: str, sid: str
) -> None:
    n_facts = 40
    buses = [await connect(nats_url, name=f"writer-{w}") for w in "ab"]
    try:
        states = {w: SessionStates(b, EventLog(b)) for w, b in zip("ab", buses, strict=True)}
        entries = {w: await states[w].entry(sid) for w in "ab"}
        seen_states: list[tuple[int, bytes]] = []  # every state a decision was taken from
        decisions = collections.Counter[str]()

        def decider(w: str) -> Callable[[SessionState], list[Append]]:
            def decide(state: SessionState) -> list[Append]:
                seen_states.append((state.last_seq, encode_state(state)))
                if state.rejected_requests >= n_facts:
                    return []
                decisions[w] += 1
                return [_fact(sid, w, state.rejected_requests)]
            return decide

        async def run(w: str) -> None:
            entry = entries[w]
            while True:
                async with entry.lock:
                    settled = await states[w].decide_and_write(entry, decider(w),
                                                               attempts=DECIDE_ATTEMPTS)
                    if settled and not entry.is_caught_up:
                        await states[w].reread(entry)
                    elif settled:
                        return

        async with asyncio.timeout(30):
            await asyncio.gather(run("a"), run("b"))

        stored = await EventLog(bus).read_session(sid)
        facts = [s.event for s in stored if isinstance(s.event, RequestRejected)]
        assert len(facts) == len(stored) == n_facts
        # Each position was decided once: the n-th fact says n, whoever wrote it.
        assert [f.message.split()[1] for f in facts] == [str(n) for n in range(n_facts)]
        log_fold = encode_state(fold(sid, ((s.seq, s.event) for s in stored)))
        assert encode_state(entries["a"].state) == encode_state(entries["b"].state) == log_fold
        prefixes = _folds_of_prefixes(sid, stored)
        for last_seq, encoded in seen_states:
            assert encoded == prefixes[last_seq]
        writers = collections.Counter(f.actor for f in facts)
        conflicts = sum(decisions.values()) - n_facts
        print(f"\nrace: {n_facts} facts, by writer {dict(writers)}; {conflicts} decisions "
              "lost a race and were taken again")
    finally:
        for b in buses:
            await b.close()


# --- 4. an unreadable event --------------------------------------------------------------------


async def test_an_unreadable_event_does_not_stop_the_session_actor(
    bus: Bus, client: ToolbusClient, sid: str
) -> None:
    subject = event_subject(sid, "call.requested", partitions=bus.partitions)
    garbage = b"\x00\xffnot an event at all"
    ack = await bus.js.publish(subject, garbage, timeout=5,
                               headers={Header.MSG_ID.value: f"{sid}:garbage"})
    end = await client.call(sid, [{"tool": "built-in:echo", "arguments": {"text": "hi"}}],
                            timeout=10)
    assert isinstance(end, TurnCompleted) and end.ok
    assert end.outcomes[0].result == {"text": "hi"}

    def rejected_by_approval(evs: list[Event]) -> bool:
        return any(isinstance(e, RequestRejected) and e.actor == "approval" for e in evs)

    async with EventWatch(bus, sid) as w:
        events = await w.until(rejected_by_approval)
    assert any(s.seq == ack.seq and s.event is None for s in w.events)  # kept, unreadable
    rej = next(e for e in events if isinstance(e, RequestRejected) and e.actor == "approval")
    assert rej.reason == "unreadable_event" and rej.session_id == sid
    assert rej.message.startswith("not a call.requested: ")
    assert rej.subject == subject
    assert rej.excerpt == excerpt(garbage)
    info = await _consumer_drained(bus, EVENTS_STREAM, "approval")
    assert info.num_ack_pending == 0, info


async def test_a_rejection_quoting_a_huge_value_is_clipped_and_stored(bus, sid) -> None:
    # A request under the size limit whose error message would quote 128 KB of
    # characters that each escape to many bytes: the rejection is clipped, stored and the
    # request terminated, not retried forever.
    import msgspec

    from bus.eventlog import EventLog
    from bus.subjects import request_subject

    body = msgspec.json.encode({"agent": "\U000e0001" * 32000,
                                "calls": [{"tool": "built-in:echo"}]})
    await bus.js.publish(request_subject(sid), body)
    async with asyncio.timeout(10):
        while True:
            stored = await EventLog(bus).read_session(sid)
            if stored:
                break
            await asyncio.sleep(0.05)  # polling the log, bounded
    rejected = stored[0].event
    assert rejected is not None and rejected.reason == "invalid_request"
    assert len(rejected.message) <= 500


async def test_a_turn_whose_errors_quote_huge_values_still_ends_once(
        bus: Bus, client: ToolbusClient, sid: str) -> None:
    # The schema error quotes a 65 KB value with escapes: the call's rejection and the
    # turn's end are clipped, so the turn ends (once) instead of failing to be stored.
    end = await client.call(sid, [{"tool": "testing:sleep",
                                   "arguments": {"seconds": '"' * 65_000}}], timeout=10)
    assert not isinstance(end, RequestRejected)
    assert end.outcomes[0].status == "rejected"
    stored = await EventLog(bus).read_session(sid)
    sizes = {type(s.event).__name__: len(s.data) for s in stored}
    assert sizes["CallRejected"] < 16 * 1024 and sizes["TurnFailed"] < 16 * 1024
    assert [type(s.event).__name__ for s in stored].count("RequestRejected") == 0
    assert len(stored) == 4  # turn, call, its rejection, the turn's end: nothing more


async def test_a_stored_message_posing_as_a_server_status_is_still_handled(
        bus: Bus, client: ToolbusClient, sid: str) -> None:
    # An empty request with a `Status` header is a request like any other (rejected),
    # not a heartbeat that would sit unacknowledged in the requests consumer forever.
    for i in range(20):
        await bus.js.publish(request_subject(f"{sid}-s{i}"), b"",
                             headers={Header.STATUS.value: "404"})
    end = await client.call(sid, [{"tool": "built-in:echo", "arguments": {}}], timeout=10)
    assert isinstance(end, TurnCompleted)
    for i in range(20):
        async with EventWatch(bus, f"{sid}-s{i}") as w:
            events = await w.until(lambda evs: bool(evs), timeout=5)
        assert isinstance(events[0], RequestRejected)
    for part in range(bus.partitions):
        info = await _consumer_drained(bus, REQUESTS_STREAM, f"session-requests-p{part}")
        assert info.num_ack_pending == 0


async def test_a_malformed_traceparent_is_not_copied_onto_events(bus: Bus, sid: str) -> None:
    await bus.js.publish(request_subject(sid),
                         b'{"calls": [{"tool": "built-in:echo", "arguments": {}}]}',
                         headers={"traceparent": "x" * 60_000})
    async with EventWatch(bus, sid) as w:
        await w.until(lambda evs: any(isinstance(e, TurnCompleted) for e in evs), timeout=10)
    sizes = []
    for s in w.events:
        msg = await bus.js.get_msg("TOOLBUS_EVENTS", s.seq, direct=True)
        sizes.append(len((msg.headers or {}).get("traceparent", "")))
    assert sizes and max(sizes) == 0


async def test_a_message_whose_handler_never_finishes_is_rejected_after_redeliveries(
        bus: Bus, sid: str) -> None:
    # A handler that dies with its process each time looks, to the server, like one that
    # never acks: after twice the deliveries allowed, the kernel stores a rejection
    # instead of handling it again (a crash loop would otherwise never end).
    durable = f"t-dies-{uuid.uuid4().hex[:8]}"
    handled: list[int] = []

    async def dies(delivery: Delivery) -> None:
        handled.append(delivery.num_delivered)  # and never acks

    kernel = Kernel(bus, "dying", max_deliveries=1)
    kernel.add(Inbox(ConsumerSpec(EVENTS_STREAM, durable,
                                  (event_subject(sid, "turn.requested",
                                                 partitions=bus.partitions),),
                                  ack_wait_s=0.3),
                     dies, lambda d, reason, message: [kernel.generic_rejection(
                         d, reason, message)]))
    await kernel.start()
    try:
        await EventLog(bus).append(Append(TurnRequested(
            session_id=sid, at=1.0, actor="test", turn_id="t1", request_id="t1",
            call_ids=[]), f"{sid}:t1:requested"))
        async with EventWatch(bus, sid) as w:
            events = await w.until(lambda evs: any(
                isinstance(e, RequestRejected) and e.actor == "dying" for e in evs),
                timeout=20)
        (rejected,) = [e for e in events if isinstance(e, RequestRejected)]
        assert rejected.reason == "redelivered" and "3 times" in rejected.message
        assert handled == [1, 2]
        info = await _consumer_drained(bus, EVENTS_STREAM, durable)
        assert (info.num_ack_pending, info.num_pending) == (0, 0), info
    finally:
        await kernel.stop()
        await bus.js.delete_consumer(EVENTS_STREAM, durable)


class _NoMsg:
    headers = None  # all `Kernel._deliver` reads of a message besides the Delivery


async def _order_of(bus: Bus, *, yields: bool) -> list[str]:
    """What runs first: the handler of a delivery, or what was ready on the event loop
    when it came (a model call another actor of the process had just started)."""
    order: list[str] = []

    async def handle(delivery: Delivery) -> None:
        order.append("handled")

    kernel = Kernel(bus, "test")
    inbox = Inbox(ConsumerSpec(EVENTS_STREAM, "unused", ("x",)), handle,
                  lambda d, r, m: [], yields=yields)
    asyncio.get_running_loop().call_soon(order.append, "ready before")
    delivery = Delivery(subject="toolbus.evt.s.0.call.succeeded", data=b"{}", stream_seq=1,
                        num_delivered=1, timestamp_ns=0, _msg=_NoMsg())  # type: ignore[arg-type]
    await kernel._deliver(inbox, delivery)
    await asyncio.sleep(0)
    return order


async def test_a_delivery_off_the_critical_path_lets_what_is_ready_run_first(
        bus: Bus) -> None:
    assert await _order_of(bus, yields=True) == ["ready before", "handled"]
    assert await _order_of(bus, yields=False) == ["handled", "ready before"]
