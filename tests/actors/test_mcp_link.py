"""The MCP link (actors/mcp_link.py) against real MCP servers: transports and their
environment, keys, bounded start-up failures, healing after a dropped connection,
retries of calls in flight, progress notifications."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

from actors.mcp_connector import McpConnector
from actors.mcp_link import McpUnavailableError
from bus.client import ToolbusClient
from bus.connection import Bus
from tests.actors.conftest import call_outcome
from tests.mcp_servers import SampleServer, http_config, mcp_config


async def test_a_stdio_servers_env_is_merged_over_the_connectors(
        connector: McpConnector, servers: dict[str, Any], client: ToolbusClient,
        sid: str) -> None:
    ns = servers["ids"]["stdio"]
    out = await call_outcome(client, sid, f"{ns}:environment",
                             {"names": ["TENANT", "FROM_PARENT", "SHARED"]})
    assert out.result == {"TENANT": "acme", "FROM_PARENT": "yes", "SHARED": "server"}


async def test_the_bearer_key_is_sent_and_a_wrong_one_fails_start_up(
        bus: Bus, servers: dict[str, Any]) -> None:
    wrong = McpConnector(bus, [http_config("keyless", servers["http"], api_key="wrong")], env={})
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
    connector = McpConnector(bus, [mcp_config("ghost", hostname="http://127.0.0.1",
                                              port=dead.port, connect_timeout_ms=1500)],
                             env={})
    t0 = time.monotonic()
    with pytest.raises(McpUnavailableError) as err:
        await connector.start()
    elapsed = time.monotonic() - t0
    assert f"MCP server ghost is unreachable: tried streamable-http http://127.0.0.1:{dead.port}" \
        f"/mcp" in str(err.value)
    assert elapsed < 1.5 + 5  # bounded by connect_timeout_ms, with slack for a busy machine
    stdio = McpConnector(bus, [mcp_config("nocmd", transport="stdio",
                                          command="/nonexistent/mcp-server")], env={})
    with pytest.raises(McpUnavailableError, match="tried stdio command /nonexistent/mcp-server"):
        await stdio.start()


async def test_a_restarted_server_heals_and_interrupts_only_its_non_idempotent_call(
        connector: McpConnector, servers: dict[str, Any], client: ToolbusClient, sid: str,
        bus: Bus) -> None:
    http: SampleServer = servers["http"]
    ns, other = servers["ids"]["http"], servers["ids"]["stdio"]
    link = connector.links[ns]
    reserve = asyncio.create_task(call_outcome(client, sid, f"{ns}:reserve_car",
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
    assert (await call_outcome(client, sid, f"{other}:describe_car", {"car_id": "c1"})).status \
        == "succeeded"
    await http.start()  # same port, a new process: the link opens a new session
    healed = await call_outcome(client, sid, f"{ns}:search_cars", {"max_price": 40})
    assert healed.status == "succeeded" and healed.result["cars"][0]["id"] == "c1"
    assert link.sessions >= 2
    lines = log.read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["customer"] == "ada"  # ran once


async def test_an_idempotent_call_in_flight_is_retried_on_the_new_session(
        connector: McpConnector, servers: dict[str, Any], client: ToolbusClient,
        sid: str) -> None:
    http: SampleServer = servers["http"]
    ns = servers["ids"]["http"]
    report = asyncio.create_task(call_outcome(client, sid, f"{ns}:fleet_report",
                                              {"steps": 8, "step_seconds": 0.25}))
    await asyncio.sleep(0.5)  # let the call reach the server (a side-effect-free tool)
    http.kill()
    await http.start()
    out = await report
    assert out.status == "succeeded", out
    assert out.result == {"result": "fleet: 4 cars"}


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
