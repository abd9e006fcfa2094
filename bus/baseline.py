"""The floor a benchmark compares toolbus with: raw JetStream, raw request/reply, and a bare
agent turn (its hops and model calls alone, between the same processes)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
from nats.aio.msg import Msg
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    RePublish,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)

from bus.connection import Bus

Op = Callable[[int], Awaitable[None]]


@contextlib.asynccontextmanager
async def raw_ops(bus: Bus, responder: Bus, payload: bytes) -> AsyncIterator[tuple[Op, Op]]:
    """(publish+ack to a file stream, request/reply to an echo responder), cleaned up."""
    await bus.js.add_stream(StreamConfig(name="BENCH_RAW", subjects=["bench.raw.>"],
                                         storage=StorageType.FILE))

    async def on_req(msg: Msg) -> None:
        await msg.respond(msg.data)

    sub = await responder.nc.subscribe("bench.rr", cb=on_req)
    await responder.nc.flush()

    async def publish(i: int) -> None:
        await bus.js.publish("bench.raw.x", payload)

    async def request(i: int) -> None:
        await bus.nc.request("bench.rr", payload, timeout=5)

    try:
        yield publish, request
    finally:
        await sub.unsubscribe()
        await bus.js.delete_stream("BENCH_RAW")


async def _consume(bus: Bus, subject: str, durable: str,
                   cb: Callable[[Msg], Awaitable[None]], *,
                   deliver: DeliverPolicy = DeliverPolicy.NEW) -> Any:
    """A durable push consumer of new messages on `subject` (`deliver`: all of them, for a
    work queue), acked by `cb`."""
    return await bus.js.subscribe(subject, durable=durable, cb=cb, manual_ack=True,
                                  config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT,
                                                        deliver_policy=deliver))


async def _until_delivered(bus: Bus, waiting: dict[Any, asyncio.Future[None]], key: Any,
                           subject: str, body: bytes) -> None:
    """Publish `body` and wait (bounded) until `waiting[key]` is set by its last hop."""
    done = waiting[key] = asyncio.get_running_loop().create_future()
    try:
        await bus.js.publish(subject, body)
        await asyncio.wait_for(done, 10)
    finally:
        waiting.pop(key, None)


@contextlib.asynccontextmanager
async def raw_chain(bus: Bus, other: Bus, hops: int) -> AsyncIterator[Op]:
    """An op that is `hops` JetStream hops one after another, as an event-sourced step
    is: publish to a file stream and wait for the ack, the message is delivered to a
    durable consumer on the other connection, which acks it and publishes the next. The
    op ends when the last one is delivered. Nothing is decoded or decided: the bare cost
    of the bus, in this process."""
    if hops < 1:
        raise ValueError("a chain has at least one hop")
    await bus.js.add_stream(StreamConfig(name="BENCH_CHAIN", subjects=["bench.chain.>"],
                                         storage=StorageType.FILE))
    conns = (bus, other)
    waiting: dict[bytes, asyncio.Future[None]] = {}

    async def on_msg(msg: Msg) -> None:
        await msg.ack()
        hop = int(msg.subject.rsplit(".", 1)[1]) + 1
        if hop < hops:
            await conns[hop % 2].js.publish(f"bench.chain.{hop % 2}.{hop}", msg.data)
        else:
            done = waiting.pop(msg.data, None)
            if done is not None and not done.done():
                done.set_result(None)

    subs = [await _consume(c, f"bench.chain.{i}.*", f"bench-chain-{i}", on_msg)
            for i, c in enumerate(conns)]

    async def op(i: int) -> None:
        key = str(i).encode()
        await _until_delivered(bus, waiting, key, "bench.chain.0.0", key)

    try:
        yield op
    finally:
        for sub in subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        await bus.js.delete_stream("BENCH_CHAIN")


# --- the bare agent turn ------------------------------------------------------------------
#
# The least a turn of `toolbus bench agent` can cost with its shape (the request, a model
# call, a tool in another process, a model call, the end) when every step is a stored
# event: four JetStream hops between the same processes (the client, an actor process, a
# worker process), each delivered to a durable consumer, decoded, re-encoded, published
# and acked, and the same two model round trips. Nothing else: no state, no checks.

BARE_STREAM = "BENCH_BARE"
BARE_PREFIX = "bench.bare"
_BARE_CONSUMERS = {"actor": ("req", "result"), "worker": ("call",)}


async def _serve_until_cancelled(subs: list[Any], ready: Callable[[], None]) -> None:
    ready()
    try:
        await asyncio.Event().wait()
    finally:
        for sub in subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()


@contextlib.asynccontextmanager
async def bare_stream(bus: Bus) -> AsyncIterator[None]:
    """The stream the bare turn's hops are stored in, deleted afterwards."""
    await bus.js.add_stream(StreamConfig(name=BARE_STREAM, subjects=[f"{BARE_PREFIX}.>"],
                                         storage=StorageType.FILE))
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            await bus.js.delete_stream(BARE_STREAM)


async def serve_bare(bus: Bus, role: str, ready: Callable[[], None],
                     ask: Callable[[int], Awaitable[None]] | None = None) -> None:
    """Consume the bare turn's hops of `role` until cancelled: `actor` answers a request
    with the model's first round trip (`ask(0)`) and a call for the worker, the call's
    result with the second (`ask(1)`) and the end; `worker` answers a call with its
    result. `ready` is called once its consumers are made."""

    async def on_msg(msg: Msg) -> None:
        kind, key = msg.subject.rsplit(".", 2)[1:]
        body = msgspec.json.decode(msg.data)
        if kind == "req":
            assert ask is not None
            await ask(0)
            nxt = "call"
        elif kind == "call":
            nxt = "result"
        else:
            assert ask is not None
            await ask(1)
            nxt = "done"
        await bus.js.publish(f"{BARE_PREFIX}.{nxt}.{key}", msgspec.json.encode(body))
        await msg.ack()

    subs = [await _consume(bus, f"{BARE_PREFIX}.{kind}.*", f"bench-bare-{kind}", on_msg)
            for kind in _BARE_CONSUMERS[role]]
    await _serve_until_cancelled(subs, ready)


@contextlib.asynccontextmanager
async def bare_client(bus: Bus) -> AsyncIterator[Op]:
    """An op that is one bare turn: the request published, until its end is delivered
    here (the stream and both other processes serving it)."""
    waiting: dict[str, asyncio.Future[None]] = {}

    async def on_done(msg: Msg) -> None:
        await msg.ack()
        done = waiting.pop(msg.subject.rsplit(".", 1)[1], None)
        if done is not None and not done.done():
            done.set_result(None)

    sub = await _consume(bus, f"{BARE_PREFIX}.done.*", "bench-bare-done", on_done)

    async def op(i: int) -> None:
        await _until_delivered(bus, waiting, str(i), f"{BARE_PREFIX}.req.{i}",
                               b'{"message":"say %d"}' % i)

    try:
        yield op
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


# --- the bare event-model turn ------------------------------------------------------------
#
# The same turn with the events toolbus's event model stores for it and the deliveries it
# makes, and nothing else: the request stored in a work queue; eleven events stored (each
# with its message id), each delivered to a durable consumer of every session event (the
# session actor's) and acked; `turn.requested` and `call.succeeded` delivered to the
# planner's consumer, `call.requested` to the approval's, `call.dispatched` to the worker's,
# `call.succeeded` to the compressor's; the model's text deltas published live; the end
# republished live to the client. Bodies are decoded and re-encoded; no state, no checks.
# What the event model costs on this machine before toolbus does any work of its own.

BARE_EVENTS_STREAM = "BENCH_BARE_EVENTS"
BARE_REQUESTS_STREAM = "BENCH_BARE_REQUESTS"
_BEV = "bench.barev"  # events: bench.barev.<key>.<type>
_BREQ = "bench.barevreq"  # requests: bench.barevreq.<key>
_BLIVE = "bench.barevlive"  # the events republished: bench.barevlive.<key>.<type>
# Each event's consumers, past the session actor's, as toolbus's actors consume them.
_BARE_EVENT_CONSUMERS = {"actor": {"planner-turn": "turn.requested",
                                   "planner-result": "call.succeeded",
                                   "approval": "call.requested",
                                   "compressor": "call.succeeded"},
                         "worker": {"executor": "call.dispatched"}}
BARE_EVENTS_STORED = 11  # turn.requested, 2 x (model.requested, model.responded), ...
BARE_EVENTS_DELIVERIES = 16  # the session actor's 11, and 5 above
_BARE_DELTAS = 3  # the sample model's text deltas in the turn's last round trip


@contextlib.asynccontextmanager
async def bare_events_streams(bus: Bus) -> AsyncIterator[None]:
    """The streams of the bare event-model turn, deleted afterwards."""
    await bus.js.add_stream(StreamConfig(name=BARE_REQUESTS_STREAM, subjects=[f"{_BREQ}.*"],
                                         retention=RetentionPolicy.WORK_QUEUE,
                                         storage=StorageType.FILE))
    await bus.js.add_stream(StreamConfig(
        name=BARE_EVENTS_STREAM, subjects=[f"{_BEV}.>"], storage=StorageType.FILE,
        republish=RePublish(src=f"{_BEV}.*.>", dest=f"{_BLIVE}.{{{{wildcard(1)}}}}.>")))
    try:
        yield
    finally:
        for name in (BARE_EVENTS_STREAM, BARE_REQUESTS_STREAM):
            with contextlib.suppress(Exception):
                await bus.js.delete_stream(name)


async def serve_bare_events(bus: Bus, role: str, ready: Callable[[], None],
                            ask: Callable[[int], Awaitable[None]] | None = None) -> None:
    """Consume the bare event-model turn's events of `role` until cancelled: `actor` is
    the session actor (the request, and every event), the planner (`turn.requested`:
    the first model round trip, `ask(0)`, and the call; `call.succeeded`: the second,
    `ask(1)`, and the end), the approval and the compressor; `worker` the executor."""

    def publish(key: str, kind: str, body: bytes) -> Awaitable[Any]:
        return bus.js.publish(f"{_BEV}.{key}.{kind}", body,
                              headers={"Nats-Msg-Id": f"{key}:{kind}"})

    async def on_request(msg: Msg) -> None:
        key = msg.subject.rsplit(".", 1)[1]
        body = msgspec.json.encode(msgspec.json.decode(msg.data))
        await publish(key, "turn.requested", body)
        await msg.ack()

    async def on_event(msg: Msg) -> None:  # the session actor: every event, decoded
        msgspec.json.decode(msg.data)
        await msg.ack()

    async def plan(msg: Msg, i: int, then: tuple[str, ...], deltas: int) -> None:
        """The planner: `model.requested` stored while the model is asked (`ask(i)`), its
        text deltas published live, then the events its answer makes due."""
        assert ask is not None
        key = msg.subject.split(".")[2]
        body = msgspec.json.encode(msgspec.json.decode(msg.data))
        asked = asyncio.ensure_future(publish(key, "model.requested", body))
        await ask(i)
        for _ in range(deltas):
            await bus.nc.publish(f"{_BLIVE}.{key}.model.delta", b'{"text":"x"}')
        await asyncio.gather(asked, *(publish(key, kind, body) for kind in then))
        await msg.ack()

    async def on_turn(msg: Msg) -> None:
        await plan(msg, 0, ("model.responded", "call.requested", "call.approved",
                            "call.dispatched"), 0)

    async def on_call(msg: Msg) -> None:
        key = msg.subject.split(".")[2]
        body = msgspec.json.encode(msgspec.json.decode(msg.data))
        await asyncio.gather(publish(key, "call.started", body),
                             publish(key, "call.succeeded", body))
        await msg.ack()

    async def on_result(msg: Msg) -> None:
        await plan(msg, 1, ("model.responded", "turn.completed"), _BARE_DELTAS)

    async def on_ack(msg: Msg) -> None:  # the approval's and the compressor's
        msgspec.json.decode(msg.data)
        await msg.ack()

    handlers: dict[str, Callable[[Msg], Awaitable[None]]] = {
        "planner-turn": on_turn, "planner-result": on_result, "approval": on_ack,
        "compressor": on_ack, "executor": on_call}
    subs = []
    if role == "actor":
        subs.append(await _consume(bus, f"{_BREQ}.*", "bench-barev-requests", on_request,
                                   deliver=DeliverPolicy.ALL))
        subs.append(await _consume(bus, f"{_BEV}.>", "bench-barev-session", on_event))
    for name, kind in _BARE_EVENT_CONSUMERS[role].items():
        subs.append(await _consume(bus, f"{_BEV}.*.{kind}", f"bench-barev-{name}",
                                   handlers[name]))
    await _serve_until_cancelled(subs, ready)


@contextlib.asynccontextmanager
async def bare_events_client(bus: Bus) -> AsyncIterator[Op]:
    """An op that is one bare event-model turn: the request stored, until its end is
    republished here (the streams and both other processes serving it)."""
    waiting: dict[str, asyncio.Future[None]] = {}

    async def on_end(msg: Msg) -> None:
        done = waiting.pop(msg.subject.split(".")[2], None)
        if done is not None and not done.done():
            done.set_result(None)

    sub = await bus.nc.subscribe(f"{_BLIVE}.*.turn.completed", cb=on_end)
    turns = itertools.count()  # each turn's own key: its events' message ids are new

    async def op(i: int) -> None:
        key = f"t{next(turns)}"
        await _until_delivered(bus, waiting, key, f"{_BREQ}.{key}",
                               b'{"message":"say %d"}' % i)

    try:
        yield op
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
