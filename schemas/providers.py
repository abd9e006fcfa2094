"""The catalog in the formats LLM providers take, and names that survive the round trip.

Provider name rules (the strictest documented form of each):

| format    | tool name pattern                 | how `ns:tool` is written          |
|-----------|-----------------------------------|-----------------------------------|
| openai    | `^[a-zA-Z0-9_-]{1,64}$`           | `ns__tool`                        |
| anthropic | `^[a-zA-Z0-9_-]{1,64}$`           | `ns__tool`                        |
| gemini    | `^[a-zA-Z_][a-zA-Z0-9_-]{0,62}$`  | `ns__tool`                        |
| mcp       | `^[A-Za-z0-9_.-]{1,128}$`         | `ns.tool` (always reversible)     |

`ns__tool` is decoded by splitting at the first `__`, which is exact whenever the namespace
neither contains `__` nor ends with `_`. A name for which that fails, or that is too long,
or (Gemini) starts with a digit or `-`, is written `t<hash>_<readable prefix>` instead;
`ProviderNames`, built from the same catalog, maps it back. So: encode with a
`ProviderNames`, decode the model's answer with the same one.
"""

from __future__ import annotations

import copy
import hashlib
import re
from collections.abc import Iterable
from typing import Any, Final, Literal

from schemas.errors import ConfigError
from schemas.ids import split_tool_name
from schemas.tools import Annotations, ToolSpec

Format = Literal["openai", "anthropic", "gemini", "mcp"]
FORMATS: Final = ("openai", "anthropic", "gemini", "mcp")

NAME_PATTERNS: Final[dict[str, re.Pattern[str]]] = {
    "openai": re.compile(r"^[a-zA-Z0-9_-]{1,64}$"),
    "anthropic": re.compile(r"^[a-zA-Z0-9_-]{1,64}$"),
    "gemini": re.compile(r"^[a-zA-Z_][a-zA-Z0-9_-]{0,62}$"),
    "mcp": re.compile(r"^[A-Za-z0-9_.-]{1,128}$"),
}
_MAX_LEN: Final = {"openai": 64, "anthropic": 64, "gemini": 63, "mcp": 128}

# Gemini's Schema object is an OpenAPI 3.0 subset: every other key is refused.
GEMINI_SCHEMA_KEYS: Final = frozenset({
    "type", "format", "title", "description", "nullable", "enum", "maxItems", "minItems",
    "properties", "required", "minProperties", "maxProperties", "minLength", "maxLength",
    "pattern", "example", "anyOf", "propertyOrdering", "default", "items", "minimum",
    "maximum",
})


def _simple(name: str, fmt: str) -> str:
    ns, tool = split_tool_name(name)
    return f"{ns}.{tool}" if fmt == "mcp" else f"{ns}__{tool}"


def _simple_decodes(name: str, fmt: str) -> bool:
    ns, _ = split_tool_name(name)
    if fmt == "mcp":
        return True
    return "__" not in ns and not ns.endswith("_")


def _hashed(name: str, fmt: str) -> str:
    digest = hashlib.blake2b(name.encode(), digest_size=5).hexdigest()
    readable = re.sub(r"[^A-Za-z0-9_-]", "_", name.replace(":", "__"))
    return f"t{digest}_{readable}"[:_MAX_LEN[fmt]]


def provider_name(name: str, fmt: str) -> str:
    """The provider-safe name of `ns:tool` (deterministic)."""
    simple = _simple(name, fmt)
    if _simple_decodes(name, fmt) and NAME_PATTERNS[fmt].fullmatch(simple):
        return simple
    return _hashed(name, fmt)


def decode_simple(pname: str, fmt: str) -> str | None:
    """`ns:tool` from a simple provider name, without a table; None if it is not one."""
    sep = "." if fmt == "mcp" else "__"
    if sep not in pname:
        return None
    ns, tool = pname.split(sep, 1)
    name = f"{ns}:{tool}"
    try:
        split_tool_name(name)
    except ValueError:
        return None
    return name if provider_name(name, fmt) == pname else None


class ProviderNames:
    """The two-way map between catalog names and one provider's names."""

    def __init__(self, names: Iterable[str], fmt: str) -> None:
        if fmt not in FORMATS:
            raise ConfigError(f"unknown format {fmt!r}: choose from {', '.join(FORMATS)}")
        self.fmt = fmt
        self._to: dict[str, str] = {}
        self._from: dict[str, str] = {}
        for name in names:
            pname = provider_name(name, fmt)
            other = self._from.get(pname)
            if other is not None and other != name:
                raise ConfigError(f"{name} and {other} map to the same {fmt} name {pname}")
            self._to[name] = pname
            self._from[pname] = name

    def encode(self, name: str) -> str:
        return self._to.get(name) or provider_name(name, self.fmt)

    def decode(self, pname: str) -> str:
        name = self._from.get(pname) or decode_simple(pname, self.fmt)
        if name is None:
            raise ConfigError(f"{pname!r} is not a {self.fmt} tool name of this catalog")
        return name


# --- schema conversion -------------------------------------------------------------------


def inline_refs(schema: dict[str, Any]) -> dict[str, Any]:
    """Replace local `#/$defs/X` references by their definitions (recursive ones are cut
    to `{}` after one level: providers without $ref support cannot express them)."""
    defs = schema.get("$defs") or schema.get("definitions") or {}

    def walk(node: Any, seen: tuple[str, ...]) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith(("#/$defs/", "#/definitions/")):
                key = ref.rsplit("/", 1)[1]
                if key in seen or key not in defs:
                    return {}
                merged = {**defs[key], **{k: v for k, v in node.items() if k != "$ref"}}
                return walk(merged, (*seen, key))
            return {k: walk(v, seen) for k, v in node.items() if k not in ("$defs",
                                                                            "definitions")}
        if isinstance(node, list):
            return [walk(x, seen) for x in node]
        return node

    out = walk(schema, ())
    assert isinstance(out, dict)
    return out


def to_gemini_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """JSON Schema -> Gemini's OpenAPI 3.0 subset."""

    def conv(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        out: dict[str, Any] = {}
        t = node.get("type")
        if isinstance(t, list):
            kinds = [k for k in t if k != "null"]
            if "null" in t:
                out["nullable"] = True
            if len(kinds) == 1:
                out["type"] = kinds[0]
            elif kinds:
                out["anyOf"] = [{"type": k} for k in kinds]
        elif isinstance(t, str):
            out["type"] = t
        if "const" in node:
            out["enum"] = [node["const"]]
        for key, value in node.items():
            if key in ("type", "const") or key not in GEMINI_SCHEMA_KEYS:
                continue
            if key == "properties":
                out[key] = {k: conv(v) for k, v in value.items()}
            elif key == "items":
                out[key] = conv(value)
            elif key == "anyOf":
                alts = [conv(v) for v in value]
                nulls = [a for a in alts if a.get("type") == "null"]
                alts = [a for a in alts if a.get("type") != "null"]
                if nulls:
                    out["nullable"] = True
                if len(alts) == 1:
                    out.update(alts[0])
                else:
                    out["anyOf"] = alts
            elif key == "enum":
                out[key] = [v for v in value if v is not None]
            else:
                out[key] = value
        if out.get("type") == "null":
            out.pop("type")
            out["nullable"] = True
        return out

    result = conv(inline_refs(schema))
    assert isinstance(result, dict)
    return result


def _params(spec: ToolSpec) -> dict[str, Any]:
    schema = inline_refs(copy.deepcopy(spec.parameters))
    schema.setdefault("type", "object")
    schema.setdefault("properties", {})
    return schema


def export(specs: Iterable[ToolSpec], fmt: str) -> tuple[Any, ProviderNames]:
    """The catalog in one provider's format, with the name map to decode its calls."""
    specs = list(specs)
    names = ProviderNames((s.name for s in specs), fmt)
    if fmt == "openai":
        return [{"type": "function", "function": {
            "name": names.encode(s.name), "description": s.description,
            "parameters": _params(s)}} for s in specs], names
    if fmt == "anthropic":
        return [{"name": names.encode(s.name), "description": s.description,
                 "input_schema": _params(s)} for s in specs], names
    if fmt == "gemini":
        decls = []
        for s in specs:
            d: dict[str, Any] = {"name": names.encode(s.name), "description": s.description}
            params = to_gemini_schema(s.parameters)
            if params.get("properties"):
                d["parameters"] = params
            decls.append(d)
        return [{"functionDeclarations": decls}], names
    # MCP `tools/list` result (one page: the catalog is small enough to send whole).
    tools = []
    for s in specs:
        entry: dict[str, Any] = {"name": names.encode(s.name)}
        if s.title:
            entry["title"] = s.title
        entry["description"] = s.description
        entry["inputSchema"] = _params(s)
        if s.output is not None and s.output.get("type") == "object":
            entry["outputSchema"] = s.output  # MCP requires an object schema here
        entry["annotations"] = {f: getattr(s.annotations, f)
                                for f in Annotations.__struct_fields__}
        if s.title:
            entry["annotations"]["title"] = s.title
        tools.append(entry)
    return {"tools": tools}, names


# --- the composed schema of seed 001 -------------------------------------------------------


def compose_schema(specs: Iterable[ToolSpec], output: dict[str, Any] | None) -> dict[str, Any]:
    """One schema for an LLM answer: `{"output": <output or null>, "calls": [...]}`, where
    each call is `{"_tool": name, "_reasoningForCall": why, ...arguments}`. The answer can
    be sent to toolbus as is: a request's calls may be written in this flat form."""
    variants = []
    for s in specs:
        params = _params(s)
        props = {"_tool": {"const": s.name},
                 "_reasoningForCall": {"type": "string",
                                       "description": "why this call, in one sentence"},
                 **params.get("properties", {})}
        variants.append({
            "type": "object",
            "description": s.description,
            "properties": props,
            "required": ["_tool", *params.get("required", [])],
            # Closed unless the tool says otherwise (`built-in:echo` takes any argument).
            "additionalProperties": params.get("additionalProperties", False),
        })
    out_schema: dict[str, Any] = {"type": "null"}
    if output is not None:
        out_schema = copy.deepcopy(output)
        t = out_schema.get("type", "object")
        out_schema["type"] = [*([t] if isinstance(t, str) else t), "null"]
        if "object" in out_schema["type"]:
            out_schema.setdefault("additionalProperties", False)
    return {
        "type": "object",
        "properties": {
            "output": out_schema,
            # No tool to call: no call at all (`items: {}` would take anything, and a
            # model's `{"_tool": 5}` would be read as a call).
            "calls": {"type": "array", "items": {"anyOf": variants}} if variants else
                     {"type": "array", "items": {"type": "null"}, "maxItems": 0},
        },
        "required": ["calls", "output"],
        "additionalProperties": False,
    }


__all__ = ["FORMATS", "NAME_PATTERNS", "ProviderNames", "compose_schema",
           "export", "inline_refs", "provider_name", "to_gemini_schema"]
