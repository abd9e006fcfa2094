"""The floor a benchmark compares toolbus with: raw JetStream and raw request/reply."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StorageType, StreamConfig

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

    subs = [await c.js.subscribe(f"bench.chain.{i}.*", durable=f"bench-chain-{i}",
                                 cb=on_msg, manual_ack=True,
                                 config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT,
                                                       deliver_policy=DeliverPolicy.NEW))
            for i, c in enumerate(conns)]

    async def op(i: int) -> None:
        key = str(i).encode()
        done = waiting[key] = asyncio.get_running_loop().create_future()
        try:
            await bus.js.publish("bench.chain.0.0", key)
            await asyncio.wait_for(done, 10)
        finally:
            waiting.pop(key, None)

    try:
        yield op
    finally:
        for sub in subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        await bus.js.delete_stream("BENCH_CHAIN")
