"""Local tools: a spec plus the Python callable that runs it.

    @tool("shop:add_to_cart", read_only=False, idempotent=False, timeout_ms=5_000)
    async def add_to_cart(item: str, qty: int = 1) -> dict: ...

A module of tools is loaded into an executor with `toolbus actor executor --tools MODULE`
(a dotted module name or a path to a .py file); every `LocalTool` at its top level, and
every item of a `TOOLS` list in it, is registered.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_type_hints

from schemas.errors import ConfigError, ToolbusError
from schemas.ids import split_tool_name
from schemas.tools import DEFAULT_POOL, DEFAULT_TIMEOUT_MS, Annotations, ToolSpec


class ToolError(ToolbusError):
    """Raise from a tool to fail the call with a chosen `error_type` and `retryable` flag."""

    def __init__(self, message: str, *, error_type: str = "tool_error", retryable: bool = False):
        self.message = message
        self.error_type = error_type
        self.retryable = retryable
        super().__init__(message)


ToolFn = Callable[..., Any]
_signatures: dict[ToolFn, inspect.Signature] = {}


@dataclass(frozen=True, slots=True)
class LocalTool:
    spec: ToolSpec
    fn: ToolFn

    def check_arguments(self, arguments: dict[str, Any]) -> None:
        """Raise `TypeError` if the function cannot take these arguments."""
        sig = _signatures.get(self.fn)
        if sig is None:
            sig = _signatures[self.fn] = inspect.signature(self.fn)
        sig.bind(**arguments)

    async def run(self, arguments: dict[str, Any]) -> Any:
        if inspect.iscoroutinefunction(self.fn):
            return await self.fn(**arguments)
        # Sync tools run in a worker thread so one slow tool never blocks the loop. A
        # thread cannot be killed: on timeout the call fails and the thread is abandoned.
        result = await asyncio.to_thread(self.fn, **arguments)
        if inspect.isawaitable(result):
            return await result
        return result


_JSON_TYPES: dict[Any, str] = {
    str: "string", int: "integer", float: "number", bool: "boolean",
    dict: "object", list: "array",
}


def _parameters_from_signature(fn: ToolFn) -> dict[str, Any]:
    hints = get_type_hints(fn)
    props: dict[str, Any] = {}
    required: list[str] = []
    for name, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        schema: dict[str, Any] = {}
        json_type = _JSON_TYPES.get(hints.get(name))
        if json_type:
            schema["type"] = json_type
        if param.default is inspect.Parameter.empty:
            required.append(name)
        else:
            schema["default"] = param.default
        props[name] = schema
    out: dict[str, Any] = {"type": "object", "properties": props}
    if required:
        out["required"] = required
    return out


def tool(
    name: str,
    *,
    description: str | None = None,
    read_only: bool = False,
    destructive: bool | None = None,
    idempotent: bool = False,
    open_world: bool = True,
    timeout_ms: int = DEFAULT_TIMEOUT_MS,
    parameters: dict[str, Any] | None = None,
    pool: str | None = None,
) -> Callable[[ToolFn], LocalTool]:
    split_tool_name(name)

    def wrap(fn: ToolFn) -> LocalTool:
        spec = ToolSpec(
            name=name,
            description=description if description is not None else inspect.getdoc(fn) or "",
            parameters=parameters or _parameters_from_signature(fn),
            annotations=Annotations(
                readOnlyHint=read_only,
                destructiveHint=(not read_only) if destructive is None else destructive,
                idempotentHint=idempotent,
                openWorldHint=open_world,
            ),
            timeout_ms=timeout_ms,
            pool=pool or DEFAULT_POOL,
        )
        return LocalTool(spec=spec, fn=fn)

    return wrap


def load_tools(target: str) -> list[LocalTool]:
    """Import a module (dotted name or .py path) and collect its tools."""
    try:
        if target.endswith(".py") or "/" in target:
            path = Path(target).resolve()
            if not path.is_file():
                raise ConfigError(f"--tools {target}: no such file")
            mod_name = f"toolbus_user_tools_{path.stem}"
            spec = importlib.util.spec_from_file_location(mod_name, path)
            if spec is None or spec.loader is None:
                raise ConfigError(f"--tools {target}: cannot load this file as Python")
            module = importlib.util.module_from_spec(spec)
            sys.modules[mod_name] = module
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except ImportError as exc:
        raise ConfigError(f"--tools {target}: cannot import it: {exc}") from exc
    found: list[LocalTool] = [v for v in vars(module).values() if isinstance(v, LocalTool)]
    for item in getattr(module, "TOOLS", []):
        if isinstance(item, LocalTool) and item not in found:
            found.append(item)
    if not found:
        raise ConfigError(
            f"--tools {target}: the module defines no tools; decorate functions with "
            "@actors.tool.tool(...)"
        )
    return found


def index_tools(tools: Iterable[LocalTool]) -> dict[str, LocalTool]:
    out: dict[str, LocalTool] = {}
    for t in tools:
        if t.spec.name in out and out[t.spec.name] is not t:
            raise ConfigError(f"tool {t.spec.name} is defined twice")
        out[t.spec.name] = t
    return out

