"""Appending events to, and reading them from, the `TOOLBUS_EVENTS` stream."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg

from bus.auth import READ_ONLY_ROLES
from bus.connection import Bus
from bus.direct import direct_batch
from bus.headers import Header
from bus.subjects import EVENTS_STREAM, event_filter, event_subject, session_filter
from schemas.defaults import MAX_EVENT_BYTES
from schemas.errors import (
    AppendError,
    BusTimeoutError,
    ConcurrencyError,
    EventTooLargeError,
    PermissionDeniedError,
)
from schemas.events import AnyEvent, Event, decode_event, encode_event, event_type

log = logging.getLogger("toolbus.bus")

_WRONG_LAST_SEQUENCE = 10071
_IN_PROCESS = 10158  # "duplicate message id is in process"
# What nats-server's refusals of an atomic batch say first (a stored message id in it,
# too many in flight, batches disabled, ...).
_BATCH_REFUSED = "atomic publish"
# Retried with the same message id (never stored twice) over at least 15 s of backoff:
# long enough for a cluster to elect a new stream leader when a node dies.
_APPEND_ATTEMPTS = 20
_APPEND_TIMEOUT_S = 2.0
_READ_BATCH = 1024
_CONSUMER_READ_OVER = 1024  # events still to read above which an ephemeral consumer pays
_PULL_BATCH = 10_000
_STATUS = Header.STATUS.value
_SEQUENCE = Header.SEQUENCE.value
_SUBJECT = Header.SUBJECT.value
_NUM_PENDING = Header.NUM_PENDING.value
_BATCH_ID = Header.BATCH_ID.value
_BATCH_SEQUENCE = Header.BATCH_SEQUENCE.value
_BATCH_COMMIT = Header.BATCH_COMMIT.value
_CHECK_HEADERS = (Header.EXPECTED_LAST_SUBJECT_SEQUENCE.value,
                  Header.EXPECTED_LAST_SUBJECT_SEQUENCE_SUBJECT.value)
# The largest decision stored as one atomic batch (nats-server's default
# `max_batch_size` is 1,000 messages); a larger one is stored event by event.
_MAX_BATCH = 1000


@dataclass(frozen=True, slots=True)
class Append:
    """One event to store: its deterministic message id and optional subject route."""

    event: Event
    msg_id: str
    route: str | None = None
    # Not the first event of a decision: stored only if the session's last
    # `turn.cancelled` is still at this sequence (0: none), so that a decision taken on a
    # state a cancellation has overtaken stores none of its calls (see `append_decision`).
    unless_cancelled_after: int | None = None
    # The first event of a decision: a fact its writer stores even when the concurrency
    # check fails (a model's answer), so that the events pipelined behind it, which
    # follow from it, are never stored without it (see `append_decision`).
    fact: bool = False


@dataclass(frozen=True, slots=True)
class AppendResult:
    seq: int
    duplicate: bool


@dataclass(frozen=True, slots=True)
class StoredEvent:
    seq: int
    subject: str
    data: bytes
    event: AnyEvent | None
    error: str | None = None


def decode_stored(seq: int, subject: str, data: bytes) -> StoredEvent:
    try:
        return StoredEvent(seq, subject, data, decode_event(data))
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
        # An event this version cannot read (newer type, foreign writer, nested deeper
        # than this reader's stack allows): kept visible, never folded, never fatal.
        return StoredEvent(seq, subject, data, None, str(exc))


class _PubAck(msgspec.Struct):
    stream: str = ""
    seq: int = 0
    duplicate: bool = False
    error: dict[str, Any] | None = None
    count: int = 0  # an atomic batch's: how many it stored, `seq` being the last


_ack_decoder = msgspec.json.Decoder(_PubAck)


class _UnavailableError(Exception):
    """The stream did not answer (503): no responders, or JetStream is restarting."""


_RETRYABLE = (TimeoutError, _UnavailableError, nats.errors.ConnectionReconnectingError,
              nats.errors.OutboundBufferLimitError)


class _Publisher:
    """JetStream publish with acks on one wildcard inbox, matched by a counter token.

    nats-py's `js.publish` draws a random token per request and parses every ack with
    `json.loads` into a dataclass; on the hot path this does neither.
    """

    def __init__(self, bus: Bus) -> None:
        self._nc = bus.nc
        self._prefix = ""
        self._next = 0
        self._waiting: dict[str, asyncio.Future[Msg]] = {}
        self._started: asyncio.Future[None] | None = None
        # Batch ids: unique on the stream while batches are in flight (at most 64
        # characters), so a random prefix per publisher and a counter.
        self._batch_prefix = uuid.uuid4().hex[:16]
        self._batches = 0

    async def _ensure(self) -> None:
        if self._started is None:
            self._started = asyncio.get_running_loop().create_future()
            self._prefix = self._nc.new_inbox()
            await self._nc.subscribe(f"{self._prefix}.*", cb=self._on_ack)
            self._started.set_result(None)
        elif not self._started.done():
            await self._started

    async def _on_ack(self, msg: Msg) -> None:
        fut = self._waiting.pop(msg.subject, None)
        if fut is not None and not fut.done():
            fut.set_result(msg)

    async def send(self, subject: str, payload: bytes,
                   headers: dict[str, str]) -> tuple[str, asyncio.Future[Msg]]:
        """Publish; the future resolves with the ack. Sends in call order."""
        await self._ensure()
        self._next += 1
        reply = f"{self._prefix}.{self._next}"
        fut: asyncio.Future[Msg] = asyncio.get_running_loop().create_future()
        self._waiting[reply] = fut
        try:
            await self._nc.publish(subject, payload, reply=reply, headers=headers)
        except BaseException:
            self._waiting.pop(reply, None)
            raise
        return reply, fut

    async def send_batch(self, prepared: Sequence[tuple[str, bytes, dict[str, str]]]
                         ) -> tuple[str, asyncio.Future[Msg]]:
        """Publish messages as one atomic batch: the stream stores all of them together
        once the last (the commit) is in, or none. The future resolves with the commit's
        ack, the only one the stream sends."""
        await self._ensure()
        self._batches += 1
        batch_id = f"{self._batch_prefix}{self._batches}"
        last = len(prepared) - 1
        for i, (subject, payload, headers) in enumerate(prepared[:last]):
            await self._nc.publish(subject, payload, headers={
                **headers, _BATCH_ID: batch_id, _BATCH_SEQUENCE: str(i + 1)})
        subject, payload, headers = prepared[last]
        return await self.send(subject, payload, {
            **headers, _BATCH_ID: batch_id, _BATCH_SEQUENCE: str(last + 1),
            _BATCH_COMMIT: "1"})

    async def wait(self, subject: str, sent: tuple[str, asyncio.Future[Msg]],
                   timeout: float) -> _PubAck:
        reply, fut = sent
        try:
            if fut.done():
                # Most acks of a pipelined decision are in by the time they are awaited:
                # taken at once (awaiting costs a turn of the event loop, and `wait_for`
                # two more per ack, behind whatever else the loop has ready).
                msg = fut.result()
            else:
                async with asyncio.timeout(timeout):
                    msg = await fut
        finally:
            self._waiting.pop(reply, None)
        if not msg.data and msg.headers and msg.headers.get(Header.STATUS.value) == "503":
            raise _UnavailableError(subject)
        return _ack_decoder.decode(msg.data)


class EventLog:
    def __init__(self, bus: Bus, *, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        self._bus = bus
        # The read-only roles may not create consumers: they read by direct gets only.
        self._consumer_reads = bus.principal not in READ_ONLY_ROLES
        self._pub = _Publisher(bus)
        self._max_event_bytes = max_event_bytes
        self.writer: str | None = None  # stored as `Toolbus-Writer` on each event
        # Called with each event this log stored that was not a duplicate: the one writer,
        # across every process, whose append of that message id the stream kept.
        self.observer: Callable[[Event, AppendResult], None] | None = None

    @property
    def replicated(self) -> bool:
        return self._bus.replicated

    def _prepare(self, item: Append, expect_last: int | None, expect_subject: str | None,
                 extra: Mapping[str, str] | None) -> tuple[str, bytes, dict[str, str]]:
        event = item.event
        subject = event_subject(event.session_id, event_type(event), item.route,
                                partitions=self._bus.partitions)
        payload = encode_event(event)
        if len(payload) > self._max_event_bytes:
            raise EventTooLargeError(subject, len(payload), self._max_event_bytes)
        headers = {Header.MSG_ID.value: item.msg_id}
        if self.writer:
            headers[Header.WRITER.value] = self.writer
        if extra:
            headers.update(extra)
        if expect_last is not None:
            headers[Header.EXPECTED_LAST_SUBJECT_SEQUENCE.value] = str(expect_last)
            headers[Header.EXPECTED_LAST_SUBJECT_SEQUENCE_SUBJECT.value] = (
                expect_subject or session_filter(event.session_id))
        return subject, payload, headers

    @staticmethod
    def _result(subject: str, ack: _PubAck, expect_last: int | None) -> AppendResult:
        if ack.error is None:
            return AppendResult(ack.seq, ack.duplicate)
        code = int(ack.error.get("err_code", 0))
        description = str(ack.error.get("description", ""))
        if code == _WRONG_LAST_SEQUENCE:
            raise ConcurrencyError(subject, expect_last or 0, description)
        raise AppendError(subject, f"{description} (code {code})")

    async def append(self, item: Append, *, expect_last: int | None = None,
                     expect_subject: str | None = None,
                     headers: Mapping[str, str] | None = None) -> AppendResult:
        """Store one event, idempotently; returns its stream sequence (the original one,
        flagged `duplicate`, when the message id was already stored).

        With `expect_last`, the append succeeds only if the session's last event (or the
        last on `expect_subject`, a subject filter) is at that sequence (`ConcurrencyError`
        otherwise). Timeouts and 503s are retried with the same message id, so a retry can
        never store the fact twice. An event over the size limit is never sent
        (`EventTooLargeError`).
        """
        subject, payload, hdrs = self._prepare(item, expect_last, expect_subject, headers)
        # An earlier attempt of this very message still being stored (a cluster between
        # leaders) is asked about again, to learn its sequence.
        ack = await self._acknowledged(
            subject, lambda: self._pub.send(subject, payload, hdrs), in_process_again=True)
        result = self._result(subject, ack, expect_last)
        if self.observer is not None and not result.duplicate:
            self.observer(item.event, result)
        return result

    async def _acknowledged(
            self, subject: str, send: Callable[[], Awaitable[tuple[str, asyncio.Future[Msg]]]],
            *, in_process_again: bool) -> _PubAck:
        """The acknowledgement of what `send` publishes, sent again after a timeout or a
        503 (and, with `in_process_again`, after "duplicate message id is in process")
        over at least 15 s of backoff."""
        delay = 0.05
        last_error: Exception | None = None
        for _ in range(_APPEND_ATTEMPTS):
            try:
                ack = await self._pub.wait(subject, await send(), _APPEND_TIMEOUT_S)
            except _RETRYABLE as exc:
                last_error = exc
            else:
                if not (in_process_again and ack.error is not None
                        and int(ack.error.get("err_code", 0)) == _IN_PROCESS):
                    return ack
                last_error = AppendError(subject, str(ack.error.get("description", "")))
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)
        raise AppendError(subject, f"no acknowledgement after {_APPEND_ATTEMPTS} attempts: "
                                   f"{type(last_error).__name__}: {last_error}")

    async def send(self, item: Append, *, headers: Mapping[str, str] | None = None
                   ) -> Callable[[], Awaitable[AppendResult]]:
        """Publish one event now and return a function that awaits its acknowledgement
        (retrying, as `append` does, if the publish or its ack failed). Events sent one
        after another on this log are stored in that order, so a second can be sent
        before the first is acknowledged: one round trip for both."""
        return await self._send(item, self._prepare(item, None, None, headers), None,
                                headers)

    async def _send(self, item: Append, prepared: tuple[str, bytes, dict[str, str]],
                    expect_last: int | None, headers: Mapping[str, str] | None,
                    expect_subject: str | None = None
                    ) -> Callable[[], Awaitable[AppendResult]]:
        subject, payload, hdrs = prepared
        try:
            sent: tuple[str, asyncio.Future[Msg]] | None = await self._pub.send(
                subject, payload, hdrs)
        except _RETRYABLE:
            sent = None  # sent again by `append`, with the same message id
        done: list[AppendResult] = []

        async def result() -> AppendResult:
            if done:
                return done[0]
            if sent is not None:
                try:
                    ack = await self._pub.wait(subject, sent, _APPEND_TIMEOUT_S)
                    done.append(self._result(subject, ack, expect_last))
                    if self.observer is not None and not done[0].duplicate:
                        self.observer(item.event, done[0])
                    return done[0]
                except _RETRYABLE:
                    pass
            done.append(await self.append(item, expect_last=expect_last,
                                          expect_subject=expect_subject, headers=headers))
            return done[0]

        return result

    async def append_decision(
        self, items: Sequence[Append], *, expect_last: int | None,
        headers: Mapping[str, str] | None = None,
    ) -> list[AppendResult]:
        """Store the events of one decision, the first under the concurrency check.
        Returns their results in order.

        On a replicated stream that takes atomic batches (`Bus.atomic`), they are
        stored all together or none: a failed check (`ConcurrencyError`) stores nothing
        of the decision, and the stream answers once for all of them, in one round trip
        of the cluster. Elsewhere, or for a decision some of whose events are stored
        already (decided again after a crash: the same message ids), they are stored
        event by event: on a single server sent at once, in order on one connection, the
        first checked, the rest pipelined behind it; on a cluster one after another."""
        # Without a batch, only the first is checked: if that check fails, the others
        # may still be stored. Harmless, because a decision's events have deterministic
        # ids and the re-decision after a re-read writes the same ids (deduplicated) and
        # the reducer accepts either order. Every event is prepared (size-checked) before
        # any is sent. The rest may carry a guard of their own: no `turn.cancelled`
        # stored since.
        expects = [expect_last if i == 0 else item.unless_cancelled_after
                   for i, item in enumerate(items)]
        subjects = [None if i == 0 or item.unless_cancelled_after is None else
                    event_filter(item.event.session_id, "turn.cancelled")
                    for i, item in enumerate(items)]
        more = [{**(headers or {}), Header.MORE.value: str(len(items) - 1 - i)}
                if i < len(items) - 1 else headers for i in range(len(items))]
        prepared = [self._prepare(item, expect, subject, extra)
                    for item, expect, subject, extra
                    in zip(items, expects, subjects, more, strict=True)]
        # Only on a cluster: there a batch is one round trip where the events one by
        # one are one each (4 events: 0.5 against 1.6 ms on three local servers); on a
        # single server nats-server 2.15 takes 1.8 ms to commit a batch of 4 that
        # pipelined takes 0.2 ms.
        if 1 < len(items) <= _MAX_BATCH and self._bus.atomic and self._bus.replicated:
            stored = await self._append_batch(items, prepared, expect_last)
            if stored is not None:
                return stored
        if self._bus.replicated:
            # One after another, each once the one before is stored: a leader change
            # could otherwise store a later event of the decision and lose an earlier.
            return [await self.append(item, expect_last=expect, expect_subject=subject,
                                      headers=extra)
                    for item, expect, subject, extra
                    in zip(items, expects, subjects, more, strict=True)]
        pending: list[Callable[[], Awaitable[AppendResult]]] = []
        again: Callable[[], Awaitable[AppendResult]] | None = None
        for i, (item, one, expect, subject, extra) in enumerate(
                zip(items, prepared, expects, subjects, more, strict=True)):
            pending.append(await self._send(item, one, expect, extra, subject))
            if i == 0 and item.fact and len(items) > 1:
                # Sent again, unchecked, right behind itself under the same message id: a
                # duplicate when the check passed, else stored there, ahead of the rest.
                # Without it, a writer killed after a failed check, before its own append
                # of the fact (the planner's `_finish`), left what follows from the fact
                # stored without it: a turn completed, or calls run, with no answer.
                to, payload, hdrs = one
                unchecked = {k: v for k, v in hdrs.items() if k not in _CHECK_HEADERS}
                again = await self._send(item, (to, payload, unchecked), None, extra)
        results: list[AppendResult] = []
        failure: AppendError | None = None
        for i, result in enumerate(pending):
            try:
                results.append(await result())
            except AppendError as exc:  # ConcurrencyError included: raised after the rest
                failure = failure or exc
            if i == 0 and again is not None:
                try:
                    await again()  # its result is the first's (or the one stored)
                except AppendError as exc:
                    failure = failure or exc
        if failure is not None:
            raise failure
        return results

    async def _append_batch(self, items: Sequence[Append],
                            prepared: Sequence[tuple[str, bytes, dict[str, str]]],
                            expect_last: int | None) -> list[AppendResult] | None:
        """Store prepared events as one atomic batch; None when the stream took no
        batch of them (some are stored already, or it refuses batches just now): then
        nothing of this batch was stored, and they are to be stored event by event.

        Timeouts and 503s are retried, each time as a new batch: one stored before its
        acknowledgement was lost is then refused as holding stored message ids (None),
        and the event-by-event store finds each of them stored, with its sequence."""
        subject = prepared[0][0]
        ack = await self._acknowledged(subject, lambda: self._pub.send_batch(prepared),
                                       in_process_again=False)
        if ack.error is not None:
            code = int(ack.error.get("err_code", 0))
            description = str(ack.error.get("description", ""))
            if code == _WRONG_LAST_SEQUENCE:
                raise ConcurrencyError(subject, expect_last or 0, description)
            if code == _IN_PROCESS or description.startswith(_BATCH_REFUSED):
                # Stored ids among them, too many batches in flight on the stream,
                # batches turned off since: stored one by one instead.
                return None
            raise AppendError(subject, f"{description} (code {code})")
        if ack.count != len(items):
            raise AppendError(subject, f"an atomic batch of {len(items)} events was "
                                       f"stored as {ack.count}")
        # A batch is stored at consecutive sequences, its commit last.
        first = ack.seq - len(items) + 1
        results = [AppendResult(first + i, False) for i in range(len(items))]
        if self.observer is not None:
            for item, result in zip(items, results, strict=True):
                self.observer(item.event, result)
        return results

    async def read_session(
        self,
        session_id: str,
        *,
        after: int = 0,
        until: int | None = None,
        subject_filter: str | None = None,
        timeout: float = 10.0,
    ) -> list[StoredEvent]:
        """All of a session's events after stream sequence `after`, in order, by batched
        direct gets: no consumer is created, so nothing is left behind."""
        filt = subject_filter or session_filter(session_id)
        out: list[StoredEvent] = []
        start = after + 1
        async with asyncio.timeout(timeout):
            while True:
                batch, pending = await self._direct_batch(filt, start)
                if batch and pending >= _CONSUMER_READ_OVER and self._consumer_reads and (
                        until is None or until - batch[-1][0] >= _CONSUMER_READ_OVER):
                    # A long history: an ephemeral consumer streams it about twice as
                    # fast (its messages carry no metadata headers to parse).
                    try:
                        batch += await self._consumer_read(filt, batch[-1][0] + 1, until)
                        pending = 0
                    except PermissionDeniedError:
                        self._consumer_reads = False  # direct gets only, from now on
                for seq, subject, data in batch:
                    if until is not None and seq > until:
                        return out
                    out.append(decode_stored(seq, subject, data))
                if not batch or pending == 0:
                    return out
                start = batch[-1][0] + 1

    async def _consumer_read(self, filt: str, start: int, until: int | None
                             ) -> list[tuple[int, str, bytes]]:
        """Every message on `filt` from `start` (to `until`), through an ephemeral,
        unacknowledged, in-memory consumer that is deleted afterwards (and expires by
        itself if this process dies first)."""
        nc = self._bus.nc
        config = {"stream_name": EVENTS_STREAM, "config": {
            "ack_policy": "none", "deliver_policy": "by_start_sequence",
            "opt_start_seq": start, "filter_subject": filt, "mem_storage": True,
            "num_replicas": 1, "inactive_threshold": 10_000_000_000}}
        reply = await self._bus.request(f"$JS.API.CONSUMER.CREATE.{EVENTS_STREAM}",
                                        json.dumps(config).encode(), timeout=5.0)
        created = json.loads(reply)
        if "error" in created:
            raise BusTimeoutError(f"reading {filt}: {created['error'].get('description')}")
        name = created["name"]
        out: list[tuple[int, str, bytes]] = []
        try:
            while True:
                got, pending = await self._pull(name, _PULL_BATCH)
                out += got
                if not got or pending == 0 or (until is not None and got[-1][0] >= until):
                    return out
        finally:
            with contextlib.suppress(Exception):
                await nc.publish(f"$JS.API.CONSUMER.DELETE.{EVENTS_STREAM}.{name}", b"")

    async def _pull(self, consumer: str, batch_size: int
                    ) -> tuple[list[tuple[int, str, bytes]], int]:
        nc = self._bus.nc
        got: list[tuple[int, str, bytes]] = []
        done: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def on_msg(msg: Msg) -> None:
            if not msg.data and msg.headers and _STATUS in msg.headers:
                if not done.done():
                    done.set_result(0)  # 404/408: nothing more now
                return
            # $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>[...]
            tokens = (msg.reply or "").split(".")
            if len(tokens) == 9:
                seq, pending = int(tokens[5]), int(tokens[8])
            else:
                seq, pending = int(tokens[7]), int(tokens[10])
            got.append((seq, msg.subject, msg.data))
            if (pending == 0 or len(got) == batch_size) and not done.done():
                done.set_result(pending)

        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox, cb=on_msg, pending_msgs_limit=4 * batch_size)
        try:
            await nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.{EVENTS_STREAM}.{consumer}",
                             json.dumps({"batch": batch_size, "no_wait": True}).encode(),
                             reply=inbox)
            pending = await done
        finally:
            await sub.unsubscribe()
        return got, pending

    async def read_head(self, session_id: str) -> tuple[list[StoredEvent], bool]:
        """The session's first events, by one batched direct get, and whether they are
        all of them (a new or short session is read whole in one round trip)."""
        batch, pending = await self._direct_batch(session_filter(session_id), 1)
        return [decode_stored(seq, subject, data) for seq, subject, data in batch], \
            pending == 0

    async def _direct_batch(self, filt: str, start: int
                            ) -> tuple[list[tuple[int, str, bytes]], int]:
        return await direct_batch(self._bus, EVENTS_STREAM, filt, start, _READ_BATCH)

    async def last_seq_of(self, session_id: str) -> int:
        """The sequence of the session's last event, asked of the stream's leader (not a
        direct get, which any replica may answer, one that is behind among them): what a
        complete read of the session must reach. 0 for a session with no event."""
        try:
            msg = await self._bus.js.get_last_msg(EVENTS_STREAM, session_filter(session_id))
        except nats.js.errors.NotFoundError:
            return 0
        return int(msg.seq or 0)

    async def last_of_type(self, session_id: str, event_type: str
                           ) -> tuple[StoredEvent, str | None] | None:
        """The session's last event of one type and who wrote it (`Toolbus-Writer`),
        asked of the stream's leader (a direct get may be answered by a replica that is
        behind), None if it has none."""
        try:
            msg = await self._bus.js.get_last_msg(EVENTS_STREAM,
                                                  event_filter(session_id, event_type))
        except nats.js.errors.NotFoundError:
            return None
        writer = (msg.headers or {}).get(Header.WRITER.value)
        return (decode_stored(int(msg.seq or 0), msg.subject or "", msg.data or b""),
                writer if isinstance(writer, str) else None)

    async def read_from_leader(self, session_id: str, *, after: int,
                               until: int) -> list[StoredEvent]:
        """The session's events after `after` up to `until`, asked of the stream's leader
        one by one (for the few a replica that is behind did not have yet)."""
        out: list[StoredEvent] = []
        filt = session_filter(session_id)
        seq = after
        while seq < until:
            try:
                msg = await self._bus.js.get_msg(EVENTS_STREAM, seq + 1, subject=filt,
                                                 next=True)
            except nats.js.errors.NotFoundError:
                break
            if msg.seq is None or msg.seq <= seq:
                break
            seq = msg.seq
            out.append(decode_stored(seq, msg.subject or "", msg.data or b""))
        return out

    async def read_at(self, seq: int, *, timeout: float = 5.0) -> StoredEvent | None:
        """The event at one stream sequence (a direct get), None if there is none."""
        api = f"$JS.API.DIRECT.GET.{EVENTS_STREAM}"
        try:
            msg = await self._bus.nc.request(api, json.dumps({"seq": seq}).encode(),
                                             timeout=timeout)
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError) as exc:
            raise BusTimeoutError(f"reading event {seq}: no answer in {timeout:g} s"
                                  ) from exc
        hdrs = msg.headers or {}
        if hdrs.get(Header.STATUS.value):
            return None
        return decode_stored(int(hdrs[Header.SEQUENCE.value]), hdrs[Header.SUBJECT.value],
                             msg.data)
