"""Tools for executor subprocesses that tests start, share work between and SIGKILL."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from actors.tools import tool


@tool("proc:append_line", idempotent=False, timeout_ms=60_000)
async def append_line(path: str, line: str, hold_s: float = 0.0) -> dict[str, object]:
    """Append a line (the side effect), then hold the call open for `hold_s` seconds."""
    with Path(path).open("a") as f:
        f.write(f"{line} pid={os.getpid()}\n")
    await asyncio.sleep(hold_s)
    return {"written": line, "pid": os.getpid()}


@tool("proc:idempotent_hold", idempotent=True, timeout_ms=60_000)
async def idempotent_hold(path: str, line: str, hold_s: float = 0.0) -> dict[str, object]:
    """An idempotent tool: records each run, so a test can see it re-run after a kill."""
    with Path(path).open("a") as f:
        f.write(f"{line} pid={os.getpid()}\n")
    await asyncio.sleep(hold_s)
    return {"ran": line, "pid": os.getpid()}


@tool("proc:whoami", read_only=True, timeout_ms=10_000)
async def whoami(hold_s: float = 0.0) -> dict[str, int]:
    await asyncio.sleep(hold_s)
    return {"pid": os.getpid()}


@tool("proc:blob", read_only=True, timeout_ms=120_000)
async def blob(size: int) -> str:
    """A text result of `size` characters, made in an executor process whose memory the
    test reads."""
    return "y" * size
