"""OpenAI Responses (`POST {base}/responses`), stateless: the whole conversation is sent
each time (no `previous_response_id`), so a replay of the log rebuilds the same request.

Request: `instructions` (the system text), `input` items, flat `tools: [{type:
"function", name, description, parameters, strict}]` (`strict` is sent either way: this
API defaults it to true, which refuses any schema with optional properties). A turn with
calls is echoed as its reasoning items (if any), its text, then its `function_call` items
`{type, id, call_id, name, arguments}`; each result is `{type: "function_call_output",
call_id, output}`. Calls are keyed on `call_id`; the item `id` (`fc_...`) and the reasoning
items before the call ride in `ToolCall.extra`, because reasoning models refuse a
`function_call` replayed without them.
Reply: `output[]` items (`message` with `output_text` parts, `function_call`,
`reasoning`), `status` (no finish reason: a reply without calls is final), `usage.
{input_tokens, output_tokens}`. Stream: `response.output_item.added`,
`response.output_text.delta`, `response.function_call_arguments.delta`,
`response.output_item.done`, then `response.completed` (or `.incomplete`, `.failed`,
`error`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import msgspec

from actors.llm.convert import (
    Assembly,
    Names,
    WireMemo,
    arguments_json,
    assembled,
    base_url,
    exported_tools,
    joined_system,
    parse_arguments,
    strict_compatible,
    tokens,
)
from actors.llm.openai_chat import DEFAULT_BASE_URL
from actors.llm.transport import WireRequest, decode_json, stream_error
from actors.llm.types import Message, ModelResponse, ModelSettings, ToolCall, Usage
from schemas.errors import ModelError
from schemas.tools import ToolSpec

PROVIDER: Final = "openai-responses"
INCOMPLETE: Final = {"max_output_tokens": "length", "content_filter": "content_filter"}
REASONING_KEYS: Final = ("type", "id", "summary", "content", "encrypted_content")


def build(settings: ModelSettings, *, system: str | None, messages: Sequence[Message],
          tools: Sequence[ToolSpec], tool_choice: str, response_schema: dict[str, Any] | None,
          stream: bool, memo: WireMemo | None = None) -> WireRequest:
    exported, names = exported_tools(PROVIDER, "openai", tools, _functions)
    assembly = assembled(messages, memo, PROVIDER, lambda: _Input(names))
    body: dict[str, Any] = {"model": settings.model, "input": assembly.done()}
    instructions = joined_system(system, assembly.system)
    if instructions:
        body["instructions"] = instructions
    if tools:
        body["tools"] = exported
        body["tool_choice"] = tool_choice
    if settings.temperature is not None:
        body["temperature"] = settings.temperature
    if settings.max_tokens is not None:
        body["max_output_tokens"] = settings.max_tokens
    if response_schema is not None:
        body["text"] = {"format": {"type": "json_schema", "name": "response",
                                   "schema": response_schema,
                                   "strict": strict_compatible(response_schema)}}
    if stream:
        body["stream"] = True
    headers = {"content-type": "application/json", **settings.extra_headers}
    if settings.api_key:
        headers["authorization"] = f"Bearer {settings.api_key}"
    url = base_url(settings.base_url, DEFAULT_BASE_URL)
    return WireRequest(
        provider=PROVIDER, url=f"{url}/responses", headers=headers, body=body,
        parse=lambda data: parse(data, names),
        stream=(lambda: ResponsesStream(names)) if stream else None)


def _functions(exported: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"type": "function", **t["function"],
             "strict": strict_compatible(t["function"]["parameters"])} for t in exported]


class _Input(Assembly):
    """A message's items each, in order; system-role messages go in `instructions`."""

    __slots__ = ()

    def push(self, m: Message) -> None:
        if m.role == "system":
            if m.text:
                self.system.append(m.text)
            return
        self.out += _items(m, self.names)


def _items(m: Message, names: Names) -> list[dict[str, Any]]:
    if m.role == "tool":
        return [{"type": "function_call_output", "call_id": m.tool_call_id, "output": m.text}]
    if m.role == "user" or not m.tool_calls:
        return [{"role": m.role, "content": m.text}]
    calls: list[dict[str, Any]] = []
    for c in m.tool_calls:
        calls.extend(c.extra.get("reasoning") or [])
        item = {"type": "function_call", "call_id": c.id, "name": names.out(c.name),
                "arguments": arguments_json(c)}
        if c.extra.get("id"):
            item["id"] = c.extra["id"]
        calls.append(item)
    if m.text:
        # The text goes before the calls, after the reasoning that led to the first one.
        first = next(i for i, it in enumerate(calls) if it.get("type") == "function_call")
        calls.insert(first, {"role": "assistant", "content": m.text})
    return calls


def parse(data: Any, names: Names) -> ModelResponse:
    if not isinstance(data, dict):
        raise ModelError("unavailable", "the reply is not a response object",
                         provider=PROVIDER, retryable=True)
    if data.get("status") == "failed" or data.get("error"):
        raise stream_error(PROVIDER, data.get("error") or {"message": "the response failed"})
    text: list[str] = []
    calls: list[ToolCall] = []
    reasoning: list[dict[str, Any]] = []
    extra: dict[str, Any] = {}
    for item in data.get("output") or []:
        kind = item.get("type")
        if kind == "message":
            for part in item.get("content") or []:
                if part.get("type") == "output_text":
                    text.append(part.get("text") or "")
                elif part.get("type") == "refusal":  # the answer, when the model refuses
                    text.append(part.get("refusal") or "")
                    extra["refusal"] = part.get("refusal")
        elif kind == "reasoning":
            reasoning.append({k: item[k] for k in REASONING_KEYS if k in item})
        elif kind == "function_call":
            arguments, call_extra = parse_arguments(item.get("arguments"))
            if item.get("id"):
                call_extra["id"] = item["id"]
            if reasoning:
                call_extra["reasoning"], reasoning = reasoning, []
            calls.append(ToolCall(id=item.get("call_id") or item.get("id") or "",
                                  name=names.back(item.get("name") or ""),
                                  arguments=arguments, extra=call_extra))
    status = raw = data.get("status") or "completed"
    if status == "incomplete":
        raw = (data.get("incomplete_details") or {}).get("reason") or "incomplete"
        finish = INCOMPLETE.get(raw, raw)
    else:
        finish = "tool_calls" if calls else "stop"
    usage = data.get("usage")
    return ModelResponse(
        text="".join(text), tool_calls=calls, finish_reason=finish,
        usage=Usage(input_tokens=tokens(usage, "input_tokens"),
                    output_tokens=tokens(usage, "output_tokens")),
        model=data.get("model") or "", latency_ms=0, response_id=data.get("id"),
        extra={"stop_reason": raw, **extra})


class ResponsesStream:
    """Assembles the typed events; the output items are keyed by `output_index`, and the
    final `response` object, when it lists them, is the authority."""

    open_ended = False  # see StreamDecoder

    def __init__(self, names: Names) -> None:
        self.names = names
        self.ended = False
        self.complete = False
        self._items: dict[int, dict[str, Any]] = {}
        self._arguments: dict[int, list[str]] = {}  # a function call's fragments so far
        self._text: list[str] = []  # the text deltas, shown as they came
        self._final: dict[str, Any] = {}

    def feed(self, event: str, data: str) -> str:
        ev = decode_json(data, PROVIDER)
        if not isinstance(ev, dict):
            return ""
        kind = ev.get("type") or event
        index = ev.get("output_index", 0)
        if kind in ("response.output_text.delta", "response.refusal.delta"):
            delta = ev.get("delta") or ""
            if not isinstance(delta, str):
                return ""
            self._text.append(delta)
            return delta
        if kind in ("response.output_item.added", "response.output_item.done"):
            self._items[index] = dict(ev.get("item") or {})
            self._arguments.pop(index, None)  # the item as it stands now
        elif kind == "response.function_call_arguments.delta":
            # Joined at the end: a string grown fragment by fragment costs the square of
            # its length.
            self._items.setdefault(index, {"type": "function_call", "arguments": ""})
            parts = self._arguments.get(index)
            if parts is None:
                start = self._items[index].get("arguments")
                parts = self._arguments[index] = [start] if isinstance(start, str) else []
            parts.append(ev.get("delta") or "")
        elif kind == "response.output_text.done":
            # Kept for servers that never send `output_item.done` for the message.
            item = self._items.setdefault(index, {"type": "message", "content": []})
            if not item.get("content"):
                item["content"] = [{"type": "output_text", "text": ev.get("text") or ""}]
        elif kind in ("response.completed", "response.incomplete"):
            self._final = dict(ev.get("response") or {})
            self.ended = self.complete = True
        elif kind == "response.failed":
            response = ev.get("response") or {}
            raise stream_error(PROVIDER, response.get("error") or {"message": "failed"})
        elif kind == "error":
            # The reference shows `code` and `message` flat; the live API nests them (and
            # the error's `type`) under `error`.
            error = {"code": ev.get("code"), "message": ev.get("message")}
            nested = ev.get("error")
            if isinstance(nested, dict):
                error.update((k, v) for k, v in nested.items() if v)
            raise stream_error(PROVIDER, error)
        return ""

    def result(self) -> ModelResponse:
        for index, parts in self._arguments.items():
            self._items[index]["arguments"] = "".join(parts)
        self._arguments.clear()
        response = dict(self._final)
        if not response.get("output"):
            response["output"] = [self._items[i] for i in sorted(self._items)]
        reply = parse(response, self.names)
        if not reply.text and self._text:
            # A server whose items never carry the text it streamed: the reply is what
            # was shown, not nothing.
            reply = msgspec.structs.replace(reply, text="".join(self._text))
        return reply
