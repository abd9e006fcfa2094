"""Review findings on the SSE reader (actors/llm/transport.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from actors.llm.transport import ModelClient, _events
from schemas.errors import ModelError
from tests.actors.llm.test_hostile_provider import RawServer, ask, events, server, sse

__all__ = ["server"]


def chunk(choice: dict[str, Any], **top: Any) -> bytes:
    return sse({"id": "c1", "model": "m", "choices": [choice] if choice else [], **top})


async def test_chat_usage_after_a_pause_past_the_finish_is_still_read(
        server: tuple[RawServer, int]) -> None:
    # Chat Completions has a last event ([DONE]); the usage chunk comes after the one with
    # finish_reason. A pause over 1 s between them must not drop the usage.
    raw, port = server

    async def reply(w: asyncio.StreamWriter) -> None:
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"connection: close\r\n\r\n")
        w.write(chunk({"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}))
        await w.drain()
        await asyncio.sleep(1.5)
        w.write(chunk({}, usage={"prompt_tokens": 7, "completion_tokens": 3}))
        w.write(b"data: [DONE]\n\n")
        await w.drain()

    raw.reply = reply
    got, _ = await ask(port, "openai", stream=True, timeout_s=5)
    assert not isinstance(got, ModelError), got
    assert got.text == "hi"
    assert got.usage.input_tokens == 7 and got.usage.output_tokens == 3


def _spec_events(body: bytes) -> list[tuple[str, str]]:
    """The SSE spec's interpretation, written plainly, as the reference."""
    text = body.decode("utf-8", errors="replace")
    if text.startswith("\ufeff"):
        text = text[1:]
    lines, i, start = [], 0, 0
    while i < len(text):
        c = text[i]
        if c in "\r\n":
            lines.append(text[start:i])
            if c == "\r" and i + 1 < len(text) and text[i + 1] == "\n":
                i += 1
            start = i + 1
        i += 1
    out, name, data = [], "", ""
    for line in lines:
        if not line:
            if data:
                out.append((name, data.removesuffix("\n")))
            name, data = "", ""
            continue
        if line.startswith(":"):
            continue
        field, colon, value = line.partition(":")
        value = value.removeprefix(" ") if colon else ""
        if field == "event":
            name = value
        elif field == "data":
            data += value + "\n"
    return out


async def _read(port: int) -> list[tuple[str, str]]:
    async with ModelClient() as client, client.session.get(
            f"http://127.0.0.1:{port}/") as response:
        return [e async for e in _events(response, "openai", 5.0)]


BODY = ("data: a\r\n\r\nevent: x\rdata: é€😀\r\rid: 7\n\ndata\n\n: c\ndata:  sp\r\n"
        "data: two\r\n\r\nretry: 5\n\nevent: y\ndata: z\n\n").encode()


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7])
async def test_events_split_anywhere_read_as_the_spec_says(
        server: tuple[RawServer, int], size: int) -> None:
    raw, port = server
    raw.reply = events([BODY[i:i + size] for i in range(0, len(BODY), size)], every_s=0.002)
    assert await _read(port) == _spec_events(BODY)


async def test_a_leading_bom_is_not_part_of_the_first_field(
        server: tuple[RawServer, int]) -> None:
    raw, port = server
    body = b"\xef\xbb\xbfdata: first\n\ndata: second\n\n"
    raw.reply = events([body])
    assert await _read(port) == [("", "first"), ("", "second")]
