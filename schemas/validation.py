"""Argument and result validation against a tool's JSON Schema.

Compiled with jsonschema-rs (Rust): a valid 10-field call costs well under a microsecond to
check (`toolbus bench validation` measures it against fastjsonschema, the runner-up at
about 4x the cost, which also stops at the first error). Validity is checked first; only
a call that fails pays for the full list of violations, each with its JSON path, so an LLM
can fix every mistake in one retry.

Defaults are filled in by a small walker compiled from the schema (jsonschema-rs only
validates): for every object whose `properties` declare a `default`, a missing key gets a
copy of it. Nested objects are reached through `properties`, not through combinators.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import jsonschema_rs

from schemas.errors import ConfigError
from schemas.tools import ToolSpec

MAX_VIOLATIONS: Final = 20

_Filler = Callable[[dict[str, Any]], None]


@dataclass(frozen=True, slots=True)
class Violation:
    path: str  # JSON Pointer-ish, "$" for the root: "$.items[2].name"
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


def json_path(parts: list[str | int]) -> str:
    out = "$"
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else f".{p}"
    return out


class Validator:
    """A compiled schema. `check` returns the arguments with defaults filled in, or the
    list of violations; it never raises on bad input."""

    __slots__ = ("_fill", "_rs", "schema")

    def __init__(self, schema: dict[str, Any]) -> None:
        try:
            # Offline: a `$ref` to anything outside the schema (http://, file://) is an
            # error, never fetched. Schemas come from clients, MCP servers and model-facing
            # manifests: fetching would let any of them make toolbus read local files or
            # reach hosts on its network, and stall whoever compiles the schema.
            self._rs = jsonschema_rs.validator_for(schema, validate_formats=True,
                                                   offline=True)
        except (jsonschema_rs.ValidationError, ValueError, TypeError) as exc:
            # Its first line: the rest repeats the schema and the instance.
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else \
                type(exc).__name__
            raise ConfigError(f"invalid JSON Schema: {first}") from exc
        self.schema = schema
        self._fill = _compile_filler(schema)

    def violations(self, value: Any) -> list[Violation]:
        try:
            if self._rs.is_valid(value):
                return []
            out = []
            for err in self._rs.iter_errors(value):
                out.append(Violation(json_path(list(err.instance_path)), err.message))
                if len(out) >= MAX_VIOLATIONS:
                    break
            return out
        except (ValueError, RecursionError) as exc:
            # jsonschema-rs gives up on a value nested too deeply ("Recursion limit
            # reached"): a model's arguments can be; that is a violation, not a crash.
            why = " (nested too deeply)" if isinstance(exc, RecursionError) or \
                "recursion" in str(exc).lower() else ""
            return [Violation("$", f"the value cannot be checked: {exc}{why}")]

    def check(self, arguments: dict[str, Any]) -> tuple[dict[str, Any], list[Violation]]:
        if self._fill is not None:
            arguments = copy.copy(arguments)  # never mutate the caller's (stored) dict
            self._fill(arguments)
        return arguments, self.violations(arguments)


def describe(violations: list[Violation], what: str) -> str:
    """One message listing every violation, for `call.rejected` / `call.failed`."""
    lines = "; ".join(str(v) for v in violations)
    more = " (first 20 shown)" if len(violations) >= MAX_VIOLATIONS else ""
    n = len(violations)
    return f"{what}: {n} violation{'s' if n != 1 else ''}{more}: {lines}"


def _compile_filler(schema: dict[str, Any]) -> _Filler | None:
    props = schema.get("properties")
    if not isinstance(props, dict):
        return None
    defaults: list[tuple[str, Any]] = []
    nested: list[tuple[str, _Filler]] = []
    for key, sub in props.items():
        if not isinstance(sub, dict):
            continue
        if "default" in sub:
            defaults.append((key, sub["default"]))
        inner = _compile_filler(sub)
        if inner is not None:
            nested.append((key, inner))
    if not defaults and not nested:
        return None

    def fill(obj: dict[str, Any]) -> None:
        for key, value in defaults:
            if key not in obj:
                # Mutable defaults are copied so one call can never change another's.
                obj[key] = copy.deepcopy(value) if isinstance(value, dict | list) else value
        for key, inner in nested:
            child = obj.get(key)
            if isinstance(child, dict):
                child = obj[key] = dict(child)
                inner(child)

    return fill


class CompiledTool:
    """A catalog spec with its compiled validators, built once per spec version."""

    __slots__ = ("args", "error", "output", "spec")

    def __init__(self, spec: ToolSpec) -> None:
        self.spec = spec
        self.error: str | None = None
        self.args: Validator | None = None
        self.output: Validator | None = None
        try:
            self.args = Validator(spec.parameters)
            if spec.output is not None:
                self.output = Validator(spec.output)
        except ConfigError as exc:
            self.error = f"{spec.name} has a schema toolbus cannot use: {exc}"


class CompiledTools:
    """`lookup(name)` plus a cache of compiled validators, recompiled when a spec changes."""

    def __init__(self, lookup: Callable[[str], ToolSpec | None]) -> None:
        self._lookup = lookup
        self._cache: dict[str, CompiledTool] = {}

    def get(self, name: str) -> CompiledTool | None:
        spec = self._lookup(name)
        if spec is None:
            return None
        hit = self._cache.get(name)
        if hit is None or hit.spec is not spec:
            hit = self._cache[name] = CompiledTool(spec)
        return hit
