"""Executor actor.

Consumes: `call.dispatched` for the local tools it holds, from one durable consumer per
(pool, namespace) shared by every executor process that holds that namespace, so N
processes split the calls between them.
Emits: `call.started`, then exactly one of `call.succeeded` / `call.failed`.
Idempotency: both terminal events share the call's terminal message id (schemas/ids.py),
so two executors racing on one call can store only one outcome; `call.started` is keyed
by attempt. A result too large for an event is streamed to the object store and the
event carries its reference.
Retry rule (DESIGN.md): a redelivered call that already ended is acked and skipped; one
that started but never ended runs again only if the tool is read-only or idempotent,
otherwise it ends `call.failed` / `interrupted`: never a silent second side effect. The
dispatch is acked only after the terminal event is stored; while a tool runs, in-progress
acks keep the message from being redelivered; the ack wait is short (3 s), so a call held
by an executor that died is redelivered to a survivor within seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import socket
import time
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from typing import Any

import msgspec

from actors import metrics
from actors.kernel import Inbox, Kernel, PoisonError, SessionStates, outgoing_headers
from actors.tools import ResourceScope, RunnableTool, ToolError, index_tools, with_pool
from bus import trace
from bus.artifacts import ArtifactStore, json_string_chunks
from bus.catalog import Catalog
from bus.connection import Bus
from bus.consumer import Delivery
from bus.eventlog import Append, decode_stored
from bus.streams import ConsumerSpec
from bus.subjects import EVENTS_STREAM, dispatch_filter, event_filter
from bus.tasks import stop_task
from schemas.defaults import (
    EXECUTOR_ACK_WAIT_S,
    EXECUTORS_TTL_S,
    MAX_IN_FLIGHT,
    MAX_INLINE_RESULT_BYTES,
    MAX_RESULT_BYTES,
    MAX_RESULT_DEPTH,
)
from schemas.errors import ArtifactError, ConfigError
from schemas.events import (
    CallDispatched,
    CallFailed,
    CallStarted,
    CallSucceeded,
    Event,
    ResultRef,
    clip,
)
from schemas.ids import call_started_id, call_terminal_id, check_namespace
from schemas.requests import json_depth
from schemas.tools import DEFAULT_POOL, ExecutorInfo, ToolSpec, instance_route, pool_route
from schemas.validation import Validator, describe

log = logging.getLogger("toolbus.executor")

# A first delivery older than this is checked against the log too: its consumer may have
# been re-created, and a dispatch that old may already have run.
_STALE_DELIVERY_S = 5.0
_FIRST_START_READS = 40  # reads of the call's starts, 50 ms apart, until one holds its own
_INSTANCE_ROUTE = instance_route("x", "x").split(".", 1)[0] + "."
_json = msgspec.json.Encoder()


def default_instance_name(pool: str | None = None) -> str:
    """`<host>-<pid>`, or `<host>-<pid>-<pool>` for the executor of one pool: unique on
    the host as long as each process runs one executor per pool (the runtime names its
    MCP connector's apart, services/runtime.py)."""
    suffix = f"-{os.getpid()}" + (f"-{pool}" if pool else "")
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:max(1, 128 - len(suffix))]
    return f"{host}{suffix}"[:128]


# The executors started in this process, by instance name. A name is both a presence
# entry in `toolbus_executors` and an `_instance` route: two executors sharing one would
# overwrite each other's presence and split each other's named calls.
_RUNNING: dict[str, Executor] = {}
_ANNOUNCING: set[asyncio.Task[None]] = set()  # announcements of a changed tool list


# The dispatch of the call a tool is running, for the few tools that act on their
# caller's session: agents as tools (actors/agent_tools.py), the context tools.
current_dispatch: ContextVar[CallDispatched | None] = ContextVar("toolbus_dispatch",
                                                                 default=None)
# Its delivery: a tool that waits for other calls to run (an agent for its child's turn)
# waits inside `delivery.waiting()`, so that it holds none of the executor's slots.
current_delivery: ContextVar[Delivery | None] = ContextVar("toolbus_delivery", default=None)

class Executor:
    def __init__(
        self,
        bus: Bus,
        tools: Iterable[RunnableTool],
        *,
        namespaces: Iterable[str] | None = None,
        register: bool = True,
        instance: str | None = None,
        pool: str = DEFAULT_POOL,
        ack_wait_s: float = EXECUTOR_ACK_WAIT_S,
        max_in_flight: int = MAX_IN_FLIGHT,
        max_ack_pending: int = 4096,
        max_inline_result: int = MAX_INLINE_RESULT_BYTES,
        max_result: int = MAX_RESULT_BYTES,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._bus = bus
        self._kernel = Kernel(bus, "executor", clock=clock)
        self._kernel.attributes[metrics.POOL] = pool
        self._states = SessionStates(bus, self._kernel.log, size=1024)
        # (session, call) running here -> the copies of its delivery that came meanwhile.
        self._running: dict[tuple[str, str], list[Delivery]] = {}
        self._artifacts = ArtifactStore(bus)
        self._max_inline_result = max_inline_result
        self._max_result = max_result
        self._catalog = Catalog(bus)
        self.instance = check_namespace(instance or default_instance_name(pool))
        self._pool = check_namespace(pool)
        self._tools = index_tools(with_pool(t, pool) for t in tools)
        self._register = register
        self._outputs: dict[str, tuple[ToolSpec, Validator | None]] = {}
        self._resources = ResourceScope(self._tools.values())
        self._ack_wait_s = ack_wait_s
        self._clock = clock
        self._started_at = clock()
        namespaces = sorted(set(namespaces) if namespaces is not None
                            else {t.spec.namespace for t in self._tools.values()})
        # One shared consumer per (pool, namespace): the processes of a pool split its
        # calls. One consumer per (instance, namespace) takes the calls that name this
        # instance with `_instance`; it is removed an hour after the instance is gone.
        specs = [ConsumerSpec(EVENTS_STREAM, f"exec_{pool}_{ns}",
                              (dispatch_filter(pool_route(pool, ns)),),
                              ack_wait_s=ack_wait_s, max_ack_pending=max_ack_pending)
                 for ns in namespaces]
        specs += [ConsumerSpec(EVENTS_STREAM, f"exec_instance_{self.instance}_{ns}",
                               (dispatch_filter(instance_route(self.instance, ns)),),
                               ack_wait_s=ack_wait_s, max_ack_pending=max_ack_pending,
                               inactive_threshold_s=3600.0)
                  for ns in namespaces]
        for spec in specs:
            self._kernel.add(Inbox(spec, self._on_dispatch, self._reject, ordered=False,
                                   max_in_flight=max_in_flight))
        self._heartbeat: asyncio.Task[None] | None = None
        self.runs = 0  # calls this process executed (for stats and tests)

    @property
    def pool(self) -> str:
        return self._pool

    @property
    def tools(self) -> dict[str, RunnableTool]:
        return self._tools

    def set_tools(self, namespace: str, tools: Iterable[RunnableTool]) -> None:
        """Replace the tools of one namespace (an MCP server's list changed). A call for a
        tool no longer here fails `unknown_tool`. Announced at once once started (the
        planner offers a model only the tools a live executor lists)."""
        for name in [n for n, t in self._tools.items() if t.spec.namespace == namespace]:
            del self._tools[name]
        for t in tools:
            self._tools[t.spec.name] = with_pool(t, self._pool)
        if self._heartbeat is not None and not self._heartbeat.done():
            task = asyncio.create_task(self._announce_quietly())
            _ANNOUNCING.add(task)
            task.add_done_callback(_ANNOUNCING.discard)

    async def _announce_quietly(self) -> None:
        try:
            await self._announce()
        except Exception as exc:  # the next refresh tries again
            log.warning("executor %s: could not announce its tools: %s", self.instance, exc)

    def _output_validator(self, tool: RunnableTool) -> Validator | None:
        spec = tool.spec
        hit = self._outputs.get(spec.name)
        if hit is None or hit[0] is not spec:
            try:
                validator = Validator(spec.output) if spec.output is not None else None
            except ConfigError as exc:  # a remote schema we cannot compile: not checked
                log.warning("%s: output schema not checked: %s", spec.name, exc)
                validator = None
            hit = self._outputs[spec.name] = (spec, validator)
        return hit[1]

    async def start(self) -> None:
        other = _RUNNING.get(self.instance)
        if other is not None and other is not self:
            raise ConfigError(f"executor instance name {self.instance} is already taken in "
                              f"this process (pool {other.pool}); give each executor its own "
                              "name")
        _RUNNING[self.instance] = self
        try:
            if self._register:
                await self._catalog.register([t.spec for t in self._tools.values()])
            await self._resources.__aenter__()
        except BaseException:
            _RUNNING.pop(self.instance, None)
            raise
        try:
            # Present before it consumes: the janitor ends the calls of routes with no
            # live executor, and must not take this one, starting, for gone.
            await self._announce()
            await self._kernel.start()
        except BaseException:
            _RUNNING.pop(self.instance, None)
            with contextlib.suppress(Exception):
                await self._catalog.retire(self.instance)
            await self._resources.__aexit__(None, None, None)
            raise
        self._heartbeat = asyncio.create_task(self._keep_announcing(), name="executor-announce")

    async def stop(self, grace: float = 10.0) -> None:
        await stop_task(self._heartbeat)
        await self._kernel.stop(grace)
        # Only now: while it drains, the instance still runs the calls it holds. Best
        # effort, and bounded: the entry expires anyway, and a server gone away (the
        # embedded one killed) must not hold the exit for a request timeout per executor,
        # the data dir staying locked meanwhile for the `toolbus up` that would resume.
        if self._bus.nc.is_connected:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._catalog.retire(self.instance), _RETIRE_S)
        if _RUNNING.get(self.instance) is self:
            del _RUNNING[self.instance]
        await self._resources.__aexit__(None, None, None)

    async def _announce(self) -> None:
        await self._catalog.announce(ExecutorInfo(
            instance=self.instance, pool=self._pool, tools=sorted(self._tools),
            host=socket.gethostname(), pid=os.getpid(), started_at=self._started_at))

    async def _keep_announcing(self) -> None:
        while True:
            await asyncio.sleep(EXECUTORS_TTL_S / 3)
            try:
                await self._announce()
            except Exception as exc:  # a NATS outage: try again next tick
                log.warning("executor %s: could not refresh its presence: %s",
                            self.instance, exc)

    async def _started_first(self, d: CallDispatched, seq: int, *, after: int) -> bool:
        """Whether the `call.started` stored at `seq` is the first of the call's (those
        stored after its dispatch at `after`): two deliveries of a call that may not run
        twice (one held up, one handed out again meanwhile) can both find it unstarted
        and both store a start. The first runs it. A read that does not hold this start
        yet (a replica behind) is made again; one that never does runs nothing here (the
        call comes back, and is decided then)."""
        for _ in range(_FIRST_START_READS):
            starts = await self._kernel.log.read_session(
                d.session_id, after=after,
                subject_filter=event_filter(d.session_id, "call.started"))
            seqs = [s.seq for s in starts if isinstance(s.event, CallStarted)
                    and s.event.call_id == d.call_id]
            if seq in seqs:
                return min(seqs) == seq
            await asyncio.sleep(0.05)
        return False

    async def _is_ours(self, seq: int, event: CallStarted) -> bool:
        """Whether the `call.started` stored at `seq` is `event` (this delivery's own,
        stored by a publish retried after a lost acknowledgement), not an earlier one."""
        stored = await self._kernel.log.read_at(seq)
        return stored is not None and stored.event == event

    async def _append(self, event: Event, msg_id: str) -> None:
        await self._kernel.log.append(Append(event, msg_id),
                                      headers=outgoing_headers())

    def _failed(self, d: CallDispatched, error_type: str, message: str, *,
                retryable: bool = False, duration_ms: float = 0.0) -> CallFailed:
        return CallFailed(session_id=d.session_id, at=self._clock(), actor="executor",
                          call_id=d.call_id, turn_id=d.turn_id, error_type=error_type[:128],
                          message=clip(message), retryable=retryable, executor=self.instance,
                          duration_ms=duration_ms)

    async def _on_dispatch(self, delivery: Delivery) -> None:
        stored = decode_stored(delivery.stream_seq, delivery.subject, delivery.data)
        d = stored.event
        if not isinstance(d, CallDispatched):
            raise PoisonError("unreadable_event",
                              f"not a call.dispatched: {stored.error or type(d).__name__}")
        terminal_id = call_terminal_id(d.session_id, d.call_id)
        tool = self._tools.get(d.tool)
        if tool is None:
            await self._append(self._failed(
                d, "unknown_tool", f"executor {self.instance} has no tool {d.tool}"), terminal_id)
            await delivery.ack()
            return

        running = (d.session_id, d.call_id)
        attached = self._running.get(running)
        if attached is not None:
            # Delivered again while this process handles it: the server lost count of its
            # deliveries (restarted without them), or the ack wait ran out while the
            # state was read. Held beside the one being handled (kept alive, then settled
            # as it is), never run a second time.
            attached.append(delivery)
            return
        copies: list[Delivery] = []
        self._running[running] = copies
        try:
            done = await self._dispatch_once(delivery, d, tool, terminal_id, copies)
        finally:
            del self._running[running]
        if done is None:
            return
        await (delivery.ack() if done else delivery.nak(delay=self._ack_wait_s))
        for copy in copies:  # settled as the delivery they copy
            with contextlib.suppress(Exception):
                await (copy.ack() if done else copy.nak(delay=self._ack_wait_s))

    async def _dispatch_once(self, delivery: Delivery, d: CallDispatched, tool: RunnableTool,
                             terminal_id: str, copies: list[Delivery]) -> bool | None:
        """Run the call unless it ran (or may have run) already; True once it is settled
        (to ack), False to be decided again later (to put back), None when another
        delivery of it, in hand elsewhere, settles it (left alone: neither acked, which
        would end the message should that one die, nor put back)."""
        attempt = delivery.num_delivered
        age_s = time.time() - delivery.timestamp_ns / 1e9
        # A call sent to this instance by name may have been ended by the janitor while
        # this instance's presence had lapsed: look before running it, as for a redelivery.
        named = d.route.startswith(_INSTANCE_ROUTE)
        # So may one older than its timeout: the janitor ends a call whose route had no
        # live executor once its timeout has passed.
        timeout_s = (d.timeout_ms or tool.spec.timeout_ms) / 1000
        # Another delivery of it may be in hand elsewhere once half the ack wait has
        # passed (this process was stopped or starved, and the server sent it again).
        contested = attempt > 1 or age_s > min(_STALE_DELIVERY_S, timeout_s,
                                               self._ack_wait_s / 2) or named
        if contested:
            # It may have run already: the session's state says how far it got.
            call = (await self._states.current(d.session_id)).state.calls.get(d.call_id)
            if call is not None and call.terminal:
                return True
            if call is not None and call.attempts > attempt:
                # A later delivery started it (this one was held up past its ack wait):
                # that one settles it, and keeps the message from going elsewhere while
                # it runs. Deciding here marked a call running elsewhere `interrupted`,
                # or ran it twice.
                return None
            if call is not None and call.attempts > 0 and not tool.spec.rerunnable:
                await self._append(self._failed(
                    d, "interrupted",
                    f"the executor running {d.tool} stopped answering before it finished (it "
                    "died, or was paused past its ack wait: what the tool did, in part or "
                    "whole, may stand); the tool is neither read-only nor idempotent, so it "
                    "is not run again",
                ), terminal_id)
                return True

        started_event = CallStarted(session_id=d.session_id, at=self._clock(), actor="executor",
                                    call_id=d.call_id, turn_id=d.turn_id,
                                    executor=self.instance, attempt=attempt)
        started_id = call_started_id(d.session_id, d.call_id, attempt)
        with trace.tool_span(d.tool, d.call_id, parent=None):
            log = self._kernel.log
            # Beats from before `call.started` is sent until the outcome is stored: the
            # start's append may retry for longer than the ack wait (a cluster electing),
            # and a delivery gone quiet meanwhile was handed out again and the call
            # ended `interrupted` while this one ran it.
            keep_alive = _KeepAlive(delivery, max(self._ack_wait_s / 3, 0.05), copies)
            try:
                started = await log.send(Append(started_event, started_id),
                                         headers=outgoing_headers())
                if not tool.spec.rerunnable:
                    # Stored before a tool that may not run twice starts; and stored by
                    # this delivery, not an earlier one that the server forgot (a delivery
                    # count lost in a restart makes a redelivery look like a first one).
                    first = await started()
                    if first.duplicate and not await self._is_ours(first.seq,
                                                                   started_event):
                        return False  # decided when it comes back
                    if not await self._started_first(d, first.seq,
                                                     after=delivery.stream_seq):
                        return None  # another delivery's start was stored first: it runs it
                outcome = await self._run(d, tool, keep_alive, attempt)
                # A rerunnable tool ran while `call.started` was on the wire: the outcome
                # is sent behind it without waiting for its ack (one round trip, not two;
                # the order on the connection keeps started before the outcome).
                ended = await log.send(Append(outcome, terminal_id), headers=outgoing_headers())
                await started()
                await ended()
            finally:
                keep_alive.cancel()
        return True

    def _too_large(self, d: CallDispatched, size: int, t0: float) -> CallFailed:
        return self._failed(d, "result_too_large",
                            f"{d.tool} returned {size:,} bytes (at least); results over "
                            f"{self._max_result:,} bytes are not stored: return a "
                            "reference (a path or URL) instead", duration_ms=_ms(t0))

    def _reject(self, delivery: Delivery, reason: str, message: str) -> list[Append]:
        d = decode_stored(delivery.stream_seq, delivery.subject, delivery.data).event
        if not isinstance(d, CallDispatched):
            return [self._kernel.generic_rejection(delivery, reason, message)]
        return [Append(self._failed(d, "internal", message),
                       call_terminal_id(d.session_id, d.call_id))]

    async def _run(self, d: CallDispatched, tool: RunnableTool, keep_alive: _KeepAlive,
                   attempt: int) -> Event:
        timeout_s = (d.timeout_ms or tool.spec.timeout_ms) / 1000
        try:
            tool.check_arguments(d.arguments)
        except TypeError as exc:
            return self._failed(d, "invalid_arguments", f"{d.tool}: {exc}")
        t0 = time.perf_counter()
        self.runs += 1
        token = current_dispatch.set(d)
        held = current_delivery.set(keep_alive.delivery)
        try:
            async with asyncio.timeout(timeout_s):
                result: Any = await tool.run(d.arguments, self._resources.values,
                                             progress=keep_alive.poke)
        except TimeoutError:
            return self._failed(d, "timeout", f"{d.tool} did not finish within {timeout_s:g} s",
                                retryable=True, duration_ms=_ms(t0))
        except ToolError as exc:
            return self._failed(d, exc.error_type, exc.message, retryable=exc.retryable,
                                duration_ms=_ms(t0))
        except Exception as exc:
            return self._failed(d, type(exc).__name__, str(exc) or repr(exc),
                                duration_ms=_ms(t0))
        finally:
            current_delivery.reset(held)
            current_dispatch.reset(token)
        validator = self._output_validator(tool)
        if validator is not None:
            violations = validator.violations(result)
            if violations:
                return self._failed(d, "output_invalid",
                                    describe(violations, f"result of {d.tool}"),
                                    duration_ms=_ms(t0))
        if isinstance(result, str) and len(result) > self._max_result:
            return self._too_large(d, len(result), t0)
        if isinstance(result, str) and len(result) > self._max_inline_result:
            # Surely too large for an event: streamed to the object store as it is
            # encoded, so the result is held once, not twice.
            keep_alive.poke()
            try:
                streamed = await self._artifacts.put_chunks(
                    d.session_id, d.call_id, attempt, json_string_chunks(result))
            except ArtifactError as exc:
                return self._failed(d, "result_not_stored", str(exc), retryable=True,
                                    duration_ms=_ms(t0))
            return CallSucceeded(session_id=d.session_id, at=self._clock(), actor="executor",
                                 call_id=d.call_id, turn_id=d.turn_id, result=None,
                                 executor=self.instance, duration_ms=_ms(t0),
                                 result_ref=streamed)
        try:
            encoded = _json.encode(result)
        except (TypeError, ValueError, RecursionError, msgspec.EncodeError) as exc:
            return self._failed(d, "result_not_serializable",
                                f"{d.tool} returned a value that is not JSON: {exc}",
                                duration_ms=_ms(t0))
        ref: ResultRef | None = None
        if len(encoded) > self._max_result:
            return self._too_large(d, len(encoded), t0)
        if 2 * MAX_RESULT_DEPTH < len(encoded) <= self._max_inline_result and \
                json_depth(result, MAX_RESULT_DEPTH) > MAX_RESULT_DEPTH:
            # Stored in the event, it would be one that some readers cannot decode (their
            # stack is deeper than the encoder's was), and the session's state could not
            # be read. (A walk of at most an event's worth of values.)
            return self._failed(d, "result_not_serializable",
                                f"{d.tool} returned a value nested over {MAX_RESULT_DEPTH} "
                                "levels deep", duration_ms=_ms(t0))
        if len(encoded) > self._max_inline_result:
            # Too large for an event: stream it to the object store, keep a reference.
            del result
            keep_alive.poke()
            try:
                ref = await self._artifacts.put(d.session_id, d.call_id, attempt, encoded)
            except ArtifactError as exc:
                return self._failed(d, "result_not_stored", str(exc), retryable=True,
                                    duration_ms=_ms(t0))
            del encoded
            result = None
        return CallSucceeded(session_id=d.session_id, at=self._clock(), actor="executor",
                             call_id=d.call_id, turn_id=d.turn_id, result=result,
                             executor=self.instance, duration_ms=_ms(t0), result_ref=ref)


# How long a stopping executor tries to remove its presence entry.
_RETIRE_S = 2.0


class _KeepAlive:
    """In-progress acks every `interval` while a tool runs. A timer, not a task: most
    calls end long before the first tick, and then it costs nothing."""

    def __init__(self, delivery: Delivery, interval: float,
                 copies: list[Delivery] | None = None) -> None:
        # In-progress acks keep the message from being redelivered while the tool runs,
        # and their absence is how a dead executor is noticed: after one ack wait. Copies
        # of the delivery that came meanwhile (`copies`, grown as they come) get them too.
        self._delivery = delivery
        self._copies = copies if copies is not None else []
        self._interval = interval
        self._loop = asyncio.get_running_loop()
        self._handle: asyncio.TimerHandle | None = self._loop.call_later(interval, self._tick)
        self._task: asyncio.Task[None] | None = None
        self._last_poke = 0.0

    @property
    def delivery(self) -> Delivery:
        return self._delivery

    def _tick(self) -> None:
        self._task = self._loop.create_task(self._beat())
        self._handle = self._loop.call_later(self._interval, self._tick)

    async def _beat(self) -> None:
        for delivery in (self._delivery, *self._copies):
            with contextlib.suppress(Exception):
                await delivery.in_progress()

    def poke(self) -> None:
        """Progress was reported: ack in-progress now, at most once a second."""
        now = self._loop.time()
        if self._handle is not None and now - self._last_poke >= 1.0:
            self._last_poke = now
            self._task = self._loop.create_task(self._beat())

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


def _ms(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1000, 3)
