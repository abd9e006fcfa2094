"""The janitor: a call sent to a pool or an instance that no live executor serves ends
`instance_unavailable` once its timeout has passed, exactly once, with real actors."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from actors.executor import Executor
from actors.janitor import Janitor, fail_orphan
from actors.tools import LocalTool, tool
from bus.catalog import Catalog
from bus.client import ToolbusClient
from bus.connection import Bus
from bus.eventlog import EventLog
from bus.streams import Backlog
from schemas.events import CallDispatched, TurnCompleted
from schemas.state import CallState
from tests.conftest import EventWatch, of_type, settled_state


def _tools(ns: str, timeout_ms: int) -> list[LocalTool]:
    @tool(f"{ns}:look", read_only=True, timeout_ms=timeout_ms)
    async def look() -> str:
        return "seen"

    @tool(f"{ns}:write_once", auto_approve=True, timeout_ms=timeout_ms)
    async def write_once() -> str:
        return "written"

    return [look, write_once]


async def _vanished_pool(bus: Bus, catalog: Catalog, ns: str, timeout_ms: int) -> str:
    """A pool whose only executor served `ns` and stopped: the tools still list it."""
    pool = f"gone{ns}"
    executor = Executor(bus, _tools(ns, timeout_ms), instance=f"{ns}-1", pool=pool)
    await executor.start()
    await catalog.wait_for_instance(f"{ns}-1", timeout=5)
    await executor.stop()
    await catalog._executors.wait_until(lambda items: f"{ns}-1" not in items, 5)
    return pool


async def test_a_call_delegated_to_a_pool_with_no_live_executor_fails_after_its_timeout(
        bus: Bus, client: ToolbusClient, sid: str, system: dict[str, Any]) -> None:
    ns = f"vanish{uuid.uuid4().hex[:6]}"
    pool = await _vanished_pool(bus, system["catalog"], ns, timeout_ms=300)
    end = await client.call(sid, [{"tool": f"{ns}:look", "arguments": {}, "_delegate": pool}],
                            timeout=15)
    assert isinstance(end, TurnCompleted)
    out = end.outcomes[0]
    assert out.status == "failed" and out.error.error_type == "instance_unavailable"
    assert out.error.retryable
    assert f"no live executor serves pool {pool}" in out.error.message
    assert "within its 0.3 s timeout" in out.error.message
    async with EventWatch(bus, sid) as watch:
        events = await watch.until(lambda evs: bool(of_type(evs, "turn.completed")))
    dispatched, failed = of_type(events, "call.dispatched")[0], of_type(events, "call.failed")
    assert dispatched.route == f"{pool}.{ns}" and not of_type(events, "call.started")
    assert len(failed) == 1 and failed[0].actor == "janitor"
    assert failed[0].at >= dispatched.at + 0.3  # after its timeout, never before


async def test_racing_janitors_end_a_due_call_once_and_none_ends_it_early(
        bus: Bus, client: ToolbusClient, sid: str, system: dict[str, Any]) -> None:
    ns = f"race{uuid.uuid4().hex[:6]}"
    # Long enough that the test session's own janitor leaves it alone meanwhile.
    pool = await _vanished_pool(bus, system["catalog"], ns, timeout_ms=60_000)
    async with EventWatch(bus, sid) as watch:
        call = asyncio.create_task(client.call(
            sid, [{"tool": f"{ns}:write_once", "arguments": {}, "_delegate": pool}],
            timeout=30))
        await watch.until(lambda evs: bool(of_type(evs, "call.dispatched")))
        now = Janitor(bus, system["catalog"])
        await now.sweep()  # not due: its timeout has not passed
        state = await settled_state(bus, client, sid)
        assert [c.status for c in state.calls.values()] == ["dispatched"]
        later = [Janitor(bus, system["catalog"], clock=lambda: time.time() + 120)
                 for _ in range(3)]
        await asyncio.gather(*(j.sweep() for j in later))
        end = await call
        events = await watch.until(lambda evs: bool(of_type(evs, "turn.completed")))
    assert isinstance(end, TurnCompleted)
    assert end.outcomes[0].error.error_type == "instance_unavailable"
    assert len(of_type(events, "call.failed")) == 1
    await asyncio.gather(*(j.sweep() for j in later))  # ended: nothing more is written
    stored = [s.event for s in await EventLog(bus).read_session(sid) if s.event is not None]
    assert len(of_type(stored, "call.failed")) == 1 and len(stored) == len(events)


async def test_a_call_queued_on_a_live_instance_is_left_to_it_even_past_its_timeout(
        bus: Bus, client: ToolbusClient, sid: str, system: dict[str, Any]) -> None:
    from tests import toolkit

    busy = Executor(bus, [toolkit.sleep, toolkit.short_timeout], instance=f"busy-{sid}",
                    max_in_flight=1)
    await busy.start()
    try:
        await system["catalog"].wait_for_instance(busy.instance, timeout=5)
        async with EventWatch(bus, sid) as watch:
            first = asyncio.create_task(client.call(sid, [{
                "tool": "testing:sleep", "arguments": {"seconds": 1.0},
                "_instance": busy.instance}], timeout=15))
            await watch.until(lambda evs: bool(of_type(evs, "call.started")))
            queued = asyncio.create_task(client.call(sid, [{
                "tool": "testing:short_timeout", "arguments": {"seconds": 0},
                "_instance": busy.instance}], timeout=15))
            await watch.until(lambda evs: len(of_type(evs, "call.dispatched")) == 2)
            late = Janitor(bus, system["catalog"], clock=lambda: time.time() + 120)
            await late.sweep()  # due, but its instance is alive: only queued
            ends = await asyncio.gather(first, queued)
    finally:
        await busy.stop()
    assert [e.outcomes[0].status for e in ends] == ["succeeded", "succeeded"]


def test_an_orphan_is_ended_only_after_its_timeout_counted_from_its_latest_start() -> None:
    d = CallDispatched(session_id="s", at=100.0, actor="session", call_id="c", turn_id="t",
                       tool="ns:write", arguments={}, route="instance.i-1.ns", timeout_ms=10_000)
    gone = Backlog(None, "i-1", "ns", "toolbus.evt.*.*.call.dispatched.instance.i-1.ns", 0)
    queued = CallState(call_id="c", turn_id="t", tool="ns:write", arguments={},
                       status="dispatched")

    def end(call: CallState | None, now: float, rerunnable: bool = False) -> Any:
        return fail_orphan(d, call, gone, timeout_s=10.0, rerunnable=rerunnable, now=now)

    assert end(queued, now=109.9) is None
    unavailable = end(queued, now=110.0)
    assert unavailable.error_type == "instance_unavailable" and unavailable.retryable
    assert "executor instance i-1 (named by _instance) is gone" in unavailable.message
    running = CallState(call_id="c", turn_id="t", tool="ns:write", arguments={},
                        status="running", attempts=1, started_at=105.0)
    assert end(running, now=114.0) is None  # it may still be running on its executor
    interrupted = end(running, now=115.0)
    assert interrupted.error_type == "interrupted" and not interrupted.retryable
    assert end(running, now=115.0, rerunnable=True).error_type == "instance_unavailable"
    done = CallState(call_id="c", turn_id="t", tool="ns:write", arguments={},
                     status="succeeded")
    assert end(done, now=1e9) is None
