"""MCP servers that misbehave (tests/hostile_mcp.py, raw JSON-RPC over stdio and HTTP):
what they send back never holds their key, a message without end is refused rather than
buffered, a server's own -32000 error is an error (not a dropped connection, which would
interrupt its other calls and run read-only ones again), and tool names that make no
catalog key are skipped."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from actors.mcp_connector import McpConnector
from actors.mcp_link import McpLink, McpUnavailableError
from bus.catalog import Catalog
from bus.client import ToolbusClient
from bus.connection import Bus
from bus.eventlog import EventLog
from tests.actors.conftest import call_outcome
from tests.mcp_servers import REPO, SampleServer, http_config, mcp_config

KEY = "sk-hostile-0123456789abcdef"


async def _ignore(link: McpLink, tools: list[Any]) -> None:
    """No catalog: these servers never get that far."""


def hostile_stdio(*args: str) -> dict[str, object]:
    return {"transport": "stdio", "command": sys.executable,
            "args": ["-m", "tests.hostile_mcp", "--transport", "stdio", *args],
            "cwd": str(REPO)}


@pytest.fixture
async def hostile_http() -> AsyncIterator[SampleServer]:
    server = await SampleServer("streamable-http", module="tests.hostile_mcp").start()
    yield server
    server.stop()


@contextlib.asynccontextmanager
async def connected(bus: Bus, system: dict[str, Any], *configs: Any
                    ) -> AsyncIterator[McpConnector]:
    """A connector of `configs`, once each server's `ok` is in the catalog; stopped after."""
    c = McpConnector(bus, list(configs), env={}, ack_wait_s=1.0)
    await c.start()
    try:
        catalog: Catalog = system["catalog"]
        for cfg in configs:
            await catalog._specs.wait_until(lambda items, i=cfg.id: f"{i}.ok" in items, 5)
        yield c
    finally:
        await c.stop()


async def test_a_key_the_server_quotes_back_is_never_stored(
        bus: Bus, client: ToolbusClient, sid: str, system: dict[str, Any],
        hostile_http: SampleServer) -> None:
    ns = f"mcpkey{uuid.uuid4().hex[:6]}"
    async with connected(bus, system, http_config(ns, hostile_http, api_key=KEY)):
        failed = await call_outcome(client, sid, f"{ns}:echo_auth", {})
        assert failed.error.error_type == "tool_error"
        assert failed.error.message == "refused: you sent Bearer [redacted]"
        refused = await call_outcome(client, sid, f"{ns}:err_auth", {})
        assert refused.error.error_type == "mcp_error"
        assert "bad credentials Bearer [redacted]" in refused.error.message
        shown = await call_outcome(client, sid, f"{ns}:show_auth", {})
        assert shown.result == {"headers": {"authorization": "Bearer [redacted]"}}
        stored = msgspec.json.encode([s.event for s in await EventLog(bus).read_session(sid)])
        assert KEY.encode() not in stored


async def test_a_key_in_the_servers_url_query_is_never_stored_when_quoted_back(
        bus: Bus, client: ToolbusClient, sid: str, system: dict[str, Any],
        hostile_http: SampleServer) -> None:
    # Hosted MCP servers often take the key in the URL (`/mcp?api_key=...`).
    ns = f"mcpqkey{uuid.uuid4().hex[:6]}"
    async with connected(bus, system, http_config(ns, hostile_http,
                                                  path=f"/mcp?api_key={KEY}")):
        failed = await call_outcome(client, sid, f"{ns}:echo_url", {})
        assert failed.error.message == "refused: you asked /mcp?api_key=[redacted]"
        stored = msgspec.json.encode([s.event for s in await EventLog(bus).read_session(sid)])
        assert KEY.encode() not in stored


@pytest.mark.parametrize("mode", ["initauth", "http401"])
async def test_a_key_the_server_quotes_back_at_start_up_is_never_shown(
        mode: str, capsys: pytest.CaptureFixture[str]) -> None:
    # Its error answering `initialize` (or its 401 page) quotes the Authorization header:
    # the start-up error is printed by `toolbus up` and logged by a worker.
    server = await SampleServer("streamable-http", "--mode", mode,
                                module="tests.hostile_mcp").start()
    try:
        link = McpLink(http_config("keyed", server, api_key=KEY), env={}, on_tools=_ignore)
        with pytest.raises(McpUnavailableError) as err:
            await link.start()
    finally:
        server.stop()
    assert "MCP server keyed is unreachable" in str(err.value)
    assert KEY not in str(err.value) and KEY[3:15] not in str(err.value)
    assert KEY not in capsys.readouterr().err


async def test_a_key_a_stdio_server_quotes_on_stderr_is_never_shown(
        capsys: pytest.CaptureFixture[str]) -> None:
    cfg = mcp_config("keyedio", **hostile_stdio("--mode", "stderrkey"),
                     env={"TOKEN": KEY})
    link = McpLink(cfg, env={}, on_tools=_ignore)
    with pytest.raises(McpUnavailableError) as err:
        await link.start()
    assert "its stderr ended with: error: token [redacted] was refused" in str(err.value)
    passed_on = capsys.readouterr().err
    assert "[mcp keyedio] error: token [redacted] was refused" in passed_on
    assert KEY not in passed_on


async def test_a_key_a_stderr_line_is_cut_in_shows_none_of_it() -> None:
    # The start-up error shows each stderr line cut at 240 characters: cut inside the key,
    # its first part stayed.
    pad = 240 - len("error: token ") - len(KEY) // 2
    cfg = mcp_config("keyedcut", **hostile_stdio("--mode", "stderrkey"),
                     env={"TOKEN": KEY, "PAD": str(pad)})
    link = McpLink(cfg, env={}, on_tools=_ignore)
    with pytest.raises(McpUnavailableError) as err:
        await link.start()
    shown = str(err.value)
    assert "xtoken [redacted]. Start it" in shown and KEY[:4] not in shown, shown


async def test_a_servers_own_minus_32000_error_is_an_error_not_a_dropped_connection(
        bus: Bus, client: ToolbusClient, sid: str, system: dict[str, Any],
        tmp_path: Path) -> None:
    ns = f"mcpbusy{uuid.uuid4().hex[:6]}"
    count = tmp_path / "busy.log"
    cfg = mcp_config(ns, **hostile_stdio("--count", str(count)))
    async with connected(bus, system, cfg) as c:
        out = await call_outcome(client, sid, f"{ns}:busy", {})
        assert out.status == "failed" and out.error.error_type == "mcp_error", out
        assert "database is locked" in out.error.message
        assert count.read_text().count("busy") == 1  # answered: not sent again
        assert c.links[ns].sessions == 1  # the session lives on


async def test_an_answer_without_end_is_refused_not_buffered(
        bus: Bus, client: ToolbusClient, sid: str, system: dict[str, Any],
        hostile_http: SampleServer) -> None:
    web, io = f"mcpendless{uuid.uuid4().hex[:6]}", f"mcpendlessio{uuid.uuid4().hex[:6]}"
    async with connected(bus, system, http_config(web, hostile_http),
                        mcp_config(io, **hostile_stdio())) as c:
        outs = await asyncio.gather(call_outcome(client, sid, f"{web}:endless", {}),
                                    call_outcome(client, sid, f"{io}:endless", {}))
        for out in outs:  # well before the call's 20 s timeout, not out of memory
            assert out.status == "failed" and out.error.error_type != "timeout", out
        assert "over 64 MiB" in outs[0].error.message
        # The stdio stream cannot be read past it: its session ended and a new one began.
        assert c.links[io].sessions == 2
        for ns in (web, io):
            ok = await call_outcome(client, sid, f"{ns}:ok", {})
            assert ok.result == "ok"


async def test_tool_names_that_make_no_catalog_key_are_skipped(
        bus: Bus, system: dict[str, Any]) -> None:
    ns = f"mcpnames{uuid.uuid4().hex[:6]}"
    cfg = mcp_config(ns, **hostile_stdio("--names", "a.,.b,c..d,..,files.read"))
    async with connected(bus, system, cfg) as c:
        assert f"{ns}:files.read" in c.tools
        assert not {f"{ns}:{n}" for n in ("a.", ".b", "c..d", "..")} & set(c.tools)


async def test_a_server_that_exits_while_its_child_holds_stdout_is_restarted(
        bus: Bus, client: ToolbusClient, sid: str, system: dict[str, Any]) -> None:
    # It forks a daemon (a session of its own) that keeps its stdout open, then exits on
    # `hostile`: the session must end with the process, not wait for that stdout to end.
    ns = f"mcpforkdie{uuid.uuid4().hex[:6]}"
    cfg = mcp_config(ns, **hostile_stdio("--mode", "forkdie"))
    async with connected(bus, system, cfg) as c:
        died = await asyncio.wait_for(call_outcome(client, sid, f"{ns}:hostile", {}), 10)
        assert died.status == "failed" and died.error.error_type != "timeout", died
        ok = await asyncio.wait_for(call_outcome(client, sid, f"{ns}:ok", {}), 10)
        assert ok.result == "ok"
        assert c.links[ns].sessions >= 2


async def test_a_server_announcing_changes_without_pause_is_listed_once_a_second(
        bus: Bus, client: ToolbusClient, sid: str, system: dict[str, Any],
        tmp_path: Any) -> None:
    # `notifications/tools/list_changed` in a loop: every notice listed the tools again
    # and registered each one (two KV reads a tool), back to back.
    ns = f"mcpflood{uuid.uuid4().hex[:6]}"
    asked = tmp_path / "lists"
    cfg = {**hostile_stdio("--mode", "listchanged_loop"),
           "env": {"HOSTILE_LIST_LOG": str(asked)}}
    async with connected(bus, system, mcp_config(ns, **cfg)):
        before = asked.read_text().count("list") if asked.exists() else 0
        await asyncio.sleep(3)
        lists = asked.read_text().count("list") - before
        assert lists <= 4, f"listed {lists} times in 3 s"
        ok = await asyncio.wait_for(call_outcome(client, sid, f"{ns}:ok", {}), 10)
        assert ok.result == "ok"


@pytest.mark.parametrize("query", ["q%2Bs3cret%2Fkey%3D%3D", "q+s3cret/key=="])
def test_a_url_query_key_is_redacted_in_the_form_it_was_sent(query: str) -> None:
    # The server quotes the URL as it was asked: percent-encoded (a base64 key's +, /, =),
    # or with a literal `+` that parse_qsl would have read as a space.
    from actors.mcp_link import server_secrets
    from actors.redaction import redact
    from schemas.manifest import McpServerConfig
    cfg = McpServerConfig(id="q", hostname="http://h", port=1, path=f"/mcp?api_key={query}")
    shown = redact(f"refused: you asked /mcp?api_key={query}", server_secrets(cfg))
    assert "s3cret" not in shown, shown
