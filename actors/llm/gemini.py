"""Gemini `generateContent` (`POST {base}/models/{model}:generateContent`, streamed as
`:streamGenerateContent?alt=sse`; key in `x-goog-api-key`, never in the URL).

Request: `systemInstruction`, `contents[{role: user | model, parts}]`, `tools:
[{functionDeclarations}]` (the OpenAPI subset schemas/providers.py converts to),
`toolConfig.functionCallingConfig.mode` (AUTO, ANY, NONE), `generationConfig`.
Quirks:
- Function call ids: Gemini 3 gives `functionCall.id`, older models none. A call without
  one gets a deterministic id (same reply, same id), and the id is echoed both in the
  `functionCall` and in its `functionResponse`.
- Thought signatures: a `functionCall` part may carry `thoughtSignature`; it is kept in
  `ToolCall.extra` and echoed verbatim in that part. Gemini 3 refuses a replayed turn
  whose first call has none (e.g. history from another model), so that one gets the
  documented placeholder `skip_thought_signature_validator`.
- Results: a `role: user` content whose parts are all the `functionResponse{name, id,
  response: {output | error}}` of one turn's calls, in one content (Gemini pairs them by
  count); user text after them goes in a content of its own, since Gemini takes a
  content mixing the two for the model's. A result without a tool name is sent with the
  name of the latest call with its id before it.
- Turn order: a function call turn must come right after a user turn or a function
  response turn. A model content with none before it (a tool event injected at the start
  of a session or right after an answer, rendered as the model's call) gets a short user
  content first (`TOOLS_FOLLOW`).
- `finishReason` is `STOP` even when calls are present. Thought-summary parts
  (`thought: true`) are not answer text.
Reply: `candidates[0].content.parts`, `usageMetadata.{promptTokenCount,
candidatesTokenCount, thoughtsTokenCount}`, `responseId`, `modelVersion`. The stream is a
sequence of such responses, each with the new parts; it has no end marker, so it is
whole once a candidate has a `finishReason`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from actors.llm.convert import (
    TOOLS_FOLLOW,
    Assembly,
    Names,
    WireMemo,
    assembled,
    base_url,
    call_names,
    exported_tools,
    joined_system,
    parse_arguments,
    raw_json,
    result_value,
    stable_id,
    tokens,
)
from actors.llm.transport import WireRequest, decode_json, stream_error
from actors.llm.types import Message, ModelResponse, ModelSettings, ToolCall, Usage
from schemas.errors import ModelError
from schemas.tools import ToolSpec

PROVIDER: Final = "gemini"
DEFAULT_BASE_URL: Final = "https://generativelanguage.googleapis.com/v1beta"
SKIP_SIGNATURE: Final = "skip_thought_signature_validator"
MODE: Final = {"auto": "AUTO", "required": "ANY", "none": "NONE"}
FILTERED: Final = frozenset({"SAFETY", "RECITATION", "BLOCKLIST", "PROHIBITED_CONTENT",
                             "SPII", "IMAGE_SAFETY"})


def build(settings: ModelSettings, *, system: str | None, messages: Sequence[Message],
          tools: Sequence[ToolSpec], tool_choice: str, response_schema: dict[str, Any] | None,
          stream: bool, memo: WireMemo | None = None) -> WireRequest:
    exported, names = exported_tools(PROVIDER, "gemini", tools)
    assembly = assembled(messages, memo, PROVIDER, lambda: _Contents(names))
    body: dict[str, Any] = {"contents": assembly.done()}
    instructions = joined_system(system, assembly.system)
    if instructions:
        body["systemInstruction"] = {"parts": [{"text": instructions}]}
    if tools:
        body["tools"] = exported
        body["toolConfig"] = {"functionCallingConfig": {"mode": MODE[tool_choice]}}
    config: dict[str, Any] = {}
    if settings.temperature is not None:
        config["temperature"] = settings.temperature
    if settings.max_tokens is not None:
        config["maxOutputTokens"] = settings.max_tokens
    if response_schema is not None:
        config["responseMimeType"] = "application/json"
        config["responseJsonSchema"] = response_schema
    if config:
        body["generationConfig"] = config
    headers = {"content-type": "application/json", **settings.extra_headers}
    if settings.api_key:
        headers["x-goog-api-key"] = settings.api_key
    model = settings.model.removeprefix("models/")
    url = base_url(settings.base_url, DEFAULT_BASE_URL)
    method = "streamGenerateContent?alt=sse" if stream else "generateContent"
    return WireRequest(
        provider=PROVIDER, url=f"{url}/models/{model}:{method}", headers=headers, body=body,
        parse=lambda data: parse(data, names),
        stream=(lambda: GenerateStream(names)) if stream else None)


_Wire = tuple[str, Any] | None  # ("model" | "user", content) or ("result", part)


class _Contents(Assembly):
    """A run of results shares one user content, kept apart until something else ends it;
    anything else is a content of its own. A result without a tool name takes the name of
    the call it answers: the latest call with its id before it (none: an empty name)."""

    __slots__ = ("by_id", "last", "owns_ids", "results")

    def __init__(self, names: Names) -> None:
        super().__init__(names)
        self.results: list[Any] | None = None
        self.last: str | None = None  # the role of the latest content in `out`
        self.by_id: dict[str, str] = {}
        self.owns_ids = True  # False: `by_id` is shared with the assembly resumed from

    def push(self, m: Message) -> None:
        if m.role == "system":
            if m.text:
                self.system.append(m.text)
            return
        if m.tool_calls:
            if not self.owns_ids:
                self.by_id, self.owns_ids = dict(self.by_id), True
            self.by_id.update(call_names([m]))
        wire = _wire(m, self.names, self.by_id)
        if wire is None:
            return
        kind, value = wire
        if kind == "result":
            if self.results is None:
                self.results = []
            self.results.append(value)
            return
        self._close()
        if kind == "model" and self.last != "user":
            # The first content, or one after the model's: Gemini wants a function call
            # turn right after a user turn (or a function response turn).
            self.out.append({"role": "user", "parts": [{"text": TOOLS_FOLLOW}]})
        self.out.append(value)
        self.last = kind

    def _close(self) -> None:
        if self.results is not None:
            self.out.append({"role": "user", "parts": self.results})
            self.results = None
            self.last = "user"

    def resumed(self) -> _Contents:
        other = super().resumed()
        other.results = None if self.results is None else self.results[:]
        # Shared until either side gets a call of its own, which copies it first.
        other.owns_ids = self.owns_ids = False
        return other

    def freeze(self) -> None:
        super().freeze()
        if self.results is not None:
            self.results[:] = map(raw_json, self.results)


def _wire(m: Message, names: Names, by_id: dict[str, str]) -> _Wire:
    if m.role == "assistant":
        parts: list[dict[str, Any]] = [{"text": m.text}] if m.text else []
        for i, c in enumerate(m.tool_calls):
            part: dict[str, Any] = {"functionCall": {
                "name": names.out(c.name), "args": c.arguments, "id": c.id}}
            signature = c.extra.get("thoughtSignature")
            if signature or i == 0:
                part["thoughtSignature"] = signature or SKIP_SIGNATURE
            parts.append(part)
        return ("model", {"role": "model", "parts": parts}) if parts else None
    if m.role == "tool":
        value = result_value(m.text)
        return "result", {"functionResponse": {
            "name": names.out(m.name or by_id.get(m.tool_call_id or "", "")),
            "id": m.tool_call_id,
            "response": {"error": value} if m.is_error else {"output": value}}}
    if m.text:
        return "user", {"role": "user", "parts": [{"text": m.text}]}
    return None


def _finish(raw: str | None, has_calls: bool) -> str:
    if raw in (None, "STOP", "FINISH_REASON_UNSPECIFIED"):
        return "tool_calls" if has_calls else "stop"
    if raw == "MAX_TOKENS":
        return "length"
    if raw in FILTERED:
        return "content_filter"
    return raw.lower()


def _calls(parts: list[dict[str, Any]], names: Names, response_id: str | None,
           ) -> list[ToolCall]:
    calls: list[ToolCall] = []
    for part in parts:
        function = part.get("functionCall")
        if not function:
            continue
        pname = function.get("name") or ""
        arguments, extra = parse_arguments(function.get("args"))
        if part.get("thoughtSignature"):
            extra["thoughtSignature"] = part["thoughtSignature"]
        call_id = function.get("id") or stable_id("call", response_id, len(calls), pname,
                                                  arguments)
        calls.append(ToolCall(id=call_id, name=names.back(pname), arguments=arguments,
                              extra=extra))
    return calls


def _reply(parts: list[dict[str, Any]], raw_finish: str | None, data: dict[str, Any],
           names: Names) -> ModelResponse:
    response_id = data.get("responseId")
    calls = _calls(parts, names, response_id)
    text = "".join(p.get("text") or "" for p in parts if not p.get("thought"))
    usage = data.get("usageMetadata")
    extra: dict[str, Any] = {"stop_reason": raw_finish}
    block = (data.get("promptFeedback") or {}).get("blockReason")
    if block:
        extra["block_reason"] = block
    return ModelResponse(
        text=text, tool_calls=calls,
        finish_reason="content_filter" if block else _finish(raw_finish, bool(calls)),
        usage=Usage(input_tokens=tokens(usage, "promptTokenCount"),
                    output_tokens=tokens(usage, "candidatesTokenCount",
                                         "thoughtsTokenCount")),
        model=data.get("modelVersion") or "", latency_ms=0, response_id=response_id,
        extra=extra)


def parse(data: Any, names: Names) -> ModelResponse:
    if isinstance(data, list) and data:
        data = data[0]
    if not isinstance(data, dict):
        raise ModelError("unavailable", "the reply is not a response", provider=PROVIDER,
                         retryable=True)
    if data.get("error"):
        raise stream_error(PROVIDER, data["error"])
    candidates = data.get("candidates") or [{}]
    candidate = candidates[0]
    parts = (candidate.get("content") or {}).get("parts") or []
    return _reply(parts, candidate.get("finishReason"), data, names)


class GenerateStream:
    """Accumulates the parts of every chunk; text parts are the deltas."""

    open_ended = True  # see StreamDecoder

    def __init__(self, names: Names) -> None:
        self.names = names
        self.ended = False  # no end marker: read to the end of the stream
        self.complete = False
        self._parts: list[dict[str, Any]] = []
        self._finish: str | None = None
        self._last: dict[str, Any] = {}

    def feed(self, event: str, data: str) -> str:
        chunk = decode_json(data, PROVIDER)
        if isinstance(chunk, list) and chunk:
            chunk = chunk[0]
        if not isinstance(chunk, dict):
            return ""
        if chunk.get("error"):
            raise stream_error(PROVIDER, chunk["error"])
        self._last = {**self._last, **chunk}
        if (chunk.get("promptFeedback") or {}).get("blockReason"):
            self.complete = True
        piece = ""
        for candidate in chunk.get("candidates") or []:
            if candidate.get("index", 0) != 0:
                continue
            for part in (candidate.get("content") or {}).get("parts") or []:
                self._parts.append(part)
                if part.get("text") and not part.get("thought"):
                    piece += part["text"]
            if candidate.get("finishReason"):
                self._finish = candidate["finishReason"]
                self.complete = True
        return piece

    def result(self) -> ModelResponse:
        return _reply(self._parts, self._finish, self._last, self.names)
