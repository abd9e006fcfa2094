"""The MCP connector (actors/mcp_connector.py) against real MCP servers over streamable
HTTP, SSE and stdio: the catalog (every page, verbatim), calls, errors, in-progress
acks, list changes, untrusted servers, binary content."""

from __future__ import annotations

import asyncio
import base64
import uuid
from typing import Any

from actors.mcp_connector import McpConnector
from bus.catalog import Catalog
from bus.client import ToolbusClient
from bus.connection import Bus
from schemas.events import TurnCompleted
from tests.actors.conftest import call_outcome
from tests.conftest import EventWatch, of_type
from tests.mcp_servers import http_config, mcp_config, png, stdio_variant

SAMPLE_TOOLS = ["add_model", "describe_car", "environment", "fleet_report", "reserve_car",
                "retire_model", "search_cars"]


async def test_every_transport_registers_the_tools_verbatim_and_serves_calls(
        connector: McpConnector, servers: dict[str, Any], client: ToolbusClient, sid: str,
        system: dict[str, Any]) -> None:
    catalog: Catalog = system["catalog"]
    for kind, ns in servers["ids"].items():
        names = sorted(s.name.split(":", 1)[1] for s in catalog.all() if s.namespace == ns)
        assert names == SAMPLE_TOOLS, kind  # all pages of tools/list (page size 2 on http)
        spec = catalog.get(f"{ns}:search_cars")
        assert spec is not None
        assert spec.description == "Find cars by price per day and number of seats."
        assert spec.parameters["properties"]["max_price"]["description"] == "highest price per day"
        assert spec.annotations.readOnlyHint and spec.annotations.idempotentHint
        assert not spec.annotations.openWorldHint and spec.source == f"mcp:{ns}"
        reserve = catalog.get(f"{ns}:reserve_car")
        assert reserve is not None and not reserve.rerunnable and reserve.risk_level == "medium"

        found = await call_outcome(client, sid, f"{ns}:search_cars", {"max_price": 55})
        assert found.status == "succeeded", (kind, found)
        assert [c["id"] for c in found.result["cars"]] == ["c1", "c2"]  # structured content
        text = await call_outcome(client, sid, f"{ns}:describe_car", {"car_id": "c3"})
        assert text.result == "Citroen Berlingo, 7 seats, 61.0/day"  # content blocks as text
        err = await call_outcome(client, sid, f"{ns}:describe_car", {"car_id": "nope"})
        assert err.status == "failed" and err.error.error_type == "tool_error"
        assert "no car nope" in err.error.message  # the server's own text
        bad = await call_outcome(client, sid, f"{ns}:search_cars", {"max_price": "cheap"})
        assert bad.status == "rejected" and "$.max_price" in bad.error.message


async def test_progress_notifications_keep_a_long_call_alive(
        connector: McpConnector, servers: dict[str, Any], client: ToolbusClient, sid: str,
        bus: Bus) -> None:
    ns = servers["ids"]["http"]
    async with EventWatch(bus, sid) as watch:
        # 6 steps of 0.4 s against an ack wait of 1 s: only in-progress acks prevent a
        # redelivery.
        out = await call_outcome(client, sid, f"{ns}:fleet_report",
                                 {"steps": 6, "step_seconds": 0.4})
        events = await watch.until(lambda evs: bool(of_type(evs, "turn.completed")))
    assert out.result == {"result": "fleet: 4 cars"}
    assert [s.attempt for s in of_type(events, "call.started")] == [1]


async def test_tool_list_changes_update_the_catalog_and_removed_tools_go(
        connector: McpConnector, servers: dict[str, Any], client: ToolbusClient, sid: str,
        system: dict[str, Any]) -> None:
    catalog: Catalog = system["catalog"]
    ns = servers["ids"]["sse"]
    added = await call_outcome(client, sid, f"{ns}:add_model", {"name": "van"})
    assert added.status == "succeeded", added
    await catalog._specs.wait_until(lambda items: f"{ns}.quote_van" in items, 10)
    # Its executor says it serves it at once (a planner offers a model only the tools a
    # live executor lists), not at its next presence refresh.
    await catalog._executors.wait_until(
        lambda items: any(f"{ns}:quote_van" in i.tools for i in items.values()), 3)
    quote = await call_outcome(client, sid, f"{ns}:quote_van", {"days": 2})
    assert quote.status == "succeeded" and quote.result == {"result": 84.0}
    await call_outcome(client, sid, f"{ns}:retire_model", {"name": "van"})
    await catalog._specs.wait_until(lambda items: f"{ns}.quote_van" not in items, 10)
    gone = await call_outcome(client, sid, f"{ns}:quote_van", {})
    assert gone.status == "rejected" and gone.error.error_type == "unknown_tool"


async def test_an_untrusted_servers_read_only_claims_are_not_believed(
        bus: Bus, client: ToolbusClient, sid: str, system: dict[str, Any],
        servers: dict[str, Any]) -> None:
    ns = f"untrusted{uuid.uuid4().hex[:6]}"  # not auto-approved by the test policy
    c = McpConnector(bus, [http_config(ns, servers["sse"], trusted=False)], env={})
    await c.start()
    try:
        await system["catalog"]._specs.wait_until(lambda items: f"{ns}.search_cars" in items, 5)
        async with EventWatch(bus, sid) as watch:
            task = asyncio.create_task(call_outcome(client, sid, f"{ns}:search_cars", {}))
            events = await watch.until(lambda evs: bool(of_type(evs, "approval.requested")))
        asked = of_type(events, "approval.requested")[-1]
        assert asked.rule == "policy:mutating" and "not believed" in asked.reason
        assert asked.side_effect and asked.risk == 6  # low 1, +2 +1 +1 as worst case, +1 untrusted
        out = await task  # the test policy's approval timeout: denied
        assert out.error.error_type == "approval_denied"
    finally:
        await c.stop()


async def test_image_content_is_kept_inline_when_small_and_as_an_artifact_when_large(
        bus: Bus, client: ToolbusClient, sid: str, system: dict[str, Any]) -> None:
    ns = f"mcpimages{uuid.uuid4().hex[:6]}"
    c = McpConnector(bus, [mcp_config(ns, **stdio_variant())], env={})
    await c.start()
    try:
        await system["catalog"]._specs.wait_until(lambda items: f"{ns}.snapshot" in items, 5)
        small = await call_outcome(client, sid, f"{ns}:snapshot", {"side": 4})
        assert small.status == "succeeded", small
        # MCP's own content blocks: the caption, and the image as the server sent it.
        caption, image = small.result["content"]
        assert caption == {"type": "text", "text": "fleet snapshot, 4x4"}
        assert image["type"] == "image" and image["mimeType"] == "image/png"
        assert base64.b64decode(image["data"]) == png(4, 4)
        assert small.result_ref is None  # small enough for the event itself

        end = await client.call(sid, [{"tool": f"{ns}:snapshot",
                                       "arguments": {"side": 320, "noise": True}}],
                                timeout=30, full=True)
        assert isinstance(end, TurnCompleted)
        large = end.outcomes[0]
        assert large.status == "succeeded", large
        assert large.result_ref is not None  # in the object store, the event refers to it
        data = base64.b64decode(large.result["content"][1]["data"])
        assert data.startswith(b"\x89PNG\r\n") and len(data) > 300_000
    finally:
        await c.stop()
