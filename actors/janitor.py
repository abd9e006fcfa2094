"""Janitor: ends calls that would otherwise wait forever for an executor that is gone.

Consumes: nothing durable; every few seconds it looks at the executor consumers (`exec_*`:
a pool's, or an `_instance`'s) that still hold unacknowledged calls, and at the executor
presence bucket. The backlogs live in JetStream, so a restarted janitor finds them again.
Emits: `call.failed` for each call whose route no live executor serves once the call's
timeout has passed (counted from its dispatch, or from its latest start): a pool with no
live executor holding the call's namespace, or a named instance that is not alive.
`instance_unavailable` (retryable) if it never started or its tool may run again,
`interrupted` if it started a tool that may not run twice.
Idempotency: the call's terminal message id, shared with the executors, and the failure
is appended under the session's concurrency check after reading the call's state: if
anything was stored in the session since (the call's own outcome, another janitor's
failure), it reads again and decides again, so a call ends once.
Retry rule: a sweep that fails (a NATS outage) is retried at the next interval.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable

from actors.kernel import SessionStates
from bus.catalog import Catalog
from bus.connection import Bus
from bus.eventlog import Append, EventLog
from bus.streams import Backlog, executor_backlogs
from bus.tasks import stop_task
from schemas.defaults import DECIDE_ATTEMPTS
from schemas.errors import ConcurrencyError
from schemas.events import CallDispatched, CallFailed
from schemas.ids import call_terminal_id
from schemas.state import CallState
from schemas.tools import DEFAULT_TIMEOUT_MS

log = logging.getLogger("toolbus.janitor")

ACTOR = "janitor"
_ENDED_KEPT = 100_000  # dispatches of dead routes known ended, skipped by later sweeps


def fail_orphan(d: CallDispatched, call: CallState | None, backlog: Backlog, *,
                timeout_s: float, rerunnable: bool, now: float) -> CallFailed | None:
    """The failure that ends a call queued on a route no live executor serves; None while
    it may still end by itself (it ended, or its timeout has not run out yet)."""
    if call is not None and call.terminal:
        return None
    started = call is not None and call.attempts > 0
    since = d.at
    if call is not None and started and call.started_at is not None:
        since = call.started_at
    if now < since + timeout_s:
        return None
    if started and not rerunnable:
        kind = "interrupted"
        what = (f"{d.tool} stopped while running (what it did, in part or whole, may "
                f"stand); it is neither read-only nor idempotent, "
                "so it is not run again")
    else:
        kind = "instance_unavailable"
        what = f"{d.tool} did not {'finish' if started else 'run'} within its " \
               f"{timeout_s:g} s timeout"
    if backlog.instance is not None:
        message = (f"executor instance {backlog.instance} (named by _instance) is gone: "
                   f"{what}; call it again without _instance, or start that instance first")
    else:
        message = (f"no live executor serves pool {backlog.pool} (namespace "
                   f"{backlog.namespace}): {what}; start one (`toolbus actor executor "
                   f"--pool {backlog.pool}` with the --manifest or --tools that put "
                   f"{d.tool} in it), or call it again in another pool")
    return CallFailed(session_id=d.session_id, at=now, actor=ACTOR, call_id=d.call_id,
                      turn_id=d.turn_id, error_type=kind,
                      retryable=kind == "instance_unavailable", message=message)


class Janitor:
    def __init__(self, bus: Bus, catalog: Catalog, *, interval_s: float = 5.0,
                 clock: Callable[[], float] = time.time) -> None:
        self._bus = bus
        self._log = EventLog(bus)
        self._states = SessionStates(bus, self._log, size=256)
        self._catalog = catalog
        self._interval_s = interval_s
        self._clock = clock
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._ended: OrderedDict[int, None] = OrderedDict()  # stream seqs

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="janitor")

    async def stop(self, grace: float = 5.0) -> None:
        self._stopping = True
        # Cancelled again until it ends (see bus.tasks): the sweep would go on forever.
        await stop_task(self._task)

    async def _run(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self._interval_s)
            try:
                await self.sweep()
            except Exception as exc:  # a NATS outage: the next sweep tries again
                log.warning("sweeping calls of gone executors failed: %s", exc)

    def _alive(self, backlog: Backlog) -> bool:
        if backlog.instance is not None:
            return self._catalog.instance_tools(backlog.instance) is not None
        assert backlog.pool is not None
        return self._catalog.pool_serves(backlog.pool, backlog.namespace)

    async def sweep(self) -> None:
        for backlog in await executor_backlogs(self._bus):
            if self._alive(backlog):
                continue  # its calls are only queued
            # The route's backlog (not a session's history): what it was sent.
            for stored in await self._log.read_session(
                    "", after=backlog.after_seq, subject_filter=backlog.filter_subject):
                d = stored.event
                if not isinstance(d, CallDispatched) or stored.seq in self._ended:
                    continue
                spec = self._catalog.get(d.tool)
                timeout_s = (d.timeout_ms or (spec.timeout_ms if spec is not None
                                              else DEFAULT_TIMEOUT_MS)) / 1000
                if self._clock() < d.at + timeout_s:
                    continue  # not due yet, whatever the session says: no read needed
                if await self._end(d, backlog, timeout_s=timeout_s,
                                   rerunnable=spec is not None and spec.rerunnable):
                    # Nobody acknowledges it until an executor of the route is back: not
                    # read again meanwhile.
                    self._ended[stored.seq] = None
                    while len(self._ended) > _ENDED_KEPT:
                        self._ended.popitem(last=False)

    async def _end(self, d: CallDispatched, backlog: Backlog, *, timeout_s: float,
                   rerunnable: bool) -> bool:
        """End the call if it is due, checked against its session's state; True once it
        has ended (by this janitor or otherwise)."""
        entry = await self._states.current(d.session_id)
        async with entry.lock:
            for _ in range(DECIDE_ATTEMPTS):
                call = entry.state.calls.get(d.call_id)
                failed = fail_orphan(d, call, backlog, now=self._clock(),
                                     timeout_s=timeout_s, rerunnable=rerunnable)
                if failed is None:
                    return call is not None and call.terminal
                try:
                    await self._states.write(entry, [Append(
                        failed, call_terminal_id(d.session_id, d.call_id))])
                except ConcurrencyError:  # the session moved on: look again
                    await self._states.reread(entry)
                    continue
                log.warning("call %s of session %s: %s", d.call_id, d.session_id,
                            failed.error_type)
                return True
        log.warning("call %s of session %s: gave up ending it after %d conflicts",
                    d.call_id, d.session_id, DECIDE_ATTEMPTS)
        return False
