"""OpenAI Chat Completions (`POST {base}/chat/completions`), and every server that speaks
it (llama.cpp, vLLM, Ollama, ...) through `base_url`.

Request: `messages` (system first), `tools: [{type: "function", function: {name,
description, parameters, strict?}}]`, `tool_choice`. An assistant turn with calls is echoed
with `tool_calls[{id, type: "function", function: {name, arguments: "<JSON string>"}}]`,
then one `{role: "tool", tool_call_id, content}` per result.
Reply: `choices[0].message.{content, tool_calls}`, `finish_reason`, `usage.{prompt_tokens,
completion_tokens}`. Stream: `chat.completion.chunk`s whose `delta.tool_calls[]` carry an
`index`, the id and name once, and the arguments in fragments; a last chunk with `usage`
(asked for by `stream_options.include_usage`), then `data: [DONE]`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from actors.llm.convert import (
    Assembly,
    Names,
    WireMemo,
    arguments_json,
    assembled,
    base_url,
    exported_tools,
    parse_arguments,
    stable_id,
    strict_compatible,
    tokens,
)
from actors.llm.transport import WireRequest, decode_json, stream_error
from actors.llm.types import Message, ModelResponse, ModelSettings, ToolCall, Usage
from schemas.errors import ModelError
from schemas.tools import ToolSpec

PROVIDER: Final = "openai"
DEFAULT_BASE_URL: Final = "https://api.openai.com/v1"
FINISH: Final = {"stop": "stop", "tool_calls": "tool_calls", "function_call": "tool_calls",
                 "length": "length", "content_filter": "content_filter"}


def build(settings: ModelSettings, *, system: str | None, messages: Sequence[Message],
          tools: Sequence[ToolSpec], tool_choice: str, response_schema: dict[str, Any] | None,
          stream: bool, memo: WireMemo | None = None) -> WireRequest:
    exported, names = exported_tools(PROVIDER, "openai", tools, _strict)
    url = base_url(settings.base_url, DEFAULT_BASE_URL)
    body: dict[str, Any] = {"model": settings.model,
                            "messages": _messages(system, messages, names, memo)}
    if tools:
        body["tools"] = exported
        body["tool_choice"] = tool_choice
    if settings.temperature is not None:
        body["temperature"] = settings.temperature
    if settings.max_tokens is not None:
        # OpenAI's reasoning models refuse `max_tokens`; compatible servers may not know
        # its successor.
        key = "max_completion_tokens" if url == DEFAULT_BASE_URL else "max_tokens"
        body[key] = settings.max_tokens
    if response_schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "response", "schema": response_schema,
            "strict": strict_compatible(response_schema)}}
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    headers = {"content-type": "application/json", **settings.extra_headers}
    if settings.api_key:
        headers["authorization"] = f"Bearer {settings.api_key}"
    return WireRequest(
        provider=PROVIDER, url=f"{url}/chat/completions", headers=headers, body=body,
        parse=lambda data: parse(data, names),
        stream=(lambda: ChatStream(names)) if stream else None)


def _strict(exported: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for tool in exported:
        if strict_compatible(tool["function"]["parameters"]):
            tool["function"]["strict"] = True
    return exported


def _messages(system: str | None, messages: Sequence[Message], names: Names,
              memo: WireMemo | None = None) -> list[Any]:
    out: list[Any] = [{"role": "system", "content": system}] if system else []
    out += assembled(messages, memo, PROVIDER, lambda: _Chat(names)).done()
    return out


class _Chat(Assembly):
    """One message each, system-role ones included, in order."""

    __slots__ = ()

    def push(self, m: Message) -> None:
        self.out.append(_message(m, self.names))


def _message(m: Message, names: Names) -> dict[str, Any]:
    if m.role == "tool":
        return {"role": "tool", "tool_call_id": m.tool_call_id, "content": m.text}
    if m.role == "assistant" and m.tool_calls:
        turn: dict[str, Any] = {"role": "assistant"}
        if m.text:  # optional with calls; some servers refuse an explicit null
            turn["content"] = m.text
        turn["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": names.out(c.name), "arguments": arguments_json(c)}}
            for c in m.tool_calls]
        return turn
    return {"role": m.role, "content": m.text}


def _call(raw_id: Any, pname: str, raw_args: Any, names: Names, position: int,
          response_id: str | None) -> ToolCall:
    arguments, extra = parse_arguments(raw_args)
    # Some compatible servers send calls without an id; every result must name one.
    call_id = raw_id or stable_id("call", response_id, position, pname, raw_args)
    return ToolCall(id=call_id, name=names.back(pname), arguments=arguments, extra=extra)


def _reply(text: str, calls: list[ToolCall], raw_finish: str | None, usage: Any,
           model: str, response_id: str | None, extra: dict[str, Any]) -> ModelResponse:
    finish = FINISH.get(raw_finish or "", raw_finish or "stop")
    if calls and finish == "stop":
        finish = "tool_calls"  # some compatible servers say "stop" with calls
    return ModelResponse(
        text=text, tool_calls=calls, finish_reason=finish,
        usage=Usage(input_tokens=tokens(usage, "prompt_tokens"),
                    output_tokens=tokens(usage, "completion_tokens")),
        model=model, latency_ms=0, response_id=response_id,
        extra={"stop_reason": raw_finish, **extra})


def parse(data: Any, names: Names) -> ModelResponse:
    choices = data.get("choices") if isinstance(data, dict) else None
    if not choices:
        raise ModelError("unavailable", "the reply has no choices", provider=PROVIDER,
                         retryable=True)
    choice = choices[0]
    message = choice.get("message") or {}
    response_id = data.get("id")
    calls = [_call(tc.get("id"), (tc.get("function") or {}).get("name", ""),
                   (tc.get("function") or {}).get("arguments"), names, i, response_id)
             for i, tc in enumerate(message.get("tool_calls") or [])]
    extra = {"refusal": message["refusal"]} if message.get("refusal") else {}
    # A refusal is the model's answer, in a field of its own (`content` is null).
    text = message.get("content") or message.get("refusal") or ""
    return _reply(text, calls, choice.get("finish_reason"),
                  data.get("usage"), data.get("model") or "", response_id, extra)


class ChatStream:
    """Assembles `chat.completion.chunk`s; calls are keyed by their `index`."""

    open_ended = False  # see StreamDecoder

    def __init__(self, names: Names) -> None:
        self.names = names
        self.ended = False
        self.complete = False
        self._text: list[str] = []
        # Per call: its id, its name, and its arguments' fragments (joined at the end: a
        # string grown fragment by fragment costs the square of its length).
        self._calls: dict[int, tuple[list[str], list[str], list[str]]] = {}
        self._last: int | None = None  # the call the latest fragment went to
        self._slots: dict[Any, int] = {}  # an index reused by a new call -> that call
        self._finish: str | None = None
        self._usage: Any = {}
        self._model = ""
        self._id: str | None = None

    def feed(self, event: str, data: str) -> str:
        if data.strip() == "[DONE]":
            self.ended = self.complete = True
            return ""
        chunk = decode_json(data, PROVIDER)
        if not isinstance(chunk, dict):
            return ""
        if chunk.get("error"):
            raise stream_error(PROVIDER, chunk["error"])
        self._id = self._id or chunk.get("id")
        self._model = self._model or chunk.get("model") or ""
        self._usage = chunk.get("usage") or self._usage
        piece = ""
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            piece += delta.get("content") or ""
            piece += delta.get("refusal") or ""  # the answer, when the model refuses
            for fragment in delta.get("tool_calls") or []:
                index = fragment.get("index")
                if index is None:
                    key = self._unindexed(fragment.get("id"))
                else:
                    key = self._indexed(index, fragment.get("id"))
                self._last = key
                ids, names, arguments = self._calls.setdefault(key, ([], [], []))
                if fragment.get("id"):
                    ids[:] = [fragment["id"]]
                function = fragment.get("function") or {}
                name = function.get("name") or ""
                # The name comes whole once; a server that repeats it must not double it.
                if name and name != "".join(names):
                    names.append(name)
                    if len(names) > 64:
                        raise ValueError("a tool call's name in over 64 fragments")
                arguments.append(function.get("arguments") or "")
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]
                self.complete = True
        if piece:
            self._text.append(piece)
        return piece

    def _indexed(self, index: Any, call_id: Any) -> Any:
        """Where a fragment with an `index` goes: that index's call, unless it brings an id
        other than that call's. Then it starts a call of its own, and the index's later
        fragments go to it: Ollama, and a few other compatible servers, give every call of
        a parallel batch `index: 0`."""
        key = self._slots.get(index, index)
        held = self._calls.get(key)
        if held is not None and call_id and held[0] not in ([], [call_id]):
            key = max((k for k in self._calls if isinstance(k, int)), default=-1) + 1
            self._slots[index] = key
        return key

    def _unindexed(self, call_id: Any) -> int:
        """Where a fragment without an `index` goes (some compatible servers send each
        call whole, one per chunk, without one): a new call if it brings an id other
        than the latest call's, else on with the latest."""
        last = self._last
        if last is None or (call_id and self._calls[last][0] not in ([], [call_id])):
            last = max((k for k in self._calls if isinstance(k, int)), default=-1) + 1
        return last

    def result(self) -> ModelResponse:
        calls = [_call("".join(ids), "".join(names), "".join(arguments), self.names, i,
                       self._id)
                 for i, (_, (ids, names, arguments)) in enumerate(sorted(self._calls.items()))]
        return _reply("".join(self._text), calls, self._finish, self._usage, self._model,
                      self._id, {})
