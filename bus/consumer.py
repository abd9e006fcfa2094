"""A continuous pull loop over a durable JetStream consumer.

Keeps pull requests outstanding on one inbox so messages arrive as soon as they are
stored (no fetch round trip per batch), bounds the work in flight, and optionally keeps
messages of one key (a session) in order while different keys run concurrently.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import math
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg

from bus.connection import Bus
from bus.headers import Header, Status
from bus.streams import ConsumerSpec, ensure_consumer
from bus.tasks import stop_task

log = logging.getLogger("toolbus.bus")


@dataclass(slots=True)
class Delivery:
    """One delivered message; the actor decides when to ack it."""

    subject: str
    data: bytes
    stream_seq: int
    num_delivered: int
    timestamp_ns: int
    _msg: Msg
    _loop: PullLoop | None = None

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """While its handler waits for work elsewhere (an agent call, for its child's
        turn), this message does not count against its loop's in-flight bound: the loop
        goes on pulling, so a wait on another message of the same consumer (an agent
        calling an agent) can never find every slot held by messages waiting likewise."""
        loop = self._loop
        if loop is None:
            yield
            return
        loop._step_out()
        try:
            yield
        finally:
            loop._in_flight += 1

    async def ack(self) -> None:
        # Fire-and-forget: a lost ack only means a redelivery, which every actor handles.
        msg = self._msg
        nc = msg._client
        if not nc.is_connected or not msg.reply or msg._ackd:
            await msg.ack()  # nats-py's own path, and its errors
            return
        _ack_later(nc, msg.reply)
        msg._ackd = True

    async def nak(self, delay: float | None = None) -> None:
        await self._msg.nak(delay=delay)

    async def in_progress(self) -> None:
        await self._msg.in_progress()

    async def term(self) -> None:
        await self._msg.term()

    @property
    def headers(self) -> dict[str, str] | None:
        """The message's headers (trace context among them), None when it has none."""
        return self._msg.headers


Handler = Callable[[Delivery], Awaitable[None]]

# Acks wait in the connection's buffer for whatever is written next (an event, a pull
# request, another actor's publish), at most this long: a socket write each, on loopback,
# cost both this process and the server about as much as the rest of a delivery, and
# nothing waits on them (a lost ack is a redelivery, which every actor handles).
_ACK_FLUSH_S = 0.002
_ack_flush_armed: weakref.WeakSet[Client] = weakref.WeakSet()


def _ack_later(nc: Client, reply: str) -> None:
    """Queue an ack (`+ACK`, an empty publish to the message's reply subject) on `nc`
    without waking its flusher, and make sure something flushes it soon."""
    cmd = b"PUB " + reply.encode() + b" 0\r\n\r\n"
    nc._pending.append(cmd)
    nc._pending_data_size += len(cmd)
    nc.stats["out_msgs"] += 1
    if nc not in _ack_flush_armed:
        _ack_flush_armed.add(nc)
        asyncio.get_running_loop().call_later(_ACK_FLUSH_S, _flush_acks, nc)


def _flush_acks(nc: Client) -> None:
    _ack_flush_armed.discard(nc)
    queue = nc._flush_queue
    if not nc._pending_data_size or queue is None or not queue.empty() or \
            not nc.is_connected:
        return
    flusher = nc._flusher_task
    if flusher is not None and not flusher.done():
        # What `Client._flush_pending` does, without a task: the flusher writes it all.
        queue.put_nowait(asyncio.get_running_loop().create_future())
    else:  # nats-py's own path, which writes inline when its flusher has ended
        task = asyncio.get_running_loop().create_task(nc._flush_pending())
        _flushing.add(task)
        task.add_done_callback(_flushing.discard)


_flushing: set[asyncio.Task[Any]] = set()


class PullLoop:
    def __init__(
        self,
        bus: Bus,
        spec: ConsumerSpec,
        handler: Handler,
        *,
        max_in_flight: int = 256,
        key: Callable[[str], str] | None = None,
        expires_s: float = 10.0,
        arrived: Callable[[Delivery], None] | None = None,
    ) -> None:
        """`arrived`: told of each message as it arrives, before it waits for its key's
        turn (to react at once to what must not wait, such as a cancellation)."""
        self._bus = bus
        self._arrived = arrived
        self._spec = spec
        self._handler = handler
        self._max = max_in_flight
        self._key = key
        self._expires_ns = int(expires_s * 1e9)
        self._heartbeat_ns = int(min(expires_s / 4, 2.0) * 1e9)
        self._outstanding = 0
        self._in_flight = 0
        self._queues: dict[str, collections.deque[Delivery]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        self._stopping = False
        self._last_seen = 0.0
        self._runner: asyncio.Task[None] | None = None
        self._keeper: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await ensure_consumer(self._bus, self._spec)
        self._runner = asyncio.create_task(self._run(), name=f"pull:{self._spec.durable}")
        if self._key is not None:
            self._keeper = asyncio.create_task(self._keep_queued_alive(),
                                               name=f"keep:{self._spec.durable}")

    async def _keep_queued_alive(self) -> None:
        """Messages waiting behind their key's current one (a session's next events while
        its model call runs) are kept from being redelivered: each is marked in progress
        every third of the ack wait. Only this process's death lets them go elsewhere."""
        period = max(self._spec.ack_wait_s / 3, 0.05)
        while True:
            await asyncio.sleep(period)
            for queue in list(self._queues.values()):
                for delivery in list(queue):
                    with contextlib.suppress(Exception):
                        await delivery.in_progress()

    async def stop(self, grace: float = 10.0) -> None:
        """Stop pulling, then let in-flight handlers finish for up to `grace` seconds."""
        self._stopping = True
        self._wake.set()
        if self._runner is not None:
            await self._runner
        try:
            if self._tasks:
                _, late = await asyncio.wait(set(self._tasks), timeout=grace)
                # Cancelled, and again while they run (a cancel can be lost: bus/tasks.py),
                # for at most `grace` more.
                for _ in range(max(1, math.ceil(grace))):
                    if not late:
                        break
                    for task in late:
                        task.cancel()
                    _, late = await asyncio.wait(late, timeout=min(1.0, grace))
        finally:
            # Only now: the messages in hand are kept from redelivery while they finish
            # (a grace longer than the ack wait would otherwise hand them to another
            # process, which would do their work again).
            await stop_task(self._keeper)

    async def _run(self) -> None:
        nc = self._bus.nc
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox, cb=self._on_msg)
        api = f"$JS.API.CONSUMER.MSG.NEXT.{self._spec.stream}.{self._spec.durable}"
        loop = asyncio.get_running_loop()
        self._last_seen = loop.time()
        watchdog = self._heartbeat_ns / 1e9 * 3
        reconnects = nc.stats["reconnects"]
        try:
            while not self._stopping:
                now = loop.time()
                if nc.stats["reconnects"] != reconnects:
                    # Pull requests die with the connection: ask again at once.
                    reconnects = nc.stats["reconnects"]
                    self._outstanding = 0
                elif self._outstanding and now - self._last_seen > watchdog:
                    # No heartbeat: the server lost our pull requests.
                    self._outstanding = 0
                want = self._max - self._in_flight - self._outstanding
                if want >= max(1, self._max // 2) and nc.is_connected:
                    req = {
                        "batch": want,
                        "expires": self._expires_ns,
                        "idle_heartbeat": self._heartbeat_ns,
                    }
                    try:
                        await nc.publish(api, json.dumps(req).encode(), reply=inbox)
                        self._outstanding += want
                        self._last_seen = now
                    except Exception as exc:  # reconnecting: try again shortly
                        log.debug("pull request for %s failed: %s", self._spec.durable, exc)
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=min(watchdog / 2, 0.5))
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _on_msg(self, msg: Msg) -> None:
        self._last_seen = asyncio.get_running_loop().time()
        hdrs = msg.headers
        # A status from the server has no reply subject; a stored message always has
        # its `$JS.ACK...` one, whatever headers its publisher gave it.
        if hdrs and not msg.data and not msg.reply and Header.STATUS.value in hdrs:
            status = hdrs[Header.STATUS.value]
            if status == Status.IDLE_HEARTBEAT:
                return
            pending = hdrs.get(Header.PENDING_MESSAGES.value)
            if pending is not None:
                self._outstanding = max(0, self._outstanding - int(pending))
            elif status in (Status.REQUEST_TIMEOUT, Status.CONFLICT, Status.NOT_FOUND):
                self._outstanding = 0
            if status == Status.CONFLICT:
                log.debug("%s: %s", self._spec.durable, hdrs.get(Header.DESCRIPTION.value))
            self._wake.set()
            return
        self._outstanding = max(0, self._outstanding - 1)
        if self._stopping:
            return  # not acked: redelivered to another process after ack_wait
        stream_seq, num_delivered, timestamp_ns = ack_metadata(msg)
        delivery = Delivery(
            subject=msg.subject,
            data=msg.data,
            stream_seq=stream_seq,
            num_delivered=num_delivered,
            timestamp_ns=timestamp_ns,
            _msg=msg,
            _loop=self,
        )
        self._in_flight += 1
        if self._arrived is not None:
            try:
                self._arrived(delivery)
            except Exception:  # a hint only: the handler still gets the message
                log.exception("%s: noticing a message failed", self._spec.durable)
        if self._key is None:
            self._spawn(self._handle(delivery))
            return
        key = self._key(msg.subject)
        queue = self._queues.get(key)
        if queue is not None:
            queue.append(delivery)  # its key's worker takes it next, in order
            return
        self._queues[key] = collections.deque((delivery,))
        self._spawn(self._drain(key))

    def _spawn(self, coro: Coroutine[None, None, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _drain(self, key: str) -> None:
        """One worker per key with messages waiting: handles them in delivery order,
        and ends when none are left (a new message then starts a new worker)."""
        queue = self._queues[key]
        try:
            while queue:
                await self._handle(queue[0])
                queue.popleft()
        finally:
            if self._queues.get(key) is queue:
                del self._queues[key]

    def _step_out(self) -> None:
        self._in_flight -= 1
        if self._max - self._in_flight - self._outstanding >= self._max // 2:
            self._wake.set()

    async def _handle(self, delivery: Delivery) -> None:
        try:
            await self._handler(delivery)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s: handler failed on %s", self._spec.durable, delivery.subject)
            with contextlib.suppress(Exception):
                await delivery.nak(delay=1.0)
        finally:
            self._in_flight -= 1
            if self._max - self._in_flight - self._outstanding >= self._max // 2:
                self._wake.set()


def ack_metadata(msg: Msg) -> tuple[int, int, int]:
    """(stream sequence, delivery count, timestamp ns) from a JetStream message's reply
    subject, read directly: nats-py's `msg.metadata` builds a datetime for every message.

    `$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ns>.<pending>`, or with
    `<domain>.<account hash>` after `ACK` (and a trailing token) on newer servers.
    """
    tokens = (msg.reply or "").split(".")
    if len(tokens) == 9 and tokens[1] == "ACK":
        return int(tokens[5]), int(tokens[4]), int(tokens[7])
    if len(tokens) >= 11 and tokens[1] == "ACK":
        return int(tokens[7]), int(tokens[6]), int(tokens[9])
    md = msg.metadata
    ts = int(md.timestamp.timestamp() * 1e9) if md.timestamp else 0
    return md.sequence.stream, md.num_delivered, ts


@dataclass(frozen=True, slots=True)
class ConsumerLag:
    """A durable consumer's messages not delivered yet (`num_pending`)."""

    stream: str
    name: str
    filter_subjects: tuple[str, ...]
    pending: int


async def consumer_lags(bus: Bus, stream: str) -> list[ConsumerLag]:
    """Every consumer of `stream`, with its `num_pending`: one request per 256 consumers."""
    out: list[ConsumerLag] = []
    offset = 0
    while True:
        page = await bus.js.consumers_info(stream, offset=offset)
        for info in page:
            config = info.config
            filters = tuple(config.filter_subjects or ()) or (
                (config.filter_subject,) if config.filter_subject else ())
            out.append(ConsumerLag(stream, info.name or "", filters, info.num_pending or 0))
        if len(page) < 256:
            return out
        offset += len(page)
