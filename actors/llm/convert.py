"""Conversions the four API modules share: tool names both ways, arguments, results,
system text, schema strictness."""

from __future__ import annotations

import copy
import hashlib
import operator
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final, Self

import msgspec

from actors.llm.types import Message, ToolCall
from schemas.defaults import MAX_JSON_DEPTH
from schemas.errors import ConfigError
from schemas.providers import ProviderNames, export
from schemas.requests import json_depth
from schemas.tools import ToolSpec


class Assembly:
    """One API's messages, built from a conversation one message at a time: `push` each,
    then `done`. Some APIs merge neighbours (Anthropic's and Gemini's results share one user
    content), so the state between two messages can be more than a list: a subclass keeps
    what may still change apart from `out`, the entries that cannot. System-role messages
    are collected in `system`, for the APIs that take them apart."""

    __slots__ = ("frozen", "names", "out", "system")

    def __init__(self, names: Names) -> None:
        self.names = names
        self.out: list[Any] = []
        self.system: list[str] = []
        self.frozen = 0  # out[:frozen] are encoded

    def push(self, m: Message) -> None:
        raise NotImplementedError

    def _close(self) -> None:
        """Move what may still change (a merged run of results) into `out`."""

    def done(self) -> list[Any]:
        self._close()
        return self.out

    def resumed(self) -> Self:
        """A copy to push more messages into, leaving this one as it is."""
        other = copy.copy(self)
        other.out = self.out[:]
        other.system = self.system[:]
        return other

    def freeze(self) -> None:
        """Encode the entries that cannot change any more (see `WireMemo`)."""
        out = self.out
        for i in range(self.frozen, len(out)):
            out[i] = raw_json(out[i])
        self.frozen = len(out)


class WireMemo:
    """The wire form of the messages of a conversation that will not change (a session's
    ended turns), per API, converted and JSON-encoded once: each later model call of the
    session copies their bytes into its request (as `msgspec.Raw`) and converts only the
    messages after them: what grows with the session is a copy of references and of bytes.

    The owner passes the messages that are final to `keep`, in order, as they become
    final; a request whose messages start with those very objects is built from the memo
    (a copy of references, then the messages after them), any other in full. Identity,
    not equality: `1 == True` and dicts equal in another key order encode differently."""

    __slots__ = ("_assemblies", "_kept")

    def __init__(self) -> None:
        self._kept: list[Message] = []
        self._assemblies: dict[str, tuple[int, Assembly]] = {}

    def keep(self, messages: Iterable[Message]) -> None:
        self._kept += messages

    def assemble(self, fmt: str, messages: Sequence[Message],
                 start: Callable[[], Assembly]) -> Assembly:
        """An assembly of `messages` in `fmt`, its start taken from the memo."""
        kept = self._kept
        k = len(kept)
        if not k or len(messages) < k or not all(map(operator.is_, messages[:k], kept)):
            return assemble(messages, start())
        done, assembly = self._assemblies.get(fmt) or (0, start())
        if done < k:  # final since the last call: converted once, and kept converted
            for m in kept[done:]:
                assembly.push(m)
            assembly.freeze()
            self._assemblies[fmt] = (k, assembly)
        return assemble(messages[k:], assembly.resumed())


def assemble(messages: Iterable[Message], assembly: Assembly) -> Assembly:
    for m in messages:
        assembly.push(m)
    return assembly


def assembled(messages: Sequence[Message], memo: WireMemo | None, fmt: str,
              start: Callable[[], Assembly]) -> Assembly:
    """`messages` assembled for `fmt`, from `memo` when one is given."""
    if memo is None:
        return assemble(messages, start())
    return memo.assemble(fmt, messages, start)


_EXPORTS_KEPT = 256
_exports: OrderedDict[tuple[str, tuple[int, ...]], tuple[tuple[ToolSpec, ...], Any, Names]] = \
    OrderedDict()


def exported_tools(api: str, fmt: str, tools: Sequence[ToolSpec],
                   finish: Callable[[Any], Any] = lambda exported: exported,
                   ) -> tuple[Any, Names]:
    """The tools offered to one API (`export` in `fmt`, then `finish`ed as the API wants
    them), encoded, and the name map to read its calls. Kept for the last few hundred sets
    of tool specs offered: a session offers the same ones at every model call, and
    converting dozens of schemas costs more than the rest of a request. Specs are frozen,
    so a set is known by the identity of its specs."""
    specs = tuple(tools)
    key = (api, tuple(map(id, specs)))
    kept = _exports.get(key)
    if kept is not None and all(map(operator.is_, kept[0], specs)):
        _exports.move_to_end(key)
        return kept[1], kept[2]
    exported, pnames = export(specs, fmt)
    value, names = raw_json(finish(exported)), Names(pnames)
    _exports[key] = (specs, value, names)
    while len(_exports) > _EXPORTS_KEPT:
        _exports.popitem(last=False)
    return value, names


def raw_json(value: Any) -> Any:
    """`value` encoded now, to be copied verbatim into a request body."""
    return value if isinstance(value, msgspec.Raw) else msgspec.Raw(msgspec.json.encode(value))


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


def model_json(text: str | bytes) -> Any:
    """A model's JSON text (a call's arguments, a structured answer) decoded, at most
    `MAX_JSON_DEPTH` levels deep, as a client's request: deeper, what is stored of it
    might not be read back (msgspec's limit counts the stack it is read on, and an event
    nests it further), so it fails as text that is not JSON: `msgspec.DecodeError`."""
    try:
        value = msgspec.json.decode(text)
    except RecursionError:
        value = None
    else:
        if json_depth(value, MAX_JSON_DEPTH) <= MAX_JSON_DEPTH:
            return value
    raise msgspec.DecodeError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")


# The user's turn put before an assistant's that has none before it (a tool event
# injected before the session's first message, or right after an answer, is rendered as
# the assistant's call): Anthropic refuses a conversation whose first message is not the
# user's, Gemini a function call turn that does not follow a user turn.
TOOLS_FOLLOW: Final = "[What tools returned follows.]"
# What stands for arguments that came as an object nested too deeply to keep.
TOO_DEEP: Final = f"(a JSON value nested deeper than {MAX_JSON_DEPTH} levels)"


def parse_arguments(raw: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(arguments, extra) from a JSON string or an object. Arguments that are not a JSON
    object (or nest deeper than `MAX_JSON_DEPTH`) are kept verbatim in
    `extra["invalid_arguments"]`, so the planner can say what was wrong and the next
    request can echo exactly what the model sent."""
    value: Any = raw
    if isinstance(raw, str | bytes):
        if not raw.strip():
            return {}, {}
        try:
            value = model_json(raw)
        except (msgspec.DecodeError, UnicodeDecodeError):
            text = raw if isinstance(raw, str) else raw.decode(errors="replace")
            return {}, {"invalid_arguments": text}
    if value is None:
        return {}, {}
    deep = json_depth(value, MAX_JSON_DEPTH) > MAX_JSON_DEPTH  # an object decoded already
    if isinstance(value, dict) and not deep:
        return value, {}
    if deep:  # could not be stored, folded or validated: refused, and the model told why
        return {}, {"invalid_arguments": TOO_DEEP}
    return {}, {"invalid_arguments": msgspec.json.encode(value).decode()}


def arguments_json(call: ToolCall) -> str:
    invalid = call.extra.get("invalid_arguments")
    return invalid if isinstance(invalid, str) else msgspec.json.encode(call.arguments).decode()


def result_value(text: str) -> Any:
    """A tool result's text as JSON if it is JSON, else the text."""
    try:
        return msgspec.json.decode(text)
    except (msgspec.DecodeError, RecursionError):
        return text


def tokens(usage: Any, *keys: str) -> int:
    """The sum of the token counts under `keys` of a provider's usage object. Counts only
    feed the turn's budget: a value that is not a count (text, a list, negative, past
    2**53), or a usage that is not an object, counts as none, never fails the reply."""
    if not isinstance(usage, dict):
        return 0
    return sum(count(usage.get(k)) for k in keys)


def count(value: Any) -> int:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < 2**53
    return int(value) if ok else 0


def joined_system(system: str | None, texts: list[str]) -> str | None:
    """The system prompt plus the system-role messages' texts (see `Assembly.system`)."""
    return "\n\n".join([system, *texts] if system else texts) or None


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
