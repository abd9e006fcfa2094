"""Real MCP servers for tests, on free ports: services/sample_mcp.py, and this module's
variants of it (built with the same `mcp` SDK server), in subprocesses.

    python -m tests.mcp_servers --transport streamable-http --port 8765 --legacy
    python -m tests.mcp_servers --transport stdio --mute --pid-file /tmp/pid

Variants: `--legacy` speaks only the 2025 handshake over streamable HTTP, so its sessions
live in the process (an `Mcp-Session-Id` that a restart forgets), like the reference
`server-everything`; `--stale-status 400` answers a forgotten session id with 400, as
servers built on the TypeScript SDK's examples do, instead of the spec's 404. `--mute`
never answers `initialize` (`--ignore-sigterm` too); `--crash CODE` writes to stderr and
exits at start-up. Extra tools: `snapshot` returns an image, `wait_quietly` sleeps without
progress notifications.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from schemas.manifest import McpServerConfig

# The servers import no more than they need: a stdio one must start fast.
REPO = Path(__file__).parent.parent


class SampleServer:
    """An MCP server over HTTP (streamable or SSE), killable and restartable on the same
    port: `python -m services.sample_mcp`, or with `module="tests.mcp_servers"` this
    module's variants."""

    def __init__(self, transport: str = "streamable-http", *args: str,
                 port: int | None = None, module: str = "services.sample_mcp") -> None:
        from bus.server import free_port

        self.transport = transport
        self.args = args
        self.port = port or free_port()
        self.module = module
        self.proc: subprocess.Popen[bytes] | None = None

    async def start(self) -> SampleServer:
        from services.sample_mcp import wait_listening

        self.proc = subprocess.Popen(  # noqa: ASYNC220  # spawning does not block
            [sys.executable, "-m", self.module, "--transport", self.transport,
             "--port", str(self.port), *self.args],
            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        await wait_listening(self.port, self.proc)
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
            self.kill()


def legacy_server(*args: str, port: int | None = None) -> SampleServer:
    """A stateful streamable-HTTP server speaking only the 2025 handshake."""
    return SampleServer("streamable-http", "--legacy", *args, port=port,
                        module="tests.mcp_servers")


def stdio_command(log: Path | None = None) -> dict[str, object]:
    args = ["-m", "services.sample_mcp", "--transport", "stdio"]
    if log is not None:
        args += ["--log", str(log)]
    return {"transport": "stdio", "command": sys.executable, "args": args, "cwd": str(REPO)}


def stdio_variant(*args: str) -> dict[str, object]:
    """A manifest entry's stdio fields for this module's variants."""
    return {"transport": "stdio", "command": sys.executable,
            "args": ["-m", "tests.mcp_servers", "--transport", "stdio", *args],
            "cwd": str(REPO)}


def mcp_config(id_: str, **kw: Any) -> McpServerConfig:
    """A manifest `mcps:` entry with test-sized timeouts."""
    from schemas.manifest import McpServerConfig

    return McpServerConfig.model_validate({"id": id_, "connect_timeout_s": 5,
                                           "timeout_ms": 20_000, **kw})


def http_config(id_: str, server: SampleServer, **kw: Any) -> McpServerConfig:
    return mcp_config(id_, transport=server.transport, hostname="http://127.0.0.1",
                      port=server.port, **kw)


def process_alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def read_pid(path: Path, timeout: float = 20.0) -> int:
    """The pid a `--pid-file` server wrote, once it has (another process writes it: there
    is no event to await)."""
    async with asyncio.timeout(timeout):
        while not (path.exists() and path.read_text().strip()):  # noqa: ASYNC110
            await asyncio.sleep(0.02)
    return int(path.read_text())


# --- the servers ---------------------------------------------------------------------


def png(width: int, height: int, *, noise: bool = False) -> bytes:
    """A valid RGB PNG; `noise` makes it incompressible (as large as its pixels)."""
    row = 3 * width
    pixels = b"".join(b"\x00" + (os.urandom(row) if noise else bytes([200, 30, 60]) * width)
                      for _ in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(pixels)) + chunk(b"IEND", b""))


def build(log: Path | None) -> Any:
    from mcp.server.mcpserver import Image
    from mcp.types import ToolAnnotations

    from services.sample_mcp import build as build_sample

    server = build_sample(log=log)

    @server.tool(annotations=ToolAnnotations(read_only_hint=True, idempotent_hint=True),
                 structured_output=False)
    def snapshot(side: int = 4, noise: bool = False) -> list[Any]:
        """A photo of the fleet: a caption and a PNG image."""
        return [f"fleet snapshot, {side}x{side}", Image(data=png(side, side, noise=noise),
                                                        format="png")]

    @server.tool(annotations=ToolAnnotations(read_only_hint=True, idempotent_hint=True))
    async def wait_quietly(seconds: float) -> str:
        """Sleep without sending progress notifications."""
        await asyncio.sleep(seconds)
        return "done"

    return server


class _Legacy:
    """ASGI middleware that makes a server speak only the 2025 handshake (it refuses the
    2026 `server/discover` probe as a 2025 server does), with no standalone GET stream (a
    server may answer GET with 405), and optionally answers a forgotten session id with
    another status."""

    def __init__(self, app: Any, stale_status: int) -> None:
        self.app = app
        self.stale_status = stale_status

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["method"] == "GET":
            await _send_json(send, 405, {"error": "no standalone stream"})
            return
        if scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        with contextlib.suppress(ValueError, AttributeError):
            if json.loads(body).get("method") == "server/discover":
                await _send_json(send, 400, {"jsonrpc": "2.0", "id": None, "error": {
                    "code": -32000, "message": "Bad Request: No valid session ID provided"}})
                return
        has_session = any(k == b"mcp-session-id" for k, _ in scope["headers"])
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        async def restatus(message: Any) -> None:
            if message["type"] == "http.response.start" and message["status"] == 404 \
                    and has_session:
                message = {**message, "status": self.stale_status}
            await send(message)

        await self.app(scope, replay, restatus)


async def _send_json(send: Any, status: int, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.mcp_servers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--transport", choices=["streamable-http", "sse", "stdio"],
                   default="streamable-http")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--log", type=Path, default=None)
    p.add_argument("--legacy", action="store_true")
    p.add_argument("--stale-status", type=int, default=404)
    p.add_argument("--mute", action="store_true")
    p.add_argument("--ignore-sigterm", action="store_true")
    p.add_argument("--crash", type=int, default=None)
    p.add_argument("--pid-file", type=Path, default=None)
    args = p.parse_args(argv)
    if args.pid_file is not None:
        args.pid_file.write_text(str(os.getpid()))
    if args.crash is not None:
        print("fleet-mcp 1.0 starting", file=sys.stderr)
        print("error: DATABASE_URL is not set; cannot load the fleet", file=sys.stderr,
              flush=True)
        return int(args.crash)
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.mute:
        print("fleet-mcp: loading the fleet model...", file=sys.stderr, flush=True)
        time.sleep(3600)  # never gets to answer initialize
        return 1
    server = build(args.log)
    if args.transport == "stdio":
        server.run("stdio")
        return 0
    import uvicorn

    app: Any = (server.streamable_http_app() if args.transport == "streamable-http"
                else server.sse_app())
    if args.legacy:
        app = _Legacy(app, args.stale_status)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
