"""The request format clients publish to `toolbus.req.<session_id>`.

    {"request_id": "optional, any string", "calls": [{"tool": "ns:tool", "arguments": {...}}]}

Parsing is hand-written rather than schema-driven so every refusal names the exact field
that was wrong, in words an LLM or a person can act on.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

from schemas.errors import InvalidRequestError
from schemas.ids import AUTO_REQUEST_PREFIX

DEFAULT_MAX_REQUEST_BYTES: Final = 256 * 1024
DEFAULT_MAX_CALLS: Final = 64


class CallInput(msgspec.Struct, frozen=True, kw_only=True):
    tool: str
    arguments: Any = msgspec.field(default_factory=dict)
    reasoning: str | None = None


class Request(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str | None
    calls: list[CallInput]


_KNOWN_KEYS: Final = frozenset({"request_id", "calls"})
_KNOWN_CALL_KEYS: Final = frozenset({"tool", "arguments", "_reasoningForCall"})


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
    try:
        body = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise InvalidRequestError(
            "malformed_json", f"request body is not valid JSON: {exc}"
        ) from exc
    if not isinstance(body, dict):
        raise InvalidRequestError(
            "invalid_request", f"request must be a JSON object, got {_json_type(body)}"
        )
    unknown = sorted(set(body) - _KNOWN_KEYS)
    if unknown:
        raise InvalidRequestError(
            "invalid_request",
            f"unknown field(s) {', '.join(unknown)}; a request has request_id and calls",
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
        extra = sorted(set(call) - _KNOWN_CALL_KEYS)
        if extra:
            raise InvalidRequestError(
                "invalid_request",
                f"{where} has unknown field(s) {', '.join(extra)}; "
                "a call has tool, arguments and optionally _reasoningForCall",
            )
        tool = call.get("tool")
        if not isinstance(tool, str):
            raise InvalidRequestError(
                "invalid_request", f"{where}.tool must be a string, got {_json_type(tool)}"
            )
        reasoning = call.get("_reasoningForCall")
        if reasoning is not None and not isinstance(reasoning, str):
            raise InvalidRequestError(
                "invalid_request",
                f"{where}._reasoningForCall must be a string, got {_json_type(reasoning)}",
            )
        # Arguments that are not an object are kept: they become a call.rejected naming
        # the call, while the other calls of the request still run.
        parsed.append(
            CallInput(tool=tool, arguments=call.get("arguments", {}), reasoning=reasoning)
        )
    return Request(request_id=request_id, calls=parsed)


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
