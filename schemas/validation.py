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

import contextlib
import copy
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import unquote, urldefrag, urljoin

import jsonschema_rs
import msgspec

from schemas.defaults import MAX_JSON_DEPTH
from schemas.errors import ConfigError
from schemas.tools import ToolSpec

MAX_VIOLATIONS: Final = 20
# Subschemas applied at one place of a value, at most (see `_costly`).
MAX_SCHEMA_APPLICATIONS: Final = 10_000

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
        costly = _costly(schema)
        if costly is not None:
            raise ConfigError(f"JSON Schema {costly}")
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


def validator_for(schema: dict[str, Any]) -> Validator:
    """`Validator(schema)`, compiled once per distinct schema (the last 256 kept): the
    planner's match, think and composed schemas and a latent tool's output come back at
    every model call, and compiling one (and weighing its cost) takes milliseconds."""
    return _compiled(msgspec.json.encode(schema))


@functools.lru_cache(maxsize=256)
def _compiled(encoded: bytes) -> Validator:
    return Validator(msgspec.json.decode(encoded))


def describe(violations: list[Violation], what: str) -> str:
    """One message listing every violation, for `call.rejected` / `call.failed`."""
    lines = "; ".join(str(v) for v in violations)
    more = " (first 20 shown)" if len(violations) >= MAX_VIOLATIONS else ""
    n = len(violations)
    return f"{what}: {n} violation{'s' if n != 1 else ''}{more}: {lines}"


# --- the cost of a schema ------------------------------------------------------------------
#
# jsonschema-rs walks every path through a schema, and `$ref` lets one subschema be reached
# along many: two branches of an `anyOf` that name the same definition, one level after
# another, double the checks (and the error lists it builds) with each level, and a schema
# of 2 KB takes longer than anyone waits, growing by gigabytes. So before a schema is used,
# the subschemas applied at each place of a value are counted, place by place down to the
# deepest value toolbus decodes, and a schema that would apply more than
# MAX_SCHEMA_APPLICATIONS at one place is refused. Places are told apart as a value tells
# them apart (a property's name, an item's index), so recursive schemas (trees, lists of
# nodes) count one application per place and stay usable. What one subschema applies in
# place and enters below is worked out once (`_Below`), so a large definition named from
# many places costs the count once; the count has a budget of steps that grows with the
# schema, and a schema that spends it is refused too: counting the worst of a request's
# 128 KiB takes about a tenth of a second.

_IN_PLACE: Final = ("not", "if", "then", "else", "$ref", "$dynamicRef", "$recursiveRef")
_IN_PLACE_LISTS: Final = ("allOf", "anyOf", "oneOf")
_IN_PLACE_MAPS: Final = ("dependentSchemas", "dependencies")
_ANY_KEY: Final = ("additionalProperties", "unevaluatedProperties")
_ANY_ITEM: Final = ("contains", "unevaluatedItems")
_META_SCHEMAS: Final = ("https://json-schema.org/", "http://json-schema.org/")
# Steps the count itself may take (an entry merged, a subschema looked at), so that
# counting a hostile schema is no slower than a large honest one: an honest one takes
# about four per subschema it holds.
_COUNTING_STEPS: Final = MAX_SCHEMA_APPLICATIONS
_COUNTING_STEPS_PER_SUBSCHEMA: Final = 8


_TOO_LARGE: Final = "too costly to check: too large to count its checks; write it smaller"


class _Uncounted(Exception):
    """A schema whose checks cannot be counted (its message says why)."""


class _Graph:
    """A schema's subschemas (by `id`) and how `$ref`s reach them."""

    def __init__(self, root: dict[str, Any]) -> None:
        self.resources: dict[str, Any] = {"": root}
        self.anchors: dict[tuple[str, str], Any] = {}
        self.dynamic: dict[str, list[Any]] = {}
        self.base: dict[int, str] = {}
        self.nodes: dict[int, dict[str, Any]] = {}
        self._register(root, "")

    def _register(self, node: Any, base: str) -> None:
        stack = [(node, base)]
        while stack:
            item, uri = stack.pop()
            if isinstance(item, list):
                stack.extend((v, uri) for v in item)
                continue
            if not isinstance(item, dict):
                continue
            if isinstance(item.get("$id"), str):
                with contextlib.suppress(ValueError):  # in no schema's place: not a URI
                    uri = urldefrag(urljoin(uri, item["$id"]))[0]
                    self.resources.setdefault(uri, item)
            self.base[id(item)] = uri
            self.nodes[id(item)] = item
            if isinstance(item.get("$anchor"), str):
                self.anchors[(uri, item["$anchor"])] = item
            for key in ("$dynamicAnchor", "$recursiveAnchor"):
                if isinstance(item.get(key), str | bool):
                    self.dynamic.setdefault(key, []).append(item)
                    if key == "$dynamicAnchor":
                        self.anchors.setdefault((uri, item[key]), item)
            stack.extend((v, uri) for v in item.values())

    def resolve(self, node: dict[str, Any], key: str) -> list[Any]:
        ref = node[key]
        if not isinstance(ref, str):
            return []
        base = self.base.get(id(node), "")
        try:  # a fragment alone stays in its resource, whatever the scheme (urn:)
            uri, fragment = (base, ref[1:]) if ref.startswith("#") else \
                urldefrag(urljoin(base, ref))
        except ValueError:
            uri, fragment = "", "#"  # followed nowhere: refused below
        found: Any = self.resources.get(uri)
        if found is not None and fragment.startswith("/"):
            for part in unquote(fragment).split("/")[1:]:
                part = part.replace("~1", "/").replace("~0", "~")
                if isinstance(found, dict) and part in found:
                    found = found[part]
                elif isinstance(found, list) and part.isdigit() and int(part) < len(found):
                    found = found[int(part)]
                else:
                    found = None
                    break
        elif found is not None and fragment:
            found = self.anchors.get((uri, fragment))
        if found is None and uri.startswith(_META_SCHEMAS) and uri not in self.resources:
            return []  # one jsonschema-rs holds (offline: nothing else compiles), bounded
        if found is None:
            raise _Uncounted(f"not usable: toolbus cannot follow its $ref {ref!r} to "
                             "count the checks it leads to; refer to a definition of this "
                             "schema (#/$defs/name)")
        # A dynamic reference may land on any subschema that declares the anchor.
        extra = self.dynamic.get("$dynamicAnchor" if key == "$dynamicRef" else
                                 "$recursiveAnchor", []) if key != "$ref" else []
        return [found, *extra]

    def in_place(self, node: dict[str, Any]) -> Iterator[Any]:
        """The subschemas applied to the same value as `node`, once per way."""
        for key in _IN_PLACE:
            if key in node:
                yield from (self.resolve(node, key) if key.startswith("$") else [node[key]])
        for key in _IN_PLACE_LISTS:
            if isinstance(node.get(key), list):
                yield from node[key]
        for key in _IN_PLACE_MAPS:
            if isinstance(node.get(key), dict):
                yield from node[key].values()


def _schemas(node: dict[str, Any], *keys: str) -> list[Any]:
    return [node[k] for k in keys if isinstance(node.get(k), dict | bool)]


def _tuple(node: dict[str, Any]) -> list[Any]:
    items = node.get("prefixItems", node.get("items"))
    return items if isinstance(items, list) else []


_Entries = dict[int, int]  # a subschema (by id) -> the times it is entered at one place


def _add(into: _Entries, schemas: list[Any], n: int) -> None:
    for sub in schemas:
        if isinstance(sub, dict):
            into[id(sub)] = into.get(id(sub), 0) + n


@dataclass(frozen=True, slots=True)
class _Below:
    """Applying one subschema at a place: how many subschemas that applies there (itself
    and all it applies in place), and what it enters one level down, per place: any key,
    each key it names (changes to any key's: a named key is not an additional one), any
    item, each tuple index (changes to any item's), a key's name. Every pattern of
    `patternProperties` counts as matching: none is run here (a pattern can backtrack for
    ages)."""

    total: int
    any_key: _Entries
    named: dict[str, _Entries]
    any_item: _Entries
    indexed: dict[int, _Entries]
    key_name: _Entries

    @classmethod
    def own(cls, node: dict[str, Any]) -> _Below:
        below = cls(1, {}, {}, {}, {}, {})
        patterns = node.get("patternProperties")
        _add(below.any_key, list(patterns.values()) if isinstance(patterns, dict) else [], 1)
        extra = _schemas(node, *_ANY_KEY)
        _add(below.any_key, extra, 1)
        props = node.get("properties")
        for name, sub in (props.items() if isinstance(props, dict) else ()):
            _add(below.named.setdefault(name, {}), [sub], 1)
            _add(below.named[name], extra, -1)
        rest = _schemas(node, "items") or _schemas(node, "additionalItems")
        _add(below.any_item, rest + _schemas(node, *_ANY_ITEM), 1)
        for i, sub in enumerate(_tuple(node)):
            _add(below.indexed.setdefault(i, {}), [sub], 1)
            _add(below.indexed[i], rest, -1)
        _add(below.key_name, _schemas(node, "propertyNames"), 1)
        return below

    def empty(self) -> bool:
        return not (self.any_key or self.named or self.any_item or self.indexed or
                    self.key_name)

    def size(self) -> int:
        return len(self.any_key) + len(self.any_item) + len(self.key_name) + \
            sum(len(e) + 1 for e in self.named.values()) + \
            sum(len(e) + 1 for e in self.indexed.values())


def _merge(into: _Entries, entries: _Entries, n: int) -> None:
    for key, m in entries.items():
        into[key] = into.get(key, 0) + m * n


class _Counter:
    """`_Below` of each subschema, each computed once, within a budget of steps."""

    def __init__(self, graph: _Graph) -> None:
        self.graph = graph
        self.budget = _COUNTING_STEPS + _COUNTING_STEPS_PER_SUBSCHEMA * len(graph.nodes)
        self._below: dict[int, _Below] = {}
        # A subschema that only applies another ({"$ref": ...}) stands for it: places
        # entered through either are one.
        self._same: dict[int, int] = {}

    def spend(self, steps: int) -> None:
        self.budget -= steps
        if self.budget < 0:
            raise _Uncounted(_TOO_LARGE)

    def canonical(self, key: int) -> int:
        self.below(key)
        return self._same.get(key, key)

    def below(self, key: int) -> _Below:
        """Along `in_place` edges, depth first; a cycle is cut where it closes (the
        validator stops there too)."""
        if key in self._below:
            return self._below[key]
        stack = [(key, self.graph.in_place(self.graph.nodes[key]))]
        open_ = {key}
        while stack:
            top, todo = stack[-1]
            sub = next(todo, None)
            if sub is None:
                stack.pop()
                open_.discard(top)
                self._below[top] = self._combine(top)
            elif isinstance(sub, dict) and id(sub) not in self._below and \
                    id(sub) not in open_:
                self.spend(1)
                open_.add(id(sub))
                stack.append((id(sub), self.graph.in_place(sub)))
        return self._below[key]

    def _combine(self, key: int) -> _Below:
        node = self.graph.nodes[key]
        own = _Below.own(node)
        subs = [self._below[id(s)] for s in self.graph.in_place(node)
                if isinstance(s, dict) and id(s) in self._below]
        self.spend(1 + own.size() + len(subs))
        if not subs:
            return own
        if len(subs) == 1 and own.empty():
            only = next(id(s) for s in self.graph.in_place(node)
                        if isinstance(s, dict) and id(s) in self._below)
            self._same[key] = self._same.get(only, only)
            return _Below(subs[0].total + 1, *(getattr(subs[0], f) for f in _PLACES))
        for sub in subs:
            self.spend(sub.size())
            _merge(own.any_key, sub.any_key, 1)
            _merge(own.any_item, sub.any_item, 1)
            _merge(own.key_name, sub.key_name, 1)
            for name, entries in sub.named.items():
                _merge(own.named.setdefault(name, {}), entries, 1)
            for i, entries in sub.indexed.items():
                _merge(own.indexed.setdefault(i, {}), entries, 1)
        return _Below(own.total + sum(s.total for s in subs), own.any_key, own.named,
                      own.any_item, own.indexed, own.key_name)

    def places(self, entry: _Entries) -> tuple[int, list[_Entries]]:
        """The subschemas applied at a place entered by `entry`, and the entries of each
        place one level down."""
        parts = [(self.below(k), n) for k, n in entry.items()]
        any_key: _Entries = {}
        any_item: _Entries = {}
        key_name: _Entries = {}
        named: dict[str, _Entries] = {}
        indexed: dict[int, _Entries] = {}
        for below, n in parts:
            self.spend(below.size())
            _merge(any_key, below.any_key, n)
            _merge(any_item, below.any_item, n)
            _merge(key_name, below.key_name, n)
            for name, entries in below.named.items():
                _merge(named.setdefault(name, {}), entries, n)
            for i, entries in below.indexed.items():
                _merge(indexed.setdefault(i, {}), entries, n)
        out = [any_key, any_item, key_name]
        for base, changes in ((any_key, named.values()), (any_item, indexed.values())):
            for change in changes:
                self.spend(len(base) + len(change))
                place = dict(base)
                _merge(place, change, 1)
                out.append(place)
        total = sum(below.total * n for below, n in parts)
        return total, [self._canonical(place) for place in out]

    def _canonical(self, place: _Entries) -> _Entries:
        out: _Entries = {}
        for key, n in place.items():
            if n > 0:
                same = self.canonical(key)
                out[same] = out.get(same, 0) + n
        return out


_PLACES: Final = ("any_key", "named", "any_item", "indexed", "key_name")


def _costly(schema: dict[str, Any]) -> str | None:
    """Why checking a value against `schema` could take too long ("too costly to
    check: ..."), or None."""
    try:
        return _count(_Counter(_Graph(schema)))
    except _Uncounted as exc:
        return str(exc)


def _count(counter: _Counter) -> str | None:
    root = counter.canonical(id(counter.graph.resources[""]))
    level: dict[frozenset[int], _Entries] = {frozenset({root}): {root: 1}}
    for depth in range(MAX_JSON_DEPTH + 1):
        merged: dict[frozenset[int], _Entries] = {}
        for entry in level.values():
            total, places = counter.places(entry)
            if total > MAX_SCHEMA_APPLICATIONS:
                where = "the value itself" if depth == 0 else f"{depth} levels down"
                return (f"too costly to check: it applies over {MAX_SCHEMA_APPLICATIONS:,} "
                        f"subschemas to one place of a value ({where}): a $ref reached by "
                        "several branches, level after level, multiplies the checks; name "
                        "each definition from one branch, or write the schema out")
            for child in places:
                if child:  # places with the same subschemas: the most of each, a bound
                    counter.spend(len(child))
                    same = merged.setdefault(frozenset(child), {})
                    for key, n in child.items():
                        same[key] = max(n, same.get(key, 0))
        if not merged or merged == level:
            return None
        level = merged
    return None


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
