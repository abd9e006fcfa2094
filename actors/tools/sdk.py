"""The Python tool SDK: a decorator on a typed function.

    from typing import Annotated
    from pydantic import BaseModel, Field
    from actors.tools import ToolError, resource, tool, uses

    class Ticket(BaseModel):
        id: int
        title: str

    @resource
    async def tracker():                       # set up once per executor, closed at stop
        async with httpx.AsyncClient(base_url="https://tracker") as client:
            yield client

    @tool("tickets:create", idempotent=False, risk_level="medium", timeout_ms=5_000)
    async def create(title: Annotated[str, Field(max_length=200)], priority: int = 3,
                     *, client: httpx.AsyncClient = uses(tracker)) -> Ticket:
        '''Open a ticket.

        Args:
            title: one line saying what is wrong.
            priority: 1 (urgent) to 5.
        '''

The parameters' JSON Schema is generated from the type hints by pydantic (models,
`Literal`, `Annotated[..., Field(...)]`, defaults), the result schema (`_output`) from the
return annotation, the description from the docstring, and each parameter's description
from its `Args:` entry. Parameters whose default is `uses(resource)` are not part of the
schema: the executor injects them. Sync functions run in a worker thread.

A module of tools is loaded into an executor with `toolbus actor executor --tools MODULE`
(a dotted module name or a path to a .py file); every `LocalTool` at its top level, and
every item of a `TOOLS` list in it, is registered.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import importlib
import importlib.util
import inspect
import re
import sys
import threading
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, get_type_hints

import msgspec
import pydantic
import pydantic_core

from schemas.errors import ConfigError, ToolbusError
from schemas.ids import split_tool_name
from schemas.tools import (
    DEFAULT_POOL,
    DEFAULT_TIMEOUT_MS,
    RISK_LEVELS,
    Annotations,
    RiskLevel,
    ToolSpec,
)


async def in_thread(fn: Callable[..., Any], kwargs: dict[str, Any], *, name: str) -> Any:
    """`fn(**kwargs)` in a thread of its own, so that a slow sync tool never blocks the
    event loop. Not the loop's shared pool (`asyncio.to_thread`): a thread cannot be
    killed, so one a call timed out on is left running, and a few such (6 on 2 cores)
    would take every thread of the pool, after which no sync tool of the process ran at
    all, and closing the loop waited for them, so Ctrl-C never ended `toolbus up`. A
    daemon thread of its own holds up neither."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Any] = loop.create_future()
    context = contextvars.copy_context()

    def settle(value: Any, error: BaseException | None) -> None:
        if done.done():
            return  # the call timed out, or was cancelled, while this ran
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(value)

    def run() -> None:
        try:
            value, error = context.run(fn, **kwargs), None
        except Exception as exc:  # handed to the awaiting call
            value, error = None, exc
        except BaseException as exc:  # SystemExit, KeyboardInterrupt: the call's, not ours
            value, error = None, RuntimeError(f"{name} raised {type(exc).__name__}: {exc}")
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(settle, value, error)

    threading.Thread(target=run, name=f"tool {name}", daemon=True).start()
    return await done


class ToolError(ToolbusError):
    """Raise from a tool to fail the call with a chosen `error_type` and `retryable` flag."""

    def __init__(self, message: str, *, error_type: str = "tool_error", retryable: bool = False):
        self.message = message
        self.error_type = error_type
        self.retryable = retryable
        super().__init__(message)


ToolFn = Callable[..., Any]


# --- resources (stateful tools) ----------------------------------------------------------


class Resource:
    """Something tools share, opened once when the executor starts and closed when it
    stops: a client, a connection pool. The factory is an async or sync generator function
    (code after `yield` is the clean-up), a function returning a context manager, or a
    plain function returning the value."""

    def __init__(self, factory: Callable[[], Any], name: str | None = None) -> None:
        self.factory = factory
        self.name = name or getattr(factory, "__qualname__", repr(factory))

    def __repr__(self) -> str:
        return f"Resource({self.name})"

    async def enter(self, stack: contextlib.AsyncExitStack) -> Any:
        f = self.factory
        if inspect.isasyncgenfunction(f):
            return await stack.enter_async_context(contextlib.asynccontextmanager(f)())
        if inspect.isgeneratorfunction(f):
            return stack.enter_context(contextlib.contextmanager(f)())
        value = f()
        if inspect.isawaitable(value):
            value = await value
        if isinstance(value, contextlib.AbstractAsyncContextManager):
            return await stack.enter_async_context(value)
        if isinstance(value, contextlib.AbstractContextManager):
            return stack.enter_context(value)
        return value


def resource(factory: Callable[[], Any]) -> Resource:
    return Resource(factory)


@dataclass(frozen=True, slots=True)
class _Uses:
    resource: Resource


def uses(res: Resource) -> Any:
    """Default value of a keyword parameter the executor fills with an open resource."""
    if not isinstance(res, Resource):
        raise TypeError(f"uses() takes a @resource, got {res!r}")
    return _Uses(res)


class ResourceScope:
    """The open resources of one executor: `async with ResourceScope(tools) as scope`."""

    def __init__(self, tools: Iterable[RunnableTool]) -> None:
        self._needed: list[Resource] = []
        for t in tools:
            for res in t.injected.values():
                if res not in self._needed:
                    self._needed.append(res)
        self._stack = contextlib.AsyncExitStack()
        self.values: dict[Resource, Any] = {}

    async def __aenter__(self) -> ResourceScope:
        try:
            for res in self._needed:
                self.values[res] = await res.enter(self._stack)
        except Exception as exc:
            await self._stack.aclose()
            raise ConfigError(f"resource {res.name} failed to open: {exc!r}") from exc
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.values.clear()
        await self._stack.aclose()


# --- local tools -------------------------------------------------------------------------

ProgressFn = Callable[[], None]


class RunnableTool(Protocol):
    """What an executor runs: a local function (`LocalTool`) or a remote one (an MCP
    server's tool, `McpTool` in actors/mcp_link.py)."""

    @property
    def spec(self) -> ToolSpec: ...
    @property
    def injected(self) -> dict[str, Resource]: ...
    def check_arguments(self, arguments: dict[str, Any]) -> None: ...
    async def run(self, arguments: dict[str, Any], resources: dict[Resource, Any] | None = None,
                  *, progress: ProgressFn | None = None) -> Any: ...


@dataclass(frozen=True, slots=True, eq=False)
class LocalTool:
    spec: ToolSpec
    fn: ToolFn
    injected: dict[str, Resource] = field(default_factory=dict)
    # Set when some parameter is not plain JSON (a pydantic model, a datetime...): the
    # arguments go through this model first. Plain tools skip pydantic entirely.
    args_model: type[pydantic.BaseModel] | None = None
    result_adapter: pydantic.TypeAdapter[Any] | None = None

    def check_arguments(self, arguments: dict[str, Any]) -> None:
        """Raise `TypeError` if the function cannot take these arguments."""
        _signature(self.fn).bind(**arguments, **dict.fromkeys(self.injected))

    async def run(self, arguments: dict[str, Any],
                  resources: dict[Resource, Any] | None = None,
                  *, progress: ProgressFn | None = None) -> Any:
        kwargs = arguments
        if self.args_model is not None:
            model = self.args_model.model_validate(arguments)
            kwargs = {k: getattr(model, k) for k in type(model).model_fields}
        if self.injected:
            if resources is None:
                raise ConfigError(f"{self.spec.name} needs resources; run it in an executor")
            kwargs = kwargs | {p: resources[r] for p, r in self.injected.items()}
        if inspect.iscoroutinefunction(self.fn):
            result = await self.fn(**kwargs)
        else:
            result = await in_thread(self.fn, kwargs, name=self.spec.name)
            if inspect.isawaitable(result):
                result = await result
        try:
            if self.result_adapter is not None:
                # No warnings: a result of the wrong shape is reported by the output check.
                return self.result_adapter.dump_python(result, mode="json", warnings=False)
            if isinstance(result, pydantic.BaseModel):
                return result.model_dump(mode="json")
        except pydantic_core.PydanticSerializationError as exc:
            raise ToolError(f"{self.spec.name} returned a value that is not JSON: {exc}",
                            error_type="result_not_serializable") from exc
        return result


_signatures: dict[ToolFn, inspect.Signature] = {}


def _signature(fn: ToolFn) -> inspect.Signature:
    sig = _signatures.get(fn)
    if sig is None:
        sig = _signatures[fn] = inspect.signature(fn)
    return sig


_PLAIN = (str, int, float, bool, type(None), dict, list, Any)


def _is_plain(tp: Any) -> bool:
    """True when a JSON value that passed the schema can be handed over unchanged."""
    if tp in _PLAIN or tp is inspect.Parameter.empty:
        return True
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return _is_plain(typing.get_args(tp)[0])
    if origin is Literal:
        return True
    if origin in (typing.Union, types.UnionType, list, dict):
        return all(_is_plain(a) for a in typing.get_args(tp))
    return False


_ARGS_SECTION = re.compile(r"^\s*(Args|Arguments|Parameters):\s*$", re.MULTILINE)
_ARG_LINE = re.compile(r"^\s+(\w+)\s*(?:\([^)]*\))?:\s*(.+)$")


def _split_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(description, {param: description}) from a Google-style docstring."""
    m = _ARGS_SECTION.search(doc)
    if not m:
        return doc.strip(), {}
    head, rest = doc[:m.start()].strip(), doc[m.end():]
    params: dict[str, str] = {}
    current: str | None = None
    for line in rest.splitlines():
        if line.strip() and not line.startswith((" ", "\t")):
            break  # the next section (Returns:, Raises:) starts at the margin
        am = _ARG_LINE.match(line)
        indent = len(line) - len(line.lstrip())
        if am and (current is None or indent <= _indent_of(rest, current)):
            current = am.group(1)
            params[current] = am.group(2).strip()
        elif current and line.strip():
            params[current] += " " + line.strip()
    return head, params


def _indent_of(text: str, name: str) -> int:
    for line in text.splitlines():
        if line.strip().startswith(f"{name}:") or line.strip().startswith(f"{name} ("):
            return len(line) - len(line.lstrip())
    return 0


def _strip_titles(schema: Any, top: bool = True) -> Any:
    """pydantic titles every property ("Item", "Qty"): noise in an LLM's prompt."""
    if isinstance(schema, dict):
        out = {}
        for k, v in schema.items():
            if k == "title" and isinstance(v, str) and not top:
                continue
            if k == "properties" and isinstance(v, dict):
                out[k] = {pk: _strip_titles(pv, False) for pk, pv in v.items()}
            else:
                out[k] = _strip_titles(v, False)
        return out
    if isinstance(schema, list):
        return [_strip_titles(x, False) for x in schema]
    return schema


def _build(fn: ToolFn, name: str) -> tuple[dict[str, Any], dict[str, Resource],
                                           type[pydantic.BaseModel] | None, str]:
    try:
        hints = get_type_hints(fn, include_extras=True)
    except Exception as exc:
        raise ConfigError(f"{name}: cannot resolve the type hints of {fn.__qualname__}: "
                          f"{exc}") from exc
    description, arg_docs = _split_docstring(inspect.getdoc(fn) or "")
    fields: dict[str, Any] = {}
    injected: dict[str, Resource] = {}
    plain = True
    for pname, param in _signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if isinstance(param.default, _Uses):
            injected[pname] = param.default.resource
            continue
        if pname.startswith("_"):
            raise ConfigError(f"{name}: parameter {pname} starts with '_', which marks "
                              "meta-fields in a tool schema; rename it")
        tp = hints.get(pname, Any)
        plain = plain and _is_plain(tp)
        default = ... if param.default is inspect.Parameter.empty else param.default
        if pname in arg_docs:
            fields[pname] = (tp, pydantic.Field(default, description=arg_docs[pname]))
        else:
            fields[pname] = (tp, default)
    try:
        model = pydantic.create_model(f"{name}:arguments", **fields)
        schema = model.model_json_schema()
    except (pydantic.PydanticUserError, pydantic.PydanticSchemaGenerationError,
            TypeError) as exc:
        raise ConfigError(f"{name}: cannot make a JSON Schema of its parameters: {exc}") from exc
    schema = _strip_titles(schema)
    schema.pop("title", None)
    schema.setdefault("properties", {})
    schema["additionalProperties"] = False
    return schema, injected, (None if plain else model), description


def _output_schema(fn: ToolFn, name: str) -> tuple[dict[str, Any] | None,
                                                     pydantic.TypeAdapter[Any] | None]:
    ret = get_type_hints(fn, include_extras=True).get("return", Any)
    if ret is Any or ret is type(None) or ret is None:
        return None, None
    try:
        adapter: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ret)
        schema = _strip_titles(adapter.json_schema(mode="serialization"))
    except (pydantic.PydanticUserError, pydantic.PydanticSchemaGenerationError,
            TypeError) as exc:
        raise ConfigError(f"{name}: cannot make a JSON Schema of its result: {exc}") from exc
    return schema, (None if _is_plain(ret) else adapter)


def tool(
    name: str,
    *,
    description: str | None = None,
    title: str | None = None,
    read_only: bool = False,
    destructive: bool | None = None,
    idempotent: bool = False,
    open_world: bool = True,
    risk_level: RiskLevel | None = None,
    timeout_ms: int = DEFAULT_TIMEOUT_MS,
    requires_approval: bool = False,
    auto_approve: bool = False,
    parameters: dict[str, Any] | None = None,
    output: dict[str, Any] | None = None,
    pool: str | None = None,
    source: str | None = None,
) -> Callable[[ToolFn], LocalTool]:
    """Make a function a tool. `destructive` defaults to `not read_only`; `risk_level` to
    low for read-only tools, medium otherwise. `auto_approve` lets a mutating tool run
    without a human's approval (read-only tools never need one). `parameters` / `output`
    replace the generated schemas when given."""
    try:
        split_tool_name(name)
    except ToolbusError as exc:
        raise ConfigError(str(exc)) from exc
    if risk_level is not None and risk_level not in RISK_LEVELS:
        raise ConfigError(f"{name}: risk_level must be one of low, medium, high")
    if timeout_ms <= 0:
        raise ConfigError(f"{name}: timeout_ms must be positive")

    def wrap(fn: ToolFn) -> LocalTool:
        gen_params, injected, args_model, doc = _build(fn, name)
        gen_output, adapter = _output_schema(fn, name)
        spec = ToolSpec(
            name=name,
            title=title,
            description=description if description is not None else doc,
            parameters=parameters if parameters is not None else gen_params,
            output=output if output is not None else gen_output,
            annotations=Annotations(
                readOnlyHint=read_only,
                destructiveHint=(not read_only) if destructive is None else destructive,
                idempotentHint=idempotent,
                openWorldHint=open_world,
            ),
            risk_level=risk_level or ("low" if read_only else "medium"),
            timeout_ms=timeout_ms,
            requires_approval=requires_approval,
            auto_approve=auto_approve,
            source=source or f"python:{fn.__module__}",
            pools=[pool or DEFAULT_POOL],
        )
        return LocalTool(spec=spec, fn=fn, injected=injected, args_model=args_model,
                         result_adapter=adapter)

    return wrap


def with_pool(t: RunnableTool, pool: str) -> RunnableTool:
    if isinstance(t, LocalTool):
        return LocalTool(msgspec.structs.replace(t.spec, pools=[pool]), t.fn, t.injected,
                         t.args_model, t.result_adapter)
    return t  # remote tools carry their pool already


def load_tools(target: str) -> list[LocalTool]:
    """Import a module (dotted name or .py path) and collect its tools."""
    source: str | None = None
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
            source = f"python:{_dotted_name(path) or path.name}"
        else:
            module = importlib.import_module(target)
    except ImportError as exc:
        raise ConfigError(f"--tools {target}: cannot import it: {exc}") from exc
    except ConfigError:
        raise
    except SystemExit as exc:  # its own command line, parsed at import: not toolbus's exit
        raise ConfigError(f"--tools {target}: it called sys.exit({exc.code!r}) while it was "
                          "imported") from None
    except Exception as exc:  # the module's own code failed while it was imported
        where = ""
        tb = exc.__traceback__
        while tb is not None:  # the deepest line of the module's own file
            if tb.tb_frame.f_code.co_filename == str(Path(target).resolve()) or \
                    tb.tb_frame.f_globals.get("__name__") == target:
                where = f" (line {tb.tb_lineno})"
            tb = tb.tb_next
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ConfigError(f"--tools {target}: importing it failed{where}: "
                          f"{type(exc).__name__}: {first}".rstrip(": ")) from exc
    found: list[LocalTool] = [v for v in vars(module).values() if isinstance(v, LocalTool)]
    for item in getattr(module, "TOOLS", []):
        if isinstance(item, LocalTool) and item not in found:
            found.append(item)
    if not found:
        raise ConfigError(
            f"--tools {target}: the module defines no tools; decorate functions with "
            "@actors.tools.tool(...)"
        )
    if source is not None:
        found = [LocalTool(msgspec.structs.replace(t.spec, source=source), t.fn, t.injected,
                           t.args_model, t.result_adapter) for t in found]
    return found


def _dotted_name(path: Path) -> str | None:
    """The module name a .py file has when imported from sys.path, so a module loaded by
    path and by name is one source in the catalog."""
    for entry in sys.path:
        base = Path(entry or ".").resolve()
        try:
            rel = path.with_suffix("").relative_to(base)
        except ValueError:
            continue
        if all(part.isidentifier() for part in rel.parts):
            return ".".join(rel.parts)
    return None


def index_tools(tools: Iterable[RunnableTool]) -> dict[str, RunnableTool]:
    out: dict[str, RunnableTool] = {}
    for t in tools:
        if t.spec.name in out and out[t.spec.name] is not t:
            raise ConfigError(f"tool {t.spec.name} is defined twice")
        out[t.spec.name] = t
    return out


__all__ = ["LocalTool", "Resource", "ResourceScope", "ToolError", "index_tools", "load_tools",
           "resource", "tool", "uses", "with_pool"]
