"""Anthropic Messages (`POST {base}/messages`, `x-api-key`, `anthropic-version:
2023-06-01`).

Request: top-level `system`, `max_tokens` (required: 4096 unless set), `tools: [{name,
description, input_schema}]`, `tool_choice: {type: auto | any | none}`. A turn with calls
is echoed as `content: [thinking..., text, tool_use{id, name, input}...]`.
Adjacency: every `tool_result` must sit in the user message right after the assistant
message holding its `tool_use`, before any text of that message. So consecutive results
are grouped into one user message, a result that comes after user text is moved ahead
of it, and user text after results joins their message (the API would merge two user
messages anyway). The first message is the user's, and the assistant's follow the
user's: an assistant message with none before it (a tool event injected at the start of
a session or right after an answer, rendered as the assistant's call) gets a short user
message first (`TOOLS_FOLLOW`). Thinking blocks (`thinking` with its `signature`,
`redacted_thinking`) ride in the first call's `extra["thinking"]`: with extended
thinking on, a replayed tool-use turn must start with them.
Reply: `content[]` blocks, `stop_reason` (`tool_use`, `end_turn`, `max_tokens`, ...),
`usage.{input_tokens, output_tokens}` (cache reads and writes are added to the input).
Stream: `message_start`, `content_block_start`, `content_block_delta` (`text_delta`,
`input_json_delta` fragments, `thinking_delta`, `signature_delta`), `content_block_stop`,
`message_delta` (stop reason, output tokens), `message_stop`; `ping`; `error`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Final

from actors.llm.convert import (
    TOOLS_FOLLOW,
    Assembly,
    Names,
    WireMemo,
    assembled,
    base_url,
    exported_tools,
    joined_system,
    parse_arguments,
    raw_json,
    tokens,
)
from actors.llm.transport import WireRequest, decode_json, stream_error
from actors.llm.types import Message, ModelResponse, ModelSettings, ToolCall, Usage
from schemas.errors import ModelError
from schemas.tools import ToolSpec

PROVIDER: Final = "anthropic"
DEFAULT_BASE_URL: Final = "https://api.anthropic.com/v1"
API_VERSION: Final = "2023-06-01"
DEFAULT_MAX_TOKENS: Final = 4096
TOOL_CHOICE: Final = {"auto": "auto", "required": "any", "none": "none"}
FINISH: Final = {"end_turn": "stop", "stop_sequence": "stop", "tool_use": "tool_calls",
                 "max_tokens": "length", "refusal": "content_filter"}
THINKING: Final = ("thinking", "redacted_thinking")


def build(settings: ModelSettings, *, system: str | None, messages: Sequence[Message],
          tools: Sequence[ToolSpec], tool_choice: str, response_schema: dict[str, Any] | None,
          stream: bool, memo: WireMemo | None = None) -> WireRequest:
    exported, names = exported_tools(PROVIDER, "anthropic", tools)
    assembly = assembled(messages, memo, PROVIDER, lambda: _Messages(names))
    body: dict[str, Any] = {"model": settings.model,
                            "max_tokens": settings.max_tokens or DEFAULT_MAX_TOKENS,
                            "messages": assembly.done()}
    instructions = joined_system(system, assembly.system)
    if instructions:
        body["system"] = instructions
    if tools:
        body["tools"] = exported
        body["tool_choice"] = {"type": TOOL_CHOICE[tool_choice]}
    else:
        used = _tools_used(messages, names)
        if used:
            # The API refuses tool_use and tool_result blocks in a request that defines no
            # tools ("... must define tools"): those the history used are declared, and
            # none may be called.
            body["tools"] = used
            body["tool_choice"] = {"type": "none"}
    if settings.temperature is not None:
        body["temperature"] = settings.temperature
    if response_schema is not None:
        body["output_config"] = {"format": {"type": "json_schema", "schema": response_schema}}
    if stream:
        body["stream"] = True
    headers = {"content-type": "application/json", "anthropic-version": API_VERSION,
               **settings.extra_headers}
    if settings.api_key:
        headers["x-api-key"] = settings.api_key
    url = base_url(settings.base_url, DEFAULT_BASE_URL)
    return WireRequest(
        provider=PROVIDER, url=f"{url}/messages", headers=headers, body=body,
        parse=lambda data: parse(data, names),
        stream=(lambda: MessagesStream(names)) if stream else None)


_TOOL_NAME: Final = re.compile(r"[a-zA-Z0-9_-]{1,64}")


def _tools_used(messages: Sequence[Message], names: Names) -> list[dict[str, Any]]:
    """A declaration of each tool the history's calls name (the API's name pattern held),
    or, with results but no such call, of one stand-in."""
    used = dict.fromkeys(pname for m in messages for c in m.tool_calls
                         if _TOOL_NAME.fullmatch(pname := names.out(c.name)))
    if not used and any(m.role == "tool" for m in messages):
        used = {"tool": None}
    return [{"name": n, "input_schema": {"type": "object"}} for n in used]


_Wire = tuple[str, Any] | None  # ("assistant", message) or ("result" | "text", block)


class _Messages(Assembly):
    """Results and text go into user messages; a run of them shares one, its tool results
    first (the API wants them right after the assistant's calls), then its text. The open
    run is kept apart until something else ends it."""

    __slots__ = ("last", "results", "texts")

    def __init__(self, names: Names) -> None:
        super().__init__(names)
        self.results: list[Any] | None = None
        self.texts: list[Any] = []
        self.last: str | None = None  # the role of the latest message in `out`

    def push(self, m: Message) -> None:
        if m.role == "system":
            if m.text:
                self.system.append(m.text)
            return
        wire = _wire(m, self.names)
        if wire is None:
            return
        kind, value = wire
        if kind == "assistant":
            self._close()
            if self.last != "user":  # the first message, or one after the assistant's
                self.out.append({"role": "user",
                                 "content": [{"type": "text", "text": TOOLS_FOLLOW}]})
            self.out.append(value)
            self.last = "assistant"
            return
        if self.results is None:
            self.results, self.texts = [], []
        (self.results if kind == "result" else self.texts).append(value)

    def _close(self) -> None:
        if self.results is not None:
            self.out.append({"role": "user", "content": self.results + self.texts})
            self.results, self.texts = None, []
            self.last = "user"

    def resumed(self) -> _Messages:
        other = super().resumed()
        other.results = None if self.results is None else self.results[:]
        other.texts = self.texts[:]
        return other

    def freeze(self) -> None:
        super().freeze()
        if self.results is not None:
            self.results[:] = map(raw_json, self.results)
        self.texts[:] = map(raw_json, self.texts)


def _wire(m: Message, names: Names) -> _Wire:
    if m.role == "assistant":
        blocks: list[dict[str, Any]] = []
        for c in m.tool_calls:
            blocks.extend(c.extra.get("thinking") or [])
        if m.text:
            blocks.append({"type": "text", "text": m.text})
        blocks += [{"type": "tool_use", "id": c.id, "name": names.out(c.name),
                    "input": c.arguments} for c in m.tool_calls]
        # The API refuses empty text blocks; an empty turn says nothing.
        return ("assistant", {"role": "assistant", "content": blocks}) if blocks else None
    if m.role == "tool":
        block: dict[str, Any] = {"type": "tool_result", "tool_use_id": m.tool_call_id,
                                 "is_error": m.is_error}
        if m.text:
            block["content"] = m.text
        return "result", block
    if m.text:
        return "text", {"type": "text", "text": m.text}
    return None


def parse(data: Any, names: Names) -> ModelResponse:
    if not isinstance(data, dict):
        raise ModelError("unavailable", "the reply is not a message", provider=PROVIDER,
                         retryable=True)
    if data.get("type") == "error":
        raise stream_error(PROVIDER, data.get("error"))
    text: list[str] = []
    calls: list[ToolCall] = []
    thinking: list[dict[str, Any]] = []
    for block in data.get("content") or []:
        kind = block.get("type")
        if kind == "text":
            text.append(block.get("text") or "")
        elif kind in THINKING:
            thinking.append(block)
        elif kind == "tool_use":
            arguments, extra = parse_arguments(block.get("input"))
            if thinking:
                extra["thinking"], thinking = thinking, []
            calls.append(ToolCall(id=block.get("id") or "", name=names.back(block.get("name")
                                                                             or ""),
                                  arguments=arguments, extra=extra))
    raw = data.get("stop_reason")
    usage = data.get("usage")
    input_tokens = tokens(usage, "input_tokens", "cache_creation_input_tokens",
                          "cache_read_input_tokens")
    return ModelResponse(
        text="".join(text), tool_calls=calls, finish_reason=FINISH.get(raw or "", raw or "stop"),
        usage=Usage(input_tokens=input_tokens, output_tokens=tokens(usage, "output_tokens")),
        model=data.get("model") or "", latency_ms=0, response_id=data.get("id"),
        extra={"stop_reason": raw})


class MessagesStream:
    """Assembles the content blocks by `index`; tool input is the concatenation of its
    `input_json_delta` fragments, parsed at `content_block_stop`."""

    open_ended = False  # see StreamDecoder

    def __init__(self, names: Names) -> None:
        self.names = names
        self.ended = False
        self.complete = False
        self._message: dict[str, Any] = {}
        self._blocks: dict[int, dict[str, Any]] = {}
        # A block's fragments (`input_json`, `text`, `thinking`), joined when it ends: a
        # string grown fragment by fragment costs the square of its length.
        self._parts: dict[tuple[int, str], list[str]] = {}
        self._usage: dict[str, Any] = {}

    def feed(self, event: str, data: str) -> str:
        ev = decode_json(data, PROVIDER)
        if not isinstance(ev, dict):
            return ""
        kind = ev.get("type") or event
        index = ev.get("index", 0)
        if kind == "message_start":
            self._message = dict(ev.get("message") or {})
            self._add_usage(self._message.get("usage"))
        elif kind == "content_block_start":
            self._blocks[index] = dict(ev.get("content_block") or {})
            for key in ("text", "thinking", "input"):  # a block restarted at this index
                self._parts.pop((index, key), None)
        elif kind == "content_block_delta":
            return self._delta(index, ev.get("delta") or {})
        elif kind == "content_block_stop":
            self._join(index)
        elif kind == "message_delta":
            self._message.update(ev.get("delta") or {})
            self._add_usage(ev.get("usage"))
        elif kind == "message_stop":
            self.ended = self.complete = True
        elif kind == "error":
            raise stream_error(PROVIDER, ev.get("error"))
        return ""

    def _add_usage(self, usage: Any) -> None:
        # A null count says nothing: `message_delta` sends `"input_tokens": null` (and
        # nulls for the cache counts), which must not erase those of `message_start`.
        if isinstance(usage, dict):  # otherwise no count (see `tokens`)
            self._usage.update((k, v) for k, v in usage.items() if v is not None)

    def _delta(self, index: int, delta: dict[str, Any]) -> str:
        self._blocks.setdefault(index, {"type": "text", "text": ""})
        kind = delta.get("type")
        if kind == "text_delta":
            piece = delta.get("text") or ""
            if not isinstance(piece, str):
                raise TypeError(f"a text delta that is not text: {type(piece).__name__}")
            self._part(index, "text").append(piece)
            return piece
        if kind == "input_json_delta":
            self._part(index, "input").append(delta.get("partial_json") or "")
        elif kind == "thinking_delta":
            self._part(index, "thinking").append(delta.get("thinking") or "")
        elif kind == "signature_delta":
            self._blocks[index]["signature"] = delta.get("signature")
        return ""

    def _part(self, index: int, key: str) -> list[str]:
        parts = self._parts.get((index, key))
        if parts is None:
            # What the block started with comes first (a tool_use's `input` is `{}`
            # until its JSON comes, and is replaced by it).
            start = self._blocks[index].get(key)
            parts = self._parts[(index, key)] = (
                [start] if key != "input" and isinstance(start, str) and start else [])
        return parts

    def _join(self, index: int) -> None:
        """Put the block's fragments into it: a tool_use's input as the JSON text (parsed
        by `parse`), only if some came."""
        block = self._blocks.get(index)
        for key in ("text", "thinking", "input"):
            parts = self._parts.pop((index, key), None)
            if parts and block is not None:
                block[key] = "".join(parts)

    def result(self) -> ModelResponse:
        for index in list(self._blocks):
            self._join(index)
        message = {**self._message, "usage": self._usage,
                   "content": [self._blocks[i] for i in sorted(self._blocks)]}
        return parse(message, self.names)
