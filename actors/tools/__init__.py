"""The tool SDK and the built-in tools.

    from actors.tools import ToolError, resource, tool, uses
"""

from actors.tools.sdk import (
    LocalTool,
    ProgressFn,
    Resource,
    ResourceScope,
    RunnableTool,
    ToolError,
    index_tools,
    load_tools,
    resource,
    tool,
    uses,
    with_pool,
)

__all__ = [
    "LocalTool",
    "ProgressFn",
    "Resource",
    "ResourceScope",
    "RunnableTool",
    "ToolError",
    "index_tools",
    "load_tools",
    "resource",
    "tool",
    "uses",
    "with_pool",
]
