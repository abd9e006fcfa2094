"""The MCP client link: one MCP server's connection, kept alive, and its tools as the
executor runs them.

Each server has one `McpLink`, a supervisor task that owns its `mcp.Client` (the SDK never
reconnects by itself): connect, list every page of tools, hand them to `on_tools` (the
connector registers them as `<id>:<tool>`), then watch. Start-up is bounded by
`connect_timeout_s` and can be cancelled at any moment (Ctrl-C): a stdio server that never
answers `initialize` is stopped, never left behind. A stdio server that exits at start-up
is reported with its exit code and the last lines of its stderr.

Healing. A session ends when its connection drops, its stdio process exits, a refresh
fails, or it goes stale: an HTTP 400/404 answering a known session id (a stateful server
that restarted and forgot its `Mcp-Session-Id`). The link then reconnects at once with a
fresh session (with backoff while that fails) and re-lists the tools. Only calls for that
server notice, and how a call ends depends on what the server may have done with it:

- refused without being run (400/404 on the stale session, or the connection refused):
  a read-only or idempotent tool is sent again once, on the new session; any other ends
  `server_unavailable`, retryable (it did not run, so the caller may send it again);
- in flight when the connection dropped: a read-only or idempotent tool is sent again
  once; any other ends `interrupted`, since the server may or may not have acted on it.

Deadlines. A call fails `timeout` after `timeout_ms` without a progress notification;
each notification pushes the deadline out again, never past `max_timeout_ms` from the
call's start (the executor's own limit, the catalog's `timeout_ms` for these tools).

Results. Structured content as is; text content as text; a result with an image, audio or
a binary resource is MCP's own result shape, `{"content": [...]}` (binary data base64
with its `mimeType`), which the executor moves to the object store when it is large.

Tool list changes (`notifications/tools/list_changed`, or a `subscriptions/listen` event
on 2026-07-28 servers, or the periodic refresh) are handed to `on_tools` again.

No bus here: the connector (actors/mcp_connector.py) owns the catalog and the executor loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import re
import signal
import sys
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, quote, urlsplit

import anyio
import httpx2
import mcp
import mcp.types as mt
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from mcp.client.sse import sse_client
from mcp.client.stdio import get_default_environment
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp.shared.message import SessionMessage

from actors.redaction import redact, redact_cut
from actors.tools import ProgressFn, Resource, ToolError
from schemas.errors import ConnectError, ToolbusError
from schemas.ids import split_tool_name
from schemas.manifest import McpServerConfig
from schemas.tools import Annotations, ToolSpec

log = logging.getLogger("toolbus.mcp")


class _ReaderGoneMidStream(logging.Filter):
    """The mcp SDK logs a traceback, "Error parsing SSE message", when the reader of an
    SSE response went away mid-message: toolbus closing the session (a stop, a failed
    boot check, a reconnect, a call given up), not a parse failure (the SDK's own comment
    says as much). Kept for `-v`, as a debug line without the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if record.msg != "Error parsing SSE message" or \
                not isinstance(exc, anyio.BrokenResourceError | anyio.ClosedResourceError):
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        record.msg, record.args = f"{record.getMessage()}: the reader was gone", None
        record.exc_info, record.exc_text = None, None
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


logging.getLogger("mcp.client.streamable_http").addFilter(_ReaderGoneMidStream())

_CONNECTION_CLOSED = -32000
# The SDK's own errors for a request whose connection closed, or whose SSE stream ended
# or failed. Servers send -32000 too (the first of JSON-RPC's implementation-defined
# server errors, a common "something went wrong"): that is an answer, not a drop.
_SDK_DROP_MESSAGES = ("Connection closed", "SSE stream ")
_REQUEST_TIMEOUT = -32001
_MAX_PAGES = 1000
# The shortest time between two listings of a server's tools (list_changed in a loop).
_MIN_REFRESH_S = 1.0
_BACKOFF_MIN_S, _BACKOFF_MAX_S = 0.1, 5.0
_STOP_WAIT_S = 5.0  # for a session's teardown (a stdio server's takes at most ~2 s)
# A stdio server gets this long to exit after its stdin closes (the MCP shutdown
# sequence), then SIGTERM, then after as long again SIGKILL, to its whole process group.
_STDIO_EXIT_GRACE_S = 1.0
_STDIO_KILL_AFTER_S = 1.0
_STDERR_TAIL_LINES, _STDERR_SHOWN_LINES, _STDERR_LINE_CHARS = 20, 5, 240
# The largest message a server may send (a stdio line, an HTTP JSON body): past it the
# server is refused rather than buffered until memory runs out. A stderr line is cut.
MAX_MESSAGE_BYTES = 64 << 20
_STDERR_LINE_BYTES = 64 << 10
_TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (
    httpx2.TransportError, anyio.ClosedResourceError, anyio.BrokenResourceError,
    anyio.EndOfStream, ConnectionError, EOFError,
)


class McpUnavailableError(ConnectError):
    """An MCP server could not be reached at start-up."""

    def __init__(self, server: str, tried: str, detail: str) -> None:
        self.server = server
        self.tried = tried
        self.detail = detail
        ToolbusError.__init__(self, f"MCP server {server} is unreachable: tried {tried}: "
                                    f"{detail}. Start it, or fix mcps[{server}] in the manifest")


class _TooLarge(Exception):
    """A server's message, or stderr line, went past its limit."""


class _ConnectionLost(Exception):
    """The session ended while the call was in flight: the server may have run it."""


class _NotRun(Exception):
    """The server refused the call without running it."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


@dataclass
class _Attempt:
    """One `tools/call` request. The HTTP transports send each message in its sender's
    context (`_attempt`), so what happened to this request's POST lands here."""

    not_run: str | None = None


_attempt: ContextVar[_Attempt | None] = ContextVar("toolbus_mcp_attempt", default=None)
_Inbound = MemoryObjectSendStream[SessionMessage | Exception]
_Streams = tuple[MemoryObjectReceiveStream[SessionMessage | Exception],
                 MemoryObjectSendStream[SessionMessage]]


class _Session:
    """One connection to the server, from connect to teardown."""

    def __init__(self) -> None:
        self.client: mcp.Client | None = None
        self.established = False  # the handshake is done
        self.broken = False  # ended, or ending: no new call takes it
        self.lost = asyncio.Event()  # set once it is torn down
        self.stale: str | None = None  # why the server no longer knows it
        self.process: _StdioServer | None = None


def _is_connection_error(exc: BaseException) -> bool:
    if isinstance(exc, MCPError):
        return exc.code == _CONNECTION_CLOSED and exc.message.startswith(_SDK_DROP_MESSAGES)
    if isinstance(exc, BaseExceptionGroup):
        return any(_is_connection_error(e) for e in exc.exceptions)
    return isinstance(exc, _TRANSPORT_ERRORS)


def _is_timeout(exc: BaseException) -> bool:
    if isinstance(exc, BaseExceptionGroup):
        return any(_is_timeout(e) for e in exc.exceptions)
    return isinstance(exc, TimeoutError)


def _describe_error(exc: BaseException) -> str:
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(dict.fromkeys(_describe_error(e) for e in exc.exceptions))
    if isinstance(exc, TimeoutError):
        return "no answer in time"
    if isinstance(exc, httpx2.ConnectError):
        return f"cannot connect: {exc}" if str(exc) else "cannot connect"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


# --- HTTP ---------------------------------------------------------------------------------


class _WatchedTransport(httpx2.AsyncBaseTransport):
    """The HTTP transport of one session, which notes what the SDK does not report: a
    message that never reached the server (the statuses are noted by a response hook)."""

    def __init__(self, link: McpLink, session: _Session) -> None:
        self._inner = httpx2.AsyncHTTPTransport()
        self._link = link
        self._session = session

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        try:
            response = await self._inner.handle_async_request(request)
        except httpx2.ConnectError:
            if request.method == "POST":
                self._link._not_run(self._session, "the server could not be reached")
            raise
        # An SSE stream is bounded per event by the SDK; any other body is read whole.
        if not response.headers.get("content-type", "").startswith("text/event-stream"):
            response.stream = _BoundedStream(response.stream, self._link.cfg.id)
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


class _BoundedStream(httpx2.AsyncByteStream):
    """A response body that fails past `MAX_MESSAGE_BYTES`: the SDK reads a JSON answer
    whole, so a server streaming one without end would otherwise take all the memory.
    The SDK turns the `StreamError` into an error answer for that request alone."""

    def __init__(self, inner: Any, server: str) -> None:
        self._inner = inner
        self._server = server

    async def __aiter__(self) -> AsyncIterator[bytes]:
        size = 0
        async for chunk in self._inner:
            size += len(chunk)
            if size > MAX_MESSAGE_BYTES:
                raise httpx2.StreamError(
                    f"MCP server {self._server} sent an answer over "
                    f"{MAX_MESSAGE_BYTES >> 20} MiB; it was not read further")
            yield chunk

    async def aclose(self) -> None:
        await self._inner.aclose()


def _http_timeout(cfg: McpServerConfig) -> httpx2.Timeout:
    # A response stream may stay open for as long as a call runs.
    return httpx2.Timeout(min(cfg.connect_timeout_s, 30.0), read=max(cfg.max_timeout_s, 300.0))


# --- stdio --------------------------------------------------------------------------------


class _StdioServer:
    """A stdio MCP server: a child process in its own process group, whose stdin and
    stdout carry the session, and whose stderr is passed on with its last lines kept.

    Not the SDK's `stdio_client`: it hides the process (no exit code to report), sends
    stderr straight to a file, and its shielded shutdown can hang under asyncio
    cancellation, leaving a server that never answered `initialize` behind. Here a
    shutdown that is itself cancelled kills the process group at once, without awaiting.
    """

    def __init__(self, cfg: McpServerConfig, env: Mapping[str, str], *,
                 on_exit: Callable[[], None]) -> None:
        self.cfg = cfg
        self._env = env
        self._on_exit = on_exit
        self.returncode: int | None = None
        self.exited = False  # by itself, not stopped by us
        self.stderr_tail: deque[str] = deque(maxlen=_STDERR_TAIL_LINES)
        self._secrets = server_secrets(cfg)
        self._stopping = False
        self._eof = False  # its stdout ended before we stopped it

    def exit_text(self) -> str:
        code = self.returncode
        if code is not None and code < 0:
            with contextlib.suppress(ValueError):
                return f"was killed by {signal.Signals(-code).name}"
        return f"exited with code {code}"

    def tail_text(self) -> str:
        lines = [line for line in self.stderr_tail if line.strip()][-_STDERR_SHOWN_LINES:]
        return " | ".join(lines)

    @contextlib.asynccontextmanager
    async def streams(self) -> AsyncIterator[_Streams]:
        cfg = self.cfg
        assert cfg.command is not None
        proc = await asyncio.create_subprocess_exec(
            cfg.command, *cfg.args, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env={**get_default_environment(), **self._env}, cwd=cfg.cwd,
            start_new_session=True)  # its own group: Ctrl-C is ours to pass on, or not
        try:  # no await before this: a cancellation must not leak the process
            read_send, read_recv = anyio.create_memory_object_stream[SessionMessage | Exception](0)
            write_send, write_recv = anyio.create_memory_object_stream[SessionMessage](0)
            stderr = asyncio.create_task(self._read_stderr(proc), name=f"mcp-{cfg.id}-stderr")
            tasks = [asyncio.create_task(self._read_stdout(proc, read_send),
                                         name=f"mcp-{cfg.id}-stdout"),
                     asyncio.create_task(self._write_stdin(proc, write_recv, read_send),
                                         name=f"mcp-{cfg.id}-stdin"),
                     asyncio.create_task(self._watch_exit(proc, read_send),
                                         name=f"mcp-{cfg.id}-exit")]
        except BaseException:
            _signal_group(proc, signal.SIGKILL)
            raise
        try:
            yield read_recv, write_send
        finally:
            self._stopping = True
            died = self._eof  # the session failed because the process ended
            try:
                await self._stop(proc)
                self.exited = self.exited or died
                # Its last stderr lines: the pipe ends with the process (bounded: a
                # grandchild may still hold it).
                await asyncio.wait({stderr}, timeout=0.5)
            except BaseException:
                _signal_group(proc, signal.SIGKILL)  # cancelled while stopping it
                raise
            finally:
                for t in [*tasks, stderr]:
                    t.cancel()
                for s in (read_send, read_recv, write_send, write_recv):
                    s.close()
                # The subprocess transport otherwise stays open (and warns when collected)
                # while a grandchild holds a pipe end; nothing public closes it.
                transport = getattr(proc, "_transport", None)
                if transport is not None:
                    transport.close()

    async def _stop(self, proc: asyncio.subprocess.Process) -> None:
        if proc.returncode is None:
            if proc.stdin is not None:  # the MCP shutdown sequence: stdin first
                with contextlib.suppress(OSError):
                    proc.stdin.close()
            if not await _exited(proc, _STDIO_EXIT_GRACE_S):
                _signal_group(proc, signal.SIGTERM)
                if not await _exited(proc, _STDIO_KILL_AFTER_S):
                    _signal_group(proc, signal.SIGKILL)
                    await _exited(proc, 2.0)
        if self.returncode is None:
            self.returncode = proc.returncode

    async def _read_stdout(self, proc: asyncio.subprocess.Process, out: _Inbound) -> None:
        assert proc.stdout is not None
        try:
            async for line in _lines(proc.stdout, MAX_MESSAGE_BYTES):
                if not line.strip():
                    continue
                try:
                    item: SessionMessage | Exception = SessionMessage(
                        mt.jsonrpc_message_adapter.validate_json(line, by_name=False))
                except ValueError as exc:
                    log.warning("MCP server %s wrote a line that is not JSON-RPC: %.200r",
                                self.cfg.id, line)
                    item = exc
                await out.send(item)
            self._eof = True
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            return  # the session is gone
        except _TooLarge:
            # The stream cannot be resynchronised: end the session (the process is
            # stopped with it, and started again).
            log.warning("MCP server %s wrote a message over %d MiB on stdout; ending its "
                        "session", self.cfg.id, MAX_MESSAGE_BYTES >> 20)
            out.close()
            self._on_exit()
            return
        finally:
            out.close()  # the session sees the end of the connection
        # stdout ended: the process is exiting (or closed it, which ends the session too).
        await _exited(proc, 2.0)
        if not self._stopping:
            self.returncode = proc.returncode
            self.exited = proc.returncode is not None
            self._on_exit()

    async def _watch_exit(self, proc: asyncio.subprocess.Process, out: _Inbound) -> None:
        """End the session when the process exits, even if its stdout stays open: a child
        it started (a daemon, in a session of its own) may hold that pipe for as long as it
        lives, and every call would otherwise wait for an answer until its timeout."""
        while proc.returncode is None:  # noqa: ASYNC110  # see _exited
            await asyncio.sleep(0.1)
        await asyncio.sleep(_STDIO_EXIT_GRACE_S)  # its last lines, if stdout does end
        if self._stopping or self._eof:
            return
        log.warning("MCP server %s: its process exited but its stdout is still open (a "
                    "child of it holds it); ending its session", self.cfg.id)
        self.returncode = proc.returncode
        self.exited = True
        out.close()
        self._on_exit()

    async def _write_stdin(self, proc: asyncio.subprocess.Process,
                           inbox: MemoryObjectReceiveStream[SessionMessage],
                           out: _Inbound) -> None:
        assert proc.stdin is not None
        try:
            async for message in inbox:
                data = message.message.model_dump_json(by_alias=True, exclude_unset=True)
                proc.stdin.write(data.encode() + b"\n")
                await proc.stdin.drain()
        except (OSError, anyio.ClosedResourceError, anyio.BrokenResourceError):
            out.close()  # it cannot read: end the session rather than let calls hang

    async def _read_stderr(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stderr is not None
        async for raw in _lines(proc.stderr, _STDERR_LINE_BYTES, cut=True):
            # A server that complains about its key quoting it: not into our logs.
            text = raw.decode(errors="replace").rstrip("\r")
            # Cut (at the line limit here, or shorter for the tail): never the start of a
            # secret the cut fell in.
            line = redact_cut(text, self._secrets) if len(raw) >= _STDERR_LINE_BYTES \
                else str(redact(text, self._secrets))
            self.stderr_tail.append(line if len(line) <= _STDERR_LINE_CHARS
                                    else redact_cut(text[:_STDERR_LINE_CHARS], self._secrets))
            with contextlib.suppress(OSError, ValueError):  # our own stderr is gone
                sys.stderr.write(f"[mcp {self.cfg.id}] {line}\n")
                sys.stderr.flush()


async def _lines(stream: asyncio.StreamReader, limit: int, *,
                 cut: bool = False) -> AsyncIterator[bytes]:
    """Lines of up to `limit` bytes (`readline` stops at the reader's limit, 64 KiB). A
    longer one raises `_TooLarge`, or with `cut` is cut there (the rest of it skipped):
    a line that never ends is never held whole."""
    pending: list[bytes] = []
    size = 0
    skipping = False
    while chunk := await stream.read(1 << 16):
        parts = chunk.split(b"\n")
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            if not skipping:
                room = limit - size
                if len(part) > room:
                    if not cut:
                        raise _TooLarge(f"a line over {limit} bytes")
                    pending.append(part[:room])
                    size = limit
                    skipping = True
                elif part:
                    pending.append(part)
                    size += len(part)
            if not last:
                yield b"".join(pending)
                pending, size, skipping = [], 0, False
    if pending:
        yield b"".join(pending)


async def _exited(proc: asyncio.subprocess.Process, within_s: float) -> bool:
    # Polled: `proc.wait()` also waits for the pipes to close, which a grandchild holding
    # them delays for as long as it lives.
    loop = asyncio.get_running_loop()
    end = loop.time() + within_s
    while proc.returncode is None and loop.time() < end:  # noqa: ASYNC110  # see above
        await asyncio.sleep(0.02)
    return proc.returncode is not None


def _signal_group(proc: asyncio.subprocess.Process, sig: int) -> None:
    """Signal the server and everything it started (`npx` → `node`, `uv run` → python)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


# --- the link -----------------------------------------------------------------------------


class McpLink:
    """One MCP server's connection, kept alive by a supervisor task."""

    def __init__(self, cfg: McpServerConfig, *, env: Mapping[str, str],
                 on_tools: Callable[[McpLink, list[mt.Tool]], Awaitable[None]]) -> None:
        self.cfg = cfg
        self._env = env
        self._on_tools = on_tools
        self._live: _Session | None = None  # the session calls take
        self._current: _Session | None = None  # the session being opened or run
        self._ready = asyncio.Event()  # set while `_live` is
        self._wake = asyncio.Event()  # refresh now (list_changed) or the session broke
        self._task: asyncio.Task[None] | None = None
        self._first: asyncio.Future[None] | None = None
        self._refused: int | None = None
        self._secrets = server_secrets(cfg)
        self.sessions = 0  # sessions opened so far (1 after boot; more after healing)
        self.last_error: str | None = None

    # -- lifecycle

    async def start(self) -> None:
        """Connect and list the tools, or raise `McpUnavailableError` within
        `connect_timeout_s` (plus the teardown of what was started). Cancelling it stops
        everything it started."""
        self._first = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._supervise(), name=f"mcp-{self.cfg.id}")
        try:
            # The session bounds itself; this is a safety net for a teardown that hangs.
            await asyncio.wait_for(asyncio.shield(self._first),
                                   self.cfg.connect_timeout_s + 2 * _STOP_WAIT_S)
        except TimeoutError as exc:
            await self.stop()
            raise McpUnavailableError(self.cfg.id, self.cfg.describe(),
                                      f"no session within {self.cfg.connect_timeout_s:g} s "
                                      "(connect_timeout_s)") from exc
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        """Stop the supervisor and its session; bounded, even for a server that does not
        answer."""
        task, self._task = self._task, None
        if self._first is not None and not self._first.done():
            self._first.cancel()
        if task is None:
            return
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=_STOP_WAIT_S)
        if not done:  # a teardown stuck on the network: interrupt that too
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=_STOP_WAIT_S)
        if not done:
            log.warning("MCP server %s: its connection did not close in time", self.cfg.id)
        elif not task.cancelled() and task.exception() is not None:
            log.warning("MCP server %s: the supervisor failed: %s", self.cfg.id,
                        _describe_error(task.exception() or Exception()))

    def _transport(self, s: _Session, stack: contextlib.AsyncExitStack) -> Any:
        cfg = self.cfg
        if cfg.transport == "stdio":
            s.process = _StdioServer(cfg, {**self._env, **cfg.env},
                                     on_exit=lambda: self.mark_broken(s))
            return s.process.streams()
        assert cfg.url is not None

        async def on_response(response: httpx2.Response) -> None:
            self._http_status(s, response.request, response.status_code)

        def http_client(headers: dict[str, str] | None = None,
                        timeout: httpx2.Timeout | None = None,
                        auth: httpx2.Auth | None = None) -> httpx2.AsyncClient:
            return httpx2.AsyncClient(headers=headers, timeout=timeout or _http_timeout(cfg),
                                      auth=auth, transport=_WatchedTransport(self, s),
                                      event_hooks={"response": [on_response]})

        if cfg.transport == "sse":
            return sse_client(cfg.url, headers=cfg.http_headers,
                              timeout=min(cfg.connect_timeout_s, 30.0),
                              sse_read_timeout=max(cfg.max_timeout_s, 300.0),
                              httpx_client_factory=http_client)
        http = http_client(headers=cfg.http_headers)
        stack.push_async_callback(http.aclose)  # the SDK closes only clients it made itself
        return streamable_http_client(cfg.url, http_client=http)

    def _http_status(self, s: _Session, request: httpx2.Request, status: int) -> None:
        if status in (401, 403):
            # The SDK reports a refused request as "Server returned an error response";
            # keep the status, so an error can say "HTTP 401: check api_key".
            self._refused = status
            return
        if status not in (400, 404) or request.method == "DELETE":
            return
        # 404 is how the spec says "no such session"; servers built like the TypeScript
        # SDK's examples say 400 "No valid session ID". SSE sessions live on the server.
        if "mcp-session-id" in request.headers or (self.cfg.transport == "sse"
                                                   and request.method == "POST"):
            reason = (f"HTTP {status} for its session: the server no longer knows it "
                      "(it restarted, or expired the session)")
            s.stale = reason
            self._not_run(s, reason)

    def _not_run(self, s: _Session, reason: str) -> None:
        attempt = _attempt.get()
        if attempt is not None and attempt.not_run is None:
            attempt.not_run = reason
        self.mark_broken(s)

    async def _message(self, message: Any) -> None:
        if isinstance(message, mt.ToolListChangedNotification):
            self._wake.set()  # 2025-era servers notify on the session itself

    def _failure(self, s: _Session | None, exc: BaseException) -> str:
        """Why a session failed or ended, in one line, for people."""
        proc = s.process if s is not None else None
        if proc is not None and proc.exited:
            text = f"the server process {proc.exit_text()}"
            if s is not None and not s.established:
                text += " before it answered initialize"
        elif s is not None and not s.established and _is_timeout(exc):
            text = (f"no answer to initialize within {self.cfg.connect_timeout_s:g} s "
                    "(connect_timeout_s)")
        else:
            text = _describe_error(exc)
        if proc is not None and proc.tail_text():
            text += f"; its stderr ended with: {proc.tail_text()}"
        if self._refused is not None:
            text = (f"HTTP {self._refused}: the server refused the credentials (check "
                    f"api_key / headers); {text}")
            self._refused = None
        # It goes to logs, the start-up error and calls' errors: a server's error quoting
        # the key it was sent (`bad credentials Bearer sk-...`) must not take it there.
        return str(redact(text, self._secrets))

    async def _supervise(self) -> None:
        backoff = _BACKOFF_MIN_S
        while True:
            try:
                await self._session()
                backoff = _BACKOFF_MIN_S  # the session ran and ended: retry at once
                s = self._current
                if s is not None and s.process is not None and s.process.exited:
                    self.last_error = self._failure(s, EOFError())
                    log.warning("MCP server %s: %s; restarting it", self.cfg.id,
                                self.last_error)
                elif s is not None and s.stale is not None:
                    log.info("MCP server %s: %s; reconnecting", self.cfg.id, s.stale)
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # any failure ends one session only
                s = self._current
                if s is not None and s.stale is not None and s.client is not None:
                    # Ended on purpose; what its teardown raised is noise.
                    self.last_error = s.stale
                    log.info("MCP server %s: %s; reconnecting", self.cfg.id, s.stale)
                    backoff = _BACKOFF_MIN_S
                else:
                    self.last_error = self._failure(s, exc)
                    if self._first is not None and not self._first.done():
                        self._first.set_exception(McpUnavailableError(
                            self.cfg.id, self.cfg.describe(), self.last_error))
                        self._first.exception()  # retrieved by start(); never "never retrieved"
                        return
                    log.warning("MCP server %s: session ended (%s); reconnecting in %.1f s",
                                self.cfg.id, self.last_error, backoff)
            await asyncio.sleep(backoff * (0.5 + random.random()))  # jitter
            backoff = min(backoff * 2, _BACKOFF_MAX_S)

    async def _session(self) -> None:
        cfg = self.cfg
        s = self._current = _Session()
        try:
            async with contextlib.AsyncExitStack() as stack:
                client = mcp.Client(self._transport(s, stack), message_handler=self._message,
                                    cache=None, read_timeout_seconds=cfg.timeout_s)
                async with asyncio.timeout(cfg.connect_timeout_s):
                    await stack.enter_async_context(client)
                    s.established = True
                    tools = await self._list_all(client)
                await self._on_tools(self, tools)
                if s.broken:
                    return
                s.client = client
                self._live = s
                self.sessions += 1
                self.last_error = None
                self._ready.set()
                if self._first is not None and not self._first.done():
                    self._first.set_result(None)
                listener = None
                if client.protocol_version >= "2026-07-28":
                    listener = asyncio.create_task(self._listen(client))
                try:
                    loop = asyncio.get_running_loop()
                    listed = loop.time()
                    while not s.broken:
                        self._wake.clear()
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(self._wake.wait(), cfg.refresh_s)
                        # A server announcing changes without pause is listed at most
                        # once per interval: the notices meanwhile are one refresh.
                        early = _MIN_REFRESH_S - (loop.time() - listed)
                        if early > 0 and not s.broken:
                            await asyncio.sleep(early)
                        if s.broken:
                            break
                        self._wake.clear()  # what came meanwhile: this listing sees it
                        listed = loop.time()
                        await self._on_tools(self, await self._list_all(client))
                finally:
                    self.mark_broken(s)
                    if listener is not None:
                        listener.cancel()
                        with contextlib.suppress(BaseException):
                            await listener
        finally:
            self.mark_broken(s)
            s.lost.set()

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

    def mark_broken(self, s: _Session) -> None:
        """End session `s` (it failed a call, went stale, or its process exited), and let
        no new call take it while the supervisor tears it down."""
        if s.broken:
            return
        s.broken = True
        if self._live is s:
            self._live = None
            self._ready.clear()
        self._wake.set()

    # -- calls

    async def _ready_session(self, wait_s: float) -> _Session:
        loop = asyncio.get_running_loop()
        end = loop.time() + wait_s
        while self._live is None:
            try:
                await asyncio.wait_for(self._ready.wait(), max(end - loop.time(), 0))
            except TimeoutError:
                raise ToolError(
                    f"MCP server {self.cfg.id} is unreachable ({self.cfg.describe()}"
                    f"{': ' + self.last_error if self.last_error else ''}); toolbus keeps "
                    "reconnecting", error_type="server_unavailable", retryable=True) from None
        return self._live

    async def call(self, name: str, arguments: dict[str, Any], *,
                   progress: ProgressFn | None, wait_s: float | None = None
                   ) -> mt.CallToolResult:
        """One `tools/call` on the current session (waiting up to `wait_s`, default
        `connect_timeout_s`, for one). `_NotRun` if the server refused it without running
        it, `_ConnectionLost` if the session died while it ran."""
        s = await self._ready_session(self.cfg.connect_timeout_s if wait_s is None else wait_s)
        client = s.client
        assert client is not None
        attempt = _Attempt()
        report = progress

        async def on_progress(progress: float, total: float | None, message: str | None) -> None:
            if report is not None:
                report()

        async def send() -> mt.CallToolResult:
            _attempt.set(attempt)  # this task's context: the transport sends in it
            # The deadline is the caller's (McpTool.run); the SDK's own is only a backstop.
            return await client.call_tool(name, arguments,
                                          read_timeout_seconds=self.cfg.max_timeout_s + 5,
                                          progress_callback=on_progress)

        call = asyncio.ensure_future(send())
        gone = asyncio.ensure_future(s.lost.wait())
        try:
            await asyncio.wait({call, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for f in (call, gone):
                if not f.done():
                    f.cancel()
        exc = call.exception() if call.done() and not call.cancelled() else None
        if call.done() and not call.cancelled() and exc is None:
            return call.result()
        if attempt.not_run is not None:
            raise _NotRun(attempt.not_run) from exc
        if exc is None or _is_connection_error(exc):
            self.mark_broken(s)
            raise _ConnectionLost() from exc
        if isinstance(exc, MCPError):
            if s.stale is not None:  # answered on a session the server has forgotten
                raise _NotRun(s.stale) from exc
            if exc.code == _REQUEST_TIMEOUT:
                raise ToolError(f"MCP server {self.cfg.id} did not answer {name} in time",
                                error_type="timeout", retryable=True) from exc
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
        # The executor's hard limit; McpTool.run keeps the shorter deadline that progress
        # notifications push out.
        timeout_ms=round(cfg.max_timeout_s * 1000),
        source=f"mcp:{cfg.id}",
        pools=[cfg.pool],
        trusted=cfg.trusted,
        annotated=a is not None,
    )


_SECRET_NAME = re.compile(r"key|token|secret|passw|auth|cookie|credential", re.I)
_SECRET_MIN_CHARS = 8  # shorter values are no keys, and would take words out of results


def server_secrets(cfg: McpServerConfig) -> list[str]:
    """What toolbus hands the server that the server must not hand back to the event log
    (and the model): its `api_key`, the values of its headers and stdio variables whose
    names say key, token, secret, password, auth, cookie or credential, and the values of
    its URL's query."""
    values = [cfg.api_key or ""]
    for name, value in [*cfg.headers.items(), *cfg.env.items()]:
        if _SECRET_NAME.search(name):
            values.append(value)
    # A key in the URL (`path: /mcp?api_key=...`, as hosted servers often take it):
    # `describe` never shows the query, and neither may what the server sends back.
    # The server quotes it as it was sent, too: percent-encoded as written (decoded, `+`
    # is a space), or as a key with +, / or = is encoded.
    query = urlsplit(cfg.path or "").query
    values += [v for _, v in parse_qsl(query)]
    values += [p.partition("=")[2] for p in query.split("&")]
    forms = {form for v in values if len(v) >= _SECRET_MIN_CHARS
             for form in (v, repr(v)[1:-1], json.dumps(v)[1:-1], quote(v, safe=""))}
    return sorted(forms, key=len, reverse=True)


class McpTool:
    """An MCP server's tool, as the executor runs it. What the server sends back, result
    or error, never holds its secrets (`server_secrets`): a server (or a proxy before it)
    quoting the request's `Authorization` header in an error would otherwise store the key
    in the call's event, for every client and the model to read."""

    def __init__(self, spec: ToolSpec, remote_name: str, link: McpLink) -> None:
        self.spec = spec
        self.remote_name = remote_name
        self.link = link
        self.injected: dict[str, Resource] = {}
        self._secrets = server_secrets(link.cfg)

    def check_arguments(self, arguments: dict[str, Any]) -> None:
        """The server checks its own arguments; the schema was checked on admission."""

    async def run(self, arguments: dict[str, Any], resources: dict[Resource, Any] | None = None,
                  *, progress: ProgressFn | None = None) -> Any:
        cfg = self.link.cfg
        loop = asyncio.get_running_loop()
        hard = loop.time() + cfg.max_timeout_s
        deadline = asyncio.timeout_at(min(loop.time() + cfg.timeout_s, hard))

        def on_progress() -> None:
            deadline.reschedule(min(loop.time() + cfg.timeout_s, hard))
            if progress is not None:
                progress()

        try:
            async with deadline:
                return redact(await self._attempts(arguments, on_progress, deadline),
                              self._secrets)
        except ToolError as exc:
            if not any(secret in exc.message for secret in self._secrets):
                raise
            raise ToolError(redact(exc.message, self._secrets), error_type=exc.error_type,
                            retryable=exc.retryable) from None
        except TimeoutError:
            if not deadline.expired():
                raise
            if loop.time() >= hard:
                message = (f"{self.spec.name} did not finish within max_timeout_ms "
                           f"({cfg.max_timeout_s:g} s), although it kept reporting progress")
            else:
                message = (f"{self.spec.name} sent no progress for {cfg.timeout_s:g} s "
                           "(timeout_ms) and did not finish")
            raise ToolError(message, error_type="timeout", retryable=True) from None

    async def _attempts(self, arguments: dict[str, Any], progress: ProgressFn,
                        deadline: asyncio.Timeout) -> Any:
        server = self.link.cfg.id
        for attempt in (1, 2):
            # A session (or a reconnection) is waited for within what is left of the
            # call's time, so a call that never reached the server says so, not `timeout`.
            left = (deadline.when() or 0.0) - asyncio.get_running_loop().time()
            wait_s = max(min(self.link.cfg.connect_timeout_s, left - 0.05), 0.0)
            try:
                result = await self.link.call(self.remote_name, arguments, progress=progress,
                                              wait_s=wait_s)
            except _NotRun as exc:
                if not self.spec.rerunnable:
                    raise ToolError(
                        f"MCP server {server} did not run {self.spec.name}: {exc.reason}. "
                        "toolbus is reconnecting; the call can be sent again",
                        error_type="server_unavailable", retryable=True) from None
                if attempt == 2:
                    raise ToolError(f"MCP server {server} did not run {self.spec.name}, "
                                    f"twice: {exc.reason}", error_type="server_unavailable",
                                    retryable=True) from None
                log.info("%s: not run (%s); sending it again on a new session",
                         self.spec.name, exc.reason)
                continue
            except _ConnectionLost:
                if not self.spec.rerunnable:
                    raise ToolError(
                        f"the connection to MCP server {server} dropped while "
                        f"{self.spec.name} ran; the tool is neither read-only nor idempotent, "
                        "so it is not run again (the server may or may not have acted)",
                        error_type="interrupted") from None
                if attempt == 2:
                    raise ToolError(f"the connection to MCP server {server} dropped "
                                    "twice during this call", error_type="server_unavailable",
                                    retryable=True) from None
                log.info("%s: connection dropped mid-call; retrying on a new session",
                         self.spec.name)
                continue
            return tool_result(self.spec, result)
        raise AssertionError("unreachable")


def _is_binary(block: mt.ContentBlock) -> bool:
    if isinstance(block, mt.ImageContent | mt.AudioContent):
        return True
    return isinstance(block, mt.EmbeddedResource) and \
        isinstance(block.resource, mt.BlobResourceContents)


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


def tool_result(spec: ToolSpec, result: mt.CallToolResult) -> Any:
    """The call's result: structured content as is (what an output schema describes),
    else text; with binary content (images, audio, blobs), MCP's own shape
    `{"content": [...], "structuredContent": ...}`, binary data base64 with its mimeType."""
    if result.is_error:
        raise ToolError(content_text(result.content) or f"{spec.name} failed",
                        error_type="tool_error")
    binary = any(_is_binary(b) for b in result.content)
    if result.structured_content is not None and (not binary or spec.output is not None):
        return result.structured_content
    if not binary:
        return content_text(result.content)
    out: dict[str, Any] = {"content": [b.model_dump(mode="json", by_alias=True,
                                                    exclude_none=True)
                                       for b in result.content]}
    if result.structured_content is not None:
        out["structuredContent"] = result.structured_content
    return out
