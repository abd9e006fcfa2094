"""Tools used by the tests, loaded with `--tools tests/toolkit.py` or `load_tools`.

Namespace `testing` is served by the in-process executor of the test session; `proc`
(in proc_toolkit.py) only by executor subprocesses that tests start and kill.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from actors.tool import ToolError, tool


@tool("testing:append_line", idempotent=False, timeout_ms=10_000)
async def append_line(path: str, line: str) -> dict[str, str]:
    """Append a line to a file: a side effect that must never happen twice."""
    with Path(path).open("a") as f:
        f.write(line + "\n")
    return {"written": line}


@tool("testing:sleep", read_only=True, timeout_ms=60_000)
async def sleep(seconds: float) -> dict[str, float]:
    await asyncio.sleep(seconds)
    return {"slept": seconds}


@tool("testing:short_timeout", read_only=True, timeout_ms=200)
async def short_timeout(seconds: float) -> dict[str, float]:
    await asyncio.sleep(seconds)
    return {"slept": seconds}


@tool("testing:boom", read_only=True)
async def boom(message: str) -> None:
    raise RuntimeError(message)


@tool("testing:refuse", read_only=True)
def refuse(reason: str) -> None:
    raise ToolError(reason, error_type="refused", retryable=True)


@tool("testing:not_json", read_only=True)
def not_json() -> object:
    return {"value": object()}


@tool("testing:loose", read_only=True, parameters={"type": "object"})
async def loose(seconds: float) -> dict[str, float]:
    return {"seconds": seconds}
