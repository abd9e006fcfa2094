"""A sample model server speaking the OpenAI Chat Completions API, deterministic and fast.

    python -m services.sample_llm --port 8780

`POST /v1/chat/completions` (or `/chat/completions`) answers from the conversation alone:

- the last message is the user's and a tool `--tool` (default `built-in__echo`, the
  provider name of `built-in:echo`) is offered: one call of it, `{"text": <the message>}`;
- the last message is a tool result: a short final text quoting it;
- anything else: a short final text.

With `"stream": true` the reply comes as `chat.completion.chunk` server-sent events, as
OpenAI sends them (role, text deltas, each call's header then its arguments, the finish,
the usage when `stream_options.include_usage` asks, `data: [DONE]`). `GET /v1/models`
lists the one model; `GET /requests` returns the last request bodies received, verbatim,
as a JSON list (at most 16), for checks and for `toolbus bench agent`, which sends the
same bodies directly.

A key: `--api-key KEY`, or `$SAMPLE_LLM_KEY` when set, requires `Authorization: Bearer
KEY` (401 as OpenAI answers otherwise). Point a manifest at it:

    agent_config:
      model: {provider: openai, model: sample, base_url: http://127.0.0.1:8780/v1,
              api_key: "${SAMPLE_LLM_KEY:-}"}

HTTP/1.1 with keep-alive over a bare asyncio protocol: `toolbus bench agent` measures it
as part of its floor, so a request costs tens of microseconds, not a web framework's
hundreds. It answers without awaiting anything, so requests on one connection are
answered in order. It is not part of the runtime.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Final, cast

import msgspec

from services.process import run as run_loop
from services.process import tcp_port

DEFAULT_TOOL: Final = "built-in__echo"
MAX_HEAD: Final = 64 * 1024
MAX_BODY: Final = 32 * 1024 * 1024
RECENT: Final = 16

_REASONS: Final = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
                   405: "Method Not Allowed", 411: "Length Required",
                   413: "Content Too Large", 431: "Request Header Fields Too Large"}
_encode = msgspec.json.encode


# --- what to answer (pure) --------------------------------------------------------------


def _text_of(content: Any) -> str:
    """A message's text: a string, or the text parts of a list of content parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] for p in content
                       if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _offered(body: dict[str, Any]) -> set[str]:
    tools = body.get("tools")
    return {t["function"].get("name", "") for t in tools if isinstance(t, dict)
            and isinstance(t.get("function"), dict)} if isinstance(tools, list) else set()


def completion(body: dict[str, Any], *, tool: str = DEFAULT_TOOL, n: int = 0) -> dict[str, Any]:
    """The `chat.completion` answering `body`; `n` numbers the reply (its ids)."""
    messages = body.get("messages") or []
    last = messages[-1] if messages and isinstance(messages[-1], dict) else {}
    said = _text_of(last.get("content"))
    message: dict[str, Any] = {"role": "assistant", "content": None}
    if last.get("role") == "user" and tool in _offered(body):
        message["tool_calls"] = [{"id": f"call_{n}", "type": "function", "function": {
            "name": tool, "arguments": _encode({"text": said}).decode()}}]
        finish = "tool_calls"
    else:
        heard = "The tool answered" if last.get("role") == "tool" else "You said"
        message["content"] = f"{heard}: {said[:200]}"
        finish = "stop"
    prompt = sum(len(_text_of(m.get("content"))) for m in messages if isinstance(m, dict))
    out = len(message["content"] or "") + sum(
        len(c["function"]["arguments"]) for c in message.get("tool_calls", []))
    return {"id": f"chatcmpl-sample-{n}", "object": "chat.completion", "created": 0,
            "model": body.get("model") or "sample",
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": finish}],
            "usage": {"prompt_tokens": prompt // 4 + 1, "completion_tokens": out // 4 + 1,
                      "total_tokens": prompt // 4 + out // 4 + 2}}


def chunks(reply: dict[str, Any], *, include_usage: bool) -> Iterator[dict[str, Any]]:
    """`reply` as the `chat.completion.chunk`s of `stream: true`."""
    head = {"id": reply["id"], "object": "chat.completion.chunk", "created": 0,
            "model": reply["model"]}
    choice = reply["choices"][0]
    message = choice["message"]

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                     "finish_reason": finish}]}

    yield chunk({"role": "assistant", "content": ""})
    text = message.get("content") or ""
    for start in range(0, len(text), 16):  # a few tokens a chunk
        yield chunk({"content": text[start:start + 16]})
    for i, call in enumerate(message.get("tool_calls") or []):
        yield chunk({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                     "function": {"name": call["function"]["name"],
                                                  "arguments": ""}}]})
        yield chunk({"tool_calls": [{"index": i, "function": {
            "arguments": call["function"]["arguments"]}}]})
    yield chunk({}, choice["finish_reason"])
    if include_usage:
        yield {**head, "choices": [], "usage": reply["usage"]}


def event_stream(reply: dict[str, Any], *, include_usage: bool) -> bytes:
    return b"".join(b"data: " + _encode(c) + b"\n\n"
                    for c in chunks(reply, include_usage=include_usage)) + b"data: [DONE]\n\n"


# --- HTTP -------------------------------------------------------------------------------


def _response(status: int, body: bytes, content_type: str = "application/json", *,
              close: bool = False) -> bytes:
    head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
            f"content-type: {content_type}\r\ncontent-length: {len(body)}\r\n"
            + ("connection: close\r\n" if close else "")
            + ("cache-control: no-cache\r\n" if content_type == "text/event-stream" else "")
            + "\r\n")
    return head.encode() + body


def _error(status: int, message: str, kind: str = "invalid_request_error",
           code: str | None = None, *, close: bool = False) -> bytes:
    return _response(status, _encode({"error": {"message": message, "type": kind,
                                                "param": None, "code": code}}), close=close)


@dataclass
class SampleModel:
    """The server's state: the key it requires, the tool it calls, what it received."""

    tool: str = DEFAULT_TOOL
    api_key: str | None = None
    model: str = "sample"
    recent: collections.deque[bytes] = field(
        default_factory=lambda: collections.deque(maxlen=RECENT))
    _count: Iterator[int] = field(default_factory=itertools.count)

    def handle(self, method: str, path: str, headers: dict[str, str], body: bytes) -> bytes:
        path = path.split("?", 1)[0]
        if path in ("/v1/chat/completions", "/chat/completions"):
            if method != "POST":
                return _error(405, f"{method} {path}: use POST")
            if self.api_key is not None and \
                    headers.get("authorization") != f"Bearer {self.api_key}":
                return _error(401, "Incorrect API key provided.", code="invalid_api_key")
            try:
                request = msgspec.json.decode(body)
            except msgspec.DecodeError as exc:
                return _error(400, f"the body is not JSON: {exc}")
            if not isinstance(request, dict) or not isinstance(request.get("messages"), list):
                return _error(400, "the body needs `messages`, a list")
            self.recent.append(body)
            try:
                reply = completion(request, tool=self.tool, n=next(self._count))
                options = request.get("stream_options")
                usage = isinstance(options, dict) and bool(options.get("include_usage"))
            except (TypeError, AttributeError, KeyError, ValueError) as exc:  # a field's shape
                return _error(400, f"the body is not a chat completion request: {exc}")
            if request.get("stream"):
                return _response(200, event_stream(reply, include_usage=usage),
                                 "text/event-stream")
            return _response(200, _encode(reply))
        if path in ("/v1/models", "/models") and method == "GET":
            return _response(200, _encode({"object": "list", "data": [
                {"id": self.model, "object": "model", "created": 0, "owned_by": "toolbus"}]}))
        if path == "/requests" and method == "GET":
            return _response(200, b"[" + b",".join(self.recent) + b"]")
        return _error(404, f"no route {method} {path}")


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection: requests with a `content-length` body,
    answered in order as each arrives whole."""

    def __init__(self, model: SampleModel) -> None:
        self.model = model
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not `asyncio.Transport` subclasses, but have its methods.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while self.transport is not None and not self.transport.is_closing():
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buf) > MAX_HEAD:
                    self._finish(_error(431, "the request head is too large", close=True))
                return
            lines = bytes(self.buf[:end]).decode("latin-1").split("\r\n")
            try:
                method, target, version = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip()
                           for k, v in (line.split(":", 1) for line in lines[1:] if line)}
                length = int(headers.get("content-length", "0"))
            except ValueError:
                self._finish(_error(400, "malformed request head", close=True))
                return
            if "transfer-encoding" in headers:
                self._finish(_error(411, "send the body with a content-length", close=True))
                return
            if not 0 <= length <= MAX_BODY:
                self._finish(_error(413, f"the body is over {MAX_BODY} bytes", close=True))
                return
            if len(self.buf) < end + 4 + length:
                return  # the rest of the body is on its way
            body = bytes(self.buf[end + 4:end + 4 + length])
            del self.buf[:end + 4 + length]
            close = headers.get("connection", "").lower() == "close" or version == "HTTP/1.0"
            self.transport.write(self.model.handle(method, target, headers, body))
            if close:
                self.transport.close()

    def _finish(self, response: bytes) -> None:
        assert self.transport is not None
        self.transport.write(response)
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None


async def listen(model: SampleModel, *, host: str = "127.0.0.1",
                 port: int = 0) -> asyncio.Server:
    """A server answering for `model` on `host:port` (0: a free port), already listening;
    `serve_forever()` it, or use it in `async with` from an event loop of one's own."""
    return await asyncio.get_running_loop().create_server(lambda: _Connection(model),
                                                          host, port)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.sample_llm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=tcp_port, default=8780)
    p.add_argument("--tool", default=DEFAULT_TOOL,
                   help=f"the provider name of the tool to call (default {DEFAULT_TOOL})")
    p.add_argument("--api-key", default=os.environ.get("SAMPLE_LLM_KEY") or None,
                   help="require `Authorization: Bearer KEY` (default: $SAMPLE_LLM_KEY)")
    args = p.parse_args(argv)
    model = SampleModel(tool=args.tool, api_key=args.api_key)

    async def run() -> int:
        server = await listen(model, host=args.host, port=args.port)
        bound = server.sockets[0].getsockname()[1]
        print(f"sample model server (OpenAI Chat Completions) on http://{args.host}:{bound}/v1",
              file=sys.stderr, flush=True)
        async with server:
            await server.serve_forever()
        return 0

    try:
        return run_loop(run())
    except KeyboardInterrupt:
        return 0
    except OSError as exc:
        print(f"sample model server: cannot listen on {args.host}:{args.port}: "
              f"{exc.strerror or exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
