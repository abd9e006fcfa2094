"""Session states in memory: cold start from a snapshot plus the log tail, equal to a
fold of the whole log; snapshots are only an optimisation."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from actors.kernel import Entry, SessionStates
from bus.connection import Bus, connect
from bus.eventlog import Append, EventLog
from bus.server import EmbeddedServer
from bus.snapshots import Snapshot, SnapshotStore
from bus.subjects import SNAPSHOTS_BUCKET
from schemas.errors import BusTimeoutError, ConcurrencyError
from schemas.events import RequestRejected
from schemas.state import STATE_VERSION, SessionState, encode_state, fold


async def _append_rejections(log: EventLog, sid: str, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        await log.append(Append(RequestRejected(session_id=sid, at=float(i), actor="test",
                                                reason="test", message=f"m{i}"),
                                f"{sid}:test:{i}"))


async def _folded(log: EventLog, sid: str) -> bytes:
    return encode_state(fold(sid, ((s.seq, s.event) for s in await log.read_session(sid))))


async def test_a_cold_session_loads_its_snapshot_and_folds_only_the_tail(
        bus: Bus, sid: str) -> None:
    # Longer than one batched read of its head, so the snapshot is what saves the work.
    log = EventLog(bus)
    await _append_rejections(log, sid, 1100)
    writer = SessionStates(bus, log, snapshot_every=1100)
    entry = await writer.entry(sid)  # folds all 1100: a snapshot at 1100
    assert entry.state.event_count == 1100
    for task in list(writer._saving):
        await task
    await _append_rejections(log, sid, 5, start=1100)
    # Ours, at 1100, or one a session actor running beside the suite saved at 1000.
    snap = await SnapshotStore(bus).load(sid)
    assert snap is not None and snap.event_count >= 1000

    reads: list[int] = []
    real = log.read_session

    async def counting(session_id: str, **kw):  # type: ignore[no-untyped-def]
        out = await real(session_id, **kw)
        reads.append(len(out))
        return out

    log.read_session = counting  # type: ignore[method-assign]
    cold = await SessionStates(bus, log).entry(sid)
    assert reads == [1105 - snap.event_count]  # only the tail after the snapshot was read
    log.read_session = real  # type: ignore[method-assign]
    assert encode_state(cold.state) == await _folded(log, sid)


async def test_snapshots_grow_further_apart_as_a_session_grows(bus: Bus, sid: str) -> None:
    # A snapshot encodes the whole state: at a fixed interval a long session would pay
    # more for it at every event. An eighth of the session's events apart, at least
    # `snapshot_every`, the cost per event stays flat and a cold start still reads only
    # the tail after the last one.
    log = EventLog(bus)
    states = SessionStates(bus, log, snapshot_every=10)
    taken: list[int] = []
    states._save_snapshot = lambda state: taken.append(state.event_count)  # type: ignore[method-assign]
    entry = Entry(SessionState(session_id=sid))
    for seq in range(1, 4001):
        states.fold(entry, seq, RequestRejected(session_id=sid, at=0.0, actor="test",
                                                reason="test", message="m"))
    gaps = [b - a for a, b in zip([0, *taken], taken, strict=False)]
    assert taken[:8] == list(range(10, 90, 10))  # every 10 while that is more than 1/8
    assert all(gap >= max(10, count // 8) for gap, count in zip(gaps, taken, strict=True))
    assert len(taken) < 45  # against 400 at a fixed 10
    assert 4000 - taken[-1] < 4000 // 8 + 1


async def test_a_short_session_is_read_whole_in_one_batch_beside_its_snapshot(
        bus: Bus, sid: str) -> None:
    log = EventLog(bus)
    await _append_rejections(log, sid, 30)
    writer = SessionStates(bus, log, snapshot_every=10)
    await writer.entry(sid)
    for task in list(writer._saving):
        await task
    assert await SnapshotStore(bus).load(sid) is not None
    await _append_rejections(log, sid, 5, start=30)
    heads: list[bool] = []
    real_head, real_read = log.read_head, log.read_session

    async def head(session_id: str):  # type: ignore[no-untyped-def]
        out = await real_head(session_id)
        heads.append(out[1])
        return out

    async def no_read(session_id: str, **kw):  # type: ignore[no-untyped-def]
        raise AssertionError("a short session needs no second read")

    log.read_head, log.read_session = head, no_read  # type: ignore[method-assign]
    cold = await SessionStates(bus, log).entry(sid)
    log.read_head, log.read_session = real_head, real_read  # type: ignore[method-assign]
    assert heads == [True] and cold.state.event_count == 35
    assert encode_state(cold.state) == await _folded(log, sid)


async def test_an_unusable_snapshot_is_ignored(bus: Bus, sid: str) -> None:
    log = EventLog(bus)
    await _append_rejections(log, sid, 3)
    kv = await bus.js.key_value(SNAPSHOTS_BUCKET)
    for bad in (b"not json", msgspec.json.encode({"version": STATE_VERSION + 1, "state": {
            "session_id": sid, "last_seq": 10**9}})):
        await kv.put(sid, bad)
        entry = await SessionStates(bus, log).entry(sid)
        assert encode_state(entry.state) == await _folded(log, sid)
    # A snapshot of another session under this key is not believed either.
    other = fold("someone-else", [])
    await kv.put(sid, msgspec.json.encode(Snapshot(version=STATE_VERSION, state=other)))
    entry = await SessionStates(bus, log).entry(sid)
    assert entry.state.session_id == sid and entry.state.event_count == 3


async def test_a_long_history_reads_whole_and_in_order(bus: Bus, sid: str) -> None:
    # Past 1,024 events the log is streamed through an ephemeral consumer instead of
    # direct gets: same events, same order, `until` and `after` respected.
    log = EventLog(bus)
    await asyncio.gather(*(_append_rejections(log, sid, 500, start=k * 500)
                           for k in range(6)))
    before = len(await bus.js.consumers_info("TOOLBUS_EVENTS"))
    everything = await log.read_session(sid)
    assert len(everything) == 3000
    seqs = [s.seq for s in everything]
    assert seqs == sorted(seqs)
    assert sorted(e.event.message for e in everything) == sorted(f"m{i}" for i in range(3000))
    middle = seqs[1999]
    assert [s.seq for s in await log.read_session(sid, until=middle)] == seqs[:2000]
    assert [s.seq for s in await log.read_session(sid, after=seqs[99])] == seqs[100:]
    # The ephemeral consumers are deleted after each read (the delete is not awaited).
    async with asyncio.timeout(5):
        while len(await bus.js.consumers_info("TOOLBUS_EVENTS")) > before:  # noqa: ASYNC110  # polling the server: it signals nothing
            await asyncio.sleep(0.02)


async def test_a_snapshot_the_log_does_not_agree_with_is_ignored(bus: Bus, sid: str) -> None:
    log = EventLog(bus)
    await _append_rejections(log, sid, 2)
    forged = fold(sid, [])
    forged.last_seq = 10**9  # beyond the log: a stream recreated under a surviving bucket
    await SnapshotStore(bus).save(forged)
    entry = await SessionStates(bus, log).entry(sid)
    assert encode_state(entry.state) == await _folded(log, sid)


async def test_an_event_delivered_after_a_read_went_past_it_is_noticed(
        bus: Bus, sid: str) -> None:
    # On a cluster a read of the log can reach past an event its consumer delivers only
    # later; the entry tells it from the events it folded, so the actor folds the log again.
    log = EventLog(bus)
    await _append_rejections(log, sid, 3)
    states = SessionStates(bus, log)
    entry = await states.entry(sid)
    seqs = list(entry.recent)
    assert len(seqs) == 3 and not any(entry.missed(s) for s in seqs)
    assert not entry.missed(seqs[-1] + 1)  # ahead of the state: folded when it comes
    assert not entry.missed(seqs[0] - 1)  # before what is remembered: taken as folded
    # A fold that skipped the middle one (as a read that went past it would have):
    skipped = Entry(SessionState(session_id=sid))
    for stored in await log.read_session(sid):
        if stored.seq != seqs[1]:
            states.fold(skipped, stored.seq, stored.event)
    assert skipped.missed(seqs[1]) and not skipped.missed(seqs[2])
    await states.rebuild(skipped)
    assert skipped.state.event_count == 3 and not skipped.missed(seqs[1])
    # A log that cannot be read up to the state (a replica behind, for longer than the
    # reads are tried): an error worth another delivery, not a decision on a state known
    # to lack an event.
    ahead = Entry(SessionState(session_id=sid, last_seq=seqs[-1] + 1))
    with pytest.raises(BusTimeoutError, match=f"up to seq {seqs[-1] + 1}"):
        await states.rebuild(ahead, attempts=2)
    assert ahead.state.last_seq == seqs[-1] + 1 and ahead.state.event_count == 0


async def test_a_session_whose_oldest_events_were_purged_loads_from_its_snapshot(
        bus: Bus, nats_server: EmbeddedServer, sid: str) -> None:
    # An operator trimmed the log (limits, a purge): the snapshot holds what came before
    # the head that is left, even when that head fits in one read.
    log = EventLog(bus)
    await _append_rejections(log, sid, 30)
    writer = SessionStates(bus, log, snapshot_every=20)
    whole = encode_state((await writer.entry(sid)).state)
    for task in list(writer._saving):
        await task
    snap = await SnapshotStore(bus).load(sid)
    assert snap is not None and snap.event_count >= 20
    seqs = [s.seq for s in await log.read_session(sid)]
    admin = await connect(nats_server.url_for("admin"), name="tests-admin")
    try:
        await admin.js.purge_stream("TOOLBUS_EVENTS", subject=f"toolbus.evt.{sid}.>",
                                    seq=seqs[10])  # the first ten are gone
    finally:
        await admin.close()
    assert len(await log.read_session(sid)) == 20
    cold = await SessionStates(bus, log).entry(sid)
    assert encode_state(cold.state) == whole


async def test_a_cold_session_is_copied_from_the_peer_when_it_holds_the_event(
        bus: Bus, sid: str) -> None:
    # The planner's states borrow from the session actor's of the same process: a session
    # new to the planner needs no read of the bus when the peer already folded the event
    # being handled; one the peer is behind on is read from the log as before.
    log = EventLog(bus)
    await _append_rejections(log, sid, 12)
    peer = SessionStates(bus, log)
    held = await peer.entry(sid)
    last = held.state.last_seq
    reads: list[str] = []
    real_head, real_read = log.read_head, log.read_session

    async def head(session_id: str):  # type: ignore[no-untyped-def]
        reads.append("head")
        return await real_head(session_id)

    async def read(session_id: str, **kw):  # type: ignore[no-untyped-def]
        reads.append("read")
        return await real_read(session_id, **kw)

    log.read_head, log.read_session = head, read  # type: ignore[method-assign]
    try:
        borrower = SessionStates(bus, log)
        borrower.peer = peer
        copied = await borrower.entry(sid, at_least=last)
        assert reads == []
        assert copied.state is not held.state  # a copy: each actor folds its own
        assert encode_state(copied.state) == encode_state(held.state)
        assert encode_state(copied.state) == await _folded(log, sid)
        reads.clear()

        # An event the peer has not folded yet: read from the bus, as without a peer.
        await _append_rejections(log, sid, 1, start=12)
        newest = (await real_read(sid))[-1].seq
        other = SessionStates(bus, log)
        other.peer = peer
        loaded = await other.entry(sid, at_least=newest)
        assert reads == ["head"] and loaded.state.last_seq == newest
        assert held.state.last_seq == last  # the peer's own state is left alone
    finally:
        log.read_head, log.read_session = real_head, real_read  # type: ignore[method-assign]


async def test_a_new_session_the_peer_is_writing_is_waited_for_not_read(
        bus: Bus, sid: str) -> None:
    # The session actor takes a session it does not hold as new and writes its first
    # event checked against "none yet"; the planner, handed that event before the session
    # actor has its acknowledgement, waits for the write instead of reading the bus.
    log = EventLog(bus)
    peer = SessionStates(bus, log)
    new = peer.assume_new(sid)
    assert new is not None and new.state.last_seq == 0
    assert peer.assume_new(sid) is None  # one first write at a time
    reads: list[str] = []
    real_head = log.read_head

    async def head(session_id: str):  # type: ignore[no-untyped-def]
        reads.append("head")
        return await real_head(session_id)

    log.read_head = head  # type: ignore[method-assign]
    try:
        borrower = SessionStates(bus, log)
        borrower.peer = peer
        waiting = asyncio.create_task(borrower.entry(sid, at_least=1))
        # The writer's own consumer, handed the event before the write's acknowledgement,
        # waits for it too, and then has the written entry itself.
        own = asyncio.create_task(peer.entry(sid))
        await asyncio.sleep(0.05)
        assert not waiting.done() and not own.done()
        async with new.lock:
            await peer.write(new, [Append(RequestRejected(
                session_id=sid, at=0.0, actor="test", reason="test", message="first"),
                f"{sid}:test:first")])
        peer.adopt(new)
        copied = await asyncio.wait_for(waiting, 5)
        assert reads == [] and copied.state.last_seq == new.state.last_seq >= 1
        assert encode_state(copied.state) == await _folded(log, sid)
        assert peer.peek(sid) is new and await asyncio.wait_for(own, 5) is new

        # A session with a past: the checked write conflicts, nothing is stored, and the
        # entry is abandoned (whoever waited reads the bus).
        again = SessionStates(bus, log)
        stale = again.assume_new(sid)
        assert stale is not None
        try:
            async with stale.lock:
                await again.write(stale, [Append(RequestRejected(
                    session_id=sid, at=0.0, actor="test", reason="test", message="again"),
                    f"{sid}:test:again")])
        except ConcurrencyError:
            again.abandon(stale)
        else:
            raise AssertionError("a write checked against 'no event yet' was stored")
        assert again.peek(sid) is None and again.assume_new(sid) is not None
        assert len(await log.read_session(sid)) == 1
    finally:
        log.read_head = real_head  # type: ignore[method-assign]


async def test_a_state_behind_an_event_handed_back_reads_the_log_past_it(
        bus: Bus, sid: str) -> None:
    """An event handed back unfolded (`handed_back`) leaves the state behind it until a
    read of the log in order reaches it; a read that does not (a replica behind, on a
    cluster) is an error worth another delivery, not a state folded past a gap."""
    from schemas.errors import BusError

    log = EventLog(bus)
    await _append_rejections(log, sid, 3)
    states = SessionStates(bus, log)
    entry = await states.entry(sid)
    first = entry.state.last_seq
    await _append_rejections(log, sid, 2, start=3)
    last = max(s.seq for s in await log.read_session(sid))
    states.handed_back(sid, last - 1)
    assert entry.behind
    entry.settled = True
    async with entry.lock:
        await states.read_past_handed_back(entry)
    assert not entry.behind and entry.state.last_seq == last > first
    assert not entry.settled  # events came in: decided again
    assert encode_state(entry.state) == await _folded(log, sid)
    states.handed_back(sid, last + 1_000)  # never stored
    async with entry.lock:
        with pytest.raises(BusError, match=f"seq {last + 1_000}"):
            await states.read_past_handed_back(entry, attempts=2)
    assert entry.behind


async def test_a_session_evicted_from_memory_is_read_again_not_taken_as_new(
        bus: Bus, sid: str) -> None:
    # More sessions than the cache holds: the one evicted has a past, so its next request
    # reads it instead of writing on the assumption that it is new (and conflicting).
    log = EventLog(bus)
    states = SessionStates(bus, log, size=1)
    first = states.assume_new(sid)
    assert first is not None
    async with first.lock:
        await states.write(first, [Append(RequestRejected(
            session_id=sid, at=0.0, actor="test", reason="test", message="first"),
            f"{sid}:test:first")])
    states.adopt(first)
    other = await states.entry(f"{sid}-other")  # evicts the first
    assert states.peek(sid) is None and states.peek(other.state.session_id) is other
    assert states.assume_new(sid) is None
    assert (await states.entry(sid)).state.last_seq == first.state.last_seq


async def test_a_state_over_a_mebibyte_is_snapshotted_up_to_the_servers_payload(
        bus: Bus, sid: str) -> None:
    # A soak's long sessions passed a fixed 1 MiB at ~5,000 events: their snapshot froze
    # there, and each cold start folded a tail that grew with every turn.
    store = SnapshotStore(bus)
    state = SessionState(session_id=sid, event_count=9000,
                         data={"blob": "x" * (3 * 1024 * 1024)})
    assert await store.save(state)  # the suite's server takes 8 MiB messages
    loaded = await store.load(sid)
    assert loaded is not None and encode_state(loaded) == encode_state(state)
    too_big = SessionState(session_id=sid, event_count=9001,
                           data={"blob": "x" * bus.nc.max_payload})
    assert not await store.save(too_big)  # not for this server: the last one stays
    kept = await store.load(sid)
    assert kept is not None and kept.event_count == 9000
