"""The executor's containment rules, with an in-process executor on a real server."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from datetime import datetime
from typing import Any

import pytest

from actors.executor import Executor, default_instance_name
from actors.tools import load_tools, tool
from bus.client import ToolbusClient
from bus.connection import Bus
from bus.eventlog import Append, EventLog
from schemas.errors import ConfigError
from schemas.events import CallDispatched, CallFailed, CallRequested, TurnCompleted
from schemas.ids import call_requested_id, call_terminal_id, dispatch_id, is_token
from schemas.tools import instance_route
from tests.conftest import TESTS, of_type


async def _one(client: ToolbusClient, sid: str, tool: str, arguments: dict) -> object:
    end = await client.call(sid, [{"tool": tool, "arguments": arguments}], timeout=15)
    assert isinstance(end, TurnCompleted)
    return end.outcomes[0]


async def test_current_time_is_iso_8601_in_the_requested_zone(client, sid) -> None:
    out = await _one(client, sid, "built-in:current_time", {"timezone": "Asia/Tokyo"})
    parsed = datetime.fromisoformat(out.result["time"])  # type: ignore[attr-defined]
    assert parsed.utcoffset() is not None and parsed.utcoffset().total_seconds() == 9 * 3600
    utc = await _one(client, sid, "built-in:current_time", {})
    assert utc.result["timezone"] == "UTC"  # type: ignore[attr-defined]


async def test_a_bad_time_zone_is_a_clear_call_failure(client, sid) -> None:
    out = await _one(client, sid, "built-in:current_time", {"timezone": "Mars/Olympus"})
    assert out.status == "failed"  # type: ignore[attr-defined]
    assert out.error.error_type == "invalid_timezone"  # type: ignore[attr-defined]
    assert "Mars/Olympus" in out.error.message  # type: ignore[attr-defined]


async def test_a_tool_past_its_timeout_fails_retryable(client, sid) -> None:
    out = await _one(client, sid, "testing:short_timeout", {"seconds": 5})
    assert out.error.error_type == "timeout" and out.error.retryable  # type: ignore[attr-defined]
    assert "0.2 s" in out.error.message  # type: ignore[attr-defined]


async def test_a_raising_tool_is_a_call_failure_and_the_executor_goes_on(client, sid) -> None:
    out = await _one(client, sid, "testing:boom", {"message": "disk on fire"})
    assert out.error.error_type == "RuntimeError"  # type: ignore[attr-defined]
    assert out.error.message == "disk on fire"  # type: ignore[attr-defined]
    after = await _one(client, sid, "built-in:echo", {"still": "alive"})
    assert after.result == {"still": "alive"}  # type: ignore[attr-defined]


async def test_a_tool_error_keeps_its_type_and_retryable_flag(client, sid) -> None:
    out = await _one(client, sid, "testing:refuse", {"reason": "rate limited"})
    assert out.error.error_type == "refused" and out.error.retryable  # type: ignore[attr-defined]


async def test_a_result_that_is_not_json_is_a_call_failure(client, sid) -> None:
    out = await _one(client, sid, "testing:not_json", {})
    assert out.error.error_type == "result_not_serializable"  # type: ignore[attr-defined]


async def test_arguments_the_function_cannot_take_fail_the_call(client, sid) -> None:
    # testing:loose declares a schema looser than its signature: the schema lets the call
    # through, the executor's own check stops it before the function runs.
    out = await _one(client, sid, "testing:loose", {"secs": 1})
    assert out.error.error_type == "invalid_arguments"  # type: ignore[attr-defined]
    assert "seconds" in out.error.message  # type: ignore[attr-defined]


async def test_a_call_the_janitor_ended_is_not_run_by_its_named_instance_later(
        bus, sid, tmp_path) -> None:
    # The instance's presence lapsed, the janitor ended the call it was sent; when the
    # instance comes back and receives the call, it must not run it anyway.
    log = EventLog(bus)
    call = "late-turn-0"
    await log.append(Append(CallRequested(session_id=sid, at=1.0, actor="session",
                                          call_id=call, turn_id="late-turn",
                                          tool="testing:append_line", arguments={}),
                            call_requested_id(sid, call)))
    await log.append(Append(CallFailed(session_id=sid, at=2.0, actor="janitor", call_id=call,
                                       turn_id="late-turn", error_type="instance_unavailable",
                                       message="gone"), call_terminal_id(sid, call)))
    effects = tmp_path / "effects.txt"
    route = instance_route("late-one", "testing")
    await log.append(Append(CallDispatched(
        session_id=sid, at=3.0, actor="session", call_id=call, turn_id="late-turn",
        tool="testing:append_line", arguments={"path": str(effects), "line": "no"},
        route=route), dispatch_id(sid, call), route))
    executor = Executor(bus, load_tools(str(TESTS / "toolkit.py")), instance="late-one",
                        register=False)
    await executor.start()
    try:
        async with asyncio.timeout(5):
            while True:  # the consumer takes it and acks it: the server says when
                ci = await bus.js.consumer_info("TOOLBUS_EVENTS",
                                                "exec_instance_late-one_testing")
                if ci.num_pending == 0 and ci.num_ack_pending == 0:
                    break
                await asyncio.sleep(0.02)
    finally:
        await executor.stop()
    assert executor.runs == 0 and not effects.exists()
    events = [s.event for s in await log.read_session(sid)]
    assert len(of_type(events, "call.failed")) == 1 and not of_type(events, "call.started")


async def test_a_result_over_the_result_cap_fails_and_stores_nothing(bus, client, sid) -> None:
    executor = Executor(bus, load_tools(str(TESTS / "toolkit.py")), instance="capped",
                        pool="capped", max_result=300_000)
    await executor.start()
    try:
        for args in ({"size": 300_001}, {"size": 200_000, "fill": "\x01"}):  # str; escaped
            end = await client.call(sid, [{"tool": "testing:blob", "arguments": args,
                                           "_delegate": "capped"}], timeout=15)
            out = end.outcomes[0]
            assert out.status == "failed" and out.error.error_type == "result_too_large"
            assert "300,000 bytes are not stored" in out.error.message
    finally:
        await executor.stop()


def test_default_instance_names_are_per_pool_and_valid_tokens() -> None:
    suffix = f"-{os.getpid()}"
    assert default_instance_name().endswith(suffix)
    assert default_instance_name("gpu").endswith(f"{suffix}-gpu")
    assert default_instance_name("gpu") != default_instance_name("default")
    long = default_instance_name("p" * 128)
    assert is_token(long) and len(long) == 128


async def test_two_executors_of_one_process_cannot_share_an_instance_name(bus) -> None:
    tools = load_tools(str(TESTS / "toolkit.py"))
    first = Executor(bus, tools, instance="twin-name", pool="twins", register=False)
    twin = Executor(bus, tools, instance="twin-name", pool="twins-too", register=False)
    await first.start()
    try:
        with pytest.raises(ConfigError, match="twin-name is already taken in this process "
                                              r"\(pool twins\)"):
            await twin.start()
        others = [Executor(bus, tools, pool=p, register=False) for p in ("twins", "twins-b")]
        assert len({first.instance, *(o.instance for o in others)}) == 3
    finally:
        await first.stop()
    await twin.start()  # the name is free again once its holder stopped
    await twin.stop()


# --- a delivery the server forgot ------------------------------------------------------------


def _side_effect_tool(ran: list[str], release: asyncio.Event):  # type: ignore[no-untyped-def]
    from actors.tools import tool

    @tool("dupe:charge", timeout_ms=30_000)  # neither read-only nor idempotent
    async def charge(amount: int) -> dict:
        ran.append(f"charge {amount}")
        await release.wait()
        return {"charged": amount}

    return charge


async def _requested(log: EventLog, sid: str, call: str) -> None:
    """A call of dupe:charge, approved (under the approval actor's own message id, so
    the suite's approval actor, which knows no such tool, decides nothing)."""
    from schemas.events import CallApproved
    from schemas.ids import policy_decision_id
    from schemas.tools import pool_route
    await log.append(Append(CallRequested(session_id=sid, at=2.0, actor="session",
                                          call_id=call, turn_id=f"{call}-turn",
                                          tool="dupe:charge", arguments={"amount": 5}),
                            call_requested_id(sid, call)))
    await log.append(Append(CallApproved(
        session_id=sid, at=2.0, actor="approval", call_id=call, turn_id=f"{call}-turn",
        tool="dupe:charge", rule="test", arguments={"amount": 5},
        route=pool_route("default", "dupe")), policy_decision_id(sid, call)))


async def _dispatch(log: EventLog, sid: str, call: str, msg_id: str) -> None:
    from schemas.tools import pool_route
    route = pool_route("default", "dupe")
    await _requested(log, sid, call)
    await log.append(Append(CallDispatched(
        session_id=sid, at=3.0, actor="session", call_id=call, turn_id=f"{call}-turn",
        tool="dupe:charge", arguments={"amount": 5}, route=route), msg_id, route))


async def _terminal(log: EventLog, sid: str) -> list[object]:
    async with asyncio.timeout(15):
        while True:
            events = [s.event for s in await log.read_session(sid)]
            ends = of_type(events, "call.succeeded") + of_type(events, "call.failed")
            if ends:
                return ends
            await asyncio.sleep(0.05)


async def test_a_call_delivered_again_as_new_while_it_runs_here_runs_once(bus, sid) -> None:
    # A server restarted without its consumer's delivery counts hands out a running call
    # again as a first delivery: the tool must not run a second time.
    ran: list[str] = []
    release = asyncio.Event()
    log = EventLog(bus)
    executor = Executor(bus, [_side_effect_tool(ran, release)], register=False,
                        ack_wait_s=0.5)
    await executor.start()
    before = (await bus.js.consumer_info("TOOLBUS_EVENTS", "exec_default_dupe")
              ).num_redelivered
    try:
        await _dispatch(log, sid, "c1", dispatch_id(sid, "c1"))
        async with asyncio.timeout(10):
            while not ran:  # noqa: ASYNC110 - the tool says when it started
                await asyncio.sleep(0.02)
        await _dispatch(log, sid, "c1", "the-same-dispatch-again")
        await asyncio.sleep(2.0)  # the copy is held beside the run, kept alive meanwhile
        release.set()
        (end,) = await _terminal(log, sid)
        async with asyncio.timeout(10):
            while True:  # both acked once the outcome is stored: nothing comes back
                ci = await bus.js.consumer_info("TOOLBUS_EVENTS", "exec_default_dupe")
                if ci.num_pending == 0 and ci.num_ack_pending == 0:
                    break
                await asyncio.sleep(0.05)
        assert ci.num_redelivered == before  # the copy was never handed out again
    finally:
        await executor.stop()
    assert ran == ["charge 5"]
    assert type(end).__name__ == "CallSucceeded"
    events = [s.event for s in await log.read_session(sid)]
    assert len(of_type(events, "call.succeeded") + of_type(events, "call.failed")) == 1


async def test_a_call_another_delivery_started_is_not_run_as_a_first_one(bus, sid) -> None:
    # Started by an executor that died (the server forgot that delivery): this one gets it
    # as a first delivery, finds `call.started` of attempt 1 stored by someone else, and
    # does not run it; delivered again, it is `interrupted`.
    from schemas.events import CallStarted
    from schemas.ids import call_started_id
    ran: list[str] = []
    release = asyncio.Event()
    release.set()
    log = EventLog(bus)
    await _requested(log, sid, "c2")
    await log.append(Append(CallStarted(session_id=sid, at=1.0, actor="executor",
                                        call_id="c2", turn_id="c2-turn", executor="gone-1",
                                        attempt=1), call_started_id(sid, "c2", 1)))
    executor = Executor(bus, [_side_effect_tool(ran, release)], register=False,
                        ack_wait_s=0.5)
    await executor.start()
    try:
        await _dispatch(log, sid, "c2", dispatch_id(sid, "c2"))
        (end,) = await _terminal(log, sid)
    finally:
        await executor.stop()
    assert ran == []
    assert isinstance(end, CallFailed) and end.error_type == "interrupted"


class _Later:
    """`time` as the executor module reads it, `ahead` seconds later: each delivery looks
    that much older (held up past half its ack wait). With the executor live throughout,
    the suite's janitor leaves its calls alone."""

    def __init__(self, ahead: float) -> None:
        self._ahead = ahead

    def time(self) -> float:
        return time.time() + self._ahead

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)


def _held_up_executor(bus: Bus, ran: list[str], monkeypatch: Any) -> Executor:
    """An executor of dupe:charge whose every delivery looks 1.2 s old, past half its
    ack wait (2 s)."""
    import actors.executor
    release = asyncio.Event()
    release.set()
    monkeypatch.setattr(actors.executor, "time", _Later(1.2))
    return Executor(bus, [_side_effect_tool(ran, release)], register=False, ack_wait_s=2.0)


async def test_a_delivery_held_up_past_its_ack_wait_leaves_the_call_to_the_later_one(
        bus, sid, monkeypatch) -> None:
    # An executor stopped (SIGSTOP, a starved machine) past half its ack wait holds a
    # delivery the server has handed out again, and the later delivery started the call
    # elsewhere. Unchecked under 5 s it stored a start of its own and ran the tool a second
    # time; checked, it ended the call running elsewhere `interrupted`. It leaves it now.
    from schemas.events import CallStarted, CallSucceeded
    from schemas.ids import call_started_id, call_terminal_id
    ran: list[str] = []
    log = EventLog(bus)
    executor = _held_up_executor(bus, ran, monkeypatch)
    await executor.start()
    try:
        await _requested(log, sid, "c3")
        await log.append(Append(CallStarted(session_id=sid, at=1.0, actor="executor",
                                            call_id="c3", turn_id="c3-turn",
                                            executor="later-1", attempt=2),
                                call_started_id(sid, "c3", 2)))
        await _dispatch(log, sid, "c3", dispatch_id(sid, "c3"))
        await asyncio.sleep(0.6)  # taken, and left alone
        events = [s.event for s in await log.read_session(sid)]
        assert of_type(events, "call.failed") == [] and ran == []
        assert [e.attempt for e in of_type(events, "call.started")] == [2]
        # The later delivery's executor ends it.
        await log.append(Append(CallSucceeded(session_id=sid, at=2.0, actor="executor",
                                              call_id="c3", turn_id="c3-turn",
                                              executor="later-1", result={"charged": 5}),
                                call_terminal_id(sid, "c3")))
        (end,) = await _terminal(log, sid)
    finally:
        await executor.stop()
    assert ran == [] and isinstance(end, CallSucceeded)


@pytest.mark.parametrize("held_up", [True, False])
async def test_of_two_deliveries_that_both_found_the_call_unstarted_the_first_start_runs(
        bus, sid, monkeypatch, held_up: bool) -> None:
    # Both looked at the state (or, fresh, had no reason to) before either start was
    # stored: both stored one (their ids differ by attempt), and both ran the tool. A
    # fresh delivery can be held up after its look, before its start is stored. The one
    # whose start was stored first runs it; the other leaves it.
    from schemas.events import CallStarted
    from schemas.ids import call_started_id
    ran: list[str] = []
    log = EventLog(bus)
    release = asyncio.Event()
    release.set()
    executor = _held_up_executor(bus, ran, monkeypatch) if held_up else \
        Executor(bus, [_side_effect_tool(ran, release)], register=False, ack_wait_s=2.0)
    await _requested(log, sid, "c4")
    looked_before = await executor._states.current(sid)  # no start stored yet

    async def stale(session_id: str) -> object:
        return looked_before
    monkeypatch.setattr(executor._states, "current", stale)
    await _dispatch(log, sid, "c4", dispatch_id(sid, "c4"))
    await log.append(Append(CallStarted(session_id=sid, at=1.0, actor="executor",
                                        call_id="c4", turn_id="c4-turn", executor="other-1",
                                        attempt=2), call_started_id(sid, "c4", 2)))
    await executor.start()
    try:
        async with asyncio.timeout(10):
            while len(of_type([s.event for s in await log.read_session(sid)],  # noqa: ASYNC110
                              "call.started")) < 2:
                await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
    finally:
        await executor.stop()
    assert ran == []


@pytest.mark.parametrize(("depth", "status"), [(100, "succeeded"), (900, "failed")])
async def test_a_result_nested_too_deep_to_read_back_fails_its_call(
        bus: Bus, client: ToolbusClient, sid: str, system: dict[str, Any], depth: int,
        status: str) -> None:
    # 900 levels encode, but a reader a few hundred frames deep cannot decode them: the
    # event would be stored, and the session's state unreadable there.
    def nested(n: int) -> Any:
        value: list[Any] = []
        for _ in range(n - 1):
            value = [value]
        return value

    @tool("deep:result", read_only=True, parameters={"type": "object"})
    async def deep() -> Any:
        return nested(depth)

    pool = f"deep{uuid.uuid4().hex[:6]}"
    ex = Executor(bus, [deep], instance=f"d-{pool}", pool=pool, ack_wait_s=5.0)
    await ex.start()
    try:
        end = await client.call(sid, [{"tool": "deep:result", "arguments": {},
                                       "_delegate": pool}], timeout=20)
    finally:
        await ex.stop()
    (out,) = end.outcomes
    assert out.status == status, out
    if status == "failed":
        assert out.error is not None and out.error.error_type == "result_not_serializable"
        assert "nested over 128 levels deep" in out.error.message
