"""The tool model: one spec per `namespace:tool`, as stored in the `toolbus_catalog` bucket.

A spec is the JSON Schema object of seed 001 plus the execution policy of seeds 003/004.
In its JSON Schema form (`to_tool_schema` / `from_tool_schema`) the non-underscore keys
are the parameters' schema and the underscore keys are meta-fields:

    {"_tool": "tickets:create_ticket", "type": "object", "description": "...",
     "properties": {...}, "required": [...], "_output": {...},
     "_annotations": {"readOnlyHint": false, ...}, "_risk_level": "medium",
     "_timeout_ms": 10000, "_requires_approval": true}

`_tool` and `_output` may also be given the way seed 001 writes them, as properties
(`"_tool": {"const": "name"}`).
"""

from __future__ import annotations

from typing import Any, Final, Literal

import msgspec

from schemas.errors import ConfigError, InvalidIdError
from schemas.ids import check_namespace, split_tool_name

DEFAULT_TIMEOUT_MS: Final = 30_000
DEFAULT_POOL: Final = "default"
RISK_LEVELS: Final = ("low", "medium", "high")

RiskLevel = Literal["low", "medium", "high"]


class Annotations(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """MCP tool annotations, spelled as MCP spells them. Defaults are MCP's: a tool that
    says nothing is assumed to write, destructively, to the open world."""

    readOnlyHint: bool = False
    destructiveHint: bool = True
    idempotentHint: bool = False
    openWorldHint: bool = True


class ToolSpec(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    description: str = ""
    parameters: dict[str, Any] = msgspec.field(
        default_factory=lambda: {"type": "object", "properties": {}}
    )
    output: dict[str, Any] | None = None
    annotations: Annotations = Annotations()
    risk_level: RiskLevel = "low"
    timeout_ms: int = DEFAULT_TIMEOUT_MS
    requires_approval: bool = False
    # Who provides the tool: `built-in`, `python:<module>`, `http:<manifest>`, `mcp:<server>`.
    # Two different sources may never register the same name.
    source: str = "local"
    # The executor pools that run it. Calls go to `default` (or the only pool) unless
    # they name another with `_delegate`.
    pools: list[str] = msgspec.field(default_factory=lambda: [DEFAULT_POOL])
    title: str | None = None
    # A mutating tool whose config says it may run without a human (seed 002).
    auto_approve: bool = False
    # False for an MCP server declared untrusted: its annotations are not believed.
    trusted: bool = True
    # False when the source gave no annotations at all (the defaults above are MCP's).
    annotated: bool = True

    @property
    def namespace(self) -> str:
        return self.name.split(":", 1)[0]

    @property
    def rerunnable(self) -> bool:
        """Safe to run again after an interruption: read-only or idempotent."""
        return self.annotations.readOnlyHint or self.annotations.idempotentHint

    @property
    def default_pool(self) -> str:
        return DEFAULT_POOL if DEFAULT_POOL in self.pools or not self.pools else self.pools[0]

    def route(self, pool: str | None = None) -> str:
        """The subject suffix of `call.dispatched` that the right executors consume."""
        return pool_route(pool or self.default_pool, self.namespace)


def pool_route(pool: str, namespace: str) -> str:
    return f"{pool}.{namespace}"


def instance_route(instance: str, namespace: str) -> str:
    # Three tokens, so no pool route (two tokens) can ever match it.
    return f"instance.{instance}.{namespace}"


class ExecutorInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A live executor instance, as announced in `toolbus_executors` (refreshed while it
    runs, gone some seconds after it stops)."""

    instance: str
    pool: str
    tools: list[str]
    host: str = ""
    pid: int = 0
    started_at: float = 0.0


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(ToolSpec)


def encode_spec(spec: ToolSpec) -> bytes:
    return _encoder.encode(spec)


def decode_spec(data: bytes) -> ToolSpec:
    return _decoder.decode(data)


# --- the JSON Schema form ----------------------------------------------------------------


def to_tool_schema(spec: ToolSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"_tool": spec.name}
    if spec.title:
        out["title"] = spec.title
    out["description"] = spec.description
    out.update(spec.parameters)
    if spec.output is not None:
        out["_output"] = spec.output
    out["_annotations"] = {f: getattr(spec.annotations, f) for f in Annotations.__struct_fields__}
    out["_risk_level"] = spec.risk_level
    out["_timeout_ms"] = spec.timeout_ms
    out["_requires_approval"] = spec.requires_approval
    out["_auto_approve"] = spec.auto_approve
    out["_source"] = spec.source
    out["_pools"] = list(spec.pools)
    return out


def from_tool_schema(obj: Any, *, source: str = "local") -> ToolSpec:
    """Build a spec from its JSON Schema form, naming the key that is wrong."""
    if not isinstance(obj, dict):
        raise ConfigError(f"a tool schema must be a JSON object, got {type(obj).__name__}")
    body = dict(obj)
    props = dict(body.get("properties") or {})
    if not isinstance(body.get("properties", {}), dict):
        raise ConfigError("properties must be an object")
    name = body.pop("_tool", None)
    if name is None and isinstance(props.get("_tool"), dict):
        name = props.pop("_tool").get("const")
    try:
        split_tool_name(name)
    except InvalidIdError as exc:
        raise ConfigError(f"_tool: {exc}") from exc
    assert isinstance(name, str)
    output = body.pop("_output", None)
    if output is None and "_output" in props:
        output = props.pop("_output")
    if output is not None and not isinstance(output, dict):
        raise ConfigError(f"{name}: _output must be a JSON Schema object")
    ann = body.pop("_annotations", {}) or {}
    # Annotations may also sit at the top level, MCP-style.
    for key in Annotations.__struct_fields__:
        if key in body:
            ann[key] = body.pop(key)
    try:
        annotations = msgspec.convert(ann, Annotations)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{name}: _annotations: {exc}") from exc
    risk = body.pop("_risk_level", "low")
    if risk not in RISK_LEVELS:
        raise ConfigError(f"{name}: _risk_level must be one of low, medium, high; got {risk!r}")
    timeout_ms = body.pop("_timeout_ms", DEFAULT_TIMEOUT_MS)
    if not isinstance(timeout_ms, int) or isinstance(timeout_ms, bool) or timeout_ms <= 0:
        raise ConfigError(f"{name}: _timeout_ms must be a positive integer, got {timeout_ms!r}")
    approval = body.pop("_requires_approval", False)
    auto = body.pop("_auto_approve", False)
    if not isinstance(approval, bool) or not isinstance(auto, bool):
        raise ConfigError(f"{name}: _requires_approval and _auto_approve are true or false")
    source = body.pop("_source", source)
    pools = body.pop("_pools", [DEFAULT_POOL])
    try:
        pools = [check_namespace(p) for p in pools]
    except (InvalidIdError, TypeError) as exc:
        raise ConfigError(f"{name}: _pools: {exc}") from exc
    unknown = sorted(k for k in body if k.startswith("_"))
    if unknown:
        raise ConfigError(f"{name}: unknown meta-field(s) {', '.join(unknown)}")
    title = body.pop("title", None)
    description = body.pop("description", "")
    body["properties"] = props
    body.setdefault("type", "object")
    if "required" in body:
        body["required"] = [r for r in body["required"] if not str(r).startswith("_")]
    return ToolSpec(name=name, title=title, description=description, parameters=body,
                    output=output, annotations=annotations, risk_level=risk,
                    timeout_ms=timeout_ms, requires_approval=approval, source=source,
                    pools=pools, auto_approve=auto)
