"""Janitor: ends calls that would otherwise wait forever for an executor that is gone.

Consumes: nothing durable; every few seconds it looks at the instance consumers
(`exec_instance_*`) that still hold unacknowledged calls, and at the executor presence
bucket.
Emits: `call.failed` for each call sent with `_instance` to an executor instance that is
no longer alive: `instance_unavailable` (retryable) if it never started, `interrupted` if
it started a tool that may not run twice.
Idempotency: the call's terminal message id, shared with the executors, so if the
instance comes back it finds the call ended, and two janitors write one failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from actors.kernel import SessionStates, outgoing_headers
from bus.catalog import Catalog
from bus.connection import Bus
from bus.eventlog import Append, EventLog
from bus.streams import instance_backlogs
from schemas.events import CallDispatched, CallFailed
from schemas.ids import call_terminal_id
from schemas.state import CallState

log = logging.getLogger("toolbus.janitor")

ACTOR = "janitor"


def fail_orphan(d: CallDispatched, call: CallState | None, instance: str, *, rerunnable: bool,
                now: float) -> CallFailed | None:
    """The failure that ends a call queued for a gone instance; None if it ended."""
    if call is not None and call.terminal:
        return None
    started = call is not None and call.attempts > 0
    if started and not rerunnable:
        kind, why = "interrupted", "stopped while running it"
    else:
        kind, why = "instance_unavailable", "is gone before running it"
    return CallFailed(session_id=d.session_id, at=now, actor=ACTOR, call_id=d.call_id,
                      turn_id=d.turn_id, error_type=kind,
                      retryable=kind == "instance_unavailable",
                      message=f"executor instance {instance} (named by _instance) {why} "
                              f"{d.tool}; call it again without _instance, or start that "
                              "instance first")


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

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="janitor")

    async def stop(self, grace: float = 5.0) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.sweep()
            except Exception as exc:  # a NATS outage: the next sweep tries again
                log.warning("sweeping calls of gone executor instances failed: %s", exc)

    async def sweep(self) -> None:
        for backlog in await instance_backlogs(self._bus):
            if self._catalog.instance_tools(backlog.instance) is not None:
                continue  # alive: its calls are only queued
            # The instance's backlog (not a session's history): what it was sent.
            for stored in await self._log.read_session(
                    "", after=backlog.after_seq, subject_filter=backlog.filter_subject):
                d = stored.event
                if not isinstance(d, CallDispatched):
                    continue
                call = (await self._states.current(d.session_id)).state.calls.get(d.call_id)
                spec = self._catalog.get(d.tool)
                failed = fail_orphan(d, call, backlog.instance, now=self._clock(),
                                     rerunnable=spec is not None and spec.rerunnable)
                if failed is None:
                    continue
                await self._log.append(Append(failed, call_terminal_id(d.session_id,
                                                                       d.call_id)),
                                       headers=outgoing_headers())
                log.warning("call %s of session %s: %s", d.call_id, d.session_id,
                            failed.error_type)
