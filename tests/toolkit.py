"""Tools used by the tests, loaded with `--tools tests/toolkit.py` or `load_tools`.

Namespace `testing` is served by the in-process executor of the test session; `proc`
(in proc_toolkit.py) only by executor subprocesses that tests start and kill.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from actors.tools import ToolError, tool


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


# --- for the parallel and side-effect rules -----------------------------------------------

RUNS: list[tuple[str, float, float]] = []  # (label, start, end) of every probe/record run


@tool("testing:probe", read_only=True, idempotent=True, timeout_ms=30_000)
async def probe(label: str, seconds: float = 0.3) -> dict[str, str]:
    """A slow read-only call that records when it ran."""
    start = time.monotonic()
    await asyncio.sleep(seconds)
    RUNS.append((label, start, time.monotonic()))
    return {"label": label}


@tool("testing:create_record", idempotent=False, timeout_ms=30_000)
async def create_record(label: str, seconds: float = 0.3) -> dict[str, str]:
    """A slow call with side effects that records when it ran."""
    start = time.monotonic()
    await asyncio.sleep(seconds)
    RUNS.append((label, start, time.monotonic()))
    return {"created": label}


@tool("testing:dangerous", risk_level="high", destructive=True, idempotent=False)
async def dangerous() -> str:
    """Risk 10: blocked by the test policy's block_at."""
    return "should never run"


@tool("testing:forbidden_tool", read_only=True)
async def forbidden_tool() -> str:
    return "denied by the test policy"


# Namespace `approvals` is not auto-approved by the test policy.
@tool("approvals:write", idempotent=True, risk_level="medium")
async def write(text: str) -> dict[str, str]:
    """A mutating tool: the policy asks a human."""
    return {"wrote": text}


@tool("approvals:write_auto", idempotent=True, auto_approve=True)
async def write_auto(text: str) -> dict[str, str]:
    """A mutating tool whose own config says auto_approve."""
    return {"wrote": text}


@tool("testing:blob", read_only=True, timeout_ms=60_000)
async def blob(size: int, fill: str = "x") -> str:
    """A text result of `size` characters: results of any size, for the size limits."""
    return fill[:1] * size


@tool("testing:list_commits", read_only=True)
def list_commits(repo: str = "tylerjrbuell/reactive-agents-ts") -> list[dict[str, object]]:
    """A repository's last 30 commits, as GitHub's MCP server lists them (31,863 chars)."""
    from tests.github import COMMITS

    return COMMITS
