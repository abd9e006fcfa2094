"""The Python tool SDK: schemas from type hints, resources, pools, the catalog."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import uuid
from typing import Any

import pytest

from actors.executor import Executor
from actors.tools import load_tools, tool
from actors.tools.sdk import in_thread
from bus.catalog import Catalog
from bus.client import ToolbusClient
from bus.connection import Bus
from bus.subjects import approval_subject
from schemas.errors import ConfigError, ToolConflictError
from schemas.events import TurnCompleted, TurnFailed
from schemas.tools import ToolSpec
from tests.conftest import TESTS, EventWatch, of_type, settled_state


def _sdk() -> dict[str, Any]:
    return {t.spec.name: t for t in load_tools(str(TESTS / "sdk_toolkit.py"))}


def test_the_decorator_builds_the_schema_from_hints_docstring_and_models() -> None:
    spec = _sdk()["shipping:quote"].spec
    assert spec.description == "Quote the price of shipping one parcel."
    params = spec.parameters
    assert params["required"] == ["address"] and params["additionalProperties"] is False
    assert params["properties"]["speed"] == {
        "default": "standard", "description": "express costs double.",
        "enum": ["standard", "express"], "type": "string"}
    assert "rates" not in params["properties"]  # injected, not an argument
    address = params["$defs"]["Address"]
    assert address["properties"]["zip"]["pattern"] == r"^\d{5}$"
    assert spec.output is not None and spec.output["required"] == ["city", "price", "express"]
    assert spec.annotations.readOnlyHint and spec.annotations.idempotentHint
    assert not spec.annotations.destructiveHint and spec.risk_level == "low"
    assert spec.source == "python:tests.sdk_toolkit"  # the same as `--tools tests.sdk_toolkit`
    label = _sdk()["shipping:label"].spec
    assert label.requires_approval and label.risk_level == "high"
    assert not label.annotations.destructiveHint and label.output is not None


def test_bad_tool_definitions_are_clear_errors() -> None:
    with pytest.raises(ConfigError, match="namespace:tool"):
        tool("no_namespace")
    with pytest.raises(ConfigError, match="risk_level"):
        tool("a:b", risk_level="extreme")  # type: ignore[arg-type]

    def meta(_secret: int) -> None: ...

    with pytest.raises(ConfigError, match="starts with '_'"):
        tool("a:b")(meta)


async def _call(client: ToolbusClient, sid: str, tool_name: str, args: Any,
                **meta: str) -> Any:
    end = await client.call(sid, [{"tool": tool_name, "arguments": args, **meta}], timeout=15)
    assert isinstance(end, TurnCompleted | TurnFailed), end
    return end.outcomes[0]


async def test_sdk_tools_run_with_models_resources_and_output_checks(
        bus: Bus, client: ToolbusClient, sid: str, system: dict[str, Any]) -> None:
    tools = load_tools(str(TESTS / "sdk_toolkit.py"))
    mod = sys.modules["toolbus_user_tools_sdk_toolkit"]  # the module load_tools imported
    pool = f"sdk{uuid.uuid4().hex[:6]}"
    ex = Executor(bus, tools, instance=f"sdk-{pool}", pool=pool, ack_wait_s=5.0)
    await ex.start()
    try:
        assert mod.EVENTS == ["opened"]
        addr = {"street": "1 rue X", "city": "Paris", "zip": "75001"}
        out = await _call(client, sid, "shipping:quote", {"address": addr, "speed": "express"},
                          _delegate=pool)
        assert out.status == "succeeded", out
        assert out.result == {"city": "Paris", "price": 25.0, "express": True}
        bad = await _call(client, sid, "shipping:quote",
                          {"address": {"street": 1, "zip": "7500"}, "speed": "rocket"},
                          _delegate=pool)
        assert bad.status == "rejected" and bad.error.error_type == "invalid_arguments"
        for where in ("$.address.street", "$.address.zip", "$.address:", "$.speed"):
            assert where in bad.error.message, (where, bad.error.message)
        nope = await _call(client, sid, "shipping:quote",
                           {"address": {**addr, "city": "Nice"}}, _delegate=pool)
        assert nope.error.error_type == "no_service"
        # shipping:label says requires_approval: it waits for a human, who approves.
        async with EventWatch(bus, sid) as watch:
            pending = asyncio.create_task(
                _call(client, sid, "shipping:label", {"order_id": 7}, _delegate=pool))
            asked = (await watch.until(lambda evs: bool(of_type(evs, "approval.requested"))))
        request = of_type(asked, "approval.requested")[-1]
        assert request.rule == "tool:requires_approval"
        reply = await bus.request(approval_subject(sid, request.call_id, "tester"),
                                  b'{"decision": "approve", "by": "ada"}', timeout=5)
        assert json.loads(reply) == {"ok": True, "decision": "approved"}
        sync = await pending
        assert sync.result == {"order_id": 7, "copies": 1}  # default filled in
        broken = await _call(client, sid, "shipping:broken_promise", {}, _delegate=pool)
        assert broken.error.error_type == "output_invalid"
        assert "$.city" in broken.error.message
    finally:
        await ex.stop()
    assert mod.EVENTS == ["opened", "closed"]


async def test_delegate_routes_to_the_named_pool_and_unknown_pools_are_rejected(
        bus: Bus, client: ToolbusClient, sid: str, system: dict[str, Any]) -> None:
    from tests import toolkit

    special = Executor(bus, [toolkit.sleep], instance="special-1", pool="special",
                       ack_wait_s=5.0)
    await special.start()
    try:
        async with EventWatch(bus, sid) as watch:
            await _call(client, sid, "testing:sleep", {"seconds": 0}, _delegate="special")
            await _call(client, sid, "testing:sleep", {"seconds": 0})
            events = await watch.until(lambda evs: len(of_type(evs, "turn.completed")) == 2)
        started = of_type(events, "call.started")
        assert [s.executor for s in started] == ["special-1", "in-process"]
        assert of_type(events, "call.dispatched")[0].route == "special.testing"
        missing = await _call(client, sid, "testing:sleep", {"seconds": 0}, _delegate="gpu")
        assert missing.error.error_type == "unknown_pool"
        assert "default, special" in missing.error.message
    finally:
        await special.stop()


async def test_instance_targets_one_named_executor(
        bus: Bus, client: ToolbusClient, sid: str, system: dict[str, Any]) -> None:
    from tests import toolkit

    twin = Executor(bus, [toolkit.sleep], instance="twin-b", ack_wait_s=5.0)
    await twin.start()
    try:
        catalog: Catalog = system["catalog"]
        await catalog.wait_for_instance("twin-b", timeout=5)
        for _ in range(3):
            out = await _call(client, sid, "testing:sleep", {"seconds": 0}, _instance="twin-b")
            assert out.status == "succeeded"
        state = await settled_state(bus, client, sid)
        assert {c.executor for c in state.calls.values()} == {"twin-b"}
        gone = await _call(client, sid, "testing:sleep", {"seconds": 0}, _instance="nobody")
        assert gone.error.error_type == "unknown_instance"
        wrong = await _call(client, sid, "built-in:echo", {}, _instance="twin-b")
        assert "does not have the tool" in wrong.error.message
    finally:
        await twin.stop()


async def test_output_path_writes_the_result_into_the_session_state(
        bus: Bus, client: ToolbusClient, sid: str) -> None:
    await _call(client, sid, "built-in:echo", {"name": "Ada"}, _outputPath="customer.profile",
                _reasoningForCall="remember who we talk to")
    await _call(client, sid, "built-in:echo", {"n": 1}, _outputPath="customer.visits")
    state = await settled_state(bus, client, sid)
    assert state.data == {"customer": {"profile": {"name": "Ada"}, "visits": {"n": 1}}}
    call = next(c for c in state.calls.values() if c.output_path == "customer.profile")
    assert call.reasoning == "remember who we talk to"
    # the client fixture checks that the replayed state (data included) equals this one


async def test_two_sources_cannot_register_one_name_but_one_source_merges_pools(
        bus: Bus) -> None:
    catalog = Catalog(bus)
    name = f"clash{uuid.uuid4().hex[:6]}:tool"
    await catalog.register([ToolSpec(name=name, source="python:a", pools=["default"])])
    await catalog.register([ToolSpec(name=name, source="python:a", pools=["gpu"])])
    assert [s.pools for s in await catalog.load() if s.name == name] == [["default", "gpu"]]
    with pytest.raises(ToolConflictError) as err:
        await catalog.register([ToolSpec(name=name, source="mcp:other")])
    assert "already registered by python:a" in str(err.value)
    assert f"toolbus tools remove {name}" in str(err.value)
    assert [s.source for s in await catalog.load() if s.name == name] == ["python:a"]
    assert await catalog.remove(name)
    await catalog.register([ToolSpec(name=name, source="mcp:other")])


async def test_a_call_queued_for_an_instance_that_is_gone_fails_instead_of_waiting(
        bus: Bus, client: ToolbusClient, sid: str, system: dict[str, Any]) -> None:
    from tests import toolkit

    doomed = Executor(bus, [toolkit.sleep, toolkit.short_timeout], instance="doomed-1",
                      ack_wait_s=5.0, max_in_flight=1)
    await doomed.start()
    await system["catalog"].wait_for_instance("doomed-1", timeout=5)
    async with EventWatch(bus, sid) as watch:
        first = asyncio.create_task(_call(client, sid, "testing:sleep", {"seconds": 1.0},
                                          _instance="doomed-1"))
        await watch.until(lambda evs: bool(of_type(evs, "call.started")))
        # Ended once its (0.2 s) timeout has passed and its instance is gone.
        queued = asyncio.create_task(_call(client, sid, "testing:short_timeout",
                                           {"seconds": 0}, _instance="doomed-1"))
        await watch.until(lambda evs: len(of_type(evs, "call.dispatched")) == 2)
    await doomed.stop()  # finishes the running call, leaves the queued one behind
    first_out = await first
    assert first_out.status == "succeeded", first_out
    out = await queued  # the approval actor's janitor ends it
    assert out.status == "failed" and out.error.error_type == "instance_unavailable"
    assert out.error.retryable and "doomed-1" in out.error.message


async def test_sync_tools_left_running_past_their_timeout_never_hold_up_the_next(
        bus: Bus, client: ToolbusClient, sid: str, system: dict[str, Any]) -> None:
    release = threading.Event()

    @tool("stuck:wait", read_only=True, timeout_ms=200)
    def wait() -> dict[str, bool]:
        return {"released": release.wait(30)}

    @tool("stuck:quick", read_only=True, timeout_ms=5_000)
    def quick() -> dict[str, bool]:
        return {"ok": True}

    pool = f"stuck{uuid.uuid4().hex[:6]}"
    ex = Executor(bus, [wait, quick], instance=f"x-{pool}", pool=pool, ack_wait_s=5.0)
    await ex.start()
    try:
        # More than asyncio's shared pool has threads (min(32, cores + 4)): they filled
        # it, and no sync tool of the process ran again.
        stuck = await asyncio.gather(*(
            _call(client, f"{sid}-{i}", "stuck:wait", {}, _delegate=pool)
            for i in range(12)))
        assert {o.error.error_type for o in stuck} == {"timeout"}, stuck
        out = await _call(client, sid, "stuck:quick", {}, _delegate=pool)
        assert out.status == "succeeded" and out.result == {"ok": True}, out
    finally:
        release.set()
        await ex.stop()


async def test_a_sync_tool_that_exits_fails_its_call_and_not_its_executor() -> None:
    def leave() -> None:
        raise SystemExit(3)

    with pytest.raises(RuntimeError, match="raised SystemExit"):
        await in_thread(leave, {}, name="t:leave")
    assert await in_thread(lambda x: x + 1, {"x": 1}, name="t:add") == 2
