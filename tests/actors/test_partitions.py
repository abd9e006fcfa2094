"""Partitioned session actors (issue 14): sessions are spread over N partitions, each
consumed by one process at a time through leases (bus/partitions.py); a process that dies
hands its partitions over within seconds, and no turn is lost."""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import msgspec
import nats.js.errors
import nats.js.kv

from bus.client import ToolbusClient
from bus.connection import Bus, connect
from bus.eventlog import EventLog
from bus.headers import Header
from bus.partitions import PartitionOwner
from bus.server import free_port
from bus.streams import stored_partitions
from bus.subjects import LEASES_BUCKET, partition
from schemas.defaults import LEASE_RENEW_S, LEASE_TTL_S
from schemas.events import CallFailed, CallSucceeded, TurnCompleted
from tests.conftest import Proc, role_url


class _Member:
    """A lease holder that only records what it holds."""

    def __init__(self, bus: Bus, group: str, name: str, partitions: int) -> None:
        self.held: set[int] = set()
        self.owner = PartitionOwner(bus, group, name, on_acquire=self._take,
                                    on_release=self._drop, partitions=partitions,
                                    renew_s=0.2)

    async def _take(self, part: int) -> None:
        self.held.add(part)

    async def _drop(self, part: int) -> None:
        self.held.discard(part)


async def _until(predicate: Any, timeout: float) -> float:
    start = time.monotonic()
    async with asyncio.timeout(timeout):
        while not predicate():  # noqa: ASYNC110 - polling state changed by other tasks
            await asyncio.sleep(0.05)
    return time.monotonic() - start


async def test_members_share_the_partitions_and_take_over_those_of_a_dead_one(
        bus: Bus) -> None:
    group = f"t-{uuid.uuid4().hex[:8]}"
    a, b = _Member(bus, group, "a", 8), _Member(bus, group, "b", 8)
    await a.owner.start()
    assert a.held == set(range(8))  # alone: all of them, before start returns
    await b.owner.start()
    await _until(lambda: len(a.held) == len(b.held) == 4, timeout=5)
    assert a.held.isdisjoint(b.held)
    # b dies: its loop stops, nothing is given back; its leases expire.
    assert b.owner._task is not None
    b.owner._task.cancel()
    took = await _until(lambda: len(a.held) == 8, timeout=LEASE_TTL_S + 5)
    assert took <= LEASE_TTL_S + 2, took
    await a.owner.stop()
    assert a.held == set()
    # Stopping gave every lease back (and its membership): nothing waits to expire.
    kv = await bus.js.key_value(LEASES_BUCKET)
    try:
        keys = await kv.keys()
    except nats.js.errors.NoKeysError:
        keys = []
    assert not [k for k in keys if k.startswith(f"{group}.")], keys


async def test_a_member_starting_as_a_lease_expires_under_its_take_starts(
        bus: Bus, monkeypatch: Any) -> None:
    """nats-py's `create` of a key that exists reads it back to tell a deleted one; a
    lease that expired in between made that read raise KeyNotFoundError, which ended the
    new member's first round and its process's start (found by killing `toolbus up`
    processes: tests/actors/test_planner_chaos.py). Here the lease's message is removed,
    as its TTL does, right before that read."""
    group = f"t-{uuid.uuid4().hex[:8]}"
    a, b = _Member(bus, group, "a", 1), _Member(bus, group, "b", 1)
    await a.owner.start()
    read = nats.js.kv.KeyValue._get

    async def expiring(kv: Any, key: str, revision: int | None = None) -> Any:
        if key == f"{group}.p0":
            await bus.js.purge_stream(f"KV_{LEASES_BUCKET}",
                                      subject=f"$KV.{LEASES_BUCKET}.{key}")
        return await read(kv, key, revision)

    monkeypatch.setattr(nats.js.kv.KeyValue, "_get", expiring)
    try:
        await b.owner.start()  # raised KeyNotFoundError
    finally:
        monkeypatch.undo()
        await b.owner.stop()
        await a.owner.stop()


async def test_lease_rounds_leave_no_consumer_behind(bus: Bus) -> None:
    # Each round counted the members with `kv.keys()`, which leaves an ephemeral consumer
    # for minutes: at a round a second per member, the bucket's stream reached the
    # server's limit of consumers, and every round failed from then on.
    group = f"t-{uuid.uuid4().hex[:8]}"
    a, b = _Member(bus, group, "a", 4), _Member(bus, group, "b", 4)
    stream = f"KV_{LEASES_BUCKET}"
    before = (await bus.js.stream_info(stream)).state.consumer_count
    await a.owner.start()
    await b.owner.start()
    try:
        for _ in range(20):
            assert await a.owner._members() == 2
            await a.owner._round()
        await _until(lambda: len(a.held) == len(b.held) == 2, timeout=5)
    finally:
        await a.owner.stop()
        await b.owner.stop()
    assert (await bus.js.stream_info(stream)).state.consumer_count <= before


async def test_a_slow_release_never_lets_the_leases_kept_lapse(bus: Bus) -> None:
    """Giving a partition up waits for its messages in hand (a model call can take a
    minute). Meanwhile the leases kept are renewed: were they not, a member joining would
    take them while this one still consumes them."""
    group = f"t-{uuid.uuid4().hex[:8]}"
    gate = asyncio.Event()
    a, b = _Member(bus, group, "a", 8), _Member(bus, group, "b", 8)
    released: list[int] = []

    async def slow_drop(part: int) -> None:
        released.append(part)
        async with asyncio.timeout(LEASE_TTL_S * 4):
            await gate.wait()
        a.held.discard(part)

    a.owner._on_release = slow_drop
    taken_by_b: set[int] = set()

    async def b_take(part: int) -> None:
        taken_by_b.add(part)
        b.held.add(part)

    b.owner._on_acquire = b_take
    await a.owner.start()
    await b.owner.start()
    try:
        await _until(lambda: len(released) == 4, timeout=5)
        # Twice the leases' TTL with every release still in hand (time must pass here).
        await asyncio.sleep(LEASE_TTL_S * 2)
        kept = set(range(8)) - set(released)
        assert taken_by_b.isdisjoint(kept), (taken_by_b, kept)
        assert all(a.owner.holds(p) for p in kept)
        assert not any(a.owner.holds(p) for p in released)
        gate.set()
        await _until(lambda: taken_by_b == set(released), timeout=5)
    finally:
        gate.set()
        await b.owner.stop()
        await a.owner.stop()


async def test_a_member_whose_renewals_stall_stops_holding_its_partitions_for_sure(
        bus: Bus) -> None:
    """A process stopped or starved past its leases may have lost its partitions without
    knowing: it no longer `holds` them, so it leaves their messages to the new owner."""
    group = f"t-{uuid.uuid4().hex[:8]}"
    a = _Member(bus, group, "a", 4)
    await a.owner.start()
    assert all(a.owner.holds(p) for p in range(4))
    assert a.owner._task is not None
    a.owner._task.cancel()  # the renewals stall; nothing is given up
    took = await _until(lambda: not any(a.owner.holds(p) for p in range(4)),
                        timeout=LEASE_TTL_S + 2)
    assert took <= LEASE_TTL_S + 0.5, took
    assert a.held == set(range(4))
    await a.owner.stop()


async def test_a_lease_round_slower_than_the_ttl_still_holds_every_partition(
        bus: Bus) -> None:
    """Renewals that each take a while (an R3 bucket on a loaded machine, a cluster
    electing) must not leave a member that never lost its leases unsure of them: it would
    drop every event of those partitions, again at each redelivery. Eight renewals of
    0.5 s one after another took 4 s, over the 3 s TTL, and `holds` counted from the start
    of the round said no for all of them once it ended."""
    group = f"t-{uuid.uuid4().hex[:8]}"
    a = _Member(bus, group, "a", 8)
    await a.owner.start()
    assert a.owner._task is not None and a.owner._kv is not None
    a.owner._task.cancel()  # the rounds are run here, one at a time
    kv = a.owner._kv
    real_update = kv.update

    async def slow_update(*args: Any, **kwargs: Any) -> int:
        await asyncio.sleep(0.5)  # the bucket answers, slowly
        return await real_update(*args, **kwargs)

    kv.update = slow_update  # type: ignore[method-assign]
    try:
        for _ in range(3):
            await a.owner._round()
            assert a.held == set(range(8))
            assert [p for p in range(8) if not a.owner.holds(p)] == []
    finally:
        kv.update = real_update  # type: ignore[method-assign]
        await a.owner.stop()


async def test_a_message_of_a_partition_whose_renewal_is_late_waits_for_the_next_round(
        bus: Bus) -> None:
    """A member that still owns a partition but is not sure of it (its renewal late) lets
    a message wait for the next round rather than hand it back: handed back, it came
    again only after its ack wait, was handed back again while the rounds stayed slow,
    and each time counted as a delivery, until the kernel gave it up."""
    group = f"t-{uuid.uuid4().hex[:8]}"
    a = _Member(bus, group, "a", 2)
    await a.owner.start()
    try:
        a.owner._sure_until[0] = 0.0  # as after a round slower than the TTL
        assert not a.owner.holds(0)
        start = time.monotonic()
        assert await a.owner.surely_holds(0)  # renewed by the next round (each second)
        assert time.monotonic() - start <= LEASE_RENEW_S + 1.0
        assert not await a.owner.surely_holds(5)  # not ours: at once
        assert a.owner._task is not None
        a.owner._task.cancel()  # the rounds stall: waited for as long as asked, no more
        a.owner._sure_until[1] = 0.0
        start = time.monotonic()
        assert not await a.owner.surely_holds(1, wait=0.3)
        assert 0.3 <= time.monotonic() - start < 1.5
    finally:
        await a.owner.stop()


async def _calls(client: ToolbusClient, sessions: list[str]) -> list[Any]:
    return list(await asyncio.gather(*(
        client.call(sid, [{"tool": "built-in:echo", "arguments": {"sid": sid}}], timeout=60)
        for sid in sessions)))


async def test_two_session_actor_processes_split_the_sessions_and_survive_a_kill(
        tmp_path: Path) -> None:
    data = tmp_path / "data"
    port = free_port()
    up = Proc("up", "--port", str(port), "--data-dir", str(data), "--instance", "a",
              ready="stop:")
    second: Proc | None = None
    try:
        await up.wait_ready()
        url = role_url(data, "actor")
        second = Proc("actor", "session", "--nats", url, "--instance", "b",
                      ready="session actor")
        await second.wait_ready()
        bus = await connect(url, name="partition-test")
        bus.partitions = await stored_partitions(bus)
        client = ToolbusClient(bus)
        writers: dict[str, set[str]] = {}

        async def on_live(msg: Any) -> None:
            body = msgspec.json.decode(msg.data)
            writer = (msg.headers or {}).get(Header.WRITER.value)
            if body.get("actor") == "session" and writer:
                writers.setdefault(body["session_id"], set()).add(writer)

        sub = await bus.nc.subscribe("toolbus.live.>", cb=on_live)
        kv = await bus.js.key_value(LEASES_BUCKET)

        async def owners() -> dict[int, str]:
            out = {}
            for p in range(bus.partitions):
                try:
                    out[p] = (await kv.get(f"session.p{p}")).value.decode()
                except Exception:
                    pass
            return out

        # Both processes hold partitions (the second took its share).
        async with asyncio.timeout(10):
            while set((await owners()).values()) != {"a-session", "b-session"}:  # noqa: ASYNC110
                await asyncio.sleep(0.1)
        run = uuid.uuid4().hex[:6]
        first = [f"p-{run}-{i}" for i in range(48)]
        ends = await _calls(client, first)
        assert all(isinstance(e, TurnCompleted) and e.ok for e in ends)
        # Each session decided by one process; both decided some.
        assert all(len(w) == 1 for sid, w in writers.items() if sid in first), writers
        assert set().union(*(writers[s] for s in first)) == {"a-session", "b-session"}
        held = await owners()
        n = len(held)
        for sid in first:
            assert writers[sid] == {held[partition(sid, n)]}

        # Calls in flight while the second process is killed: none is lost.
        later = [f"q-{run}-{i}" for i in range(96)]
        pending = asyncio.ensure_future(_calls(client, later))
        await asyncio.sleep(0.3)
        second.kill()
        killed = time.monotonic()
        async with asyncio.timeout(15):
            while (await owners()) != dict.fromkeys(range(n), "a-session"):  # noqa: ASYNC110
                await asyncio.sleep(0.1)
        moved = time.monotonic() - killed
        assert moved <= 10, moved
        ends = await pending
        assert all(isinstance(e, TurnCompleted) and e.ok for e in ends), \
            [e for e in ends if not (isinstance(e, TurnCompleted) and e.ok)][:3]
        # Every call ended exactly once.
        log = EventLog(bus)
        for sid in later:
            stored = [s.event for s in await log.read_session(sid)]
            assert len([e for e in stored if isinstance(e, CallSucceeded | CallFailed)]) == 1
        await sub.unsubscribe()
        await client.close()
        await bus.close()
        print(f"\npartitions moved {moved:.1f} s after the kill")
    finally:
        if second is not None:
            second.stop(signal.SIGKILL)  # closes its pipes too
        assert up.stop() == 0


async def test_two_planners_share_the_partitions_and_each_session_has_one(
        bus: Bus, system: dict[str, Any], model: Any) -> None:
    from actors.llm.types import ModelSettings
    from actors.planner import Planner
    from tests.actors.test_planner import reply

    settings = ModelSettings(provider="openai", model="scripted",
                             base_url=f"http://127.0.0.1:{model.port}/v1", max_retries=0)
    planners = [Planner(bus, system["catalog"], settings, instance=f"planner-{i}")
                for i in range(2)]
    for p in planners:
        await p.start()
    client = ToolbusClient(bus)
    try:
        await _until(lambda: all(len(p.partitions) == bus.partitions // 2 for p in planners),
                     timeout=5)
        assert set(planners[0].partitions).isdisjoint(planners[1].partitions)
        sessions = [f"plan-{uuid.uuid4().hex[:6]}-{i}" for i in range(24)]
        model.script = [(200, reply("Done.")) for _ in sessions]
        ends = await asyncio.gather(*(client.ask(s, "Go.", timeout=30) for s in sessions))
        assert all(isinstance(e, TurnCompleted) and e.text == "Done." for e in ends), ends[:2]
        # Each session planned by the planner holding its partition: the writer header.
        log = EventLog(bus)
        used = set()
        for sid in sessions:
            owner = next(p for p in planners if partition(sid, bus.partitions) in p.partitions)
            raw = await log.read_session(sid)
            stored = [(s, s.event) for s in raw if s.event is not None]
            asked = [s for s, e in stored if e.actor == "planner"]
            assert asked
            writers = {await _writer(bus, s.seq) for s in asked}
            assert writers == {owner.instance}, (sid, writers)
            used |= writers
        assert used == {"planner-0", "planner-1"}
    finally:
        await client.close()
        for p in planners:
            await p.stop()


async def _writer(bus: Bus, seq: int) -> str | None:
    from bus.subjects import EVENTS_STREAM

    msg = await bus.js.get_msg(EVENTS_STREAM, seq, direct=True)
    return (msg.headers or {}).get(Header.WRITER.value)

