"""Built-in tools of the `built-in` namespace."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from actors.tool import LocalTool, ToolError, tool


@tool(
    "built-in:echo",
    description="Return the arguments unchanged. Useful to test the tool path end to end.",
    read_only=True,
    idempotent=True,
    open_world=False,
    timeout_ms=5_000,
    parameters={"type": "object", "additionalProperties": True},
)
async def echo(**arguments: Any) -> Any:
    return arguments


@tool(
    "built-in:current_time",
    description="The current date and time as ISO-8601, in UTC or the given IANA time zone.",
    read_only=True,
    idempotent=False,
    open_world=False,
    timeout_ms=5_000,
    parameters={
        "type": "object",
        "properties": {
            "timezone": {
                "type": "string",
                "description": "IANA time zone name, e.g. Europe/Paris. Default UTC.",
            }
        },
        "additionalProperties": False,
    },
)
async def current_time(timezone: str = "UTC") -> dict[str, str]:
    try:
        zone = ZoneInfo(timezone)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise ToolError(
            f"unknown time zone {timezone!r}: use an IANA name such as UTC or Europe/Paris",
            error_type="invalid_timezone",
        ) from exc
    now = datetime.now(UTC).astimezone(zone)
    return {"time": now.isoformat(), "timezone": timezone}


BUILTINS: list[LocalTool] = [echo, current_time]
