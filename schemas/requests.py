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
from typing import Any, Final

import msgspec

from schemas.defaults import MAX_CALLS_PER_REQUEST, MAX_JSON_DEPTH, MAX_REQUEST_BYTES
from schemas.errors import InvalidRequestError
from schemas.events import ChatMessage
from schemas.ids import AUTO_REQUEST_PREFIX, is_token

DEFAULT_MAX_REQUEST_BYTES: Final = MAX_REQUEST_BYTES
DEFAULT_MAX_CALLS: Final = MAX_CALLS_PER_REQUEST


class CallInput(msgspec.Struct, frozen=True, kw_only=True):
    tool: str
    arguments: Any = msgspec.field(default_factory=dict)
    reasoning: str | None = None
    output_path: str | None = None
    delegate: str | None = None
    instance: str | None = None


class Request(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str | None
    calls: list[CallInput]
    agent: str | None = None
    # A planner turn instead of explicit calls: what the user says to the agent, and the
    # conversation before it when the client keeps it (`messages`).
    message: str | None = None
    history: list[ChatMessage] = []


MAX_MESSAGE_BYTES: Final = 64 * 1024
_KNOWN_KEYS: Final = frozenset({"request_id", "calls", "agent", "message", "messages"})
META_FIELDS: Final = ("_reasoningForCall", "_outputPath", "_delegate", "_instance")
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
            "calls or message",
        )
    request_id = body.get("request_id")
    if request_id is not None:
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError(
                "invalid_request",
                f"request_id must be a non-empty string, got {_json_type(request_id)}",
            )
        if len(request_id) > 256:
            raise InvalidRequestError("invalid_request", "request_id is longer than 256 characters")
        if request_id.startswith(AUTO_REQUEST_PREFIX):
            raise InvalidRequestError(
                "invalid_request",
                f"request ids starting with {AUTO_REQUEST_PREFIX!r} are reserved for toolbus",
            )
    agent = body.get("agent")
    if agent is not None and not is_token(agent):
        raise InvalidRequestError(
            "invalid_request",
            f"agent {agent!r} is not a valid name: use 1 to 128 characters from A-Z a-z 0-9 _ -",
        )
    if "messages" in body:
        if "message" in body or "calls" in body:
            raise InvalidRequestError(
                "invalid_request", "give calls, message or messages: only one of them")
        said, history = _parse_messages(body["messages"])
        if len(said.encode()) > MAX_MESSAGE_BYTES:
            raise InvalidRequestError(
                "payload_too_large", f"the last message is over {MAX_MESSAGE_BYTES} bytes")
        return Request(request_id=request_id, calls=[], agent=agent, message=said,
                       history=history)
    message = body.get("message")
    if message is not None:
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
        return Request(request_id=request_id, calls=[], agent=agent, message=message)
    calls = body.get("calls")
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
            raise InvalidRequestError("invalid_request", f"{where}.role must be user or "
                                      f"assistant, got {_json_type(role)}")
        if not isinstance(content, str) or not content.strip():
            raise InvalidRequestError("invalid_request", f"{where}.content must be a "
                                      "non-empty string")
        history.append(ChatMessage(role=role, content=content))
    last = history.pop()
    if last.role != "user":
        raise InvalidRequestError("invalid_request", "the last of messages must be the "
                                  "user's (the turn answers it)")
    return last.content, history


def decode_json(data: bytes, *, what: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Decode untrusted JSON within the decoder's limits, or raise `InvalidRequestError`.

    Every way bytes can be unusable maps to one reason: not JSON or not UTF-8
    (`malformed_json`), nested deeper than `max_depth` (`nested_too_deep`)."""
    try:
        body = msgspec.json.decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequestError("malformed_json", f"{what} is not valid JSON (UTF-8): {exc}"
                                  ) from exc
    except RecursionError as exc:
        raise InvalidRequestError("nested_too_deep", f"{what} nests deeper than "
                                  f"{max_depth} levels") from exc
    if json_depth(body, max_depth) > max_depth:
        raise InvalidRequestError("nested_too_deep", f"{what} nests deeper than "
                                  f"{max_depth} levels")
    return body


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
    # Arguments that are not an object are kept: they become a call.rejected naming the
    # call, while the other calls of the request still run.
    return CallInput(tool=tool, arguments=arguments, reasoning=meta["_reasoningForCall"],
                     output_path=path, delegate=meta["_delegate"], instance=meta["_instance"])


def _json_type(value: object) -> str:
    match value:
        case None:
            return "null"
        case bool():
            return "a boolean"
        case int() | float():
            return "a number"
        case str():
            return "a string"
        case list():
            return "an array"
        case dict():
            return "an object"
    return type(value).__name__
