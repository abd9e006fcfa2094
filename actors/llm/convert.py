"""Conversions the four API modules share: tool names both ways, arguments, results,
system text, schema strictness."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import msgspec

from actors.llm.types import Message, ToolCall
from schemas.errors import ConfigError
from schemas.providers import ProviderNames


class Names:
    """The catalog's two-way name map for one format, tolerant both ways: a name that is
    not a toolbus name (a call the model invented, replayed from history) goes out as it
    is, and a provider name outside the catalog comes back raw, for the planner to
    reject clearly."""

    def __init__(self, names: ProviderNames) -> None:
        self._names = names

    def out(self, name: str) -> str:
        try:
            return self._names.encode(name)
        except ValueError:  # InvalidIdError: not `ns:tool`
            return name

    def back(self, pname: str) -> str:
        try:
            return self._names.decode(pname)
        except ConfigError:
            return pname


def parse_arguments(raw: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(arguments, extra) from a JSON string or an object. Arguments that are not a JSON
    object are kept verbatim in `extra["invalid_arguments"]`, so the planner can say what
    was wrong and the next request can echo exactly what the model sent."""
    value: Any = raw
    if isinstance(raw, str | bytes):
        if not raw.strip():
            return {}, {}
        try:
            value = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            return {}, {"invalid_arguments": raw if isinstance(raw, str) else raw.decode()}
    if value is None:
        return {}, {}
    if isinstance(value, dict):
        return value, {}
    return {}, {"invalid_arguments": msgspec.json.encode(value).decode()}


def arguments_json(call: ToolCall) -> str:
    invalid = call.extra.get("invalid_arguments")
    return invalid if isinstance(invalid, str) else msgspec.json.encode(call.arguments).decode()


def result_value(text: str) -> Any:
    """A tool result's text as JSON if it is JSON, else the text."""
    try:
        return msgspec.json.decode(text)
    except msgspec.DecodeError:
        return text


def system_text(system: str | None, messages: Iterable[Message]) -> str | None:
    """The system prompt plus every system-role message, for the APIs that take one."""
    parts = [system] if system else []
    parts += [m.text for m in messages if m.role == "system" and m.text]
    return "\n\n".join(parts) or None


def call_names(messages: Iterable[Message]) -> dict[str, str]:
    """Tool call id -> tool name, from the assistant messages (for results without one)."""
    return {c.id: c.name for m in messages for c in m.tool_calls}


def stable_id(prefix: str, *parts: object) -> str:
    """A deterministic id for a call the provider gave none (replay gives the same)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).hexdigest()
    return f"{prefix}_{digest}"


def strict_compatible(schema: Any) -> bool:
    """Whether OpenAI's strict mode accepts `schema`: every object closed
    (`additionalProperties: false`) with all its properties required."""
    if isinstance(schema, list):
        return all(strict_compatible(s) for s in schema)
    if not isinstance(schema, dict):
        return True
    kind = schema.get("type")
    is_object = kind == "object" or (isinstance(kind, list) and "object" in kind) or (
        "properties" in schema)
    if is_object:
        props = schema.get("properties", {})
        if schema.get("additionalProperties") is not False:
            return False
        if set(schema.get("required", [])) != set(props):
            return False
    return all(strict_compatible(v) for k, v in schema.items()
               if k not in ("enum", "const", "default", "examples", "description", "title"))


def base_url(configured: str | None, default: str) -> str:
    return (configured or default).rstrip("/")
