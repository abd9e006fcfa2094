"""A broken or hostile model server cannot crash, wedge or bloat a model call: whatever it
sends, `complete` returns a reply every field of which is of its type (so the stored
`model.responded` reads back), or raises a `ModelError` that quotes no key.

The server is a real socket speaking raw HTTP/1.1, so it can send what no well-behaved
server library would: bytes that are not UTF-8, JSON nested a thousand deep, a stream that
never ends, a body larger than any reply should be.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import tracemalloc
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import msgspec
import pytest

from actors.llm import Message, ModelSettings, complete, transport
from actors.llm.retry import http_error, redact
from schemas.defaults import MAX_JSON_DEPTH
from schemas.errors import ModelError
from schemas.events import ModelResponded

KEY = "sk-hostile-0123456789abcdef"
Reply = Callable[[asyncio.StreamWriter], Awaitable[None]]


class RawServer:
    def __init__(self) -> None:
        self.reply: Reply | None = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            await reader.readexactly(length)
            assert self.reply is not None
            await self.reply(writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


@pytest.fixture
async def server() -> AsyncIterator[tuple[RawServer, int]]:
    raw = RawServer()
    srv = await asyncio.start_server(raw._handle, "127.0.0.1", 0)
    try:
        yield raw, srv.sockets[0].getsockname()[1]
    finally:
        srv.close()


def body(data: bytes, status: int = 200, ctype: str = "application/json", *,
         every_s: float = 0.0) -> Reply:
    """`data` as the whole body; with `every_s`, only its first byte, then silence."""
    async def send(w: asyncio.StreamWriter) -> None:
        w.write(f"HTTP/1.1 {status} X\r\ncontent-type: {ctype}\r\ncontent-length: "
                f"{len(data)}\r\nconnection: close\r\n\r\n".encode()
                + (data[:1] if every_s else data))
        await w.drain()
        await asyncio.sleep(every_s)
    return send


def events(chunks: list[bytes], *, every_s: float = 0.0, forever: bytes | None = None) -> Reply:
    async def send(w: asyncio.StreamWriter) -> None:
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"connection: close\r\n\r\n")
        for chunk in chunks:
            w.write(chunk)
            await w.drain()
            await asyncio.sleep(every_s)
        while forever is not None:
            w.write(forever)
            await w.drain()
            await asyncio.sleep(every_s)
    return send


def sse(value: Any) -> bytes:
    return b"data: " + json.dumps(value).encode() + b"\n\n"


async def ask(port: int, provider: str = "openai", *, stream: bool = False,
              timeout_s: float = 5.0) -> tuple[Any, list[Any]]:
    settings = ModelSettings(provider=provider, model="m", api_key=KEY, max_retries=0,
                             timeout_s=timeout_s, base_url=f"http://127.0.0.1:{port}")
    deltas: list[Any] = []

    async def on_delta(text: str) -> None:
        deltas.append(text)

    try:
        return await complete(settings, system=None, messages=[Message(role="user",
                                                                       text="hi")],
                              tools=[], on_delta=on_delta if stream else None), deltas
    except ModelError as exc:
        assert KEY not in str(exc) and KEY not in repr(exc.__cause__)
        return exc, deltas


def chat(message: dict[str, Any], **top: Any) -> bytes:
    return json.dumps({"id": "c1", "choices": [{"index": 0, "message": message,
                                                "finish_reason": "stop"}], **top}).encode()


@pytest.mark.parametrize(("reply", "words"), [
    # Fields of the wrong type: refused, never stored as an event that cannot be read.
    (chat({"content": 5}), "does not have the API's shape"),
    (chat({"content": "x", "tool_calls": [{"id": 5, "function": {"name": "a__b",
                                                                 "arguments": "{}"}}]}),
     "does not have the API's shape"),
    (chat({"content": ["x"]}), "does not have the API's shape"),
    # Not JSON in any way it could be read.
    (b"\xff\xfe not utf-8", "not JSON"),
    (b"[" * 5000 + b"]" * 5000, "not JSON (nested too deeply)"),
    # Too much of it.
    (chat({"content": "x", "tool_calls": [
        {"id": f"c{i}", "function": {"name": "a__b", "arguments": "{}"}}
        for i in range(transport.MAX_CALLS_PER_REPLY + 1)]}), "tool calls in one reply"),
    (chat({"content": "x", "tool_calls": [{"id": "c" * 600, "function": {
        "name": "a__b", "arguments": "{}"}}]}), "over 512 characters"),
])
async def test_a_reply_the_planner_could_not_store_is_a_model_error(
        server: tuple[RawServer, int], reply: bytes, words: str) -> None:
    raw, port = server
    raw.reply = body(reply)
    got, _ = await ask(port)
    assert isinstance(got, ModelError) and got.kind == "unavailable", got
    assert words in got.message


async def test_arguments_nested_too_deeply_are_kept_as_not_json_for_the_model(
        server: tuple[RawServer, int]) -> None:
    # As any arguments that are not a JSON object: the planner refuses the call and tells
    # the model, which sees what it sent.
    raw, port = server
    deep = "[" * 5000 + "]" * 5000
    raw.reply = body(chat({"content": "x", "tool_calls": [{"id": "c", "function": {
        "name": "a__b", "arguments": deep}}]}))
    got, _ = await ask(port)
    (call,) = got.tool_calls
    assert call.arguments == {} and call.extra["invalid_arguments"] == deep


async def test_json_deeper_than_a_request_may_nest_is_not_stored(
        server: tuple[RawServer, int]) -> None:
    # Arguments at most MAX_JSON_DEPTH levels deep, as a client's: deeper (940 levels
    # decoded here), storing the `model.responded` holding them raised RecursionError
    # in the planner, which failed the turn `internal`.
    raw, port = server
    deep = "[" * 940 + "]" * 940
    raw.reply = body(chat({"content": "x", "tool_calls": [{"id": "c", "function": {
        "name": "a__b", "arguments": deep}}]}))
    got, _ = await ask(port)
    (call,) = got.tool_calls
    assert call.arguments == {} and call.extra["invalid_arguments"] == deep
    # Already an object (Anthropic's `input`): refused as a call, back to the model;
    # deeper than 128 anywhere in the reply: the reply is refused.
    nested: Any = 1
    for _ in range(MAX_JSON_DEPTH + 1):
        nested = {"k": nested}
    raw.reply = body(json.dumps({"content": [{"type": "tool_use", "id": "t", "name": "a__b",
                                              "input": nested["k"]}]}).encode())
    got, _ = await ask(port, "anthropic")
    assert not isinstance(got, ModelError), got  # 64 levels: as deep as may be
    raw.reply = body(json.dumps({"content": [{"type": "tool_use", "id": "t", "name": "a__b",
                                              "input": nested}]}).encode())
    got, _ = await ask(port, "anthropic")
    assert not isinstance(got, ModelError), got
    (call,) = got.tool_calls
    assert call.arguments == {} and "deeper than 64 levels" in call.extra["invalid_arguments"]
    raw.reply = body(json.dumps({"content": [
        {"type": "thinking", "thinking": "", "signature": json.loads("[" * 130 + "]" * 130)},
        {"type": "tool_use", "id": "t", "name": "a__b", "input": {}}]}).encode())
    got, _ = await ask(port, "anthropic")
    assert isinstance(got, ModelError) and "deeper than 128 levels" in got.message, got


async def test_odd_token_counts_count_as_none_and_the_answer_stores(
        server: tuple[RawServer, int]) -> None:
    raw, port = server
    raw.reply = body(chat({"content": "fine"}, usage={"prompt_tokens": -5,
                                                      "completion_tokens": 1e308}))
    got, _ = await ask(port)
    assert got.text == "fine" and (got.usage.input_tokens, got.usage.output_tokens) == (0, 0)
    # What the planner stores of it reads back.
    event = ModelResponded(session_id="s", at=0.0, actor="planner", turn_id="t",
                           iteration=1, text=got.text, finish_reason=got.finish_reason,
                           input_tokens=got.usage.input_tokens,
                           output_tokens=got.usage.output_tokens)
    assert msgspec.json.decode(msgspec.json.encode(event), type=ModelResponded) == event


async def test_an_error_body_that_is_not_utf8_and_quotes_the_key_is_a_clean_error(
        server: tuple[RawServer, int]) -> None:
    raw, port = server
    raw.reply = body(b'{"error": {"message": "bad key ' + KEY.encode() + b'\xff"}}',
                     status=500)
    got, _ = await ask(port)
    assert isinstance(got, ModelError) and got.status == 500 and KEY not in got.message


async def test_a_404_names_the_url_posted_to_and_points_at_base_url(
        server: tuple[RawServer, int]) -> None:
    # A wrong base_url (or provider): the server's own 404 said nothing of where.
    raw, port = server
    raw.reply = body(b"404: Not Found", status=404, ctype="text/plain")
    got, _ = await ask(port)
    assert isinstance(got, ModelError) and got.status == 404 and got.kind == "bad_request"
    assert f"there is no openai API at http://127.0.0.1:{port}/chat/completions: " \
        "check the model's base_url and provider" in str(got), got


async def test_a_reply_over_the_size_limit_is_refused(server: tuple[RawServer, int],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transport, "MAX_REPLY_BYTES", 100_000)
    raw, port = server
    raw.reply = body(chat({"content": "x" * 200_000}))
    got, _ = await ask(port)
    assert isinstance(got, ModelError) and "over 100000 bytes" in got.message
    # The same for a stream that goes on and on.
    raw.reply = events([], forever=sse({"choices": [{"index": 0, "delta": {
        "content": "y" * 1000}}]}))
    got, deltas = await ask(port, stream=True)
    assert isinstance(got, ModelError) and "over 100000 bytes" in got.message
    assert got.kind == "partial_stream" and 50 < len(deltas) < 110


@pytest.mark.parametrize("stream", [False, True])
async def test_a_gzip_bomb_is_refused_without_inflating_it_whole(
        server: tuple[RawServer, int], stream: bool) -> None:
    # 512 MiB of zeros in half a megabyte, `content-encoding: gzip`. aiohttp before 3.13.3
    # (CVE-2025-69223) inflated each chunk the socket gave whole, some 125 MiB per read,
    # before the reply's size was counted: a bound of 16 MiB that held nothing.
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    data = b"".join([packer.compress(bytes(1 << 20)) for _ in range(512)] + [packer.flush()])
    ctype = "text/event-stream" if stream else "application/json"

    async def send(w: asyncio.StreamWriter) -> None:
        w.write(f"HTTP/1.1 200 OK\r\ncontent-type: {ctype}\r\ncontent-encoding: gzip\r\n"
                f"content-length: {len(data)}\r\nconnection: close\r\n\r\n".encode() + data)
        await w.drain()
    raw, port = server
    raw.reply = send
    tracemalloc.start()
    try:
        got, _ = await ask(port, stream=stream)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert isinstance(got, ModelError) and "over 16777216 bytes" in got.message, got
    assert peak < 3 * transport.MAX_REPLY_BYTES, f"{peak / 2**20:.0f} MiB at the peak"


@pytest.mark.parametrize("provider", ["openai", "openai-responses", "anthropic", "gemini"])
@pytest.mark.parametrize("line", [b"x" * 65536, b"x" * 1000 + b"\ndata: "],
                         ids=["one-line", "no-blank-line"])
async def test_an_event_that_never_ends_is_refused_at_the_size_limit(
        server: tuple[RawServer, int], monkeypatch: pytest.MonkeyPatch, provider: str,
        line: bytes) -> None:
    # A `data:` line with no end of line, or `data:` lines with no blank line after them:
    # httpx-sse kept all of it in memory until the event ended, before any count.
    monkeypatch.setattr(transport, "MAX_REPLY_BYTES", 100_000)
    raw, port = server
    raw.reply = events([b"data: ", *[line] * (3_000_000 // len(line))])  # then it closes
    started = time.monotonic()
    got, _ = await ask(port, provider, stream=True)
    assert isinstance(got, ModelError) and "over 100000 bytes" in got.message, got
    assert time.monotonic() - started < 4


async def test_events_cut_anywhere_read_the_same(server: tuple[RawServer, int]) -> None:
    # CRLF, CR and LF line ends; a CRLF and a UTF-8 character split between two reads;
    # comments, an id and a field without a colon; an event with no data, which is none
    # (once an `id:` had come, httpx-sse made every later blank line an event with empty
    # data, which is not JSON); an event no blank line ends.
    chunk = json.dumps({"id": "c", "choices": [{"index": 0, "delta": {
        "content": "h\u00e9llo \u2603"}}]}, ensure_ascii=False).encode()
    done = json.dumps({"id": "c", "choices": [{"index": 0, "delta": {},
                                               "finish_reason": "stop"}]}).encode()
    cut = chunk.index("\u2603".encode()) + 1
    raw, port = server
    raw.reply = events([b": hello\r\nid: 1\r\ndata: ", chunk[:cut], chunk[cut:], b"\r",
                        b"\n\r", b"\ndata: " + done + b"\r\rfoo\n\n", b"data: [DO",
                        b"NE]\n", b"\n", b"data: [DONE]"], every_s=0.01)
    got, deltas = await ask(port, stream=True)
    assert not isinstance(got, ModelError), got
    assert got.text == "h\u00e9llo \u2603" == "".join(deltas)


@pytest.mark.parametrize(("provider", "last"), [
    ("openai", b"data: [DONE]\n\n"),
    ("anthropic", b'event: message_stop\ndata: {"type": "message_stop"}\n\n'),
    ("openai-responses", b'data: {"type": "response.completed", "response": {"id": "r", '
                         b'"status": "completed", "output": [{"type": "message", "content": '
                         b'[{"type": "output_text", "text": "hi"}]}]}}\n\n'),
])
async def test_a_stream_kept_open_after_its_last_event_is_a_whole_reply(
        server: tuple[RawServer, int], provider: str, last: bytes) -> None:
    # The reply was whole; waiting for the end of the body failed it (`partial_stream`
    # after a read timeout), and the planner asked the model again.
    first = {"openai": sse({"id": "c", "choices": [{"index": 0, "delta": {"content": "hi"},
                                                    "finish_reason": "stop"}]}),
             "anthropic": sse({"type": "message_start", "message": {"id": "m"}})
             + sse({"type": "content_block_start", "index": 0,
                    "content_block": {"type": "text", "text": ""}})
             + sse({"type": "content_block_delta", "index": 0,
                    "delta": {"type": "text_delta", "text": "hi"}}),
             "openai-responses": sse({"type": "response.output_text.delta",
                                      "output_index": 0, "delta": "hi"})}[provider]
    raw, port = server
    raw.reply = events([first + last], every_s=30)
    started = time.monotonic()
    got, deltas = await ask(port, provider, stream=True, timeout_s=5)
    assert not isinstance(got, ModelError), got
    assert got.text == "hi" and deltas == ["hi"]
    assert time.monotonic() - started < 3


async def test_a_gemini_stream_kept_open_after_its_last_chunk_is_a_whole_reply(
        server: tuple[RawServer, int]) -> None:
    # Gemini's stream has no last event: it ends with the body. A server that keeps it
    # open after the chunk with `finishReason` failed the reply at the read timeout
    # (`partial_stream`, asked again, then `model_error`); chunks that follow the finish
    # promptly (the usage) are still read.
    def chunk(value: dict[str, Any]) -> bytes:
        return sse(value)
    raw, port = server
    raw.reply = events([chunk({"candidates": [{"content": {"parts": [{"text": "hi"}]}}]}),
                        chunk({"candidates": [{"content": {"parts": [{"text": "!"}]},
                                               "finishReason": "STOP"}]}),
                        chunk({"usageMetadata": {"promptTokenCount": 5,
                                                 "candidatesTokenCount": 2}})],
                       every_s=0.05, forever=b": keep-alive\n\n")
    started = time.monotonic()
    got, deltas = await ask(port, "gemini", stream=True, timeout_s=5)
    assert not isinstance(got, ModelError), got
    assert got.text == "hi!" and deltas == ["hi", "!"]
    assert got.usage.input_tokens == 5 and got.usage.output_tokens == 2
    assert time.monotonic() - started < 3


async def test_parallel_calls_streamed_without_an_index_stay_apart(
        server: tuple[RawServer, int]) -> None:
    # Some compatible servers send each call whole, one per chunk, with no `index`: they
    # were joined into one call, with the last id and the arguments '{"n": 1}{"n": 2}'.
    def call(i: int) -> bytes:
        return sse({"id": "c", "choices": [{"index": 0, "delta": {"tool_calls": [
            {"id": f"call_{i}", "type": "function",
             "function": {"name": "a__b", "arguments": json.dumps({"n": i})}}]}}]})
    raw, port = server
    raw.reply = events([call(1), call(2), sse({"id": "c", "choices": [
        {"index": 0, "delta": {"tool_calls": [{"function": {"arguments": ""}}]},
         "finish_reason": "tool_calls"}]}), b"data: [DONE]\n\n"])
    got, _ = await ask(port, stream=True)
    assert not isinstance(got, ModelError), got
    assert [(c.id, c.arguments) for c in got.tool_calls] == [("call_1", {"n": 1}),
                                                              ("call_2", {"n": 2})]


async def test_parallel_calls_streamed_all_at_index_0_stay_apart(
        server: tuple[RawServer, int]) -> None:
    # Ollama (ollama/ollama#15457) and some other compatible servers give every call of a
    # parallel batch `index: 0`, each starting with its own id: they were joined into one
    # call, with the last id, both names run together and the arguments '{...}{...}'.
    def chunk(fragment: dict[str, Any], finish: str | None = None) -> bytes:
        return sse({"id": "c", "choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, **fragment}]}, "finish_reason": finish}]})
    raw, port = server
    raw.reply = events([
        chunk({"id": "call_1", "type": "function",
               "function": {"name": "a__b", "arguments": '{"n": '}}),
        chunk({"function": {"arguments": "1}"}}),
        chunk({"id": "call_2", "type": "function",
               "function": {"name": "c__d", "arguments": '{"n": 2}'}}),
        chunk({"id": "call_2", "function": {"arguments": ""}}, "tool_calls"),
        b"data: [DONE]\n\n"])
    got, _ = await ask(port, stream=True)
    assert not isinstance(got, ModelError), got
    assert [(c.id, c.name, c.arguments) for c in got.tool_calls] == [
        ("call_1", "a:b", {"n": 1}), ("call_2", "c:d", {"n": 2})]


async def test_a_responses_stream_whose_items_lack_its_text_answers_the_text_shown(
        server: tuple[RawServer, int]) -> None:
    raw, port = server
    raw.reply = events([sse({"type": "response.output_text.delta", "output_index": 0,
                             "delta": "Hel"}),
                        sse({"type": "response.output_text.delta", "output_index": 0,
                             "delta": "lo"}),
                        sse({"type": "response.completed", "response": {
                            "id": "r", "status": "completed", "output": []}})])
    got, deltas = await ask(port, "openai-responses", stream=True)
    assert not isinstance(got, ModelError), got
    assert got.text == "Hello" == "".join(deltas)


async def test_a_stream_that_never_ends_ends_the_attempt_after_its_deadline(
        server: tuple[RawServer, int], monkeypatch: pytest.MonkeyPatch) -> None:
    # Each read is on time (a ping every 0.05 s, under timeout_s), so only the deadline
    # of the whole attempt can end it.
    monkeypatch.setattr(transport, "ATTEMPT_DEADLINE_FACTOR", 2)
    raw, port = server
    raw.reply = events([b"event: message_start\ndata: " + json.dumps({
        "type": "message_start", "message": {"id": "m", "usage": {}}}).encode() + b"\n\n"],
        every_s=0.05, forever=b'event: ping\ndata: {"type": "ping"}\n\n')
    started = time.monotonic()
    got, _ = await ask(port, "anthropic", stream=True, timeout_s=0.5)
    assert isinstance(got, ModelError) and got.kind == "unavailable" and got.retryable
    assert "no whole reply within 1 s (2 x timeout_s)" in got.message
    assert 0.9 < time.monotonic() - started < 5


async def test_many_small_fragments_cost_linear_time(server: tuple[RawServer, int]) -> None:
    # A string grown fragment by fragment costs the square of its length: 100,000
    # fragments of a call's arguments took seconds; joined at the end, a fraction of one.
    n = 100_000
    start = {"type": "content_block_start", "index": 0, "content_block": {
        "type": "tool_use", "id": "t1", "name": "a__b", "input": {}}}
    frag = {"type": "content_block_delta", "index": 0,
            "delta": {"type": "input_json_delta", "partial_json": " "}}
    raw, port = server
    raw.reply = events([sse({"type": "message_start", "message": {"id": "m"}}), sse(start),
                        sse(frag) * n, sse({"type": "content_block_delta", "index": 0,
                                            "delta": {"type": "input_json_delta",
                                                      "partial_json": '{"k": 1}'}}),
                        sse({"type": "content_block_stop", "index": 0}),
                        sse({"type": "message_delta", "delta": {"stop_reason": "tool_use"}}),
                        sse({"type": "message_stop"})])
    t = time.process_time()
    got, _ = await ask(port, "anthropic", stream=True, timeout_s=30)
    assert not isinstance(got, ModelError), got
    assert got.tool_calls[0].arguments == {"k": 1}
    assert time.process_time() - t < 10  # CPU; quadratic was minutes


async def test_a_text_delta_that_is_not_text_is_never_handed_on(
        server: tuple[RawServer, int]) -> None:
    raw, port = server
    raw.reply = events([sse({"type": "message_start", "message": {"id": "m"}}),
                        sse({"type": "content_block_start", "index": 0,
                             "content_block": {"type": "text", "text": ""}}),
                        sse({"type": "content_block_delta", "index": 0,
                             "delta": {"type": "text_delta", "text": ["not", "text"]}})])
    got, deltas = await ask(port, "anthropic", stream=True)
    assert isinstance(got, ModelError) and deltas == []


@pytest.mark.parametrize("provider", ["openai", "anthropic", "openai-responses"])
async def test_calls_that_repeat_an_id_or_have_none_get_ids_of_their_own(
        server: tuple[RawServer, int], provider: str) -> None:
    # Every API pairs each result with its call by id: a reply that repeats one would make
    # the next request one the provider refuses, for nothing the user did.
    raw, port = server
    ids = ["same", "same", "", "same"]
    if provider == "openai":
        raw.reply = body(chat({"content": None, "tool_calls": [
            {"id": i, "type": "function", "function": {"name": "a__b", "arguments": "{}"}}
            for i in ids]}))
    elif provider == "anthropic":
        raw.reply = body(json.dumps({
            "id": "msg_1", "type": "message", "role": "assistant", "model": "m",
            "stop_reason": "tool_use", "usage": {"input_tokens": 1, "output_tokens": 1},
            "content": [{"type": "tool_use", "id": i, "name": "a__b", "input": {}}
                        for i in ids]}).encode())
    else:
        raw.reply = body(json.dumps({
            "id": "resp_1", "object": "response", "status": "completed", "model": "m",
            "usage": {"input_tokens": 1, "output_tokens": 1},
            "output": [{"type": "function_call", "id": f"fc_{n // 2}", "call_id": i,
                        "name": "a__b", "arguments": "{}"} for n, i in enumerate(ids)]
        }).encode())
    got, _ = await ask(port, provider)
    assert not isinstance(got, ModelError), got
    first = [c.id for c in got.tool_calls]
    assert len(first) == 4 and len(set(first)) == 4 and all(first)
    assert first[0] == "same"  # the first of an id keeps it
    if provider == "openai-responses":  # a repeated item id is left out, never sent twice
        assert [c.extra.get("id") for c in got.tool_calls] == ["fc_0", None, "fc_1", None]
    # Deterministic: the same reply gives the same ids (replay never asks again, but a
    # reply read twice must not differ).
    again, _ = await ask(port, provider)
    assert [c.id for c in again.tool_calls] == first


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
async def test_call_ids_no_api_takes_back_get_ids_of_their_own(
        server: tuple[RawServer, int], provider: str) -> None:
    # Found by the planner fuzzer: an id with a space, a control or a bidi character was
    # sent back as it came, and Anthropic refuses a `tool_use.id` outside [a-zA-Z0-9_-]
    # (400): the turn failed `model_error` for what a server sent.
    raw, port = server
    ids = ["toolu_01A-b_9", "id with spaces", "\u202eid", "a\u0000b", "call.1"]
    if provider == "openai":
        raw.reply = body(chat({"content": None, "tool_calls": [
            {"id": i, "type": "function", "function": {"name": "a__b", "arguments": "{}"}}
            for i in ids]}))
    else:
        raw.reply = body(json.dumps({
            "id": "msg_1", "type": "message", "role": "assistant", "model": "m",
            "stop_reason": "tool_use", "usage": {"input_tokens": 1, "output_tokens": 1},
            "content": [{"type": "tool_use", "id": i, "name": "a__b", "input": {}}
                        for i in ids]}).encode())
    got, _ = await ask(port, provider)
    assert not isinstance(got, ModelError), got
    sent = [c.id for c in got.tool_calls]
    assert sent[0] == ids[0]  # an id every API takes keeps it
    assert all(re.fullmatch(r"[a-zA-Z0-9_-]+", i) for i in sent), sent
    assert len(set(sent)) == len(ids)
    again, _ = await ask(port, provider)
    assert [c.id for c in again.tool_calls] == sent


def chat_stream(pieces: list[str]) -> Reply:
    """An OpenAI chat stream whose text comes in `pieces`, then its end."""
    head = {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": "m"}
    return events([sse({**head, "choices": [{"index": 0, "delta": {"content": p},
                                             "finish_reason": None}]}) for p in pieces]
                  + [sse({**head, "choices": [{"index": 0, "delta": {},
                                               "finish_reason": "stop"}]}),
                     b"data: [DONE]\n\n"])


async def test_a_key_the_server_streams_back_is_never_shown_nor_stored(
        server: tuple[RawServer, int]) -> None:
    # One character at a time, after some text: nothing of it reaches the watchers.
    raw, port = server
    raw.reply = chat_stream(["Your key is ", *KEY, " ok"])
    got, deltas = await ask(port, stream=True)
    assert isinstance(got, ModelError) and "quotes the API key" in got.message, got
    shown = "".join(deltas)
    assert shown == "Your key is " and KEY[:2] not in shown


@pytest.mark.parametrize("hidden", ["\u200b", "\u200d", "\u034f", "\ufe0f", "\u3164", "\x01",
                                    "\u2028", "\u0600", "\ufff9"])
async def test_a_key_with_invisible_characters_inside_is_still_the_key(
        server: tuple[RawServer, int], hidden: str) -> None:
    raw, port = server
    split = hidden.join([KEY[:5], KEY[5:12], KEY[12:]])
    raw.reply = chat_stream(["Here: ", *split])
    got, deltas = await ask(port, stream=True)
    assert isinstance(got, ModelError) and "quotes the API key" in got.message, got
    assert "".join(deltas) == "Here: "
    for reply in (chat({"content": f"Here: {split}"}), chat({"content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {
                "name": "a__b", "arguments": json.dumps({"k": split})}}]})):
        raw.reply = body(reply)
        got, _ = await ask(port)
        assert isinstance(got, ModelError) and "quotes the API key" in got.message, got
    error_body = json.dumps({"error": {"message": f"bad key {split}"}}).encode()
    assert KEY[5:12] not in http_error("openai", 401, httpx.Headers(), error_body,
                                       KEY).message


async def test_text_that_only_looks_like_the_start_of_the_key_is_shown_whole(
        server: tuple[RawServer, int]) -> None:
    raw, port = server
    # Prefixes of the key, and an emoji whose joiner must reach the watchers intact.
    text = ["ask ", "sk-", "hostile", " questions, s", "\u200dk-ho", " 👨\u200d👩\u200d👧"]
    raw.reply = chat_stream(text)
    got, deltas = await ask(port, stream=True)
    assert not isinstance(got, ModelError), got
    assert "".join(deltas) == "".join(text) == got.text


@pytest.mark.parametrize("reply", [
    chat({"content": "", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "a__b", "arguments": json.dumps({"note": f"use {KEY}"})}}]}),
    chat({"content": f"the key: {KEY}"}),
])
async def test_a_reply_that_quotes_the_key_is_refused(
        server: tuple[RawServer, int], reply: bytes) -> None:
    raw, port = server
    raw.reply = body(reply)
    got, _ = await ask(port)
    assert isinstance(got, ModelError) and got.kind == "unavailable" and got.retryable
    assert "quotes the API key" in got.message and KEY not in got.message


async def test_a_key_split_by_an_invisible_character_in_an_error_is_still_redacted(
        server: tuple[RawServer, int]) -> None:
    # clip() strips invisible characters: were that done after the redaction, the key
    # would come out whole. Each error is built redacted (`http_error` here), and
    # `complete` checks the message once more on its way out.
    raw, port = server
    split = KEY[:6] + "\u200b" + KEY[6:]
    error_body = json.dumps({"error": {"message": f"bad key {split}"}}).encode()
    built = http_error("openai", 401, httpx.Headers(), error_body, KEY)
    assert KEY not in built.message and "[redacted]" in built.message, built.message
    raw.reply = body(error_body, status=401)
    got, _ = await ask(port)
    assert isinstance(got, ModelError) and got.status == 401, got
    assert KEY not in got.message and KEY[6:] not in got.message, got.message


async def test_a_key_split_by_a_space_or_cut_in_an_error_shows_none_of_its_pieces(
        server: tuple[RawServer, int]) -> None:
    # Exact matches left most of it: "bad key [redacted] ETVALUE-0123456789abcdef" for a
    # key echoed with a space in it. Any 8 characters of it in a row are taken out now.
    raw, port = server
    error_body = json.dumps({"error": {"message": (
        f"bad key {KEY[:9]} {KEY[9:]}, or was it ...{KEY[-10:]}? "
        "see https://platform.example.com/docs")}}).encode()
    raw.reply = body(error_body, status=401)
    got, _ = await ask(port)
    assert isinstance(got, ModelError) and got.status == 401, got
    message = got.message
    assert not any(KEY[i:i + 8] in message for i in range(len(KEY) - 7)), message
    assert message.count("[redacted]") == 3 and "platform.example.com/docs" in message


async def test_a_streamed_error_event_quoting_a_piece_of_the_key_shows_none_of_it(
        server: tuple[RawServer, int]) -> None:
    # A cut key in an error event of a stream (a 200 whose events say what went wrong)
    # came out as sent, in the error logged at each retry and stored in `turn.failed`:
    # only the whole key, or one shaped like OpenAI's or Google's, was taken out there.
    raw, port = server
    key = "tok_9f8e7d6c5b4a3f2e1d0c9b8a7z"
    event = {"error": {"message": f"Invalid API key {key[:16]}...", "type": "server_error"}}
    raw.reply = events([f"data: {json.dumps(event)}\n\n".encode()])
    settings = ModelSettings(provider="openai", model="m", api_key=key, max_retries=0,
                             timeout_s=5.0, base_url=f"http://127.0.0.1:{port}")

    async def on_delta(text: str) -> None:
        pass

    with pytest.raises(ModelError) as caught:
        await complete(settings, system=None, messages=[Message(role="user", text="hi")],
                       tools=[], on_delta=on_delta)
    message = caught.value.message
    assert not any(key[i:i + 8] in message for i in range(len(key) - 7)), message
    assert "[redacted]" in message, message


def test_a_placeholder_key_takes_no_words_out_of_errors_nor_costs_time_repeating_itself(
        ) -> None:
    # llama.cpp's documented placeholder: its pieces are words ("required").
    assert redact("'messages' is required; Field required", "sk-no-key-required") == \
        "'messages' is required; Field required"
    # A key repeating itself searched a body once per repeat: 9.5 s on the event loop
    # for 64 KiB. Each distinct piece is searched once.
    started = time.monotonic()
    assert redact("ab1" * 20_000, "sk-" + "ab1" * 60) == "[redacted]"
    assert time.monotonic() - started < 2


async def test_a_placeholder_key_a_local_server_ignores_does_not_censor_the_answer(
        server: tuple[RawServer, int]) -> None:
    raw, port = server
    raw.reply = chat_stream(["Run it with ", "ollama", "."])
    settings = ModelSettings(provider="openai", model="m", api_key="ollama", max_retries=0,
                             base_url=f"http://127.0.0.1:{port}")
    shown: list[str] = []

    async def on_delta(text: str) -> None:
        shown.append(text)

    got = await complete(settings, system=None, messages=[Message(role="user", text="hi")],
                         tools=[], on_delta=on_delta)
    assert got.text == "".join(shown) == "Run it with ollama."


def test_a_key_is_redacted_as_libraries_quote_it_escaped() -> None:
    # httpx refuses a header value with a line break, quoting it as bytes: b'Bearer ...'.
    key = "sk-NL\nSECRET-9"
    quoted = f"LocalProtocolError: Illegal header value {('Bearer ' + key).encode()!r}"
    assert "SECRET" in quoted and "SECRET" not in redact(quoted, key)
    assert "SECRET" not in redact(f"{key!r}", key) and "SECRET" not in redact(key, key)


@pytest.mark.parametrize("provider", ["openai", "openai-responses", "anthropic", "gemini"])
async def test_a_long_error_message_without_spaces_costs_linear_time(
        server: tuple[RawServer, int], provider: str) -> None:
    # The masked-key pattern (`\S*\*{4,}\S*`) was tried from every character of a word:
    # 64 KiB of error body without a space held the planner's event loop (every session)
    # 20 s per attempt, and a 1 MiB message in an error event for over an hour.
    raw, port = server
    raw.reply = body(b"x" * transport.ERROR_BODY_LIMIT, status=500, ctype="text/plain")
    t = time.process_time()
    got, _ = await ask(port, provider)
    assert isinstance(got, ModelError) and got.status == 500, got
    error = {"message": "y" * 1_000_000, "type": "server_error"}
    event = {"openai": {"error": error},
             "openai-responses": {"type": "error", "code": "server_error",
                                  "message": error["message"]},
             "anthropic": {"type": "error", "error": error}, "gemini": {"error": error}}
    raw.reply = events([sse(event[provider])])
    got, _ = await ask(port, provider, stream=True)
    assert isinstance(got, ModelError) and got.message.startswith("yyy"), got
    assert time.process_time() - t < 3  # CPU; quadratic was hours
    assert redact("ok sk-proj-****abcd and x****y", None) == "ok [redacted] and [redacted]"


@pytest.mark.parametrize("usage", [{"a": "12", "b": 3}, {"a": [1], "b": [2]}, {"a": 2**80, "b": -1},
                                   {"a": 1.5, "b": None}, "lots", [1, 2]],
                         ids=["string", "lists", "huge-negative", "float-null", "text", "list"])
@pytest.mark.parametrize("provider", ["openai", "openai-responses", "anthropic", "gemini"])
async def test_token_counts_that_are_not_counts_count_as_none_in_every_api(
        server: tuple[RawServer, int], provider: str, usage: Any) -> None:
    # Anthropic's and Gemini's input or output are sums of two counts: a count given as
    # text ("12" + 3) refused the whole reply as not in the API's shape, and the turn
    # ended `model_error` after every retry.
    def spelt(names: tuple[str, str]) -> Any:
        return {names[0]: usage["a"], names[1]: usage["b"]} if isinstance(usage, dict) \
            else usage
    reply = {
        "openai": {"id": "c", "choices": [{"index": 0, "message": {"content": "fine"},
                                           "finish_reason": "stop"}],
                   "usage": spelt(("prompt_tokens", "completion_tokens"))},
        "openai-responses": {"id": "r", "status": "completed", "output": [
            {"type": "message", "content": [{"type": "output_text", "text": "fine"}]}],
            "usage": spelt(("input_tokens", "output_tokens"))},
        "anthropic": {"id": "m", "type": "message", "stop_reason": "end_turn",
                      "content": [{"type": "text", "text": "fine"}],
                      "usage": {"output_tokens": 2, **spelt(
                          ("input_tokens", "cache_read_input_tokens"))}
                      if isinstance(usage, dict) else usage},
        "gemini": {"candidates": [{"content": {"parts": [{"text": "fine"}]},
                                   "finishReason": "STOP"}],
                   "usageMetadata": {"promptTokenCount": 2, **spelt(
                       ("candidatesTokenCount", "thoughtsTokenCount"))}
                   if isinstance(usage, dict) else usage},
    }[provider]
    raw, port = server
    raw.reply = body(json.dumps(reply).encode())
    got, _ = await ask(port, provider)
    assert not isinstance(got, ModelError), got
    assert got.text == "fine"
    counts = (got.usage.input_tokens, got.usage.output_tokens)
    assert all(isinstance(n, int) and 0 <= n < 2**53 for n in counts), counts


@pytest.mark.parametrize(("provider", "reply", "words"), [
    ("gemini", {"promptFeedback": {"blockReason": "SAFETY"}},
     "the provider's content filter stopped it (SAFETY)"),
    ("gemini", {"candidates": [{"finishReason": "RECITATION", "index": 0}]},
     "the provider's content filter stopped it (RECITATION)"),
    ("anthropic", {"id": "m", "type": "message", "content": [], "stop_reason": "refusal"},
     "the provider's content filter stopped it (refusal)"),
    ("gemini", {"candidates": [{"content": {"role": "model"}, "finishReason": "MAX_TOKENS"}]},
     "the model reached its token limit (MAX_TOKENS) before any text or call"),
    ("openai-responses", {"id": "r", "status": "incomplete", "output": [],
                          "incomplete_details": {"reason": "max_output_tokens"}},
     "the model reached its token limit (max_output_tokens) before any text or call"),
])
async def test_an_empty_reply_the_provider_cut_short_is_a_model_error_saying_why(
        server: tuple[RawServer, int], provider: str, reply: Any, words: str) -> None:
    # Neither text nor a call: the turn completed with an empty answer, and nothing told
    # the user that a filter or the token limit had stopped the model.
    raw, port = server
    raw.reply = body(json.dumps(reply).encode())
    got, _ = await ask(port, provider)
    assert isinstance(got, ModelError) and got.kind == "bad_request", got
    assert words in got.message and not got.retryable


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("provider", ["openai", "openai-responses"])
async def test_an_openai_refusal_is_the_answer(server: tuple[RawServer, int], provider: str,
                                               stream: bool) -> None:
    # The model's refusal is in its own field, `content` null: the turn completed with an
    # empty answer and the refusal was nowhere.
    said = "I'm sorry, I can't help with that."
    raw, port = server
    if provider == "openai" and not stream:
        raw.reply = body(chat({"content": None, "refusal": said}))
    elif provider == "openai":
        raw.reply = events([sse({"id": "c", "choices": [{"index": 0, "delta": {
            "refusal": piece}}]}) for piece in (said[:9], said[9:])] + [sse(
                {"id": "c", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
                b"data: [DONE]\n\n"])
    else:
        final = {"id": "r", "status": "completed", "output": [{"type": "message", "content": [
            {"type": "refusal", "refusal": said}]}]}
        raw.reply = body(json.dumps(final).encode()) if not stream else events([
            sse({"type": "response.refusal.delta", "output_index": 0, "content_index": 0,
                 "delta": piece}) for piece in (said[:9], said[9:])] + [
            sse({"type": "response.completed", "response": final})])
    got, deltas = await ask(port, provider, stream=stream)
    assert not isinstance(got, ModelError), got
    assert got.text == said and got.tool_calls == []
    if stream:
        assert "".join(deltas) == said


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("provider", ["openai", "openai-responses", "anthropic", "gemini"])
async def test_a_server_silent_after_its_headers_ends_the_attempt_saying_how_long(
        server: tuple[RawServer, int], provider: str, stream: bool) -> None:
    # The error said only "ReadTimeout": not what was waited for, nor which setting.
    raw, port = server
    raw.reply = events([b""], every_s=30) if stream else body(b"{}", every_s=30)
    got, _ = await ask(port, provider, stream=stream, timeout_s=0.3)
    assert isinstance(got, ModelError) and got.kind == "unavailable" and got.retryable, got
    assert "the model server sent nothing for 0.3 s (timeout_s)" in got.message, got


@pytest.mark.parametrize(("provider", "stream", "reply"), [
    ("openai", True, events([sse({"id": "c", "choices": [], "usage": {"prompt_tokens": 3}}),
                             b"data: [DONE]\n\n"])),
    ("openai", False, body(json.dumps({"id": "c", "choices": [{"message": None}]}).encode())),
    ("gemini", False, body(json.dumps({"candidates": [], "responseId": "r"}).encode())),
    ("anthropic", False, body(json.dumps({"id": "m", "type": "message",
                                          "content": []}).encode())),
], ids=["chat-usage-only-stream", "chat-null-message", "gemini-no-candidates",
        "anthropic-no-stop-reason"])
async def test_an_empty_reply_with_no_finish_reason_is_asked_again(
        server: tuple[RawServer, int], provider: str, stream: bool, reply: Reply) -> None:
    # Nothing said and no reason given (a stream of only its usage, then [DONE]): the turn
    # completed with an empty answer.
    raw, port = server
    raw.reply = reply
    got, _ = await ask(port, provider, stream=stream)
    assert isinstance(got, ModelError) and got.kind == "unavailable" and got.retryable, got
    assert "the reply is empty, with no finish reason" in got.message


@pytest.mark.parametrize(("provider", "reply"), [
    ("openai", {"id": "c", "choices": [{"index": 0, "finish_reason": "length", "message": {
        "content": None, "tool_calls": [{"id": "k1", "type": "function", "function": {
            "name": "fs__delete", "arguments": '{"path": "/data/old'}}]}}]}),
    ("openai-responses", {"id": "r", "status": "incomplete",
                          "incomplete_details": {"reason": "max_output_tokens"}, "output": [
                              {"type": "function_call", "call_id": "k1", "id": "fc_1",
                               "name": "fs__delete", "arguments": '{"path": "/data/old'}]}),
    # Anthropic hands over the cut input as an object: run, it would delete /data.
    ("anthropic", {"id": "m", "type": "message", "stop_reason": "max_tokens", "content": [
        {"type": "tool_use", "id": "k1", "name": "fs__delete", "input": {"path": "/data"}}]}),
    ("gemini", {"candidates": [{"finishReason": "MAX_TOKENS", "content": {"parts": [
        {"functionCall": {"name": "fs__delete", "args": {"path": "/data"}}}]}}]}),
])
async def test_tool_calls_the_token_limit_cut_short_are_not_run(
        server: tuple[RawServer, int], provider: str, reply: Any) -> None:
    raw, port = server
    raw.reply = body(json.dumps(reply).encode())
    got, _ = await ask(port, provider)
    assert isinstance(got, ModelError) and got.kind == "bad_request", got
    assert "token limit" in got.message and "none of the 1 ran" in got.message, got
    assert "max_tokens" in got.message and not got.retryable
