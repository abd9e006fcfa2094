"""A scripted fake LLM provider: a real HTTP server (uvicorn, in this process, on a free
port) that answers each request with the next step of a script and records every request.

    async with FakeProvider() as fake:
        fake.script(reply("anthropic", calls=[Call("toolu_1", "ns__tool", {"a": 1})]),
                    error("anthropic", 429, "slow down", headers={"retry-after": "0"}),
                    reply("anthropic", text="done", stream=True))
        ... ModelSettings(provider="anthropic", base_url=fake.base_url("anthropic"), ...)
        fake.requests[0].body["messages"]

It speaks whatever API the client asks for, on any path: the script decides the reply.
The builders below write replies in each API's documented shape (Chat Completions,
Responses, Anthropic Messages, Gemini generateContent), whole or as the API's event
stream, with tool names given as the provider spells them (`ns__tool`). A step can also
break its stream after some events (the connection closes mid-body) or wait before it
answers. With the script empty, the server answers 418 with a message saying so.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs

import uvicorn

Event = tuple[str | None, Any]  # (SSE event name or None, data: JSON value or raw string)


@dataclass
class Step:
    """One scripted reply: a JSON `body`, or `events` sent as server-sent events. With
    `break_after=n` the stream stops after n events without finishing its body."""

    status: int = 200
    body: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    events: list[Event] | None = None
    break_after: int | None = None
    delay_s: float = 0.0


@dataclass
class Received:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]  # lower-case names
    body: Any  # parsed JSON (None if the body was not JSON)
    raw: bytes


@dataclass
class Call:
    """A tool call in a scripted reply; `name` as the provider spells it."""

    id: str
    name: str
    arguments: dict[str, Any]
    signature: str | None = None  # Gemini's thoughtSignature
    item_id: str | None = None  # Responses' `fc_...` item id (default: derived from id)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Any:  # leave the test runner's signal handlers alone
        yield


class FakeProvider:
    def __init__(self) -> None:
        self.steps: deque[Step] = deque()
        self.requests: list[Received] = []
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None
        self.port = 0
        # Answers each request in place of the script when set (the fuzzer's model).
        self.respond: Callable[[Received], Step] | None = None

    # --- the script ------------------------------------------------------------------

    def script(self, *steps: Step) -> None:
        self.steps.extend(steps)

    def reset(self) -> None:
        self.steps.clear()
        self.requests.clear()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def base_url(self, provider: str) -> str:
        return f"{self.url}/v1beta" if provider == "gemini" else f"{self.url}/v1"

    # --- the server ------------------------------------------------------------------

    async def start(self) -> FakeProvider:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        # Listening now, connections queue until uvicorn accepts them: nothing to wait for.
        sock.listen(128)
        config = uvicorn.Config(self._app, interface="asgi3", lifespan="off", log_config=None,
                                log_level="warning", access_log=False, ws="none",
                                timeout_graceful_shutdown=1)
        self._server = _Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        return self

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            async with asyncio.timeout(5):
                await self._task

    async def __aenter__(self) -> FakeProvider:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _app(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        raw = b""
        while True:
            message = await receive()
            raw += message.get("body", b"")
            if not message.get("more_body"):
                break
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        self.requests.append(Received(
            method=scope["method"], path=scope["path"],
            query=parse_qs(scope["query_string"].decode()),
            headers={k.decode().lower(): v.decode() for k, v in scope["headers"]},
            body=body, raw=raw))
        step = self.respond(self.requests[-1]) if self.respond is not None else \
            self.steps.popleft() if self.steps else Step(
            status=418, body={"error": {"message": "the fake provider has no step left "
                                                  "in its script", "type": "script_empty"}})
        if step.delay_s:
            await asyncio.sleep(step.delay_s)
        streaming = step.events is not None
        headers = {"content-type": "text/event-stream" if streaming else "application/json",
                   **step.headers}
        await send({"type": "http.response.start", "status": step.status,
                    "headers": [(k.encode(), v.encode()) for k, v in headers.items()]})
        if step.events is None:
            payload = b"" if step.body is None else json.dumps(step.body).encode()
            await send({"type": "http.response.body", "body": payload})
            return
        for i, (name, data) in enumerate(step.events):
            if step.break_after is not None and i >= step.break_after:
                return  # the body never ends: uvicorn drops the connection
            text = data if isinstance(data, str) else json.dumps(data)
            chunk = (f"event: {name}\n" if name else "") + f"data: {text}\n\n"
            await send({"type": "http.response.body", "body": chunk.encode(),
                        "more_body": True})
        await send({"type": "http.response.body", "body": b""})


# --- replies in each API's shape ---------------------------------------------------------


def _fragments(arguments: dict[str, Any], n: int = 3) -> list[str]:
    """The arguments' JSON cut into n pieces, as providers stream them."""
    text = json.dumps(arguments, separators=(",", ":"))
    size = max(1, -(-len(text) // n))
    return [text[i:i + size] for i in range(0, len(text), size)]


def _chunks(text: str, n: int = 3) -> list[str]:
    if not text:
        return []
    size = max(1, -(-len(text) // n))
    return [text[i:i + size] for i in range(0, len(text), size)]


def chat_body(text: str = "", calls: Sequence[Call] = (), *, model: str = "gpt-test",
              finish: str | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text or None, "refusal": None}
    if calls:
        message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.name, "arguments": json.dumps(c.arguments)}} for c in calls]
    return {"id": "chatcmpl-test1", "object": "chat.completion", "created": 1700000000,
            "model": model, "choices": [{"index": 0, "message": message, "logprobs": None,
                                         "finish_reason": finish or (
                                             "tool_calls" if calls else "stop")}],
            "usage": {"prompt_tokens": 21, "completion_tokens": 9, "total_tokens": 30}}


def chat_events(text_chunks: Iterable[str] = (), calls: Sequence[Call] = (), *,
                model: str = "gpt-test") -> list[Event]:
    base = {"id": "chatcmpl-test2", "object": "chat.completion.chunk", "created": 1700000000,
            "model": model}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> Event:
        return None, {**base, "choices": [{"index": 0, "delta": delta,
                                           "finish_reason": finish}]}

    events = [chunk({"role": "assistant", "content": ""})]
    events += [chunk({"content": piece}) for piece in text_chunks]
    for index, c in enumerate(calls):
        events.append(chunk({"tool_calls": [{"index": index, "id": c.id, "type": "function",
                                             "function": {"name": c.name, "arguments": ""}}]}))
        events += [chunk({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
                   for piece in _fragments(c.arguments)]
    events.append(chunk({}, "tool_calls" if calls else "stop"))
    events.append((None, {**base, "choices": [], "usage": {
        "prompt_tokens": 21, "completion_tokens": 9, "total_tokens": 30}}))
    events.append((None, "[DONE]"))
    return events


def _responses_call_item(c: Call) -> dict[str, Any]:
    return {"type": "function_call", "id": c.item_id or f"fc_{c.id}", "call_id": c.id,
            "name": c.name, "arguments": json.dumps(c.arguments), "status": "completed"}


def _responses_message_item(text: str) -> dict[str, Any]:
    return {"type": "message", "id": "msg_test1", "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def responses_body(text: str = "", calls: Sequence[Call] = (), *, model: str = "gpt-test",
                   reasoning: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    output: list[dict[str, Any]] = list(reasoning)
    if text:
        output.append(_responses_message_item(text))
    output += [_responses_call_item(c) for c in calls]
    return {"id": "resp_test1", "object": "response", "created_at": 1700000000,
            "status": "completed", "error": None, "incomplete_details": None,
            "model": model, "output": output, "parallel_tool_calls": True,
            "usage": {"input_tokens": 21, "output_tokens": 9, "total_tokens": 30}}


def responses_events(text_chunks: Iterable[str] = (), calls: Sequence[Call] = (), *,
                     model: str = "gpt-test") -> list[Event]:
    pieces = list(text_chunks)
    final = responses_body("".join(pieces), calls, model=model)
    shell = {**final, "status": "in_progress", "output": [], "usage": None}
    events: list[Event] = [("response.created", {"type": "response.created",
                                                 "response": shell})]
    index = 0
    if pieces:
        item = _responses_message_item("")
        item["content"] = []
        events.append(("response.output_item.added", {
            "type": "response.output_item.added", "output_index": 0, "item": item}))
        events += [("response.output_text.delta", {
            "type": "response.output_text.delta", "item_id": "msg_test1", "output_index": 0,
            "content_index": 0, "delta": piece}) for piece in pieces]
        events.append(("response.output_item.done", {
            "type": "response.output_item.done", "output_index": 0,
            "item": _responses_message_item("".join(pieces))}))
        index = 1
    for c in calls:
        done = _responses_call_item(c)
        events.append(("response.output_item.added", {
            "type": "response.output_item.added", "output_index": index,
            "item": {**done, "arguments": "", "status": "in_progress"}}))
        events += [("response.function_call_arguments.delta", {
            "type": "response.function_call_arguments.delta", "item_id": done["id"],
            "output_index": index, "delta": piece}) for piece in _fragments(c.arguments)]
        events.append(("response.function_call_arguments.done", {
            "type": "response.function_call_arguments.done", "item_id": done["id"],
            "output_index": index, "arguments": done["arguments"]}))
        events.append(("response.output_item.done", {
            "type": "response.output_item.done", "output_index": index, "item": done}))
        index += 1
    events.append(("response.completed", {"type": "response.completed", "response": final}))
    return events


def anthropic_body(text: str = "", calls: Sequence[Call] = (), *,
                   model: str = "claude-test", thinking: Sequence[dict[str, Any]] = (),
                   ) -> dict[str, Any]:
    content: list[dict[str, Any]] = list(thinking)
    if text:
        content.append({"type": "text", "text": text})
    content += [{"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments}
                for c in calls]
    return {"id": "msg_test1", "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": "tool_use" if calls else "end_turn",
            "stop_sequence": None,
            "usage": {"input_tokens": 21, "output_tokens": 9,
                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}


def anthropic_events(text_chunks: Iterable[str] = (), calls: Sequence[Call] = (), *,
                     model: str = "claude-test") -> list[Event]:
    pieces = list(text_chunks)
    start = {**anthropic_body(model=model), "content": [], "stop_reason": None,
             "usage": {"input_tokens": 21, "output_tokens": 1}}
    events: list[Event] = [("message_start", {"type": "message_start", "message": start})]
    index = 0
    if pieces:
        events.append(("content_block_start", {"type": "content_block_start", "index": 0,
                                               "content_block": {"type": "text",
                                                                 "text": ""}}))
        events.append(("ping", {"type": "ping"}))
        events += [("content_block_delta", {
            "type": "content_block_delta", "index": 0,
            "delta": {"type": "text_delta", "text": piece}}) for piece in pieces]
        events.append(("content_block_stop", {"type": "content_block_stop", "index": 0}))
        index = 1
    for c in calls:
        events.append(("content_block_start", {
            "type": "content_block_start", "index": index,
            "content_block": {"type": "tool_use", "id": c.id, "name": c.name, "input": {}}}))
        events += [("content_block_delta", {
            "type": "content_block_delta", "index": index,
            "delta": {"type": "input_json_delta", "partial_json": piece}})
            for piece in ["", *_fragments(c.arguments)]]
        events.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
        index += 1
    events.append(("message_delta", {
        "type": "message_delta",
        "delta": {"stop_reason": "tool_use" if calls else "end_turn", "stop_sequence": None},
        "usage": {"output_tokens": 9}}))
    events.append(("message_stop", {"type": "message_stop"}))
    return events


def _gemini_call_part(c: Call, with_id: bool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": c.name, "args": c.arguments}
    if with_id:
        function["id"] = c.id
    part: dict[str, Any] = {"functionCall": function}
    if c.signature:
        part["thoughtSignature"] = c.signature
    return part


def gemini_body(text: str = "", calls: Sequence[Call] = (), *, model: str = "gemini-test",
                with_ids: bool = True) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"text": text}] if text else []
    parts += [_gemini_call_part(c, with_ids) for c in calls]
    return {"candidates": [{"content": {"parts": parts, "role": "model"},
                            "finishReason": "STOP", "index": 0}],
            "usageMetadata": {"promptTokenCount": 21, "candidatesTokenCount": 9,
                              "totalTokenCount": 30},
            "modelVersion": model, "responseId": "gemini-resp-1"}


def gemini_events(text_chunks: Iterable[str] = (), calls: Sequence[Call] = (), *,
                  model: str = "gemini-test", with_ids: bool = True) -> list[Event]:
    pieces = list(text_chunks)
    usage = {"promptTokenCount": 21, "candidatesTokenCount": 9, "totalTokenCount": 30}

    def chunk(parts: list[dict[str, Any]], finish: bool = False) -> Event:
        candidate: dict[str, Any] = {"content": {"parts": parts, "role": "model"}, "index": 0}
        if finish:
            candidate["finishReason"] = "STOP"
        return None, {"candidates": [candidate], "usageMetadata": usage,
                      "modelVersion": model, "responseId": "gemini-resp-2"}

    events = [chunk([{"text": piece}]) for piece in pieces]
    if calls:
        # Gemini sends whole function calls, the parallel ones in one chunk.
        events.append(chunk([_gemini_call_part(c, with_ids) for c in calls]))
    events.append(chunk([{"text": ""}], finish=True))
    return events


BODIES = {"openai": chat_body, "openai-responses": responses_body,
          "anthropic": anthropic_body, "gemini": gemini_body}
EVENTS = {"openai": chat_events, "openai-responses": responses_events,
          "anthropic": anthropic_events, "gemini": gemini_events}


def reply(provider: str, text: str = "", calls: Sequence[Call] = (), *,
          stream: bool = False, chunks: Sequence[str] | None = None,
          headers: dict[str, str] | None = None) -> Step:
    """A successful reply in `provider`'s shape; streamed as `chunks` (default: `text`
    cut in three)."""
    if stream:
        return Step(events=EVENTS[provider](chunks if chunks is not None else _chunks(text),
                                            calls), headers=headers or {})
    return Step(body=BODIES[provider](text, calls), headers=headers or {})


def error_body(provider: str, status: int, message: str) -> Any:
    if provider == "anthropic":
        kind = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 429: "rate_limit_error",
                529: "overloaded_error"}.get(status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": message},
                "request_id": "req_test"}
    if provider == "gemini":
        status_name = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED",
                       403: "PERMISSION_DENIED", 429: "RESOURCE_EXHAUSTED",
                       503: "UNAVAILABLE"}.get(status, "INTERNAL")
        return {"error": {"code": status, "message": message, "status": status_name}}
    kind = {400: "invalid_request_error", 401: "invalid_request_error",
            429: "rate_limit_error"}.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": None,
                      "code": "invalid_api_key" if status == 401 else None}}


def error(provider: str, status: int, message: str,
          headers: dict[str, str] | None = None) -> Step:
    return Step(status=status, body=error_body(provider, status, message),
                headers=headers or {})
