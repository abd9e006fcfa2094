"""The MCP client link: one MCP server's connection, kept alive, and its tools as the
executor runs them.

Each server has one `McpLink`, a supervisor task that owns its `mcp.Client` (the SDK never
reconnects by itself): connect, list every page of tools, hand them to `on_tools` (the
connector registers them as `<id>:<tool>`), then watch. A dropped connection, a dead stdio
process or a failed refresh ends the session; the link reconnects with backoff and a fresh
session, and re-lists the tools. Only calls for that server notice. A call in flight when
the connection drops is retried once on the new session if the tool is read-only or
idempotent (`McpTool`); otherwise it ends `interrupted`, since the server may or may not
have acted on it.

Tool list changes (`notifications/tools/list_changed`, or a `subscriptions/listen` event
on 2026-07-28 servers, or the periodic refresh) are handed to `on_tools` again.

No bus here: the connector (actors/mcp_connector.py) owns the catalog and the executor loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import anyio
import httpx2
import mcp
import mcp.types as mt
from mcp.client.sse import sse_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp.shared.exceptions import MCPError

from actors.tools import ProgressFn, Resource, ToolError
from schemas.errors import ConnectError, ToolbusError
from schemas.ids import split_tool_name
from schemas.manifest import McpServerConfig
from schemas.tools import Annotations, ToolSpec

log = logging.getLogger("toolbus.mcp")

_CONNECTION_CLOSED = -32000
_MAX_PAGES = 1000
_BACKOFF_MIN_S, _BACKOFF_MAX_S = 0.1, 5.0
_TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (
    httpx2.TransportError, anyio.ClosedResourceError, anyio.BrokenResourceError,
    anyio.EndOfStream, ConnectionError, EOFError,
)


class McpUnavailableError(ConnectError):
    """An MCP server could not be reached at start-up."""

    def __init__(self, server: str, tried: str, detail: str) -> None:
        self.server = server
        self.tried = tried
        ToolbusError.__init__(self, f"MCP server {server} is unreachable: tried {tried}: "
                                    f"{detail}. Start it, or fix mcps[{server}] in the manifest")


class _ConnectionLost(Exception):
    pass


def _is_connection_error(exc: BaseException) -> bool:
    if isinstance(exc, MCPError):
        return exc.code == _CONNECTION_CLOSED
    if isinstance(exc, BaseExceptionGroup):
        return any(_is_connection_error(e) for e in exc.exceptions)
    return isinstance(exc, _TRANSPORT_ERRORS)


def _describe_error(exc: BaseException) -> str:
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_describe_error(e) for e in exc.exceptions)
    if isinstance(exc, TimeoutError):
        return "no answer in time"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class McpLink:
    """One MCP server's connection, kept alive by a supervisor task."""

    def __init__(self, cfg: McpServerConfig, *, env: Mapping[str, str],
                 on_tools: Callable[[McpLink, list[mt.Tool]], Awaitable[None]]) -> None:
        self.cfg = cfg
        self._env = env
        self._on_tools = on_tools
        self._client: mcp.Client | None = None
        self._ready = asyncio.Event()
        self._lost = asyncio.Event()  # replaced for every session
        self._wake = asyncio.Event()  # refresh now (list_changed) or the session broke
        self._broken = False
        self._task: asyncio.Task[None] | None = None
        self._first: asyncio.Future[None] | None = None
        self._refused: int | None = None
        self.sessions = 0  # sessions opened so far (1 after boot; more after healing)
        self.last_error: str | None = None

    # -- lifecycle

    async def start(self) -> None:
        """Connect and list the tools, or raise `McpUnavailableError` within the
        connect timeout."""
        self._first = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._supervise(), name=f"mcp-{self.cfg.id}")
        try:
            await asyncio.wait_for(asyncio.shield(self._first),
                                   self.cfg.connect_timeout_ms / 1000 + 1)
        except (TimeoutError, McpUnavailableError) as exc:
            await self.stop()
            if isinstance(exc, McpUnavailableError):
                raise
            raise McpUnavailableError(self.cfg.id, self.cfg.describe(),
                                      f"no session within {self.cfg.connect_timeout_ms} ms"
                                      ) from exc

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def _transport(self, stack: contextlib.AsyncExitStack) -> Any:
        cfg = self.cfg
        if cfg.transport == "stdio":
            assert cfg.command is not None
            return mcp.StdioServerParameters(command=cfg.command, args=list(cfg.args),
                                             env={**self._env, **cfg.env}, cwd=cfg.cwd)
        assert cfg.url is not None
        if cfg.transport == "sse":
            return sse_client(cfg.url, headers=cfg.http_headers,
                              timeout=cfg.connect_timeout_ms / 1000)
        http = create_mcp_http_client(headers=cfg.http_headers)
        stack.push_async_callback(http.aclose)  # the SDK closes only clients it made itself
        http.event_hooks["response"].append(self._note_refusal)
        return streamable_http_client(cfg.url, http_client=http)

    async def _note_refusal(self, response: httpx2.Response) -> None:
        # The SDK reports a refused request as "Server returned an error response"; keep
        # the status, so an error can say "HTTP 401: check api_key".
        if response.status_code in (401, 403):
            self._refused = response.status_code

    async def _message(self, message: Any) -> None:
        if isinstance(message, mt.ToolListChangedNotification):
            self._wake.set()  # 2025-era servers notify on the session itself

    async def _supervise(self) -> None:
        backoff = _BACKOFF_MIN_S
        while True:
            try:
                await self._session()
                backoff = _BACKOFF_MIN_S  # the session ran and ended: retry at once
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # any failure ends one session only
                self.last_error = _describe_error(exc)
                if self._refused is not None:
                    self.last_error = (f"HTTP {self._refused}: the server refused the "
                                       f"credentials (check api_key / headers); "
                                       f"{self.last_error}")
                    self._refused = None
                if self._first is not None and not self._first.done():
                    self._first.set_exception(McpUnavailableError(
                        self.cfg.id, self.cfg.describe(), self.last_error))
                    self._first.exception()  # retrieved by start(); never "never retrieved"
                    return
                log.warning("MCP server %s: session ended (%s); reconnecting in %.1f s",
                            self.cfg.id, self.last_error, backoff)
            finally:
                self._client = None
                self._ready.clear()
                self._lost.set()
            await asyncio.sleep(backoff * (0.5 + random.random()))  # jitter
            backoff = min(backoff * 2, _BACKOFF_MAX_S)

    async def _session(self) -> None:
        cfg = self.cfg
        self._lost = asyncio.Event()
        self._broken = False
        async with contextlib.AsyncExitStack() as stack:
            client = mcp.Client(self._transport(stack), message_handler=self._message,
                                cache=None, read_timeout_seconds=cfg.timeout_ms / 1000)
            async with asyncio.timeout(cfg.connect_timeout_ms / 1000):
                await stack.enter_async_context(client)
                tools = await self._list_all(client)
            await self._on_tools(self, tools)
            self._client = client
            self.sessions += 1
            self.last_error = None
            self._ready.set()
            if self._first is not None and not self._first.done():
                self._first.set_result(None)
            listener = None
            if client.protocol_version >= "2026-07-28":
                listener = asyncio.create_task(self._listen(client))
            try:
                while not self._broken:
                    self._wake.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), cfg.refresh_s)
                    if self._broken:
                        break
                    await self._on_tools(self, await self._list_all(client))
            finally:
                if listener is not None:
                    listener.cancel()
                    with contextlib.suppress(BaseException):
                        await listener
                self._client = None
                self._ready.clear()
                self._lost.set()

    async def _listen(self, client: mcp.Client) -> None:
        try:
            async with client.listen(tools_list_changed=True) as sub:
                async for _ in sub:
                    self._wake.set()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the session is ending, or listen is unsupported
            log.debug("MCP server %s: listen ended: %s", self.cfg.id, exc)

    @staticmethod
    async def _list_all(client: mcp.Client) -> list[mt.Tool]:
        tools: list[mt.Tool] = []
        cursor: str | None = None
        for _ in range(_MAX_PAGES):
            page = await client.list_tools(cursor=cursor)
            tools.extend(page.tools)
            cursor = page.next_cursor
            if not cursor:
                return tools
        raise ToolbusError(f"tools/list returned more than {_MAX_PAGES} pages")

    def mark_broken(self, lost: asyncio.Event) -> None:
        """The session whose `lost` event this is failed a call: end it now, and let no
        new call take it while the supervisor tears it down."""
        if lost is self._lost and not lost.is_set():
            self._broken = True
            self._ready.clear()
            self._client = None
            self._wake.set()

    # -- calls

    async def _ready_client(self, wait_s: float) -> tuple[mcp.Client, asyncio.Event]:
        if not self._ready.is_set():
            try:
                await asyncio.wait_for(self._ready.wait(), wait_s)
            except TimeoutError:
                raise ToolError(
                    f"MCP server {self.cfg.id} is unreachable ({self.cfg.describe()}"
                    f"{': ' + self.last_error if self.last_error else ''}); toolbus keeps "
                    "reconnecting", error_type="server_unavailable", retryable=True) from None
        assert self._client is not None
        return self._client, self._lost

    async def call(self, name: str, arguments: dict[str, Any], *,
                   progress: ProgressFn | None) -> mt.CallToolResult:
        """One `tools/call` on the current session; `_ConnectionLost` if it dies first."""
        client, lost = await self._ready_client(self.cfg.connect_timeout_ms / 1000)

        report = progress

        async def on_progress(progress: float, total: float | None, message: str | None) -> None:
            if report is not None:
                report()

        call = asyncio.ensure_future(client.call_tool(name, arguments,
                                                      progress_callback=on_progress))
        gone = asyncio.ensure_future(lost.wait())
        try:
            await asyncio.wait({call, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for f in (call, gone):
                if not f.done():
                    f.cancel()
        if not call.done() or call.cancelled():
            raise _ConnectionLost()
        exc = call.exception()
        if exc is None:
            return call.result()
        if _is_connection_error(exc):
            self.mark_broken(lost)
            raise _ConnectionLost() from exc
        if isinstance(exc, MCPError):
            raise ToolError(f"MCP server {self.cfg.id} refused {name}: {exc}",
                            error_type="mcp_error") from exc
        raise exc


# --- tools -------------------------------------------------------------------------------


def mcp_spec(cfg: McpServerConfig, tool: mt.Tool) -> ToolSpec | None:
    """The catalog spec of an MCP tool: name, description and schemas verbatim."""
    name = f"{cfg.id}:{tool.name}"
    try:
        split_tool_name(name)
    except ToolbusError:
        log.warning("MCP server %s: tool %r has a name toolbus cannot route; skipped",
                    cfg.id, tool.name)
        return None
    a = tool.annotations
    read_only = bool(a and a.read_only_hint)
    destructive = (not read_only) if a is None or a.destructive_hint is None else \
        a.destructive_hint and not read_only
    annotations = Annotations(
        readOnlyHint=read_only,
        destructiveHint=destructive,
        idempotentHint=bool(a and a.idempotent_hint),
        openWorldHint=True if a is None or a.open_world_hint is None else a.open_world_hint,
    )
    return ToolSpec(
        name=name,
        title=tool.title or (a.title if a else None),
        description=tool.description or "",
        parameters=tool.input_schema,
        output=tool.output_schema,
        annotations=annotations,
        # The annotations add to the policy's risk score themselves; the level only says
        # whether the tool reads or writes.
        risk_level="low" if read_only else "medium",
        timeout_ms=cfg.timeout_ms,
        source=f"mcp:{cfg.id}",
        pools=[cfg.pool],
        trusted=cfg.trusted,
        annotated=a is not None,
    )


class McpTool:
    """An MCP server's tool, as the executor runs it."""

    def __init__(self, spec: ToolSpec, remote_name: str, link: McpLink) -> None:
        self.spec = spec
        self.remote_name = remote_name
        self.link = link
        self.injected: dict[str, Resource] = {}

    def check_arguments(self, arguments: dict[str, Any]) -> None:
        """The server checks its own arguments; the schema was checked on admission."""

    async def run(self, arguments: dict[str, Any], resources: dict[Resource, Any] | None = None,
                  *, progress: ProgressFn | None = None) -> Any:
        for attempt in (1, 2):
            try:
                result = await self.link.call(self.remote_name, arguments, progress=progress)
            except _ConnectionLost:
                if not self.spec.rerunnable:
                    raise ToolError(
                        f"the connection to MCP server {self.link.cfg.id} dropped while "
                        f"{self.spec.name} ran; the tool is neither read-only nor idempotent, "
                        "so it is not run again (the server may or may not have acted)",
                        error_type="interrupted") from None
                if attempt == 2:
                    raise ToolError(f"the connection to MCP server {self.link.cfg.id} dropped "
                                    "twice during this call", error_type="server_unavailable",
                                    retryable=True) from None
                log.info("%s: connection dropped mid-call; retrying on a new session",
                         self.spec.name)
                continue
            return tool_result(self.spec.name, result)
        raise AssertionError("unreachable")


def content_text(blocks: list[mt.ContentBlock]) -> str:
    """Content blocks as clean text: text as is, other blocks as short placeholders."""
    parts: list[str] = []
    for b in blocks:
        if isinstance(b, mt.TextContent):
            parts.append(b.text)
        elif isinstance(b, mt.ImageContent | mt.AudioContent):
            kind = "image" if isinstance(b, mt.ImageContent) else "audio"
            parts.append(f"[{kind}: {b.mime_type}, {len(b.data) * 3 // 4} bytes]")
        elif isinstance(b, mt.ResourceLink):
            parts.append(f"[resource: {b.uri}]")
        elif isinstance(b, mt.EmbeddedResource):
            res = b.resource
            text = getattr(res, "text", None)
            parts.append(text if isinstance(text, str) else f"[resource: {res.uri}]")
    return "\n".join(parts)


def tool_result(name: str, result: mt.CallToolResult) -> Any:
    if result.is_error:
        raise ToolError(content_text(result.content) or f"{name} failed",
                        error_type="tool_error")
    if result.structured_content is not None:
        return result.structured_content
    return content_text(result.content)

