"""The request format clients publish to `toolbus.req.<session_id>`.

    {"request_id": "optional, any string", "agent": "optional name",
     "calls": [{"tool": "ns:tool", "arguments": {...}}]}

`agent` names who asks: the policy's per-agent tool grants apply to it.

A call may carry the meta-fields of seed 001 beside `tool`: `_reasoningForCall` (why the
agent chose it), `_outputPath` (where the result goes in the session's state object),
`_delegate` (an executor pool) and `_instance` (one executor instance). A call may also be
written flat, the way an LLM fills a composed schema: `{"_tool": "ns:tool", "x": 1}`, where
every key without an underscore is an argument.

Parsing is hand-written rather than schema-driven so every refusal names the exact field
that was wrong, in words an LLM or a person can act on.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any, Final

import msgspec

from schemas.defaults import MAX_CALLS_PER_REQUEST, MAX_JSON_DEPTH, MAX_REQUEST_BYTES
from schemas.errors import ConfigError, InvalidRequestError
from schemas.events import ChatMessage, ThinkRequest
from schemas.ids import AUTO_REQUEST_PREFIX, TOKEN_RULE, TOOL_EVENT_PREFIX, is_token
from schemas.validation import Validator

DEFAULT_MAX_REQUEST_BYTES: Final = MAX_REQUEST_BYTES
DEFAULT_MAX_CALLS: Final = MAX_CALLS_PER_REQUEST


class CallInput(msgspec.Struct, frozen=True, kw_only=True):
    tool: str
    arguments: Any = msgspec.field(default_factory=dict)
    reasoning: str | None = None
    output_path: str | None = None
    delegate: str | None = None
    instance: str | None = None
    transform: str | None = None  # `_transform`: JMESPath over the result, for the model


class Request(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str | None
    calls: list[CallInput]
    agent: str | None = None
    # A planner turn instead of explicit calls: what the user says to the agent, and the
    # conversation before it when the client keeps it (`messages`).
    message: str | None = None
    history: list[ChatMessage] = []
    think: list[ThinkRequest] = []  # think steps for this turn (`built-in:reason`)
    # Not a turn: the running turn to cancel, and why (`{"cancel": turn_id, "reason"}`).
    cancel: str | None = None
    reason: str | None = None


MAX_MESSAGE_BYTES: Final = 64 * 1024
MAX_CANCEL_REASON_CHARS: Final = 1000
_KNOWN_KEYS: Final = frozenset({"request_id", "calls", "agent", "message", "messages",
                                "think", "cancel", "reason"})
MAX_THINK_STEPS: Final = 8
MAX_THINK_INSTRUCTION_CHARS: Final = 8000
META_FIELDS: Final = ("_reasoningForCall", "_outputPath", "_delegate", "_instance",
                      "_transform")
MAX_TRANSFORM_CHARS: Final = 1000
# A longer request id is refused without being stored (its rejection names no request).
MAX_REQUEST_ID_CHARS: Final = 256
_KNOWN_CALL_KEYS: Final = frozenset({"tool", "arguments", *META_FIELDS})
_PATH_SEGMENT = re.compile(r"[A-Za-z0-9_-]{1,128}")


def parse_request(
    data: bytes,
    *,
    max_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    max_calls: int = DEFAULT_MAX_CALLS,
) -> Request:
    """Parse a request body, raising `InvalidRequestError` with a reason code and message."""
    if len(data) > max_bytes:
        raise InvalidRequestError(
            "payload_too_large",
            f"request is {len(data)} bytes; the limit is {max_bytes} bytes. "
            "Send large inputs by reference (a path or URL) instead of inline",
        )
    body = decode_json(data, what="request body")
    if not isinstance(body, dict):
        raise InvalidRequestError(
            "invalid_request", f"request must be a JSON object, got {_json_type(body)}"
        )
    unknown = sorted(set(body) - _KNOWN_KEYS)
    if unknown:
        raise InvalidRequestError(
            "invalid_request",
            f"unknown field(s) {', '.join(unknown)}; a request has request_id, agent, and "
            "one of calls, message or messages (think steps with a message); a cancel has "
            "cancel and reason",
        )
    request_id = body.get("request_id")
    if request_id is not None:
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError(
                "invalid_request",
                f"request_id must be a non-empty string, got {_json_type(request_id)}",
            )
        if len(request_id) > MAX_REQUEST_ID_CHARS:
            raise InvalidRequestError("invalid_request", "request_id is longer than "
                                      f"{MAX_REQUEST_ID_CHARS} characters")
        if request_id.startswith((AUTO_REQUEST_PREFIX, TOOL_EVENT_PREFIX)):
            raise InvalidRequestError(
                "invalid_request",
                f"request ids starting with {AUTO_REQUEST_PREFIX!r} or {TOOL_EVENT_PREFIX!r} "
                "are reserved for toolbus",
            )
    agent = body.get("agent")
    if agent is not None and not is_token(agent):
        raise InvalidRequestError(
            "invalid_request",
            f"agent {agent!r} is not a valid name: use 1 to 128 characters from A-Z a-z 0-9 _ -",
        )
    if "cancel" in body or "reason" in body:
        return _parse_cancel(body, request_id)
    think = _parse_think(body["think"]) if "think" in body else []
    if think and "message" not in body and "messages" not in body:
        raise InvalidRequestError("invalid_request", "think steps need a message: they run "
                                  "in a turn the model plans, not with explicit calls")
    if "messages" in body:
        if "message" in body or "calls" in body:
            raise InvalidRequestError(
                "invalid_request", "give calls, message or messages: only one of them")
        said, history = _parse_messages(body["messages"])
        if len(said.encode()) > MAX_MESSAGE_BYTES:
            raise InvalidRequestError(
                "payload_too_large", f"the last message is over {MAX_MESSAGE_BYTES} bytes")
        return Request(request_id=request_id, calls=[], agent=agent, message=said,
                       history=history, think=think)
    message = body.get("message")
    if "message" in body:
        if "calls" in body:
            raise InvalidRequestError(
                "invalid_request", "give calls (explicit tool calls) or message (a turn the "
                "model plans), not both")
        if not isinstance(message, str) or not message.strip():
            raise InvalidRequestError(
                "invalid_request", f"message must be a non-empty string, got "
                f"{_json_type(message)}")
        if len(message.encode()) > MAX_MESSAGE_BYTES:
            raise InvalidRequestError(
                "payload_too_large", f"message is over {MAX_MESSAGE_BYTES} bytes")
        return Request(request_id=request_id, calls=[], agent=agent, message=message,
                       think=think)
    calls = body.get("calls")
    if "calls" not in body:
        raise InvalidRequestError(
            "invalid_request", "a request needs calls (explicit tool calls), message or "
            "messages (a turn the model plans)")
    if not isinstance(calls, list):
        raise InvalidRequestError(
            "invalid_request", f"calls must be a list of calls, got {_json_type(calls)}"
        )
    if not calls:
        raise InvalidRequestError("invalid_request", "calls is empty; give at least one call")
    if len(calls) > max_calls:
        raise InvalidRequestError(
            "too_many_calls", f"{len(calls)} calls in one request; the limit is {max_calls}"
        )
    parsed: list[CallInput] = []
    for i, call in enumerate(calls):
        where = f"calls[{i}]"
        if not isinstance(call, dict):
            raise InvalidRequestError(
                "invalid_request", f"{where} must be an object, got {_json_type(call)}"
            )
        parsed.append(_parse_call(call, where))
    return Request(request_id=request_id, calls=parsed, agent=agent)


def _parse_cancel(body: dict[str, Any], request_id: str | None) -> Request:
    """`{"cancel": turn_id, "reason"?, "request_id"?}`: stop a running turn."""
    extra = sorted(set(body) - {"cancel", "reason", "request_id"})
    if extra or "cancel" not in body:
        raise InvalidRequestError(
            "invalid_request", "a cancel request has cancel (the turn id), and may have "
            "reason and request_id" + (f"; not {', '.join(extra)}" if extra else ""))
    turn_id, reason = body["cancel"], body.get("reason")
    if not is_token(turn_id):
        raise InvalidRequestError(
            "invalid_request", f"cancel must be a turn id ({TOKEN_RULE}), got "
            f"{_json_type(turn_id)}")
    if reason is not None and (not isinstance(reason, str) or not reason.strip()
                               or len(reason) > MAX_CANCEL_REASON_CHARS):
        raise InvalidRequestError(
            "invalid_request", f"reason must be a non-empty string of at most "
            f"{MAX_CANCEL_REASON_CHARS} characters")
    return Request(request_id=request_id, calls=[], cancel=turn_id,
                   reason=strip_controls(reason) if reason is not None else None)


def _parse_think(value: Any) -> list[ThinkRequest]:
    """`think`: one think step `{id, instruction, output_schema}`, or a list of them."""
    items = [value] if isinstance(value, dict) else value
    if not isinstance(items, list) or not items:
        raise InvalidRequestError("invalid_request", 'think must be a think step {"id", '
                                  '"instruction", "output_schema"} or a non-empty list of them')
    if len(items) > MAX_THINK_STEPS:
        raise InvalidRequestError("invalid_request", f"{len(items)} think steps; the limit "
                                  f"is {MAX_THINK_STEPS} per request")
    steps: list[ThinkRequest] = []
    for i, item in enumerate(items):
        where = f"think[{i}]"
        if not isinstance(item, dict) or set(item) != {"id", "instruction", "output_schema"}:
            raise InvalidRequestError("invalid_request", f"{where} must be an object with "
                                      "exactly id, instruction and output_schema")
        ident, instruction, schema = item["id"], item["instruction"], item["output_schema"]
        if not is_token(ident):
            raise InvalidRequestError("invalid_request", f"{where}.id must be 1 to 128 "
                                      "characters from A-Z a-z 0-9 _ -")
        if any(s.id == ident for s in steps):
            raise InvalidRequestError("invalid_request", f"{where}.id {ident} is given twice")
        if not isinstance(instruction, str) or not instruction.strip() or \
                len(instruction) > MAX_THINK_INSTRUCTION_CHARS:
            raise InvalidRequestError("invalid_request", f"{where}.instruction must be a "
                                      f"non-empty string of at most "
                                      f"{MAX_THINK_INSTRUCTION_CHARS} characters")
        if not isinstance(schema, dict):
            raise InvalidRequestError("invalid_request", f"{where}.output_schema must be a "
                                      f"JSON Schema object, got {_json_type(schema)}")
        try:
            Validator(schema)
        except ConfigError as exc:
            raise InvalidRequestError("invalid_request", f"{where}.output_schema: "
                                      f"{exc}") from exc
        steps.append(ThinkRequest(id=ident, instruction=instruction, output_schema=schema))
    return steps


def _parse_messages(value: Any) -> tuple[str, list[ChatMessage]]:
    """`messages`: the conversation, oldest first, ending with the user's new message."""
    if not isinstance(value, list) or not value:
        raise InvalidRequestError("invalid_request", "messages must be a non-empty list of "
                                  '{"role": "user"|"assistant", "content": "..."}')
    history: list[ChatMessage] = []
    for i, item in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(item, dict) or set(item) != {"role", "content"}:
            raise InvalidRequestError("invalid_request", f"{where} must be an object with "
                                      "exactly role and content")
        role, content = item["role"], item["content"]
        if role not in ("user", "assistant"):
            got = repr(strip_controls(role[:40])) if isinstance(role, str) and role.strip() \
                else _json_type(role)
            more = " (the agent's instructions come from its manifest)" \
                if role == "system" else ""
            raise InvalidRequestError("invalid_request", f"{where}.role must be user or "
                                      f"assistant, got {got}{more}")
        if not isinstance(content, str) or not content.strip():
            raise InvalidRequestError("invalid_request", f"{where}.content must be a "
                                      "non-empty string")
        history.append(ChatMessage(role=role, content=content))
    last = history.pop()
    if last.role != "user":
        raise InvalidRequestError("invalid_request", "the last of messages must be the "
                                  "user's (the turn answers it)")
    return last.content, history


# A `\uD800`-`\uDFFF` escape that is not half of a pair: JSON's grammar allows it, but it
# is no character, and msgspec refuses it as "Input data was truncated".
_LONE_SURROGATE: Final = re.compile(
    rb"(?<!\\)(?:\\\\)*(\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
    rb"|(?<![0-9a-fA-F]{2}\\u)\\u[dD][c-fC-F][0-9a-fA-F]{2})")


def json_error(exc: Exception, data: bytes | str) -> str:
    """What is wrong with JSON text msgspec refused: its own words, except for a lone
    UTF-16 surrogate escape, which it calls truncation."""
    if isinstance(exc, msgspec.DecodeError) and "truncated" in str(exc):
        raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
        found = _LONE_SURROGATE.search(raw)
        if found is not None:
            return (f"{found.group(1).decode()} at byte {found.start(1)} is half of a "
                    "UTF-16 surrogate pair, which is not a character")
    return str(exc)


def decode_json(data: bytes, *, what: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Decode untrusted JSON within the decoder's limits, or raise `InvalidRequestError`.

    Every way bytes can be unusable maps to one reason: not JSON or not UTF-8
    (`malformed_json`), nested deeper than `max_depth` (`nested_too_deep`)."""
    try:
        body = msgspec.json.decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequestError("malformed_json", f"{what} is not valid JSON (UTF-8): "
                                  f"{json_error(exc, data)}") from exc
    except RecursionError as exc:
        raise InvalidRequestError("nested_too_deep", f"{what} nests deeper than "
                                  f"{max_depth} levels") from exc
    if json_depth(body, max_depth) > max_depth:
        raise InvalidRequestError("nested_too_deep", f"{what} nests deeper than "
                                  f"{max_depth} levels")
    return body


def json_values(value: Any) -> Iterator[Any]:
    """Every value in decoded JSON, containers, keys and the values inside included, each
    time it is used (a YAML alias is walked once per use), without recursion."""
    stack = [value]
    while stack:
        item = stack.pop()
        yield item
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def json_depth(value: Any, limit: int) -> int:
    """The nesting depth of decoded JSON (a scalar is 0, `[]` is 1), counted level by
    level without recursion, and only up to `limit + 1`."""
    depth = 0
    level = [value] if isinstance(value, dict | list) else []
    while level and depth <= limit:
        depth += 1
        nxt: list[Any] = []
        for container in level:
            items = container.values() if isinstance(container, dict) else container
            nxt.extend(v for v in items if isinstance(v, dict | list))
        level = nxt
    return depth


def _parse_call(call: dict[str, Any], where: str) -> CallInput:
    if "_tool" in call:  # the flat form of seed 001
        if "tool" in call:
            raise InvalidRequestError("invalid_request",
                                      f"{where} has both tool and _tool; give one")
        tool = call["_tool"]
        arguments: Any = {k: v for k, v in call.items() if not k.startswith("_")}
        extra = sorted(k for k in call if k.startswith("_") and k not in META_FIELDS
                       and k != "_tool")
    else:
        tool = call.get("tool")
        arguments = call.get("arguments", {})
        extra = sorted(set(call) - _KNOWN_CALL_KEYS)
    if extra:
        raise InvalidRequestError(
            "invalid_request",
            f"{where} has unknown field(s) {', '.join(extra)}; a call has tool, arguments "
            f"and optionally {', '.join(META_FIELDS)}",
        )
    where_tool = f"{where}._tool" if "_tool" in call else f"{where}.tool"
    if not isinstance(tool, str):
        raise InvalidRequestError(
            "invalid_request", f"{where_tool} must be a string, got {_json_type(tool)}"
        )
    meta: dict[str, str | None] = {}
    for key in META_FIELDS:
        value = call.get(key)
        if value is not None and not isinstance(value, str):
            raise InvalidRequestError(
                "invalid_request", f"{where}.{key} must be a string, got {_json_type(value)}"
            )
        meta[key] = value
    path = meta["_outputPath"]
    if path is not None and not all(_PATH_SEGMENT.fullmatch(p) for p in path.split(".")):
        raise InvalidRequestError(
            "invalid_request",
            f"{where}._outputPath {path!r} is not a dotted path of names like "
            "customer.profile (each part 1 to 128 of A-Z a-z 0-9 _ -)",
        )
    for key in ("_delegate", "_instance"):
        value = meta[key]
        if value is not None and not is_token(value):
            raise InvalidRequestError(
                "invalid_request",
                f"{where}.{key} {value!r} is not a valid name: use 1 to 128 characters "
                "from A-Z a-z 0-9 _ -",
            )
    transform = meta["_transform"]
    if transform is not None and not 0 < len(transform) <= MAX_TRANSFORM_CHARS:
        raise InvalidRequestError(
            "invalid_request", f"{where}._transform must be a JMESPath expression of 1 to "
            f"{MAX_TRANSFORM_CHARS} characters")
    # Arguments that are not an object are kept: they become a call.rejected naming the
    # call, while the other calls of the request still run.
    return CallInput(tool=tool, arguments=arguments, reasoning=meta["_reasoningForCall"],
                     output_path=path, delegate=meta["_delegate"], instance=meta["_instance"],
                     transform=transform)


def _json_type(value: object) -> str:
    match value:
        case None:
            return "null"
        case bool():
            return "a boolean"
        case int() | float():
            return "a number"
        case "":
            return "an empty string"
        case str() if not value.strip():
            return "only whitespace"
        case str():
            return "a string"
        case list():
            return "an array"
        case dict():
            return "an object"
    return type(value).__name__


# --- injected tool events (seed 000) ------------------------------------------------------

MAX_IDEMPOTENCY_KEY_CHARS: Final = 256
_TOOL_EVENT_KEYS: Final = frozenset({"tool_id", "arguments", "result", "idempotency_key",
                                     "trigger_processing"})
# Control characters (C0 but tab and newline, DEL, C1, line and paragraph separators)
# and the invisible format characters (Unicode category Cf: bidirectional controls,
# zero-width spaces, the tag block that can hide text from a human reader), but for the
# zero-width joiners that scripts and emoji need.
_CONTROL: Final = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\xad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891"
    "\u08e2\u180e\u200b\u200e\u200f\u2028-\u202e\u2060-\u2064\u2066-\u206f\ufeff"
    "\ufff9-\ufffb\U000110bd\U000110cd\U00013430-\U0001343f\U0001bca0-\U0001bca3"
    "\U0001d173-\U0001d17a\U000e0001\U000e0020-\U000e007f]")


# What shows nothing at all: the above, with the joiners, variation selectors and other
# default-ignorable code points that `_CONTROL` keeps for scripts and emoji. Text is never
# stripped of these; they are dropped only to look for a secret hidden by them.
INVISIBLE: Final = re.compile(
    _CONTROL.pattern[:-1] + "\u034f\u115f\u1160\u17b4\u17b5\u180b-\u180f\u200b-\u200f"
    "\u202a-\u202e\u2060-\u206f\u3164\ufe00-\ufe0f\uffa0\ufff0-\ufff8"
    "\U000e0000-\U000e0fff]")


class ToolEventInput(msgspec.Struct, frozen=True, kw_only=True):
    """A tool event to inject, as `POST /sessions/{id}/tool_events` and
    `toolbus.req.<session_id>.tool_events` take it; every string already stripped of
    control characters."""

    tool_id: str
    arguments: dict[str, Any]
    result: Any
    idempotency_key: str
    trigger_processing: bool = False


def is_tool_event(data: bytes) -> bool:
    """Whether a body sent to a session (`toolbus.req.<sid>`) is a tool event to inject
    rather than a request: a JSON object with `tool_id` at its top level."""
    if b'"tool_id"' not in data:
        return False
    try:
        body = decode_json(data, what="tool event")
    except InvalidRequestError:
        return False
    return isinstance(body, dict) and "tool_id" in body


def _json_escape(match: re.Match[str]) -> str:
    units = match.group().encode("utf-16-be")
    return "".join(f"\\u{units[i]:02x}{units[i + 1]:02x}" for i in range(0, len(units), 2))


def escape_controls(json_text: str) -> str:
    """JSON text with every character `strip_controls` removes written as its `\\uXXXX`
    escape instead (JSON encoders escape C0 only; C1, DEL and the bidirectional overrides
    go out raw): it decodes to the same value, and a terminal shows it inert. Only for
    JSON, where such characters can only be inside strings."""
    return _CONTROL.sub(_json_escape, json_text)


def strip_controls(value: Any) -> Any:
    """`value` with control characters (C0 but tab and newline, DEL, C1, and the
    bidirectional overrides) removed from every string in it, keys included."""
    if isinstance(value, str):
        return _CONTROL.sub("", value)
    if isinstance(value, list):
        return [strip_controls(v) for v in value]
    if isinstance(value, dict):
        return {strip_controls(k): strip_controls(v) for k, v in value.items()}
    return value


def parse_tool_event(data: bytes, *, max_bytes: int = DEFAULT_MAX_REQUEST_BYTES
                     ) -> ToolEventInput:
    """Parse an injected tool event, raising `InvalidRequestError` naming what is wrong."""
    if len(data) > max_bytes:
        raise InvalidRequestError(
            "payload_too_large", f"the tool event is {len(data)} bytes; the limit is "
            f"{max_bytes} bytes")
    body = decode_json(data, what="tool event")
    if not isinstance(body, dict):
        raise InvalidRequestError(
            "invalid_request", f"a tool event must be a JSON object, got {_json_type(body)}")
    unknown = sorted(set(body) - _TOOL_EVENT_KEYS)
    if unknown:
        raise InvalidRequestError(
            "invalid_request", f"unknown field(s) {', '.join(unknown)}; a tool event has "
            "tool_id, arguments, result, idempotency_key and trigger_processing")
    tool_id = body.get("tool_id")
    if not isinstance(tool_id, str) or tool_id.count(":") != 1 or not all(
            is_token(part) for part in tool_id.split(":")):
        raise InvalidRequestError(
            "invalid_request", f"tool_id must be a label written namespace:name (each part 1 "
            f"to 128 of A-Z a-z 0-9 _ -), e.g. injected:bank_statement; got "
            f"{_json_type(tool_id) if not isinstance(tool_id, str) else repr(tool_id[:80])}")
    arguments = body.get("arguments", {})
    if not isinstance(arguments, dict):
        raise InvalidRequestError(
            "invalid_request", f"arguments must be an object, got {_json_type(arguments)}")
    if "result" not in body:
        raise InvalidRequestError("invalid_request", "result is missing: give what the tool "
                                  "would have returned (any JSON)")
    key = body.get("idempotency_key")
    if not isinstance(key, str) or not key.strip() or len(key) > MAX_IDEMPOTENCY_KEY_CHARS:
        got = f"{len(key)} characters" if isinstance(key, str) and key.strip() else \
            _json_type(key)
        raise InvalidRequestError(
            "invalid_request", f"idempotency_key (required) must be a non-empty string of "
            f"at most {MAX_IDEMPOTENCY_KEY_CHARS} characters, got {got}: a retry with the "
            "same key returns the first event instead of storing a second")
    trigger = body.get("trigger_processing", False)
    if not isinstance(trigger, bool):
        raise InvalidRequestError(
            "invalid_request", f"trigger_processing must be true or false, got "
            f"{_json_type(trigger)}")
    clean_key = strip_controls(key)
    if not clean_key.strip():
        raise InvalidRequestError("invalid_request", "idempotency_key is only control "
                                  "characters")
    return ToolEventInput(tool_id=tool_id, arguments=strip_controls(arguments),
                          result=strip_controls(body["result"]), idempotency_key=clean_key,
                          trigger_processing=trigger)
