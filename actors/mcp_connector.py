"""MCP connector actor: the tools of manifest-declared MCP servers, served like local ones.

Consumes: `call.dispatched` for the namespaces of its servers (one namespace per server,
its manifest `id`), through the executor's loop (actors/executor.py), so a call gets the
same guarantees: the durable consumer `exec_<pool>_<id>` shared by every connector process
of that server, exactly one terminal event (`<sid>:<call_id>:terminal`), a timeout, and
in-progress acks while the tool runs, also on each MCP progress notification.
Emits: `call.started`, then `call.succeeded` / `call.failed`.

Each server has one `McpLink` (actors/mcp_link.py), which keeps its connection alive and
lists its tools; this actor registers them in the catalog as `<id>:<tool>`, removes those
the server no longer lists, and hands them to the executor loop of the server's pool.
Retry rule (the link's): a call the server refused without running it (a stale session)
or that was in flight when the connection dropped is sent again once if the tool is
read-only or idempotent; otherwise it ends `server_unavailable` (retryable) or
`interrupted` respectively. Start-up connects to every server at once, each bounded by its
`connect_timeout_s`; one that fails stops the others, and cancelling it stops them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping

import mcp.types as mt

from actors.executor import Executor
from actors.mcp_link import McpLink, McpTool, mcp_spec
from bus.catalog import Catalog
from bus.connection import Bus
from schemas.errors import ToolbusError
from schemas.manifest import McpServerConfig

log = logging.getLogger("toolbus.mcp")


class McpConnector:
    """Links to some MCP servers, and one executor loop per pool they are in."""

    def __init__(self, bus: Bus, servers: list[McpServerConfig], *, env: Mapping[str, str],
                 instance: str | None = None, ack_wait_s: float = 30.0,
                 max_in_flight: int = 64) -> None:
        if not servers:
            raise ToolbusError("no MCP servers to connect to: declare them under mcps:")
        self._catalog = Catalog(bus)
        self.links = {s.id: McpLink(s, env=env, on_tools=self._tools_listed) for s in servers}
        self._registered: dict[str, set[str]] = {s.id: set() for s in servers}
        self._booting = True
        self._started: list[Executor] = []
        pools = sorted({s.pool for s in servers})
        self.executors: dict[str, Executor] = {}
        for pool in pools:
            name = None
            if instance:
                name = instance if len(pools) == 1 else f"{instance}-{pool}"
            self.executors[pool] = Executor(
                bus, [], namespaces=[s.id for s in servers if s.pool == pool], register=False,
                instance=name, pool=pool, ack_wait_s=ack_wait_s, max_in_flight=max_in_flight)

    async def _tools_listed(self, link: McpLink, tools: list[mt.Tool]) -> None:
        cfg = link.cfg
        runnable: list[McpTool] = []
        for t in tools:
            spec = mcp_spec(cfg, t)
            if spec is not None:
                runnable.append(McpTool(spec, t.name, link))
        try:
            await self._catalog.register([t.spec for t in runnable])
        except ToolbusError as exc:
            if self._booting:
                raise
            log.error("MCP server %s: cannot update the catalog: %s", cfg.id, exc)
            return
        names = {t.spec.name for t in runnable}
        gone = sorted(self._registered[cfg.id] - names)
        if gone:
            await self._catalog.unregister(gone, f"mcp:{cfg.id}")
            log.info("MCP server %s no longer lists %s", cfg.id, ", ".join(gone))
        self._registered[cfg.id] = names
        self.executors[cfg.pool].set_tools(cfg.id, runnable)

    async def start(self) -> None:
        try:
            try:
                async with asyncio.TaskGroup() as tg:
                    for link in self.links.values():
                        tg.create_task(link.start(), name=f"mcp-start-{link.cfg.id}")
            except BaseExceptionGroup as group:
                # The first server that failed; the others were stopped meanwhile.
                raise group.exceptions[0] from None
            self._booting = False
            for executor in self.executors.values():
                await executor.start()
                self._started.append(executor)
        except BaseException:
            await self.stop()
            raise

    async def stop(self, grace: float = 10.0) -> None:
        for executor in self._started:
            with contextlib.suppress(Exception):
                await executor.stop(grace)
        self._started.clear()
        for link in self.links.values():
            await link.stop()

    @property
    def tools(self) -> list[str]:
        return sorted(n for names in self._registered.values() for n in names)
