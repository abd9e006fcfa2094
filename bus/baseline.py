"""The floor a benchmark compares toolbus with: raw JetStream and raw request/reply."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from nats.aio.msg import Msg
from nats.js.api import StorageType, StreamConfig

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
