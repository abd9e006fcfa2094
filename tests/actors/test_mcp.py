"""The MCP connector against real MCP servers (the `mcp` SDK's MCPServer) over streamable
HTTP, SSE and stdio: catalog, calls, errors, keys, pagination, healing, list changes."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from actors.mcp_connector import McpConnector, McpUnavailableError
from bus.catalog import Catalog
from bus.client import ToolbusClient
from bus.connection import Bus
from schemas.events import TurnCompleted, TurnFailed
from schemas.manifest import McpServerConfig
from tests.conftest import EventWatch, of_type
from tests.mcp_servers import SampleServer, stdio_command

SAMPLE_TOOLS = ["add_model", "describe_car", "environment", "fleet_report", "reserve_car",
                "retire_model", "search_cars"]


def _cfg(id_: str, **kw: Any) -> McpServerConfig:
    return McpServerConfig.model_validate({"id": id_, "connect_timeout_ms": 5000,
                                           "timeout_ms": 20_000, **kw})


def _http(id_: str, server: SampleServer, **kw: Any) -> McpServerConfig:
    return _cfg(id_, transport=server.transport, hostname="http://127.0.0.1",
                port=server.port, **kw)


async def _call(client: ToolbusClient, sid: str, tool: str, args: dict[str, Any]) -> Any:
    end = await client.call(sid, [{"tool": tool, "arguments": args}], timeout=30)
    assert isinstance(end, TurnCompleted | TurnFailed), end
    return end.outcomes[0]


@pytest.fixture
async def servers(tmp_path: Path) -> AsyncIterator[dict[str, Any]]:
    """A paginating, key-protected streamable HTTP server; an SSE server; a stdio one."""
    uid = uuid.uuid4().hex[:6]
    log = tmp_path / "reservations.log"
    http = await SampleServer("streamable-http", "--api-key", "k-123", "--page-size", "2",
                              "--log", str(log)).start()
    sse = await SampleServer("sse").start()
    # The test policy auto-approves mcp*:* (reserve_car writes).
    ids = {"http": f"mcpcars{uid}", "sse": f"mcpsse{uid}", "stdio": f"mcpio{uid}"}
    yield {"http": http, "sse": sse, "ids": ids, "log": log, "configs": [
        _http(ids["http"], http, api_key="k-123"),
        _http(ids["sse"], sse),
        _cfg(ids["stdio"], **stdio_command(), env={"TENANT": "acme", "SHARED": "server"}),
    ]}
    http.stop()
    sse.stop()


@pytest.fixture
async def connector(bus: Bus, system: dict[str, Any],
                    servers: dict[str, Any]) -> AsyncIterator[McpConnector]:
    c = McpConnector(bus, servers["configs"],
                     env={"PATH": "/usr/bin:/bin", "FROM_PARENT": "yes", "SHARED": "parent"},
                     instance=f"mcp-{uuid.uuid4().hex[:6]}", ack_wait_s=1.0)
    await c.start()
    catalog: Catalog = system["catalog"]
    for i in servers["ids"].values():  # the session actor sees the tools
        await catalog._specs.wait_until(lambda items, i=i: f"{i}.search_cars" in items, 5)
    yield c
    await c.stop()


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

        found = await _call(client, sid, f"{ns}:search_cars", {"max_price": 55})
        assert found.status == "succeeded", (kind, found)
        assert [c["id"] for c in found.result["cars"]] == ["c1", "c2"]  # structured content
        text = await _call(client, sid, f"{ns}:describe_car", {"car_id": "c3"})
        assert text.result == "Citroen Berlingo, 7 seats, 61.0/day"  # content blocks as text
        err = await _call(client, sid, f"{ns}:describe_car", {"car_id": "nope"})
        assert err.status == "failed" and err.error.error_type == "tool_error"
        assert "no car nope" in err.error.message  # the server's own text
        bad = await _call(client, sid, f"{ns}:search_cars", {"max_price": "cheap"})
        assert bad.status == "rejected" and "$.max_price" in bad.error.message


async def test_a_stdio_servers_env_is_merged_over_the_connectors(
        connector: McpConnector, servers: dict[str, Any], client: ToolbusClient,
        sid: str) -> None:
    ns = servers["ids"]["stdio"]
    out = await _call(client, sid, f"{ns}:environment",
                      {"names": ["TENANT", "FROM_PARENT", "SHARED"]})
    assert out.result == {"TENANT": "acme", "FROM_PARENT": "yes", "SHARED": "server"}


async def test_the_bearer_key_is_sent_and_a_wrong_one_fails_start_up(
        bus: Bus, servers: dict[str, Any]) -> None:
    wrong = McpConnector(bus, [_http("keyless", servers["http"], api_key="wrong")], env={})
    with pytest.raises(McpUnavailableError) as err:
        await wrong.start()
    text = str(err.value)
    assert "MCP server keyless is unreachable" in text
    assert f"streamable-http http://127.0.0.1:{servers['http'].port}/mcp" in text
    assert "HTTP 401: the server refused the credentials (check api_key" in text
    assert "wrong" not in text  # the key itself is never printed


async def test_an_unreachable_server_fails_start_up_within_its_bounded_time(
        bus: Bus) -> None:
    dead = SampleServer()  # a free port nothing listens on
    connector = McpConnector(bus, [_cfg("ghost", hostname="http://127.0.0.1", port=dead.port,
                                        connect_timeout_ms=1500)], env={})
    t0 = time.monotonic()
    with pytest.raises(McpUnavailableError) as err:
        await connector.start()
    elapsed = time.monotonic() - t0
    assert f"MCP server ghost is unreachable: tried streamable-http http://127.0.0.1:{dead.port}" \
        f"/mcp" in str(err.value)
    assert elapsed < 1.5 + 5  # bounded by connect_timeout_ms, with slack for a busy machine
    stdio = McpConnector(bus, [_cfg("nocmd", transport="stdio",
                                    command="/nonexistent/mcp-server")], env={})
    with pytest.raises(McpUnavailableError, match="tried stdio command /nonexistent/mcp-server"):
        await stdio.start()


async def test_progress_notifications_keep_a_long_call_alive(
        connector: McpConnector, servers: dict[str, Any], client: ToolbusClient, sid: str,
        bus: Bus) -> None:
    ns = servers["ids"]["http"]
    async with EventWatch(bus, sid) as watch:
        # 6 steps of 0.4 s against an ack wait of 1 s: only in-progress acks prevent a
        # redelivery.
        out = await _call(client, sid, f"{ns}:fleet_report", {"steps": 6, "step_seconds": 0.4})
        events = await watch.until(lambda evs: bool(of_type(evs, "turn.completed")))
    assert out.result == {"result": "fleet: 4 cars"}
    assert [s.attempt for s in of_type(events, "call.started")] == [1]


async def test_a_restarted_server_heals_and_interrupts_only_its_non_idempotent_call(
        connector: McpConnector, servers: dict[str, Any], client: ToolbusClient, sid: str,
        bus: Bus) -> None:
    http: SampleServer = servers["http"]
    ns, other = servers["ids"]["http"], servers["ids"]["stdio"]
    link = connector.links[ns]
    reserve = asyncio.create_task(_call(client, sid, f"{ns}:reserve_car",
                                        {"car_id": "c1", "customer": "ada",
                                         "hold_seconds": 5}))
    log: Path = servers["log"]
    async with asyncio.timeout(10):  # until the server has made the reservation
        while not (log.exists() and log.read_text()):  # noqa: ASYNC110  # another process writes it: no event to await
            await asyncio.sleep(0.02)
    http.kill()
    out = await reserve
    assert out.status == "failed" and out.error.error_type == "interrupted", out
    assert "neither read-only nor idempotent" in out.error.message
    # Meanwhile other servers are untouched.
    assert (await _call(client, sid, f"{other}:describe_car", {"car_id": "c1"})).status \
        == "succeeded"
    await http.start()  # same port, a new process: the link opens a new session
    healed = await _call(client, sid, f"{ns}:search_cars", {"max_price": 40})
    assert healed.status == "succeeded" and healed.result["cars"][0]["id"] == "c1"
    assert link.sessions >= 2
    lines = log.read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["customer"] == "ada"  # ran once


async def test_an_idempotent_call_in_flight_is_retried_on_the_new_session(
        connector: McpConnector, servers: dict[str, Any], client: ToolbusClient,
        sid: str) -> None:
    http: SampleServer = servers["http"]
    ns = servers["ids"]["http"]
    report = asyncio.create_task(_call(client, sid, f"{ns}:fleet_report",
                                       {"steps": 8, "step_seconds": 0.25}))
    await asyncio.sleep(0.5)  # let the call reach the server (a side-effect-free tool)
    http.kill()
    await http.start()
    out = await report
    assert out.status == "succeeded", out
    assert out.result == {"result": "fleet: 4 cars"}


async def test_tool_list_changes_update_the_catalog_and_removed_tools_go(
        connector: McpConnector, servers: dict[str, Any], client: ToolbusClient, sid: str,
        system: dict[str, Any]) -> None:
    catalog: Catalog = system["catalog"]
    ns = servers["ids"]["sse"]
    added = await _call(client, sid, f"{ns}:add_model", {"name": "van"})
    assert added.status == "succeeded", added
    await catalog._specs.wait_until(lambda items: f"{ns}.quote_van" in items, 10)
    quote = await _call(client, sid, f"{ns}:quote_van", {"days": 2})
    assert quote.status == "succeeded" and quote.result == {"result": 84.0}
    await _call(client, sid, f"{ns}:retire_model", {"name": "van"})
    await catalog._specs.wait_until(lambda items: f"{ns}.quote_van" not in items, 10)
    gone = await _call(client, sid, f"{ns}:quote_van", {})
    assert gone.status == "rejected" and gone.error.error_type == "unknown_tool"


async def test_an_untrusted_servers_read_only_claims_are_not_believed(
        bus: Bus, client: ToolbusClient, sid: str, system: dict[str, Any],
        servers: dict[str, Any]) -> None:
    ns = f"untrusted{uuid.uuid4().hex[:6]}"  # not auto-approved by the test policy
    c = McpConnector(bus, [_http(ns, servers["sse"], trusted=False)], env={})
    await c.start()
    try:
        await system["catalog"]._specs.wait_until(lambda items: f"{ns}.search_cars" in items, 5)
        async with EventWatch(bus, sid) as watch:
            task = asyncio.create_task(_call(client, sid, f"{ns}:search_cars", {}))
            events = await watch.until(lambda evs: bool(of_type(evs, "approval.requested")))
        asked = of_type(events, "approval.requested")[-1]
        assert asked.rule == "policy:mutating" and "not believed" in asked.reason
        assert asked.side_effect and asked.risk == 6  # low 1, +2 +1 +1 as worst case, +1 untrusted
        out = await task  # the test policy's approval timeout: denied
        assert out.error.error_type == "approval_denied"
    finally:
        await c.stop()


async def test_each_progress_notification_reaches_the_keep_alive_hook(
        connector: McpConnector, servers: dict[str, Any]) -> None:
    """The executor's `progress` hook (an in-progress ack, throttled) fires on every MCP
    progress notification of the call, not only on its own timer."""
    link = connector.links[servers["ids"]["http"]]
    pokes: list[int] = []
    result = await link.call("fleet_report", {"steps": 4, "step_seconds": 0.05},
                             progress=lambda: pokes.append(1))
    assert not result.is_error
    assert len(pokes) == 4
