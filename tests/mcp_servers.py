"""Real MCP servers for tests: services/sample_mcp.py in subprocesses, on free ports."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from bus.server import free_port
from schemas.manifest import McpServerConfig
from services.sample_mcp import wait_listening
from tests.conftest import REPO


class SampleServer:
    """`python -m services.sample_mcp` over HTTP (streamable or SSE), killable and
    restartable on the same port."""

    def __init__(self, transport: str = "streamable-http", *args: str,
                 port: int | None = None) -> None:
        self.transport = transport
        self.args = args
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    async def start(self) -> SampleServer:
        self.proc = subprocess.Popen(  # noqa: ASYNC220  # spawning does not block
            [sys.executable, "-m", "services.sample_mcp", "--transport", self.transport,
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


def stdio_command(log: Path | None = None) -> dict[str, object]:
    args = ["-m", "services.sample_mcp", "--transport", "stdio"]
    if log is not None:
        args += ["--log", str(log)]
    return {"transport": "stdio", "command": sys.executable, "args": args, "cwd": str(REPO)}


def mcp_config(id_: str, **kw: Any) -> McpServerConfig:
    """A manifest `mcps:` entry with test-sized timeouts."""
    return McpServerConfig.model_validate({"id": id_, "connect_timeout_ms": 5000,
                                           "timeout_ms": 20_000, **kw})


def http_config(id_: str, server: SampleServer, **kw: Any) -> McpServerConfig:
    return mcp_config(id_, transport=server.transport, hostname="http://127.0.0.1",
                      port=server.port, **kw)
