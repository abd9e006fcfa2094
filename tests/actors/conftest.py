"""Fixtures of the actor tests: real MCP servers (the `mcp` SDK's MCPServer) over
streamable HTTP, SSE and stdio, and a connector serving all three; a local HTTP server
speaking the OpenAI Chat Completions API with scripted replies (`model`)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from actors.mcp_connector import McpConnector
from bus.catalog import Catalog
from bus.client import ToolbusClient
from bus.connection import Bus
from schemas.events import TurnCompleted, TurnFailed
from tests.actors.test_planner import ScriptedChat
from tests.mcp_servers import SampleServer, http_config, mcp_config, stdio_command


async def call_outcome(client: ToolbusClient, sid: str, tool: str, args: dict[str, Any]) -> Any:
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
        http_config(ids["http"], http, api_key="k-123"),
        http_config(ids["sse"], sse),
        mcp_config(ids["stdio"], **stdio_command(), env={"TENANT": "acme", "SHARED": "server"}),
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


@pytest.fixture
async def model() -> AsyncIterator[ScriptedChat]:
    server = await ScriptedChat().start()
    yield server
    await server.stop()
