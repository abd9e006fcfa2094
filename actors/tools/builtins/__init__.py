"""Built-in tools of the `built-in` namespace, and the tools a manifest declares.

`echo` and `current_time` need no configuration and are always there; the others
(`http` tools under their own names, `file_read`/`file_write`, `code_execute`,
`git_read`/`git`, `web_search`) exist when the manifest configures them.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from actors.tools import LocalTool, ToolError, load_tools, tool
from schemas.manifest import Manifest


@tool(
    "built-in:echo",
    description="Return the arguments unchanged. Useful to test the tool path end to end.",
    read_only=True,
    idempotent=True,
    open_world=False,
    timeout_ms=5_000,
    source="built-in",
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
    source="built-in",
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


def manifest_tools(manifest: Manifest, *, path_env: str,
                   secrets: Mapping[str, str]) -> list[LocalTool]:
    """Every tool a manifest declares, each tagged with its pool. `secrets` holds the
    provider key variables (TAVILY_API_KEY) read by the caller."""
    from actors.tools.builtins.code import code_tool  # heavy, optional parts
    from actors.tools.builtins.files import file_tools
    from actors.tools.builtins.git import git_tools
    from actors.tools.builtins.http import http_tool
    from actors.tools.builtins.search import KEY_VARIABLES, search_tool

    t = manifest.tools
    by_name = {b.spec.name.split(":", 1)[1]: b for b in BUILTINS}
    tools: list[LocalTool] = [by_name[n] for n in dict.fromkeys(t.builtins)]
    for module in t.modules:
        tools.extend(load_tools(module))
    tools.extend(http_tool(h) for h in t.http)
    if t.files is not None:
        tools.extend(file_tools(t.files))
    if t.code is not None:
        tools.append(code_tool(t.code, path_env=path_env))
    if t.git is not None:
        tools.extend(git_tools(t.git, path_env=path_env))
    if t.web_search is not None:
        ws = t.web_search
        key = ws.api_key or secrets.get(KEY_VARIABLES[ws.provider])
        tools.append(search_tool(ws, api_key=key))
    return tools
